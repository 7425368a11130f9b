// SPDX-License-Identifier: Apache-2.0

package metrics

import (
	"strconv"
	"strings"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/meshwarp/meshwarp/internal/accel"
)

// FlowsFunc reads the observation (nil: observation is off).
type FlowsFunc func() ([]accel.Flow, error)

// RED series, named as OpenTelemetry's HTTP semantic conventions render in
// Prometheus, plus meshwarp_accelerated. Client and server series count
// applications only (sidecars are hops, in meshwarp_http_point_*), so a
// request through two sidecars is one client and one server observation.
var (
	httpLabels     = []string{"http_request_method", "http_response_status_code", "server_port", "meshwarp_accelerated"}
	descHTTPServer = prometheus.NewDesc("http_server_request_duration_seconds",
		"Duration of HTTP/1.x requests served by applications of the cgroup (request line in to status line out), seen by meshwarp.", httpLabels, nil)
	descHTTPClient = prometheus.NewDesc("http_client_request_duration_seconds",
		"Duration of HTTP/1.x requests made by applications of the cgroup (request line out to status line in), seen by meshwarp.", httpLabels, nil)
	descHTTPPoint = prometheus.NewDesc("meshwarp_http_point_request_duration_seconds",
		"Duration of HTTP/1.x exchanges by observation point (client, sidecar outbound_in/outbound_out, inbound_in/inbound_out, server): differences between points are the hops and proxies (`meshwarp trace`).",
		[]string{"point", "meshwarp_accelerated"}, nil)
	descTCPDuration = prometheus.NewDesc("meshwarp_tcp_connection_duration_seconds",
		"Lifetime of TCP connections of the cgroup that ended, by observation point and outcome (closed; errors: reset, connect_failed).",
		[]string{"point", "outcome", "server_port", "meshwarp_accelerated"}, nil)
	descTCPBytes = prometheus.NewDesc("meshwarp_tcp_bytes_total",
		"Payload bytes of TCP connections of the cgroup, both directions, by observation point (added at least every second while a socket sends, and at its end).",
		[]string{"point", "server_port", "meshwarp_accelerated"}, nil)
	descFlowsErr = prometheus.NewDesc("meshwarp_observe_scrape_error",
		"1 if the last read of the observation map failed.", nil, nil)
)

type redCollector struct{ read FlowsFunc }

func (c redCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{descHTTPServer, descHTTPClient, descHTTPPoint, descTCPDuration, descTCPBytes, descFlowsErr} {
		ch <- d
	}
}

// series accumulates one labelled histogram (and bytes) from flows.
type series struct {
	desc    *prometheus.Desc
	labels  []string
	count   uint64
	sum     float64
	bytes   uint64
	buckets []uint64
}

func (c redCollector) Collect(ch chan<- prometheus.Metric) {
	flows, err := c.read()
	if err != nil {
		ch <- prometheus.MustNewConstMetric(descFlowsErr, prometheus.GaugeValue, 1)
		return
	}
	ch <- prometheus.MustNewConstMetric(descFlowsErr, prometheus.GaugeValue, 0)
	hist := map[string]*series{}
	bytes := map[string]*series{}
	add := func(to map[string]*series, d *prometheus.Desc, f accel.Flow, labels ...string) {
		key := d.String() + "\x00" + strings.Join(labels, "\x00")
		s := to[key]
		if s == nil {
			s = &series{desc: d, labels: labels, buckets: make([]uint64, len(f.Buckets))}
			to[key] = s
		}
		s.count += f.Count
		s.sum += f.SumSeconds
		s.bytes += f.Bytes
		for i, b := range f.Buckets {
			s.buckets[i] += b
		}
	}
	for _, f := range flows {
		accelerated := strconv.FormatBool(f.Accelerated)
		port := strconv.Itoa(int(f.Server.Port()))
		switch f.Proto {
		case "http":
			status := strconv.Itoa(f.Status)
			switch f.Point {
			case accel.PointServer:
				add(hist, descHTTPServer, f, f.Method, status, port, accelerated)
			case accel.PointClient:
				add(hist, descHTTPClient, f, f.Method, status, port, accelerated)
			}
			add(hist, descHTTPPoint, f, f.Point, accelerated)
		case "tcp":
			if f.Outcome == "open" {
				add(bytes, descTCPBytes, f, f.Point, port, accelerated)
				continue
			}
			add(hist, descTCPDuration, f, f.Point, f.Outcome, port, accelerated)
			add(bytes, descTCPBytes, f, f.Point, port, accelerated)
		}
	}
	for _, s := range hist {
		ch <- prometheus.MustNewConstHistogram(s.desc, s.count, s.sum, cumulative(s.buckets), s.labels...)
	}
	for _, s := range bytes {
		ch <- prometheus.MustNewConstMetric(s.desc, prometheus.CounterValue, float64(s.bytes), s.labels...)
	}
}

// cumulative turns per-bucket counts into Prometheus' upper-bound counts
// (the +Inf bucket is the count itself).
func cumulative(perBucket []uint64) map[float64]uint64 {
	out := make(map[float64]uint64, len(accel.ObsBucketBounds))
	var n uint64
	for i, ub := range accel.ObsBucketBounds {
		if i < len(perBucket) {
			n += perBucket[i]
		}
		out[ub.Seconds()] = n
	}
	return out
}
