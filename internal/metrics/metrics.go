// SPDX-License-Identifier: Apache-2.0

// Package metrics exposes the agent's counters in Prometheus format. Values
// are read from the BPF maps at scrape time (the maps are the source of
// truth), plus the agent's own CPU and memory cost.
package metrics

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"runtime"
	"strconv"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/meshwarp/meshwarp/internal/accel"
	"github.com/meshwarp/meshwarp/internal/crossnode"
	"github.com/meshwarp/meshwarp/internal/version"
)

// StatsFunc reads the current counters.
type StatsFunc func() (accel.Stats, error)

// accelDescs describe the accel counters that are metrics, from the model
// (accel.CounterModel), in its order.
var accelDescs = func() []*prometheus.Desc {
	var out []*prometheus.Desc
	for _, k := range accel.CounterModel() {
		if k.Metric == "" {
			continue
		}
		var labels []string
		if k.Label != "" {
			labels = []string{k.Label}
		}
		out = append(out, prometheus.NewDesc(k.Metric, k.Help, labels, nil))
	}
	return out
}()

var (
	descXNPackets = prometheus.NewDesc("meshwarp_crossnode_redirected_packets_total",
		"Packets redirected past the node's bridge, netfilter and routing (run --cross-node), by direction: to_wire (a local pod to another node), to_pod (another node into a local pod).", []string{"direction"}, nil)
	descXNBytes = prometheus.NewDesc("meshwarp_crossnode_redirected_bytes_total",
		"Bytes of meshwarp_crossnode_redirected_packets_total, by direction.", []string{"direction"}, nil)
	descXNPassed = prometheus.NewDesc("meshwarp_crossnode_passed_packets_total",
		"Packets the cross-node programs left to the normal path, by reason.", []string{"reason"}, nil)
	descXNNode = prometheus.NewDesc("meshwarp_crossnode_redirect_enabled",
		"1 while packets of the family are redirected in the node namespace: an agent checked it lately and no netfilter rule (or IPv4 rp_filter) stands in the way.", []string{"netns_cookie", "family"}, nil)
	descScrapeErr = prometheus.NewDesc("meshwarp_accel_scrape_error",
		"1 if the last read of the BPF maps failed.", nil, nil)
)

// accelCollector builds metrics from the maps at scrape time.
type accelCollector struct{ read StatsFunc }

func (c accelCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range accelDescs {
		ch <- d
	}
	for _, d := range []*prometheus.Desc{descScrapeErr, descXNPackets, descXNBytes, descXNPassed, descXNNode} {
		ch <- d
	}
}

func (c accelCollector) Collect(ch chan<- prometheus.Metric) {
	s, err := c.read()
	if err != nil {
		ch <- prometheus.MustNewConstMetric(descScrapeErr, prometheus.GaugeValue, 1)
		return
	}
	ch <- prometheus.MustNewConstMetric(descScrapeErr, prometheus.GaugeValue, 0)
	i := 0
	for _, k := range accel.CounterModel() {
		if k.Metric == "" {
			continue
		}
		d := accelDescs[i]
		i++
		kind := prometheus.CounterValue
		if k.Gauge {
			kind = prometheus.GaugeValue
		}
		v := k.Values(s.Counters)
		if k.Label == "" {
			ch <- prometheus.MustNewConstMetric(d, kind, float64(v[""]))
			continue
		}
		for _, l := range k.LabelValues() {
			ch <- prometheus.MustNewConstMetric(d, kind, float64(v[l]), l)
		}
	}
	if x := s.CrossNode; x != nil {
		for _, d := range crossnode.DirectionNames() {
			ch <- prometheus.MustNewConstMetric(descXNPackets, prometheus.CounterValue, float64(x.RedirectedPackets[d]), d)
			ch <- prometheus.MustNewConstMetric(descXNBytes, prometheus.CounterValue, float64(x.RedirectedBytes[d]), d)
		}
		for _, r := range crossnode.ReasonNames() {
			ch <- prometheus.MustNewConstMetric(descXNPassed, prometheus.CounterValue, float64(x.PassedPackets[r]), r)
		}
		for _, n := range x.Nodes {
			cookie := strconv.FormatUint(n.NetnsCookie, 10)
			for fam, on := range map[string]bool{"ipv4": n.Verified && n.IPv4, "ipv6": n.Verified && n.IPv6} {
				v := 0.0
				if on {
					v = 1
				}
				ch <- prometheus.MustNewConstMetric(descXNNode, prometheus.GaugeValue, v, cookie, fam)
			}
		}
	}
}

// NewRegistry returns a registry with the accel collector, build info and
// the agent's own process cost (meshwarp_process_cpu_seconds_total, ...).
// flows (nil when observation is off) adds the RED series (red.go).
func NewRegistry(read StatsFunc, flows FlowsFunc) *prometheus.Registry {
	reg := prometheus.NewRegistry()
	reg.MustRegister(accelCollector{read: read})
	if flows != nil {
		reg.MustRegister(redCollector{read: flows})
	}
	reg.MustRegister(collectors.NewProcessCollector(collectors.ProcessCollectorOpts{Namespace: "meshwarp"}))
	build := prometheus.NewGauge(prometheus.GaugeOpts{
		Name:        "meshwarp_build_info",
		Help:        "Build information; the value is always 1.",
		ConstLabels: prometheus.Labels{"version": version.Version, "goversion": runtime.Version()},
	})
	build.Set(1)
	reg.MustRegister(build)
	return reg
}

// Handler serves /metrics and /healthz (200 while the maps can be read).
func Handler(read StatsFunc, flows FlowsFunc) http.Handler {
	mux := http.NewServeMux()
	mux.Handle("/metrics", promhttp.HandlerFor(NewRegistry(read, flows), promhttp.HandlerOpts{}))
	mux.HandleFunc("/healthz", func(w http.ResponseWriter, _ *http.Request) {
		if _, err := read(); err != nil {
			http.Error(w, "unhealthy: "+err.Error(), http.StatusServiceUnavailable)
			return
		}
		fmt.Fprintln(w, "ok")
	})
	return mux
}

// Serve listens on addr and serves Handler until ctx is done. The listener
// is opened before Serve returns so a bad address fails fast.
func Serve(ctx context.Context, addr string, read StatsFunc, flows FlowsFunc, logger *slog.Logger) (<-chan error, error) {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("listen for metrics on %s: %w (pass --metrics-addr with a free port, or \"\" to disable)", addr, err)
	}
	srv := &http.Server{Handler: Handler(read, flows), ReadHeaderTimeout: 5 * time.Second}
	// done carries only a failure: a shutdown on ctx is not one, and must not
	// race the caller's own <-ctx.Done() as a nil "error".
	done := make(chan error, 1)
	go func() {
		if err := srv.Serve(ln); !errors.Is(err, http.ErrServerClosed) {
			done <- err
		}
	}()
	go func() {
		<-ctx.Done()
		shutdownCtx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		srv.Shutdown(shutdownCtx)
	}()
	logger.Info("serving metrics", "subsys", "metrics", "addr", ln.Addr().String())
	return done, nil
}
