// SPDX-License-Identifier: Apache-2.0

package bench

import (
	"context"
	"fmt"
	"math"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"
)

func TestParseCurlTransfer(t *testing.T) {
	x, err := ParseCurlTransfer("200 67108864 0.081234")
	if err != nil {
		t.Fatal(err)
	}
	if x.HTTPCode != 200 || x.Bytes != 67108864 || x.Seconds != 0.081234 {
		t.Fatalf("%+v", x)
	}
	// curl prints 000 and what it got when the connection failed
	if x, err := ParseCurlTransfer("000 0 0.000412\n"); err != nil || x.HTTPCode != 0 || x.Bytes != 0 {
		t.Errorf("%+v, %v", x, err)
	}
	for _, bad := range []string{"", "200 67108864", "200 67108864 0.08 extra", "200 x 0.08", "ok 1 0.08", "200 1 fast", "curl: (7) Failed to connect"} {
		if _, err := ParseCurlTransfer(bad); err == nil {
			t.Errorf("%q: no error", bad)
		}
	}
}

func TestBulkSample(t *testing.T) {
	s := BulkSample(ModeSidecar, 1, []float64{0.1, 0.3, 0.2}, 0.7, 0.5)
	if s.Workload != WorkloadBulk || s.Requests != 3 || s.Repeat != 1 || s.DurationSeconds != 0.7 {
		t.Fatalf("%+v", s)
	}
	// 3 files in 0.6 s
	if bw := s.Metrics[MetricBandwidth]; math.Abs(bw-3*BulkBytes/1e6/0.6) > 1e-9 {
		t.Errorf("bandwidth %v MB/s", bw)
	}
	if avg, p50 := s.Metrics[MetricLatencyAvg], s.Metrics[MetricLatencyP50]; math.Abs(avg-200000) > 1e-6 || p50 != 200000 {
		t.Errorf("avg %v us, p50 %v us", avg, p50)
	}
	// bandwidth x time per transfer is the file
	if b := s.Metrics[MetricBandwidth] * 1e6 * s.Metrics[MetricLatencyAvg] / 1e6; math.Abs(b-BulkBytes) > 1 {
		t.Errorf("bandwidth x time per transfer = %v bytes, want %d", b, BulkBytes)
	}
	if c := s.Metrics[MetricCPUPerGB]; math.Abs(c-0.5/(3*BulkBytes/1e9)) > 1e-12 {
		t.Errorf("cpu %v s/GB", c)
	}
	if _, ok := s.Metrics[MetricQPS]; ok {
		t.Error("bulk reports no qps")
	}
	if s := BulkSample(ModeSidecar, 0, nil, 1, 1); len(s.Metrics) != 0 || s.Requests != 0 {
		t.Errorf("no transfer: %+v", s)
	}
}

// TestRunBulkOnLoopback runs the bulk workload with nginx and curl on
// loopback: every transfer downloads the whole file, the table shows it,
// and nginx and its temp dir are gone afterwards.
func TestRunBulkOnLoopback(t *testing.T) {
	for _, bin := range []string{"nginx", "curl", "ss"} {
		if _, err := exec.LookPath(bin); err != nil {
			t.Skipf("%s not installed (scripts/install-deps.sh installs it)", bin)
		}
	}
	tmp := t.TempDir()
	t.Setenv("TMPDIR", tmp)
	env := newLoopEnv(t)
	modes := []string{ModeDirect, ModeSidecar, ModeSidecarMeshwarp}
	opts := Options{Duration: 200 * time.Millisecond, Repeat: 2, Modes: modes, Workloads: []string{WorkloadBulk}, NoBPFStats: true}
	rep, err := Run(context.Background(), opts, env, (&fakeAgent{}).start, nil)
	if err != nil {
		t.Fatal(err)
	}
	if len(rep.Failures) > 0 {
		t.Fatalf("failures: %v", rep.Failures)
	}
	for _, m := range modes {
		r := rep.FindResult(m, WorkloadBulk, 0)
		if r == nil || r.RequestsTotal < 2 || r.ErrorsTotal != 0 || r.BandwidthMBps == nil || r.LatencyUS == nil || r.LatencyUS.Avg == nil {
			t.Fatalf("%s: %+v", m, r)
		}
	}
	for _, s := range rep.Runs {
		if b := s.Metrics[MetricBandwidth] * s.Metrics[MetricLatencyAvg]; s.Workload == WorkloadBulk && math.Abs(b-BulkBytes) > 1 {
			t.Errorf("%s repeat %d: bandwidth x time per transfer = %.0f bytes, want %d", s.Mode, s.Repeat, b, BulkBytes)
		}
	}
	if x := rep.FindRatio(ModeSidecarMeshwarp, ModeSidecar, WorkloadBulk, 0); x == nil || x.Values["bandwidth_ratio"] <= 0 {
		t.Errorf("no bandwidth ratio: %+v", x)
	}
	if want := fmt.Sprintf("http://127.0.0.1:%d/%s", BulkPort, bulkFile); rep.Config.BulkURL != want {
		t.Errorf("bulk url %q", rep.Config.BulkURL)
	}
	var buf strings.Builder
	if err := rep.WriteTable(&buf); err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"bulk: curl downloads a 64 MiB file", "MB/s vs sidecar", "time vs direct"} {
		if !strings.Contains(buf.String(), want) {
			t.Errorf("table has no %q:\n%s", want, buf.String())
		}
	}
	t.Log("\n" + buf.String())
	if left, _ := os.ReadDir(tmp); len(left) > 0 {
		t.Errorf("left in the temp dir: %v", left)
	}
	if out, _ := exec.Command("ss", "-Hltn", fmt.Sprintf("sport = :%d", BulkPort)).Output(); len(strings.TrimSpace(string(out))) > 0 {
		t.Errorf("nginx still listens on :%d: %s", BulkPort, out)
	}
}
