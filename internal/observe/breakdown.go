// SPDX-License-Identifier: Apache-2.0

// Package observe turns the agent's observation (accel.Flow, read from the
// pinned mw_flows map) into what users read: the per-hop breakdown of a
// request (`meshwarp trace`, the bench's "where the time goes") and the
// node's flows (`meshwarp top`).
package observe

import (
	"fmt"
	"math"
	"slices"

	"github.com/meshwarp/meshwarp/internal/accel"
)

// Segment is one part of a request's time: a kernel hop (transit both
// ways), a proxy (receive to forward, both ways) or the server application.
type Segment struct {
	Name string `json:"name"`
	// Kind is "kernel", "proxy" or "app".
	Kind        string  `json:"kind"`
	MeanSeconds float64 `json:"mean_seconds"`
	// P50Seconds and P99Seconds are differences of the bounding points'
	// quantiles (requests are not followed one by one across hops).
	P50Seconds float64 `json:"p50_seconds"`
	P99Seconds float64 `json:"p99_seconds"`
	// Count is the exchanges seen at the segment's outer point.
	Count uint64 `json:"count"`
}

// Point is what one observation point saw of HTTP exchanges.
type Point struct {
	Name        string  `json:"name"`
	Count       uint64  `json:"count"`
	MeanSeconds float64 `json:"mean_seconds"`
	P50Seconds  float64 `json:"p50_seconds"`
	P99Seconds  float64 `json:"p99_seconds"`
	// Accelerated is the share of exchanges seen on redirected connections.
	Accelerated float64 `json:"accelerated_share"`
}

// Breakdown is where an HTTP request's time goes, from the client
// application (its request sent to its first read of the response) inwards.
// The segments' means add up to ClientMeanSeconds: each is the difference
// between the mean durations at two consecutive observation points.
type Breakdown struct {
	Segments          []Segment `json:"segments"`
	ClientMeanSeconds float64   `json:"client_mean_seconds"`
	ClientCount       uint64    `json:"client_count"`
	Points            []Point   `json:"points"`
}

// segmentNames names the part between two consecutive points.
var segmentNames = map[[2]string]Segment{
	{accel.PointClientApp, accel.PointClient}:       {Name: "socket -> client app (wakeup, read)", Kind: "kernel"},
	{accel.PointClient, accel.PointOutboundIn}:      {Name: "app -> sidecar (kernel)", Kind: "kernel"},
	{accel.PointOutboundIn, accel.PointOutboundOut}: {Name: "client sidecar (proxy)", Kind: "proxy"},
	{accel.PointOutboundOut, accel.PointInboundIn}:  {Name: "sidecar -> sidecar (kernel)", Kind: "kernel"},
	{accel.PointInboundIn, accel.PointInboundOut}:   {Name: "server sidecar (proxy)", Kind: "proxy"},
	{accel.PointInboundOut, accel.PointServer}:      {Name: "sidecar -> app (kernel)", Kind: "kernel"},
	{accel.PointClient, accel.PointServer}:          {Name: "app -> app (kernel)", Kind: "kernel"},
}

// hist is HTTP exchanges merged over flows.
type hist struct {
	count, accelerated uint64
	sum                float64
	buckets            []uint64
}

func (h *hist) add(f accel.Flow) {
	h.count += f.Count
	h.sum += f.SumSeconds
	if f.Accelerated {
		h.accelerated += f.Count
	}
	if h.buckets == nil {
		h.buckets = make([]uint64, len(f.Buckets))
	}
	for i, b := range f.Buckets {
		if i < len(h.buckets) {
			h.buckets[i] += b
		}
	}
}

func (h *hist) mean() float64 {
	if h.count == 0 {
		return 0
	}
	return h.sum / float64(h.count)
}

// Quantile estimates the q-quantile (0..1) of per-bucket counts over
// accel.ObsBucketBounds, interpolating linearly inside the bucket; the
// +Inf bucket answers with its lower bound.
func Quantile(buckets []uint64, q float64) float64 {
	var total uint64
	for _, b := range buckets {
		total += b
	}
	if total == 0 {
		return 0
	}
	rank := q * float64(total)
	var seen float64
	lower := 0.0
	for i, b := range buckets {
		if i >= len(accel.ObsBucketBounds) {
			return lower
		}
		upper := accel.ObsBucketBounds[i].Seconds()
		if b > 0 && seen+float64(b) >= rank {
			return lower + (upper-lower)*(rank-seen)/float64(b)
		}
		seen += float64(b)
		lower = upper
	}
	return lower
}

// ByPort keeps the flows of one server port (0: all). The sidecars'
// listener points see the capture port instead of the one the client
// dialled, so they are kept whatever the port.
func ByPort(flows []accel.Flow, port uint16) []accel.Flow {
	if port == 0 {
		return flows
	}
	var out []accel.Flow
	for _, f := range flows {
		if f.Server.Port() == port || f.Point == accel.PointOutboundIn || f.Point == accel.PointInboundIn {
			out = append(out, f)
		}
	}
	return out
}

// NewBreakdown computes the breakdown of the HTTP exchanges in flows
// (usually the difference of two reads: Sub).
func NewBreakdown(flows []accel.Flow) (Breakdown, error) {
	byPoint := map[string]*hist{}
	for _, f := range flows {
		if f.Proto != "http" || f.Count == 0 {
			continue
		}
		h := byPoint[f.Point]
		if h == nil {
			h = &hist{}
			byPoint[f.Point] = h
		}
		h.add(f)
	}
	var b Breakdown
	var present []string
	for _, name := range accel.PointNames() {
		h := byPoint[name]
		if h == nil {
			continue
		}
		present = append(present, name)
		b.Points = append(b.Points, Point{
			Name: name, Count: h.count, MeanSeconds: h.mean(),
			P50Seconds: Quantile(h.buckets, 0.5), P99Seconds: Quantile(h.buckets, 0.99),
			Accelerated: float64(h.accelerated) / float64(h.count),
		})
	}
	// The client application's own read, when the tracepoint saw it; else its socket.
	client := byPoint[accel.PointClientApp]
	if client == nil {
		client = byPoint[accel.PointClient]
	}
	if client == nil {
		return b, fmt.Errorf("no HTTP/1.x request by an application of the cgroup was seen (points seen: %v)", present)
	}
	b.ClientMeanSeconds = client.mean()
	b.ClientCount = client.count
	for i, outer := range present {
		ho := byPoint[outer]
		if i+1 == len(present) {
			seg := Segment{Name: "server app", Kind: "app"}
			if outer != accel.PointServer {
				seg = Segment{Name: "beyond " + outer + " (not observed)", Kind: "app"}
			}
			seg.MeanSeconds, seg.P50Seconds, seg.P99Seconds = ho.mean(), Quantile(ho.buckets, 0.5), Quantile(ho.buckets, 0.99)
			seg.Count = ho.count
			b.Segments = append(b.Segments, seg)
			break
		}
		inner := present[i+1]
		hi := byPoint[inner]
		seg, ok := segmentNames[[2]string{outer, inner}]
		if !ok {
			seg = Segment{Name: outer + " -> " + inner, Kind: "kernel"}
		}
		seg.MeanSeconds = ho.mean() - hi.mean()
		seg.P50Seconds = math.Max(0, Quantile(ho.buckets, 0.5)-Quantile(hi.buckets, 0.5))
		seg.P99Seconds = math.Max(0, Quantile(ho.buckets, 0.99)-Quantile(hi.buckets, 0.99))
		seg.Count = ho.count
		b.Segments = append(b.Segments, seg)
	}
	return b, nil
}

// Sub returns after - before, flow by flow (flows that did not change are left out).
func Sub(after, before []accel.Flow) []accel.Flow {
	prev := make(map[string]accel.Flow, len(before))
	for _, f := range before {
		prev[f.Key()] = f
	}
	var out []accel.Flow
	for _, f := range after {
		p, ok := prev[f.Key()]
		if ok {
			if f.Count < p.Count || f.Bytes < p.Bytes {
				continue // a new agent's map: not comparable
			}
			f.Count -= p.Count
			f.SumSeconds -= p.SumSeconds
			f.Bytes -= p.Bytes
			f.Buckets = slices.Clone(f.Buckets)
			for i := range f.Buckets {
				if i < len(p.Buckets) {
					f.Buckets[i] -= p.Buckets[i]
				}
			}
		}
		if f.Count == 0 && f.Bytes == 0 {
			continue
		}
		out = append(out, f)
	}
	return out
}
