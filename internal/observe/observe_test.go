// SPDX-License-Identifier: Apache-2.0

package observe

import (
	"math"
	"net/netip"
	"testing"

	"github.com/meshwarp/meshwarp/internal/accel"
)

// httpFlow is count exchanges of d seconds each at point, to server.
func httpFlow(point, server string, count uint64, d float64, status int) accel.Flow {
	b := make([]uint64, len(accel.ObsBucketBounds)+1)
	for i, ub := range accel.ObsBucketBounds {
		if d <= ub.Seconds() {
			b[i] = count
			break
		}
	}
	return accel.Flow{Point: point, Proto: "http", Method: "GET", Status: status, Server: netip.MustParseAddrPort(server),
		Count: count, SumSeconds: float64(count) * d, Buckets: b}
}

// The segments are the differences between consecutive points and add up
// to the client application's mean; a missing point merges its segments.
func TestBreakdownAddsUp(t *testing.T) {
	flows := []accel.Flow{
		httpFlow(accel.PointClientApp, "10.0.0.2:8080", 100, 400e-6, 200),
		httpFlow(accel.PointClient, "10.0.0.2:8080", 100, 350e-6, 200),
		httpFlow(accel.PointOutboundIn, "10.0.0.1:15001", 100, 340e-6, 200),
		httpFlow(accel.PointInboundIn, "10.0.0.2:15006", 100, 200e-6, 200),
		httpFlow(accel.PointServer, "10.0.0.2:8080", 100, 50e-6, 200),
	}
	b, err := NewBreakdown(flows)
	if err != nil {
		t.Fatal(err)
	}
	want := []struct {
		name string
		us   float64
	}{
		{"socket -> client app (wakeup, read)", 50}, {"app -> sidecar (kernel)", 10},
		{"outbound_in -> inbound_in", 140}, {"inbound_in -> server", 150}, {"server app", 50},
	}
	if len(b.Segments) != len(want) {
		t.Fatalf("segments %+v", b.Segments)
	}
	var sum float64
	for i, w := range want {
		s := b.Segments[i]
		sum += s.MeanSeconds
		if s.Name != w.name || math.Abs(s.MeanSeconds*1e6-w.us) > 1e-6 {
			t.Errorf("segment %d: %s %.1fus, want %s %.1fus", i, s.Name, s.MeanSeconds*1e6, w.name, w.us)
		}
	}
	if math.Abs(sum-b.ClientMeanSeconds) > 1e-12 || math.Abs(b.ClientMeanSeconds-400e-6) > 1e-12 {
		t.Errorf("sum %v, client mean %v, want both 400us", sum, b.ClientMeanSeconds)
	}
	if _, err := NewBreakdown(flows[4:]); err == nil {
		t.Error("a breakdown without a client point")
	}
}

func TestQuantile(t *testing.T) {
	b := make([]uint64, len(accel.ObsBucketBounds)+1)
	b[0], b[4] = 50, 50 // 0..10us and 75..100us
	if q := Quantile(b, 0.25); q <= 0 || q > 10e-6 {
		t.Errorf("p25 %v, want within the first bucket", q)
	}
	if q := Quantile(b, 0.99); q <= 75e-6 || q > 100e-6 {
		t.Errorf("p99 %v, want within 75..100us", q)
	}
	if q := Quantile(make([]uint64, 3), 0.5); q != 0 {
		t.Errorf("empty: %v", q)
	}
}

// Rows: one per client pod and server; a server whose clients are outside
// the cgroup gets its own row; rates per second; errors are 5xx.
func TestRows(t *testing.T) {
	in := httpFlow(accel.PointClient, "10.0.0.2:8080", 100, 1e-3, 200)
	in.Netns = 7
	fail := httpFlow(accel.PointClient, "10.0.0.2:8080", 10, 1e-3, 503)
	fail.Netns = 7
	seenAtServer := httpFlow(accel.PointServer, "10.0.0.2:8080", 110, 1e-3, 200) // the same requests, server side
	outside := httpFlow(accel.PointServer, "10.0.0.3:9090", 40, 1e-3, 200)
	rows := Rows([]accel.Flow{in, fail, seenAtServer, outside}, 2, map[uint64]string{7: "pod-a"})
	if len(rows) != 2 {
		t.Fatalf("rows %+v", rows)
	}
	r := rows[0]
	if r.Client != "pod-a" || r.Server != "10.0.0.2:8080" || r.Protocol != "http" || r.RequestsPerSecond != 55 || r.ErrorsPerSecond != 5 {
		t.Errorf("row %+v", r)
	}
	if o := rows[1]; o.Client != UnobservedClient || o.Server != "10.0.0.3:9090" || o.RequestsPerSecond != 20 {
		t.Errorf("row of a client outside the cgroup %+v", o)
	}
	if got := Filter(rows, "9090"); len(got) != 1 || got[0].Server != "10.0.0.3:9090" {
		t.Errorf("filter: %+v", got)
	}
	SortRows(rows, SortErrors)
	if rows[0].ErrorsPerSecond != 5 {
		t.Errorf("sorted by errors: %+v", rows)
	}
}
