// SPDX-License-Identifier: Apache-2.0

package testutil

import (
	"bufio"
	"errors"
	"io"
	"os"
	"os/exec"
	"strings"
	"syscall"
	"testing"
	"time"
)

// Agent is what StartAgent starts and uninstalls: *accel.Agent. (An
// interface because accel's own tests use this kit, which therefore cannot
// import accel; agenttest.Start is the accel-typed form for other packages.)
type Agent interface {
	Uninstall() (openSockets uint64, err error)
}

// StartAgent starts an agent in this process with start, after filling an
// empty *cgroup with a throwaway cgroup this test process joins and an empty
// *pinDir with a throwaway pin directory (start reads both, typically from
// the config they point into). It fails t when the agent does not start,
// and uninstalls it on cleanup (before the cgroup and pin directory go),
// failing t when that fails.
func StartAgent[A Agent](t testing.TB, cgroup, pinDir *string, start func() (A, error)) A {
	t.Helper()
	if *cgroup == "" {
		*cgroup = EnterCgroup(t)
	}
	if *pinDir == "" {
		*pinDir = PinDir(t)
	}
	a, err := start()
	if err != nil {
		t.Fatalf("start agent: %v", err)
	}
	t.Cleanup(func() {
		if _, err := a.Uninstall(); err != nil {
			t.Errorf("uninstall: %v", err)
		}
	})
	return a
}

// WithAndWithout runs fn as subtests "without-agent" and then "with-agent":
// the same assertions without the agent and with it (fn starts the agent
// when withAgent is true).
func WithAndWithout(t *testing.T, fn func(t *testing.T, withAgent bool)) {
	t.Helper()
	inAgentModes(t, []bool{false, true}, fn)
}

// WithThenWithout is WithAndWithout with the agent first, for cases whose
// setup the agent-less run can reuse but not the other way round.
func WithThenWithout(t *testing.T, fn func(t *testing.T, withAgent bool)) {
	t.Helper()
	inAgentModes(t, []bool{true, false}, fn)
}

func inAgentModes(t *testing.T, order []bool, fn func(t *testing.T, withAgent bool)) {
	t.Helper()
	for _, withAgent := range order {
		mode := "without-agent"
		if withAgent {
			mode = "with-agent"
		}
		t.Run(mode, func(t *testing.T) { fn(t, withAgent) })
	}
}

// AgentProc is `meshwarp run` as a separate process, as an operator or the
// DaemonSet runs it.
type AgentProc struct {
	cmd    *exec.Cmd
	stderr *SyncBuffer
	exited chan struct{} // closed once the process has been waited for
}

// StartAgentProc runs `meshwarp run` on cgroup with pinDir (no metrics
// listener unless extra asks for one; extra flags come last and win) and
// returns once it logs that it is attached; it fails t if the process exits
// first or is not ready within 60 s. The process is killed on cleanup.
func StartAgentProc(t testing.TB, cgroup, pinDir string, extra ...string) *AgentProc {
	t.Helper()
	args := append([]string{"run", "--cgroup", cgroup, "--pin-dir", pinDir, "--metrics-addr", ""}, extra...)
	cmd := exec.Command(MeshwarpBinary(t), args...)
	p := &AgentProc{cmd: cmd, stderr: &SyncBuffer{}, exited: make(chan struct{})}
	pr, pw := io.Pipe()
	cmd.Stderr = io.MultiWriter(p.stderr, pw)
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() {
		cmd.Wait()
		pw.Close()
		close(p.exited)
	}()
	t.Cleanup(func() {
		cmd.Process.Kill()
		<-p.exited
	})
	ready := make(chan bool, 1)
	go func() {
		sc := bufio.NewScanner(pr)
		for sc.Scan() {
			if strings.Contains(sc.Text(), "meshwarp: accelerating TCP") {
				ready <- true
				io.Copy(io.Discard, pr)
				return
			}
		}
		ready <- false
	}()
	select {
	case ok := <-ready:
		if !ok {
			t.Fatalf("meshwarp run did not start:\n%s", p.stderr.String())
		}
	case <-time.After(60 * time.Second):
		t.Fatalf("meshwarp run not ready after 60s:\n%s", p.stderr.String())
	}
	return p
}

// agentStopTimeout bounds an agent's exit, an uninstall under load included,
// with room for a slow emulated VM.
const agentStopTimeout = 3 * time.Minute

// Stderr is what the agent has logged so far.
func (p *AgentProc) Stderr() string { return p.stderr.String() }

// Stop signals the agent and waits for it; it returns the exit code (minus
// the signal number when a signal killed it).
func (p *AgentProc) Stop(t testing.TB, sig syscall.Signal) int {
	t.Helper()
	if err := p.cmd.Process.Signal(sig); err != nil {
		t.Fatal(err)
	}
	select {
	case <-p.exited:
	case <-time.After(agentStopTimeout):
		// Stuck: its goroutines (Go prints them on SIGQUIT) say where.
		p.cmd.Process.Signal(syscall.SIGQUIT)
		<-p.exited
		t.Fatalf("meshwarp run did not exit %v after %v; its log and goroutines:\n%s", agentStopTimeout, sig, p.stderr.String())
	}
	if ws, ok := p.cmd.ProcessState.Sys().(syscall.WaitStatus); ok && ws.Signaled() {
		return -int(ws.Signal())
	}
	return p.cmd.ProcessState.ExitCode()
}

// CgroupPrograms is bpftool's list of the BPF programs attached to cgroup.
func CgroupPrograms(t testing.TB, cgroup string) string {
	t.Helper()
	return Run(t, "bpftool", "cgroup", "show", cgroup)
}

// AssertNothingLeft fails t (without stopping it) when pinDir still exists
// or a sock_ops program is still attached to cgroup: what an agent that
// refused to start or was uninstalled must not leave behind.
func AssertNothingLeft(t testing.TB, pinDir, cgroup string) {
	t.Helper()
	if _, err := os.Lstat(pinDir); err == nil {
		entries, _ := os.ReadDir(pinDir)
		var names []string
		for _, e := range entries {
			names = append(names, e.Name())
		}
		t.Errorf("pin dir %s left behind, holding %v", pinDir, names)
	} else if !errors.Is(err, os.ErrNotExist) {
		t.Errorf("stat %s: %v", pinDir, err)
	}
	if out := CgroupPrograms(t, cgroup); strings.Contains(out, "sock_ops") {
		t.Errorf("a sock_ops program is still attached to %s:\n%s", cgroup, out)
	}
}
