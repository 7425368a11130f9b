// SPDX-License-Identifier: Apache-2.0

package accel

import (
	"encoding/binary"
	"net/netip"
	"reflect"
	"testing"
)

// The BPF side compares addresses as the raw network-order words it reads
// from sock_ops (IPv4 as ::ffff:a.b.c.d). Go must build identical LPM keys.
func TestCIDRKeyEncoding(t *testing.T) {
	word := func(b0, b1, b2, b3 byte) uint32 { return binary.NativeEndian.Uint32([]byte{b0, b1, b2, b3}) }
	cases := []struct {
		in   string
		want accelMwCidrKey
	}{
		{"10.1.2.0/24", accelMwCidrKey{Prefixlen: 96 + 24, Addr: [4]uint32{0, 0, word(0, 0, 0xff, 0xff), word(10, 1, 2, 0)}}},
		{"127.0.0.6/32", accelMwCidrKey{Prefixlen: 128, Addr: [4]uint32{0, 0, word(0, 0, 0xff, 0xff), word(127, 0, 0, 6)}}},
		// Host bits are masked off: the trie stores canonical prefixes.
		{"10.1.2.3/8", accelMwCidrKey{Prefixlen: 96 + 8, Addr: [4]uint32{0, 0, word(0, 0, 0xff, 0xff), word(10, 0, 0, 0)}}},
		{"fd00::1/128", accelMwCidrKey{Prefixlen: 128, Addr: [4]uint32{word(0xfd, 0, 0, 0), 0, 0, word(0, 0, 0, 1)}}},
	}
	for _, c := range cases {
		if got := cidrKey(netip.MustParsePrefix(c.in)); got != c.want {
			t.Errorf("cidrKey(%s) = %+v, want %+v", c.in, got, c.want)
		}
	}
}

func TestPortActionsExcludeWins(t *testing.T) {
	p := Policy{IncludePorts: []uint16{80, 443}, ExcludePorts: []uint16{443}}
	want := map[uint32]uint32{80: portInclude, 443: portExclude}
	if got := p.portActions(); !reflect.DeepEqual(got, want) {
		t.Fatalf("got %v, want %v", got, want)
	}
}

func TestPolicyValidate(t *testing.T) {
	if err := (Policy{IncludePorts: []uint16{0}}).Validate(); err == nil {
		t.Error("port 0 accepted")
	}
	many := make([]uint16, maxPolicyEntries+1)
	for i := range many {
		many[i] = uint16(i + 1)
	}
	if err := (Policy{ExcludePorts: many}).Validate(); err == nil {
		t.Error("more ports than the map holds accepted")
	}
	if err := (Policy{ExcludeCIDRs: []netip.Prefix{{}}}).Validate(); err == nil {
		t.Error("invalid CIDR accepted")
	}
}

func TestSumCountersAcrossCPUs(t *testing.T) {
	var a, b accelMwCounters
	a.SocketsPaired, b.SocketsPaired = 4, 2
	a.SocketsClosed = 1
	a.RedirectedBytes, b.RedirectedBytes = 100, 50
	a.PassthroughMsgs[1], b.PassthroughMsgs[2] = 3, 4 // no_peer, peer_closed
	a.PassthroughConns[6] = 2                         // policy
	b.HopBytes[1] = 7                                 // app_to_sidecar
	s := sumCounters([]accelMwCounters{a, b})
	if s.AcceleratedSockets != 5 || s.RedirectedBytes != 150 || s.PassthroughMessages != 7 {
		t.Fatalf("sum: %+v", s)
	}
	if s.PassthroughByReason["no_peer"] != 3 || s.PassthroughByReason["peer_closed"] != 4 || s.PassthroughConnections["policy"] != 2 {
		t.Fatalf("reasons: %v %v", s.PassthroughByReason, s.PassthroughConnections)
	}
	if s.Hops["app_to_sidecar"].RedirectedBytes != 7 {
		t.Fatalf("hops: %v", s.Hops)
	}
	// A connection re-counted on another CPU (no_local_peer -> hint_missed)
	// leaves one CPU's counter wrapped below zero; the sum is exact.
	var x, y accelMwCounters
	x.PassthroughConns[8] = 3                                     // no_local_peer
	y.PassthroughConns[8], y.PassthroughConns[15] = ^uint64(0), 1 // -1, hint_missed
	if r := sumCounters([]accelMwCounters{x, y}).PassthroughConnections; r["no_local_peer"] != 2 || r["hint_missed"] != 1 {
		t.Fatalf("re-counted reasons: %v", r)
	}
	// A close seen before its pairing (per-CPU race) must not wrap around.
	var c accelMwCounters
	c.SocketsClosed = 1
	if got := sumCounters([]accelMwCounters{c}).AcceleratedSockets; got != 0 {
		t.Fatalf("gauge wrapped: %d", got)
	}
}

func TestStatsSub(t *testing.T) {
	before := sumCounters([]accelMwCounters{{RedirectedBytes: 10, SocketsPaired: 2}})
	var c accelMwCounters
	c.RedirectedBytes, c.SocketsPaired, c.HopMsgs[0] = 25, 6, 3
	d := sumCounters([]accelMwCounters{c}).Sub(before)
	if d.RedirectedBytes != 15 || d.PairedSockets != 4 || d.Hops["direct"].RedirectedMessages != 3 {
		t.Fatalf("sub: %+v", d)
	}
}

// The names the Go side prints must match the C enums' order.
func TestReasonAndHopNames(t *testing.T) {
	if len(reasonNames()) != len(accelMwCounters{}.PassthroughMsgs) {
		t.Fatalf("%d reason names for %d counters (bpf/accel/accel.h MW_REASON_MAX)", len(reasonNames()), len(accelMwCounters{}.PassthroughMsgs))
	}
	if len(hopNames()) != len(accelMwCounters{}.HopMsgs) {
		t.Fatalf("%d hop names for %d counters (MW_HOP_MAX)", len(hopNames()), len(accelMwCounters{}.HopMsgs))
	}
}
