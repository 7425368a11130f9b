// SPDX-License-Identifier: Apache-2.0

package kube

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"

	"golang.org/x/sys/unix"
)

// The kubelet's pods cgroup: the parent of every pod's cgroup, named by the
// cgroup driver (systemd: kubepods.slice, cgroupfs: kubepods) under the
// kubelet's cgroupRoot (default /).
var podsCgroupNames = []string{"kubepods.slice", "kubepods"}

// PodsCgroup finds the kubelet's pods cgroup in the node's cgroup tree mounted
// at root (the chart mounts the node's /sys/fs/cgroup at /host/sys/fs/cgroup)
// and returns its cgroup v2 directory. The v2 hierarchy is root itself
// (unified layout) or root/unified (hybrid layout: v1 controllers at
// /sys/fs/cgroup, v2 at /sys/fs/cgroup/unified). The agent's own cgroup
// names the pods cgroup when the pod shares the node's cgroup namespace (the
// runtime's default on v1 and hybrid nodes), including a kubelet cgroupRoot;
// otherwise the driver's names are looked up under the v2 root.
func PodsCgroup(root string) (string, error) {
	v2, err := cgroup2Under(root)
	if err != nil {
		return "", err
	}
	if f, err := os.Open("/proc/self/cgroup"); err == nil {
		own, _ := ownCgroup2(f)
		f.Close()
		if dir := podsCgroupOf(own); dir != "" {
			if p := filepath.Join(v2, dir); isDir(p) {
				return p, nil
			}
		}
	}
	for _, name := range podsCgroupNames {
		if p := filepath.Join(v2, name); isDir(p) {
			return p, nil
		}
	}
	return "", fmt.Errorf("the kubelet's pods cgroup is not under %s (looked for %s, and in the agent's own cgroup): set the chart's cgroupPath to the node's cgroup v2 directory of the pods",
		v2, strings.Join(podsCgroupNames, ", "))
}

func isDir(p string) bool {
	st, err := os.Stat(p)
	return err == nil && st.IsDir()
}

// cgroup2Under returns root when it is a cgroup v2 mount, else root/unified
// when that is one.
func cgroup2Under(root string) (string, error) {
	for _, p := range []string{root, filepath.Join(root, "unified")} {
		var st unix.Statfs_t
		if err := unix.Statfs(p, &st); err == nil && st.Type == unix.CGROUP2_SUPER_MAGIC {
			return p, nil
		}
	}
	return "", fmt.Errorf("no cgroup v2 hierarchy at %s or %s/unified: mount the node's /sys/fs/cgroup there", root, root)
}

// ownCgroup2 returns the cgroup v2 path in /proc/self/cgroup format ("0::/a/b").
func ownCgroup2(r io.Reader) (string, error) {
	sc := bufio.NewScanner(r)
	for sc.Scan() {
		if p, ok := strings.CutPrefix(sc.Text(), "0::"); ok {
			return p, nil
		}
	}
	if err := sc.Err(); err != nil {
		return "", err
	}
	return "", errors.New("no cgroup v2 entry")
}

// podsCgroupOf cuts a pod's cgroup path after its pods cgroup:
// /meshwarp-cluster/kubepods/burstable/pod1/c1 -> /meshwarp-cluster/kubepods.
func podsCgroupOf(p string) string {
	parts := strings.Split(p, "/")
	for i, s := range parts {
		for _, name := range podsCgroupNames {
			if s == name {
				return strings.Join(parts[:i+1], "/")
			}
		}
	}
	return ""
}
