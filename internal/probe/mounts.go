// SPDX-License-Identifier: Apache-2.0

package probe

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"os"
	"strings"
)

// ErrNoCgroup2 means no cgroup v2 hierarchy is mounted.
var ErrNoCgroup2 = errors.New("cgroup v2 is not mounted: " + fixCgroup2)

// errNoBPFFS means no bpf filesystem is mounted anywhere.
var errNoBPFFS = errors.New("bpffs is not mounted: " + fixBPFFS)

const (
	fixCgroup2 = "mount -t cgroup2 none /sys/fs/cgroup/unified (or boot with systemd.unified_cgroup_hierarchy=1)"
	fixBPFFS   = "mount -t bpf bpf /sys/fs/bpf"
)

// procMounts is read for every lookup; a variable so tests can point it
// elsewhere.
var procMounts = "/proc/mounts"

// Mount is one line of /proc/mounts.
type Mount struct {
	Source   string
	Point    string
	FSType   string
	Options  []string
	ReadOnly bool
}

// Cgroup2Root returns the mount point of the cgroup v2 hierarchy, read from
// /proc/mounts because it is not always /sys/fs/cgroup (hybrid hosts mount it
// at /sys/fs/cgroup/unified).
func Cgroup2Root() (string, error) {
	return findMount("cgroup2", ErrNoCgroup2)
}

// BPFFSRoot returns the first bpf filesystem mount point.
func BPFFSRoot() (string, error) {
	return findMount("bpf", errNoBPFFS)
}

func findMount(fstype string, notFound error) (string, error) {
	f, err := os.Open(procMounts)
	if err != nil {
		return "", fmt.Errorf("read %s: %w", procMounts, err)
	}
	defer f.Close()
	m, err := findMountIn(f, fstype)
	if err != nil {
		return "", fmt.Errorf("read %s: %w", procMounts, err)
	}
	if m == nil {
		return "", notFound
	}
	return m.Point, nil
}

// findMountIn returns the first mount of fstype in r (in /proc/mounts
// format), or nil when there is none.
func findMountIn(r io.Reader, fstype string) (*Mount, error) {
	mounts, err := ParseMounts(r)
	if err != nil {
		return nil, err
	}
	for i := range mounts {
		if mounts[i].FSType == fstype {
			return &mounts[i], nil
		}
	}
	return nil, nil
}

// ParseMounts parses /proc/mounts (fstab format: source, mount point, type,
// options, dump, pass). Octal escapes the kernel uses for spaces, tabs,
// newlines and backslashes in paths are decoded. Short lines are skipped.
func ParseMounts(r io.Reader) ([]Mount, error) {
	var mounts []Mount
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 0, 64*1024), 1024*1024)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) < 4 {
			continue
		}
		opts := strings.Split(fields[3], ",")
		m := Mount{
			Source:  unescapeMountField(fields[0]),
			Point:   unescapeMountField(fields[1]),
			FSType:  fields[2],
			Options: opts,
		}
		for _, o := range opts {
			if o == "ro" {
				m.ReadOnly = true
			}
		}
		mounts = append(mounts, m)
	}
	if err := sc.Err(); err != nil {
		return nil, err
	}
	return mounts, nil
}

// unescapeMountField decodes the \ooo octal escapes of /proc/mounts.
func unescapeMountField(s string) string {
	if !strings.Contains(s, `\`) {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] == '\\' && i+3 < len(s) && isOctal(s[i+1]) && isOctal(s[i+2]) && isOctal(s[i+3]) {
			b.WriteByte((s[i+1]-'0')<<6 | (s[i+2]-'0')<<3 | (s[i+3] - '0'))
			i += 3
			continue
		}
		b.WriteByte(s[i])
	}
	return b.String()
}

func isOctal(c byte) bool { return c >= '0' && c <= '7' }
