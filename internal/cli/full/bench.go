// SPDX-License-Identifier: Apache-2.0

package full

import (
	"errors"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"

	"github.com/meshwarp/meshwarp/internal/bench"
	"github.com/meshwarp/meshwarp/internal/cli"
	"github.com/meshwarp/meshwarp/internal/probe"
)

type benchFlags struct {
	duration      time.Duration
	qperfDuration time.Duration
	qperfLoopback bool
	qperfCPU      int
	qperfUnpaired bool
	bpfStats      bool
	observeReads  bool
	repeat        int
	modes         []string
	workloads     []string
	sizes         []string
	connections   int
	closeConns    int
	quick         bool
	jsonPath      string
	htmlPath      string
	keepLab       bool
	pinDir        string
	nodes         int
}

func newBenchCommand(g *cli.Global) *cobra.Command {
	f := &benchFlags{}
	cmd := &cobra.Command{
		Use:   "bench",
		Short: "Measure direct / sidecar / sidecar+meshwarp / direct+meshwarp side by side in the lab",
		Long: `bench runs the published sidecar-acceleration experiments (fortio HTTP and TCP echo,
qperf latency and bandwidth by message size) in the lab (meshwarp lab), every mode in turn,
repeated, and reports medians, spread and per-repeat ratios:

  modes      direct            pod to pod, no capture
             sidecar           Istio-style iptables capture through HAProxy sidecars
             sidecar+meshwarp  sidecar with the meshwarp agent attached for that mode only
             direct+meshwarp   direct with the agent attached
  workloads  http   fortio HTTP load, 64 connections, qps max, /echo?size=1024
             tcp    fortio TCP echo load, 64 connections, qps max, 1 KB payload
             qperf  qperf tcp_lat and tcp_bw pod to pod per message size
             unix   AF_UNIX socketpair ping-pong and stream: the floor
  cost workloads (not in the default set; add them with --workloads):
             http-close  fortio HTTP, one connection per request (Connection: close),
                         32 connections (--close-connections); the lab's pods run with
                         tcp_tw_reuse=1 and a wide ephemeral port range
             http-c1     fortio HTTP, 1 connection: a lone request's latency
             tcp-c1      fortio TCP echo, 1 connection
             redis       redis-server in the server pod, redis-benchmark -c 50 -t set,get
                         in the client pod, plain and pipelined (-P 16): rows redis and
                         redis-p16 (Debian's redis-server, redis-tools)
             bulk        nginx in the server pod serves a 64 MiB file, curl in the
                         client pod downloads it, one transfer (and connection) at a
                         time for the run's duration: MB/s and ms per transfer
                         (Debian's nginx, curl)

In every mode with an agent the report also says what the agent costs: each
BPF program's runs and run time per request and per redirected message, and the
CPU and resident memory of the process hosting the agent and its BPF maps'
memory, at idle (1s after attaching, no traffic) and under each workload. The
BPF figures come from a profiling pass after the measured repeats: each agent
mode and workload once more (at most 3s) with the kernel's BPF statistics on.
The statistics read the clock around every program run, dozens of times per
short connection, so the measured repeats (every qps, latency and ratio) run
with them off.

The load generator runs inside the client pod and the lab cgroup; CPU is the
lab cgroup's (apps, sidecars, load generator) per 1,000 requests. If no lab is
up, bench brings one up and takes it down at the end (unless --keep-lab); a lab
that is already up is used and left as it was. Needs root.

--nodes 2 measures across nodes: the lab gets two node namespaces joined by a
wire, the client pod on one and the server pod on the other, and every agent
mode runs one agent per node (on that node's cgroup, as a DaemonSet would) with
cross-node forwarding on (run --cross-node): the sidecar-to-sidecar hop and
direct pod-to-pod traffic cross the nodes; app-to-sidecar hops stay on a node.`,
		Example: `  meshwarp bench --quick --html report.html
  meshwarp bench --repeat 3 --duration 10s --json bench.json --html bench.html
  meshwarp bench --modes sidecar,sidecar+meshwarp --workloads http,tcp
  meshwarp bench --nodes 2 --repeat 3 --workloads qperf,http,tcp
  meshwarp bench --modes direct,sidecar,sidecar+meshwarp --workloads http-close,http-c1,tcp-c1,redis`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			return runBench(cmd, g, f)
		},
	}
	fl := cmd.Flags()
	fl.DurationVar(&f.duration, "duration", bench.DefaultDuration, "length of one fortio run")
	fl.DurationVar(&f.qperfDuration, "qperf-duration", 0, "length of one qperf test (and one unix floor test) per message size (default min(duration, 3s); whole seconds)")
	fl.IntVar(&f.repeat, "repeat", bench.DefaultRepeat, "rounds of every mode (modes interleaved: A B C D A B C D ...)")
	fl.StringSliceVar(&f.modes, "modes", bench.AllModes, "modes to run, in this order")
	fl.StringSliceVar(&f.workloads, "workloads", bench.AllWorkloads, "workloads: http, tcp, qperf, unix (default), http-close, http-c1, tcp-c1, redis, bulk")
	fl.StringSliceVar(&f.sizes, "sizes", nil, "qperf and unix message sizes (e.g. 1,64,256,1K,4K,16K; default those)")
	fl.IntVar(&f.connections, "connections", bench.DefaultConnections, "fortio connections (http, tcp)")
	fl.IntVar(&f.closeConns, "close-connections", bench.DefaultCloseConnections, "fortio connections of http-close (each request on a new connection)")
	fl.BoolVar(&f.qperfLoopback, "qperf-loopback", false, "run qperf between two sockets of the server pod over 127.0.0.1 (same netns) instead of pod to pod")
	fl.IntVar(&f.qperfCPU, "qperf-cpu", -1, "run qperf's client and server, and both ends of the unix floor, on this one CPU (qperf -ca): latency then measures the path, "+
		"not a wakeup across CPUs, which on a VM (waking a halted vCPU) can cost more than the whole path; bandwidth then shares that CPU (default: not pinned)")
	fl.BoolVar(&f.bpfStats, "bpf-stats", true, "after the measured repeats, profile each agent mode and workload with the kernel's BPF run-time statistics on, for the agent's BPF CPU per program, request and message (--bpf-stats=false: no profiling pass)")
	fl.BoolVar(&f.observeReads, "observe-reads", false, "the measured runs' observing agents also record client applications' reads, as while `meshwarp trace` runs (a tracepoint on every read of the node, which `meshwarp run` does not attach: the ratios then include its cost). The breakdown's first segment (client_app) comes from the profiling pass either way")
	fl.BoolVar(&f.qperfUnpaired, "qperf-unpaired", false, "run qperf against a server outside the lab cgroup: a connection meshwarp cannot pair "+
		"(what the agent costs traffic it does not accelerate; compare direct with direct+meshwarp)")
	fl.BoolVar(&f.quick, "quick", false, "short CI run: 1s runs, 1 repeat, sizes 64 and 16K, every mode and workload")
	fl.StringVar(&f.jsonPath, "json", "", "write the JSON report (docs/bench-schema.json) to `FILE`")
	fl.StringVar(&f.htmlPath, "html", "", "write the self-contained HTML report to `FILE`")
	fl.BoolVar(&f.keepLab, "keep-lab", false, "keep a lab that bench brought up itself")
	fl.StringVar(&f.pinDir, "pin-dir", bench.DefaultPinDir, "where the bench's agent pins its maps (removed after each mode; with --nodes 2 the second node's agent uses DIR-node1)")
	fl.IntVar(&f.nodes, "nodes", 1, "lab nodes: 2 puts the client and the server pods on different nodes, with one agent per node and cross-node forwarding")
	return cmd
}

func runBench(cmd *cobra.Command, g *cli.Global, f *benchFlags) error {
	fl := cmd.Flags()
	opts := bench.Options{}
	if f.quick {
		opts = bench.QuickOptions()
	}
	if !f.quick || fl.Changed("duration") {
		opts.Duration = f.duration
	}
	if fl.Changed("qperf-duration") {
		opts.QperfDuration = f.qperfDuration
	}
	if !f.quick || fl.Changed("repeat") {
		opts.Repeat = f.repeat
	}
	if fl.Changed("sizes") {
		sizes, err := bench.ParseSizes(f.sizes)
		if err != nil {
			return cli.WithExit(cli.ExitUsage, err)
		}
		opts.Sizes = sizes
	}
	opts.Modes = f.modes
	opts.Workloads = f.workloads
	opts.Connections = f.connections
	opts.CloseConnections = f.closeConns
	opts.KeepLab = f.keepLab
	opts.PinDir = f.pinDir
	opts.Nodes = f.nodes
	opts.QperfLoopback = f.qperfLoopback
	opts.QperfUnpaired = f.qperfUnpaired
	if fl.Changed("qperf-cpu") {
		opts.QperfCPU = &f.qperfCPU
	}
	opts.NoBPFStats = !f.bpfStats
	opts.ObserveReads = f.observeReads

	// The agent and lab log at info on every mode switch: keep the terminal
	// to the progress bar and the table unless --debug.
	level := slog.LevelWarn
	if g.Debug {
		level = slog.LevelDebug
	}
	logger := slog.New(slog.NewTextHandler(cmd.ErrOrStderr(), &slog.HandlerOptions{Level: level}))
	opts.Logger = logger
	if err := opts.Normalize(); err != nil {
		return cli.WithExit(cli.ExitUsage, err)
	}
	// A bench takes minutes: refuse an output path that cannot be written
	// before running it, not after.
	for _, p := range []string{f.jsonPath, f.htmlPath} {
		if p == "" {
			continue
		}
		if st, err := os.Stat(filepath.Dir(p)); err != nil || !st.IsDir() {
			return cli.WithExit(cli.ExitUsage, fmt.Errorf("cannot write %s: directory %s does not exist", p, filepath.Dir(p)))
		}
	}
	if os.Geteuid() != 0 {
		return cli.WithExit(cli.ExitNotReady, errors.New("bench needs root (it builds network namespaces, iptables rules and attaches BPF programs): run it with sudo"))
	}
	// Refuse before building the lab when the kernel cannot run the agent,
	// and mount bpffs where nothing is mounted, as `meshwarp run` does.
	if slices.ContainsFunc(opts.Modes, bench.ModeAgent) {
		if err := probe.Run(probe.Options{MountBPFFS: true}).Err(); err != nil {
			return err
		}
	}
	if slices.Contains(opts.Workloads, bench.WorkloadQperf) {
		if _, err := exec.LookPath("qperf"); err != nil {
			return cli.WithExit(cli.ExitNotReady, errors.New("qperf is not installed: run scripts/install-deps.sh (or drop it: --workloads http,tcp,unix)"))
		}
	}

	if slices.Contains(opts.Workloads, bench.WorkloadRedis) {
		for _, bin := range []string{"redis-server", "redis-benchmark"} {
			if _, err := exec.LookPath(bin); err != nil {
				return cli.WithExit(cli.ExitNotReady, fmt.Errorf("%s is not installed: run scripts/install-deps.sh (Debian redis-server, redis-tools), or drop redis from --workloads", bin))
			}
		}
	}
	if slices.Contains(opts.Workloads, bench.WorkloadBulk) {
		for _, bin := range []string{"nginx", "curl"} {
			if _, err := exec.LookPath(bin); err != nil {
				return cli.WithExit(cli.ExitNotReady, fmt.Errorf("%s is not installed: run scripts/install-deps.sh (Debian nginx, curl), or drop bulk from --workloads", bin))
			}
		}
	}

	ctx := cmd.Context()
	stderr := cmd.ErrOrStderr()
	session, err := bench.OpenLab(ctx, opts.KeepLab, opts.Nodes, logger, stderr)
	if err != nil {
		return cli.WithExit(cli.ExitNotReady, err)
	}
	rep, runErr := bench.Run(ctx, opts, session.Env(), bench.StartAccel(logger), stderr)
	closeErr := session.Close()
	for _, dir := range bench.AgentPinDirs(opts.PinDir, opts.Nodes) {
		if bench.PinDirLeft(dir) {
			closeErr = errors.Join(closeErr, fmt.Errorf("agent pins left in %s: run `meshwarp cleanup --pin-dir %s`", dir, dir))
		}
	}
	if runErr != nil {
		return errors.Join(runErr, closeErr)
	}
	rep.Config.LabBroughtUpByBench = session.BroughtUp
	rep.Config.Command = benchCommandLine(fl)

	out := cmd.OutOrStdout()
	if err := rep.WriteTable(out); err != nil {
		return err
	}
	if f.jsonPath != "" {
		if err := rep.WriteJSONFile(f.jsonPath); err != nil {
			return err
		}
		fmt.Fprintf(out, "\nJSON report: %s\n", f.jsonPath)
	}
	if f.htmlPath != "" {
		if err := rep.WriteHTMLFile(f.htmlPath); err != nil {
			return err
		}
		fmt.Fprintf(out, "HTML report: %s\n", f.htmlPath)
	}
	if closeErr != nil {
		return closeErr
	}
	if len(rep.Failures) > 0 {
		return fmt.Errorf("%d run(s) failed (listed above)", len(rep.Failures))
	}
	return nil
}

// benchCommandLine reconstructs the command from the flags that were set.
func benchCommandLine(fl *pflag.FlagSet) string {
	parts := []string{"meshwarp", "bench"}
	fl.Visit(func(f *pflag.Flag) {
		switch f.Value.Type() {
		case "bool":
			parts = append(parts, "--"+f.Name)
		case "stringSlice":
			v := strings.Trim(f.Value.String(), "[]")
			parts = append(parts, "--"+f.Name+"="+v)
		default:
			parts = append(parts, "--"+f.Name+"="+f.Value.String())
		}
	})
	return strings.Join(parts, " ")
}
