// SPDX-License-Identifier: Apache-2.0

package bench

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os/exec"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"fortio.org/fortio/fhttp"
	"fortio.org/fortio/fnet"

	"github.com/meshwarp/meshwarp/internal/accel"
	"github.com/meshwarp/meshwarp/internal/testutil"
)

// loopEnv is a "lab" on loopback: the worker runs as a plain child process
// of the test binary (no namespace), against fortio servers and a qperf
// server on 127.0.0.1. It records what the orchestrator asks for.
type loopEnv struct {
	mu       sync.Mutex
	httpPort int
	tcpPort  int
	qperf    int
	cgroup   string
	calls    []string
}

func (e *loopEnv) record(s string) {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.calls = append(e.calls, s)
}
func (e *loopEnv) ServerIP() netip.Addr        { return netip.MustParseAddr("127.0.0.1") }
func (e *loopEnv) HTTPPort() int               { return e.httpPort }
func (e *loopEnv) TCPEchoPort() int            { return e.tcpPort }
func (e *loopEnv) QperfPorts() (int, int)      { return e.qperf, 0 }
func (e *loopEnv) CgroupPath() string          { return e.cgroup }
func (e *loopEnv) AgentTargets() []AgentTarget { return []AgentTarget{{Cgroup: e.cgroup}} }
func (e *loopEnv) SetCapture(on bool) error    { e.record(fmt.Sprintf("capture=%v", on)); return nil }
func (e *loopEnv) RestartSidecars(context.Context) error {
	e.record("restart-sidecars")
	return nil
}

// ServerCommand is used by --qperf-loopback; recorded like the client's qperf.
func (e *loopEnv) ServerCommand(ctx context.Context, name string, args ...string) *exec.Cmd {
	e.record("server-" + name)
	return exec.CommandContext(ctx, name, args...)
}

// OutsideServerCommand is used by --qperf-unpaired.
func (e *loopEnv) OutsideServerCommand(ctx context.Context, name string, args ...string) *exec.Cmd {
	e.record("outside-" + name)
	return exec.CommandContext(ctx, name, args...)
}

func (e *loopEnv) ClientCommand(ctx context.Context, name string, args ...string) *exec.Cmd {
	if name == "qperf" {
		e.record("qperf")
	} else {
		e.record("worker")
	}
	return exec.CommandContext(ctx, name, args...)
}

// fakeAgent counts like an agent that redirects everything it sees.
type fakeAgent struct {
	mu          sync.Mutex
	starts      int
	uninstalls  int
	attached    bool
	reads       uint64
	onFirstRead func()
}

func (f *fakeAgent) start(cgroupPath, pinDir string, _ AgentSettings) (Agent, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.attached {
		return nil, errors.New("agent started twice without uninstall")
	}
	f.starts++
	f.attached = true
	return f, nil
}

func (f *fakeAgent) Flows() ([]accel.Flow, error) { return nil, nil }

func (f *fakeAgent) Stats() (accel.Stats, error) {
	f.mu.Lock()
	f.reads++
	n := f.reads
	hook := f.onFirstRead
	f.onFirstRead = nil
	f.mu.Unlock()
	if hook != nil {
		hook()
	}
	return accel.Stats{Counters: accel.Counters{
		RedirectedMessages: n * 100,
		Hops:               map[string]HopCounters{"direct": {PairedConnections: n, RedirectedMessages: n * 100}},
	}}, nil
}

func (f *fakeAgent) Uninstall() error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.uninstalls++
	f.attached = false
	return nil
}

func ownCgroupDir(t *testing.T) string {
	t.Helper()
	dir, err := testutil.OwnCgroupDir()
	if err != nil {
		t.Skipf("no cgroup v2: %v", err)
	}
	if _, err := CgroupCPUSeconds(dir); err != nil {
		t.Skipf("cannot read cpu.stat of own cgroup: %v", err)
	}
	return dir
}

func newLoopEnv(t *testing.T) *loopEnv {
	t.Helper()
	_, haddr := fhttp.Serve("127.0.0.1:0", "/debug")
	taddr := fnet.TCPEchoServer("bench-run-tcp", "127.0.0.1:0")
	if haddr == nil || taddr == nil {
		t.Fatal("cannot start fortio servers on loopback")
	}
	e := &loopEnv{httpPort: haddr.(*net.TCPAddr).Port, tcpPort: taddr.(*net.TCPAddr).Port, cgroup: ownCgroupDir(t)}
	if _, err := exec.LookPath("qperf"); err == nil {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		e.qperf = l.Addr().(*net.TCPAddr).Port
		l.Close()
		srv := exec.Command("qperf", "-lp", fmt.Sprint(e.qperf))
		if err := srv.Start(); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { srv.Process.Kill(); srv.Wait() })
	}
	return e
}

// TestRunOnLoopback drives the whole orchestration (modes interleaved,
// agent attached per mode, workers re-executed, qperf parsed, report built)
// with everything on loopback instead of the lab.
func TestRunOnLoopback(t *testing.T) {
	env := newLoopEnv(t)
	agent := &fakeAgent{}
	opts := Options{
		Duration: 200 * time.Millisecond, QperfDuration: time.Second, Repeat: 2, Connections: 4,
		Workloads: []string{WorkloadHTTP, WorkloadTCP, WorkloadUnix}, Sizes: []int{64},
	}
	rep, err := Run(context.Background(), opts, env, agent.start, nil)
	if err != nil {
		t.Fatal(err)
	}
	if len(rep.Failures) > 0 {
		t.Fatalf("failures: %v", rep.Failures)
	}
	if agent.starts != 6 || agent.uninstalls != 6 {
		t.Errorf("agent started %d, uninstalled %d times; want 6 and 6 (2 +meshwarp modes x (2 repeats + the profiling pass))", agent.starts, agent.uninstalls)
	}
	// The profiling pass: one run per agent mode and workload, in no result's repeats.
	profiles := map[string]int{}
	for _, s := range rep.Runs {
		if s.Profile {
			if !ModeAgent(s.Mode) || s.Agent == nil {
				t.Errorf("profiling run %s %s: agent %v", s.Mode, s.Workload, s.Agent)
			}
			profiles[s.Mode+" "+s.Workload]++
		}
	}
	if len(profiles) != 4 || profiles[ModeSidecarMeshwarp+" "+WorkloadHTTP] != 1 {
		t.Errorf("profiling runs %v, want one per agent mode and workload", profiles)
	}
	// interleaving: one capture switch per mode, in order, per repeat
	var captures []string
	for _, c := range env.calls {
		if strings.HasPrefix(c, "capture=") || c == "restart-sidecars" {
			captures = append(captures, c)
		}
	}
	one := []string{"capture=false", "capture=true", "restart-sidecars", "capture=true", "restart-sidecars", "capture=false"}
	profiling := []string{"capture=true", "restart-sidecars", "capture=false"} // the agent modes only
	want := strings.Join(append(append(append([]string{}, one...), one...), profiling...), " ")
	if got := strings.Join(captures, " "); got != want {
		t.Errorf("mode switches\n got %s\nwant %s", got, want)
	}
	for _, m := range AllModes {
		for _, w := range []string{WorkloadHTTP, WorkloadTCP} {
			r := rep.FindResult(m, w, 0)
			if r == nil || r.QPS == nil || *r.QPS <= 0 || r.Repeats != 2 {
				t.Fatalf("%s %s: %+v", m, w, r)
			}
			if (r.Hops != nil) != ModeAgent(m) {
				t.Errorf("%s %s: hops %+v", m, w, r.Hops)
			}
		}
	}
	if r := rep.FindResult(ModeSidecarMeshwarp, WorkloadHTTP, 0); r.Hops == nil || r.Hops.RedirectedMessages != 100 || r.Hops.Accelerated[0] != "direct" {
		t.Errorf("hop delta %+v", r.Hops)
	}
	if r := rep.FindResult(ModeFloor, WorkloadUnix, 64); r == nil || r.Repeats != 2 {
		t.Errorf("floor %+v", r)
	}
	if r := rep.FindRatio(ModeDirect, ModeSidecar, WorkloadTCP, 0); r == nil || r.Pairs != 2 {
		t.Errorf("ratio %+v", r)
	}
}

// TestRunQperfOnLoopback runs qperf as the bench does (tcp_lat and tcp_bw
// per size, -uu -v output parsed) against a qperf server on loopback.
func TestRunQperfOnLoopback(t *testing.T) {
	env := newLoopEnv(t)
	if env.qperf == 0 {
		t.Skip("qperf not installed (scripts/install-deps.sh installs it)")
	}
	agent := &fakeAgent{}
	opts := Options{QperfDuration: time.Second, Repeat: 1, Workloads: []string{WorkloadQperf},
		Modes: []string{ModeDirectMeshwarp}, Sizes: []int{1, 4096}}
	rep, err := Run(context.Background(), opts, env, agent.start, nil)
	if err != nil {
		t.Fatal(err)
	}
	if len(rep.Failures) > 0 {
		t.Fatalf("failures: %v", rep.Failures)
	}
	for _, size := range opts.Sizes {
		r := rep.FindResult(ModeDirectMeshwarp, WorkloadQperf, size)
		if r == nil || r.BandwidthMBps == nil || *r.BandwidthMBps <= 0 || r.LatencyUS == nil || r.LatencyUS.Avg == nil || r.QPS == nil || r.Hops == nil {
			t.Fatalf("qperf %d: %+v", size, r)
		}
		if r.CPUSecondsPer1kRequests == nil || r.CPUSecondsPerGB == nil {
			t.Errorf("qperf %d: no cpu figures (cgroup %s)", size, env.cgroup)
		}
	}
	if agent.uninstalls != 1 {
		t.Errorf("uninstalls %d", agent.uninstalls)
	}
}

// TestRunInterruptedUninstallsAgent: cancelling in the middle of a
// +meshwarp mode stops the bench and still uninstalls the agent.
func TestRunInterruptedUninstallsAgent(t *testing.T) {
	env := newLoopEnv(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	agent := &fakeAgent{onFirstRead: cancel}
	opts := Options{Duration: time.Second, Repeat: 1, Connections: 2, Workloads: []string{WorkloadHTTP},
		Modes: []string{ModeSidecarMeshwarp, ModeSidecar}}
	_, err := Run(ctx, opts, env, agent.start, nil)
	if err == nil || !strings.Contains(err.Error(), "interrupted") {
		t.Fatalf("Run = %v, want interrupted", err)
	}
	if agent.starts != 1 || agent.uninstalls != 1 {
		t.Errorf("agent started %d, uninstalled %d", agent.starts, agent.uninstalls)
	}
	if n := strings.Count(strings.Join(env.calls, " "), "capture="); n != 1 {
		t.Errorf("modes after the interruption ran: %v", env.calls)
	}
}

// TestRunQperfLoopbackUsesServerPod: --qperf-loopback runs the qperf client
// in the server pod against 127.0.0.1 and says so in the report.
func TestRunQperfLoopbackUsesServerPod(t *testing.T) {
	env := newLoopEnv(t)
	if env.qperf == 0 {
		t.Skip("qperf not installed (scripts/install-deps.sh installs it)")
	}
	opts := Options{QperfDuration: time.Second, Repeat: 1, Workloads: []string{WorkloadQperf},
		Modes: []string{ModeDirect}, Sizes: []int{64}, QperfLoopback: true}
	rep, err := Run(context.Background(), opts, env, (&fakeAgent{}).start, nil)
	if err != nil {
		t.Fatal(err)
	}
	calls := strings.Join(env.calls, " ")
	if !strings.Contains(calls, "server-qperf") || slices.Contains(env.calls, "qperf") {
		t.Fatalf("qperf client ran in the wrong pod: calls %s", calls)
	}
	if !rep.Config.QperfLoopback || !strings.HasPrefix(rep.Config.QperfTarget, "127.0.0.1:") {
		t.Fatalf("config does not say loopback: %+v", rep.Config)
	}
	if r := rep.FindResult(ModeDirect, WorkloadQperf, 64); r == nil || r.LatencyUS == nil {
		t.Fatalf("no qperf result: %+v", r)
	}
}

// TestRunCostWorkloadsOnLoopback runs the cost workloads (connection per
// request, one connection, redis) in every mode on loopback: each gives
// non-zero figures, and every mode with an agent reports its idle cost.
func TestRunCostWorkloadsOnLoopback(t *testing.T) {
	env := newLoopEnv(t)
	workloads := []string{WorkloadHTTPClose, WorkloadHTTPC1, WorkloadTCPC1}
	rows := slices.Clone(workloads)
	if _, err := exec.LookPath("redis-server"); err == nil {
		workloads = append(workloads, WorkloadRedis)
		rows = append(rows, WorkloadRedis, WorkloadRedisPipelined)
	} else {
		t.Log("redis-server not installed (scripts/install-deps.sh installs it): redis not run")
	}
	agent := &fakeAgent{}
	opts := Options{Duration: 300 * time.Millisecond, Repeat: 1, CloseConnections: 4, Workloads: workloads}
	rep, err := Run(context.Background(), opts, env, agent.start, nil)
	if err != nil {
		t.Fatal(err)
	}
	if len(rep.Failures) > 0 {
		t.Fatalf("failures: %v", rep.Failures)
	}
	for _, m := range AllModes {
		for _, w := range rows {
			r := rep.FindResult(m, w, 0)
			if r == nil || r.QPS == nil || *r.QPS <= 0 || r.LatencyUS == nil || r.LatencyUS.P50 == nil || *r.LatencyUS.P50 <= 0 {
				t.Fatalf("%s %s: %+v", m, w, r)
			}
			if (r.Hops != nil) != ModeAgent(m) {
				t.Errorf("%s %s: hops %+v", m, w, r.Hops)
			}
		}
		idle := rep.FindResult(m, WorkloadIdle, 0)
		if (idle != nil) != ModeAgent(m) {
			t.Errorf("%s: idle result %+v", m, idle)
		}
		if idle != nil && (idle.Hops == nil || idle.Hops.Cost == nil || idle.Hops.Cost.ProcessRSSBytes <= 0) {
			t.Errorf("%s: no agent cost at idle: %+v", m, idle.Hops)
		}
	}
	for _, s := range rep.Runs {
		if s.Workload == WorkloadHTTPC1 && s.Errors > 0 {
			t.Errorf("%s http-c1: %d errors", s.Mode, s.Errors)
		}
	}
	var buf strings.Builder
	if err := rep.WriteTable(&buf); err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"one connection per request", "1 connection", "What the agent costs"} {
		if !strings.Contains(buf.String(), want) {
			t.Errorf("table has no %q:\n%s", want, buf.String())
		}
	}
}

// --qperf-cpu puts qperf's client and server on one CPU (qperf -ca), and
// the report says so; without it qperf is not pinned.
func TestQperfCPUPinsBothSides(t *testing.T) {
	env := newLoopEnv(t)
	for _, cpu := range []*int{nil, new(1)} {
		r := &runner{opts: Options{QperfDuration: time.Second, QperfCPU: cpu}, env: env}
		args := strings.Join(r.qperfArgs("tcp_lat", 64), " ")
		if pinned := strings.Contains(args, " -ca 1 "); pinned != (cpu != nil) {
			t.Errorf("CPU %v: qperf args %q", cpu, args)
		}
		where := qperfWhere(Config{QperfCPU: cpu})
		if strings.Contains(where, "on CPU 1") != (cpu != nil) {
			t.Errorf("CPU %v: the report says %q", cpu, where)
		}
	}
}
