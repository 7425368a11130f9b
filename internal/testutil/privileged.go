// SPDX-License-Identifier: Apache-2.0

// Package testutil is the test kit: helpers for privileged integration
// tests (real sockets in throwaway network namespaces and cgroups, all named
// with a meshwarp prefix and removed on cleanup, also when the test fails),
// agents started in-process (StartAgent) or as a process (StartAgentProc),
// the with/without-agent loop (WithAndWithout), the binaries under test
// (Binary) and traffic checkers (CheckIntegrity).
package testutil

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/meshwarp/meshwarp/internal/probe"
)

// RequireEnv, when set (scripts/test.sh and CI set it), turns a skipped
// privileged test into a failure: a green run must mean the invariants ran.
const RequireEnv = "MESHWARP_REQUIRE_PRIVILEGED"

// RequirePrivileged skips t unless it runs as root (privileged tests attach
// BPF programs, create namespaces and cgroups); with RequireEnv set it fails.
func RequirePrivileged(t testing.TB) {
	t.Helper()
	if os.Geteuid() == 0 {
		return
	}
	const why = "privileged test: needs root (CAP_BPF, CAP_NET_ADMIN, CAP_SYS_ADMIN); run ./scripts/test.sh as root"
	if os.Getenv(RequireEnv) != "" {
		t.Fatal(why + " (" + RequireEnv + " is set: a skip would hide untested invariants)")
	}
	t.Skip(why)
}

var cgroupMu sync.Mutex

// EnterCgroup creates a throwaway cgroup v2 directory named meshwarp-test-*,
// moves this whole test process into it (sockets are charged to the cgroup
// of the task that creates them) and moves it back and removes the cgroup on
// cleanup. It returns the cgroup path.
func EnterCgroup(t testing.TB) string {
	t.Helper()
	// Cleanups run last-in first-out: NewCgroup's, registered before
	// JoinCgroup's, runs after the process has left the cgroup.
	dir := NewCgroup(t)
	JoinCgroup(t, dir)
	return dir
}

// NewCgroup creates a throwaway cgroup v2 directory named meshwarp-test-*,
// which no process joins (for an agent run as a separate process, which
// only attaches to it), and removes it on cleanup.
func NewCgroup(t testing.TB) string {
	t.Helper()
	root, err := probe.Cgroup2Root()
	if err != nil {
		t.Fatal(err)
	}
	dir, err := os.MkdirTemp(root, "meshwarp-test-")
	if err != nil {
		t.Fatalf("create test cgroup: %v", err)
	}
	t.Cleanup(func() {
		if err := os.Remove(dir); err != nil && !errors.Is(err, os.ErrNotExist) {
			t.Errorf("remove test cgroup %s: %v", dir, err)
		}
	})
	return dir
}

// JoinCgroup moves this whole test process into the existing cgroup v2
// directory dir (e.g. the lab's) and back on cleanup. One test at a time
// may hold a cgroup.
func JoinCgroup(t testing.TB, dir string) {
	t.Helper()
	root, err := probe.Cgroup2Root()
	if err != nil {
		t.Fatal(err)
	}
	cgroupMu.Lock()
	orig, err := ownCgroup()
	if err != nil {
		cgroupMu.Unlock()
		t.Fatal(err)
	}
	if err := joinCgroup(dir); err != nil {
		cgroupMu.Unlock()
		t.Fatalf("join cgroup %s: %v", dir, err)
	}
	t.Cleanup(func() {
		defer cgroupMu.Unlock()
		if err := joinCgroup(filepath.Join(root, orig)); err != nil {
			t.Errorf("leave cgroup %s: %v", dir, err)
		}
	})
}

func joinCgroup(dir string) error {
	return os.WriteFile(filepath.Join(dir, "cgroup.procs"), []byte(fmt.Sprint(os.Getpid())), 0o644)
}

// OwnCgroupDir returns the cgroup v2 directory this process is in.
func OwnCgroupDir() (string, error) {
	root, err := probe.Cgroup2Root()
	if err != nil {
		return "", err
	}
	rel, err := ownCgroup()
	if err != nil {
		return "", err
	}
	return filepath.Join(root, rel), nil
}

// ownCgroup returns this process's cgroup v2 path relative to the v2 root.
func ownCgroup() (string, error) {
	b, err := os.ReadFile("/proc/self/cgroup")
	if err != nil {
		return "", err
	}
	for _, line := range strings.Split(string(b), "\n") {
		if rest, ok := strings.CutPrefix(line, "0::"); ok {
			return rest, nil
		}
	}
	return "", fmt.Errorf("no cgroup v2 entry in /proc/self/cgroup")
}

// PinDir returns a fresh pin directory path under /sys/fs/bpf (not created)
// and removes whatever is left there on cleanup.
func PinDir(t testing.TB) string {
	t.Helper()
	ensureBPFFS(t)
	dir := filepath.Join("/sys/fs/bpf", fmt.Sprintf("meshwarp-test-%d-%s", os.Getpid(), sanitize(t.Name())))
	t.Cleanup(func() { os.RemoveAll(dir) })
	return dir
}

// ensureBPFFS mounts bpffs at /sys/fs/bpf when nothing is mounted there, as
// `meshwarp run` and `meshwarp probe` do; the mount stays, like theirs.
func ensureBPFFS(t testing.TB) {
	t.Helper()
	var fs unix.Statfs_t
	if err := unix.Statfs("/sys/fs/bpf", &fs); err == nil && fs.Type == unix.BPF_FS_MAGIC {
		return
	}
	if err := unix.Mount("bpf", "/sys/fs/bpf", "bpf", 0, ""); err != nil {
		t.Fatalf("bpffs not mounted at /sys/fs/bpf and mounting it failed: %v", err)
	}
}

func sanitize(s string) string {
	s = strings.NewReplacer("/", "-", " ", "-").Replace(s)
	if len(s) > 40 {
		s = s[len(s)-40:]
	}
	return s
}

// Netns is a throwaway network namespace.
type Netns struct {
	Name string
	fd   int
}

// NewNetns creates network namespace meshwarp-t-<name> with lo up, removed on cleanup.
func NewNetns(t testing.TB, name string) *Netns {
	t.Helper()
	full := "meshwarp-t-" + name
	exec.Command("ip", "netns", "del", full).Run() // leftover of a crashed run
	Run(t, "ip", "netns", "add", full)
	t.Cleanup(func() { exec.Command("ip", "netns", "del", full).Run() })
	Run(t, "ip", "-n", full, "link", "set", "lo", "up")
	fd, err := unix.Open("/run/netns/"+full, unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		t.Fatalf("open netns %s: %v", full, err)
	}
	t.Cleanup(func() { unix.Close(fd) })
	return &Netns{Name: full, fd: fd}
}

// OpenNetns opens the existing named network namespace (ip netns) name,
// which the test did not create and does not remove.
func OpenNetns(t testing.TB, name string) *Netns {
	t.Helper()
	fd, err := unix.Open("/run/netns/"+name, unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		t.Fatalf("open netns %s: %v", name, err)
	}
	t.Cleanup(func() { unix.Close(fd) })
	return &Netns{Name: name, fd: fd}
}

// Do runs fn on an OS thread switched into the namespace. Sockets created by
// fn belong to the namespace and can be used from any goroutine afterwards.
func (n *Netns) Do(fn func() error) error {
	errc := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		// The thread is not unlocked: if restoring failed it must die with
		// the goroutine rather than run other code in the wrong namespace.
		orig, err := unix.Open("/proc/thread-self/ns/net", unix.O_RDONLY|unix.O_CLOEXEC, 0)
		if err != nil {
			errc <- err
			return
		}
		defer unix.Close(orig)
		if err := unix.Setns(n.fd, unix.CLONE_NEWNET); err != nil {
			errc <- fmt.Errorf("setns %s: %w", n.Name, err)
			return
		}
		ferr := fn()
		if err := unix.Setns(orig, unix.CLONE_NEWNET); err != nil {
			errc <- fmt.Errorf("restore netns: %w", err)
			return
		}
		runtime.UnlockOSThread()
		errc <- ferr
	}()
	return <-errc
}

// Run runs a command and fails the test with its output on error.
func Run(t testing.TB, name string, args ...string) string {
	t.Helper()
	out, err := exec.Command(name, args...).CombinedOutput()
	if err != nil {
		t.Fatalf("%s %s: %v\n%s", name, strings.Join(args, " "), err, out)
	}
	return string(out)
}

// SyncBuffer collects a child process's output; safe for exec's writer
// goroutine and a concurrent reader.
type SyncBuffer struct {
	mu sync.Mutex
	b  strings.Builder
}

func (s *SyncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *SyncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// Tshark reads a capture file with tshark and returns its standard output
// (tshark's notes on stderr are kept out of it).
func Tshark(t testing.TB, file string, args ...string) string {
	t.Helper()
	cmd := exec.Command("tshark", append([]string{"-r", file}, args...)...)
	var stderr strings.Builder
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("tshark %v: %v\n%s", args, err, stderr.String())
	}
	return string(out)
}

// BinEnv names a prebuilt cmd/meshwarp for MeshwarpBinary to use instead of
// building one: scripts/vmtest.sh sets it, as its VMs have no writable Go
// build cache (and compiling under emulation would eat the time budget).
const BinEnv = "MESHWARP_TEST_BIN"

// MeshwarpBinary is Binary(t, "meshwarp"), or $MESHWARP_TEST_BIN when set.
func MeshwarpBinary(t testing.TB) string {
	t.Helper()
	if bin := os.Getenv(BinEnv); bin != "" {
		return bin
	}
	return Binary(t, "meshwarp")
}

type built struct {
	once sync.Once
	path string
	err  error
}

var binaries sync.Map // command name -> *built

// Main runs a package's tests (its TestMain) and then removes the binaries
// Binary built for them, which live as long as the test process.
func Main(m *testing.M) int {
	code := m.Run()
	binaries.Range(func(_, v any) bool {
		if b := v.(*built); b.path != "" {
			os.RemoveAll(filepath.Dir(b.path))
		}
		return true
	})
	return code
}

// Binary builds ./cmd/<name> of this module once per test binary, for tests
// that run a command as a user or the DaemonSet would (a separate process,
// a terminal), and returns its path. The binary's directory is readable and
// executable by every uid (a test may run it as nobody).
func Binary(t testing.TB, name string) string {
	t.Helper()
	v, _ := binaries.LoadOrStore(name, &built{})
	b := v.(*built)
	b.once.Do(func() { b.path, b.err = build(name) })
	if b.err != nil {
		t.Fatal(b.err)
	}
	return b.path
}

func build(name string) (string, error) {
	out, err := exec.Command("go", "env", "GOMOD").Output()
	if err != nil {
		return "", fmt.Errorf("go env GOMOD: %w", err)
	}
	root := filepath.Dir(strings.TrimSpace(string(out)))
	dir, err := os.MkdirTemp("", "meshwarp-test-bin-")
	if err != nil {
		return "", err
	}
	if err := os.Chmod(dir, 0o755); err != nil {
		return "", err
	}
	bin := filepath.Join(dir, name)
	cmd := exec.Command("go", "build", "-o", bin, "./cmd/"+name)
	cmd.Dir = root
	if out, err := cmd.CombinedOutput(); err != nil {
		return "", fmt.Errorf("go build ./cmd/%s: %w\n%s", name, err, out)
	}
	return bin, nil
}
