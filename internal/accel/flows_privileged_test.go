// SPDX-License-Identifier: Apache-2.0

package accel

import (
	"fmt"
	"io"
	"math"
	"net"
	"net/netip"
	"testing"

	"github.com/cilium/ebpf"

	"github.com/meshwarp/meshwarp/internal/testutil"
)

// An exchange of a paired connection is one mw_pair_flows record for the
// points of both its sockets: Flows reads it as a flow at each point, and
// adds it to the mw_flows record of the same flow (the same connection's
// exchanges after it went to TCP), per CPU copies summed.
func TestPrivilegedPairFlowsReadAtBothPoints(t *testing.T) {
	testutil.RequirePrivileged(t)
	a := startAgent(t, Config{Observe: true})
	cpus, err := ebpf.PossibleCPU()
	if err != nil {
		t.Fatal(err)
	}
	// Namespaces no socket of the test's cgroup is in: only these records carry them.
	const activeNetns, passiveNetns = 0xfeed0001, 0xfeed0002
	active := accelMwEndpoint{Addr: [4]uint32{0, 0, 0xffff0000, 0x0300000a}, PortHost: 15001}
	passive := accelMwEndpoint{Addr: [4]uint32{0, 0, 0xffff0000, 0x0400000a}, PortHost: 8080}
	perCPU := func(count, sumNs uint64, bucket int) []accelMwFlow {
		v := make([]accelMwFlow, cpus)
		v[0].Count, v[0].SumNs, v[0].Buckets[bucket] = count, sumNs, count
		v[cpus-1].Count += 1
		v[cpus-1].SumNs += 1000
		v[cpus-1].Buckets[bucket]++
		return v
	}
	// An id no connection of the test's draws (the agent counts up from 1).
	const pointsID = 0xfeed0003
	pp := accelMwPairPointsKey{ActiveNetns: activeNetns, PassiveNetns: passiveNetns, ActiveServer: active, PassiveServer: passive,
		ActivePoint: accelMwPointMW_POINT_OUTBOUND_OUT, PassivePoint: accelMwPointMW_POINT_INBOUND_IN}
	if err := a.objs.MwPairPoints.Put(pp, uint32(pointsID)); err != nil {
		t.Fatal(err)
	}
	pk := accelMwPairFlowKey{Points: pointsID, Status: 200, Method: accelMwMethodMW_METHOD_GET}
	if err := a.objs.MwPairFlows.Put(pk, perCPU(4, 4000, 1)); err != nil {
		t.Fatal(err)
	}
	// The active point's same flow, from the TCP path.
	k := accelMwFlowKey{Netns: activeNetns, Server: active, Point: accelMwPointMW_POINT_OUTBOUND_OUT, Proto: accelMwProtoMW_PROTO_HTTP,
		Status: 200, Method: accelMwMethodMW_METHOD_GET, Accelerated: 1}
	if err := a.objs.MwFlows.Put(k, perCPU(2, 2000, 1)); err != nil {
		t.Fatal(err)
	}
	flows, err := a.Flows()
	if err != nil {
		t.Fatal(err)
	}
	got := map[uint64][]Flow{}
	for _, f := range flows {
		if f.Netns == activeNetns || f.Netns == passiveNetns {
			got[f.Netns] = append(got[f.Netns], f)
		}
	}
	want := []struct {
		netns  uint64
		point  string
		server netip.AddrPort
		count  uint64
	}{
		{activeNetns, PointOutboundOut, netip.MustParseAddrPort("10.0.0.3:15001"), 5 + 3},
		{passiveNetns, PointInboundIn, netip.MustParseAddrPort("10.0.0.4:8080"), 5},
	}
	for _, w := range want {
		fs := got[w.netns]
		if len(fs) != 1 {
			t.Fatalf("netns %#x: %d flows, want 1: %+v", w.netns, len(fs), fs)
		}
		f := fs[0]
		if f.Point != w.point || f.Proto != "http" || f.Method != "GET" || f.Status != 200 || !f.Accelerated || f.Server != w.server {
			t.Errorf("netns %#x: flow %+v, want point %s, http GET 200, accelerated, server %s", w.netns, f, w.point, w.server)
		}
		if sumNs := uint64(math.Round(f.SumSeconds * 1e9)); f.Count != w.count || f.Buckets[1] != w.count || sumNs != w.count*1000 {
			t.Errorf("netns %#x: count %d, bucket %d, sum %d ns; want %d, %d, %d ns", w.netns, f.Count, f.Buckets[1], sumNs, w.count, w.count, w.count*1000)
		}
	}
}

// A paired connection's two points get an id once (mw_pair_points) and
// its exchanges are recorded under it. The ids are pinned with the points:
// a restarted agent that gave a new pair of points an id the old one gave
// already would add one server's exchanges to the other's. Exchanges of
// two servers, one before a restart and one after, are counted at each
// server exactly, at both points.
func TestPrivilegedPairPointsIDsSurviveRestart(t *testing.T) {
	testutil.RequirePrivileged(t)
	a := startAgent(t, Config{Observe: true})
	exchanges := func(a *Agent, n int) netip.AddrPort {
		ln := mustListen(t, "127.0.0.1:0")
		defer ln.Close()
		client, server := pairedConn(t, a, ln, dialer(ln.Addr().String()))
		defer client.Close()
		defer server.Close()
		req := []byte("GET /points HTTP/1.1\r\nHost: meshwarp\r\n\r\n")
		resp := []byte("HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
		httpExchanges(t, client, server, req, resp, n)
		return netip.MustParseAddrPort(ln.Addr().String())
	}
	const beforeN, afterN = 3, 5
	first := exchanges(a, beforeN)
	if err := a.Close(); err != nil {
		t.Fatal(err)
	}
	a2, err := Start(a.cfg, nil)
	if err != nil {
		t.Fatalf("restart: %v", err)
	}
	t.Cleanup(func() {
		if _, err := a2.Uninstall(); err != nil {
			t.Errorf("uninstall: %v", err)
		}
	})
	second := exchanges(a2, afterN)
	flows, err := a2.Flows()
	if err != nil {
		t.Fatal(err)
	}
	for _, w := range []struct {
		server netip.AddrPort
		count  uint64
	}{{first, beforeN}, {second, afterN}} {
		points := 0
		for _, f := range flows {
			if f.Server != w.server || f.Proto != "http" || !f.Accelerated {
				continue
			}
			points++
			if f.Count != w.count || f.Method != "GET" || f.Status != 200 {
				t.Errorf("server %s, point %s: %d exchanges (%s %d), want %d GET 200", w.server, f.Point, f.Count, f.Method, f.Status, w.count)
			}
		}
		if points != 2 {
			t.Errorf("server %s: exchanges at %d points, want 2 (client and server)", w.server, points)
		}
	}
}

// A paired connection's exchanges go to this CPU's slot for their key
// (mw_pair_flow_slots) or, where both slots the key may take hold other
// keys, to mw_pair_flows. With more keys than slots (one per status code
// from 200 to 599, each answered twice) both paths record, and every
// status is counted exactly, at both points.
func TestPrivilegedPairFlowsBeyondTheSlots(t *testing.T) {
	testutil.RequirePrivileged(t)
	a := startAgent(t, Config{Observe: true})
	const first, last, each = 200, 599, 2
	if keys := last - first + 1; keys <= int(a.objs.MwPairFlowSlots.MaxEntries()) {
		t.Fatalf("%d keys do not fill %d slots", keys, a.objs.MwPairFlowSlots.MaxEntries())
	}
	ln := mustListen(t, "127.0.0.1:0")
	defer ln.Close()
	client, server := pairedConn(t, a, ln, dialer(ln.Addr().String()))
	defer client.Close()
	defer server.Close()
	req := []byte("GET /status HTTP/1.1\r\nHost: meshwarp\r\n\r\n")
	for status := first; status <= last; status++ {
		resp := []byte(fmt.Sprintf("HTTP/1.1 %d X\r\nContent-Length: 0\r\n\r\n", status))
		httpExchanges(t, client, server, req, resp, each)
	}
	flows, err := a.Flows()
	if err != nil {
		t.Fatal(err)
	}
	addr := netip.MustParseAddrPort(ln.Addr().String())
	byStatus := map[int]map[string]uint64{}
	for _, f := range flows {
		if f.Server != addr || f.Proto != "http" || !f.Accelerated {
			continue
		}
		if byStatus[f.Status] == nil {
			byStatus[f.Status] = map[string]uint64{}
		}
		byStatus[f.Status][f.Point] += f.Count
	}
	for status := first; status <= last; status++ {
		got := byStatus[status]
		ok := len(got) == 2
		for _, n := range got {
			ok = ok && n == each
		}
		if !ok {
			t.Errorf("status %d: exchanges by point %v, want %d at each of two points (client and server)", status, got, each)
		}
	}
	// Both paths took records: the slots, and the hash past them.
	var (
		pk     accelMwPairFlowKey
		perCPU []accelMwFlow
		hashed int
	)
	for it := a.objs.MwPairFlows.Iterate(); it.Next(&pk, &perCPU); {
		hashed++
	}
	if hashed == 0 {
		t.Errorf("no record in %s: the keys past the slots were not recorded there", accelMapMwPairFlows)
	}
	var (
		slot    uint32
		perSlot []accelMwPairFlowSlot
		held    int
	)
	for it := a.objs.MwPairFlowSlots.Iterate(); it.Next(&slot, &perSlot); {
		for _, s := range perSlot {
			if s.State == accelMwSlotStateMW_SLOT_HELD {
				held++
			}
		}
	}
	if held == 0 {
		t.Errorf("no slot of %s held", accelMapMwPairFlowSlots)
	}
	t.Logf("%d slots held, %d records in %s", held, hashed, accelMapMwPairFlows)
}

// httpExchanges has the client send req and the server answer resp, n times
// in turn, each read in full by the other side.
func httpExchanges(t *testing.T, client, server net.Conn, req, resp []byte, n int) {
	t.Helper()
	buf := make([]byte, max(len(req), len(resp)))
	for range n {
		if _, err := client.Write(req); err != nil {
			t.Fatal(err)
		}
		if _, err := io.ReadFull(server, buf[:len(req)]); err != nil {
			t.Fatal(err)
		}
		if _, err := server.Write(resp); err != nil {
			t.Fatal(err)
		}
		if _, err := io.ReadFull(client, buf[:len(resp)]); err != nil {
			t.Fatal(err)
		}
	}
}
