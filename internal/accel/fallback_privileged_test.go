// SPDX-License-Identifier: Apache-2.0

package accel

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/meshwarp/meshwarp/internal/testutil"
)

// echoOn starts an echo server on addr and returns its address.
func echoOn(t *testing.T, addr string) string {
	t.Helper()
	srv := testutil.ServeEcho(mustListen(t, addr))
	t.Cleanup(srv.Close)
	return srv.Addr().String()
}

func dialer(target string) func() (net.Conn, error) {
	return func() (net.Conn, error) { return net.Dial("tcp", target) }
}

func portOf(t *testing.T, addr string) uint16 {
	t.Helper()
	_, p, _ := net.SplitHostPort(addr)
	n, err := strconv.Atoi(p)
	if err != nil {
		t.Fatal(err)
	}
	return uint16(n)
}

var fallbackOpts = testutil.IntegrityOptions{Conns: 30, Messages: 5, MaxSize: 32 << 10, Seed: 5}

// Invariant 4: excluded ports and CIDRs use the normal stack, intact, and
// a policy change applies to new connections without a reload.
func TestPrivilegedFallbackPolicy(t *testing.T) {
	testutil.RequirePrivileged(t)
	// Agent first: listeners must be created inside the test cgroup.
	a := startAgent(t, Config{})
	accelerated := echoOn(t, "127.0.0.1:0")
	excludedPort := echoOn(t, "127.0.0.1:0")
	excludedCIDR := echoOn(t, "127.0.0.2:0")
	if err := a.ApplyPolicy(Policy{
		ExcludePorts: []uint16{portOf(t, excludedPort)},
		ExcludeCIDRs: []netip.Prefix{netip.MustParsePrefix("127.0.0.2/32")},
	}); err != nil {
		t.Fatal(err)
	}

	run := func(target string) Stats {
		t.Helper()
		before := stats(t, a)
		if err := testutil.CheckIntegrity(dialer(target), fallbackOpts).Err(); err != nil {
			t.Fatalf("%s: %v", target, err)
		}
		return stats(t, a).Sub(before)
	}
	if d := run(excludedPort); d.RedirectedBytes != 0 || d.PassthroughConnections["policy"] != uint64(fallbackOpts.Conns) {
		t.Fatalf("excluded port: redirected %d bytes, policy passthrough %d", d.RedirectedBytes, d.PassthroughConnections["policy"])
	}
	if d := run(excludedCIDR); d.RedirectedBytes != 0 || d.PassthroughConnections["policy"] != uint64(fallbackOpts.Conns) {
		t.Fatalf("excluded CIDR: redirected %d bytes, policy passthrough %d", d.RedirectedBytes, d.PassthroughConnections["policy"])
	}
	if d := run(accelerated); d.RedirectedBytes == 0 {
		t.Fatal("a port outside the exclusions was not accelerated")
	}

	// Runtime change: include only the formerly excluded port.
	if err := a.ApplyPolicy(Policy{IncludePorts: []uint16{portOf(t, excludedPort)}}); err != nil {
		t.Fatal(err)
	}
	if d := run(accelerated); d.RedirectedBytes != 0 {
		t.Fatal("include list not applied at runtime: a port outside it was accelerated")
	}
	if d := run(excludedPort); d.RedirectedBytes == 0 {
		t.Fatal("include list not applied at runtime: the included port was not accelerated")
	}
}

// Invariant 4: when the SOCKMAP is full, further connections use the
// normal stack without an error reaching the application.
func TestPrivilegedFallbackSockhashFull(t *testing.T) {
	testutil.RequirePrivileged(t)
	a := startAgent(t, Config{SockhashCapacity: 8})
	target := echoOn(t, "127.0.0.1:0")
	// First 2 connections (4 sockets, below capacity), then 20 more while
	// those stay open, so the hash overflows; all are checked byte by byte.
	stop, stopStreams := testutil.StopStreams()
	defer stopStreams()
	var done []chan testutil.IntegrityResult
	for i, n := range []int{2, 20} {
		started := make(chan struct{}, n)
		res := make(chan testutil.IntegrityResult, 1)
		go func() {
			res <- testutil.CheckIntegrity(dialer(target), testutil.IntegrityOptions{Conns: n, Messages: 3, MaxSize: 8 << 10, Seed: uint64(8 + i), Stop: stop, Started: started})
		}()
		for range n {
			<-started
		}
		done = append(done, res)
	}
	stopStreams()
	for _, res := range done {
		if err := (<-res).Err(); err != nil {
			t.Fatal(err)
		}
	}
	s := stats(t, a)
	t.Logf("sockhash full %d, passthrough conns %v, paired %d", s.SockhashFull, s.PassthroughConnections, s.PairedSockets)
	if s.SockhashFull == 0 || s.PassthroughConnections["sockhash_full"] == 0 {
		t.Fatal("capacity 8 with 20 open connections did not overflow")
	}
	if s.PairedSockets == 0 {
		t.Fatal("no connection was accelerated below capacity")
	}
}

// serveSpliceEcho starts an echo server on loopback that reads with
// splice(2) (Go's io.Copy between two TCP connections does) and returns its
// address. It must start after the test joined its cgroup.
func serveSpliceEcho(t *testing.T) string {
	t.Helper()
	ln := mustListen(t, "127.0.0.1:0")
	testutil.ServeConns(t, ln, func(c net.Conn) {
		io.Copy(c, c) // splice(2) on Linux
		c.(*net.TCPConn).CloseWrite()
	})
	return ln.Addr().String()
}

// Receivers that read with splice(2) (Go's io.Copy between two TCP
// connections does) cannot see bytes redirected into the socket: the
// documented remedy is to exclude their port, and then they work.
func TestPrivilegedFallbackSpliceReceiverExcluded(t *testing.T) {
	testutil.RequirePrivileged(t)
	a := startAgent(t, Config{LearnFromSyscalls: true})
	target := serveSpliceEcho(t)
	if err := a.ApplyPolicy(Policy{ExcludePorts: []uint16{portOf(t, target)}}); err != nil {
		t.Fatal(err)
	}
	if err := testutil.CheckIntegrity(dialer(target), fallbackOpts).Err(); err != nil {
		t.Fatal(err)
	}
	// The agent saw the splice reader and names it.
	s := stats(t, a)
	self := uint32(os.Getpid())
	if s.SpliceSocketReads == 0 || !slices.ContainsFunc(s.UnfitProcesses, func(r UnfitProcess) bool {
		return r.PID == self && r.Reason == "splice_reader" && r.Calls > 0
	}) {
		t.Fatalf("splice reader not reported: %d reads, processes %+v (want pid %d)", s.SpliceSocketReads, s.UnfitProcesses, self)
	}
}

// Invariant 4: a connection whose two ends cannot be proven to be a pair
// (source NAT rewrites the address the server sees) stays on TCP, intact.
// The listener saw the SYN come from another address than the client's, so
// no local peer claims the client: it never joins the SOCKMAP, and the
// accepted side counts the connection as addr_mismatch.
func TestPrivilegedFallbackUnpairableSNAT(t *testing.T) {
	testutil.RequirePrivileged(t)
	a := startAgent(t, Config{})
	ns := testutil.NewNetns(t, "snat")
	testutil.Run(t, "ip", "-n", ns.Name, "addr", "add", "127.0.0.9/8", "dev", "lo")
	testutil.Run(t, "ip", "netns", "exec", ns.Name, "iptables", "-w", "-t", "nat", "-A", "POSTROUTING",
		"-p", "tcp", "--dport", "7009", "-j", "SNAT", "--to-source", "127.0.0.9")
	srv := testutil.ServeEcho(listenIn(t, ns, "127.0.0.1:7009"))
	defer srv.Close()
	if err := testutil.CheckIntegrity(dialIn(ns, "127.0.0.1:7009", ""), fallbackOpts).Err(); err != nil {
		t.Fatal(err)
	}
	s := stats(t, a)
	t.Logf("passthrough conns %v, redirected %d bytes", s.PassthroughConnections, s.RedirectedBytes)
	if s.PassthroughConnections["addr_mismatch"] != uint64(fallbackOpts.Conns) || s.PassthroughConnections["no_local_peer"] != 0 ||
		s.RemovedSockets["addr_mismatch"] != uint64(fallbackOpts.Conns) || s.RedirectedBytes != 0 {
		t.Fatalf("SNAT-ed connections: want %d addr_mismatch and no redirect, got %v and %d bytes",
			fallbackOpts.Conns, s.PassthroughConnections, s.RedirectedBytes)
	}
}

// A receiver that reads with splice(2) on a port nobody excluded: once the
// agent has seen one splice read there, later connections to that port are
// left to TCP and arrive intact. (The connection that revealed the splice
// reader was already paired; its redirected bytes are invisible to splice.)
func TestPrivilegedSpliceReaderPortLeftToTCP(t *testing.T) {
	testutil.RequirePrivileged(t)
	a := startAgent(t, Config{LearnFromSyscalls: true})
	target := serveSpliceEcho(t)

	// The revealing connection: its outcome is the documented hazard.
	c, err := net.Dial("tcp", target)
	if err != nil {
		t.Fatal(err)
	}
	c.Write([]byte("x"))
	c.(*net.TCPConn).CloseWrite()
	c.SetReadDeadline(time.Now().Add(30 * time.Second))
	io.Copy(io.Discard, c)
	c.Close()
	deadline := time.Now().Add(30 * time.Second)
	for stats(t, a).SpliceSocketReads == 0 {
		if time.Now().After(deadline) {
			t.Fatal("the splice read was not seen")
		}
		time.Sleep(10 * time.Millisecond) // polling interval
	}

	before := stats(t, a)
	if err := testutil.CheckIntegrity(dialer(target), fallbackOpts).Err(); err != nil {
		t.Fatal(err)
	}
	d := stats(t, a).Sub(before)
	if d.RedirectedBytes != 0 || d.PassthroughConnections["splice_reader"] != uint64(fallbackOpts.Conns) {
		t.Fatalf("after the splice reader was seen: redirected %d bytes, splice_reader passthrough %d (want 0, %d)",
			d.RedirectedBytes, d.PassthroughConnections["splice_reader"], fallbackOpts.Conns)
	}
}

// Exclusions apply to the accepting side too: a server whose real port is
// excluded stays on TCP when clients reach it through a port redirect (the
// dialled port is not excluded), and is accelerated once the exclusion goes.
func TestPrivilegedFallbackPolicyAcceptingSide(t *testing.T) {
	testutil.RequirePrivileged(t)
	a := startAgent(t, Config{})
	ns := testutil.NewNetns(t, "policy")
	testutil.Run(t, "ip", "netns", "exec", ns.Name, "iptables", "-w", "-t", "nat", "-A", "OUTPUT",
		"-p", "tcp", "-d", "127.0.0.1", "--dport", "7100", "-j", "REDIRECT", "--to-ports", "7101")
	srv := testutil.ServeEcho(listenIn(t, ns, "127.0.0.1:7101"))
	defer srv.Close()
	if err := a.ApplyPolicy(Policy{ExcludePorts: []uint16{7101}}); err != nil {
		t.Fatal(err)
	}
	run := func() Stats {
		t.Helper()
		before := stats(t, a)
		if err := testutil.CheckIntegrity(dialIn(ns, "127.0.0.1:7100", ""), fallbackOpts).Err(); err != nil {
			t.Fatal(err)
		}
		return stats(t, a).Sub(before)
	}
	if d := run(); d.RedirectedBytes != 0 || d.PassthroughConnections["policy"] != uint64(fallbackOpts.Conns) {
		t.Fatalf("server port excluded behind a redirect: redirected %d bytes, policy passthrough %d (want 0, %d)",
			d.RedirectedBytes, d.PassthroughConnections["policy"], fallbackOpts.Conns)
	}
	if err := a.ApplyPolicy(Policy{}); err != nil {
		t.Fatal(err)
	}
	if d := run(); d.RedirectedBytes == 0 {
		t.Fatal("without the exclusion the redirected connections were not accelerated")
	}
}

// connSlots describes the mw_conns slots in use (for failures).
func connSlots(t *testing.T, a *Agent) string {
	t.Helper()
	var b strings.Builder
	if err := eachConn(a.objs.MwConns, func(slot uint32, c *accelMwConn) {
		if c.Holders != 0 || c.Polls != 0 || c.State != 0 {
			fmt.Fprintf(&b, "slot %d: holders %#x, polls %d, state %d; ", slot, c.Holders, c.Polls, c.State)
		}
	}); err != nil {
		t.Fatal(err)
	}
	return b.String()
}

// mw_conn.holders bits that lapse by themselves once no socket holds the
// slot (bpf/accel/maps.h: MW_HOLD_RESERVED, MW_HOLD_LINGER).
const lapsingHolds = 4 | 8

// usedConnSlots counts the mw_conns slots that a socket or the leave poll
// holds (bpf/accel/maps.h): those no new connection may take (but for the
// second a reservation or a lingering socket's hold lasts).
func usedConnSlots(t *testing.T, a *Agent) int {
	t.Helper()
	used := 0
	if err := eachConn(a.objs.MwConns, func(_ uint32, c *accelMwConn) {
		if c.Holders&^lapsingHolds != 0 || c.Polls != 0 || c.State != 0 {
			used++
		}
	}); err != nil {
		t.Fatal(err)
	}
	return used
}

// A connection's mw_conns slot goes back when its connecting side closes,
// and the accepting side finds a connection that had to take a slot other
// than its home one: with 4 slots, two connections open at a time, 60
// times over, every connection is paired (pairedConn fails otherwise), its
// bytes arrive, and no slot stays taken.
func TestPrivilegedConnSlotsReusedAndProbed(t *testing.T) {
	testutil.RequirePrivileged(t)
	a := startAgent(t, Config{SockhashCapacity: 4})
	ln := mustListen(t, "127.0.0.1:0")
	defer ln.Close()
	before := stats(t, a)
	for round := range 60 {
		var conns []net.Conn
		for range 2 {
			c, s := pairedConn(t, a, ln, dialer(ln.Addr().String()))
			conns = append(conns, c, s)
		}
		for i := 0; i < len(conns); i += 2 {
			msg := []byte(fmt.Sprintf("round %d conn %d", round, i/2))
			if _, err := conns[i].Write(msg); err != nil {
				t.Fatal(err)
			}
			got := make([]byte, len(msg))
			if _, err := io.ReadFull(conns[i+1], got); err != nil || !bytes.Equal(got, msg) {
				t.Fatalf("round %d: read %q, %v; want %q", round, got, err, msg)
			}
		}
		for _, c := range conns {
			c.Close()
		}
		for deadline := time.Now().Add(hangGuard); usedConnSlots(t, a) != 0; time.Sleep(time.Millisecond) {
			if time.Now().After(deadline) {
				t.Fatalf("round %d: %d slots still taken after both connections closed", round, usedConnSlots(t, a))
			}
		}
	}
	d := stats(t, a).Sub(before)
	if d.PairedSockets != 240 || d.RedirectedBytes == 0 {
		t.Fatalf("paired sockets %d (want 240), redirected bytes %d", d.PairedSockets, d.RedirectedBytes)
	}
}

// A slot is taken again only when neither socket of its connection can
// send. With one slot: a paired connection's connecting side goes away
// (closed in TCP_REPAIR mode, which sends nothing, so its peer stays
// established and may still write); a new connection is dialled to a
// listener with TCP_DEFER_ACCEPT, so its connecting side is established
// and its accepted side is not (it waits for data). The old accepted side
// writes: its bytes must not reach the new connection's client, which had
// the index its old peer had if the slot were free. Freeing the slot at the
// connecting side's close makes that client receive them (checked).
func TestPrivilegedNoMisdeliveryAfterSlotReuse(t *testing.T) {
	testutil.RequirePrivileged(t)
	a := startAgent(t, Config{SockhashCapacity: 1})
	ln := mustListen(t, "127.0.0.1:0")
	defer ln.Close()
	lc := net.ListenConfig{Control: func(_, _ string, raw syscall.RawConn) error {
		var serr error
		err := raw.Control(func(fd uintptr) {
			serr = unix.SetsockoptInt(int(fd), unix.IPPROTO_TCP, unix.TCP_DEFER_ACCEPT, 30)
		})
		return errors.Join(err, serr)
	}}
	deferred, err := lc.Listen(context.Background(), "tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer deferred.Close()
	for round := range 10 {
		oldClient, oldServer := pairedConn(t, a, ln, dialer(ln.Addr().String()))
		// The accepted side redirects once (its decision is made), then its peer goes silently.
		if _, err := oldServer.Write([]byte("hello")); err != nil {
			t.Fatal(err)
		}
		if _, err := io.ReadFull(oldClient, make([]byte, 5)); err != nil {
			t.Fatal(err)
		}
		setRepair(t, oldClient)
		oldClient.Close()
		newClient, err := net.Dial("tcp", deferred.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		if _, err := oldServer.Write([]byte("old connection's bytes")); err != nil {
			t.Fatalf("round %d: write after the peer's close: %v", round, err)
		}
		// The write returned: a redirect would have queued its bytes already.
		raw, err := newClient.(*net.TCPConn).SyscallConn()
		if err != nil {
			t.Fatal(err)
		}
		var n int
		var rerr error
		raw.Control(func(fd uintptr) { n, _, rerr = unix.Recvfrom(int(fd), make([]byte, 64), unix.MSG_DONTWAIT) })
		if !errors.Is(rerr, unix.EAGAIN) {
			t.Fatalf("round %d: the new connection's client could read %d bytes (%v): another connection's", round, n, rerr)
		}
		for _, c := range []net.Conn{oldServer, newClient} {
			c.Close()
		}
		for deadline := time.Now().Add(hangGuard); usedConnSlots(t, a) != 0; time.Sleep(time.Millisecond) {
			if time.Now().After(deadline) {
				t.Fatalf("round %d: the slot is still taken after every socket closed: %s", round, connSlots(t, a))
			}
		}
	}
}

// setRepair puts a TCP socket in TCP_REPAIR mode: its close then sends
// nothing to its peer.
func setRepair(t *testing.T, c net.Conn) {
	t.Helper()
	raw, err := c.(*net.TCPConn).SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	var serr error
	if err := raw.Control(func(fd uintptr) {
		serr = unix.SetsockoptInt(int(fd), unix.IPPROTO_TCP, unix.TCP_REPAIR, 1)
	}); err != nil || serr != nil {
		t.Fatalf("TCP_REPAIR: %v %v", err, serr)
	}
}
