// SPDX-License-Identifier: Apache-2.0

// Package bench measures direct / sidecar / sidecar+meshwarp /
// direct+meshwarp side by side in the lab (internal/lab), with the workloads
// of published sidecar-acceleration measurements: fortio HTTP and TCP echo
// load (fortio as a Go library, run by a worker process inside the client
// pod), qperf tcp_lat/tcp_bw, an AF_UNIX socketpair floor, and the cost
// workloads: HTTP with a connection per request, one connection,
// redis-benchmark against redis-server, and curl downloading a large file
// from nginx. Modes are interleaved and repeated; the report
// gives medians, spread and per-repeat paired ratios, as a terminal table,
// JSON (docs/bench-schema.json) and a self-contained HTML page.
package bench

import (
	"cmp"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/meshwarp/meshwarp/internal/lab"
)

// Modes.
const (
	ModeDirect          = "direct"           // pod to pod, no capture, no agent
	ModeSidecar         = "sidecar"          // Istio-style capture through HAProxy sidecars
	ModeSidecarMeshwarp = "sidecar+meshwarp" // sidecar with the agent attached
	ModeDirectMeshwarp  = "direct+meshwarp"  // direct with the agent attached
	// The observation's own cost: the agent observing only, and accelerating only.
	ModeSidecarObserve    = "sidecar+observe"    // sidecar, agent with --accelerate=false
	ModeSidecarAccelerate = "sidecar+accelerate" // sidecar, agent with --observe=false
	ModeDirectObserve     = "direct+observe"
	ModeDirectAccelerate  = "direct+accelerate"
	// ModeFloor labels the AF_UNIX results, which do not depend on the mode.
	ModeFloor = "floor"
)

// Workloads.
const (
	WorkloadHTTP  = "http"
	WorkloadTCP   = "tcp"
	WorkloadQperf = "qperf"
	WorkloadUnix  = "unix"
	// WorkloadHTTPClose is fortio HTTP with one connection per request
	// (keep-alive off: `Connection: close`), CloseConnections at a time.
	WorkloadHTTPClose = "http-close"
	// WorkloadHTTPC1 and WorkloadTCPC1 are the http and tcp workloads with
	// one connection: the latency of a lone request.
	WorkloadHTTPC1 = "http-c1"
	WorkloadTCPC1  = "tcp-c1"
	// WorkloadRedis is redis-benchmark against redis-server in the server
	// pod; it reports two rows, WorkloadRedis (plain) and WorkloadRedisPipelined.
	WorkloadRedis          = "redis"
	WorkloadRedisPipelined = "redis-p16"
	// WorkloadBulk is curl downloading a BulkBytes file from nginx in the
	// server pod, one transfer (and connection) at a time: bandwidth.
	WorkloadBulk = "bulk"
	// WorkloadIdle labels the agent's cost with no traffic (IdleWindow
	// after it attached, in every mode with an agent).
	WorkloadIdle = "idle"
)

// Defaults (the settings of those published measurements: 64 connections, 1 KB payloads).
const (
	DefaultDuration     = 10 * time.Second
	DefaultRepeat       = 3
	DefaultConnections  = 64
	DefaultPayloadBytes = 1024
	// DefaultCloseConnections is the concurrency of http-close.
	DefaultCloseConnections = 32
	// DefaultResolutionSeconds is the histogram resolution: 10 us (fortio's
	// default of 1 ms would put every request of this lab in one bucket).
	DefaultResolutionSeconds = 0.00001
	// DefaultPinDir keeps the bench agent apart from a production agent.
	DefaultPinDir = "/sys/fs/bpf/meshwarp-bench"
	// SidecarUID is the uid of the lab's sidecars.
	SidecarUID = lab.DefaultSidecarUID
)

// AllModes in their default (interleaving) order.
var AllModes = []string{ModeDirect, ModeSidecar, ModeSidecarMeshwarp, ModeDirectMeshwarp}

// KnownModes are AllModes and the modes that measure the observation's cost.
var KnownModes = append(slices.Clone(AllModes), ModeSidecarObserve, ModeSidecarAccelerate, ModeDirectObserve, ModeDirectAccelerate)

// AllWorkloads are the default workloads (the seeds' experiments).
var AllWorkloads = []string{WorkloadHTTP, WorkloadTCP, WorkloadQperf, WorkloadUnix}

// KnownWorkloads are every workload --workloads accepts: AllWorkloads and
// the cost workloads (connection per request, one connection, redis, bulk).
var KnownWorkloads = append(slices.Clone(AllWorkloads), WorkloadHTTPClose, WorkloadHTTPC1, WorkloadTCPC1, WorkloadRedis, WorkloadBulk)

// reportOrder is the order of the report's rows (a workload may report
// rows under more than one name: redis).
var reportOrder = []string{WorkloadIdle, WorkloadHTTP, WorkloadTCP, WorkloadHTTPClose, WorkloadHTTPC1, WorkloadTCPC1,
	WorkloadRedis, WorkloadRedisPipelined, WorkloadBulk, WorkloadQperf, WorkloadUnix}

// fortioWorkload returns the fortio load (http or tcp) of a workload and
// whether it is one.
func fortioWorkload(w string) (string, bool) {
	switch w {
	case WorkloadHTTP, WorkloadHTTPClose, WorkloadHTTPC1:
		return WorkloadHTTP, true
	case WorkloadTCP, WorkloadTCPC1:
		return WorkloadTCP, true
	}
	return "", false
}

// DefaultSizes are the qperf and unix message sizes (the seed's 1 B to 16 KiB).
var DefaultSizes = []int{1, 64, 256, 1024, 4096, 16384}

// QuickSizes are the sizes of --quick runs.
var QuickSizes = []int{64, 16384}

// ModeCapture reports whether mode sends traffic through the sidecars.
func ModeCapture(mode string) bool {
	return mode == ModeSidecar || strings.HasPrefix(mode, ModeSidecar+"+")
}

// ModeAgent reports whether mode attaches the agent.
func ModeAgent(mode string) bool { return strings.Contains(mode, "+") }

// AgentSettings is what a mode's agent does: +meshwarp is `meshwarp run`'s
// defaults (accelerate and observe), +observe and +accelerate one of them.
type AgentSettings struct {
	Observe, Accelerate bool
	// ObserveReads: accel.Config.ObserveReads (the breakdown's client_app point).
	ObserveReads bool
	// CrossNodeNetns, when set, turns on cross-node forwarding in that node
	// namespace (the lab with two nodes: one agent per node).
	CrossNodeNetns string
}

// ModeAgentSettings returns the settings of mode's agent (zero without one).
func ModeAgentSettings(mode string) AgentSettings {
	switch {
	case strings.HasSuffix(mode, "+observe"):
		return AgentSettings{Observe: true}
	case strings.HasSuffix(mode, "+accelerate"):
		return AgentSettings{Accelerate: true}
	case ModeAgent(mode):
		return AgentSettings{Observe: true, Accelerate: true}
	}
	return AgentSettings{}
}

// Options configure a bench run.
type Options struct {
	Duration time.Duration // per fortio run
	// QperfDuration is the time of one qperf test at one size, and of one
	// unix floor measurement (latency or stream) at one size.
	QperfDuration time.Duration
	Repeat        int
	Modes         []string
	Workloads     []string
	Sizes         []int
	Connections   int
	// CloseConnections is the concurrency of http-close.
	CloseConnections int
	PayloadBytes     int
	Quick            bool
	// QperfLoopback runs qperf inside the server pod against 127.0.0.1
	// (two sockets of one pod) instead of from the client pod.
	QperfLoopback bool
	// QperfUnpaired runs qperf against a server outside the lab cgroup: a
	// connection the agent cannot pair (what it costs traffic it does not
	// accelerate, such as connections to other hosts).
	QperfUnpaired bool
	// QperfCPU, when set, runs qperf's client and server (qperf -ca) and
	// both ends of the unix floor on this one CPU: every wakeup is then on
	// the CPU that is already running, and latency measures the path rather
	// than waking another CPU (on a VM, waking a halted vCPU can cost more
	// than the whole path). Bandwidth then shares one CPU between writer and
	// reader.
	QperfCPU *int
	// NoBPFStats skips the profiling pass (the only runs with the kernel's
	// BPF run-time statistics on): no agent BPF CPU time in the report.
	NoBPFStats bool
	// ObserveReads makes the measured runs' observing agents record client
	// applications' reads too (the client read tracepoint, which runs for
	// every read on the node while attached: `meshwarp run` leaves it to
	// `meshwarp trace`). Without it the measured runs cost what run costs;
	// the profiling pass records the reads either way, and the report's
	// breakdown takes its client_app point from there.
	ObserveReads bool

	// Nodes is the lab's node count (0 means 1). With 2 the client and the
	// server pods live on different nodes, and every agent mode runs one
	// agent per node with cross-node forwarding.
	Nodes int

	// KeepLab keeps a lab that bench brought up itself.
	KeepLab bool
	// PinDir is where the bench agent pins its maps.
	PinDir string

	// WorkerCommand is the program and leading arguments that start a
	// worker; "--spec JSON" is appended and lab.ReexecEnvFor(WorkerHelper) is
	// set. Default: this executable, "bench worker".
	WorkerCommand []string

	Logger *slog.Logger
}

// QuickOptions returns the --quick settings: every mode and workload, 1 s
// runs, one repeat, two message sizes.
func QuickOptions() Options {
	return Options{
		Duration:      time.Second,
		QperfDuration: time.Second,
		Repeat:        1,
		Sizes:         append([]int(nil), QuickSizes...),
		Quick:         true,
	}
}

// Normalize fills defaults and validates; errors are usage errors.
func (o *Options) Normalize() error {
	o.Duration = cmp.Or(o.Duration, DefaultDuration)
	o.QperfDuration = cmp.Or(o.QperfDuration, min(max(o.Duration, time.Second), 3*time.Second).Round(time.Second))
	o.Repeat = cmp.Or(o.Repeat, DefaultRepeat)
	if len(o.Modes) == 0 {
		o.Modes = slices.Clone(AllModes)
	}
	if len(o.Workloads) == 0 {
		o.Workloads = slices.Clone(AllWorkloads)
	}
	if len(o.Sizes) == 0 {
		o.Sizes = slices.Clone(DefaultSizes)
	}
	o.Connections = cmp.Or(o.Connections, DefaultConnections)
	o.CloseConnections = cmp.Or(o.CloseConnections, DefaultCloseConnections)
	o.PayloadBytes = cmp.Or(o.PayloadBytes, DefaultPayloadBytes)
	o.PinDir = cmp.Or(o.PinDir, DefaultPinDir)
	o.Nodes = cmp.Or(o.Nodes, 1)
	if o.Logger == nil {
		o.Logger = slog.New(slog.DiscardHandler)
	}
	var errs []error
	if o.Duration < 100*time.Millisecond {
		errs = append(errs, fmt.Errorf("--duration %v: must be at least 100ms", o.Duration))
	}
	if o.QperfCPU != nil {
		// The CPUs this process may use (a container's cpuset may leave out CPU 0).
		var allowed unix.CPUSet
		if err := unix.SchedGetaffinity(0, &allowed); err == nil && (*o.QperfCPU < 0 || !allowed.IsSet(*o.QperfCPU)) {
			errs = append(errs, fmt.Errorf("--qperf-cpu %d: not a CPU this process may run on; give one of %s", *o.QperfCPU, cpuList(allowed)))
		}
		if !o.hasWorkload(WorkloadQperf) && !o.hasWorkload(WorkloadUnix) {
			errs = append(errs, errors.New("--qperf-cpu pins qperf and the unix floor: add qperf or unix to --workloads"))
		}
	}
	if o.QperfDuration < time.Second {
		errs = append(errs, fmt.Errorf("qperf duration %v: must be at least 1s (qperf counts whole seconds)", o.QperfDuration))
	}
	if o.Nodes < 1 || o.Nodes > 2 {
		errs = append(errs, fmt.Errorf("--nodes %d: give 1 or 2", o.Nodes))
	}
	if o.Repeat < 1 {
		errs = append(errs, fmt.Errorf("--repeat %d: must be at least 1", o.Repeat))
	}
	if o.Connections < 1 {
		errs = append(errs, fmt.Errorf("--connections %d: must be at least 1", o.Connections))
	}
	if o.CloseConnections < 1 {
		errs = append(errs, fmt.Errorf("--close-connections %d: must be at least 1", o.CloseConnections))
	}
	for _, m := range o.Modes {
		if !slices.Contains(KnownModes, m) {
			errs = append(errs, fmt.Errorf("unknown mode %q (want one of %s)", m, strings.Join(KnownModes, ", ")))
		}
	}
	for _, w := range o.Workloads {
		if !slices.Contains(KnownWorkloads, w) {
			errs = append(errs, fmt.Errorf("unknown workload %q (want one of %s)", w, strings.Join(KnownWorkloads, ", ")))
		}
	}
	for _, s := range o.Sizes {
		if s < 1 || s > 1<<20 {
			errs = append(errs, fmt.Errorf("message size %d: must be 1..1048576", s))
		}
	}
	o.Modes = dedup(o.Modes)
	o.Workloads = dedup(o.Workloads)
	o.Sizes = dedup(o.Sizes)
	slices.Sort(o.Sizes)
	return errors.Join(errs...)
}

// ParseSizes parses message sizes such as "64", "1K", "16k", "1M" (binary
// prefixes, as qperf's msg_size).
func ParseSizes(in []string) ([]int, error) {
	var out []int
	for _, s := range in {
		s = strings.TrimSpace(s)
		num, mult := s, 1
		switch {
		case strings.HasSuffix(s, "K"), strings.HasSuffix(s, "k"):
			num, mult = s[:len(s)-1], 1024
		case strings.HasSuffix(s, "M"), strings.HasSuffix(s, "m"):
			num, mult = s[:len(s)-1], 1024*1024
		}
		n, err := strconv.Atoi(num)
		if err != nil || n < 1 {
			return nil, fmt.Errorf("--sizes: %q is not a message size (examples: 1, 64, 1K, 16K)", s)
		}
		out = append(out, n*mult)
	}
	return out, nil
}

func dedup[T comparable](xs []T) []T {
	var out []T
	for _, x := range xs {
		if !slices.Contains(out, x) {
			out = append(out, x)
		}
	}
	return out
}

// hasWorkload reports whether w is selected.
func (o *Options) hasWorkload(w string) bool { return slices.Contains(o.Workloads, w) }

// cpuList names the CPUs of set, as "0-3,6".
func cpuList(set unix.CPUSet) string {
	var parts []string
	for cpu, n := 0, len(set)*64; cpu < n; cpu++ {
		if !set.IsSet(cpu) {
			continue
		}
		last := cpu
		for last+1 < n && set.IsSet(last+1) {
			last++
		}
		if last == cpu {
			parts = append(parts, strconv.Itoa(cpu))
		} else {
			parts = append(parts, fmt.Sprintf("%d-%d", cpu, last))
		}
		cpu = last
	}
	return strings.Join(parts, ",")
}
