// SPDX-License-Identifier: Apache-2.0

package bench_test

import (
	"bytes"
	"context"
	"encoding/json"
	"math"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/santhosh-tekuri/jsonschema/v6"

	"github.com/meshwarp/meshwarp/internal/bench"
	"github.com/meshwarp/meshwarp/internal/cli/full"
	"github.com/meshwarp/meshwarp/internal/lab"
	"github.com/meshwarp/meshwarp/internal/testutil"
)

// TestPrivilegedBenchQuick runs `meshwarp bench --quick` end to end through
// the CLI against a real lab (brought up by bench when none is up), with the
// real agent in the +meshwarp modes. The workers are this test binary
// re-executed inside the client pod (bench's init hook dispatches them).
// Set MESHWARP_KEEP_BENCH=DIR to keep the JSON, HTML and screenshot.
func TestPrivilegedBenchQuick(t *testing.T) {
	testutil.RequirePrivileged(t)
	for _, bin := range []string{"haproxy", "qperf", "iptables", "ip"} {
		if _, err := exec.LookPath(bin); err != nil {
			t.Fatalf("%s not installed: run scripts/install-deps.sh", bin)
		}
	}
	labWasUp := false
	if l, err := lab.Load(); err == nil {
		labWasUp = true
		l.Close()
		t.Log("a lab is already up: bench uses it and must leave it up")
	} else if left := lab.Leftovers(); len(left) > 0 {
		t.Fatalf("leftovers of an earlier lab (run `meshwarp lab down`): %v", left)
	}
	if bench.PinDirLeft(bench.DefaultPinDir) {
		t.Fatalf("%s exists before the test: run `meshwarp cleanup --pin-dir %s`", bench.DefaultPinDir, bench.DefaultPinDir)
	}

	dir := os.Getenv("MESHWARP_KEEP_BENCH")
	if dir == "" {
		dir = t.TempDir()
	} else if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	jsonPath := filepath.Join(dir, "bench.json")
	htmlPath := filepath.Join(dir, "bench.html")

	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	start := time.Now()
	stdout, stderr, err := runCLI(ctx, "bench", "--quick", "--json", jsonPath, "--html", htmlPath)
	t.Logf("bench --quick took %v\n%s", time.Since(start).Round(time.Second), stdout)
	if err != nil {
		t.Fatalf("bench --quick: %v\nstderr:\n%s", err, stderr)
	}

	// nothing left behind: agent pins, and the lab if bench brought it up
	if bench.PinDirLeft(bench.DefaultPinDir) {
		t.Errorf("agent pins left in %s", bench.DefaultPinDir)
	}
	if labWasUp {
		if _, err := lab.Load(); err != nil {
			t.Errorf("the lab that was up is gone: %v", err)
		}
	} else if left := lab.Leftovers(); len(left) > 0 {
		t.Errorf("bench left lab pieces behind: %v", left)
	}
	if procs := workerProcesses(t); len(procs) > 0 {
		t.Errorf("worker processes left: %v", procs)
	}

	rep := readReport(t, jsonPath)
	for _, n := range rep.Notes {
		t.Logf("note: %s", n)
	}
	checkQuickResults(t, rep)

	// the page of a real run opens and draws in Chromium too
	bench.RequireChromium(t)
	shot := bench.CheckHTMLInChromium(t, htmlPath, os.Getenv("MESHWARP_KEEP_BENCH"))
	t.Logf("screenshot %s", shot)
}

// runCLI runs the meshwarp CLI in this process, as a user would run the
// command, and returns what it printed.
func runCLI(ctx context.Context, args ...string) (stdout, stderr string, err error) {
	root := full.NewRootCommand()
	var out, errOut bytes.Buffer
	root.SetOut(&out)
	root.SetErr(&errOut)
	root.SetArgs(args)
	err = root.ExecuteContext(ctx)
	return out.String(), errOut.String(), err
}

// runBenchWorkloads runs `meshwarp bench` for a second of each of workloads
// (comma-separated) in every mode, fails if it fails or leaves agent pins
// behind, and returns the path of its JSON report.
func runBenchWorkloads(t *testing.T, workloads string) (jsonPath string) {
	t.Helper()
	jsonPath = filepath.Join(t.TempDir(), "bench.json")
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	stdout, stderr, err := runCLI(ctx, "bench", "--workloads", workloads, "--duration", "1s", "--repeat", "1", "--json", jsonPath)
	t.Logf("%s", stdout)
	if err != nil {
		t.Fatalf("bench: %v\nstderr:\n%s", err, stderr)
	}
	if bench.PinDirLeft(bench.DefaultPinDir) {
		t.Errorf("agent pins left in %s", bench.DefaultPinDir)
	}
	return jsonPath
}

// readReport reads the bench JSON at path, requires it to follow
// docs/bench-schema.json and reports the failed runs it lists.
func readReport(t *testing.T, path string) *bench.Report {
	t.Helper()
	doc, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	sch, err := jsonschema.NewCompiler().Compile("../../docs/bench-schema.json")
	if err != nil {
		t.Fatal(err)
	}
	inst, err := jsonschema.UnmarshalJSON(bytes.NewReader(doc))
	if err != nil {
		t.Fatal(err)
	}
	if err := sch.Validate(inst); err != nil {
		t.Fatalf("bench JSON does not follow docs/bench-schema.json: %v", err)
	}
	var rep bench.Report
	if err := json.Unmarshal(doc, &rep); err != nil {
		t.Fatal(err)
	}
	if len(rep.Failures) > 0 {
		t.Errorf("failed runs: %v", rep.Failures)
	}
	return &rep
}

func checkQuickResults(t *testing.T, rep *bench.Report) {
	t.Helper()
	if got := rep.Config.Modes; !slices.Equal(got, bench.AllModes) {
		t.Errorf("modes %v", got)
	}
	if got := rep.Config.Workloads; !slices.Equal(got, bench.AllWorkloads) {
		t.Errorf("workloads %v", got)
	}
	positive := func(what string, v *float64) {
		t.Helper()
		if v == nil || *v <= 0 {
			t.Errorf("%s: missing or zero", what)
		}
	}
	redirected := 0.0
	for _, m := range bench.AllModes {
		for _, w := range []string{bench.WorkloadHTTP, bench.WorkloadTCP} {
			r := rep.FindResult(m, w, 0)
			if r == nil {
				t.Errorf("no result for %s %s", m, w)
				continue
			}
			positive(m+" "+w+" qps", r.QPS)
			positive(m+" "+w+" cpu", r.CPUSecondsPer1kRequests)
			if r.LatencyUS == nil || r.Histogram == nil {
				t.Errorf("%s %s: no latency or histogram", m, w)
			} else {
				positive(m+" "+w+" p50", r.LatencyUS.P50)
				positive(m+" "+w+" p99", r.LatencyUS.P99)
			}
			if bench.ModeAgent(m) {
				if r.Hops == nil {
					t.Errorf("%s %s: no hop counters", m, w)
				} else {
					redirected += float64(r.Hops.RedirectedMessages)
					t.Logf("%s %s: accelerated hops %v, %d redirected, %d passthrough", m, w, r.Hops.Accelerated, r.Hops.RedirectedMessages, r.Hops.PassthroughMessages)
				}
			}
		}
		// qperf: every mode qperf ran in (direct modes at least; capture
		// modes unless a note says qperf cannot pass the sidecars)
		if !bench.ModeCapture(m) && !slices.Contains(rep.Config.QperfModes, m) {
			t.Errorf("qperf did not run in %s", m)
		}
		if !slices.Contains(rep.Config.QperfModes, m) {
			if len(rep.Notes) == 0 {
				t.Errorf("qperf skipped %s without a note", m)
			}
			continue
		}
		for _, size := range rep.Config.SizesBytes {
			r := rep.FindResult(m, bench.WorkloadQperf, size)
			if r == nil {
				t.Errorf("no qperf result for %s at %d bytes", m, size)
				continue
			}
			positive(m+" qperf bandwidth", r.BandwidthMBps)
			if r.LatencyUS == nil {
				t.Errorf("%s qperf %d: no latency", m, size)
			} else {
				positive(m+" qperf latency", r.LatencyUS.Avg)
			}
		}
	}
	for _, size := range rep.Config.SizesBytes {
		r := rep.FindResult(bench.ModeFloor, bench.WorkloadUnix, size)
		if r == nil {
			t.Errorf("no unix floor at %d bytes", size)
			continue
		}
		positive("unix bandwidth", r.BandwidthMBps)
		positive("unix latency", r.LatencyUS.Avg)
	}
	if redirected == 0 {
		t.Error("the agent redirected no message in any +meshwarp run: was it attached to the lab cgroup?")
	}
	if r := rep.FindRatio(bench.ModeSidecarMeshwarp, bench.ModeSidecar, bench.WorkloadHTTP, 0); r == nil {
		t.Error("no sidecar+meshwarp vs sidecar ratio")
	}
}

// workerProcesses lists running bench workers (their environment selects
// the worker helper).
func workerProcesses(t *testing.T) []string {
	t.Helper()
	worker := []byte(lab.ReexecEnvFor(bench.WorkerHelper))
	return processes(t, func(pid string, _ []byte) bool {
		env, err := os.ReadFile(filepath.Join("/proc", pid, "environ"))
		return err == nil && bytes.Contains(env, worker)
	})
}

// TestPrivilegedBenchCostWorkloads runs the cost workloads (http-close,
// http-c1, tcp-c1, redis) for a second each in every mode against a real lab
// and the real agent: each gives non-zero figures in every mode, and the
// agent's modes report its BPF programs (sock_ops runs per connection of
// http-close, run time per redirected message) and its idle cost.
func TestPrivilegedBenchCostWorkloads(t *testing.T) {
	testutil.RequirePrivileged(t)
	requireBenchReady(t, "haproxy", "redis-server", "redis-benchmark", "iptables", "ip")
	jsonPath := runBenchWorkloads(t, "http-close,http-c1,tcp-c1,redis")
	if procs := workerProcesses(t); len(procs) > 0 {
		t.Errorf("worker processes left: %v", procs)
	}
	rep := readReport(t, jsonPath)
	rows := []string{bench.WorkloadHTTPClose, bench.WorkloadHTTPC1, bench.WorkloadTCPC1, bench.WorkloadRedis, bench.WorkloadRedisPipelined}
	for _, m := range bench.AllModes {
		for _, w := range rows {
			r := rep.FindResult(m, w, 0)
			if r == nil || r.QPS == nil || *r.QPS <= 0 || r.LatencyUS == nil || r.LatencyUS.P50 == nil || *r.LatencyUS.P50 <= 0 ||
				r.CPUSecondsPer1kRequests == nil || *r.CPUSecondsPer1kRequests <= 0 {
				t.Errorf("%s %s: missing or zero figures: %+v", m, w, r)
				continue
			}
			if !bench.ModeAgent(m) {
				continue
			}
			h := r.Hops
			if h == nil || h.Cost == nil || h.Cost.BPFCPUPercent <= 0 || h.Cost.ProcessRSSBytes <= 0 || h.Cost.BPFMemoryBytes <= 0 {
				t.Errorf("%s %s: no agent cost: %+v", m, w, h)
				continue
			}
			if h.RedirectedMessages == 0 || h.BPFNSPerRedirectedMessage <= 0 {
				t.Errorf("%s %s: %d messages redirected, %.0f ns of BPF per redirected message", m, w, h.RedirectedMessages, h.BPFNSPerRedirectedMessage)
			}
			if p, ok := h.BPFPrograms["mw_sockops"]; !ok || p.Runs <= 0 || p.NSPerRun <= 0 {
				t.Errorf("%s %s: no sock_ops statistics: %+v", m, w, h.BPFPrograms)
			}
			if p, ok := h.BPFPrograms["mw_skmsg"]; !ok || p.NSPerRedirectedMessage <= 0 {
				t.Errorf("%s %s: no sk_msg statistics: %+v", m, w, h.BPFPrograms)
			}
		}
		idle := rep.FindResult(m, bench.WorkloadIdle, 0)
		if bench.ModeAgent(m) && (idle == nil || idle.Hops == nil || idle.Hops.Cost == nil || idle.Hops.Cost.ProcessRSSBytes <= 0) {
			t.Errorf("%s: no idle cost: %+v", m, idle)
		}
	}
	// a connection per request: sock_ops runs at least once per connection
	if r := rep.FindResult(bench.ModeSidecarMeshwarp, bench.WorkloadHTTPClose, 0); r != nil && r.Hops != nil {
		if p := r.Hops.BPFPrograms["mw_sockops"]; p.RunsPerRequest < 1 {
			t.Errorf("http-close: %.2f sock_ops runs per request (connection), want >= 1", p.RunsPerRequest)
		}
	}
}

// TestPrivilegedBenchBulk runs the bulk workload (nginx in the server pod,
// curl in the client pod, 64 MiB per transfer) for a second in every mode
// against a real lab and the real agent: every transfer downloads the whole
// file, in every mode, and nothing is left behind (nginx, its temp dir).
func TestPrivilegedBenchBulk(t *testing.T) {
	testutil.RequirePrivileged(t)
	requireBenchReady(t, "haproxy", "nginx", "curl", "iptables", "ip")
	// the bench's temp dir goes here, to see that it is removed
	tmp := t.TempDir()
	t.Setenv("TMPDIR", tmp)
	jsonPath := runBenchWorkloads(t, "bulk")
	if left, _ := os.ReadDir(tmp); len(left) > 0 {
		t.Errorf("bench left in its temp dir: %v", left)
	}
	if procs := processesWith(t, tmp); len(procs) > 0 {
		t.Errorf("nginx left running: %v", procs)
	}
	rep := readReport(t, jsonPath)
	for _, m := range bench.AllModes {
		r := rep.FindResult(m, bench.WorkloadBulk, 0)
		if r == nil || r.RequestsTotal < 1 || r.ErrorsTotal != 0 || r.BandwidthMBps == nil || *r.BandwidthMBps <= 0 {
			t.Errorf("%s: no transfer: %+v", m, r)
			continue
		}
		if bench.ModeAgent(m) && (r.Hops == nil || r.Hops.RedirectedMessages == 0) {
			t.Errorf("%s: the agent redirected no message: %+v", m, r.Hops)
		}
	}
	// A transfer counts only with all its bytes; the sample's bandwidth and
	// time per transfer then multiply to the file's size.
	runs := 0
	for _, s := range rep.Runs {
		if s.Workload != bench.WorkloadBulk || s.Profile {
			continue
		}
		runs++
		if b := s.Metrics[bench.MetricBandwidth] * s.Metrics[bench.MetricLatencyAvg]; math.Abs(b-bench.BulkBytes) > 1 {
			t.Errorf("%s: bandwidth x time per transfer = %.0f bytes, want %d", s.Mode, b, bench.BulkBytes)
		}
	}
	if runs != len(bench.AllModes) {
		t.Errorf("%d bulk runs, want one per mode (%d)", runs, len(bench.AllModes))
	}
}

// processesWith lists the processes whose command line contains s.
func processesWith(t *testing.T, s string) []string {
	t.Helper()
	return processes(t, func(_ string, cmdline []byte) bool { return bytes.Contains(cmdline, []byte(s)) })
}

// processes lists the processes that match accepts (given its pid and
// command line), as "pid: command line".
func processes(t *testing.T, match func(pid string, cmdline []byte) bool) []string {
	t.Helper()
	var out []string
	entries, err := os.ReadDir("/proc")
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range entries {
		cmd, _ := os.ReadFile(filepath.Join("/proc", e.Name(), "cmdline")) // a process gone by now: empty
		if match(e.Name(), cmd) {
			out = append(out, e.Name()+": "+strings.ReplaceAll(string(cmd), "\x00", " "))
		}
	}
	return out
}

// requireBenchReady fails unless the programs bins are installed, no earlier
// lab left anything behind and no bench agent is pinned: a bench test
// starts from a clean machine.
func requireBenchReady(t *testing.T, bins ...string) {
	t.Helper()
	for _, bin := range bins {
		if _, err := exec.LookPath(bin); err != nil {
			t.Fatalf("%s not installed: run scripts/install-deps.sh", bin)
		}
	}
	if _, err := lab.Load(); err != nil {
		if left := lab.Leftovers(); len(left) > 0 {
			t.Fatalf("leftovers of an earlier lab (run `meshwarp lab down`): %v", left)
		}
	}
	if bench.PinDirLeft(bench.DefaultPinDir) {
		t.Fatalf("%s exists before the test: run `meshwarp cleanup --pin-dir %s`", bench.DefaultPinDir, bench.DefaultPinDir)
	}
}
