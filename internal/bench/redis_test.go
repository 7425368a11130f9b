// SPDX-License-Identifier: Apache-2.0

package bench

import "testing"

func TestParseRedisBenchmarkCSV(t *testing.T) {
	out := `"test","rps","avg_latency_ms","min_latency_ms","p50_latency_ms","p95_latency_ms","p99_latency_ms","max_latency_ms"
"SET","50000.00","0.400","0.096","0.375","0.639","0.800","2.815"
"GET","100000.00","0.200","0.040","0.225","0.671","1.200","129.279"
`
	res, err := ParseRedisBenchmarkCSV(out)
	if err != nil {
		t.Fatal(err)
	}
	if len(res) != 2 || res[0].Test != "SET" || res[1].RPS != 100000 || res[0].P99MS != 0.8 {
		t.Fatalf("%+v", res)
	}
	s := RedisSample(ModeSidecar, WorkloadRedis, 0, 10000, res, 0.5)
	// 20000 requests in 0.2 s + 0.1 s
	if q := s.Metrics[MetricQPS]; q < 66666 || q > 66667 {
		t.Errorf("qps %v", q)
	}
	if v := s.Metrics[MetricLatencyP50]; v != 300 {
		t.Errorf("p50 %v us, want the mean of 375 and 225", v)
	}
	if s.Requests != 20000 || s.Metrics[MetricCPUPer1kReqs] != 0.025 {
		t.Errorf("requests %d, cpu %v", s.Requests, s.Metrics[MetricCPUPer1kReqs])
	}
	for _, bad := range []string{"", `"test","rps"` + "\n" + `"SET","x"` + "\n", "ERROR: connection refused\n"} {
		if _, err := ParseRedisBenchmarkCSV(bad); err == nil {
			t.Errorf("%q: no error", bad)
		}
	}
}
