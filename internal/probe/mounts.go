// SPDX-License-Identifier: Apache-2.0

package probe

import (
	"bufio"
	"errors"
	"fmt"
	"os"
	"strings"
)

// ErrNoCgroup2 means no cgroup v2 hierarchy is mounted.
var ErrNoCgroup2 = errors.New("cgroup v2 is not mounted: mount -t cgroup2 none /sys/fs/cgroup/unified (or boot with systemd.unified_cgroup_hierarchy=1)")

// Cgroup2Root returns the mount point of the cgroup v2 hierarchy, read from
// /proc/mounts because it is not always /sys/fs/cgroup (hybrid hosts mount it
// at /sys/fs/cgroup/unified).
func Cgroup2Root() (string, error) {
	return findMount("cgroup2", ErrNoCgroup2)
}

// BPFFSRoot returns the first bpf filesystem mount point.
func BPFFSRoot() (string, error) {
	return findMount("bpf", errors.New("bpffs is not mounted: mount -t bpf bpf /sys/fs/bpf"))
}

func findMount(fstype string, notFound error) (string, error) {
	f, err := os.Open("/proc/mounts")
	if err != nil {
		return "", fmt.Errorf("read /proc/mounts: %w", err)
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) >= 3 && fields[2] == fstype {
			return fields[1], nil
		}
	}
	if err := sc.Err(); err != nil {
		return "", fmt.Errorf("read /proc/mounts: %w", err)
	}
	return "", notFound
}
