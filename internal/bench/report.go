// SPDX-License-Identifier: Apache-2.0

package bench

import (
	"encoding/json"
	"fmt"
	"io"
	"math"
	"os"
	"slices"
	"sort"

	"github.com/meshwarp/meshwarp/internal/accel"
	"github.com/meshwarp/meshwarp/internal/observe"
)

// Metric keys: the name of every number carries its unit. The same keys are
// used in Sample.Metrics, Result.Spread and (with _ratio) in Ratio.
const (
	MetricQPS          = "qps"                         // successful requests (round trips) per second
	MetricLatencyAvg   = "latency_avg_us"              // microseconds
	MetricLatencyP50   = "latency_p50_us"              // microseconds
	MetricLatencyP90   = "latency_p90_us"              // microseconds
	MetricLatencyP99   = "latency_p99_us"              // microseconds
	MetricBandwidth    = "bandwidth_MBps"              // 10^6 bytes per second
	MetricCPUPer1kReqs = "cpu_seconds_per_1k_requests" // CPU seconds of the lab cgroup per 1000 requests
	MetricCPUPerGB     = "cpu_seconds_per_GB"          // CPU seconds of the lab cgroup per 10^9 bytes streamed
)

// metricOrder lists metrics in report order with the key of their ratio.
var metricOrder = []struct{ key, ratio string }{
	{MetricQPS, "qps_ratio"},
	{MetricLatencyAvg, "latency_avg_ratio"},
	{MetricLatencyP50, "latency_p50_ratio"},
	{MetricLatencyP90, "latency_p90_ratio"},
	{MetricLatencyP99, "latency_p99_ratio"},
	{MetricBandwidth, "bandwidth_ratio"},
	{MetricCPUPer1kReqs, "cpu_per_1k_requests_ratio"},
	{MetricCPUPerGB, "cpu_per_GB_ratio"},
}

// Sample is one measured run: one mode, workload, size and repeat.
type Sample struct {
	Mode      string `json:"mode"`
	Workload  string `json:"workload"`
	SizeBytes int    `json:"size_bytes,omitempty"`
	Repeat    int    `json:"repeat"`
	// Metrics holds the numbers that apply, keyed by the Metric* names.
	Metrics         map[string]float64 `json:"metrics"`
	Requests        int64              `json:"requests"`
	Errors          int64              `json:"errors"`
	DurationSeconds float64            `json:"duration_seconds"`
	CPUSeconds      float64            `json:"cpu_seconds"`
	// Histogram is fortio's latency histogram of the run (http, tcp).
	Histogram []Bucket    `json:"histogram_us,omitempty"`
	Agent     *AgentDelta `json:"agent,omitempty"`
	// Profile marks a profiling run: BPF statistics on (they slow every
	// program run), so it gives the BPF cost figures and nothing else.
	Profile bool `json:"profile,omitempty"`
	// Observed is what an observing agent recorded of the run (http).
	Observed *Observation `json:"observed,omitempty"`
}

// Observation is an observing agent's view of one HTTP run.
type Observation struct {
	// ServerRequests and ClientRequests are the exchanges the agent counted
	// at the server and client applications (http_server/client_request_duration_seconds_count).
	ServerRequests uint64 `json:"server_requests"`
	ClientRequests uint64 `json:"client_requests"`
	// Breakdown is where the requests' time went (`meshwarp trace`); nil if no client exchange was seen.
	Breakdown *observe.Breakdown `json:"breakdown,omitempty"`
}

// newObservation summarises the flows of one run to the HTTP port.
func newObservation(flows []accel.Flow, port int) *Observation {
	flows = observe.ByPort(flows, uint16(port))
	o := &Observation{}
	for _, f := range flows {
		if f.Proto != "http" {
			continue
		}
		switch f.Point {
		case accel.PointServer:
			o.ServerRequests += f.Count
		case accel.PointClient:
			o.ClientRequests += f.Count
		}
	}
	if b, err := observe.NewBreakdown(flows); err == nil {
		o.Breakdown = &b
	}
	return o
}

// AgentDelta is the change of the agent's counters over one run: the
// agent's own Counters, under the keys of `meshwarp status --json`
// (accelerated_sockets is the gauge at the end of the run; maps by reason
// hold the non-zero reasons only), and what the run cost the agent.
type AgentDelta struct {
	accel.Counters
	// BPFRunSeconds is the CPU time of the agent's BPF programs over the run.
	BPFRunSeconds float64 `json:"bpf_run_seconds,omitempty"`
	// BPFPrograms splits the BPF run time by program (kernel statistics).
	BPFPrograms map[string]BPFProgramDelta `json:"bpf_programs,omitempty"`
	// BPFProgramsProfilingOnly are programs a profiling run attached that
	// the measured runs (and `meshwarp run`) do not: the client read
	// tracepoint, for the breakdown. Not in BPFRunSeconds or BPFPrograms.
	BPFProgramsProfilingOnly map[string]BPFProgramDelta `json:"bpf_programs_profiling_only,omitempty"`
	// WallSeconds is the run's wall time as the agent counters saw it.
	WallSeconds float64 `json:"wall_seconds,omitempty"`
	// ProcessCPUSeconds is the CPU time of the process hosting the agent
	// (the bench process) over the run; ProcessRSSBytes its resident memory
	// at the end; BPFMemoryBytes the kernel memory of the agent's maps and
	// programs (memlock).
	ProcessCPUSeconds float64 `json:"process_cpu_seconds"`
	ProcessRSSBytes   uint64  `json:"process_rss_bytes,omitempty"`
	BPFMemoryBytes    uint64  `json:"bpf_memory_bytes,omitempty"`
	// CrossNode counters (--nodes 2): packets redirected by direction, and
	// passed by reason (non-zero only).
	CrossNodeRedirected map[string]uint64 `json:"crossnode_redirected_packets,omitempty"`
	CrossNodePassed     map[string]uint64 `json:"crossnode_passed_packets_by_reason,omitempty"`
}

// HopCounters counts one hop kind (app_to_sidecar, sidecar_to_sidecar,
// sidecar_to_app, direct): the agent's own shape.
type HopCounters = accel.HopStats

// Report is the JSON document (docs/bench-schema.json).
type Report struct {
	Schema  string   `json:"schema"`
	Machine Machine  `json:"machine"`
	Config  Config   `json:"config"`
	Results []Result `json:"results"`
	Ratios  []Ratio  `json:"ratios"`
	Runs    []Sample `json:"runs"`
	Notes   []string `json:"notes,omitempty"`
	// Failures lists runs that failed (the bench went on without them).
	Failures []string `json:"failures,omitempty"`
}

// SchemaID names the JSON schema the report follows.
const SchemaID = "https://github.com/meshwarp/meshwarp/docs/bench-schema.json"

// Machine are the facts of the machine the numbers come from.
type Machine struct {
	Kernel          string `json:"kernel"`
	CPUs            int    `json:"cpus"`
	Model           string `json:"model"`
	Go              string `json:"go"`
	MeshwarpVersion string `json:"meshwarp_version"`
	Date            string `json:"date"`
	Hostname        string `json:"hostname,omitempty"`
}

// Config is how the bench ran.
type Config struct {
	Modes                  []string `json:"modes"`
	Workloads              []string `json:"workloads"`
	Repeat                 int      `json:"repeat"`
	DurationSeconds        float64  `json:"duration_seconds"`
	QperfDurationSeconds   float64  `json:"qperf_duration_seconds"`
	SizesBytes             []int    `json:"sizes_bytes"`
	Connections            int      `json:"connections"`
	CloseConnections       int      `json:"close_connections,omitempty"`
	RedisTarget            string   `json:"redis_target,omitempty"`
	RedisBenchmark         string   `json:"redis_benchmark,omitempty"`
	BulkURL                string   `json:"bulk_url,omitempty"`
	PayloadBytes           int      `json:"payload_bytes"`
	HistogramResolutionUS  float64  `json:"histogram_resolution_us"`
	HTTPURL                string   `json:"http_url,omitempty"`
	TCPTarget              string   `json:"tcp_target,omitempty"`
	QperfTarget            string   `json:"qperf_target,omitempty"`
	QperfLoopback          bool     `json:"qperf_loopback,omitempty"`
	QperfUnpaired          bool     `json:"qperf_unpaired,omitempty"`
	QperfCPU               *int     `json:"qperf_cpu,omitempty"`
	Quick                  bool     `json:"quick"`
	ObserveReads           bool     `json:"observe_reads,omitempty"`
	Interleaving           string   `json:"interleaving"`
	CPUAccounting          string   `json:"cpu_accounting"`
	PinDir                 string   `json:"pin_dir"`
	Nodes                  int      `json:"nodes,omitempty"`
	SidecarUID             uint32   `json:"sidecar_uid"`
	QperfModes             []string `json:"qperf_modes,omitempty"`
	LabBroughtUpByBench    bool     `json:"lab_brought_up_by_bench"`
	Command                string   `json:"command,omitempty"`
	TotalWallSeconds       float64  `json:"total_wall_seconds"`
	LatencyDefinitionQperf string   `json:"latency_definition_qperf_unix"`
}

// Result is the median of the repeats of one mode x workload x size.
type Result struct {
	Mode      string `json:"mode"`
	Workload  string `json:"workload"`
	SizeBytes int    `json:"size_bytes,omitempty"`
	Repeats   int    `json:"repeats"`

	QPS                     *float64 `json:"qps,omitempty"`
	LatencyUS               *Latency `json:"latency_us,omitempty"`
	BandwidthMBps           *float64 `json:"bandwidth_MBps,omitempty"`
	CPUSecondsPer1kRequests *float64 `json:"cpu_seconds_per_1k_requests,omitempty"`
	CPUSecondsPerGB         *float64 `json:"cpu_seconds_per_GB,omitempty"`
	RequestsTotal           int64    `json:"requests_total"`
	ErrorsTotal             int64    `json:"errors_total"`

	// Spread is the min and max over the repeats of every metric above.
	Spread map[string]MinMaxValue `json:"spread"`
	// Hops are the agent's counters (medians over repeats), +meshwarp modes only.
	Hops *HopsSummary `json:"hops,omitempty"`
	// Histogram is the latency histogram of all repeats added up, on the
	// log-spaced edges shared by every mode of the workload.
	Histogram *Histogram `json:"histogram_us,omitempty"`
}

// Latency holds latency medians in microseconds.
type Latency struct {
	Avg *float64 `json:"avg,omitempty"`
	P50 *float64 `json:"p50,omitempty"`
	P90 *float64 `json:"p90,omitempty"`
	P99 *float64 `json:"p99,omitempty"`
}

// MinMaxValue is a spread.
type MinMaxValue struct {
	Min float64 `json:"min"`
	Max float64 `json:"max"`
}

// HopsSummary tells which hops the agent accelerated during a run.
type HopsSummary struct {
	// Accelerated names the hops with redirected messages.
	Accelerated []string `json:"accelerated"`
	// Counters are the medians over repeats of the agent's counters
	// (AgentDelta), rounded; passthrough_connections_by_reason holds the
	// most connections any one repeat left to TCP, by reason: a single bad
	// repeat shows.
	accel.Counters
	// BPFUSPerRequest is the agent's BPF CPU time per request (fortio workloads).
	BPFUSPerRequest float64 `json:"bpf_us_per_request,omitempty"`
	// BPFNSPerRedirectedMessage is the agent's BPF CPU time (every program)
	// per redirected message.
	BPFNSPerRedirectedMessage float64 `json:"bpf_ns_per_redirected_message,omitempty"`
	// BPFPrograms is each program's share (medians over repeats).
	BPFPrograms map[string]BPFProgramSummary `json:"bpf_programs,omitempty"`
	// BPFProgramsProfilingOnly: AgentDelta.BPFProgramsProfilingOnly,
	// summarized the same way; in none of the totals above.
	BPFProgramsProfilingOnly map[string]BPFProgramSummary `json:"bpf_programs_profiling_only,omitempty"`
	// Cost is what the agent itself used over the run (medians over repeats).
	Cost *AgentCost `json:"agent_cost,omitempty"`
}

// BPFProgramSummary is one BPF program's cost in a result.
type BPFProgramSummary struct {
	Runs float64 `json:"runs"`
	// NSPerRun is its mean run time.
	NSPerRun float64 `json:"ns_per_run"`
	// RunsPerRequest and NSPerRequest: per request (round trip; with
	// http-close also per connection).
	RunsPerRequest float64 `json:"runs_per_request,omitempty"`
	NSPerRequest   float64 `json:"ns_per_request,omitempty"`
	// NSPerRedirectedMessage is its run time per redirected message.
	NSPerRedirectedMessage float64 `json:"ns_per_redirected_message,omitempty"`
}

// Histogram is a histogram on explicit edges (len(Counts) == len(EdgesUS)-1).
type Histogram struct {
	EdgesUS []float64 `json:"edges_us"`
	Counts  []float64 `json:"counts"`
}

// Ratio compares a mode with a baseline mode: the median over repeats of
// mode/baseline measured in the same repeat. Unitless (after/before).
type Ratio struct {
	Mode      string             `json:"mode"`
	Baseline  string             `json:"baseline"`
	Workload  string             `json:"workload"`
	SizeBytes int                `json:"size_bytes,omitempty"`
	Pairs     int                `json:"pairs"`
	Values    map[string]float64 `json:"-"`
}

// MarshalJSON flattens Values into "<metric>_ratio" keys.
func (r Ratio) MarshalJSON() ([]byte, error) {
	m := map[string]any{
		"mode": r.Mode, "baseline": r.Baseline, "workload": r.Workload, "pairs": r.Pairs,
	}
	if r.SizeBytes != 0 {
		m["size_bytes"] = r.SizeBytes
	}
	for k, v := range r.Values {
		m[k] = round(v, 4)
	}
	return json.Marshal(m)
}

// UnmarshalJSON reads the flattened form back.
func (r *Ratio) UnmarshalJSON(b []byte) error {
	var m map[string]json.RawMessage
	if err := json.Unmarshal(b, &m); err != nil {
		return err
	}
	*r = Ratio{Values: map[string]float64{}}
	for k, raw := range m {
		var err error
		switch k {
		case "mode":
			err = json.Unmarshal(raw, &r.Mode)
		case "baseline":
			err = json.Unmarshal(raw, &r.Baseline)
		case "workload":
			err = json.Unmarshal(raw, &r.Workload)
		case "size_bytes":
			err = json.Unmarshal(raw, &r.SizeBytes)
		case "pairs":
			err = json.Unmarshal(raw, &r.Pairs)
		default:
			var v float64
			err = json.Unmarshal(raw, &v)
			r.Values[k] = v
		}
		if err != nil {
			return fmt.Errorf("ratio %s: %w", k, err)
		}
	}
	return nil
}

type groupKey struct {
	mode, workload string
	size           int
}

// BuildReport aggregates samples into results (medians, spread, merged
// histograms, hop counters) and ratios against the sidecar and direct
// baselines. modes gives the row order.
func BuildReport(machine Machine, cfg Config, samples []Sample, modes []string) *Report {
	rep := &Report{Schema: SchemaID, Machine: machine, Config: cfg, Results: []Result{}, Ratios: []Ratio{}, Runs: samples}
	groups := map[groupKey][]Sample{}
	var keys []groupKey
	for _, s := range samples {
		k := groupKey{s.Mode, s.Workload, s.SizeBytes}
		if _, ok := groups[k]; !ok {
			keys = append(keys, k)
		}
		groups[k] = append(groups[k], s)
	}
	modeRank := func(m string) int {
		if i := slices.Index(modes, m); i >= 0 {
			return i
		}
		return len(modes)
	}
	sort.SliceStable(keys, func(i, j int) bool {
		a, b := keys[i], keys[j]
		if wa, wb := slices.Index(reportOrder, a.workload), slices.Index(reportOrder, b.workload); wa != wb {
			return wa < wb
		}
		if a.size != b.size {
			return a.size < b.size
		}
		return modeRank(a.mode) < modeRank(b.mode)
	})

	edges := histogramEdges(samples)
	for _, k := range keys {
		rep.Results = append(rep.Results, buildResult(k, groups[k], edges[k.workload]))
	}
	// Ratios compare measured runs only.
	for k, ss := range groups {
		groups[k], _ = splitProfile(ss)
	}
	for _, base := range []string{ModeSidecar, ModeDirect} {
		for _, k := range keys {
			if k.mode == base || k.mode == ModeFloor {
				continue
			}
			bk := groupKey{base, k.workload, k.size}
			bs, ok := groups[bk]
			if !ok {
				continue
			}
			if r, ok := buildRatio(k, base, groups[k], bs); ok {
				rep.Ratios = append(rep.Ratios, r)
			}
		}
	}
	return rep
}

// byRepeat returns metric values indexed by repeat number (NaN where absent).
func byRepeat(ss []Sample, metric string, repeats int) []float64 {
	out := make([]float64, repeats)
	for i := range out {
		out[i] = math.NaN()
	}
	for _, s := range ss {
		if v, ok := s.Metrics[metric]; ok && s.Repeat >= 0 && s.Repeat < repeats {
			out[s.Repeat] = v
		}
	}
	return out
}

func maxRepeat(ss ...[]Sample) int {
	n := 0
	for _, g := range ss {
		for _, s := range g {
			n = max(n, s.Repeat+1)
		}
	}
	return n
}

func buildRatio(k groupKey, base string, ss, bs []Sample) (Ratio, bool) {
	n := maxRepeat(ss, bs)
	r := Ratio{Mode: k.mode, Baseline: base, Workload: k.workload, SizeBytes: k.size, Values: map[string]float64{}}
	for _, m := range metricOrder {
		ratios := PairedRatios(byRepeat(ss, m.key, n), byRepeat(bs, m.key, n))
		if v, ok := Median(ratios); ok {
			r.Values[m.ratio] = v
			r.Pairs = max(r.Pairs, len(ratios))
		}
	}
	return r, len(r.Values) > 0
}

// splitProfile separates the measured runs from the profiling runs.
func splitProfile(ss []Sample) (measured, profile []Sample) {
	for _, s := range ss {
		if s.Profile {
			profile = append(profile, s)
		} else {
			measured = append(measured, s)
		}
	}
	return measured, profile
}

func buildResult(k groupKey, all []Sample, edges []float64) Result {
	ss, profile := splitProfile(all)
	r := Result{Mode: k.mode, Workload: k.workload, SizeBytes: k.size, Repeats: len(ss), Spread: map[string]MinMaxValue{}}
	med := map[string]float64{}
	for _, m := range metricOrder {
		var vals []float64
		for _, s := range ss {
			if v, ok := s.Metrics[m.key]; ok {
				vals = append(vals, v)
			}
		}
		if v, ok := Median(vals); ok {
			med[m.key] = v
			lo, hi, _ := MinMax(vals)
			r.Spread[m.key] = MinMaxValue{Min: round(lo, 4), Max: round(hi, 4)}
		}
	}
	ptr := func(key string) *float64 {
		if v, ok := med[key]; ok {
			v = round(v, 4)
			return &v
		}
		return nil
	}
	r.QPS = ptr(MetricQPS)
	lat := Latency{Avg: ptr(MetricLatencyAvg), P50: ptr(MetricLatencyP50), P90: ptr(MetricLatencyP90), P99: ptr(MetricLatencyP99)}
	if lat.Avg != nil || lat.P50 != nil {
		r.LatencyUS = &lat
	}
	r.BandwidthMBps = ptr(MetricBandwidth)
	r.CPUSecondsPer1kRequests = ptr(MetricCPUPer1kReqs)
	r.CPUSecondsPerGB = ptr(MetricCPUPerGB)
	for _, s := range ss {
		r.RequestsTotal += s.Requests
		r.ErrorsTotal += s.Errors
	}
	r.Hops = summarizeHops(ss, profile)
	if len(edges) > 1 {
		counts := make([]float64, len(edges)-1)
		any := false
		for _, s := range ss {
			if len(s.Histogram) == 0 {
				continue
			}
			any = true
			for i, c := range Rebin(s.Histogram, edges) {
				counts[i] += c
			}
		}
		if any {
			for i := range counts {
				counts[i] = round(counts[i], 3)
			}
			r.Histogram = &Histogram{EdgesUS: roundAll(edges, 4), Counts: counts}
		}
	}
	return r
}

// histogramEdges returns, per workload, log-spaced edges covering every
// run's histogram, so the modes of a workload overlay on the same bins.
func histogramEdges(samples []Sample) map[string][]float64 {
	lo, hi := map[string]float64{}, map[string]float64{}
	for _, s := range samples {
		for _, b := range s.Histogram {
			if b.Count == 0 {
				continue
			}
			start := math.Max(b.StartUS, 0.1)
			if v, ok := lo[s.Workload]; !ok || start < v {
				lo[s.Workload] = start
			}
			if v, ok := hi[s.Workload]; !ok || b.EndUS > v {
				hi[s.Workload] = b.EndUS
			}
		}
	}
	out := map[string][]float64{}
	for w, l := range lo {
		h := math.Max(hi[w], l*1.01)
		out[w] = LogEdges(l, h, 20)
	}
	return out
}

// summarizeHops summarises the agent's counters over the measured runs ss
// and its BPF cost over the profiling runs (over ss when there are none).
func summarizeHops(ss, profile []Sample) *HopsSummary {
	var ds []*AgentDelta
	for _, s := range ss {
		if s.Agent != nil {
			ds = append(ds, s.Agent)
		}
	}
	if len(ds) == 0 {
		return nil
	}
	h := &HopsSummary{Accelerated: []string{}, Counters: medianCounters(ds)}
	bpf := profile
	if len(bpf) == 0 {
		bpf = ss
	}
	var perReq []float64
	for _, s := range bpf {
		if s.Agent != nil && s.Requests > 0 && s.Agent.BPFRunSeconds > 0 {
			perReq = append(perReq, s.Agent.BPFRunSeconds*1e6/float64(s.Requests))
		}
	}
	h.BPFUSPerRequest, _ = Median(perReq)
	summarizeCost(h, ss, bpf)
	for n, c := range h.Hops {
		if c.RedirectedMessages > 0 {
			h.Accelerated = append(h.Accelerated, n)
		}
	}
	sort.Strings(h.Accelerated)
	h.PassthroughConnections = nil
	for _, d := range ds {
		for n, v := range d.PassthroughConnections {
			if h.PassthroughConnections == nil {
				h.PassthroughConnections = map[string]uint64{}
			}
			h.PassthroughConnections[n] = max(h.PassthroughConnections[n], v)
		}
	}
	return h
}

// medianCounters is, counter by counter of the model and label by label,
// the median of ds (rounded), without the zero entries of maps by reason.
func medianCounters(ds []*AgentDelta) accel.Counters {
	var m accel.Counters
	for _, k := range accel.CounterModel() {
		labels := map[string]bool{}
		for _, d := range ds {
			for l := range k.Values(d.Counters) {
				labels[l] = true
			}
		}
		for l := range labels {
			v := make([]float64, len(ds))
			for i, d := range ds {
				v[i] = float64(k.Values(d.Counters)[l])
			}
			med, _ := Median(v)
			k.Set(&m, l, uint64(math.Round(med)))
		}
	}
	return m.NonZero()
}

// FindResult returns the result of mode x workload x size.
func (r *Report) FindResult(mode, workload string, size int) *Result {
	for i := range r.Results {
		x := &r.Results[i]
		if x.Mode == mode && x.Workload == workload && x.SizeBytes == size {
			return x
		}
	}
	return nil
}

// FindRatio returns the ratio of mode against baseline.
func (r *Report) FindRatio(mode, baseline, workload string, size int) *Ratio {
	for i := range r.Ratios {
		x := &r.Ratios[i]
		if x.Mode == mode && x.Baseline == baseline && x.Workload == workload && x.SizeBytes == size {
			return x
		}
	}
	return nil
}

// WriteJSON writes the report, indented.
func (r *Report) WriteJSON(w io.Writer) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(r)
}

// WriteJSONFile writes the report to path.
func (r *Report) WriteJSONFile(path string) error {
	f, err := os.Create(path)
	if err != nil {
		return fmt.Errorf("create json report: %w", err)
	}
	if err := r.WriteJSON(f); err != nil {
		f.Close()
		return fmt.Errorf("write json report %s: %w", path, err)
	}
	return f.Close()
}

func round(v float64, digits int) float64 {
	if v == 0 || math.IsNaN(v) || math.IsInf(v, 0) {
		return v
	}
	// keep `digits` significant digits after the decimal point for small
	// values and full integers for large ones
	p := math.Pow(10, float64(digits))
	if math.Abs(v) < 1 {
		mag := math.Floor(math.Log10(math.Abs(v)))
		p = math.Pow(10, float64(digits)-mag-1)
	}
	return math.Round(v*p) / p
}

func roundAll(xs []float64, digits int) []float64 {
	out := make([]float64, len(xs))
	for i, x := range xs {
		out[i] = round(x, digits)
	}
	return out
}
