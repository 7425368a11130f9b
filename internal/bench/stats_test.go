// SPDX-License-Identifier: Apache-2.0

package bench

import (
	"math"
	"testing"

	"fortio.org/fortio/stats"
)

func near(a, b, tol float64) bool { return math.Abs(a-b) <= tol }

func TestMedian(t *testing.T) {
	for _, tc := range []struct {
		in   []float64
		want float64
		ok   bool
	}{
		{nil, 0, false},
		{[]float64{math.NaN()}, 0, false},
		{[]float64{3}, 3, true},
		{[]float64{3, 1, 2}, 2, true},
		{[]float64{4, 1, 3, 2}, 2.5, true},
		{[]float64{5, math.NaN(), 1, 3}, 3, true},
		{[]float64{1, math.Inf(1), 2}, 1.5, true},
	} {
		got, ok := Median(tc.in)
		if ok != tc.ok || got != tc.want {
			t.Errorf("Median(%v) = %v, %v; want %v, %v", tc.in, got, ok, tc.want, tc.ok)
		}
	}
	in := []float64{3, 1, 2}
	Median(in)
	if in[0] != 3 || in[1] != 1 {
		t.Errorf("Median sorted its input in place: %v", in)
	}
}

func TestMinMax(t *testing.T) {
	lo, hi, ok := MinMax([]float64{4, math.NaN(), -1, 7})
	if !ok || lo != -1 || hi != 7 {
		t.Errorf("MinMax = %v %v %v", lo, hi, ok)
	}
	if _, _, ok := MinMax(nil); ok {
		t.Error("MinMax(nil) ok")
	}
}

func TestPercentileFromBuckets(t *testing.T) {
	// 10 samples: 1 in [10,20], 4 in (20,30], 5 in (30,50]
	b := []Bucket{{10, 20, 1}, {20, 30, 4}, {30, 50, 5}}
	for _, tc := range []struct{ p, want float64 }{
		{5, 10},    // below 100/count: the minimum
		{10, 10},   // first sample sits at the minimum
		{50, 30},   // end of the second bucket (cumulative 50%)
		{30, 25},   // halfway through the second bucket (10%..50%)
		{75, 40},   // halfway through the third (50%..100%)
		{99, 49.6}, // near the max
		{100, 50},  // the max
	} {
		got, ok := PercentileFromBuckets(b, tc.p)
		if !ok || !near(got, tc.want, 1e-9) {
			t.Errorf("p%g = %v (%v), want %v", tc.p, got, ok, tc.want)
		}
	}
	if _, ok := PercentileFromBuckets(nil, 50); ok {
		t.Error("empty histogram gave a percentile")
	}
	if got, _ := PercentileFromBuckets([]Bucket{{0, 5, 0}, {7, 7, 3}, {9, 9, 0}}, 50); got != 7 {
		t.Errorf("single-value histogram p50 = %v, want 7", got)
	}
}

// TestPercentileMatchesFortio checks our interpolation against fortio's own
// on a histogram fortio built (fixed values, no randomness).
func TestPercentileMatchesFortio(t *testing.T) {
	h := stats.NewHistogram(0, 0.00001)
	for i := range 1000 {
		// a skewed distribution between 20 us and ~4 ms
		v := 20e-6 + math.Pow(float64(i)/1000, 4)*4e-3
		h.Record(v)
	}
	d := h.Export()
	var buckets []Bucket
	for _, b := range d.Data {
		buckets = append(buckets, Bucket{StartUS: b.Start * 1e6, EndUS: b.End * 1e6, Count: b.Count})
	}
	for _, p := range []float64{0.05, 1, 10, 50, 90, 99, 99.9, 100} {
		want := d.CalcPercentile(p) * 1e6
		got, ok := PercentileFromBuckets(buckets, p)
		if !ok || !near(got, want, 1e-6*math.Max(1, want)) {
			t.Errorf("p%g: ours %v, fortio %v", p, got, want)
		}
	}
}

func TestLogEdges(t *testing.T) {
	e := LogEdges(12, 1000, 10)
	if e[0] > 12 || e[len(e)-1] < 1000 {
		t.Fatalf("edges %v do not cover [12, 1000]", e)
	}
	for i := 1; i < len(e); i++ {
		if r := e[i] / e[i-1]; !near(r, math.Pow(10, 0.1), 1e-9) {
			t.Fatalf("edge ratio %v at %d", r, i)
		}
	}
	if LogEdges(0, 10, 10) != nil || LogEdges(10, 5, 10) != nil {
		t.Error("invalid ranges gave edges")
	}
}

func TestRebin(t *testing.T) {
	b := []Bucket{{10, 20, 10}, {20, 40, 20}, {40, 40, 5}}
	edges := []float64{10, 15, 30, 40}
	got := Rebin(b, edges)
	want := []float64{5, 5 + 10, 10 + 5} // [10,15): half of the first; [15,30): other half + half of second; [30,40]: rest + the point at 40
	for i := range want {
		if !near(got[i], want[i], 1e-9) {
			t.Fatalf("Rebin = %v, want %v", got, want)
		}
	}
	// mass outside the edges lands in the end bins, nothing is lost
	got = Rebin([]Bucket{{1, 3, 4}, {100, 200, 6}}, []float64{2, 10, 50})
	if !near(got[0], 4, 1e-9) || !near(got[1], 6, 1e-9) {
		t.Fatalf("Rebin clamp = %v", got)
	}
}

func TestPairedRatios(t *testing.T) {
	v := []float64{200, 300, math.NaN(), 100}
	b := []float64{100, 100, 50, 0}
	got := PairedRatios(v, b)
	if len(got) != 2 || got[0] != 2 || got[1] != 3 {
		t.Fatalf("PairedRatios = %v", got)
	}
	m, ok := MedianPairedRatio([]float64{110, 90, 130}, []float64{100, 100, 100})
	if !ok || !near(m, 1.1, 1e-12) {
		t.Fatalf("median ratio %v", m)
	}
	// pairing matters: the median of ratios is not the ratio of medians
	m, _ = MedianPairedRatio([]float64{10, 20, 40}, []float64{5, 40, 20})
	if m != 2 {
		t.Fatalf("median of paired ratios = %v, want 2", m)
	}
}

func TestParseCPUStat(t *testing.T) {
	got, err := parseCPUStat([]byte("usage_usec 1500000\nuser_usec 1000000\nsystem_usec 500000\n"))
	if err != nil || got != 1.5 {
		t.Fatalf("parseCPUStat = %v, %v", got, err)
	}
	if _, err := parseCPUStat([]byte("nr_periods 0\n")); err == nil {
		t.Fatal("missing usage_usec accepted")
	}
}
