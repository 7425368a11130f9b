// SPDX-License-Identifier: Apache-2.0

package lab

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"sort"
	"strings"
	"syscall"

	"golang.org/x/sys/unix"
)

// netnsDir is where `ip netns` keeps its named namespaces.
const netnsDir = "/run/netns"

// runner runs the external tools the lab is built with.
type runner struct {
	logger *slog.Logger
}

// run runs a tool and returns its stdout; the error carries stderr.
func (r *runner) run(ctx context.Context, stdin string, name string, args ...string) (string, error) {
	cmd := exec.CommandContext(ctx, name, args...)
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if stdin != "" {
		cmd.Stdin = strings.NewReader(stdin)
	}
	err := cmd.Run()
	r.logger.Debug("exec", "cmd", name+" "+strings.Join(args, " "), "err", err)
	if err != nil {
		msg := strings.TrimSpace(stderr.String())
		if msg == "" {
			msg = strings.TrimSpace(stdout.String())
		}
		return stdout.String(), &toolError{cmd: name + " " + strings.Join(args, " "), msg: msg, err: err}
	}
	return stdout.String(), nil
}

type toolError struct {
	cmd, msg string
	err      error
}

func (e *toolError) Error() string {
	if e.msg == "" {
		return fmt.Sprintf("%s: %v", e.cmd, e.err)
	}
	return fmt.Sprintf("%s: %v: %s", e.cmd, e.err, e.msg)
}
func (e *toolError) Unwrap() error { return e.err }

// isExit reports whether err is a tool that exited with code.
func isExit(err error, code int) bool {
	var ee *exec.ExitError
	return errors.As(err, &ee) && ee.ExitCode() == code
}

func (r *runner) ip(ctx context.Context, args ...string) (string, error) {
	return r.run(ctx, "", "ip", args...)
}

// inNetns runs a tool inside a named network namespace.
func (r *runner) inNetns(ctx context.Context, netns, name string, args ...string) (string, error) {
	return r.run(ctx, "", "ip", append([]string{"netns", "exec", netns, name}, args...)...)
}

func (r *runner) inNetnsStdin(ctx context.Context, netns, stdin, name string, args ...string) (string, error) {
	return r.run(ctx, stdin, "ip", append([]string{"netns", "exec", netns, name}, args...)...)
}

func netnsPath(name string) string { return filepath.Join(netnsDir, name) }

func netnsExists(name string) bool {
	var st unix.Statfs_t
	// A name under /run/netns that is not an nsfs mount is the debris of a
	// failed `ip netns add`; treat it as absent so add/del repair it.
	if err := unix.Statfs(netnsPath(name), &st); err != nil {
		return false
	}
	return st.Type == unix.NSFS_MAGIC
}

// labNetnsOnDisk lists the lab's namespaces that exist, found by name (not
// from the state file): pods in index order, then the nodes in index order.
func labNetnsOnDisk() []string {
	entries, err := os.ReadDir(netnsDir)
	if err != nil {
		return nil
	}
	var pods, nodes []string
	for _, e := range entries {
		if _, ok := nodeIndexFromNetns(e.Name()); ok {
			nodes = append(nodes, e.Name())
		} else if isLabNetns(e.Name()) {
			pods = append(pods, e.Name())
		}
	}
	sortByIndex := func(names []string, index func(string) (int, bool)) {
		sort.Slice(names, func(i, j int) bool {
			a, _ := index(names[i])
			b, _ := index(names[j])
			return a < b
		})
	}
	sortByIndex(pods, podIndexFromNetns)
	sortByIndex(nodes, nodeIndexFromNetns)
	return append(pods, nodes...)
}

func (r *runner) ensureNetns(ctx context.Context, name string) error {
	if netnsExists(name) {
		return nil
	}
	if _, err := os.Stat(netnsPath(name)); err == nil {
		// debris of an interrupted add: let ip remove it first
		_, _ = r.ip(ctx, "netns", "del", name)
	}
	if _, err := r.ip(ctx, "netns", "add", name); err != nil {
		return fmt.Errorf("create netns %s: %w", name, err)
	}
	if _, err := r.ip(ctx, "-n", name, "link", "set", "lo", "up"); err != nil {
		return fmt.Errorf("bring lo up in %s: %w", name, err)
	}
	return nil
}

func (r *runner) linkExists(ctx context.Context, netns, link string) bool {
	_, err := r.ip(ctx, "-n", netns, "link", "show", "dev", link)
	return err == nil
}

// labLinks lists the links named mw-* in a namespace.
func (r *runner) labLinks(ctx context.Context, netns string) ([]string, error) {
	out, err := r.ip(ctx, "-n", netns, "-o", "link", "show")
	if err != nil {
		return nil, err
	}
	var links []string
	for _, line := range strings.Split(out, "\n") {
		// "5: mw-p0-br@if4: <BROADCAST,...> ..."
		f := strings.Fields(line)
		if len(f) < 2 {
			continue
		}
		name := strings.TrimSuffix(f[1], ":")
		if i := strings.IndexByte(name, '@'); i >= 0 {
			name = name[:i]
		}
		if strings.HasPrefix(name, "mw-") {
			links = append(links, name)
		}
	}
	return links, nil
}

// nsInode identifies a network namespace: (device, inode) of its nsfs file.
type nsInode struct{ dev, ino uint64 }

func statNs(path string) (nsInode, bool) {
	var st syscall.Stat_t
	if err := syscall.Stat(path, &st); err != nil {
		return nsInode{}, false
	}
	return nsInode{dev: uint64(st.Dev), ino: st.Ino}, true
}

// dialIn opens a TCP connection from inside a named network namespace. The
// socket is created on a dedicated OS thread that has joined the namespace;
// the thread is never returned to the scheduler (it exits with the goroutine),
// so no other goroutine ever runs in the pod's namespace. The connection
// itself works from any thread once created.
//
// The socket is owned by the calling process (root, outside the lab cgroup):
// fine for health checks and tests, not for measurements (use Lab.Command).
func dialIn(ctx context.Context, netns, network, address string) (net.Conn, error) {
	type result struct {
		c   net.Conn
		err error
	}
	ch := make(chan result, 1)
	go func() {
		runtime.LockOSThread()
		// No UnlockOSThread: the thread dies with this goroutine.
		fd, err := unix.Open(netnsPath(netns), unix.O_RDONLY|unix.O_CLOEXEC, 0)
		if err != nil {
			ch <- result{err: fmt.Errorf("open netns %s: %w", netns, err)}
			return
		}
		err = unix.Setns(fd, unix.CLONE_NEWNET)
		unix.Close(fd)
		if err != nil {
			ch <- result{err: fmt.Errorf("enter netns %s: %w", netns, err)}
			return
		}
		var d net.Dialer
		c, err := d.DialContext(ctx, network, address)
		ch <- result{c, err}
	}()
	r := <-ch
	return r.c, r.err
}

// writeSysctlIn sets a sysctl (key as a path under /proc/sys, e.g.
// "net/ipv4/ip_forward") inside a named network namespace, from a
// dedicated OS thread that joined it (net sysctls are per namespace, read
// through the opening thread's namespace); the thread dies with it.
func writeSysctlIn(netns, key, value string) error {
	errc := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		// No UnlockOSThread: the thread dies with this goroutine.
		fd, err := unix.Open(netnsPath(netns), unix.O_RDONLY|unix.O_CLOEXEC, 0)
		if err != nil {
			errc <- fmt.Errorf("open netns %s: %w", netns, err)
			return
		}
		err = unix.Setns(fd, unix.CLONE_NEWNET)
		unix.Close(fd)
		if err != nil {
			errc <- fmt.Errorf("enter netns %s: %w", netns, err)
			return
		}
		if err := os.WriteFile(filepath.Join("/proc/sys", key), []byte(value), 0); err != nil {
			errc <- fmt.Errorf("set %s=%s in %s: %w", strings.ReplaceAll(key, "/", "."), value, netns, err)
			return
		}
		errc <- nil
	}()
	return <-errc
}
