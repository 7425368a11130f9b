// SPDX-License-Identifier: Apache-2.0

package accel

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"slices"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/meshwarp/meshwarp/internal/testutil"
)

// Invariants 4 and 6 for sockets meshwarp does not accelerate: they are not
// left in the SOCKMAP, so FIONREAD (and everything else) is plain TCP's.
// Each case runs with and without the agent; the assertions are the same.

// A connection's exchange: the server speaks first, or answers the client's
// request, with size bytes.
type exchangeCase struct {
	serverFirst bool
	size        int
}

func (c exchangeCase) String() string {
	who := "client-writes-first"
	if c.serverFirst {
		who = "server-speaks-first"
	}
	return fmt.Sprintf("%s/%dB", who, c.size)
}

var exchangeCases = []exchangeCase{{true, 1000}, {true, 100_000}, {false, 1000}, {false, 100_000}}

const requestSize = 100

// inq is ioctl(FIONREAD): the bytes a read would return right now.
func inq(c net.Conn) (int, error) {
	rc, err := c.(syscall.Conn).SyscallConn()
	if err != nil {
		return 0, err
	}
	var n int
	var ierr error
	if err := rc.Control(func(fd uintptr) { n, ierr = unix.IoctlGetInt(int(fd), unix.SIOCINQ) }); err != nil {
		return 0, err
	}
	return n, ierr
}

// socketCookie is SO_COOKIE, the value the SOCKMAP holds for a socket.
func socketCookie(t testing.TB, c net.Conn) uint64 {
	t.Helper()
	rc, err := c.(syscall.Conn).SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	var v uint64
	var gerr error
	rc.Control(func(fd uintptr) { v, gerr = unix.GetsockoptUint64(int(fd), unix.SOL_SOCKET, unix.SO_COOKIE) })
	if gerr != nil {
		t.Fatalf("SO_COOKIE: %v", gerr)
	}
	return v
}

// awaitInq polls FIONREAD until it reports want bytes. The peer has written
// them all and nobody reads, so on TCP the count reaches want and stays.
func awaitInq(c net.Conn, want int) error {
	deadline := time.Now().Add(hangGuard)
	last := -1
	for time.Now().Before(deadline) {
		n, err := inq(c)
		if err != nil {
			return fmt.Errorf("FIONREAD: %w", err)
		}
		if n == want {
			return nil
		}
		if n > want {
			return fmt.Errorf("FIONREAD = %d, only %d bytes were sent", n, want)
		}
		last = n
		time.Sleep(time.Millisecond)
	}
	return fmt.Errorf("FIONREAD = %d while %d bytes wait", last, want)
}

// receive checks FIONREAD against the size the peer wrote, then reads and
// compares the bytes.
func receive(c net.Conn, want []byte) error {
	if err := awaitInq(c, len(want)); err != nil {
		return err
	}
	got := make([]byte, len(want))
	if _, err := io.ReadFull(c, got); err != nil {
		return fmt.Errorf("read: %w", err)
	}
	if !bytes.Equal(got, want) {
		return errors.New("bytes differ from what was sent")
	}
	return nil
}

// dialBigRcvbuf dials target (inside ns when ns is not nil) with a receive
// buffer large enough that the peer's 100 KB fit without a read.
func dialBigRcvbuf(ns *testutil.Netns, target string) (net.Conn, error) {
	d := net.Dialer{Timeout: 10 * time.Second, Control: func(_, _ string, rc syscall.RawConn) error {
		var serr error
		rc.Control(func(fd uintptr) { serr = unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_RCVBUF, 1<<20) })
		return serr
	}}
	if ns == nil {
		return d.DialContext(context.Background(), "tcp", target)
	}
	var c net.Conn
	err := ns.Do(func() (err error) { c, err = d.DialContext(context.Background(), "tcp", target); return })
	return c, err
}

// exchange runs one connection of case tc against ln and returns both ends,
// still open, so the caller can inspect them.
func exchange(t *testing.T, ln net.Listener, ns *testutil.Netns, tc exchangeCase) (client, server net.Conn) {
	t.Helper()
	rng := rand.New(rand.NewPCG(uint64(tc.size), 7))
	request := make([]byte, requestSize)
	response := make([]byte, tc.size)
	for _, b := range [][]byte{request, response} {
		for i := range b {
			b[i] = byte(rng.Uint32())
		}
	}
	type accepted struct {
		c   net.Conn
		err error
	}
	done := make(chan accepted, 1)
	go func() {
		c, err := ln.Accept()
		if err == nil && !tc.serverFirst {
			err = receive(c, request)
			if err != nil {
				err = fmt.Errorf("server: %w", err)
			}
		}
		if err == nil {
			_, err = c.Write(response)
		}
		done <- accepted{c, err}
	}()
	client, err := dialBigRcvbuf(ns, ln.Addr().String())
	if err != nil {
		t.Fatalf("dial: %v", err)
	}
	t.Cleanup(func() { client.Close() })
	if !tc.serverFirst {
		if _, err := client.Write(request); err != nil {
			t.Fatalf("client write: %v", err)
		}
	}
	if err := receive(client, response); err != nil {
		t.Fatalf("client: %v", err)
	}
	a := <-done
	if a.c != nil {
		t.Cleanup(func() { a.c.Close() })
	}
	if a.err != nil {
		t.Fatal(a.err)
	}
	return client, a.c
}

func sockhashCookies(t testing.TB, a *Agent) []uint64 {
	t.Helper()
	cookies, err := a.SockhashCookies()
	if err != nil {
		t.Fatal(err)
	}
	return cookies
}

// requireOutsideSockhash fails when any of conns is in the agent's SOCKMAP.
func requireOutsideSockhash(t *testing.T, a *Agent, conns ...net.Conn) {
	t.Helper()
	in := sockhashCookies(t, a)
	for _, c := range conns {
		if slices.Contains(in, socketCookie(t, c)) {
			t.Fatalf("socket %v -> %v is in the SOCKMAP but is not accelerated", c.LocalAddr(), c.RemoteAddr())
		}
	}
}

// exchangeUnaccelerated runs every exchange case against ln (in ns, if not
// nil), requires that neither end is in the agent's SOCKMAP, and returns
// the agent's counters over the run (zero without an agent).
func exchangeUnaccelerated(t *testing.T, a *Agent, ln net.Listener, ns *testutil.Netns) Stats {
	t.Helper()
	var before Stats
	if a != nil {
		before = stats(t, a)
	}
	for _, tc := range exchangeCases {
		client, server := exchange(t, ln, ns, tc)
		if a != nil {
			requireOutsideSockhash(t, a, client, server)
		}
	}
	if a == nil {
		return Stats{}
	}
	return stats(t, a).Sub(before)
}

// forEachAgentMode runs fn without and with the agent; setup runs before
// the agent starts (what it creates is outside the agent's cgroup).
func forEachAgentMode(t *testing.T, setup func(t *testing.T) net.Listener, fn func(t *testing.T, a *Agent, ln net.Listener)) {
	forEachAgentConfig(t, Config{}, setup, fn)
}

// forEachAgentConfig is forEachAgentMode with the agent started with cfg.
func forEachAgentConfig(t *testing.T, cfg Config, setup func(t *testing.T) net.Listener, fn func(t *testing.T, a *Agent, ln net.Listener)) {
	testutil.WithAndWithout(t, func(t *testing.T, withAgent bool) {
		ln := setup(t)
		if ln != nil {
			t.Cleanup(func() { ln.Close() })
		}
		var a *Agent
		if withAgent {
			a = startAgent(t, cfg)
		}
		fn(t, a, ln)
	})
}

// A client of the attached cgroup whose server is outside it (the shape of
// every connection to another host) never joins the SOCKMAP: FIONREAD
// counts its bytes, whoever speaks first, and it pays nothing per message.
func TestPrivilegedNoHarmServerOutsideCgroup(t *testing.T) {
	testutil.RequirePrivileged(t)
	forEachAgentMode(t, func(t *testing.T) net.Listener {
		// Created before the agent's cgroup is entered: outside it.
		return mustListen(t, "127.0.0.1:0")
	}, func(t *testing.T, a *Agent, ln net.Listener) {
		d := exchangeUnaccelerated(t, a, ln, nil)
		if a == nil {
			return
		}
		if got := d.PassthroughConnections["no_local_peer"]; got != uint64(len(exchangeCases)) {
			t.Fatalf("no_local_peer connections = %d, want %d (%v)", got, len(exchangeCases), d.PassthroughConnections)
		}
		if got := d.RemovedSockets["no_local_peer"]; got != uint64(len(exchangeCases)) {
			t.Fatalf("sockets kept off the SOCKMAP as no_local_peer = %d, want %d (%v)", got, len(exchangeCases), d.RemovedSockets)
		}
		if d.RedirectedMessages+d.PassthroughMessages != 0 {
			t.Fatalf("the sk_msg program ran on sockets it cannot accelerate: %d redirected, %d passed", d.RedirectedMessages, d.PassthroughMessages)
		}
	})
}

// A paired connection: FIONREAD counts the redirected bytes on both ends,
// and both sockets are in the SOCKMAP.
func TestPrivilegedNoHarmPairedFIONREAD(t *testing.T) {
	testutil.RequirePrivileged(t)
	forEachAgentMode(t, func(t *testing.T) net.Listener { return nil }, func(t *testing.T, a *Agent, _ net.Listener) {
		ln := mustListen(t, "127.0.0.1:0") // inside the cgroup when the agent runs
		defer ln.Close()
		for _, tc := range exchangeCases {
			before := Stats{}
			if a != nil {
				before = stats(t, a)
			}
			client, server := exchange(t, ln, nil, tc)
			if a == nil {
				continue
			}
			in := sockhashCookies(t, a)
			if !slices.Contains(in, socketCookie(t, client)) || !slices.Contains(in, socketCookie(t, server)) {
				t.Fatalf("%v: a paired connection's sockets are not both in the SOCKMAP", tc)
			}
			if d := stats(t, a).Sub(before); d.RedirectedBytes < uint64(tc.size) {
				t.Fatalf("%v: %d bytes redirected, want the whole response", tc, d.RedirectedBytes)
			}
		}
	})
}

// Connections decided passthrough: excluded by policy (they never join), or
// hinted and then left to TCP because their accepted side came late (the
// handshake's last ACK is dropped): the late accepted side or the client's
// own first packet takes the client out of the SOCKMAP before the server
// can send, so FIONREAD is right on both ends.
func TestPrivilegedNoHarmPassthroughFIONREAD(t *testing.T) {
	testutil.RequirePrivileged(t)
	t.Run("policy", func(t *testing.T) {
		forEachAgentMode(t, func(t *testing.T) net.Listener { return nil }, func(t *testing.T, a *Agent, _ net.Listener) {
			ln := mustListen(t, "127.0.0.1:0")
			defer ln.Close()
			if a != nil {
				if err := a.ApplyPolicy(Policy{ExcludePorts: []uint16{portOf(t, ln.Addr().String())}}); err != nil {
					t.Fatal(err)
				}
			}
			exchangeUnaccelerated(t, a, ln, nil)
		})
	})
	t.Run("late-accept", func(t *testing.T) {
		var ns *testutil.Netns
		forEachAgentMode(t, func(t *testing.T) net.Listener { return nil }, func(t *testing.T, a *Agent, _ net.Listener) {
			ns = testutil.NewNetns(t, "late")
			dropFinalHandshakeACK(t, ns, 7004)
			ln := listenIn(t, ns, "127.0.0.1:7004")
			defer ln.Close()
			d := exchangeUnaccelerated(t, a, ln, ns)
			if a == nil {
				return
			}
			t.Logf("removed %v, passthrough conns %v", d.RemovedSockets, d.PassthroughConnections)
			// Server first: the client waits; a second later the listener
			// sends its SYN-ACK again, and the client's ACK to it (or the
			// accepted side that ACK gives birth to) finds the connection
			// older than the unpaired timeout. Client first: its first byte
			// decides no_peer, and its data packet takes it out. Either way
			// each client leaves the SOCKMAP, for one of these two reasons.
			late, first := d.RemovedSockets["unpaired_timeout"], d.RemovedSockets["no_peer"]
			if late < 2 || late+first < uint64(len(exchangeCases)) {
				t.Fatalf("want the %d clients removed by unpaired_timeout or no_peer, the 2 server-first ones by unpaired_timeout; got %v",
					len(exchangeCases), nonZero(d.RemovedSockets))
			}
			if d.RedirectedBytes != 0 {
				t.Fatalf("%d bytes redirected on connections left to TCP", d.RedirectedBytes)
			}
		})
	})
}

// A client still waiting in the SOCKMAP for its accepted side (born late:
// the handshake's last ACK is dropped) when the agent is uninstalled, or
// when `meshwarp cleanup` removes what a killed agent left. No sock_ops
// callback runs after that to take it out at its first packet, so the
// uninstall (the cleanup) does. The accepted side is born from the
// retransmitted handshake and speaks first: FIONREAD counts its bytes and
// they arrive intact, as without the agent.
func TestPrivilegedUninstallReleasesWaitingClient(t *testing.T) {
	testutil.RequirePrivileged(t)
	for _, how := range []string{"uninstall", "cleanup"} {
		t.Run(how, func(t *testing.T) { uninstallWithLateServer(t, how, false) })
	}
}

// The same, but the client spoke first and so left the SOCKMAP (its first
// byte found no peer): its connection keeps its slot, unpaired, with no
// socket at its index until it closes. The release passes over it (the
// kernel's SOCKMAP delete of an empty index says EINVAL, not ENOENT)
// instead of failing the uninstall, and the connection works both ways.
func TestPrivilegedUninstallPassesLeftClient(t *testing.T) {
	testutil.RequirePrivileged(t)
	for _, how := range []string{"uninstall", "cleanup"} {
		t.Run(how, func(t *testing.T) { uninstallWithLateServer(t, how, true) })
	}
}

// uninstallWithLateServer: a client whose accepted side is born late,
// waiting in the SOCKMAP or, with spoke, gone from it after its request;
// then the agent's uninstall or cleanup (how); then the exchange.
func uninstallWithLateServer(t *testing.T, how string, spoke bool) {
	forEachAgent(t, func(t *testing.T, a *Agent) {
		ns := testutil.NewNetns(t, "release")
		dropFinalHandshakeACK(t, ns, 7005)
		ln := listenIn(t, ns, "127.0.0.1:7005")
		defer ln.Close()
		client, err := dialBigRcvbuf(ns, ln.Addr().String())
		if err != nil {
			t.Fatalf("dial: %v", err)
		}
		defer client.Close()
		request := []byte("first byte decides")
		if spoke {
			if _, err := client.Write(request); err != nil {
				t.Fatalf("client write: %v", err)
			}
		}
		if a != nil {
			waiting := 1
			if spoke {
				waiting = 0
				for deadline := time.Now().Add(10 * time.Second); inSockMap(t, a, client); time.Sleep(time.Millisecond) {
					if time.Now().After(deadline) {
						t.Fatal("the client never left the SOCKMAP: the test would not exercise a left slot")
					}
				}
			} else if !inSockMap(t, a, client) {
				t.Fatal("the waiting client is not in the SOCKMAP: the test would not exercise the release")
			}
			if how == "uninstall" {
				if _, err := a.Uninstall(); err != nil {
					t.Fatalf("uninstall: %v", err)
				}
			} else {
				a.Close() // killed: everything stays attached and pinned
				res, err := Cleanup(a.cfg.PinDir)
				if err != nil {
					t.Fatalf("cleanup: %v", err)
				}
				if res.ReleasedUnpairedSockets != waiting {
					t.Fatalf("cleanup released %d waiting sockets, want %d", res.ReleasedUnpairedSockets, waiting)
				}
			}
		}
		server, err := ln.Accept()
		if err != nil {
			t.Fatalf("accept: %v", err)
		}
		defer server.Close()
		if spoke {
			if err := receive(server, request); err != nil {
				t.Fatalf("server: %v", err)
			}
		}
		response := make([]byte, 10000)
		for i := range response {
			response[i] = pattern(int64(i))
		}
		if _, err := server.Write(response); err != nil {
			t.Fatalf("server write: %v", err)
		}
		if err := receive(client, response); err != nil {
			t.Fatalf("client: %v", err)
		}
	})
}

// Pairing races removal: with an unpaired timeout far below the time the
// accepted side takes to be established on a busy machine, connections end
// up on both sides of the race (paired, or left to TCP because the accepted
// side came later than the timeout). None may lose, duplicate or reorder a
// byte, and once all are closed the SOCKMAP is empty and the gauge is 0.
func TestPrivilegedPairingRacesRemoval(t *testing.T) {
	testutil.RequirePrivileged(t)
	for _, timeout := range []time.Duration{20 * time.Microsecond, 200 * time.Microsecond} {
		t.Run(timeout.String(), func(t *testing.T) {
			a := startAgent(t, Config{UnpairedTimeout: timeout})
			target := echoOn(t, "127.0.0.1:0")
			res := testutil.CheckIntegrity(dialer(target), testutil.IntegrityOptions{Conns: 200, Messages: 6, MaxSize: 16 << 10, Seed: 11})
			if err := res.Err(); err != nil {
				t.Fatal(err)
			}
			s := stats(t, a)
			t.Logf("paired sockets %d, removed %v, passthrough conns %v", s.PairedSockets, s.RemovedSockets, s.PassthroughConnections)
			if s.PairedSockets == 0 && s.RemovedSockets["unpaired_timeout"] == 0 {
				t.Fatal("neither pairing nor the unpaired timeout acted: the race was not run")
			}
			deadline := time.Now().Add(10 * time.Second)
			for {
				left := sockhashCookies(t, a)
				s = stats(t, a)
				if len(left) == 0 && s.AcceleratedSockets == 0 {
					break
				}
				if time.Now().After(deadline) {
					t.Fatalf("after every connection closed: %d sockets in the SOCKMAP, gauge %d", len(left), s.AcceleratedSockets)
				}
				time.Sleep(10 * time.Millisecond)
			}
		})
	}
}
