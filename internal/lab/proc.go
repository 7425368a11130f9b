// SPDX-License-Identifier: Apache-2.0

package lab

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/meshwarp/meshwarp/internal/probe"
)

// Process names, as they appear in pid files, log files and status.
const (
	procSidecar = "haproxy"
	procApps    = "apps"
	procQperf   = "qperf"
)

func pidsDir() string { return filepath.Join(RunDir, "pids") }
func logsDir() string { return filepath.Join(RunDir, "logs") }
func podDir(pod string) string {
	return filepath.Join(RunDir, "pods", pod)
}
func pidFile(pod, proc string) string {
	return filepath.Join(pidsDir(), pod+"."+proc+".pid")
}
func logFile(pod, proc string) string {
	return filepath.Join(logsDir(), pod+"."+proc+".log")
}

// cgroupPath returns <cgroup2 root>/meshwarp-lab.
func cgroupPath() (string, error) {
	root, err := probe.Cgroup2Root()
	if err != nil {
		return "", err
	}
	return filepath.Join(root, CgroupName), nil
}

// cgroupRel is how /proc/<pid>/cgroup names the lab cgroup ("0::/meshwarp-lab").
const cgroupRel = "/" + CgroupName

// procInfo is what the lab reads about a process to decide whether it is one
// of its own.
type procInfo struct {
	alive   bool // exists and is not a zombie
	inGroup bool // member of the lab cgroup
	netns   nsInode
}

func readProc(pid int) procInfo {
	var pi procInfo
	stat, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return pi
	}
	// "pid (comm) S ...": the state follows the last ')'.
	s := string(stat)
	if i := strings.LastIndexByte(s, ')'); i >= 0 && i+2 < len(s) {
		st := s[i+2]
		pi.alive = st != 'Z' && st != 'X'
	}
	if cg, err := os.ReadFile(fmt.Sprintf("/proc/%d/cgroup", pid)); err == nil {
		for _, line := range strings.Split(string(cg), "\n") {
			if strings.HasPrefix(line, "0::") && (line[3:] == cgroupRel || strings.HasPrefix(line[3:], cgroupRel+"/")) {
				pi.inGroup = true
			}
		}
	}
	pi.netns, _ = statNs(fmt.Sprintf("/proc/%d/ns/net", pid))
	return pi
}

// readPidFile returns the pid recorded for a pod's process, or 0.
func readPidFile(pod, proc string) int {
	b, err := os.ReadFile(pidFile(pod, proc))
	if err != nil {
		return 0
	}
	pid, err := strconv.Atoi(strings.TrimSpace(string(b)))
	if err != nil || pid <= 1 {
		return 0
	}
	return pid
}

// ownedPid returns the pid from a pid file if that process is alive and still
// ours (in the lab cgroup or in the pod's namespace: a recycled pid is neither).
func ownedPid(pod, netns, proc string) int {
	pid := readPidFile(pod, proc)
	if pid == 0 {
		return 0
	}
	pi := readProc(pid)
	if !pi.alive {
		return 0
	}
	if pi.inGroup {
		return pid
	}
	if ns, ok := statNs(netnsPath(netns)); ok && ns == pi.netns {
		return pid
	}
	return 0
}

// cgroupFD opens the lab cgroup for CLONE_INTO_CGROUP. The caller owns the fd.
func openCgroup(path string) (int, error) {
	fd, err := unix.Open(path, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return -1, fmt.Errorf("open lab cgroup %s: %w", path, err)
	}
	return fd, nil
}

// daemon is a long-running lab process inside a pod.
type daemon struct {
	pod   podPlan
	name  string
	argv  []string // run as `ip netns exec <pod netns> argv...`
	env   []string // added to the environment
	ports []int    // must accept on 127.0.0.1 inside the pod once started
	// listenOnly: check the ports are in LISTEN state instead of connecting
	// (qperf forks a child per connection that waits for a request and
	// logs an error: a probe connection would leave one behind each time).
	listenOnly bool
}

// listening reports whether the process pid has a TCP socket listening on
// port, read from /proc/<pid>/net/tcp{,6}, i.e. in the process's own netns.
func listening(pid, port int) bool {
	want := fmt.Sprintf(":%04X", port)
	for _, f := range []string{"tcp", "tcp6"} {
		b, err := os.ReadFile(fmt.Sprintf("/proc/%d/net/%s", pid, f))
		if err != nil {
			continue
		}
		for _, line := range strings.Split(string(b), "\n")[1:] {
			// sl local_address rem_address st ...; st 0A is TCP_LISTEN
			fl := strings.Fields(line)
			if len(fl) > 3 && strings.HasSuffix(fl[1], want) && fl[3] == "0A" {
				return true
			}
		}
	}
	return false
}

// startDaemon starts d detached (own session), inside the lab cgroup from its
// first instruction (clone3 CLONE_INTO_CGROUP, so every socket it ever opens
// is created inside the cgroup) and inside the pod namespace (ip netns exec,
// which execs d.argv in the same process: the pid stays the same).
func startDaemon(d daemon, cgroupFD int) (int, error) {
	logf, err := os.OpenFile(logFile(d.pod.Name, d.name), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return 0, fmt.Errorf("open log: %w", err)
	}
	defer logf.Close()
	fmt.Fprintf(logf, "--- meshwarp lab: start %s in %s at %s: %s\n", d.name, d.pod.Netns,
		time.Now().Format(time.RFC3339), strings.Join(d.argv, " "))
	cmd := exec.Command("ip", append([]string{"netns", "exec", d.pod.Netns}, d.argv...)...)
	cmd.Stdout, cmd.Stderr = logf, logf
	cmd.Env = append(os.Environ(), d.env...)
	cmd.Dir = "/"
	cmd.SysProcAttr = &syscall.SysProcAttr{
		Setsid:      true,
		UseCgroupFD: true,
		CgroupFD:    cgroupFD,
	}
	if err := cmd.Start(); err != nil {
		return 0, fmt.Errorf("start %s in %s: %w", d.name, d.pod.Netns, err)
	}
	pid := cmd.Process.Pid
	// Reap it if it dies while this process lives; when this process exits
	// first, the daemon is re-parented and keeps running.
	go func() { _ = cmd.Wait() }()
	if err := writeFileAtomic(pidFile(d.pod.Name, d.name), []byte(strconv.Itoa(pid)+"\n")); err != nil {
		return pid, err
	}
	return pid, nil
}

// waitExited polls until none of pids is alive, or the deadline.
func waitExited(ctx context.Context, pids []int, timeout time.Duration) []int {
	var left []int
	_ = poll(ctx, timeout, 10*time.Millisecond, func() (bool, error) {
		left = nil
		for _, p := range pids {
			if readProc(p).alive {
				left = append(left, p)
			}
		}
		return len(left) == 0, nil
	})
	return left
}

// terminate stops processes: SIGTERM to each one's process group (the lab
// starts every daemon as a session leader, so its children go too), then
// SIGKILL after grace.
func terminate(ctx context.Context, pids []int, grace time.Duration) []int {
	if len(pids) == 0 {
		return nil
	}
	signalAll(pids, syscall.SIGTERM)
	left := waitExited(ctx, pids, grace)
	if len(left) == 0 {
		return nil
	}
	signalAll(left, syscall.SIGKILL)
	return waitExited(context.WithoutCancel(ctx), left, 5*time.Second)
}

func signalAll(pids []int, sig syscall.Signal) {
	for _, p := range pids {
		if pgid, err := syscall.Getpgid(p); err == nil && pgid == p {
			_ = syscall.Kill(-p, sig)
		}
		_ = syscall.Kill(p, sig)
	}
}

// cgroupPids lists the processes in the lab cgroup.
func cgroupPids(path string) []int {
	f, err := os.Open(filepath.Join(path, "cgroup.procs"))
	if err != nil {
		return nil
	}
	defer f.Close()
	var pids []int
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if p, err := strconv.Atoi(strings.TrimSpace(sc.Text())); err == nil && p > 0 {
			pids = append(pids, p)
		}
	}
	// and those of the node cgroups below it
	for _, sub := range subCgroups(path) {
		pids = append(pids, cgroupPids(sub)...)
	}
	return pids
}

// subCgroups lists the cgroups directly below path.
func subCgroups(path string) []string {
	entries, err := os.ReadDir(path)
	if err != nil {
		return nil
	}
	var out []string
	for _, e := range entries {
		if e.IsDir() {
			out = append(out, filepath.Join(path, e.Name()))
		}
	}
	return out
}

// netnsPids lists the processes whose network namespace is one of nss.
func netnsPids(nss []nsInode) []int {
	if len(nss) == 0 {
		return nil
	}
	want := map[nsInode]bool{}
	for _, n := range nss {
		want[n] = true
	}
	entries, err := os.ReadDir("/proc")
	if err != nil {
		return nil
	}
	self := os.Getpid()
	var pids []int
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil || pid == self {
			continue
		}
		if ns, ok := statNs(fmt.Sprintf("/proc/%d/ns/net", pid)); ok && want[ns] {
			pids = append(pids, pid)
		}
	}
	return pids
}

// removeCgroup removes the lab cgroup (node cgroups first), killing
// whatever is still inside (cgroup.kill kills the whole subtree) and
// retrying while the kernel finishes tearing tasks down.
func removeCgroup(ctx context.Context, path string) error {
	if _, err := os.Stat(path); errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if len(cgroupPids(path)) > 0 {
		_ = os.WriteFile(filepath.Join(path, "cgroup.kill"), []byte("1"), 0)
	}
	for _, sub := range subCgroups(path) {
		if err := removeCgroup(ctx, sub); err != nil {
			return err
		}
	}
	var last error
	err := poll(ctx, 10*time.Second, 20*time.Millisecond, func() (bool, error) {
		last = unix.Rmdir(path)
		return last == nil || errors.Is(last, unix.ENOENT), nil
	})
	if err != nil {
		return fmt.Errorf("remove cgroup %s: %w (processes left: %v)", path, last, cgroupPids(path))
	}
	return nil
}

// poll calls cond every interval until it reports true, returns an error, or
// timeout passes. The only way the lab waits: no sleeps as synchronisation.
func poll(ctx context.Context, timeout, interval time.Duration, cond func() (bool, error)) error {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	t := time.NewTicker(interval)
	defer t.Stop()
	for {
		ok, err := cond()
		if err != nil {
			return err
		}
		if ok {
			return nil
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-t.C:
		}
	}
}

func writeFileAtomic(path string, data []byte) error {
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, data, 0o644); err != nil {
		return fmt.Errorf("write %s: %w", path, err)
	}
	if err := os.Rename(tmp, path); err != nil {
		return fmt.Errorf("write %s: %w", path, err)
	}
	return nil
}
