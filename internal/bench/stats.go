// SPDX-License-Identifier: Apache-2.0

package bench

import (
	"math"
	"sort"
)

// Pure statistics used by the report: no I/O, no clocks, unit-tested on
// fixed data in stats_test.go.

// Bucket is one histogram bucket: values in [StartUS, EndUS] (microseconds),
// Count samples. A list of buckets is sorted by StartUS and does not overlap,
// as fortio exports them (first Start = min sample, last End = max sample).
type Bucket struct {
	StartUS float64 `json:"start_us"`
	EndUS   float64 `json:"end_us"`
	Count   int64   `json:"count"`
}

// Median returns the median of xs (mean of the two middle values for an even
// count) and false when xs is empty. NaN values are ignored.
func Median(xs []float64) (float64, bool) {
	v := finite(xs)
	if len(v) == 0 {
		return 0, false
	}
	sort.Float64s(v)
	n := len(v)
	if n%2 == 1 {
		return v[n/2], true
	}
	return (v[n/2-1] + v[n/2]) / 2, true
}

// MinMax returns the smallest and largest finite value of xs and false when
// there is none.
func MinMax(xs []float64) (lo, hi float64, ok bool) {
	v := finite(xs)
	if len(v) == 0 {
		return 0, 0, false
	}
	lo, hi = v[0], v[0]
	for _, x := range v[1:] {
		lo = math.Min(lo, x)
		hi = math.Max(hi, x)
	}
	return lo, hi, true
}

func finite(xs []float64) []float64 {
	out := make([]float64, 0, len(xs))
	for _, x := range xs {
		if !math.IsNaN(x) && !math.IsInf(x, 0) {
			out = append(out, x)
		}
	}
	return out
}

// BucketsCount is the number of samples in buckets.
func BucketsCount(buckets []Bucket) int64 {
	var n int64
	for _, b := range buckets {
		n += b.Count
	}
	return n
}

// PercentileFromBuckets estimates the p-th percentile (0 < p <= 100) of the
// samples summarised by buckets, interpolating linearly inside the bucket
// that holds it. Like fortio, the first sample is taken to sit exactly at the
// minimum (so percentiles up to 100/count return the minimum) and p >= 100
// returns the maximum. ok is false when there are no samples.
func PercentileFromBuckets(buckets []Bucket, p float64) (float64, bool) {
	total := BucketsCount(buckets)
	if total == 0 {
		return 0, false
	}
	first, last := -1, -1
	for i, b := range buckets {
		if b.Count > 0 {
			if first < 0 {
				first = i
			}
			last = i
		}
	}
	if p >= 100 {
		return buckets[last].EndUS, true
	}
	prev := 100 / float64(total) // percentile already covered by the minimum
	if p <= prev {
		return buckets[first].StartUS, true
	}
	var cum int64
	for _, b := range buckets {
		if b.Count == 0 {
			continue
		}
		cum += b.Count
		cur := 100 * float64(cum) / float64(total)
		if p <= cur {
			return b.StartUS + (p-prev)/(cur-prev)*(b.EndUS-b.StartUS), true
		}
		prev = cur
	}
	return buckets[last].EndUS, true
}

// LogEdges returns bucket edges from lo to hi (both > 0) spaced evenly on a
// log scale with perDecade edges per factor of ten; the last edge is >= hi.
func LogEdges(lo, hi float64, perDecade int) []float64 {
	if lo <= 0 || hi <= lo || perDecade <= 0 {
		return nil
	}
	step := math.Pow(10, 1/float64(perDecade))
	start := math.Pow(10, math.Floor(math.Log10(lo)*float64(perDecade))/float64(perDecade))
	edges := []float64{start}
	for e := start; e < hi; {
		e *= step
		edges = append(edges, e)
	}
	return edges
}

// Rebin redistributes the counts of buckets onto the bins delimited by edges
// (len(edges)-1 bins), spreading each source bucket's count uniformly over
// its interval. It is how histograms of different runs, whose fortio bucket
// edges differ at the ends, are added up and overlaid. Counts falling
// outside [edges[0], edges[last]] go to the first or last bin. The result
// holds fractional counts; their sum equals the input count.
func Rebin(buckets []Bucket, edges []float64) []float64 {
	if len(edges) < 2 {
		return nil
	}
	out := make([]float64, len(edges)-1)
	lastBin := len(out) - 1
	for _, b := range buckets {
		if b.Count == 0 {
			continue
		}
		c := float64(b.Count)
		width := b.EndUS - b.StartUS
		if width <= 0 {
			out[binOf(edges, b.StartUS, lastBin)] += c
			continue
		}
		// clamp the part of the bucket outside the edges into the end bins
		if b.StartUS < edges[0] {
			below := math.Min(b.EndUS, edges[0]) - b.StartUS
			out[0] += c * below / width
		}
		if b.EndUS > edges[len(edges)-1] {
			above := b.EndUS - math.Max(b.StartUS, edges[len(edges)-1])
			out[lastBin] += c * above / width
		}
		for i := range out {
			lo := math.Max(b.StartUS, edges[i])
			hi := math.Min(b.EndUS, edges[i+1])
			if hi > lo {
				out[i] += c * (hi - lo) / width
			}
		}
	}
	return out
}

func binOf(edges []float64, v float64, lastBin int) int {
	i := sort.SearchFloat64s(edges, v) // first edge >= v
	switch {
	case i == 0:
		return 0
	case i > lastBin:
		return lastBin
	case edges[i] == v && i <= lastBin:
		return i
	default:
		return i - 1
	}
}

// PairedRatios divides value[i] by base[i] for every index present and
// finite in both with a non-zero base: the ratio of two modes measured in the
// same repeat (side by side, so under the same machine noise).
func PairedRatios(value, base []float64) []float64 {
	n := min(len(value), len(base))
	out := make([]float64, 0, n)
	for i := range n {
		v, b := value[i], base[i]
		if math.IsNaN(v) || math.IsNaN(b) || b == 0 || math.IsInf(v, 0) || math.IsInf(b, 0) {
			continue
		}
		out = append(out, v/b)
	}
	return out
}

// MedianPairedRatio is the median of PairedRatios(value, base).
func MedianPairedRatio(value, base []float64) (float64, bool) {
	return Median(PairedRatios(value, base))
}
