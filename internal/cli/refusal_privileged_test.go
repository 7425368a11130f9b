// SPDX-License-Identifier: Apache-2.0

package cli

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/meshwarp/meshwarp/internal/accel"
	"github.com/meshwarp/meshwarp/internal/testutil"
)

// Invariant 5 (docs/ARCHITECTURE.md, refusals): on bad input or a
// machine that lacks something, `meshwarp run` refuses with a message that
// names the problem and the fix, exits non-zero with the documented code
// (root.go: 2 usage, 3 not ready, 1 other) and leaves nothing attached or
// pinned. The real binary runs in its own process, as an operator runs it.

// freshPinDir returns a path under /sys/fs/bpf that does not exist. If a
// case leaves it behind, cleanup removes it (after the test has failed).
func freshPinDir(t *testing.T) string {
	t.Helper()
	dir := filepath.Join("/sys/fs/bpf", fmt.Sprintf("meshwarp-t-refusal-%d-%d", os.Getpid(), time.Now().UnixNano()))
	t.Cleanup(func() {
		if _, err := os.Stat(dir); err == nil {
			accel.Cleanup(dir)
			os.RemoveAll(dir)
		}
	})
	return dir
}

// readOnlyBPFFS mounts a fresh bpffs read-only at a temporary directory.
func readOnlyBPFFS(t *testing.T) string {
	t.Helper()
	dir, err := os.MkdirTemp("", "meshwarp-t-refusal-robpf-")
	if err != nil {
		t.Fatal(err)
	}
	if err := syscall.Mount("bpf", dir, "bpf", syscall.MS_RDONLY, ""); err != nil {
		os.Remove(dir)
		t.Fatalf("mount -t bpf -o ro bpf %s: %v", dir, err)
	}
	t.Cleanup(func() {
		if err := syscall.Unmount(dir, 0); err != nil {
			t.Errorf("umount %s: %v", dir, err)
			return
		}
		os.Remove(dir)
	})
	return dir
}

type runResult struct {
	code   int
	stderr string
	stdout string
}

// runMeshwarp runs the binary to completion (a refusal that hangs fails).
func runMeshwarp(t *testing.T, bin string, cred *syscall.Credential, args ...string) runResult {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, bin, args...)
	cmd.Dir = "/"
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if cred != nil {
		cmd.SysProcAttr = &syscall.SysProcAttr{Credential: cred}
	}
	err := cmd.Run()
	res := runResult{stderr: stderr.String(), stdout: stdout.String()}
	var ee *exec.ExitError
	switch {
	case err == nil:
		res.code = 0
	case errors.As(err, &ee):
		res.code = ee.ExitCode()
		if ctx.Err() != nil {
			t.Fatalf("meshwarp %s: did not exit within 2 minutes (killed)\nstderr:\n%s", strings.Join(args, " "), res.stderr)
		}
	default:
		t.Fatalf("meshwarp %s: %v", strings.Join(args, " "), err)
	}
	return res
}

func TestPrivilegedRefusal(t *testing.T) {
	testutil.RequirePrivileged(t)
	bin := testutil.Binary(t, "meshwarp-agent")
	cg := testutil.NewCgroup(t)

	notCgroup := t.TempDir()
	notBPFFS := t.TempDir() // exists, but on tmpfs/ext4, not bpffs
	roBPFFS := readOnlyBPFFS(t)
	// A port already taken: run fails only after it attached (the undo path).
	busy, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer busy.Close()

	type tc struct {
		name string
		// args are appended after `run --cgroup <cg> --pin-dir <fresh> --metrics-addr 127.0.0.1:0`
		// (flags given twice: the last one wins).
		args func(pinDir string) []string
		// pinDirOverride, when set, is the --pin-dir passed and checked instead of a fresh one.
		pinDir string
		cred   *syscall.Credential
		codes  []int    // acceptable exit codes
		want   []string // stderr must contain each (case-insensitive): the problem and the fix
	}
	cases := []tc{
		{
			name:  "unknown-flag",
			args:  func(string) []string { return []string{"--no-such-flag"} },
			codes: []int{ExitUsage},
			want:  []string{"unknown flag", "--no-such-flag"},
		},
		{
			name:  "capacity-zero",
			args:  func(string) []string { return []string{"--capacity", "0"} },
			codes: []int{ExitUsage},
			want:  []string{"--capacity", "at least 1"},
		},
		{
			name:  "exclude-ports-not-a-number",
			args:  func(string) []string { return []string{"--exclude-ports", "abc"} },
			codes: []int{ExitUsage},
			want:  []string{`"abc"`, "1 to 65535"},
		},
		{
			name:  "include-cidrs-host-bits",
			args:  func(string) []string { return []string{"--include-cidrs", "10.0.0.1/8"} },
			codes: []int{ExitUsage},
			want:  []string{"10.0.0.1/8", "10.0.0.0/8"},
		},
		{
			// A bad --cgroup value is a bad argument: exit 2 (root.go: "bad flags or arguments").
			name:  "cgroup-not-cgroup2",
			args:  func(string) []string { return []string{"--cgroup", notCgroup} },
			codes: []int{ExitUsage},
			want:  []string{notCgroup, "not a cgroup v2", "cgroup2"},
		},
		{
			name:  "cgroup-missing",
			args:  func(string) []string { return []string{"--cgroup", "/nonexistent/meshwarp-t-refusal-cgroup"} },
			codes: []int{ExitUsage},
			want:  []string{"/nonexistent/meshwarp-t-refusal-cgroup", "no such file", "cgroup v2 directory"},
		},
		{
			// The operator chose a --pin-dir outside bpffs: a bad argument (2),
			// or read as "bpffs not mounted there" (3); never a generic 1.
			name:   "pin-dir-parent-not-bpffs",
			pinDir: filepath.Join(notBPFFS, "pins"),
			codes:  []int{ExitUsage, ExitNotReady},
			want:   []string{notBPFFS, "not on a bpf filesystem", "mount -t bpf"},
		},
		{
			name:   "pin-dir-parent-missing",
			pinDir: "/tmp/meshwarp-t-refusal-nonexistent/y",
			codes:  []int{ExitUsage, ExitNotReady},
			want:   []string{"/tmp/meshwarp-t-refusal-nonexistent", "mount -t bpf"},
		},
		{
			// An unwritable bpffs is a machine that is not ready (the probe's
			// "bpffs writable" row says so for /sys/fs/bpf): exit 3 with the remount fix.
			name:   "pin-dir-read-only-bpffs",
			pinDir: filepath.Join(roBPFFS, "pins"),
			codes:  []int{ExitNotReady},
			want:   []string{"read-only", "remount"},
		},
		{
			// Fails after attaching, when the metrics listener cannot bind:
			// everything attached so far must be undone.
			name:  "metrics-addr-in-use",
			args:  func(string) []string { return []string{"--metrics-addr", busy.Addr().String()} },
			codes: []int{ExitFailure, ExitUsage},
			want:  []string{busy.Addr().String(), "address already in use", "--metrics-addr"},
		},
		{
			name:  "unprivileged",
			cred:  &syscall.Credential{Uid: 65534, Gid: 65534},
			codes: []int{ExitNotReady},
			want:  []string{"CAP_BPF", "run as root"},
		},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			pinDir := c.pinDir
			if pinDir == "" {
				pinDir = freshPinDir(t)
			}
			args := []string{"run", "--cgroup", cg, "--pin-dir", pinDir, "--metrics-addr", "127.0.0.1:0"}
			if c.args != nil {
				args = append(args, c.args(pinDir)...)
			}
			res := runMeshwarp(t, bin, c.cred, args...)
			t.Logf("meshwarp %s\nexit %d\nstderr: %s", strings.Join(args, " "), res.code, strings.TrimSpace(res.stderr))
			if res.code == 0 {
				t.Errorf("exit 0: want a refusal (exit %v)", c.codes)
			} else if !slices.Contains(c.codes, res.code) {
				t.Errorf("exit %d, want %v", res.code, c.codes)
			}
			low := strings.ToLower(res.stderr)
			for _, w := range c.want {
				if !strings.Contains(low, strings.ToLower(w)) {
					t.Errorf("stderr does not mention %q", w)
				}
			}
			testutil.AssertNothingLeft(t, pinDir, cg)
		})
	}

	// Positive control: the same invocation with good inputs starts, attaches,
	// and on SIGTERM exits 0 and removes everything.
	t.Run("control-starts-and-stops", func(t *testing.T) {
		pinDir := freshPinDir(t)
		args := []string{"run", "--cgroup", cg, "--pin-dir", pinDir, "--metrics-addr", "127.0.0.1:0"}
		cmd := exec.Command(bin, args...)
		cmd.Dir = "/"
		var stderr testutil.SyncBuffer
		cmd.Stderr = &stderr
		cmd.Stdout = &stderr
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		done := make(chan error, 1)
		go func() { done <- cmd.Wait() }()
		exited := false
		defer func() {
			if !exited {
				cmd.Process.Kill()
				<-done
			}
		}()
		link := filepath.Join(pinDir, accel.SockopsLinkPin)
		deadline := time.After(time.Minute)
		tick := time.NewTicker(20 * time.Millisecond)
		defer tick.Stop()
	wait:
		for {
			if _, err := os.Stat(link); err == nil {
				break
			}
			select {
			case err := <-done:
				exited = true
				t.Fatalf("meshwarp %s exited before attaching: %v\n%s", strings.Join(args, " "), err, stderr.String())
			case <-deadline:
				t.Fatalf("%s did not appear within a minute\n%s", link, stderr.String())
			case <-tick.C:
				continue wait
			}
		}
		if out := testutil.CgroupPrograms(t, cg); !strings.Contains(out, "sock_ops") {
			t.Errorf("running agent: no sock_ops program on %s:\n%s", cg, out)
		}
		// One agent per pin directory: a second run, and a cleanup, are
		// refused while this one runs, naming it; neither touches its pins.
		pid := strconv.Itoa(cmd.Process.Pid)
		for _, second := range [][]string{
			{"run", "--cgroup", cg, "--pin-dir", pinDir, "--metrics-addr", "127.0.0.1:0"},
			{"cleanup", "--pin-dir", pinDir},
		} {
			out, err := exec.Command(bin, second...).CombinedOutput()
			var ee *exec.ExitError
			if !errors.As(err, &ee) || ee.ExitCode() != ExitFailure {
				t.Errorf("meshwarp %s with an agent running there: %v, want exit %d\n%s", second[0], err, ExitFailure, out)
			}
			for _, w := range []string{"another meshwarp agent", pinDir, "pid " + pid} {
				if !strings.Contains(string(out), w) {
					t.Errorf("meshwarp %s with an agent running there: output does not mention %q:\n%s", second[0], w, out)
				}
			}
			if _, err := os.Stat(link); err != nil {
				t.Errorf("after a refused %s: %v", second[0], err)
			}
		}
		if err := cmd.Process.Signal(syscall.SIGTERM); err != nil {
			t.Fatal(err)
		}
		var err error
		select {
		case err = <-done:
			exited = true
		case <-time.After(time.Minute):
			t.Fatalf("no exit within a minute of SIGTERM\n%s", stderr.String())
		}
		code := 0
		var ee *exec.ExitError
		if errors.As(err, &ee) {
			code = ee.ExitCode()
		} else if err != nil {
			t.Fatal(err)
		}
		t.Logf("exit %d\n%s", code, stderr.String())
		if code != ExitOK {
			t.Errorf("SIGTERM: exit %d, want 0", code)
		}
		testutil.AssertNothingLeft(t, pinDir, cg)
	})
}
