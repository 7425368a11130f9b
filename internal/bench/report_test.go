// SPDX-License-Identifier: Apache-2.0

package bench

import (
	"bytes"
	"encoding/json"
	"runtime"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/santhosh-tekuri/jsonschema/v6"
	"golang.org/x/sys/unix"

	"github.com/meshwarp/meshwarp/internal/accel"
	"github.com/meshwarp/meshwarp/internal/observe"
)

// fixedHistogram is a small fortio-like histogram centred on center us.
func fixedHistogram(center float64, n int64) []Bucket {
	return []Bucket{
		{center * 0.5, center * 0.8, n / 10},
		{center * 0.8, center, n * 4 / 10},
		{center, center * 1.5, n * 4 / 10},
		{center * 1.5, center * 4, n / 10},
	}
}

// fixtureReport builds a report from fixed samples: every mode, every
// workload, 3 repeats, sizes 64 and 16K.
func fixtureReport(t *testing.T) *Report {
	t.Helper()
	qpsBase := map[string]float64{ModeDirect: 20000, ModeSidecar: 8000, ModeSidecarMeshwarp: 14000, ModeDirectMeshwarp: 26000}
	var samples []Sample
	for rep := range 3 {
		noise := []float64{1, 0.9, 1.1}[rep] // the whole machine slower or faster per repeat
		for _, m := range AllModes {
			for _, w := range []string{WorkloadHTTP, WorkloadTCP} {
				qps := qpsBase[m] * noise
				if w == WorkloadTCP {
					qps *= 2
				}
				res := WorkerResult{
					Requests: int64(qps * 10), DurationSeconds: 10,
					AvgUS: 64e6 / qps, Histogram: fixedHistogram(64e6/qps, int64(qps*10)),
				}
				s := FortioSample(m, w, rep, res, 0.05*qps*10/1000)
				if ModeAgent(m) {
					s.Agent = deltaOf(accel.Stats{Counters: accel.Counters{
						PairedSockets: 200, RedirectedMessages: 1000, RedirectedBytes: 1e6, NATPortRemaps: 3,
						PassthroughConnections: map[string]uint64{"hint_missed": 1, "policy": 0},
						Hops:                   map[string]HopCounters{"app_to_sidecar": {PairedConnections: 64, RedirectedMessages: 500, RedirectedBytes: 5e5}, "sidecar_to_sidecar": {PairedConnections: 64, RedirectedMessages: 500, RedirectedBytes: 5e5}, "direct": {}},
					}})
				}
				samples = append(samples, s)
			}
			speed := map[string]float64{ModeDirect: 1, ModeSidecar: 0.5, ModeSidecarMeshwarp: 0.7, ModeDirectMeshwarp: 1.5}[m]
			for _, size := range []int{64, 16384} {
				lat := QperfResult{Test: "tcp_lat", LatencyUS: 30 / noise / speed, MsgRatePerSec: 1e6 / (30 / noise), MsgSizeBytes: int64(size), TimeSeconds: 1}
				bw := QperfResult{Test: "tcp_bw", BandwidthBytesPerSec: float64(size) * 1e5 * noise * speed, MsgSizeBytes: int64(size), TimeSeconds: 1}
				samples = append(samples, QperfSample(m, rep, size, lat, 0.5, bw, 0.8))
			}
		}
		for _, size := range []int{64, 16384} {
			samples = append(samples, UnixSample(rep, UnixResult{
				MsgSizeBytes: int64(size), LatencyUS: 5, MsgRatePerSec: 2e5, RoundTrips: 1e5, LatSeconds: 1, LatCPUSeconds: 1,
				BandwidthBytesPerSec: 2e9, StreamBytes: 2e9, BWSeconds: 1, BWCPUSeconds: 1,
			}))
		}
	}
	opts := Options{Sizes: []int{64, 16384}}
	if err := opts.Normalize(); err != nil {
		t.Fatal(err)
	}
	r := &runner{opts: opts, env: fakeEnv{}}
	cfg := r.config()
	cfg.Command = "meshwarp bench (fixture)"
	m := Machine{Kernel: "6.18.0-test", CPUs: 2, Model: "Test CPU", Go: "go1.26", MeshwarpVersion: "dev", Date: time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC).Format(time.RFC3339)}
	return BuildReport(m, cfg, samples, AllModes)
}

func TestBuildReportMediansAndRatios(t *testing.T) {
	rep := fixtureReport(t)
	// 4 modes x (http, tcp, qperf 64, qperf 16K) + floor x 2 sizes
	if got := len(rep.Results); got != 4*4+2 {
		t.Fatalf("%d results", got)
	}
	side := rep.FindResult(ModeSidecar, WorkloadHTTP, 0)
	if side == nil || side.Repeats != 3 || *side.QPS != 8000 {
		t.Fatalf("sidecar http = %+v", side)
	}
	if s := side.Spread[MetricQPS]; s.Min != 7200 || s.Max != 8800 {
		t.Errorf("spread %+v", s)
	}
	if side.LatencyUS == nil || side.LatencyUS.P50 == nil || side.LatencyUS.P99 == nil || side.Histogram == nil {
		t.Fatalf("latency/histogram missing: %+v", side)
	}
	if side.Hops != nil || side.BandwidthMBps != nil || side.SizeBytes != 0 {
		t.Errorf("keys that do not apply are present: %+v", side)
	}
	acc := rep.FindResult(ModeSidecarMeshwarp, WorkloadTCP, 0)
	if acc.Hops == nil || strings.Join(acc.Hops.Accelerated, ",") != "app_to_sidecar,sidecar_to_sidecar" {
		t.Errorf("hops = %+v", acc.Hops)
	}
	// per-repeat noise cancels out in paired ratios
	r := rep.FindRatio(ModeSidecarMeshwarp, ModeSidecar, WorkloadHTTP, 0)
	if r == nil || !near(r.Values["qps_ratio"], 1.75, 1e-9) || r.Pairs != 3 {
		t.Fatalf("ratio = %+v", r)
	}
	if v := r.Values["latency_p50_ratio"]; !near(v, 1/1.75, 1e-6) {
		t.Errorf("p50 ratio %v", v)
	}
	if r := rep.FindRatio(ModeSidecar, ModeDirect, WorkloadHTTP, 0); r == nil || !near(r.Values["qps_ratio"], 0.4, 1e-9) {
		t.Errorf("sidecar vs direct = %+v", r)
	}
	if rep.FindRatio(ModeSidecar, ModeSidecar, WorkloadHTTP, 0) != nil {
		t.Error("ratio of the baseline with itself")
	}
	q := rep.FindResult(ModeDirect, WorkloadQperf, 16384)
	if q == nil || q.LatencyUS.Avg == nil || *q.LatencyUS.Avg != 30 || q.LatencyUS.P50 != nil || *q.BandwidthMBps != 1638.4 {
		t.Fatalf("qperf = %+v %+v", q, q.LatencyUS)
	}
	// 1e6/30 messages/s one way = 16667 round trips/s
	if !near(*q.QPS, 1e6/30/2, 1e-3) {
		t.Errorf("qperf qps %v", *q.QPS)
	}
	if f := rep.FindResult(ModeFloor, WorkloadUnix, 64); f == nil || *f.CPUSecondsPer1kRequests != 0.01 || *f.CPUSecondsPerGB != 0.5 {
		t.Errorf("floor = %+v", f)
	}
}

func validateSchema(t *testing.T, doc []byte) {
	t.Helper()
	c := jsonschema.NewCompiler()
	sch, err := c.Compile("../../docs/bench-schema.json")
	if err != nil {
		t.Fatalf("compile schema: %v", err)
	}
	inst, err := jsonschema.UnmarshalJSON(bytes.NewReader(doc))
	if err != nil {
		t.Fatal(err)
	}
	if err := sch.Validate(inst); err != nil {
		t.Fatalf("report does not follow docs/bench-schema.json: %v", err)
	}
}

func TestReportJSONFollowsSchema(t *testing.T) {
	rep := fixtureReport(t)
	var buf bytes.Buffer
	if err := rep.WriteJSON(&buf); err != nil {
		t.Fatal(err)
	}
	validateSchema(t, buf.Bytes())

	var doc map[string]any
	if err := json.Unmarshal(buf.Bytes(), &doc); err != nil {
		t.Fatal(err)
	}
	results := doc["results"].([]any)
	first := results[0].(map[string]any)
	for _, k := range []string{"mode", "workload", "repeats", "qps", "latency_us", "cpu_seconds_per_1k_requests", "spread", "histogram_us"} {
		if _, ok := first[k]; !ok {
			t.Errorf("http result lacks %q: %v", k, first)
		}
	}
	for _, k := range []string{"size_bytes", "bandwidth_MBps", "hops"} {
		if _, ok := first[k]; ok {
			t.Errorf("http direct result has %q", k)
		}
	}
	ratio := doc["ratios"].([]any)[0].(map[string]any)
	if _, ok := ratio["qps_ratio"]; !ok {
		t.Errorf("ratio lacks qps_ratio: %v", ratio)
	}

	// the report reads back
	var back Report
	if err := json.Unmarshal(buf.Bytes(), &back); err != nil {
		t.Fatal(err)
	}
	if r := back.FindRatio(ModeSidecarMeshwarp, ModeSidecar, WorkloadHTTP, 0); r == nil || !near(r.Values["qps_ratio"], 1.75, 1e-9) {
		t.Errorf("ratio read back: %+v", r)
	}

	// the schema rejects what it should
	bad := strings.Replace(buf.String(), `"workload": "http"`, `"workload": "grpc"`, 1)
	c := jsonschema.NewCompiler()
	sch := c.MustCompile("../../docs/bench-schema.json")
	inst, _ := jsonschema.UnmarshalJSON(strings.NewReader(bad))
	if sch.Validate(inst) == nil {
		t.Error("schema accepted an unknown workload")
	}
}

func TestReportTable(t *testing.T) {
	rep := fixtureReport(t)
	var buf bytes.Buffer
	if err := rep.WriteTable(&buf); err != nil {
		t.Fatal(err)
	}
	out := buf.String()
	for _, want := range []string{
		"HTTP: fortio http://10.0.0.3:8080/echo?size=1024, 64 connections",
		"TCP echo: fortio tcp://10.0.0.3:8078",
		"sidecar+meshwarp", "direct+meshwarp", "af_unix floor", "16K", "x1.75", "x0.40",
		"accelerated hops: app_to_sidecar, sidecar_to_sidecar",
		"connections left to TCP (worst repeat): hint_missed 1",
		"[7200..8800]",
	} {
		if !strings.Contains(out, want) {
			t.Errorf("table lacks %q:\n%s", want, out)
		}
	}
	t.Log("\n" + out)

	// one repeat: no spread columns
	rep.Config.Repeat = 1
	buf.Reset()
	rep.WriteTable(&buf)
	if strings.Contains(buf.String(), "[min..max]") {
		t.Errorf("spread shown for a single repeat:\n%s", buf.String())
	}
	for _, tb := range rep.Tables() {
		for _, row := range tb.Rows {
			if len(row) != len(tb.Head) {
				t.Fatalf("%s: row %v has %d cells for %d columns", tb.Title, row, len(row), len(tb.Head))
			}
		}
	}
}

func TestParseSizes(t *testing.T) {
	got, err := ParseSizes([]string{"1", "64", " 1K", "16k", "1M"})
	if err != nil || !slices.Equal(got, []int{1, 64, 1024, 16384, 1 << 20}) {
		t.Fatalf("ParseSizes = %v, %v", got, err)
	}
	for _, bad := range []string{"", "K", "-1", "0", "1G", "12.5"} {
		if _, err := ParseSizes([]string{bad}); err == nil {
			t.Errorf("ParseSizes(%q) accepted", bad)
		}
	}
}

func TestNormalizeRejects(t *testing.T) {
	for _, o := range []Options{
		{Modes: []string{"turbo"}},
		{Workloads: []string{"grpc"}},
		{Repeat: -1},
		{Duration: time.Millisecond},
		{Sizes: []int{0}},
		{Workloads: []string{WorkloadQperf}, QperfCPU: new(-1)},
		{Workloads: []string{WorkloadQperf}, QperfCPU: new(runtime.NumCPU())},
		{Workloads: []string{WorkloadHTTP}, QperfCPU: new(0)}, // nothing to pin
	} {
		if err := o.Normalize(); err == nil {
			t.Errorf("Normalize accepted %+v", o)
		}
	}
	o := Options{Modes: []string{ModeSidecar, ModeSidecar}, Sizes: []int{16384, 1}}
	if err := o.Normalize(); err != nil || len(o.Modes) != 1 || o.Sizes[0] != 1 || o.QperfDuration != 3*time.Second {
		t.Errorf("Normalize = %+v, %v", o, err)
	}
}

// The table's breakdown is the fullest one: the profiling run's, which
// observes client reads, when the measured runs did not (a segment short).
func TestBreakdownFromProfilingRun(t *testing.T) {
	seg := func(names ...string) *observe.Breakdown {
		b := &observe.Breakdown{ClientMeanSeconds: 1e-3}
		for _, n := range names {
			b.Segments = append(b.Segments, observe.Segment{Name: n, MeanSeconds: 1e-4})
		}
		return b
	}
	measured := Sample{Mode: ModeSidecarMeshwarp, Workload: WorkloadHTTP, Observed: &Observation{Breakdown: seg("app -> sidecar (kernel)")}}
	profile := Sample{Mode: ModeSidecarMeshwarp, Workload: WorkloadHTTP, Profile: true,
		Observed: &Observation{Breakdown: seg("socket -> client app (wakeup, read)", "app -> sidecar (kernel)")}}
	for _, tc := range []struct {
		name     string
		runs     []Sample
		want     string
		fromProf bool
	}{
		{"measured runs without reads", []Sample{measured, profile}, "socket -> client app", true},
		{"measured runs with reads", []Sample{profile, {Mode: ModeSidecarMeshwarp, Workload: WorkloadHTTP, Observed: &Observation{Breakdown: profile.Observed.Breakdown}}}, "socket -> client app", false},
		{"no profiling pass", []Sample{measured}, "app -> sidecar", false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := &Report{Config: Config{Modes: []string{ModeSidecarMeshwarp}}, Runs: tc.runs}
			lines := r.breakdownLines()
			if len(lines) != 1 || !strings.Contains(lines[0], tc.want) || strings.Contains(lines[0], "profiling run") != tc.fromProf {
				t.Errorf("breakdown lines %q: want one with %q, from the profiling run: %v", lines, tc.want, tc.fromProf)
			}
		})
	}
}

// The client read tracepoint a profiling run attaches (for the breakdown)
// is in none of the agent's cost totals when the measured runs, like
// `meshwarp run`, do not attach it; it is listed apart.
func TestProfilingOnlyProgramOutOfTotals(t *testing.T) {
	d := &AgentDelta{
		BPFRunSeconds: 3e-3,
		BPFPrograms: map[string]BPFProgramDelta{
			"mw_skmsg":                {Runs: 1000, RunSeconds: 2e-3},
			accel.ReadObserverProgram: {Runs: 2000, RunSeconds: 1e-3},
		},
		WallSeconds: 1,
	}
	d.RedirectedMessages = 1000
	d.setProfilingOnly(accel.ReadObserverProgram)
	if d.BPFRunSeconds != 2e-3 || len(d.BPFPrograms) != 1 || d.BPFProgramsProfilingOnly[accel.ReadObserverProgram].Runs != 2000 {
		t.Fatalf("after setProfilingOnly: %+v", d)
	}
	h := &HopsSummary{}
	summarizeCost(h, nil, []Sample{{Agent: d, Requests: 500}})
	if h.BPFNSPerRedirectedMessage != 2000 {
		t.Errorf("ns per redirected message %v, want 2000 (mw_skmsg only)", h.BPFNSPerRedirectedMessage)
	}
	if p := h.BPFProgramsProfilingOnly[accel.ReadObserverProgram]; p.NSPerRun != 500 || p.RunsPerRequest != 4 {
		t.Errorf("profiling-only summary %+v, want 500 ns/run, 4 runs/request", p)
	}
	lines := programLines("sidecar+meshwarp", h)
	if len(lines) != 2 || strings.Contains(lines[0], accel.ReadObserverProgram) || !strings.Contains(lines[0], "all programs: 2000 ns") ||
		!strings.Contains(lines[1], accel.ReadObserverProgram) || !strings.Contains(lines[1], "in no total") {
		t.Errorf("program lines %q", lines)
	}
}

// --qperf-cpu's error names the CPUs the process may use, as ranges.
func TestCPUList(t *testing.T) {
	var set unix.CPUSet
	for _, cpu := range []int{0, 1, 2, 3, 6, 9, 10} {
		set.Set(cpu)
	}
	if got := cpuList(set); got != "0-3,6,9-10" {
		t.Errorf("cpuList = %q, want 0-3,6,9-10", got)
	}
	var allowed unix.CPUSet
	if err := unix.SchedGetaffinity(0, &allowed); err != nil {
		t.Fatal(err)
	}
	o := Options{Workloads: []string{WorkloadQperf}, QperfCPU: new(-1)}
	if err := o.Normalize(); err == nil || !strings.Contains(err.Error(), "give one of "+cpuList(allowed)) {
		t.Errorf("Normalize(--qperf-cpu -1) = %v: want the allowed CPUs (%s) named", err, cpuList(allowed))
	}
}
