// SPDX-License-Identifier: Apache-2.0

package bench

import (
	"fmt"
	"io"
	"maps"
	"math"
	"slices"
	"strings"
	"text/tabwriter"

	"github.com/meshwarp/meshwarp/internal/observe"
)

// Table is one block of the report: the same tables are printed on the
// terminal and rendered in the HTML page.
type Table struct {
	Title string
	Notes []string
	Head  []string
	Rows  [][]string
	// Footer lines (hops accelerated by the agent).
	Footer []string
	// LeftColumns is how many leading columns hold labels (left-aligned).
	LeftColumns int
}

// WriteTable prints the report as terminal tables: one per workload (qperf
// and unix: one block, rows = size x mode), rows = modes, medians over the
// repeats, ratios = median of per-repeat ratios.
func (r *Report) WriteTable(w io.Writer) error {
	fmt.Fprintf(w, "meshwarp bench: %s, kernel %s, %d CPUs (%s), %s\n", r.Machine.Date, r.Machine.Kernel, r.Machine.CPUs, r.Machine.Model, r.Machine.MeshwarpVersion)
	if r.Config.Repeat > 1 {
		fmt.Fprintf(w, "median of %d repeats, modes interleaved; [min..max] over repeats; ratios = median of per-repeat ratios (latency: <1 is better; qps, bandwidth: >1 is better)\n", r.Config.Repeat)
	} else {
		fmt.Fprintln(w, "one repeat (no spread: use --repeat 3 for medians); ratios: latency <1 is better; qps, bandwidth >1 is better")
	}
	if r.Config.Nodes > 1 {
		fmt.Fprintf(w, "across %d nodes: client and server pods on different nodes, one agent per node with cross-node forwarding\n", r.Config.Nodes)
	}
	for _, t := range r.Tables() {
		fmt.Fprintf(w, "\n%s\n", t.Title)
		for _, n := range t.Notes {
			fmt.Fprintln(w, n)
		}
		tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
		rows := leftAlign(t.Head, t.Rows, "mode")
		fmt.Fprintln(tw, strings.Join(rows[0], "\t")+"\t")
		for _, row := range rows[1:] {
			fmt.Fprintln(tw, strings.Join(row, "\t")+"\t")
		}
		if err := tw.Flush(); err != nil {
			return err
		}
		for _, f := range t.Footer {
			fmt.Fprintf(w, "  %s\n", f)
		}
	}
	for _, n := range r.Notes {
		fmt.Fprintf(w, "note: %s\n", n)
	}
	for _, f := range r.Failures {
		fmt.Fprintf(w, "FAILED: %s\n", f)
	}
	return nil
}

// leftAlign pads the column named col so that the right-aligned tabwriter
// shows it left-aligned; it returns head and rows as one slice.
func leftAlign(head []string, rows [][]string, col string) [][]string {
	all := append([][]string{slices.Clone(head)}, rows...)
	i := slices.Index(head, col)
	if i < 0 {
		return all
	}
	width := 0
	for _, r := range all {
		if i < len(r) {
			width = max(width, len(r[i]))
		}
	}
	for k, r := range all {
		if i < len(r) {
			r = slices.Clone(r)
			r[i] += strings.Repeat(" ", width-len(r[i]))
			all[k] = r
		}
	}
	return all
}

// Tables builds the report's tables.
func (r *Report) Tables() []Table {
	var out []Table
	c := r.Config
	for _, wl := range []string{WorkloadHTTP, WorkloadTCP, WorkloadHTTPClose, WorkloadHTTPC1, WorkloadTCPC1} {
		if slices.Contains(c.Workloads, wl) {
			out = append(out, r.fortioTable(wl))
		}
	}
	if slices.Contains(c.Workloads, WorkloadRedis) {
		out = append(out, r.fortioTable(WorkloadRedis), r.fortioTable(WorkloadRedisPipelined))
	}
	if slices.Contains(c.Workloads, WorkloadBulk) {
		out = append(out, r.bulkTable())
	}
	if slices.Contains(c.Workloads, WorkloadQperf) || slices.Contains(c.Workloads, WorkloadUnix) {
		out = append(out, r.sizeTable())
	}
	if t, ok := r.costTable(); ok {
		out = append(out, t)
	}
	if c.Repeat < 2 {
		// one repeat has no spread
		for i := range out {
			out[i] = dropColumn(out[i], "[min..max]")
		}
	}
	return out
}

func dropColumn(t Table, name string) Table {
	keep := func(row []string) []string {
		var out []string
		for i, c := range row {
			if i < len(t.Head) && t.Head[i] == name {
				continue
			}
			out = append(out, c)
		}
		return out
	}
	rows := make([][]string, len(t.Rows))
	for i, r := range t.Rows {
		rows[i] = keep(r)
	}
	t.Head, t.Rows = keep(t.Head), rows
	return t
}

func (r *Report) fortioTable(wl string) Table {
	t := Table{
		Title:       r.workloadTitle(wl),
		LeftColumns: 1,
		Head: []string{"mode", "qps", "[min..max]", "avg us", "p50 us", "p90 us", "p99 us", "cpu s/1k req",
			"qps vs sidecar", "p50 vs sidecar", "qps vs direct", "p50 vs direct"},
	}
	for _, m := range r.Config.Modes {
		res := r.FindResult(m, wl, 0)
		if res == nil {
			t.Rows = append(t.Rows, padRow([]string{m, "(no result)"}, len(t.Head)))
			continue
		}
		lat := res.LatencyUS
		if lat == nil {
			lat = &Latency{}
		}
		t.Rows = append(t.Rows, []string{m,
			num(res.QPS, 0), spread(res, MetricQPS, 0), num(lat.Avg, 0), num(lat.P50, 0), num(lat.P90, 0), num(lat.P99, 0),
			num(res.CPUSecondsPer1kRequests, 3),
			r.ratio(m, ModeSidecar, wl, 0, "qps_ratio"), r.ratio(m, ModeSidecar, wl, 0, "latency_p50_ratio"),
			r.ratio(m, ModeDirect, wl, 0, "qps_ratio"), r.ratio(m, ModeDirect, wl, 0, "latency_p50_ratio")})
	}
	t.Footer = r.hopLines(wl, 0)
	if wl == WorkloadHTTP {
		t.Footer = append(t.Footer, r.breakdownLines()...)
	}
	return t
}

// bulkTable: bandwidth and time per transfer, rows = modes.
func (r *Report) bulkTable() Table {
	t := Table{
		Title:       r.workloadTitle(WorkloadBulk),
		LeftColumns: 1,
		Head: []string{"mode", "MB/s", "[min..max]", "ms/transfer", "[min..max]", "transfers", "cpu s/GB",
			"MB/s vs sidecar", "time vs sidecar", "MB/s vs direct", "time vs direct"},
	}
	for _, m := range r.Config.Modes {
		res := r.FindResult(m, WorkloadBulk, 0)
		if res == nil {
			t.Rows = append(t.Rows, padRow([]string{m, "(no result)"}, len(t.Head)))
			continue
		}
		// the time per transfer is kept in us (latency_avg_us), shown in ms
		timeMS, timeSpread := "-", ""
		if res.LatencyUS != nil && res.LatencyUS.Avg != nil {
			timeMS = fnum(*res.LatencyUS.Avg/1000, 1)
		}
		if s, ok := res.Spread[MetricLatencyAvg]; ok && res.Repeats > 1 {
			timeSpread = "[" + fnum(s.Min/1000, 1) + ".." + fnum(s.Max/1000, 1) + "]"
		}
		t.Rows = append(t.Rows, []string{m,
			num(res.BandwidthMBps, 1), spread(res, MetricBandwidth, 1), timeMS, timeSpread,
			fmt.Sprint(res.RequestsTotal), num(res.CPUSecondsPerGB, 2),
			r.ratio(m, ModeSidecar, WorkloadBulk, 0, "bandwidth_ratio"), r.ratio(m, ModeSidecar, WorkloadBulk, 0, "latency_avg_ratio"),
			r.ratio(m, ModeDirect, WorkloadBulk, 0, "bandwidth_ratio"), r.ratio(m, ModeDirect, WorkloadBulk, 0, "latency_avg_ratio")})
	}
	t.Footer = r.hopLines(WorkloadBulk, 0)
	return t
}

// workloadTitle says what a workload of a per-mode table ran.
func (r *Report) workloadTitle(wl string) string {
	c := r.Config
	http := "HTTP: fortio " + c.HTTPURL
	tcp := fmt.Sprintf("TCP echo: fortio tcp://%s, %d B payload", c.TCPTarget, c.PayloadBytes)
	runs := fmt.Sprintf("qps max, %gs runs", c.DurationSeconds)
	switch wl {
	case WorkloadTCP:
		return fmt.Sprintf("%s, %d connections, %s", tcp, c.Connections, runs)
	case WorkloadHTTPClose:
		return fmt.Sprintf("HTTP, one connection per request (Connection: close): fortio %s, %d connections, %s (pods: tcp_tw_reuse=1, wide ip_local_port_range)",
			c.HTTPURL, c.CloseConnections, runs)
	case WorkloadHTTPC1:
		return fmt.Sprintf("%s, 1 connection, %s", http, runs)
	case WorkloadTCPC1:
		return fmt.Sprintf("%s, 1 connection, %s", tcp, runs)
	case WorkloadRedis:
		return fmt.Sprintf("redis: redis-benchmark -c %d -t %s against redis-server %s (SET and GET combined)", redisClients, redisTests, c.RedisTarget)
	case WorkloadRedisPipelined:
		return fmt.Sprintf("redis pipelined: redis-benchmark -c %d -P %d -t %s against redis-server %s (SET and GET combined)", redisClients, redisPipeline, redisTests, c.RedisTarget)
	case WorkloadBulk:
		return fmt.Sprintf("bulk: curl downloads a %d MiB file from nginx %s, one transfer (and connection) at a time, %gs runs; "+
			"MB/s = bytes / curl's time_total, ms/transfer = mean time_total, transfers = over all repeats", BulkBytes>>20, c.BulkURL, c.DurationSeconds)
	}
	return fmt.Sprintf("%s, %d connections, %s", http, c.Connections, runs)
}

func (r *Report) sizeTable() Table {
	c := r.Config
	hasQperf := slices.Contains(c.Workloads, WorkloadQperf)
	hasUnix := slices.Contains(c.Workloads, WorkloadUnix)
	t := Table{LeftColumns: 2}
	switch {
	case hasQperf && hasUnix:
		t.Title = fmt.Sprintf("qperf tcp_lat / tcp_bw %s (%gs per test and size); floor = AF_UNIX socketpair in the client pod", qperfWhere(c), c.QperfDurationSeconds)
	case hasQperf:
		t.Title = fmt.Sprintf("qperf tcp_lat / tcp_bw %s (%gs per test and size)", qperfWhere(c), c.QperfDurationSeconds)
	default:
		t.Title = fmt.Sprintf("AF_UNIX socketpair floor (%gs per test and size)", c.QperfDurationSeconds)
	}
	t.Notes = []string{"latency is one way (half a round trip), as qperf reports it; rt = round trip"}
	t.Head = []string{"size", "mode", "lat us", "[min..max]", "MB/s", "[min..max]", "cpu s/1k rt", "cpu s/GB",
		"lat vs sidecar", "bw vs sidecar", "lat vs direct", "bw vs direct"}
	type rowKey struct{ mode, wl string }
	for _, size := range c.SizesBytes {
		var rows []rowKey
		if hasQperf {
			for _, m := range c.Modes {
				rows = append(rows, rowKey{m, WorkloadQperf})
			}
		}
		if hasUnix {
			rows = append(rows, rowKey{ModeFloor, WorkloadUnix})
		}
		for _, row := range rows {
			res := r.FindResult(row.mode, row.wl, size)
			label := row.mode
			if row.wl == WorkloadUnix {
				label = "af_unix floor"
			}
			if res == nil {
				t.Rows = append(t.Rows, padRow([]string{sizeLabel(size), label, "(no result)"}, len(t.Head)))
				continue
			}
			var avg *float64
			if res.LatencyUS != nil {
				avg = res.LatencyUS.Avg
			}
			t.Rows = append(t.Rows, []string{sizeLabel(size), label,
				num(avg, 1), spread(res, MetricLatencyAvg, 1), num(res.BandwidthMBps, 1), spread(res, MetricBandwidth, 1),
				num(res.CPUSecondsPer1kRequests, 3), num(res.CPUSecondsPerGB, 2),
				r.ratio(row.mode, ModeSidecar, row.wl, size, "latency_avg_ratio"), r.ratio(row.mode, ModeSidecar, row.wl, size, "bandwidth_ratio"),
				r.ratio(row.mode, ModeDirect, row.wl, size, "latency_avg_ratio"), r.ratio(row.mode, ModeDirect, row.wl, size, "bandwidth_ratio")})
		}
	}
	if hasQperf && len(c.SizesBytes) > 0 {
		t.Footer = r.hopLines(WorkloadQperf, c.SizesBytes[len(c.SizesBytes)-1])
	}
	return t
}

func padRow(row []string, n int) []string {
	for len(row) < n {
		row = append(row, "")
	}
	return row
}

// breakdownLines say where an HTTP request's time went, per observing
// mode, as `meshwarp trace` shows it (see fullestBreakdown).
func (r *Report) breakdownLines() []string {
	var out []string
	for _, m := range r.Config.Modes {
		b, profile := r.fullestBreakdown(m)
		if b == nil {
			continue
		}
		var parts []string
		for _, seg := range b.Segments {
			parts = append(parts, fmt.Sprintf("%s %.0fus", seg.Name, seg.MeanSeconds*1e6))
		}
		from := ""
		if profile {
			from = " (from the profiling run, which observes client reads)"
		}
		out = append(out, fmt.Sprintf("%s: where the time goes (mean %.0fus)%s: %s", m, b.ClientMeanSeconds*1e6, from, strings.Join(parts, ", ")))
	}
	return out
}

// fullestBreakdown is mode's HTTP breakdown with the most segments: the
// last measured repeat's, or the profiling run's when only it observed
// client reads (the client_app segment); profile says which.
func (r *Report) fullestBreakdown(mode string) (b *observe.Breakdown, profile bool) {
	for _, s := range r.Runs {
		if s.Mode != mode || s.Workload != WorkloadHTTP || s.Observed == nil || s.Observed.Breakdown == nil {
			continue
		}
		c := s.Observed.Breakdown
		if b == nil || len(c.Segments) > len(b.Segments) || (len(c.Segments) == len(b.Segments) && !s.Profile) {
			b, profile = c, s.Profile
		}
	}
	return b, profile
}

// hopLines says which hops the agent accelerated, per mode with an agent.
func (r *Report) hopLines(wl string, size int) []string {
	var out []string
	for _, m := range r.Config.Modes {
		if !ModeAgent(m) {
			continue
		}
		res := r.FindResult(m, wl, size)
		if res == nil || res.Hops == nil {
			continue
		}
		h := res.Hops
		acc := "none"
		if len(h.Accelerated) > 0 {
			acc = strings.Join(h.Accelerated, ", ")
		}
		at := ""
		if size > 0 {
			at = " (" + sizeLabel(size) + ")"
		}
		line := fmt.Sprintf("%s%s: accelerated hops: %s; %d messages redirected, %d passed through TCP",
			m, at, acc, h.RedirectedMessages, h.PassthroughMessages)
		if h.BPFUSPerRequest > 0 {
			line += fmt.Sprintf("; BPF programs %.2f us per request", h.BPFUSPerRequest)
		}
		if len(h.PassthroughConnections) > 0 {
			var left []string
			for _, reason := range slices.Sorted(maps.Keys(h.PassthroughConnections)) {
				left = append(left, fmt.Sprintf("%s %d", reason, h.PassthroughConnections[reason]))
			}
			line += "; connections left to TCP (worst repeat): " + strings.Join(left, ", ")
		}
		out = append(out, line)
		out = append(out, programLines(m+at, h)...)
	}
	return out
}

func (r *Report) ratio(mode, base, wl string, size int, key string) string {
	if mode == base {
		return "1"
	}
	x := r.FindRatio(mode, base, wl, size)
	if x == nil {
		return "-"
	}
	v, ok := x.Values[key]
	if !ok {
		return "-"
	}
	return fmt.Sprintf("x%.2f", v)
}

func spread(res *Result, key string, prec int) string {
	s, ok := res.Spread[key]
	if !ok || res.Repeats < 2 {
		return ""
	}
	return "[" + fnum(s.Min, prec) + ".." + fnum(s.Max, prec) + "]"
}

func num(v *float64, prec int) string {
	if v == nil {
		return "-"
	}
	return fnum(*v, prec)
}

func fnum(v float64, prec int) string {
	if math.Abs(v) >= 1e5 {
		return fmt.Sprintf("%.0f", v)
	}
	if v != 0 && math.Abs(v) < math.Pow(10, -float64(prec)) {
		return fmt.Sprintf("%.2g", v)
	}
	return fmt.Sprintf("%.*f", prec, v)
}

func sizeLabel(n int) string {
	switch {
	case n >= 1024*1024 && n%(1024*1024) == 0:
		return fmt.Sprintf("%dM", n/(1024*1024))
	case n >= 1024 && n%1024 == 0:
		return fmt.Sprintf("%dK", n/1024)
	}
	return fmt.Sprintf("%dB", n)
}

// qperfWhere says which two sockets qperf measured.
func qperfWhere(c Config) string {
	where := "pod to pod"
	if c.QperfLoopback {
		where = "over loopback inside the server pod"
	}
	if c.QperfUnpaired {
		where += ", server outside the agent's cgroup (not pairable)"
	}
	if c.QperfCPU != nil {
		where += fmt.Sprintf(", client and server on CPU %d", *c.QperfCPU)
	}
	return where
}
