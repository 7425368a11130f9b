// SPDX-License-Identifier: Apache-2.0

package bench

import (
	"os"
	"testing"
)

// The fixtures are real qperf 0.4 output captured on loopback on this
// project's machine (qperf server and client on 127.0.0.1):
//
//	qperf_loop_vu.txt: qperf 127.0.0.1 -t 1 -oo msg_size:1:16K:*4 -vu tcp_lat tcp_bw
//	qperf_loop_v.txt:  same with -v (msg_rate, cpu use, costs)
//	qperf_4k_uu_v.txt: qperf 127.0.0.1 -t 1 -m 4K -uu -v tcp_lat tcp_bw (what bench runs)
func readFixture(t *testing.T, name string) string {
	t.Helper()
	b, err := os.ReadFile("testdata/" + name)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

func TestParseQperfHumanUnits(t *testing.T) {
	res, err := ParseQperf(readFixture(t, "qperf_loop_vu.txt"))
	if err != nil {
		t.Fatal(err)
	}
	if len(res) != 16 {
		t.Fatalf("got %d results, want 16 (8 sizes x 2 tests)", len(res))
	}
	first := res[0]
	if first.Test != "tcp_lat" || first.LatencyUS != 31.3 || first.MsgSizeBytes != 1 || first.TimeSeconds != 1 {
		t.Errorf("first = %+v", first)
	}
	// "16 KiB (16,384)": binary prefix
	if r := res[7]; r.MsgSizeBytes != 16384 || r.LatencyUS != 39.3 {
		t.Errorf("tcp_lat 16K = %+v", r)
	}
	// "1.22 MB/sec": decimal prefix
	if r := res[8]; r.Test != "tcp_bw" || r.BandwidthBytesPerSec != 1.22e6 || r.MsgSizeBytes != 1 {
		t.Errorf("tcp_bw 1 = %+v", r)
	}
	// "2.12 GB/sec"
	if r := res[14]; r.BandwidthBytesPerSec != 2.12e9 || r.MsgSizeBytes != 4096 {
		t.Errorf("tcp_bw 4K = %+v", r)
	}
	// "75 MB/sec" (no decimals)
	if r := res[11]; r.BandwidthBytesPerSec != 75e6 || r.MsgSizeBytes != 64 {
		t.Errorf("tcp_bw 64 = %+v", r)
	}
}

func TestParseQperfVerbose(t *testing.T) {
	res, err := ParseQperf(readFixture(t, "qperf_loop_v.txt"))
	if err != nil {
		t.Fatal(err)
	}
	if len(res) != 16 {
		t.Fatalf("got %d results", len(res))
	}
	for _, r := range res {
		if r.MsgRatePerSec <= 0 || r.LocCPUs <= 0 || r.TimeSeconds != 1 {
			t.Errorf("missing verbose fields: %+v", r)
		}
		if r.Test == "tcp_lat" && r.LatencyUS <= 0 || r.Test == "tcp_bw" && r.BandwidthBytesPerSec <= 0 {
			t.Errorf("missing value: %+v", r)
		}
	}
}

func TestParseQperfUnifiedUnits(t *testing.T) {
	res, err := ParseQperf(readFixture(t, "qperf_4k_uu_v.txt"))
	if err != nil {
		t.Fatal(err)
	}
	if len(res) != 2 {
		t.Fatalf("got %d results", len(res))
	}
	lat, bw := res[0], res[1]
	if lat.Test != "tcp_lat" || !near(lat.LatencyUS, 35.137, 1e-9) || lat.MsgRatePerSec != 28460 ||
		lat.MsgSizeBytes != 4096 || lat.TimeSeconds != 1 || lat.LocCPUs != 0.54 {
		t.Errorf("tcp_lat = %+v", lat)
	}
	if bw.Test != "tcp_bw" || bw.BandwidthBytesPerSec != 1954615296 || bw.MsgRatePerSec != 477201 || bw.LocCPUs != 1.61 {
		t.Errorf("tcp_bw = %+v", bw)
	}
}

func TestParseQperfErrors(t *testing.T) {
	for _, out := range []string{
		"",
		"127.0.0.1: failed to connect\n",
		"tcp_lat:\n    latency = 12 parsecs\n",
		"    latency = 12 us\n",
	} {
		if _, err := ParseQperf(out); err == nil {
			t.Errorf("ParseQperf(%q) accepted", out)
		}
	}
	// -ub bits per second
	res, err := ParseQperf("tcp_bw:\n    bw        =     9.9 Mb/sec\n    msg_size  =       1 bytes\n")
	if err != nil || !near(res[0].BandwidthBytesPerSec, 9.9e6/8, 1e-6) {
		t.Errorf("bits: %+v %v", res, err)
	}
}
