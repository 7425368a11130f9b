// SPDX-License-Identifier: Apache-2.0

package accel

import (
	"reflect"
)

// Counters are the data path's counters (mw_stats, summed over CPUs): the
// fields of Stats that `meshwarp status --json` prints and the bench reports
// per run (bench.AgentDelta embeds them), under the same JSON keys.
// CounterModel describes each of them once.
type Counters struct {
	AcceleratedSockets  uint64 `json:"accelerated_sockets"`
	RedirectedMessages  uint64 `json:"redirected_messages"`
	RedirectedBytes     uint64 `json:"redirected_bytes"`
	PassthroughMessages uint64 `json:"passthrough_messages"`
	PassthroughBytes    uint64 `json:"passthrough_bytes"`
	// The maps by reason hold every reason as read from the maps (status),
	// and only the non-zero ones in a bench run (NonZero).
	PassthroughByReason      map[string]uint64   `json:"passthrough_by_reason,omitempty"`
	PassthroughBytesByReason map[string]uint64   `json:"passthrough_bytes_by_reason,omitempty"`
	PassthroughConnections   map[string]uint64   `json:"passthrough_connections_by_reason,omitempty"`
	RemovedSockets           map[string]uint64   `json:"removed_sockets_by_reason,omitempty"`
	PairedSockets            uint64              `json:"paired_sockets_total"`
	LeftSockets              uint64              `json:"left_sockets_total"`
	SockhashFull             uint64              `json:"sockhash_full"`
	NATPortRemaps            uint64              `json:"nat_port_remapped_connections"`
	FlowsFull                uint64              `json:"observe_flows_full"`
	Hops                     map[string]HopStats `json:"hops,omitempty"`
	SpliceSocketReads        uint64              `json:"splice_socket_reads"`
	UnfitCalls               map[string]uint64   `json:"unfit_calls_by_reason,omitempty"`
}

// HopStats counts one hop kind (app_to_sidecar, sidecar_to_sidecar,
// sidecar_to_app, direct).
type HopStats struct {
	PairedConnections  uint64 `json:"paired_connections"`
	RedirectedMessages uint64 `json:"redirected_messages"`
	RedirectedBytes    uint64 `json:"redirected_bytes"`
}

// Labels a counter is split by.
const (
	LabelReason = "reason" // ReasonNames
	LabelHop    = "hop"    // HopNames
)

// Counter describes one counter of Counters: the one description from which
// the Prometheus metrics (internal/metrics), `status` and the bench's JSON
// (and, by tests, its schema, the dashboard and the docs) are derived.
type Counter struct {
	// Key is the JSON key in Counters; a hop counter is Hops[hop].HopKey.
	Key    string
	HopKey string
	// Metric is the Prometheus name, "" for a counter only in the JSON (a
	// sum of a metric's labels, or paired_sockets_total: see
	// meshwarp_accel_sockets).
	Metric string
	Help   string
	// Label is "", LabelReason or LabelHop.
	Label string
	// Gauge: a value now, not cumulative (Sub and Add keep the left one).
	Gauge bool
	// field names the mw_counters field (generated struct) it is read
	// from; "" for those computed from others.
	field string
	// One of these reaches the value in Counters, by Label.
	scalar func(*Counters) *uint64
	split  func(*Counters) *map[string]uint64
	hop    func(*HopStats) *uint64
}

// counterModel lists every counter. mw_counters.sockets_closed is read only
// for accelerated_sockets (TestCounterModelCoversCStruct).
var counterModel = []Counter{
	{Key: "accelerated_sockets", Metric: "meshwarp_accel_sockets", Gauge: true,
		Help:   "Sockets currently accelerated: paired, not left to TCP, and their connection not ended (closed by either side; the connecting side's close ends it for both).",
		scalar: func(c *Counters) *uint64 { return &c.AcceleratedSockets }},
	{Key: "redirected_bytes", Metric: "meshwarp_accel_redirected_bytes_total", field: "RedirectedBytes",
		Help:   "Bytes moved socket-to-socket by sk_msg, skipping the TCP/IP stack.",
		scalar: func(c *Counters) *uint64 { return &c.RedirectedBytes }},
	{Key: "redirected_messages", Metric: "meshwarp_accel_redirected_messages_total", field: "RedirectedMsgs",
		Help:   "sendmsg calls whose data was redirected to the peer socket.",
		scalar: func(c *Counters) *uint64 { return &c.RedirectedMessages }},
	{Key: "passthrough_messages",
		Help:   "Messages of tracked sockets sent through the normal TCP stack (every reason).",
		scalar: func(c *Counters) *uint64 { return &c.PassthroughMessages }},
	{Key: "passthrough_bytes",
		Help:   "Bytes of tracked sockets sent through the normal TCP stack (every reason).",
		scalar: func(c *Counters) *uint64 { return &c.PassthroughBytes }},
	{Key: "passthrough_by_reason", Metric: "meshwarp_accel_passthrough_messages_total", Label: LabelReason, field: "PassthroughMsgs",
		Help:  "Messages of tracked sockets sent through the normal TCP stack, by reason.",
		split: func(c *Counters) *map[string]uint64 { return &c.PassthroughByReason }},
	{Key: "passthrough_bytes_by_reason", Metric: "meshwarp_accel_passthrough_bytes_total", Label: LabelReason, field: "PassthroughBytes",
		Help:  "Bytes of tracked sockets sent through the normal TCP stack, by reason.",
		split: func(c *Counters) *map[string]uint64 { return &c.PassthroughBytesByReason }},
	{Key: "passthrough_connections_by_reason", Metric: "meshwarp_accel_passthrough_connections_total", Label: LabelReason, field: "PassthroughConns",
		Help:  "Connections left to the normal TCP stack, by reason (including those never seen by sk_msg, such as policy exclusions).",
		split: func(c *Counters) *map[string]uint64 { return &c.PassthroughConnections }},
	{Key: "removed_sockets_by_reason", Metric: "meshwarp_accel_removed_sockets_total", Label: LabelReason, field: "SocketsRemoved",
		Help:  "Sockets kept off the SOCKMAP or taken out of it again because their connection was left to TCP (plain TCP sockets from then on), by reason.",
		split: func(c *Counters) *map[string]uint64 { return &c.RemovedSockets }},
	{Key: "paired_sockets_total", field: "SocketsPaired",
		Help:   "Sockets that joined a paired connection.",
		scalar: func(c *Counters) *uint64 { return &c.PairedSockets }},
	{Key: "left_sockets_total", Metric: "meshwarp_accel_left_sockets_total", field: "SocketsLeft",
		Help:   "Paired sockets that left the SOCKMAP after their connection went to TCP as a whole (small_stream, one-way backpressure), once their redirected bytes were read.",
		scalar: func(c *Counters) *uint64 { return &c.LeftSockets }},
	{Key: "sockhash_full", Metric: "meshwarp_accel_sockhash_full_total", field: "SockhashFull",
		Help:   "Sockets not accelerated because the SOCKMAP was at capacity.",
		scalar: func(c *Counters) *uint64 { return &c.SockhashFull }},
	{Key: "nat_port_remapped_connections", Metric: "meshwarp_accel_nat_port_remapped_connections_total", field: "NatPortRemaps",
		Help:   "Connections paired although NAT (conntrack under REDIRECT or DNAT) rewrote their source port between the two ends.",
		scalar: func(c *Counters) *uint64 { return &c.NATPortRemaps }},
	{Key: "observe_flows_full", Metric: "meshwarp_observe_flows_full_total", field: "FlowsFull",
		Help:   "Observations lost because the flow table (mw_flows) was full.",
		scalar: func(c *Counters) *uint64 { return &c.FlowsFull }},
	{Key: "hops", HopKey: "paired_connections", Metric: "meshwarp_accel_hop_paired_connections_total", Label: LabelHop, field: "HopConns",
		Help: "Connections paired, by mesh hop.",
		hop:  func(h *HopStats) *uint64 { return &h.PairedConnections }},
	{Key: "hops", HopKey: "redirected_bytes", Metric: "meshwarp_accel_hop_redirected_bytes_total", Label: LabelHop, field: "HopBytes",
		Help: "Bytes redirected, by mesh hop.",
		hop:  func(h *HopStats) *uint64 { return &h.RedirectedBytes }},
	{Key: "hops", HopKey: "redirected_messages", Metric: "meshwarp_accel_hop_redirected_messages_total", Label: LabelHop, field: "HopMsgs",
		Help: "Messages redirected, by mesh hop.",
		hop:  func(h *HopStats) *uint64 { return &h.RedirectedMessages }},
	{Key: "splice_socket_reads", Metric: "meshwarp_accel_splice_socket_reads_total", field: "SpliceSocketReads",
		Help:   "splice(2) reads from sockets by processes of the accelerated cgroup (such readers cannot see redirected bytes).",
		scalar: func(c *Counters) *uint64 { return &c.SpliceSocketReads }},
	{Key: "unfit_calls_by_reason", Metric: "meshwarp_accel_unfit_calls_total", Label: LabelReason, field: "UnfitCalls",
		Help:  "Calls on accelerated sockets that a redirect cannot honour (splice, MSG_WAITALL, MSG_OOB, SO_RCVLOWAT, close with unread bytes), by the reason they teach: later connections on those ports, and of those programs, stay on TCP.",
		split: func(c *Counters) *map[string]uint64 { return &c.UnfitCalls }},
}

// CounterModel returns the description of every counter.
func CounterModel() []Counter { return append([]Counter(nil), counterModel...) }

// LabelValues lists the values of the counter's label (nil without one).
func (k Counter) LabelValues() []string {
	switch k.Label {
	case LabelReason:
		return ReasonNames()
	case LabelHop:
		return HopNames()
	}
	return nil
}

// Values returns the counter's values in c by label value ("" without a
// label); a label value c does not hold counts 0.
func (k Counter) Values(c Counters) map[string]uint64 {
	switch {
	case k.scalar != nil:
		return map[string]uint64{"": *k.scalar(&c)}
	case k.split != nil:
		return *k.split(&c)
	}
	out := map[string]uint64{}
	for name, h := range c.Hops {
		out[name] = *k.hop(&h)
	}
	return out
}

// Set sets the counter's value in c for one label value ("" without a label).
func (k Counter) Set(c *Counters, label string, v uint64) {
	switch {
	case k.scalar != nil:
		*k.scalar(c) = v
	case k.split != nil:
		m := k.split(c)
		if *m == nil {
			*m = map[string]uint64{}
		}
		(*m)[label] = v
	default:
		if c.Hops == nil {
			c.Hops = map[string]HopStats{}
		}
		h := c.Hops[label]
		*k.hop(&h) = v
		c.Hops[label] = h
	}
}

// countersFromC turns the summed mw_counters into Counters, by the model.
func countersFromC(t *accelMwCounters) Counters {
	c := Counters{Hops: map[string]HopStats{}}
	v := reflect.ValueOf(t).Elem()
	for _, k := range counterModel {
		if k.field == "" {
			continue
		}
		f := v.FieldByName(k.field)
		switch {
		case k.scalar != nil:
			*k.scalar(&c) = f.Uint()
		case k.split != nil:
			m := map[string]uint64{}
			for i, name := range reasonNames() {
				if i > 0 { // "none"
					m[name] = f.Index(i).Uint()
				}
			}
			*k.split(&c) = m
		default:
			for i, name := range hopNames() {
				h := c.Hops[name]
				*k.hop(&h) = f.Index(i).Uint()
				c.Hops[name] = h
			}
		}
	}
	// Per-CPU counters are summed without a lock, so a close counted on one
	// CPU can be seen before the matching pairing on another: clamp at 0.
	if done := t.SocketsClosed + t.SocketsLeft; t.SocketsPaired > done {
		c.AcceleratedSockets = t.SocketsPaired - done
	}
	for _, n := range c.PassthroughByReason {
		c.PassthroughMessages += n
	}
	for _, n := range c.PassthroughBytesByReason {
		c.PassthroughBytes += n
	}
	return c
}

// addCounters adds every counter of one CPU's copy c to t.
func addCounters(t, c *accelMwCounters) {
	tv, cv := reflect.ValueOf(t).Elem(), reflect.ValueOf(c).Elem()
	for i := range tv.NumField() {
		f, g := tv.Field(i), cv.Field(i)
		switch f.Kind() {
		case reflect.Uint64:
			f.SetUint(f.Uint() + g.Uint())
		case reflect.Array:
			for j := range f.Len() {
				f.Index(j).SetUint(f.Index(j).Uint() + g.Index(j).Uint())
			}
		}
	}
}

// combine applies op to every cumulative counter of c and o; gauges are c's.
func (c Counters) combine(o Counters, op func(a, b uint64) uint64) Counters {
	d := c
	d.Hops = map[string]HopStats{}
	hops := map[string]bool{}
	for name := range c.Hops {
		hops[name] = true
	}
	for name := range o.Hops {
		hops[name] = true
	}
	for _, k := range counterModel {
		switch {
		case k.Gauge:
		case k.scalar != nil:
			*k.scalar(&d) = op(*k.scalar(&c), *k.scalar(&o))
		case k.split != nil:
			*k.split(&d) = combineMap(*k.split(&c), *k.split(&o), op)
		default:
			for name := range hops {
				h, a, b := d.Hops[name], c.Hops[name], o.Hops[name]
				*k.hop(&h) = op(*k.hop(&a), *k.hop(&b))
				d.Hops[name] = h
			}
		}
	}
	return d
}

// NonZero returns c with the zero entries of its maps by reason left out
// (nil when none is left): what one bench run changed.
func (c Counters) NonZero() Counters {
	for _, k := range counterModel {
		if k.split == nil {
			continue
		}
		var m map[string]uint64
		for name, n := range *k.split(&c) {
			if n == 0 {
				continue
			}
			if m == nil {
				m = map[string]uint64{}
			}
			m[name] = n
		}
		*k.split(&c) = m
	}
	return c
}
