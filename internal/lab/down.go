// SPDX-License-Identifier: Apache-2.0

package lab

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"sort"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/meshwarp/meshwarp/internal/probe"
)

// lockName is an abstract unix socket (no file anywhere): holding it
// serialises Up, Down, SetCapture and RestartSidecars across processes, and
// the kernel releases it when the holder dies, so a crash never leaves a
// stale lock.
const lockName = "@meshwarp-lab.lock"

func lockLab() (unlock func(), err error) {
	var l *net.UnixListener
	err = poll(context.Background(), 2*time.Minute, 50*time.Millisecond, func() (bool, error) {
		var lerr error
		l, lerr = net.ListenUnix("unix", &net.UnixAddr{Name: lockName, Net: "unix"})
		if lerr == nil {
			return true, nil
		}
		if errors.Is(lerr, unix.EADDRINUSE) {
			return false, nil
		}
		return false, lerr
	})
	if err != nil {
		return nil, fmt.Errorf("lock the lab (another `meshwarp lab` command is running?): %w", err)
	}
	return func() { l.Close() }, nil
}

// Down removes everything the lab made: processes, iptables rules and chains,
// links, namespaces, the cgroup and /run/meshwarp-lab. It finds them by their
// names and pid files, not only through the state file, so it also cleans up
// after an Up that crashed half-way. Nothing without a lab name is touched
// (processes are killed only if they are in the lab cgroup or in a lab
// namespace). Down on a machine without a lab does nothing and succeeds.
func Down(ctx context.Context, logger *slog.Logger) error {
	if logger == nil {
		logger = slog.New(slog.NewTextHandler(io.Discard, nil))
	}
	logger = logger.With("subsys", "lab")
	if os.Geteuid() != 0 {
		return fmt.Errorf("%w: the lab needs root to be removed: run it as root, e.g. sudo meshwarp lab down", probe.ErrNotReady)
	}
	unlock, err := lockLab()
	if err != nil {
		return err
	}
	defer unlock()
	return downLocked(ctx, logger)
}

func downLocked(ctx context.Context, logger *slog.Logger) error {
	r := &runner{logger: logger}
	st, _ := readState() // may be absent or half-written after a crash
	cg, cgErr := cgroupPath()
	if st != nil && st.Cgroup != "" {
		cg = st.Cgroup
	} else if cgErr != nil {
		cg = ""
	}
	nss := labNetnsOnDisk()
	if len(nss) == 0 && st == nil && !exists(cg) && !exists(RunDir) {
		logger.Info("no lab found: nothing to remove")
		return nil
	}
	var errs []error

	// 1. Processes: pid files, the lab cgroup, and anything living in a lab
	// namespace. Each is ours by construction.
	var inodes []nsInode
	for _, ns := range nss {
		if ino, ok := statNs(netnsPath(ns)); ok {
			inodes = append(inodes, ino)
		}
	}
	pids := map[int]bool{}
	for _, pid := range pidFilePids(inodes) {
		pids[pid] = true
	}
	if cg != "" {
		for _, pid := range cgroupPids(cg) {
			pids[pid] = true
		}
	}
	for _, pid := range netnsPids(inodes) {
		pids[pid] = true
	}
	delete(pids, os.Getpid())
	list := make([]int, 0, len(pids))
	for p := range pids {
		list = append(list, p)
	}
	sort.Ints(list)
	if len(list) > 0 {
		logger.Info("stopping processes", "pids", list)
		if left := terminate(ctx, list, 3*time.Second); len(left) > 0 {
			errs = append(errs, fmt.Errorf("processes %v did not exit", left))
		}
	}

	// 2. iptables: deleting a namespace drops its rules, but remove them
	// explicitly so nothing depends on that.
	for _, ns := range nss {
		if _, isNode := nodeIndexFromNetns(ns); isNode || !netnsExists(ns) {
			continue
		}
		if err := r.removeCapture(ctx, ns); err != nil {
			errs = append(errs, err)
		}
	}

	// 3. Links in the node namespaces (veths and the wire first, then the
	// bridge), then the namespaces. Links inside pods go with their namespace.
	for _, ns := range nss {
		if _, isNode := nodeIndexFromNetns(ns); !isNode || !netnsExists(ns) {
			continue
		}
		links, err := r.labLinks(ctx, ns)
		if err != nil {
			errs = append(errs, fmt.Errorf("list links in %s: %w", ns, err))
		}
		// veths before the bridge they are enslaved to
		sort.SliceStable(links, func(i, j int) bool { return links[i] != BridgeName && links[j] == BridgeName })
		for _, link := range links {
			// Deleting one end of the wire deletes the other end too.
			if _, err := r.ip(ctx, "-n", ns, "link", "del", link); err != nil && r.linkExists(ctx, ns, link) {
				errs = append(errs, fmt.Errorf("delete link %s in %s: %w", link, ns, err))
			}
		}
	}
	if len(nss) > 0 {
		logger.Info("removing namespaces", "netns", nss)
	}
	for _, ns := range nss {
		if _, err := r.ip(ctx, "netns", "del", ns); err != nil && exists(netnsPath(ns)) {
			errs = append(errs, fmt.Errorf("delete netns %s: %w", ns, err))
		}
	}

	// 4. The cgroup (anything still inside is killed by cgroup.kill).
	if cg != "" {
		if err := removeCgroup(ctx, cg); err != nil {
			errs = append(errs, err)
		}
	}

	// 5. /run/netns, if the lab created it and it is empty now.
	if st != nil && st.NetnsDirCreated {
		removeNetnsDirIfEmpty(logger)
	}

	// 6. Files. Kept if something above failed, for the next down to retry.
	if len(errs) == 0 {
		if err := os.RemoveAll(RunDir); err != nil {
			errs = append(errs, fmt.Errorf("remove %s: %w", RunDir, err))
		}
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("lab down: %w", err)
	}
	logger.Info("lab is down")
	return nil
}

// pidFilePids returns the live processes named by pid files that are still
// ours (in the lab cgroup or in one of the lab namespaces).
func pidFilePids(inodes []nsInode) []int {
	entries, err := os.ReadDir(pidsDir())
	if err != nil {
		return nil
	}
	want := map[nsInode]bool{}
	for _, n := range inodes {
		want[n] = true
	}
	var pids []int
	for _, e := range entries {
		pod, proc, ok := strings.Cut(strings.TrimSuffix(e.Name(), ".pid"), ".")
		if !ok || !strings.HasSuffix(e.Name(), ".pid") {
			continue
		}
		pid := readPidFile(pod, proc)
		if pid == 0 {
			continue
		}
		pi := readProc(pid)
		if pi.alive && (pi.inGroup || want[pi.netns]) {
			pids = append(pids, pid)
		}
	}
	return pids
}

// removeNetnsDirIfEmpty undoes what `ip netns add` did to a fresh machine:
// /run/netns as a shared bind mount of itself.
func removeNetnsDirIfEmpty(logger *slog.Logger) {
	entries, err := os.ReadDir(netnsDir)
	if err != nil || len(entries) > 0 {
		return
	}
	for range 4 { // a bind mount, maybe stacked
		if err := unix.Unmount(netnsDir, unix.MNT_DETACH); err != nil {
			break
		}
	}
	if err := unix.Rmdir(netnsDir); err != nil {
		logger.Debug("keep /run/netns", "err", err)
	}
}

func exists(path string) bool {
	if path == "" {
		return false
	}
	_, err := os.Stat(path)
	return err == nil
}
