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
	"strconv"
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

// AgentTarget is one node's agent: its cgroup and, with several nodes, its
// node namespace for cross-node forwarding.
type AgentTarget struct {
	Cgroup    string
	NodeNetns string // "" with one node
}

// AgentPinDirs are the pin directories of n agents: pinDir, pinDir-node1, ...
func AgentPinDirs(pinDir string, n int) []string {
	out := []string{pinDir}
	for i := 1; i < n; i++ {
		out = append(out, fmt.Sprintf("%s-node%d", pinDir, i))
	}
	return out
}

// nodeAgents are the agents of one mode, one per node, read as one.
type nodeAgents []Agent

func (as nodeAgents) Stats() (accel.Stats, error) {
	var sum accel.Stats
	for i, a := range as {
		s, err := a.Stats()
		if err != nil {
			return sum, err
		}
		if i == 0 {
			sum = s
		} else {
			sum = sum.Add(s)
		}
	}
	return sum, nil
}

func (as nodeAgents) Flows() ([]accel.Flow, error) {
	var all []accel.Flow
	for _, a := range as {
		f, err := a.Flows()
		if err != nil {
			return nil, err
		}
		all = append(all, f...)
	}
	return all, nil
}

func (as nodeAgents) Uninstall() error {
	var errs []error
	for _, a := range as {
		errs = append(errs, a.Uninstall())
	}
	return errors.Join(errs...)
}

// Agent is an attached acceleration agent.
type Agent interface {
	// Stats reads its cumulative counters (accel.Stats: the one shape of them).
	Stats() (accel.Stats, error)
	// Flows reads its observation (nil when it does not observe).
	Flows() ([]accel.Flow, error)
	// Uninstall stops accelerating new connections and removes the pins.
	Uninstall() error
}

// deltaOf is the report's view of the counters of one run (after.Sub(before)).
func deltaOf(d accel.Stats) *AgentDelta {
	out := &AgentDelta{
		PairedSockets:       d.PairedSockets,
		RedirectedMessages:  d.RedirectedMessages,
		RedirectedBytes:     d.RedirectedBytes,
		PassthroughMessages: d.PassthroughMessages,
		PassthroughBytes:    d.PassthroughBytes,
		PassthroughByReason: map[string]uint64{},
		NATPortRemaps:       d.NATPortRemaps,
		LeftSockets:         d.LeftSockets,
		Hops:                d.Hops,
		BPFRunSeconds:       d.BPFRunSeconds,
	}
	for k, v := range d.PassthroughByReason {
		if v > 0 {
			out.PassthroughByReason[k] = v
		}
	}
	if x := d.CrossNode; x != nil {
		out.CrossNodeRedirected = x.RedirectedPackets
		for k, v := range x.PassedPackets {
			if v > 0 {
				if out.CrossNodePassed == nil {
					out.CrossNodePassed = map[string]uint64{}
				}
				out.CrossNodePassed[k] = v
			}
		}
	}
	for k, v := range d.PassthroughConnections {
		if v > 0 {
			if out.PassthroughConnections == nil {
				out.PassthroughConnections = map[string]uint64{}
			}
			out.PassthroughConnections[k] = v
		}
	}
	return out
}

// StartAgentFunc attaches an agent to cgroupPath, pinning under pinDir.
type StartAgentFunc func(cgroupPath, pinDir string, settings AgentSettings) (Agent, error)

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
	r := &runner{opts: opts, env: env, start: startAgent, log: opts.Logger.With("subsys", "bench")}
	steps, total := r.plan()
	r.prog = newProgress(progressOut, steps, total)
	t0 := time.Now()
	machine := MachineFacts(t0)
	// The agent's BPF CPU time (HopsSummary.BPFUSPerRequest) is counted by
	// the kernel only while its statistics are on.
	if slices.ContainsFunc(opts.Modes, ModeAgent) && !opts.NoBPFStats {
		if stats, err := accel.EnableBPFStats(); err != nil {
			r.notes = append(r.notes, fmt.Sprintf("the agent's BPF CPU time is not reported: %v", err))
		} else {
			defer stats.Close()
			r.notes = append(r.notes, "BPF run-time statistics were on during the bench (a clock read per program run, in the modes with an agent)")
		}
	}
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

func (r *runner) fortioWorkloads() []string {
	var ws []string
	for _, w := range []string{WorkloadHTTP, WorkloadTCP, WorkloadQperf} {
		if r.opts.hasWorkload(w) {
			ws = append(ws, w)
		}
	}
	return ws
}

// estimate of one step, for the progress bar
func (r *runner) estimate(workload string) time.Duration {
	q := r.opts.QperfDuration
	n := time.Duration(len(r.opts.Sizes))
	switch workload {
	case WorkloadHTTP, WorkloadTCP:
		return r.opts.Duration + 300*time.Millisecond
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
		for range r.opts.Modes {
			for _, w := range r.fortioWorkloads() {
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
	for rep := range r.opts.Repeat {
		for _, mode := range r.opts.Modes {
			if len(r.fortioWorkloads()) == 0 {
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
	return nil
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
		settings.ObserveReads = settings.Observe && !r.opts.NoObserveReads
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
	for _, w := range r.fortioWorkloads() {
		if w == WorkloadQperf && capture && r.qperfCaptureBroken {
			continue
		}
		label := fmt.Sprintf("repeat %d/%d  %-16s %s", rep+1, r.opts.Repeat, mode, w)
		r.prog.begin(label, r.estimate(w))
		var werr error
		switch w {
		case WorkloadHTTP, WorkloadTCP:
			werr = r.runFortio(ctx, rep, mode, w, agent)
		case WorkloadQperf:
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

// agentSnapshot reads the counters (nil agent: nothing).
func (r *runner) agentSnapshot(a Agent) (accel.Stats, error) {
	if a == nil {
		return accel.Stats{}, nil
	}
	c, err := a.Stats()
	if err != nil {
		return c, fmt.Errorf("read agent counters: %w", err)
	}
	return c, nil
}

func (r *runner) agentDelta(a Agent, before accel.Stats) (*AgentDelta, error) {
	if a == nil {
		return nil, nil
	}
	after, err := r.agentSnapshot(a)
	if err != nil {
		return nil, err
	}
	return deltaOf(after.Sub(before)), nil
}

func (r *runner) httpURL() string {
	return fmt.Sprintf("http://%s/echo?size=%d", netip.AddrPortFrom(r.env.ServerIP(), uint16(r.env.HTTPPort())), r.opts.PayloadBytes)
}

func (r *runner) tcpTarget() string {
	return netip.AddrPortFrom(r.env.ServerIP(), uint16(r.env.TCPEchoPort())).String()
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
	spec := WorkerSpec{
		Workload:          workload,
		Connections:       r.opts.Connections,
		DurationSeconds:   r.opts.Duration.Seconds(),
		PayloadBytes:      r.opts.PayloadBytes,
		ResolutionSeconds: DefaultResolutionSeconds,
	}
	if workload == WorkloadHTTP {
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

// unpairedQperfPort is the control port of --qperf-unpaired's server.
const unpairedQperfPort = 19766

// startOutsideQperf starts the qperf server of --qperf-unpaired outside the
// lab cgroup and waits until it listens; stop kills it.
func (r *runner) startOutsideQperf(ctx context.Context) (stop func(), err error) {
	cmd := r.env.OutsideServerCommand(ctx, "qperf", "--listen_port", strconv.Itoa(unpairedQperfPort))
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("start qperf server outside the lab cgroup: %w", err)
	}
	stop = func() {
		cmd.Process.Kill()
		cmd.Wait()
	}
	probe := fmt.Sprintf("sport = :%d", unpairedQperfPort)
	for deadline := time.Now().Add(10 * time.Second); ; {
		out, _ := r.env.OutsideServerCommand(ctx, "ss", "-Hltn", probe).Output()
		if len(bytes.TrimSpace(out)) > 0 {
			return stop, nil
		}
		if time.Now().After(deadline) || ctx.Err() != nil {
			stop()
			return nil, fmt.Errorf("qperf server outside the lab cgroup did not listen on :%d within 10s", unpairedQperfPort)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// qperfListenPort is the qperf server's control port.
func (r *runner) qperfListenPort() (listen, data int) {
	listen, data = r.env.QperfPorts()
	if r.opts.QperfUnpaired {
		listen = unpairedQperfPort
	}
	return listen, data
}

func (r *runner) qperfArgs(test string, size int) []string {
	listen, data := r.qperfListenPort()
	args := []string{r.qperfHost().String(), "-lp", strconv.Itoa(listen)}
	if data != 0 {
		args = append(args, "-ip", strconv.Itoa(data))
	}
	return append(args, "-t", strconv.Itoa(int(r.opts.QperfDuration.Seconds())),
		"-m", strconv.Itoa(size), "-uu", "-v", test)
}

// qperfHost is the qperf server's address as the qperf client dials it.
func (r *runner) qperfHost() netip.Addr {
	if r.opts.QperfLoopback {
		return netip.MustParseAddr("127.0.0.1")
	}
	return r.env.ServerIP()
}

// qperfCommand starts the qperf client: in the client pod, or for
// --qperf-loopback in the server pod itself.
func (r *runner) qperfCommand(ctx context.Context, args ...string) *exec.Cmd {
	if r.opts.QperfLoopback {
		return r.env.ServerCommand(ctx, "qperf", args...)
	}
	return r.env.ClientCommand(ctx, "qperf", args...)
}

// runQperfTest runs one qperf test at one size and returns its result and
// the lab cgroup's CPU seconds over it.
func (r *runner) runQperfTest(ctx context.Context, test string, size int) (QperfResult, float64, error) {
	ctx, cancel := context.WithTimeout(ctx, r.opts.QperfDuration+30*time.Second)
	defer cancel()
	cmd := r.qperfCommand(ctx, r.qperfArgs(test, size)...)
	var stdout, stderr bytes.Buffer
	cmd.Stdout = &stdout
	cmd.Stderr = &tailWriter{buf: &stderr, max: 4096}
	cpu0, err := CgroupCPUSeconds(r.env.CgroupPath())
	if err != nil {
		return QperfResult{}, 0, err
	}
	err = cmd.Run()
	cpu1, cerr := CgroupCPUSeconds(r.env.CgroupPath())
	if err != nil {
		return QperfResult{}, 0, fmt.Errorf("qperf %s -m %d: %w: %s %s", test, size, err,
			strings.TrimSpace(stdout.String()), strings.TrimSpace(stderr.String()))
	}
	if cerr != nil {
		return QperfResult{}, 0, cerr
	}
	res, err := ParseQperf(stdout.String())
	if err != nil {
		return QperfResult{}, 0, err
	}
	if len(res) != 1 || res[0].Test != test {
		return QperfResult{}, 0, fmt.Errorf("qperf %s -m %d: unexpected output %q", test, size, truncate(stdout.String(), 300))
	}
	return res[0], cpu1 - cpu0, nil
}

func (r *runner) runQperf(ctx context.Context, rep int, mode string, agent Agent) error {
	for _, size := range r.opts.Sizes {
		before, err := r.agentSnapshot(agent)
		if err != nil {
			return err
		}
		lat, latCPU, err := r.runQperfTest(ctx, "tcp_lat", size)
		if err == nil {
			var bw QperfResult
			var bwCPU float64
			bw, bwCPU, err = r.runQperfTest(ctx, "tcp_bw", size)
			if err == nil {
				delta, derr := r.agentDelta(agent, before)
				if derr != nil {
					return derr
				}
				s := QperfSample(mode, rep, size, lat, latCPU, bw, bwCPU)
				s.Agent = delta
				r.samples = append(r.samples, s)
				continue
			}
		}
		if ModeCapture(mode) {
			return fmt.Errorf("%w: %w", ErrQperfThroughSidecar, err)
		}
		return err
	}
	return nil
}

// QperfSample combines tcp_lat and tcp_bw at one size. A request is a
// round trip (two qperf messages); latency is qperf's (one way).
func QperfSample(mode string, rep, size int, lat QperfResult, latCPU float64, bw QperfResult, bwCPU float64) Sample {
	s := Sample{Mode: mode, Workload: WorkloadQperf, SizeBytes: size, Repeat: rep,
		Metrics: map[string]float64{}, CPUSeconds: latCPU + bwCPU,
		DurationSeconds: lat.TimeSeconds + bw.TimeSeconds}
	if lat.LatencyUS > 0 {
		s.Metrics[MetricLatencyAvg] = lat.LatencyUS
		rate := lat.MsgRatePerSec
		if rate == 0 {
			rate = 1e6 / lat.LatencyUS
		}
		rtt := rate / 2
		s.Metrics[MetricQPS] = rtt
		s.Requests = int64(rtt * lat.TimeSeconds)
		if s.Requests > 0 && latCPU > 0 {
			s.Metrics[MetricCPUPer1kReqs] = latCPU / (float64(s.Requests) / 1000)
		}
	}
	if bw.BandwidthBytesPerSec > 0 {
		s.Metrics[MetricBandwidth] = bw.BandwidthBytesPerSec / 1e6
		if gb := bw.BandwidthBytesPerSec * bw.TimeSeconds / 1e9; gb > 0 && bwCPU > 0 {
			s.Metrics[MetricCPUPerGB] = bwCPU / gb
		}
	}
	return s
}

func (r *runner) runUnix(ctx context.Context, rep int) error {
	spec := WorkerSpec{
		Workload:        WorkloadUnix,
		DurationSeconds: r.opts.QperfDuration.Seconds(),
		SizesBytes:      r.opts.Sizes,
	}
	timeout := time.Duration(2*len(r.opts.Sizes))*r.opts.QperfDuration + 60*time.Second
	res, _, err := r.runWorker(ctx, spec, timeout)
	if err != nil {
		return err
	}
	for _, u := range res.Unix {
		r.samples = append(r.samples, UnixSample(rep, u))
	}
	return nil
}

// UnixSample turns one size of the floor into a sample (same definitions as
// QperfSample; CPU is the worker process's own).
func UnixSample(rep int, u UnixResult) Sample {
	s := Sample{Mode: ModeFloor, Workload: WorkloadUnix, SizeBytes: int(u.MsgSizeBytes), Repeat: rep,
		Metrics: map[string]float64{}, CPUSeconds: u.LatCPUSeconds + u.BWCPUSeconds,
		DurationSeconds: u.LatSeconds + u.BWSeconds, Requests: u.RoundTrips}
	if u.LatencyUS > 0 {
		s.Metrics[MetricLatencyAvg] = u.LatencyUS
		s.Metrics[MetricQPS] = u.MsgRatePerSec / 2
		if u.RoundTrips > 0 && u.LatCPUSeconds > 0 {
			s.Metrics[MetricCPUPer1kReqs] = u.LatCPUSeconds / (float64(u.RoundTrips) / 1000)
		}
	}
	if u.BandwidthBytesPerSec > 0 {
		s.Metrics[MetricBandwidth] = u.BandwidthBytesPerSec / 1e6
		if u.StreamBytes > 0 && u.BWCPUSeconds > 0 {
			s.Metrics[MetricCPUPerGB] = u.BWCPUSeconds / (float64(u.StreamBytes) / 1e9)
		}
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
		Interleaving:          "per repeat, every mode in turn (A B C D A B C D ...); all workloads of a mode run while its agent is attached; the unix floor runs once per repeat",
		CPUAccounting:         "usage_usec of the lab cgroup (apps, sidecars, load generator; BPF programs run in their context) over each run; unix: the worker process's own rusage",
		PinDir:                o.PinDir,
		Nodes:                 o.Nodes,
		SidecarUID:            SidecarUID,
		LatencyDefinitionQperf: "qperf and unix latency is qperf's tcp_lat: one way, half a round trip; " +
			"their qps is round trips per second; http/tcp latency is fortio's request round trip",
	}
	if o.hasWorkload(WorkloadHTTP) {
		c.HTTPURL = r.httpURL()
	}
	if o.hasWorkload(WorkloadTCP) {
		c.TCPTarget = r.tcpTarget()
	}
	if o.hasWorkload(WorkloadQperf) {
		listen, _ := r.qperfListenPort()
		c.QperfTarget = netip.AddrPortFrom(r.qperfHost(), uint16(listen)).String()
		c.QperfLoopback = o.QperfLoopback
		c.QperfUnpaired = o.QperfUnpaired
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
