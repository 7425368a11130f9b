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

var (
	descSockets = prometheus.NewDesc("meshwarp_accel_sockets",
		"Sockets currently accelerated (paired and not yet closed).", nil, nil)
	descRedirBytes = prometheus.NewDesc("meshwarp_accel_redirected_bytes_total",
		"Bytes moved socket-to-socket by sk_msg, skipping the TCP/IP stack.", nil, nil)
	descRedirMsgs = prometheus.NewDesc("meshwarp_accel_redirected_messages_total",
		"sendmsg calls whose data was redirected to the peer socket.", nil, nil)
	descPassMsgs = prometheus.NewDesc("meshwarp_accel_passthrough_messages_total",
		"Messages of tracked sockets sent through the normal TCP stack, by reason.", []string{"reason"}, nil)
	descPassBytes = prometheus.NewDesc("meshwarp_accel_passthrough_bytes_total",
		"Bytes of tracked sockets sent through the normal TCP stack, by reason.", []string{"reason"}, nil)
	descPassConns = prometheus.NewDesc("meshwarp_accel_passthrough_connections_total",
		"Connections left to the normal TCP stack, by reason.", []string{"reason"}, nil)
	descRemoved = prometheus.NewDesc("meshwarp_accel_removed_sockets_total",
		"Sockets kept off the SOCKHASH or taken out of it again because their connection was left to TCP (plain TCP sockets from then on), by reason.", []string{"reason"}, nil)
	descLeft = prometheus.NewDesc("meshwarp_accel_left_sockets_total",
		"Paired sockets that left the SOCKHASH after their connection went to TCP as a whole (small_stream, one-way backpressure), once their redirected bytes were read.", nil, nil)
	descFull = prometheus.NewDesc("meshwarp_accel_sockhash_full_total",
		"Sockets not accelerated because the SOCKHASH was at capacity.", nil, nil)
	descHopConns = prometheus.NewDesc("meshwarp_accel_hop_paired_connections_total",
		"Connections paired, by mesh hop.", []string{"hop"}, nil)
	descHopBytes = prometheus.NewDesc("meshwarp_accel_hop_redirected_bytes_total",
		"Bytes redirected, by mesh hop.", []string{"hop"}, nil)
	descHopMsgs = prometheus.NewDesc("meshwarp_accel_hop_redirected_messages_total",
		"Messages redirected, by mesh hop.", []string{"hop"}, nil)
	descSplice = prometheus.NewDesc("meshwarp_accel_splice_socket_reads_total",
		"splice(2) reads from sockets by processes of the accelerated cgroup (such readers cannot see redirected bytes).", nil, nil)
	descNATRemaps = prometheus.NewDesc("meshwarp_accel_nat_port_remapped_connections_total",
		"Connections paired although NAT (conntrack under REDIRECT or DNAT) rewrote their source port between the two ends.", nil, nil)
	descUnfit = prometheus.NewDesc("meshwarp_accel_unfit_calls_total",
		"Calls on accelerated sockets that a redirect cannot honour (splice, MSG_WAITALL, MSG_OOB, SO_RCVLOWAT, close with unread bytes), by the reason they teach: later connections on those ports stay on TCP.", []string{"reason"}, nil)
	descFlowsFull = prometheus.NewDesc("meshwarp_observe_flows_full_total",
		"Observations lost because the flow table (mw_flows) was full.", nil, nil)
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
	for _, d := range []*prometheus.Desc{descSockets, descRedirBytes, descRedirMsgs, descPassMsgs, descPassBytes,
		descPassConns, descRemoved, descLeft, descFull, descHopConns, descHopBytes, descHopMsgs, descSplice, descNATRemaps, descUnfit, descFlowsFull, descScrapeErr,
		descXNPackets, descXNBytes, descXNPassed, descXNNode} {
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
	ch <- prometheus.MustNewConstMetric(descSockets, prometheus.GaugeValue, float64(s.AcceleratedSockets))
	ch <- prometheus.MustNewConstMetric(descRedirBytes, prometheus.CounterValue, float64(s.RedirectedBytes))
	ch <- prometheus.MustNewConstMetric(descRedirMsgs, prometheus.CounterValue, float64(s.RedirectedMessages))
	ch <- prometheus.MustNewConstMetric(descFull, prometheus.CounterValue, float64(s.SockhashFull))
	ch <- prometheus.MustNewConstMetric(descLeft, prometheus.CounterValue, float64(s.LeftSockets))
	ch <- prometheus.MustNewConstMetric(descSplice, prometheus.CounterValue, float64(s.SpliceSocketReads))
	ch <- prometheus.MustNewConstMetric(descNATRemaps, prometheus.CounterValue, float64(s.NATPortRemaps))
	ch <- prometheus.MustNewConstMetric(descFlowsFull, prometheus.CounterValue, float64(s.FlowsFull))
	for _, r := range accel.ReasonNames() {
		ch <- prometheus.MustNewConstMetric(descPassMsgs, prometheus.CounterValue, float64(s.PassthroughByReason[r]), r)
		ch <- prometheus.MustNewConstMetric(descPassBytes, prometheus.CounterValue, float64(s.PassthroughBytesByReason[r]), r)
		ch <- prometheus.MustNewConstMetric(descPassConns, prometheus.CounterValue, float64(s.PassthroughConnections[r]), r)
		ch <- prometheus.MustNewConstMetric(descRemoved, prometheus.CounterValue, float64(s.RemovedSockets[r]), r)
		ch <- prometheus.MustNewConstMetric(descUnfit, prometheus.CounterValue, float64(s.UnfitCalls[r]), r)
	}
	for _, h := range accel.HopNames() {
		hs := s.Hops[h]
		ch <- prometheus.MustNewConstMetric(descHopConns, prometheus.CounterValue, float64(hs.PairedConnections), h)
		ch <- prometheus.MustNewConstMetric(descHopBytes, prometheus.CounterValue, float64(hs.RedirectedBytes), h)
		ch <- prometheus.MustNewConstMetric(descHopMsgs, prometheus.CounterValue, float64(hs.RedirectedMessages), h)
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
