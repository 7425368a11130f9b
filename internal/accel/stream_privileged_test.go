// SPDX-License-Identifier: Apache-2.0

package accel

import (
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/meshwarp/meshwarp/internal/testutil"
)

// A small-message stream turns its connection to TCP mid-connection
// (small_stream), and both sockets then leave the SOCKMAP. These tests
// drive connections through that switch and require TCP's guarantees on
// every byte; each runs without and with the agent, with the same
// assertions.

// streamDir is one direction of a connection: writes carry pattern bytes
// at increasing stream offsets, so a lost, duplicated or reordered byte
// shows up as a wrong byte at its offset.
type streamDir struct {
	w, r    net.Conn
	written int64
	read    int64
}

// send writes n messages, message i of size(i) bytes, one write each.
func (d *streamDir) send(n int, size func(i int) int) error {
	buf := make([]byte, 64<<10)
	for i := range n {
		sz := size(i)
		for j := range sz {
			buf[j] = pattern(d.written + int64(j))
		}
		if _, err := d.w.Write(buf[:sz]); err != nil {
			return fmt.Errorf("write at offset %d: %w", d.written, err)
		}
		d.written += int64(sz)
	}
	return nil
}

// recv reads until total bytes arrived in all (or EOF when toEOF), checking
// each byte; a slow reader reads 7 bytes at a time and yields in between.
func (d *streamDir) recv(total int64, slow, toEOF bool) error {
	buf := make([]byte, 64<<10)
	if slow {
		buf = buf[:7]
	}
	for toEOF || d.read < total {
		if !toEOF {
			buf = buf[:min(int64(len(buf)), total-d.read)]
		}
		n, err := d.r.Read(buf)
		for i := range n {
			if buf[i] != pattern(d.read+int64(i)) {
				return errors.New(patternMismatch(buf[i:n], d.read+int64(i)))
			}
		}
		d.read += int64(n)
		if errors.Is(err, io.EOF) && toEOF {
			if d.read != total {
				return fmt.Errorf("EOF after %d bytes, %d were written", d.read, total)
			}
			return nil
		}
		if err != nil {
			return fmt.Errorf("read at offset %d: %w", d.read, err)
		}
		if slow {
			runtime.Gosched()
		}
	}
	return nil
}

// both runs a stream and its reader at once.
func both(send func() error, recv func() error) error {
	errc := make(chan error, 1)
	go func() { errc <- send() }()
	rerr := recv()
	return errors.Join(<-errc, rerr)
}

func smallSize(i int) int { return i%64 + 1 }

// streamScenario runs the phases of one connection: a small stream one
// way, request/response, small streams both ways at once, bulk, and a
// half-close in the middle of a stream followed by a stream back.
func streamScenario(client, server net.Conn, slow bool) error {
	up := &streamDir{w: client, r: server}
	down := &streamDir{w: server, r: client}
	steps := []struct {
		name string
		run  func() error
	}{
		{"small stream client->server", func() error {
			total := up.written + sumSizes(2000, smallSize) // before the writer starts
			return both(func() error { return up.send(2000, smallSize) }, func() error { return up.recv(total, slow, false) })
		}},
		{"request/response", func() error {
			for range 50 {
				if err := up.send(1, func(int) int { return 100 }); err != nil {
					return err
				}
				if err := up.recv(up.written, false, false); err != nil {
					return err
				}
				if err := down.send(1, func(int) int { return 300 }); err != nil {
					return err
				}
				if err := down.recv(down.written, false, false); err != nil {
					return err
				}
			}
			return nil
		}},
		{"small streams both ways", func() error {
			upTotal, downTotal := up.written+sumSizes(1500, smallSize), down.written+sumSizes(1500, smallSize)
			var wg sync.WaitGroup
			var e1, e2 error
			wg.Add(2)
			go func() {
				defer wg.Done()
				e1 = both(func() error { return up.send(1500, smallSize) }, func() error { return up.recv(upTotal, slow, false) })
			}()
			go func() {
				defer wg.Done()
				e2 = both(func() error { return down.send(1500, smallSize) }, func() error { return down.recv(downTotal, slow, false) })
			}()
			wg.Wait()
			return errors.Join(e1, e2)
		}},
		{"bulk", func() error {
			size := func(int) int { return 60 << 10 }
			total := down.written + sumSizes(40, size)
			return both(func() error { return down.send(40, size) }, func() error { return down.recv(total, slow, false) })
		}},
		{"half-close during a stream, then a stream back", func() error {
			upTotal := up.written + sumSizes(1000, smallSize)
			err := both(func() error {
				if err := up.send(1000, smallSize); err != nil {
					return err
				}
				return client.(*net.TCPConn).CloseWrite()
			}, func() error { return up.recv(upTotal, slow, true) })
			if err != nil {
				return err
			}
			downTotal := down.written + sumSizes(1000, smallSize)
			return both(func() error {
				if err := down.send(1000, smallSize); err != nil {
					return err
				}
				return server.(*net.TCPConn).CloseWrite()
			}, func() error { return down.recv(downTotal, slow, true) })
		}},
	}
	for _, s := range steps {
		if err := s.run(); err != nil {
			return fmt.Errorf("%s: %w", s.name, err)
		}
	}
	return nil
}

// named prefixes a stream's error with the stream's name (nil stays nil).
func named(stream string, err error) error {
	if err != nil {
		return fmt.Errorf("%s: %w", stream, err)
	}
	return nil
}

func sumSizes(n int, size func(int) int) int64 {
	var t int64
	for i := range n {
		t += int64(size(i))
	}
	return t
}

// Many connections at once go through every phase, over loopback and
// across namespaces (the two thresholds), with fast and slow readers.
func TestPrivilegedSmallStreamSwitchKeepsEveryByte(t *testing.T) {
	testutil.RequirePrivileged(t)
	const conns = 16
	forEachAgent(t, func(t *testing.T, a *Agent) {
		var before Stats
		if a != nil {
			before = stats(t, a)
		}
		paths := []struct {
			name string
			ln   func(t *testing.T) (net.Listener, func() (net.Conn, error))
		}{
			{"loopback", func(t *testing.T) (net.Listener, func() (net.Conn, error)) {
				ln := mustListen(t, "127.0.0.1:0")
				return ln, dialer(ln.Addr().String())
			}},
			{"across-netns", func(t *testing.T) (net.Listener, func() (net.Conn, error)) {
				cns, sns := testutil.NewNetns(t, "stream-c"), testutil.NewNetns(t, "stream-s")
				_, serverIP := vethPair(t, cns, sns)
				target := net.JoinHostPort(serverIP, "8079")
				return listenIn(t, sns, target), dialIn(cns, target, "")
			}},
		}
		for _, p := range paths {
			t.Run(p.name, func(t *testing.T) {
				ln, dial := p.ln(t)
				defer ln.Close()
				var wg sync.WaitGroup
				errs := make([]error, conns)
				for i := range conns {
					client, server := pairedConn(t, a, ln, dial)
					wg.Add(1)
					go func() {
						defer wg.Done()
						errs[i] = streamScenario(client, server, i%2 == 1)
					}()
				}
				wg.Wait()
				if err := errors.Join(errs...); err != nil {
					t.Fatal(err)
				}
			})
		}
		if a != nil {
			d := stats(t, a).Sub(before)
			logSwitches(t, d)
			if got := d.PassthroughConnections["small_stream"]; got < 2*conns {
				t.Fatalf("%d of %d connections went to TCP as small streams: the switch was not exercised", got, 2*conns)
			}
		}
	})
}

// A connection moves to TCP only where no reader can see two queues: while
// the receiver has redirected bytes unread, a small stream stays redirected
// (FIONREAD counts all of it); once it has read them, the next small writes
// switch, and both sockets leave the SOCKMAP at their first TCP packet,
// before its bytes are queued: plain TCP sockets again, native FIONREAD.
func TestPrivilegedSmallStreamSocketsLeave(t *testing.T) {
	testutil.RequirePrivileged(t)
	forEachAgent(t, func(t *testing.T, a *Agent) {
		client, server := loopbackPair(t, a)
		up := &streamDir{w: client, r: server}
		// Nobody reads: one queue holds everything, whichever it is.
		if err := up.send(SmallStreamRun+200, smallSize); err != nil {
			t.Fatal(err)
		}
		if err := awaitInq(up.r, int(up.written)); err != nil {
			t.Fatal(err)
		}
		if a != nil && (!inSockMap(t, a, client) || !inSockMap(t, a, server)) {
			t.Fatal("the connection left the redirect while its receiver held unread redirected bytes")
		}
		if err := up.recv(up.written, false, false); err != nil {
			t.Fatal(err)
		}
		// Everything read: the small stream switches now, and both leave.
		if a != nil {
			waitFor(t, "both sockets to leave the SOCKMAP", func() bool {
				if err := up.send(SmallStreamRun, smallSize); err != nil {
					t.Fatal(err)
				}
				if err := up.recv(up.written, false, false); err != nil {
					t.Fatal(err)
				}
				return !inSockMap(t, a, client) && !inSockMap(t, a, server)
			})
		}
		requireFIONREADCounts(t, up, &streamDir{w: server, r: client})
		if a != nil {
			s := stats(t, a)
			if s.PassthroughConnections["small_stream"] != 1 || s.LeftSockets != 2 || s.RemovedSockets["small_stream"] != 2 {
				t.Fatalf("counters: small_stream connections %d (want 1), left sockets %d (want 2), removed %v",
					s.PassthroughConnections["small_stream"], s.LeftSockets, s.RemovedSockets)
			}
			if s.AcceleratedSockets != 0 {
				t.Fatalf("%d sockets still counted as accelerated after both left", s.AcceleratedSockets)
			}
		}
	})
}

// Request/response and large writes stay on the redirect, and
// --keep-small-streams keeps small streams there too.
func TestPrivilegedSmallStreamOnlySmallStreamsSwitch(t *testing.T) {
	testutil.RequirePrivileged(t)
	cases := []struct {
		name      string
		cfg       Config
		n         int
		size      func(int) int
		reply     bool
		wantOnTCP bool
	}{
		{"request/response", Config{}, 500, smallSize, true, false},
		{"large writes", Config{}, 200, func(int) int { return 60 << 10 }, false, false},
		{"small stream", Config{}, 500, smallSize, false, true},
		{"small stream, --keep-small-streams", Config{KeepSmallStreams: true}, 500, smallSize, false, false},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			a := startAgent(t, tc.cfg)
			client, server := loopbackPair(t, a)
			up, down := &streamDir{w: client, r: server}, &streamDir{w: server, r: client}
			for i := range tc.n {
				if err := up.send(1, func(int) int { return tc.size(i) }); err != nil {
					t.Fatal(err)
				}
				if err := up.recv(up.written, false, false); err != nil {
					t.Fatal(err)
				}
				if tc.reply {
					if err := down.send(1, func(int) int { return 1 }); err != nil {
						t.Fatal(err)
					}
					if err := down.recv(down.written, false, false); err != nil {
						t.Fatal(err)
					}
				}
			}
			s := stats(t, a)
			onTCP := s.PassthroughConnections["small_stream"] > 0
			if onTCP != tc.wantOnTCP {
				t.Fatalf("connection on TCP as a small stream: %v, want %v (passthrough %v)", onTCP, tc.wantOnTCP, s.PassthroughConnections)
			}
			if !tc.wantOnTCP && (s.PassthroughMessages != 0 || !inSockMap(t, a, client) || !inSockMap(t, a, server)) {
				t.Fatalf("the connection left the redirect: %d messages through TCP %v", s.PassthroughMessages, s.PassthroughByReason)
			}
		})
	}
}

// requireFIONREADCounts sends ten 100-byte messages along each of dirs and
// requires FIONREAD to count all 1000 bytes before they are read.
func requireFIONREADCounts(t *testing.T, dirs ...*streamDir) {
	t.Helper()
	for _, d := range dirs {
		if err := d.send(10, func(int) int { return 100 }); err != nil {
			t.Fatal(err)
		}
		if err := awaitInq(d.r, 1000); err != nil {
			t.Fatal(err)
		}
		if err := d.recv(d.written, false, false); err != nil {
			t.Fatal(err)
		}
	}
}

// logSwitches logs what the agent did with a test's connections (d: the
// stats since the test began), to read a failure by.
func logSwitches(t *testing.T, d Stats) {
	t.Helper()
	t.Logf("small_stream connections %d, backpressure %d, sockets left %d, redirected %d messages, passthrough %v",
		d.PassthroughConnections["small_stream"], d.PassthroughConnections["backpressure"], d.LeftSockets,
		d.RedirectedMessages, d.PassthroughByReason)
}

// inSockMap reports whether c is in mw_sock_map now (one lookup: the leave
// poll may move it out while a full listing reads).
func inSockMap(t testing.TB, a *Agent, c net.Conn) bool {
	t.Helper()
	rc, err := c.(syscall.Conn).SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	var in bool
	var ierr error
	if err := rc.Control(func(fd uintptr) { in, ierr = a.InSockMap(int(fd)) }); err != nil {
		t.Fatal(err)
	}
	if ierr != nil {
		t.Fatal(ierr)
	}
	return in
}

// waitFor polls cond (each call may drive traffic) for up to 5 s.
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(time.Millisecond)
	}
}

// A writer far ahead of its reader moves to TCP with redirected bytes still
// unread (backpressure), and then stops. A reader that reads only what
// FIONREAD reports (Java's available()) still gets every byte: once it has
// read the redirected ones, its socket leaves the SOCKMAP (the node's
// leave poll re-runs the leave check when no packet comes), and FIONREAD
// counts the TCP queue again. Each socket is counted once, as left, however
// it left (at a packet or by the poll): not again at its next packet nor at
// its close, which would take a still paired connection (the witness) out
// of accelerated_sockets.
func TestPrivilegedBackpressureFIONREADReader(t *testing.T) {
	testutil.RequirePrivileged(t)
	forEachAgent(t, func(t *testing.T, a *Agent) {
		client, server, before := pairBesideWitness(t, a)
		up := &streamDir{w: client, r: server}
		// Write until the writer would block: the reader does not read.
		buf := make([]byte, 64<<10)
		onFD(t, client, func(fd int) {
			deadline := time.Now().Add(5 * time.Second)
			for time.Now().Before(deadline) {
				for j := range buf {
					buf[j] = pattern(up.written + int64(j))
				}
				n, err := unix.Write(fd, buf)
				if errors.Is(err, unix.EAGAIN) {
					return
				}
				if err != nil {
					t.Fatalf("write: %v", err)
				}
				up.written += int64(n)
			}
			t.Fatal("the writer never blocked in 5 s")
		})
		if a != nil && stats(t, a).Sub(before).PassthroughConnections["backpressure"] == 0 {
			t.Fatal("the agent counted no backpressure: the test would not exercise the switch")
		}
		deadline := time.Now().Add(10 * time.Second)
		for up.read < up.written {
			n, err := inq(server)
			if err != nil {
				t.Fatal(err)
			}
			if n == 0 {
				if time.Now().After(deadline) {
					t.Fatalf("FIONREAD = 0 with %d of %d bytes unread", up.written-up.read, up.written)
				}
				time.Sleep(time.Millisecond) // polling interval
				continue
			}
			if err := up.recv(up.read+int64(n), false, false); err != nil {
				t.Fatal(err)
			}
		}
		if a != nil {
			waitFor(t, "both sockets to leave the SOCKMAP", func() bool {
				return !inSockMap(t, a, client) && !inSockMap(t, a, server)
			})
			requireSocketCounts(t, a, before, 2, 2)
		}
		// Packets both ways after the leave, then the close.
		requireFIONREADCounts(t, up, &streamDir{w: server, r: client})
		client.Close()
		server.Close()
		waitTCPClosed(t, client)
		if a != nil {
			requireSocketCounts(t, a, before, 2, 2)
		}
	})
}

// A writer goes to TCP (backpressure) with a last one-byte write, and
// stops; its reader then reads everything. Neither socket gets a packet
// after that: the leave poll takes both out of the SOCKMAP. They are
// counted as left there, once: not again at their next packet nor at their
// close, by FIN or by a reset (the witness, a connection still paired,
// stays counted as accelerated).
func TestPrivilegedLeavePollCountsOnce(t *testing.T) {
	testutil.RequirePrivileged(t)
	for _, reset := range []bool{false, true} {
		t.Run(map[bool]string{false: "fin", true: "reset"}[reset], func(t *testing.T) { leavePollCountsOnce(t, reset) })
	}
}

func leavePollCountsOnce(t *testing.T, reset bool) {
	forEachAgent(t, func(t *testing.T, a *Agent) {
		client, server, before := pairBesideWitness(t, a)
		up := &streamDir{w: client, r: server}
		// Unread writes up to the redirect budget, then one byte more, which
		// goes to TCP (backpressure): a segment of one byte, whose ACK and
		// read move no window.
		if err := up.send(DefaultRedirectBudget>>16, func(int) int { return 64 << 10 }); err != nil {
			t.Fatal(err)
		}
		if err := up.send(1, func(int) int { return 1 }); err != nil {
			t.Fatal(err)
		}
		switched := func() bool { return stats(t, a).Sub(before).PassthroughConnections["backpressure"] > 0 }
		if a != nil && !switched() {
			t.Fatal("the connection never went to TCP: the test would not exercise the leave")
		}
		if err := up.recv(up.written, false, false); err != nil {
			t.Fatal(err)
		}
		if a != nil {
			waitFor(t, "both sockets to leave the SOCKMAP", func() bool {
				return !inSockMap(t, a, client) && !inSockMap(t, a, server)
			})
			requireSocketCounts(t, a, before, 2, 2)
		}
		if reset {
			// SO_LINGER 0: the client's close sends a reset.
			if err := client.(*net.TCPConn).SetLinger(0); err != nil {
				t.Fatal(err)
			}
			client.Close()
			waitTCPClosed(t, client)
			server.Close()
		} else {
			client.Close()
			server.Close()
			waitTCPClosed(t, client)
		}
		if a != nil {
			requireSocketCounts(t, a, before, 2, 2)
		}
	})
}

// TestPrivilegedClosedSocketKeepsItsSlot: a paired socket that TCP closes
// while its application still has it open (its peer's reset; its own
// TIME_WAIT after a half-close) stays in the SOCKMAP until that
// application closes it: the kernel unlinks it only then, and must not
// earlier (its unread redirected bytes would go). While it is there its
// connection's slot stays held, or the connection that takes the slot next
// finds its index taken and goes to TCP (counted sockhash_full). Its last
// bytes still arrive; without the agent, the same reset or EOF.
func TestPrivilegedClosedSocketKeepsItsSlot(t *testing.T) {
	testutil.RequirePrivileged(t)
	for _, reset := range []bool{true, false} {
		t.Run(map[bool]string{true: "reset", false: "time-wait"}[reset], func(t *testing.T) {
			forEachAgent(t, func(t *testing.T, a *Agent) { closedSocketKeepsItsSlot(t, a, reset) })
		})
	}
}

func closedSocketKeepsItsSlot(t *testing.T, a *Agent, reset bool) {
	ln := mustListen(t, "127.0.0.1:0")
	defer ln.Close()
	client, server := pairedConn(t, a, ln, dialer(ln.Addr().String()))
	defer client.Close()
	defer server.Close()
	if err := exchangeBothWays(client, server, "before the close"); err != nil {
		t.Fatal(err)
	}
	open := server // the socket TCP closes under its application
	if reset {
		// SO_LINGER 0: the client's close resets the connection.
		if err := client.(*net.TCPConn).SetLinger(0); err != nil {
			t.Fatal(err)
		}
		client.Close()
	} else {
		// The client half-closes first, so its socket goes to TIME_WAIT
		// (CLOSE for its application) when the server's last bytes and FIN
		// come, unread.
		open = client
		if err := client.(*net.TCPConn).CloseWrite(); err != nil {
			t.Fatal(err)
		}
		if _, err := io.ReadAll(server); err != nil {
			t.Fatal(err)
		}
		if _, err := server.Write([]byte("last")); err != nil {
			t.Fatal(err)
		}
		server.Close()
	}
	waitTCPClosed(t, open)
	if a != nil {
		if !inSockMap(t, a, open) {
			t.Fatal("the closed socket left the SOCKMAP before its application closed it: the test would not exercise the held slot")
		}
		if h := slotHolders(t, a, open); h == 0 {
			t.Fatal("the slot of a socket still in the SOCKMAP is free: the next connection to take it cannot join")
		}
	}
	if reset {
		if _, err := server.Read(make([]byte, 1)); !errors.Is(err, syscall.ECONNRESET) {
			t.Fatalf("read after the peer's reset: %v, want ECONNRESET", err)
		}
		return
	}
	if got, err := io.ReadAll(client); err != nil || string(got) != "last" {
		t.Fatalf("the server's last bytes: %q, %v; want \"last\" and EOF", got, err)
	}
}

// slotHolders reads the holders of the mw_conns slot that c's record names.
func slotHolders(t *testing.T, a *Agent, c net.Conn) uint32 {
	t.Helper()
	rc, err := c.(syscall.Conn).SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	var rec accelMwSock
	var lerr error
	if err := rc.Control(func(fd uintptr) {
		key := int32(fd)
		lerr = a.objs.MwSkStore.Lookup(&key, &rec)
	}); err != nil || lerr != nil {
		t.Fatal(err, lerr)
	}
	var conn accelMwConn
	if err := a.objs.MwConns.Lookup(rec.Pair.ConnSlot, &conn); err != nil {
		t.Fatal(err)
	}
	return conn.Holders
}

// pairBesideWitness makes two paired loopback connections and returns
// one of them with the counters after both: the other (the witness) stays
// open and paired until the test ends, so the accelerated_sockets gauge has
// sockets to lose if the test's connection is counted out twice.
func pairBesideWitness(t *testing.T, a *Agent) (client, server net.Conn, before Stats) {
	t.Helper()
	ln := mustListen(t, "127.0.0.1:0")
	t.Cleanup(func() { ln.Close() })
	witnessClient, witnessServer := pairedConn(t, a, ln, dialer(ln.Addr().String()))
	t.Cleanup(func() { witnessClient.Close(); witnessServer.Close() })
	client, server = pairedConn(t, a, ln, dialer(ln.Addr().String()))
	if a != nil {
		before = stats(t, a)
	}
	return client, server, before
}

// requireSocketCounts requires left sockets since before, and the
// accelerated_sockets gauge, to be exactly what the test made.
func requireSocketCounts(t *testing.T, a *Agent, before Stats, left, accelerated uint64) {
	t.Helper()
	d := stats(t, a).Sub(before)
	if d.LeftSockets != left || d.AcceleratedSockets != accelerated {
		t.Fatalf("counters: left sockets %d (want %d), accelerated sockets %d (want %d)",
			d.LeftSockets, left, d.AcceleratedSockets, accelerated)
	}
}

// waitTCPClosed polls /proc/net/tcp until both sockets of c's connection
// have reached CLOSE (gone, or TIME_WAIT): every state callback of its close
// has run.
func waitTCPClosed(t *testing.T, c net.Conn) {
	t.Helper()
	l, r := c.LocalAddr().(*net.TCPAddr).Port, c.RemoteAddr().(*net.TCPAddr).Port
	waitFor(t, "the connection to close", func() bool {
		raw, err := os.ReadFile("/proc/net/tcp")
		if err != nil {
			t.Fatal(err)
		}
		for _, line := range strings.Split(string(raw), "\n")[1:] {
			f := strings.Fields(line)
			if len(f) < 4 || f[3] == "06" { // TIME_WAIT
				continue
			}
			lp, rp := hexPort(f[1]), hexPort(f[2])
			if (lp == l && rp == r) || (lp == r && rp == l) {
				return false
			}
		}
		return true
	})
}

// hexPort is the port of a /proc/net/tcp address (ADDR:PORT in hex).
func hexPort(addr string) int {
	_, p, _ := strings.Cut(addr, ":")
	n, _ := strconv.ParseInt(p, 16, 32)
	return int(n)
}

// A download: a request, then a response far beyond the redirect budget
// that its reader lets pile up first. The response's direction goes to TCP
// (backpressure), and with it the whole connection: the requester, which
// redirected its request and sends nothing more, is switched at its TCP
// packets, so both sockets leave the SOCKMAP while the response streams
// and the rest of it is plain TCP. Every byte arrives in order, and FIONREAD
// counts the TCP queue again both ways.
func TestPrivilegedDownloadSocketsLeave(t *testing.T) {
	testutil.RequirePrivileged(t)
	const chunk, chunks = 64 << 10, 1024 // 64 MiB
	forEachAgent(t, func(t *testing.T, a *Agent) {
		ns := testutil.NewNetns(t, "download")
		client, server := nsLoopbackPair(t, a, ns)
		up, down := &streamDir{w: client, r: server}, &streamDir{w: server, r: client}
		var before Stats
		if a != nil {
			before = stats(t, a)
		}
		if err := up.send(1, func(int) int { return 100 }); err != nil {
			t.Fatal(err)
		}
		if err := up.recv(up.written, false, false); err != nil {
			t.Fatal(err)
		}
		errc := make(chan error, 1)
		go func() { errc <- down.send(chunks, func(int) int { return chunk }) }()
		if a != nil {
			waitFor(t, "the response to go to TCP (backpressure)", func() bool {
				return stats(t, a).Sub(before).PassthroughConnections["backpressure"] > 0
			})
		}
		leftAt := int64(-1)
		for step := int64(1 << 20); down.read < chunk*chunks; {
			if err := down.recv(min(down.read+step, chunk*chunks), false, false); err != nil {
				t.Fatal(err)
			}
			if a != nil && leftAt < 0 && !inSockMap(t, a, client) && !inSockMap(t, a, server) {
				leftAt = down.read
			}
		}
		if err := <-errc; err != nil {
			t.Fatal(err)
		}
		if a != nil {
			t.Logf("both sockets out of the SOCKMAP after %d MiB of %d", leftAt>>20, chunk*chunks>>20)
			if leftAt < 0 || leftAt > chunk*chunks*3/4 {
				t.Fatalf("the sockets did not leave the SOCKMAP during the response (out after %d of %d bytes; -1: never)", leftAt, chunk*chunks)
			}
			d := stats(t, a).Sub(before)
			if d.LeftSockets != 2 || d.AcceleratedSockets != 0 {
				t.Fatalf("counters: left sockets %d (want 2), accelerated sockets %d (want 0)", d.LeftSockets, d.AcceleratedSockets)
			}
		}
		requireFIONREADCounts(t, up, down)
		requireNoReceiveDrops(t, ns)
	})
}

// The switch of a side that still redirects (quiet_switch, at its TCP
// packets) races that side's own writes: while a response far beyond the
// redirect budget streams one way, the requester keeps writing small
// messages the other way. Several connections at once; every byte of both
// directions arrives in order, with the agent and without.
func TestPrivilegedDownloadWhileUploadingKeepsEveryByte(t *testing.T) {
	testutil.RequirePrivileged(t)
	const conns, chunk, chunks, uploads = 8, 64 << 10, 256, 3000 // 16 MiB down, ~150 KB up per connection
	forEachAgent(t, func(t *testing.T, a *Agent) {
		var before Stats
		if a != nil {
			before = stats(t, a)
		}
		errc := make(chan error, 4*conns)
		ns := testutil.NewNetns(t, "updown")
		for range conns {
			client, server := nsLoopbackPair(t, a, ns)
			up, down := &streamDir{w: client, r: server}, &streamDir{w: server, r: client}
			// The request first, redirected: the requester's direction is "redirect".
			if err := up.send(1, func(int) int { return 100 }); err != nil {
				t.Fatal(err)
			}
			if err := up.recv(up.written, false, false); err != nil {
				t.Fatal(err)
			}
			upTotal := up.written + sumSizes(uploads, smallSize)
			go func() { errc <- named("download", down.send(chunks, func(int) int { return chunk })) }()
			go func() { errc <- named("upload", up.send(uploads, smallSize)) }()
			go func() { errc <- named("upload", up.recv(upTotal, false, false)) }()
			go func() { errc <- named("download", down.recv(chunk*chunks, false, false)) }()
		}
		for range 4 * conns {
			if err := <-errc; err != nil {
				if a != nil {
					logSwitches(t, stats(t, a).Sub(before)) // which switches the failing run took
				}
				t.Fatal(err)
			}
		}
		if a != nil {
			logSwitches(t, stats(t, a).Sub(before))
		}
		requireNoReceiveDrops(t, ns)
	})
}

// A connection that goes to TCP and is closed at once, before its sockets
// left the SOCKMAP (at a packet or by the leave poll), still counts each
// of its sockets gone exactly once: closed, or left. The socket closed
// first is unlinked from the SOCKMAP by close() itself, before the FIN
// that asks it to leave. Either side closes first (the server with bytes
// unread: a reset); the client's bytes arrive in order before its EOF. A
// connection kept open meanwhile makes a double count visible: the gauge
// must end at its 2 sockets.
func TestPrivilegedSwitchThenCloseCountsEverySocket(t *testing.T) {
	testutil.RequirePrivileged(t)
	const conns = 48
	forEachAgent(t, func(t *testing.T, a *Agent) {
		ln := mustListen(t, "127.0.0.1:0")
		defer ln.Close()
		dial := dialer(ln.Addr().String())
		var before Stats
		if a != nil {
			before = stats(t, a)
		}
		inAtClose := 0
		var open int
		if a != nil {
			open = 2
			kept, kept2 := pairedConn(t, a, ln, dial)
			defer kept.Close()
			defer kept2.Close()
		}
		for i := range conns {
			client, server := pairedConn(t, a, ln, dial)
			up := &streamDir{w: client, r: server}
			down := &streamDir{w: server, r: client}
			// The server redirected once: its direction is not quiet, so the
			// client's switch does not take the client out at its own packet.
			if err := down.send(1, smallSize); err != nil {
				t.Fatal(err)
			}
			if err := down.recv(down.written, false, false); err != nil {
				t.Fatal(err)
			}
			// A one-way run of small writes, each read before the next, up
			// to the one that ends a small stream: the first write below
			// switches to TCP, at a drained point.
			for j := range SmallStreamRun - 1 {
				if err := up.send(1, func(int) int { return j%64 + 1 }); err != nil {
					t.Fatal(err)
				}
				if err := up.recv(up.written, false, false); err != nil {
					t.Fatal(err)
				}
			}
			// The server acknowledges late: no packet of its own takes the
			// client out before it closes.
			delayAcks(t, server)
			if err := up.send(4, smallSize); err != nil {
				t.Fatal(err)
			}
			// Who closes first alternates.
			first, second, r := client, server, up
			if i%2 == 1 {
				first, second = server, client
			}
			if a != nil && inSockMap(t, a, first) {
				inAtClose++
			}
			if err := first.Close(); err != nil {
				t.Fatal(err)
			}
			if first == client {
				if err := r.recv(r.written, false, true); err != nil {
					t.Fatal(err)
				}
			}
			if err := second.Close(); err != nil {
				t.Fatal(err)
			}
		}
		if a != nil {
			d := stats(t, a).Sub(before)
			logSwitches(t, d)
			if d.PassthroughConnections["small_stream"] < conns {
				t.Fatalf("%d of %d connections went to TCP as small streams: the switch was not exercised", d.PassthroughConnections["small_stream"], conns)
			}
			if inAtClose == 0 {
				t.Fatal("every socket left the SOCKMAP before its close: the close of one still in it was not exercised")
			}
			t.Logf("%d of %d closed first while still in the SOCKMAP", inAtClose, conns)
			waitAcceleratedSockets(t, a, uint64(open))
		}
	})
}

// delayAcks turns TCP_QUICKACK off: c's next ACK waits for the delayed-ACK timer.
func delayAcks(t *testing.T, c net.Conn) {
	t.Helper()
	raw, err := c.(*net.TCPConn).SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	var serr error
	if err := raw.Control(func(fd uintptr) { serr = unix.SetsockoptInt(int(fd), unix.IPPROTO_TCP, unix.TCP_QUICKACK, 0) }); err != nil {
		t.Fatal(err)
	}
	if serr != nil {
		t.Fatal(serr)
	}
}

// Health checks and aborted clients: connections closed right after the
// handshake, from several clients at once, by FIN or by a reset
// (SO_LINGER 0) from either side. As on TCP, the server accepts every one
// and its read ends at the client's FIN (EOF) or reset, with no byte. Each
// paired socket is counted gone exactly once (a connection kept open shows
// a double count as a gauge below its 2). A server that resets after its
// client has closed (the client's close ends its connection first) left its
// socket counted for good before.
func TestPrivilegedAbortedConnectionsCountEverySocket(t *testing.T) {
	testutil.RequirePrivileged(t)
	const workers, perWorker = 4, 300
	forEachAgent(t, func(t *testing.T, a *Agent) {
		ln := mustListen(t, "127.0.0.1:0")
		defer ln.Close()
		var open int
		if a != nil {
			open = 2
			kept, kept2 := pairedConn(t, a, ln, dialer(ln.Addr().String()))
			defer kept.Close()
			defer kept2.Close()
		}
		var served sync.WaitGroup
		readErrs := make(chan error, workers*perWorker)
		served.Add(workers * perWorker)
		go func() {
			for i := range workers * perWorker {
				c, err := ln.Accept()
				if err != nil {
					readErrs <- fmt.Errorf("accept %d: %w", i, err)
					served.Done()
					continue
				}
				if i%3 == 0 {
					c.(*net.TCPConn).SetLinger(0)
				}
				go func() {
					defer served.Done()
					c.SetReadDeadline(time.Now().Add(time.Minute))
					n, err := c.Read(make([]byte, 1))
					switch {
					case n > 0:
						readErrs <- fmt.Errorf("read %d bytes the client never sent", n)
					case !errors.Is(err, io.EOF) && !errors.Is(err, unix.ECONNRESET):
						readErrs <- fmt.Errorf("read ended with %v, not the client's FIN or reset", err)
					}
					c.Close()
				}()
			}
		}()
		var wg sync.WaitGroup
		errs := make([]error, workers)
		for w := range workers {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for i := range perWorker {
					c, err := net.Dial("tcp", ln.Addr().String())
					if err != nil {
						errs[w] = err
						return
					}
					if i%2 == 0 {
						c.(*net.TCPConn).SetLinger(0)
					}
					c.Close()
				}
			}()
		}
		wg.Wait()
		if err := errors.Join(errs...); err != nil {
			t.Fatal(err)
		}
		served.Wait()
		close(readErrs)
		for err := range readErrs {
			t.Error(err)
		}
		if a != nil {
			waitAcceleratedSockets(t, a, uint64(open))
		}
	})
}
