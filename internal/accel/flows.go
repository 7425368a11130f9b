// SPDX-License-Identifier: Apache-2.0

package accel

import (
	"encoding/binary"
	"errors"
	"fmt"
	"net/netip"
	"path/filepath"
	"strings"
	"time"

	"github.com/cilium/ebpf"
)

// ObsBucketBounds are the upper bounds of the duration histograms the
// observation keeps (mw_flows), fine enough for the tens of microseconds of
// an accelerated hop; the last bucket is +Inf. The BPF programs get them
// as obs_bounds_ns at load.
var ObsBucketBounds = []time.Duration{
	10 * time.Microsecond, 25 * time.Microsecond, 50 * time.Microsecond, 75 * time.Microsecond,
	100 * time.Microsecond, 150 * time.Microsecond, 200 * time.Microsecond, 300 * time.Microsecond,
	500 * time.Microsecond, 750 * time.Microsecond, time.Millisecond, 1500 * time.Microsecond,
	2500 * time.Microsecond, 5 * time.Millisecond, 10 * time.Millisecond, 25 * time.Millisecond,
	50 * time.Millisecond, 100 * time.Millisecond, 250 * time.Millisecond, 500 * time.Millisecond,
	time.Second, 5 * time.Second, 30 * time.Second,
}

// Point, protocol, method and TCP outcome names come from the C enums
// (bpf/accel/accel.h), like reasons and hops.
var (
	pointNames   = enumNames("mw_point", "MW_POINT_")
	protoNames   = enumNames("mw_proto", "MW_PROTO_")
	methodNames  = enumNames("mw_method", "MW_METHOD_")
	outcomeNames = enumNames("mw_tcp_outcome", "MW_TCP_")
)

// PointNames lists the observation points from the client inwards (the
// order a request through two sidecars meets them).
func PointNames() []string { return append([]string(nil), pointNames()...) }

// Point names (see enum mw_point).
const (
	PointClientApp   = "client_app"
	PointClient      = "client"
	PointOutboundIn  = "outbound_in"
	PointOutboundOut = "outbound_out"
	PointInboundIn   = "inbound_in"
	PointInboundOut  = "inbound_out"
	PointServer      = "server"
)

// Flow is what one observation point saw of one server: HTTP exchanges by
// method and status, or TCP connections by how they ended. Bytes are
// counted at least once a second while a connection is open (Outcome
// "open") and at its end with its outcome: a server's bytes are the sum.
type Flow struct {
	Point       string         `json:"point"`
	Proto       string         `json:"protocol"` // "http" or "tcp"
	Method      string         `json:"method,omitempty"`
	Status      int            `json:"status,omitempty"`
	Outcome     string         `json:"outcome,omitempty"`
	Accelerated bool           `json:"accelerated"`
	Server      netip.AddrPort `json:"server"`
	// Netns is the inode of the observing socket's network namespace (/proc/PID/ns/net).
	Netns      uint64  `json:"netns"`
	Count      uint64  `json:"count"`
	SumSeconds float64 `json:"sum_seconds"`
	Bytes      uint64  `json:"bytes"`
	// Buckets counts durations per bucket of ObsBucketBounds (not cumulative; one more for +Inf).
	Buckets []uint64 `json:"buckets"`
}

// Error reports whether the flow's exchanges or connections failed: HTTP
// 5xx, TCP resets and failed connects.
func (f Flow) Error() bool {
	if f.Proto == "http" {
		return f.Status >= 500
	}
	return f.Outcome == "reset" || f.Outcome == "connect_failed"
}

// Key identifies the flow without its values.
func (f Flow) Key() string {
	return fmt.Sprintf("%s|%s|%s|%d|%s|%t|%s|%d", f.Point, f.Proto, f.Method, f.Status, f.Outcome, f.Accelerated, f.Server, f.Netns)
}

// ReadPinnedFlows reads the observation of the agent pinned at pinDir.
func ReadPinnedFlows(pinDir string) ([]Flow, error) {
	if pinDir == "" {
		pinDir = DefaultPinDir
	}
	p := filepath.Join(pinDir, accelMapMwFlows)
	m, err := ebpf.LoadPinnedMap(p, &ebpf.LoadPinOptions{ReadOnly: true})
	if err != nil {
		return nil, fmt.Errorf("no meshwarp agent is attached at %s (%w): start one with `meshwarp run` (or pass its --pin-dir)", pinDir, errors.Unwrap(err))
	}
	defer m.Close()
	if obs, err := Observing(pinDir); err != nil || !obs {
		return nil, fmt.Errorf("the meshwarp agent at %s does not observe: restart it without --observe=false", pinDir)
	}
	var pair [3]*ebpf.Map
	for i, name := range []string{accelMapMwPairFlows, accelMapMwPairFlowSlots, accelMapMwPairPoints} {
		pair[i], err = ebpf.LoadPinnedMap(filepath.Join(pinDir, name), &ebpf.LoadPinOptions{ReadOnly: true})
		if err != nil {
			return nil, fmt.Errorf("the meshwarp agent at %s has no %s: it comes from another meshwarp build (%w)", pinDir, name, errors.Unwrap(err))
		}
		defer pair[i].Close()
	}
	return readFlows(m, pair[0], pair[1], pair[2])
}

// Flows reads the agent's observation.
func (a *Agent) Flows() ([]Flow, error) {
	return readFlows(a.objs.MwFlows, a.objs.MwPairFlows, a.objs.MwPairFlowSlots, a.objs.MwPairPoints)
}

// readFlows sums each record's per-CPU copies. A record of pairs (one
// exchange of a paired connection, seen at the points of both its sockets,
// whose id points gives) is a flow at each of the two points, added to any
// mw_flows record of the same flow (a connection's exchanges after it went
// to TCP). A pair record is in mw_pair_flows, or in a slot of
// mw_pair_flow_slots on some CPUs and in mw_pair_flows on others: both add.
func readFlows(flows, pairs, slots, points *ebpf.Map) ([]Flow, error) {
	sums := map[accelMwFlowKey]*accelMwFlow{}
	add := func(k accelMwFlowKey, perCPU []accelMwFlow) {
		v := sums[k]
		if v == nil {
			v = &accelMwFlow{}
			sums[k] = v
		}
		for _, c := range perCPU {
			v.Count += c.Count
			v.SumNs += c.SumNs
			v.Bytes += c.Bytes
			for i := range v.Buckets {
				v.Buckets[i] += c.Buckets[i]
			}
		}
	}
	var (
		k      accelMwFlowKey
		pk     accelMwPairFlowKey
		perCPU []accelMwFlow
	)
	it := flows.Iterate()
	for it.Next(&k, &perCPU) {
		add(k, perCPU)
	}
	if err := it.Err(); err != nil {
		return nil, fmt.Errorf("read %s: %w", accelMapMwFlows, err)
	}
	// The records first: each one's points were interned before it was made,
	// so the points read after them name every one.
	pairRecords := map[accelMwPairFlowKey][]accelMwFlow{}
	it = pairs.Iterate()
	for it.Next(&pk, &perCPU) {
		pairRecords[pk] = append(pairRecords[pk], perCPU...)
		perCPU = nil
	}
	if err := it.Err(); err != nil {
		return nil, fmt.Errorf("read %s: %w", accelMapMwPairFlows, err)
	}
	var (
		slot    uint32
		perSlot []accelMwPairFlowSlot
	)
	it = slots.Iterate()
	for it.Next(&slot, &perSlot) {
		for _, s := range perSlot {
			// Points 0 is no id (pair_points' failure): a key not seen whole.
			if s.State == accelMwSlotStateMW_SLOT_HELD && s.Key.Points != 0 {
				pairRecords[s.Key] = append(pairRecords[s.Key], s.Flow)
			}
		}
	}
	if err := it.Err(); err != nil {
		return nil, fmt.Errorf("read %s: %w", accelMapMwPairFlowSlots, err)
	}
	byID := map[uint32]accelMwPairPointsKey{}
	var (
		pp accelMwPairPointsKey
		id uint32
	)
	it = points.Iterate()
	for it.Next(&pp, &id) {
		byID[id] = pp
	}
	if err := it.Err(); err != nil {
		return nil, fmt.Errorf("read %s: %w", accelMapMwPairPoints, err)
	}
	for pk, perCPU := range pairRecords {
		pp, ok := byID[pk.Points]
		if !ok {
			return nil, fmt.Errorf("read %s: record of points %d, which %s does not name", accelMapMwPairFlows, pk.Points, accelMapMwPairPoints)
		}
		for _, side := range pairSides(pp, pk) {
			add(side, perCPU)
		}
	}
	out := make([]Flow, 0, len(sums))
	for k, v := range sums {
		out = append(out, flowOf(k, *v))
	}
	return out, nil
}

// pairSides is the flow key of each point of an mw_pair_flows record (pk, of points pp).
func pairSides(pp accelMwPairPointsKey, pk accelMwPairFlowKey) [2]accelMwFlowKey {
	side := func(netns uint64, server accelMwEndpoint, point accelMwPoint) accelMwFlowKey {
		return accelMwFlowKey{Netns: netns, Server: server, Point: point, Proto: accelMwProtoMW_PROTO_HTTP,
			Status: pk.Status, Method: pk.Method, Accelerated: 1}
	}
	return [2]accelMwFlowKey{
		side(pp.ActiveNetns, pp.ActiveServer, pp.ActivePoint),
		side(pp.PassiveNetns, pp.PassiveServer, pp.PassivePoint),
	}
}

func flowOf(k accelMwFlowKey, v accelMwFlow) Flow {
	f := Flow{
		Point:       enumName(pointNames(), uint32(k.Point)),
		Proto:       enumName(protoNames(), uint32(k.Proto)),
		Accelerated: k.Accelerated != 0,
		Server:      endpointAddrPort(k.Server),
		Netns:       k.Netns,
		Count:       v.Count,
		SumSeconds:  float64(v.SumNs) / 1e9,
		Bytes:       v.Bytes,
		Buckets:     append([]uint64(nil), v.Buckets[:]...),
	}
	if f.Proto == "http" {
		f.Method = HTTPMethodName(uint32(k.Method))
		f.Status = int(k.Status)
	} else {
		f.Outcome = enumName(outcomeNames(), uint32(k.Outcome))
	}
	return f
}

// HTTPMethodName renders a method as OpenTelemetry does: upper case, and
// "_OTHER" for methods outside the known set.
func HTTPMethodName(v uint32) string {
	n := enumName(methodNames(), v)
	if n == "other" || n == "" {
		return "_OTHER"
	}
	return strings.ToUpper(n)
}

func enumName(names []string, v uint32) string {
	if int(v) < len(names) {
		return names[v]
	}
	return fmt.Sprint(v)
}

// endpointAddrPort turns an mw_endpoint (IPv4 as v4-mapped) into an address.
func endpointAddrPort(e accelMwEndpoint) netip.AddrPort {
	var b [16]byte
	for i, w := range e.Addr {
		binary.LittleEndian.PutUint32(b[i*4:], w) // network order bytes, loaded little-endian
	}
	return netip.AddrPortFrom(netip.AddrFrom16(b).Unmap(), uint16(e.PortHost))
}
