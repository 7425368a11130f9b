// SPDX-License-Identifier: Apache-2.0

package bench

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/netip"
	"os"
	"os/exec"
	"slices"
	"strings"
	"time"

	"github.com/meshwarp/meshwarp/internal/accel"
	"github.com/meshwarp/meshwarp/internal/lab"
	"github.com/meshwarp/meshwarp/internal/observe"
)

// Env is the lab as the bench uses it; labEnv adapts internal/lab to it
// (and tests can fake it).
type Env interface {
	// ServerIP is the server pod's address (fortio :8080/:8078, qperf).
	ServerIP() netip.Addr
	HTTPPort() int
	TCPEchoPort() int
	// QperfPorts are qperf's listen (control) port and data port (-ip);
	// data 0 lets qperf pick an ephemeral one.
	QperfPorts() (listen, data int)
	// ClientCommand runs name in the client pod's network namespace and in
	// the lab cgroup.
	ClientCommand(ctx context.Context, name string, args ...string) *exec.Cmd
	// ServerCommand is ClientCommand in the server pod.
	ServerCommand(ctx context.Context, name string, args ...string) *exec.Cmd
	// OutsideServerCommand runs name in the server pod's network namespace
	// but outside the lab cgroup (in the bench's own): its sockets are not
	// the agent's, like a server on another host.
	OutsideServerCommand(ctx context.Context, name string, args ...string) *exec.Cmd
	// SetCapture turns the sidecars' iptables capture on or off.
	SetCapture(on bool) error
	// RestartSidecars restarts the sidecar proxies (drops pooled connections).
	RestartSidecars(ctx context.Context) error
	// CgroupPath is the cgroup v2 directory holding every lab process.
	CgroupPath() string
	// AgentTargets are where the agent modes attach: one agent per node
	// (the lab's nodes share a kernel; one agent over both would pair
	// sockets across nodes).
	AgentTargets() []AgentTarget
}

// ErrQperfThroughSidecar marks a qperf failure in a capture mode.
var ErrQperfThroughSidecar = errors.New("qperf through the sidecars failed")

type runner struct {
	opts     Options
	env      Env
	start    StartAgentFunc
	log      *slog.Logger
	prog     *progress
	samples  []Sample
	notes    []string
	failures []string
	// qperfCaptureBroken is set when qperf failed through the sidecars:
	// qperf then runs in direct modes only.
	qperfCaptureBroken bool
	// redisRate is the last measured redis request rate per row, which
	// sizes redis-benchmark -n for the next run.
	redisRate map[string]float64
	// profiling is set during the profiling pass (see profilePass).
	profiling bool
}

// Run measures every selected mode and workload in env, interleaving the
// modes (A B C D A B C D ...) for opts.Repeat rounds, and builds the report.
// progressOut receives the progress bar (nil: none). On error or
// cancellation the agent is always uninstalled before Run returns.
func Run(ctx context.Context, opts Options, env Env, startAgent StartAgentFunc, progressOut io.Writer) (*Report, error) {
	if err := opts.Normalize(); err != nil {
		return nil, err
	}
	if len(opts.WorkerCommand) == 0 {
		exe, err := os.Executable()
		if err != nil {
			return nil, fmt.Errorf("find own executable for the worker: %w", err)
		}
		opts.WorkerCommand = []string{exe, "bench", "worker"}
	}
	r := &runner{opts: opts, env: env, start: startAgent, log: opts.Logger.With("subsys", "bench"), redisRate: map[string]float64{}}
	steps, total := r.plan()
	r.prog = newProgress(progressOut, steps, total)
	t0 := time.Now()
	machine := MachineFacts(t0)
	err := r.runAll(ctx)
	r.prog.close()
	if err != nil {
		return nil, err
	}
	cfg := r.config()
	cfg.TotalWallSeconds = round(time.Since(t0).Seconds(), 3)
	rep := BuildReport(machine, cfg, r.samples, opts.Modes)
	rep.Notes = r.notes
	rep.Failures = r.failures
	return rep, nil
}

// modeWorkloads are the selected workloads that run in every mode, in run
// order; in the profiling pass, those reported per request.
func (r *runner) modeWorkloads() []string {
	var ws []string
	for _, w := range []string{WorkloadHTTP, WorkloadTCP, WorkloadHTTPClose, WorkloadHTTPC1, WorkloadTCPC1, WorkloadRedis, WorkloadBulk, WorkloadQperf} {
		if r.opts.hasWorkload(w) && !(r.profiling && w == WorkloadQperf) {
			ws = append(ws, w)
		}
	}
	return ws
}

// ProfileDuration caps the length of a profiling run.
const ProfileDuration = 3 * time.Second

// profileModes are the modes the profiling pass runs: those with an agent,
// when BPF statistics are wanted and a workload reports per request.
func (r *runner) profileModes() []string {
	if r.opts.NoBPFStats || !slices.ContainsFunc(r.opts.Workloads, func(w string) bool { return w != WorkloadQperf && w != WorkloadUnix }) {
		return nil
	}
	return slices.DeleteFunc(slices.Clone(r.opts.Modes), func(m string) bool { return !ModeAgent(m) })
}

// profilePass runs each agent mode's workloads once more, shorter, with the
// kernel's BPF run-time statistics on, for the per-program cost figures.
// The statistics put a clock read around every program run, which costs
// short connections (dozens of runs per request) several percent: the
// measured repeats run without them, and these runs count in no ratio.
func (r *runner) profilePass(ctx context.Context) error {
	modes := r.profileModes()
	if len(modes) == 0 {
		return nil
	}
	stats, err := accel.EnableBPFStats()
	if err != nil {
		r.notes = append(r.notes, fmt.Sprintf("the agent's BPF CPU time is not reported: %v", err))
		return nil
	}
	defer stats.Close()
	r.notes = append(r.notes, fmt.Sprintf("BPF cost figures come from one profiling run per agent mode and workload (at most %v, after the measured repeats) "+
		"with the kernel's BPF run-time statistics on; the measured repeats ran with them off. They are turned on through a BPF_ENABLE_STATS "+
		"descriptor that the bench holds, so they go back off when it exits, also on a crash (kernel.bpf_stats_enabled was %s and is not written)",
		ProfileDuration, bpfStatsSysctl()))
	r.profiling = true
	saved := r.opts.Duration
	r.opts.Duration = min(saved, ProfileDuration)
	defer func() { r.profiling, r.opts.Duration = false, saved }()
	for _, mode := range modes {
		first := len(r.samples)
		if err := r.runMode(ctx, 0, mode); err != nil {
			return err
		}
		for i := first; i < len(r.samples); i++ {
			r.samples[i].Profile = true
		}
	}
	return nil
}

// estimate of one step, for the progress bar
func (r *runner) estimate(workload string) time.Duration {
	q := r.opts.QperfDuration
	n := time.Duration(len(r.opts.Sizes))
	if _, ok := fortioWorkload(workload); ok {
		return r.opts.Duration + 300*time.Millisecond
	}
	switch workload {
	case WorkloadRedis:
		return 2*r.opts.Duration + time.Second
	case WorkloadBulk:
		return r.opts.Duration + time.Second
	case WorkloadQperf:
		return n * 2 * (q + 250*time.Millisecond)
	case WorkloadUnix:
		return n*2*q + 300*time.Millisecond
	}
	return time.Second
}

func (r *runner) plan() (int, time.Duration) {
	steps := 0
	var total time.Duration
	for range r.opts.Repeat {
		for _, m := range r.opts.Modes {
			if ModeAgent(m) && len(r.modeWorkloads()) > 0 {
				total += IdleWindow
			}
			for _, w := range r.modeWorkloads() {
				steps++
				total += r.estimate(w)
			}
			total += 500 * time.Millisecond // capture switch, sidecar restart, agent
		}
		if r.opts.hasWorkload(WorkloadUnix) {
			steps++
			total += r.estimate(WorkloadUnix)
		}
	}
	for range r.profileModes() {
		for _, w := range r.modeWorkloads() {
			if w == WorkloadQperf {
				continue
			}
			steps++
			saved := r.opts.Duration
			r.opts.Duration = min(saved, ProfileDuration)
			total += r.estimate(w)
			r.opts.Duration = saved
		}
		total += 500 * time.Millisecond
	}
	return steps, total
}

func (r *runner) runAll(ctx context.Context) error {
	if r.opts.QperfUnpaired && r.opts.hasWorkload(WorkloadQperf) {
		stop, err := r.startOutsideQperf(ctx)
		if err != nil {
			return err
		}
		defer stop()
	}
	if r.opts.hasWorkload(WorkloadRedis) {
		stop, err := r.startRedis(ctx)
		if err != nil {
			return err
		}
		defer stop()
	}
	if r.opts.hasWorkload(WorkloadBulk) {
		stop, err := r.startBulk(ctx)
		if err != nil {
			return err
		}
		defer stop()
	}
	for rep := range r.opts.Repeat {
		for _, mode := range r.opts.Modes {
			if len(r.modeWorkloads()) == 0 {
				break
			}
			if err := r.runMode(ctx, rep, mode); err != nil {
				return err
			}
		}
		if r.opts.hasWorkload(WorkloadUnix) {
			r.prog.begin(fmt.Sprintf("repeat %d/%d  af_unix floor", rep+1, r.opts.Repeat), r.estimate(WorkloadUnix))
			err := r.runUnix(ctx, rep)
			r.prog.end()
			if err := r.check(ctx, err, ModeFloor, WorkloadUnix, rep); err != nil {
				return err
			}
		}
	}
	return r.profilePass(ctx)
}

// check turns a run error into a recorded failure (the bench goes on), or
// returns it when the run was interrupted.
func (r *runner) check(ctx context.Context, err error, mode, workload string, rep int) error {
	if err == nil {
		return nil
	}
	if ctx.Err() != nil {
		return fmt.Errorf("bench interrupted: %w", context.Cause(ctx))
	}
	msg := fmt.Sprintf("repeat %d, %s, %s: %v", rep+1, mode, workload, err)
	r.failures = append(r.failures, msg)
	r.prog.note("run failed: %s", msg)
	return nil
}

func (r *runner) runMode(ctx context.Context, rep int, mode string) (err error) {
	capture := ModeCapture(mode)
	if err := r.env.SetCapture(capture); err != nil {
		return fmt.Errorf("set sidecar capture %v for %s: %w", capture, mode, err)
	}
	// Fresh sidecars: no pooled upstream connection (possibly accelerated
	// by the previous mode's agent) is carried into this mode.
	if capture {
		if err := r.env.RestartSidecars(ctx); err != nil {
			if ctx.Err() != nil {
				return fmt.Errorf("bench interrupted: %w", context.Cause(ctx))
			}
			return fmt.Errorf("restart sidecars before %s: %w", mode, err)
		}
	}
	var agent Agent
	if ModeAgent(mode) {
		settings := ModeAgentSettings(mode)
		settings.ObserveReads = settings.Observe && (r.opts.ObserveReads || r.profiling)
		targets := r.env.AgentTargets()
		pins := AgentPinDirs(r.opts.PinDir, len(targets))
		var agents nodeAgents
		for i, tg := range targets {
			s := settings
			s.CrossNodeNetns = tg.NodeNetns
			a, err := r.start(tg.Cgroup, pins[i], s)
			if err != nil {
				if uerr := agents.Uninstall(); uerr != nil {
					err = errors.Join(err, uerr)
				}
				return fmt.Errorf("start meshwarp agent for %s: %w", mode, err)
			}
			agents = append(agents, a)
		}
		agent = agents
		if len(agents) == 1 {
			agent = agents[0]
		}
		// Always uninstall, also on error and interruption, before the
		// next mode opens its connections.
		defer func() {
			if uerr := agent.Uninstall(); uerr != nil {
				err = errors.Join(err, fmt.Errorf("uninstall meshwarp agent after %s: %w", mode, uerr))
			}
		}()
	}
	if agent != nil && !r.profiling {
		if err := r.measureIdle(rep, mode, agent); err != nil {
			return fmt.Errorf("agent at idle in %s: %w", mode, err)
		}
	}
	for _, w := range r.modeWorkloads() {
		if w == WorkloadQperf && capture && r.qperfCaptureBroken {
			continue
		}
		label := fmt.Sprintf("repeat %d/%d  %-16s %s", rep+1, r.opts.Repeat, mode, w)
		if r.profiling {
			label = fmt.Sprintf("profile     %-16s %s (BPF statistics on)", mode, w)
		}
		r.prog.begin(label, r.estimate(w))
		var werr error
		_, isFortio := fortioWorkload(w)
		switch {
		case isFortio:
			werr = r.runFortio(ctx, rep, mode, w, agent)
		case w == WorkloadRedis:
			werr = r.runRedis(ctx, rep, mode, agent)
		case w == WorkloadBulk:
			werr = r.runBulk(ctx, rep, mode, agent)
		case w == WorkloadQperf:
			werr = r.runQperf(ctx, rep, mode, agent)
			if errors.Is(werr, ErrQperfThroughSidecar) && ctx.Err() == nil {
				r.qperfCaptureBroken = true
				r.notes = append(r.notes, fmt.Sprintf("qperf does not work through the sidecars here (%v); qperf ran in direct modes only", werr))
				r.prog.note("qperf failed through the sidecars; qperf runs in direct modes only: %v", werr)
				werr = nil
			}
		}
		r.prog.end()
		if err := r.check(ctx, werr, mode, w, rep); err != nil {
			return err
		}
	}
	return nil
}

// agentFlows reads the observation (nil agent: nothing).
func agentFlows(a Agent) ([]accel.Flow, error) {
	if a == nil {
		return nil, nil
	}
	f, err := a.Flows()
	if err != nil {
		return nil, fmt.Errorf("read agent observation: %w", err)
	}
	return f, nil
}

// connections is the concurrency of a fortio workload.
func (r *runner) connections(workload string) int {
	switch workload {
	case WorkloadHTTPClose:
		return r.opts.CloseConnections
	case WorkloadHTTPC1, WorkloadTCPC1:
		return 1
	}
	return r.opts.Connections
}

func (r *runner) httpURL() string {
	return fmt.Sprintf("http://%s/echo?size=%d", netip.AddrPortFrom(r.env.ServerIP(), uint16(r.env.HTTPPort())), r.opts.PayloadBytes)
}

func (r *runner) tcpTarget() string {
	return netip.AddrPortFrom(r.env.ServerIP(), uint16(r.env.TCPEchoPort())).String()
}

// serverAppAddrs are the addresses an app of the bench listens on in the
// server pod: the pod's address for the client and its loopback for the
// inbound sidecar (which connects from 127.0.0.6).
func (r *runner) serverAppAddrs() []netip.Addr {
	addrs := []netip.Addr{r.env.ServerIP()}
	if !r.env.ServerIP().IsLoopback() {
		addrs = append(addrs, netip.MustParseAddr("127.0.0.1"))
	}
	return addrs
}

// startServerApp starts name (a server the bench runs for a workload: a
// Debian program) in the server pod and the lab cgroup, and waits until it
// listens on port. stop kills it and waits for it.
func (r *runner) startServerApp(ctx context.Context, port int, name string, args ...string) (stop func(), err error) {
	cmd := r.env.ServerCommand(ctx, name, args...)
	var stderr bytes.Buffer
	cmd.Stdout = &tailWriter{buf: &stderr, max: 2048}
	cmd.Stderr = cmd.Stdout
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("start %s in the server pod (scripts/install-deps.sh installs it): %w", name, err)
	}
	exited := make(chan struct{})
	go func() { cmd.Wait(); close(exited) }()
	stop = func() {
		cmd.Process.Kill()
		<-exited
	}
	probe := fmt.Sprintf("sport = :%d", port)
	for deadline := time.Now().Add(10 * time.Second); ; {
		out, _ := r.env.ServerCommand(ctx, "ss", "-Hltn", probe).Output()
		if len(bytes.TrimSpace(out)) > 0 {
			return stop, nil
		}
		select {
		case <-exited:
			return nil, fmt.Errorf("%s exited: %s", name, strings.TrimSpace(stderr.String()))
		default:
		}
		if time.Now().After(deadline) || ctx.Err() != nil {
			stop()
			return nil, fmt.Errorf("%s did not listen on :%d within 10s: %s", name, port, strings.TrimSpace(stderr.String()))
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// runWorker starts a worker in the client pod and decodes its result; cpu
// is the lab cgroup's CPU time over the worker's life.
func (r *runner) runWorker(ctx context.Context, spec WorkerSpec, timeout time.Duration) (WorkerResult, float64, error) {
	var res WorkerResult
	b, err := json.Marshal(spec)
	if err != nil {
		return res, 0, err
	}
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	args := append(slices.Clone(r.opts.WorkerCommand[1:]), "--spec", string(b))
	cmd := r.env.ClientCommand(ctx, r.opts.WorkerCommand[0], args...)
	if cmd.Env == nil {
		cmd.Env = os.Environ()
	}
	cmd.Env = append(cmd.Env, lab.ReexecEnvFor(WorkerHelper))
	var stdout, stderr bytes.Buffer
	cmd.Stdout = &stdout
	cmd.Stderr = &tailWriter{buf: &stderr, max: 4096}
	cpu0, err := CgroupCPUSeconds(r.env.CgroupPath())
	if err != nil {
		return res, 0, err
	}
	r.log.Debug("worker start", "args", cmd.Args)
	err = cmd.Run()
	cpu1, cerr := CgroupCPUSeconds(r.env.CgroupPath())
	if err != nil {
		if ctx.Err() != nil && !errors.Is(ctx.Err(), context.Canceled) {
			return res, 0, fmt.Errorf("worker %s timed out after %v: %s", spec.Workload, timeout, strings.TrimSpace(stderr.String()))
		}
		return res, 0, fmt.Errorf("worker %s: %w: %s", spec.Workload, err, strings.TrimSpace(stderr.String()))
	}
	if cerr != nil {
		return res, 0, cerr
	}
	if err := json.Unmarshal(stdout.Bytes(), &res); err != nil {
		return res, 0, fmt.Errorf("decode worker %s result: %w (stdout %q)", spec.Workload, err, truncate(stdout.String(), 200))
	}
	return res, cpu1 - cpu0, nil
}

func (r *runner) runFortio(ctx context.Context, rep int, mode, workload string, agent Agent) error {
	load, _ := fortioWorkload(workload)
	spec := WorkerSpec{
		Workload:          load,
		Connections:       r.connections(workload),
		DurationSeconds:   r.opts.Duration.Seconds(),
		PayloadBytes:      r.opts.PayloadBytes,
		ResolutionSeconds: DefaultResolutionSeconds,
		DisableKeepAlive:  workload == WorkloadHTTPClose,
	}
	if load == WorkloadHTTP {
		spec.Target = r.httpURL()
	} else {
		spec.Target = r.tcpTarget()
	}
	before, err := r.agentSnapshot(agent)
	if err != nil {
		return err
	}
	flowsBefore, err := agentFlows(agent)
	if err != nil {
		return err
	}
	res, cpu, err := r.runWorker(ctx, spec, 3*r.opts.Duration+60*time.Second)
	if err != nil {
		return err
	}
	delta, err := r.agentDelta(agent, before)
	if err != nil {
		return err
	}
	flowsAfter, err := agentFlows(agent)
	if err != nil {
		return err
	}
	s := FortioSample(mode, workload, rep, res, cpu)
	s.Agent = delta
	if workload == WorkloadHTTP && flowsAfter != nil {
		s.Observed = newObservation(observe.Sub(flowsAfter, flowsBefore), r.env.HTTPPort())
	}
	r.samples = append(r.samples, s)
	if res.Requests == 0 {
		return fmt.Errorf("no successful request (%d errors, codes %v)", res.Errors, res.ErrorCodes)
	}
	if res.Errors > 0 {
		r.prog.note("%s %s repeat %d: %d errors (codes %v) next to %d successful requests",
			mode, workload, rep+1, res.Errors, res.ErrorCodes, res.Requests)
	}
	return nil
}

// FortioSample turns a worker's fortio result into a sample.
func FortioSample(mode, workload string, rep int, res WorkerResult, cpuSeconds float64) Sample {
	s := Sample{
		Mode: mode, Workload: workload, Repeat: rep,
		Requests: res.Requests, Errors: res.Errors,
		DurationSeconds: res.DurationSeconds, CPUSeconds: cpuSeconds,
		Histogram: res.Histogram, Metrics: map[string]float64{},
	}
	if res.DurationSeconds > 0 {
		s.Metrics[MetricQPS] = float64(res.Requests) / res.DurationSeconds
	}
	if len(res.Histogram) > 0 {
		s.Metrics[MetricLatencyAvg] = res.AvgUS
		for _, p := range []struct {
			key string
			p   float64
		}{{MetricLatencyP50, 50}, {MetricLatencyP90, 90}, {MetricLatencyP99, 99}} {
			if v, ok := PercentileFromBuckets(res.Histogram, p.p); ok {
				s.Metrics[p.key] = v
			}
		}
	}
	if res.Requests > 0 && cpuSeconds > 0 {
		s.Metrics[MetricCPUPer1kReqs] = cpuSeconds / (float64(res.Requests) / 1000)
	}
	return s
}

func (r *runner) config() Config {
	o := r.opts
	c := Config{
		Modes: o.Modes, Workloads: o.Workloads, Repeat: o.Repeat,
		DurationSeconds:       o.Duration.Seconds(),
		QperfDurationSeconds:  o.QperfDuration.Seconds(),
		SizesBytes:            o.Sizes,
		Connections:           o.Connections,
		PayloadBytes:          o.PayloadBytes,
		HistogramResolutionUS: DefaultResolutionSeconds * 1e6,
		Quick:                 o.Quick,
		ObserveReads:          o.ObserveReads,
		Interleaving:          "per repeat, every mode in turn (A B C D A B C D ...); all workloads of a mode run while its agent is attached; the unix floor runs once per repeat",
		CPUAccounting:         "usage_usec of the lab cgroup (apps, sidecars, load generator; BPF programs run in their context) over each run; unix: the worker process's own rusage",
		PinDir:                o.PinDir,
		Nodes:                 o.Nodes,
		SidecarUID:            SidecarUID,
		LatencyDefinitionQperf: "qperf and unix latency is qperf's tcp_lat: one way, half a round trip; " +
			"their qps is round trips per second; http/tcp latency is fortio's request round trip",
	}
	if o.hasWorkload(WorkloadHTTP) || o.hasWorkload(WorkloadHTTPClose) || o.hasWorkload(WorkloadHTTPC1) {
		c.HTTPURL = r.httpURL()
	}
	if o.hasWorkload(WorkloadTCP) || o.hasWorkload(WorkloadTCPC1) {
		c.TCPTarget = r.tcpTarget()
	}
	if o.hasWorkload(WorkloadHTTPClose) {
		c.CloseConnections = o.CloseConnections
	}
	if o.hasWorkload(WorkloadRedis) {
		c.RedisTarget = r.redisTarget()
		c.RedisBenchmark = fmt.Sprintf("redis-benchmark -c %d -t %s -n N (N for about %gs per command), and again with -P %d; qps = requests of both commands / their time, latency = mean of the two commands' figures",
			redisClients, redisTests, o.Duration.Seconds(), redisPipeline)
	}
	if o.hasWorkload(WorkloadBulk) {
		c.BulkURL = r.bulkURL()
	}
	if o.hasWorkload(WorkloadQperf) {
		listen, _ := r.qperfListenPort()
		c.QperfTarget = netip.AddrPortFrom(r.qperfHost(), uint16(listen)).String()
		c.QperfLoopback = o.QperfLoopback
		c.QperfUnpaired = o.QperfUnpaired
		c.QperfCPU = o.QperfCPU
		for _, m := range o.Modes {
			if !(ModeCapture(m) && r.qperfCaptureBroken) {
				c.QperfModes = append(c.QperfModes, m)
			}
		}
	}
	return c
}

// tailWriter keeps the last max bytes written (a worker's stderr).
type tailWriter struct {
	buf *bytes.Buffer
	max int
}

func (t *tailWriter) Write(p []byte) (int, error) {
	t.buf.Write(p)
	if over := t.buf.Len() - t.max; over > 0 {
		t.buf.Next(over)
	}
	return len(p), nil
}

func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n] + "..."
}
