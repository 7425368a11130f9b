// SPDX-License-Identifier: Apache-2.0

// Package netns identifies network namespaces by the cookie BPF programs see
// (bpf_get_netns_cookie, a device's nd_net cookie) and names them for users.
package netns

import (
	"fmt"
	"os"
	"path/filepath"
	"runtime"

	"golang.org/x/sys/unix"
)

// NamedDir is where `ip netns add` names namespaces.
const NamedDir = "/run/netns"

// CurrentCookie returns the cookie of the calling thread's network namespace.
func CurrentCookie() (uint64, error) {
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return 0, err
	}
	defer unix.Close(fd)
	c, err := unix.GetsockoptUint64(fd, unix.SOL_SOCKET, unix.SO_NETNS_COOKIE)
	if err != nil {
		return 0, fmt.Errorf("read the network namespace cookie (SO_NETNS_COOKIE, Linux >= 5.14): %w", err)
	}
	return c, nil
}

// Cookie returns the cookie of the network namespace at path.
func Cookie(path string) (uint64, error) {
	ns, err := os.Open(path)
	if err != nil {
		return 0, fmt.Errorf("network namespace %s: %w", path, err)
	}
	defer ns.Close()
	type result struct {
		cookie uint64
		err    error
	}
	ch := make(chan result, 1)
	go func() {
		// The thread changes namespace; never unlocking it makes the runtime
		// discard it afterwards.
		runtime.LockOSThread()
		if err := unix.Setns(int(ns.Fd()), unix.CLONE_NEWNET); err != nil {
			ch <- result{err: fmt.Errorf("enter %s: %w", path, err)}
			return
		}
		c, err := CurrentCookie()
		ch <- result{c, err}
	}()
	r := <-ch
	return r.cookie, r.err
}

// Names maps cookies to names: the caller's namespace is "host" (the agent
// runs in the node's), and each namespace named in /run/netns by its name.
// Namespaces it cannot enter are left out.
func Names() map[uint64]string {
	out := map[uint64]string{}
	if c, err := CurrentCookie(); err == nil {
		out[c] = "host"
	}
	entries, _ := os.ReadDir(NamedDir)
	for _, e := range entries {
		if c, err := Cookie(filepath.Join(NamedDir, e.Name())); err == nil {
			if _, taken := out[c]; !taken {
				out[c] = e.Name()
			}
		}
	}
	return out
}
