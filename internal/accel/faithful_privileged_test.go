// SPDX-License-Identifier: Apache-2.0

package accel

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/meshwarp/meshwarp/internal/testutil"
)

// Invariant 6 for paired sockets: TCP's guarantees hold. Each case runs
// without and with the agent; the assertions are the same.

// pairedConn dials a listener of the test's cgroup and returns both ends;
// with the agent it requires that they are paired.
func pairedConn(t testing.TB, a *Agent, ln net.Listener, dial func() (net.Conn, error)) (client, server net.Conn) {
	t.Helper()
	var before Stats
	if a != nil {
		before = stats(t, a)
	}
	client, server = acceptedPair(t, ln, dial)
	if a != nil {
		// Pairing completes in the accepted side's handshake callback.
		in := sockhashCookies(t, a)
		if !slices.Contains(in, socketCookie(t, client)) || !slices.Contains(in, socketCookie(t, server)) {
			d := stats(t, a).Sub(before)
			t.Fatalf("the connection is not paired: the test would not exercise the redirect (left to TCP: %v, removed: %v)",
				nonZero(d.PassthroughConnections), nonZero(d.RemovedSockets))
		}
	}
	return client, server
}

// nsLoopbackPair is loopbackPair in network namespace ns: a test that reads
// ns's TCP counters (requireNoReceiveDrops) counts its own connections only.
func nsLoopbackPair(t *testing.T, a *Agent, ns *testutil.Netns) (client, server net.Conn) {
	t.Helper()
	var ln net.Listener
	if err := ns.Do(func() (err error) { ln, err = net.Listen("tcp", "127.0.0.1:0"); return }); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	return pairedConn(t, a, ln, dialIn(ns, ln.Addr().String(), ""))
}

// loopbackPair is pairedConn on a fresh loopback listener of the test's
// cgroup, closed on cleanup.
func loopbackPair(t *testing.T, a *Agent) (client, server net.Conn) {
	t.Helper()
	ln := mustListen(t, "127.0.0.1:0")
	t.Cleanup(func() { ln.Close() })
	return pairedConn(t, a, ln, dialer(ln.Addr().String()))
}

func forEachAgent(t *testing.T, fn func(t *testing.T, a *Agent)) {
	forEachAgentMode(t, func(*testing.T) net.Listener { return nil }, func(t *testing.T, a *Agent, _ net.Listener) { fn(t, a) })
}

// pattern is the byte at stream offset off.
func pattern(off int64) byte { return byte(off*7 + off>>8) }

// patternMismatch names the nearest stream offset whose bytes got (read from
// offset off on) are: a later one means bytes lost, an earlier one bytes
// repeated, so a failure tells a lost message from a repeated one. The
// pattern repeats every 64 KiB.
func patternMismatch(got []byte, off int64) string {
	n := min(len(got), 64)
	msg := fmt.Sprintf("byte at offset %d differs: lost, duplicated or reordered (%d bytes read from there: % x)", off, len(got), got[:min(n, 16)])
	if n < 8 {
		return msg
	}
	best := int64(-1 << 62)
	for shift := int64(-(64 << 10)); shift < 64<<10; shift++ {
		at := off + shift
		if at < 0 || shift == 0 {
			continue
		}
		match := true
		for j := range n {
			if got[j] != pattern(at+int64(j)) {
				match = false
				break
			}
		}
		if match && abs64(shift) < abs64(best) {
			best = shift
		}
	}
	switch {
	case best == -1<<62:
		return msg + "; they match no offset within 64 KiB: not this stream's bytes"
	case best > 0:
		return msg + fmt.Sprintf("; they are the stream's bytes from offset %d: %d bytes before them are missing (or come later)", off+best, best)
	default:
		return msg + fmt.Sprintf("; they are the stream's bytes from offset %d again: %d bytes repeated", off+best, -best)
	}
}

func abs64(v int64) int64 {
	if v < 0 {
		return -v
	}
	return v
}

// writeUntilBlocked writes the pattern from stream offset written with
// non-blocking writes until the kernel says EAGAIN (how much a writer gets
// rid of while nobody reads), or bound bytes; any other error is returned.
func writeUntilBlocked(c net.Conn, written, bound int64) (int64, error) {
	rc, err := c.(syscall.Conn).SyscallConn()
	if err != nil {
		return written, err
	}
	chunk := make([]byte, 64<<10)
	for written < bound {
		for i := range chunk {
			chunk[i] = pattern(written + int64(i))
		}
		var n int
		var werr error
		rc.Write(func(fd uintptr) bool {
			n, werr = unix.SendmsgN(int(fd), chunk, nil, nil, unix.MSG_DONTWAIT)
			return true
		})
		if errors.Is(werr, unix.EAGAIN) {
			break
		}
		if werr != nil {
			return written, fmt.Errorf("write after %d bytes: %w", written, werr)
		}
		written += int64(n)
	}
	return written, nil
}

// A writer to a receiver that does not read is blocked after a few MB, as
// on TCP, and every byte arrives in order once the receiver reads.
func TestPrivilegedFaithfulSlowReader(t *testing.T) {
	testutil.RequirePrivileged(t)
	const bound = 16 << 20 // plain TCP blocks after ~3 MB here
	forEachAgent(t, func(t *testing.T, a *Agent) {
		ns := testutil.NewNetns(t, "slowreader")
		client, server := nsLoopbackPair(t, a, ns)
		written, err := writeUntilBlocked(client, 0, bound)
		if err != nil {
			t.Fatal(err)
		}
		t.Logf("writer blocked after %d bytes", written)
		if written >= bound {
			t.Fatalf("a writer to a receiver that never reads got rid of %d bytes without blocking", written)
		}
		// The reader wakes up: a writer finishes 4 MB more while it reads.
		total := written + 4<<20
		werr := make(chan error, 1)
		go func() {
			chunk := make([]byte, 64<<10)
			for written < total {
				n := min(int64(len(chunk)), total-written)
				for i := range n {
					chunk[i] = pattern(written + i)
				}
				if _, err := client.Write(chunk[:n]); err != nil {
					werr <- err
					return
				}
				written += n
			}
			werr <- client.(*net.TCPConn).CloseWrite()
		}()
		// Every byte in order, then EOF after exactly total bytes.
		rerr := (&streamDir{r: server}).recv(total, false, true)
		if err := errors.Join(<-werr, rerr); err != nil {
			t.Fatal(err)
		}
		if a != nil {
			if s := stats(t, a); s.PassthroughConnections["backpressure"] == 0 {
				t.Fatalf("the writer was not sent to TCP by backpressure: %v", s.PassthroughConnections)
			}
			// A one-way stream goes to TCP as a whole: once the reader has
			// read the redirected bytes, both are plain TCP sockets.
			requireOutsideSockhash(t, a, client, server)
		}
		requireNoReceiveDrops(t, ns)
	})
}

// send() after shutdown(SHUT_WR) fails with EPIPE; the peer reads what came
// before and then EOF, never bytes after the FIN.
func TestPrivilegedFaithfulSendAfterShutdown(t *testing.T) {
	testutil.RequirePrivileged(t)
	forEachAgent(t, func(t *testing.T, a *Agent) {
		client, server := loopbackPair(t, a)
		if _, err := client.Write([]byte("abc")); err != nil {
			t.Fatal(err)
		}
		if err := client.(*net.TCPConn).CloseWrite(); err != nil {
			t.Fatal(err)
		}
		_, err := client.Write([]byte("def"))
		if !errors.Is(err, syscall.EPIPE) {
			t.Fatalf("write after shutdown(SHUT_WR): %v, want EPIPE", err)
		}
		got, err := io.ReadAll(server)
		if err != nil || string(got) != "abc" {
			t.Fatalf("peer read %q, %v; want \"abc\" then EOF", got, err)
		}
		// The other direction still works after the half-close.
		if _, err := server.Write([]byte("reply")); err != nil {
			t.Fatal(err)
		}
		reply := make([]byte, 5)
		if _, err := io.ReadFull(client, reply); err != nil || string(reply) != "reply" {
			t.Fatalf("reply after half-close: %q, %v", reply, err)
		}
	})
}

// SO_RCVLOWAT set before the connection: the redirect path ignores the low
// mark (tcp_bpf's recvmsg returns whatever is queued), so such a connection
// stays on TCP, where recv waits for the mark.
func TestPrivilegedFaithfulRcvlowat(t *testing.T) {
	testutil.RequirePrivileged(t)
	forEachAgent(t, func(t *testing.T, a *Agent) {
		ln := mustListen(t, "127.0.0.1:0")
		defer ln.Close()
		acc := make(chan net.Conn, 1)
		go func() {
			c, _ := ln.Accept()
			acc <- c
		}()
		d := net.Dialer{Control: func(_, _ string, rc syscall.RawConn) error {
			var serr error
			rc.Control(func(fd uintptr) { serr = unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_RCVLOWAT, 3000) })
			return serr
		}}
		client, err := d.Dial("tcp", ln.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		defer client.Close()
		server := <-acc
		if server == nil {
			t.Fatal("accept failed")
		}
		defer server.Close()
		if a != nil {
			if inSockMap(t, a, client) {
				t.Fatal("a socket with SO_RCVLOWAT was paired")
			}
			if s := stats(t, a); s.PassthroughConnections["rcvlowat"] != 1 {
				t.Fatalf("rcvlowat connections = %d, want 1", s.PassthroughConnections["rcvlowat"])
			}
		}
		// Both ends exchange bytes as on TCP (the connection is plain TCP).
		if _, err := server.Write([]byte("x")); err != nil {
			t.Fatal(err)
		}
		if err := server.Close(); err != nil {
			t.Fatal(err)
		}
		if b, err := io.ReadAll(client); err != nil || string(b) != "x" {
			t.Fatalf("read %q, %v", b, err)
		}
	})
}

// liveSeqs reads a live socket's send and receive sequence numbers (repair
// mode on, read, off again), as an attacker with CAP_NET_ADMIN could.
func liveSeqs(t *testing.T, c net.Conn) (snd, rcv int) {
	t.Helper()
	onFD(t, c, func(fd int) {
		must := func(err error) {
			if err != nil {
				t.Fatalf("repair read of live sequence numbers: %v", err)
			}
		}
		must(unix.SetsockoptInt(fd, unix.IPPROTO_TCP, unix.TCP_REPAIR, 1))
		must(unix.SetsockoptInt(fd, unix.IPPROTO_TCP, unix.TCP_REPAIR_QUEUE, 2 /* TCP_SEND_QUEUE */))
		v, err := unix.GetsockoptInt(fd, unix.IPPROTO_TCP, unix.TCP_QUEUE_SEQ)
		must(err)
		snd = v
		must(unix.SetsockoptInt(fd, unix.IPPROTO_TCP, unix.TCP_REPAIR_QUEUE, 1 /* TCP_RECV_QUEUE */))
		v, err = unix.GetsockoptInt(fd, unix.IPPROTO_TCP, unix.TCP_QUEUE_SEQ)
		must(err)
		rcv = v
		must(unix.SetsockoptInt(fd, unix.IPPROTO_TCP, unix.TCP_REPAIR, -1 /* TCP_REPAIR_OFF_NO_WP */))
	})
	return snd, rcv
}

// A socket in TCP_REPAIR mode reaches ESTABLISHED with sequence numbers its
// owner chose and no handshake: it is never paired, whatever it claims. Here
// it claims everything a live paired connection has (same addresses, in
// another namespace, and that connection's own sequence numbers): it joins
// nothing and gets none of the live connection's bytes.
func TestPrivilegedFaithfulRepairSocketNotPaired(t *testing.T) {
	testutil.RequirePrivileged(t)
	a := startAgent(t, Config{})
	ln := mustListen(t, "127.0.0.1:0")
	defer ln.Close()
	client, server := pairedConn(t, a, ln, dialer(ln.Addr().String()))
	snd, rcv := liveSeqs(t, client)
	local := client.LocalAddr().(*net.TCPAddr)
	port := portOf(t, ln.Addr().String())

	before := stats(t, a)
	ns := testutil.NewNetns(t, "repair")
	var fd int
	if err := ns.Do(func() error {
		var err error
		if fd, err = unix.Socket(unix.AF_INET, unix.SOCK_STREAM, 0); err != nil {
			return err
		}
		for _, o := range [][2]int{{unix.TCP_REPAIR, 1}, {unix.TCP_REPAIR_QUEUE, 2 /* TCP_SEND_QUEUE */}, {unix.TCP_QUEUE_SEQ, snd},
			{unix.TCP_REPAIR_QUEUE, 1 /* TCP_RECV_QUEUE */}, {unix.TCP_QUEUE_SEQ, rcv}} {
			if err := unix.SetsockoptInt(fd, unix.IPPROTO_TCP, o[0], o[1]); err != nil {
				return fmt.Errorf("setsockopt %d: %w", o[0], err)
			}
		}
		unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_REUSEADDR, 1)
		if err := unix.Bind(fd, &unix.SockaddrInet4{Addr: [4]byte{127, 0, 0, 1}, Port: local.Port}); err != nil {
			return fmt.Errorf("bind the live client's address: %w", err)
		}
		return unix.Connect(fd, &unix.SockaddrInet4{Addr: [4]byte{127, 0, 0, 1}, Port: int(port)})
	}); err != nil {
		t.Fatalf("repair-mode socket: %v", err)
	}
	defer unix.Close(fd)
	cookie, err := unix.GetsockoptUint64(fd, unix.SOL_SOCKET, unix.SO_COOKIE)
	if err != nil {
		t.Fatal(err)
	}
	if slices.Contains(sockhashCookies(t, a), cookie) {
		t.Fatal("a TCP_REPAIR socket joined the SOCKMAP")
	}
	if d := stats(t, a).Sub(before); d.PassthroughConnections["tcp_repair"] != 1 {
		t.Fatalf("tcp_repair connections = %d, want 1 (%v)", d.PassthroughConnections["tcp_repair"], d.PassthroughConnections)
	}
	// The live connection is untouched: the server gets the client's bytes,
	// the impostor none.
	if _, err := client.Write([]byte("for the server only")); err != nil {
		t.Fatal(err)
	}
	got := make([]byte, len("for the server only"))
	server.SetReadDeadline(time.Now().Add(20 * time.Second))
	if _, err := io.ReadFull(server, got); err != nil || string(got) != "for the server only" {
		t.Fatalf("live server read %q, %v", got, err)
	}
	unix.SetsockoptInt(fd, unix.IPPROTO_TCP, unix.TCP_REPAIR, 0)
	if n, _, err := unix.Recvfrom(fd, make([]byte, 64), unix.MSG_DONTWAIT); n > 0 {
		t.Fatalf("the repair-mode impostor read %d bytes of the live connection (%v)", n, err)
	}
}

// rawConnect connects a blocking socket to addr (connect(AF_UNSPEC) when addr is nil).
func rawConnect(fd int, addr *net.TCPAddr) error {
	if addr == nil {
		var unspec [16]byte // struct sockaddr with sa_family AF_UNSPEC
		_, _, errno := unix.Syscall(unix.SYS_CONNECT, uintptr(fd), uintptr(unsafe.Pointer(&unspec[0])), uintptr(len(unspec)))
		if errno != 0 {
			return errno
		}
		return nil
	}
	return unix.Connect(fd, &unix.SockaddrInet4{Port: addr.Port, Addr: [4]byte(addr.IP.To4())})
}

// acceptOne accepts one connection of ln in the background.
func acceptOne(ln net.Listener) <-chan net.Conn {
	ch := make(chan net.Conn, 1)
	go func() {
		c, _ := ln.Accept()
		ch <- c
	}()
	return ch
}

// readFull reads exactly len(b) bytes from a blocking socket.
func readFull(fd int, b []byte) error {
	for off := 0; off < len(b); {
		n, err := unix.Read(fd, b[off:])
		if errors.Is(err, unix.EINTR) {
			continue // a signal (SO_RCVTIMEO reads are not restarted): read again
		}
		if err != nil {
			return err
		}
		if n == 0 {
			return io.ErrUnexpectedEOF
		}
		off += n
	}
	return nil
}

// disconnectWithUnread connects a blocking socket to ln, lets the peer
// queue bytes the socket never reads, and dissolves the connection with
// connect(AF_UNSPEC). It returns the socket and the old peer.
func disconnectWithUnread(t *testing.T, ln net.Listener) (fd int, old net.Conn) {
	t.Helper()
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_STREAM, 0)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Close(fd) })
	tv := unix.Timeval{Sec: 20}
	unix.SetsockoptTimeval(fd, unix.SOL_SOCKET, unix.SO_RCVTIMEO, &tv)
	acc := acceptOne(ln)
	if err := rawConnect(fd, ln.Addr().(*net.TCPAddr)); err != nil {
		t.Fatal(err)
	}
	old = <-acc
	t.Cleanup(func() { old.Close() })
	const unread = "old bytes nobody reads"
	if _, err := old.Write([]byte(unread)); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(10 * time.Second)
	for {
		n, _ := unix.IoctlGetInt(fd, unix.SIOCINQ)
		if n == len(unread) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("old bytes never queued at the client (FIONREAD %d)", n)
		}
		time.Sleep(time.Millisecond) // polling interval
	}
	if err := rawConnect(fd, nil); err != nil {
		t.Fatalf("connect(AF_UNSPEC): %v", err)
	}
	return fd, old
}

// connect(AF_UNSPEC) dissolves a connection; a new connect() on the same
// socket starts another. On TCP the old connection's unread bytes are gone:
// the new peer gets exactly the new bytes and the socket reads only the new
// peer's. On a paired socket this kernel keeps the redirect queue across the
// disconnect, so the agent learns the call (disconnect) and leaves later
// connections on those ports to TCP; the check runs on such a later one.
func TestPrivilegedFaithfulReconnectAfterDisconnect(t *testing.T) {
	testutil.RequirePrivileged(t)
	forEachAgentConfig(t, Config{LearnFromSyscalls: true}, func(*testing.T) net.Listener { return nil }, func(t *testing.T, a *Agent, _ net.Listener) {
		lnA, lnB := mustListen(t, "127.0.0.1:0"), mustListen(t, "127.0.0.1:0")
		defer lnA.Close()
		defer lnB.Close()
		if a != nil {
			// The revealing connection (paired): its old bytes leak, as documented.
			disconnectWithUnread(t, lnA)
			deadline := time.Now().Add(10 * time.Second)
			for stats(t, a).UnfitCalls["disconnect"] == 0 {
				if time.Now().After(deadline) {
					t.Fatal("the agent did not learn the disconnect")
				}
				time.Sleep(5 * time.Millisecond) // polling interval
			}
		}
		var before Stats
		if a != nil {
			before = stats(t, a)
		}
		fd, old := disconnectWithUnread(t, lnA)
		if a != nil {
			if d := stats(t, a).Sub(before); d.PassthroughConnections["disconnect"] != 1 {
				t.Fatalf("the later connection was not left to TCP as disconnect: %v", d.PassthroughConnections)
			}
		}
		accB := acceptOne(lnB)
		if err := rawConnect(fd, lnB.Addr().(*net.TCPAddr)); err != nil {
			t.Fatalf("reconnect: %v", err)
		}
		sB := <-accB
		defer sB.Close()
		if _, err := unix.Write(fd, []byte("to B")); err != nil {
			t.Fatal(err)
		}
		got := make([]byte, 4)
		sB.SetReadDeadline(time.Now().Add(20 * time.Second))
		if _, err := io.ReadFull(sB, got); err != nil || string(got) != "to B" {
			t.Fatalf("new peer read %q, %v; want \"to B\"", got, err)
		}
		if _, err := sB.Write([]byte("from B")); err != nil {
			t.Fatal(err)
		}
		got = make([]byte, 6)
		if err := readFull(fd, got); err != nil || string(got) != "from B" {
			t.Fatalf("reconnected socket read %q, %v; want \"from B\" (old bytes must not surface)", got, err)
		}
		// The old peer sees its connection end and none of the new bytes.
		old.SetReadDeadline(time.Now().Add(20 * time.Second))
		if rest, err := io.ReadAll(old); len(rest) != 0 || (err != nil && !errors.Is(err, syscall.ECONNRESET)) {
			t.Fatalf("old peer read %q, %v; want nothing, then EOF or reset", rest, err)
		}
	})
}

// Bytes written before the connection is established travel by TCP; a later
// write must not overtake them. TCP Fast Open without a cookie (client
// sysctl 0x5) puts the first write in the SYN; a server without Fast Open
// ignores it, and the client sends it again after the handshake. Such
// connections are never paired (early_data).
func TestPrivilegedFaithfulEarlyWriteKeepsOrder(t *testing.T) {
	testutil.RequirePrivileged(t)
	forEachAgent(t, func(t *testing.T, a *Agent) {
		ns := testutil.NewNetns(t, "tfo")
		testutil.Run(t, "ip", "netns", "exec", ns.Name, "sysctl", "-qw", "net.ipv4.tcp_fastopen=5")
		ln := listenIn(t, ns, "127.0.0.1:7200")
		defer ln.Close()
		var before Stats
		if a != nil {
			before = stats(t, a)
		}
		received := make(chan []byte, 1)
		go func() {
			c, err := ln.Accept()
			if err != nil {
				received <- nil
				return
			}
			defer c.Close()
			c.SetReadDeadline(time.Now().Add(20 * time.Second))
			b, _ := io.ReadAll(c)
			received <- b
		}()
		first, second := bytes.Repeat([]byte("A"), 1000), bytes.Repeat([]byte("B"), 1000)
		var fd int
		if err := ns.Do(func() (err error) {
			if fd, err = unix.Socket(unix.AF_INET, unix.SOCK_STREAM, 0); err != nil {
				return err
			}
			return unix.Sendto(fd, first, unix.MSG_FASTOPEN, &unix.SockaddrInet4{Addr: [4]byte{127, 0, 0, 1}, Port: 7200})
		}); err != nil {
			t.Fatalf("sendto(MSG_FASTOPEN): %v", err)
		}
		defer unix.Close(fd)
		if _, err := unix.Write(fd, second); err != nil {
			t.Fatal(err)
		}
		unix.Shutdown(fd, unix.SHUT_WR)
		got := <-received
		if !bytes.Equal(got, append(first, second...)) {
			t.Fatalf("server read %d bytes, first write first: %v", len(got), bytes.HasPrefix(got, first))
		}
		if a != nil {
			if d := stats(t, a).Sub(before); d.PassthroughConnections["early_data"] != 1 {
				t.Fatalf("the connection with early data was not left to TCP as early_data: %v (redirected %d msgs)",
					d.PassthroughConnections, d.RedirectedMessages)
			}
		}
	})
}

// nonZero keeps a counter map's non-zero entries (for failure messages).
func nonZero(m map[string]uint64) map[string]uint64 {
	out := map[string]uint64{}
	for k, v := range m {
		if v != 0 {
			out[k] = v
		}
	}
	return out
}

// tcpRmemMax is the host's net.ipv4.tcp_rmem[2]: how far TCP grows the
// receive buffer of an application that reads quickly, and so a bound on
// how far the redirect budget grows for such a reader.
func tcpRmemMax(t *testing.T) int64 {
	t.Helper()
	b, err := os.ReadFile("/proc/sys/net/ipv4/tcp_rmem")
	if err != nil {
		t.Fatal(err)
	}
	f := strings.Fields(string(b))
	if len(f) != 3 {
		t.Fatalf("tcp_rmem %q: want three values", b)
	}
	v, err := strconv.ParseInt(f[2], 10, 64)
	if err != nil {
		t.Fatal(err)
	}
	return v
}

// A reader that keeps up, then stalls while the writer goes on (a
// preempted process), then stops for good. TCP grows the receive buffer of
// a reader that keeps up, so the writer gets rid of more during the stall;
// the redirect grows its budget alike, so the stall does not send the
// connection to TCP. When the reader stops for good the writer still
// blocks, and every byte arrives in order.
func TestPrivilegedFaithfulReaderThatKeepsUp(t *testing.T) {
	testutil.RequirePrivileged(t)
	// More than the first budget, less than the budget grown.
	grown := min(int64(DefaultRedirectBudget*RedirectBudgetGrowth), tcpRmemMax(t))
	stall := grown - 1<<20
	if stall <= DefaultRedirectBudget {
		t.Fatalf("the redirect budget grows only to %d bytes here (tcp_rmem[2]): too little for a stall over the first budget (%d)", grown, DefaultRedirectBudget)
	}
	const bound = 16 << 20 // as in TestPrivilegedFaithfulSlowReader
	for _, buffer := range []string{"autotuned", "SO_RCVBUF", "SO_RCVBUF-after-reads"} {
		t.Run(buffer, func(t *testing.T) {
			readerKeepsUp(t, buffer, stall, bound)
		})
	}
}

// readerKeepsUp: see TestPrivilegedFaithfulReaderThatKeepsUp. buffer: with
// SO_RCVBUF (set before the first byte, or after the reader kept up for a
// while) neither TCP nor the redirect grows the reader's buffer, and the
// stall sends the connection to TCP (backpressure).
func readerKeepsUp(t *testing.T, buffer string, stall, bound int64) {
	fixedBuffer := buffer != "autotuned"
	forEachAgent(t, func(t *testing.T, a *Agent) {
		ns := testutil.NewNetns(t, "keepsup")
		client, server := nsLoopbackPair(t, a, ns)
		fixBuffer := func() {
			if err := server.(*net.TCPConn).SetReadBuffer(256 << 10); err != nil {
				t.Fatal(err)
			}
		}
		if buffer == "SO_RCVBUF" {
			fixBuffer()
		}
		d := &streamDir{w: client, r: server}
		for i := range 16 {
			if i == 8 && buffer == "SO_RCVBUF-after-reads" {
				fixBuffer()
			}
			if err := d.send(8, func(int) int { return 64 << 10 }); err != nil {
				t.Fatal(err)
			}
			if err := d.recv(d.written, false, false); err != nil {
				t.Fatal(err)
			}
		}
		written, err := writeUntilBlocked(client, d.written, d.written+stall)
		if err != nil {
			t.Fatal(err)
		}
		t.Logf("stall: the writer got rid of %d bytes", written-d.written)
		d.written = written
		if err := d.recv(d.written, false, false); err != nil {
			t.Fatal(err)
		}
		if a != nil && !fixedBuffer {
			if s := stats(t, a); s.PassthroughConnections["backpressure"] != 0 {
				t.Fatalf("a stall of %d bytes sent a reader that keeps up to TCP: %v", stall, s.PassthroughConnections)
			}
			if !inSockMap(t, a, client) || !inSockMap(t, a, server) {
				t.Fatal("a socket left the SOCKMAP during the stall")
			}
		}
		if a != nil && fixedBuffer {
			if s := stats(t, a); s.PassthroughConnections["backpressure"] == 0 {
				t.Fatalf("a reader with SO_RCVBUF set was given more than the first budget: %v", s.PassthroughConnections)
			}
		}
		// The reader stops for good.
		written, err = writeUntilBlocked(client, d.written, d.written+bound)
		if err != nil {
			t.Fatal(err)
		}
		t.Logf("stopped: the writer blocked after %d bytes", written-d.written)
		if written-d.written >= bound {
			t.Fatalf("a writer to a receiver that stopped got rid of %d bytes without blocking", written-d.written)
		}
		d.written = written
		if err := client.(*net.TCPConn).CloseWrite(); err != nil {
			t.Fatal(err)
		}
		if err := d.recv(d.written, false, true); err != nil {
			t.Fatal(err)
		}
		if a != nil {
			if s := stats(t, a); s.PassthroughConnections["backpressure"] == 0 {
				t.Fatalf("the writer blocked without going to TCP: %v", s.PassthroughConnections)
			}
		}
		if buffer == "SO_RCVBUF-after-reads" {
			// Not a TCP guarantee: plain TCP on 6.1 drops here too, a buffer
			// shrunk below the window it had already advertised.
			t.Logf("receive drops: %v", receiveDrops(t, ns))
		} else {
			requireNoReceiveDrops(t, ns)
		}
	})
}

// requireNoReceiveDrops fails the test if TCP in ns dropped a segment for
// want of receive memory (/proc/net/netstat). TCP's window keeps a sender
// within what its receiver can hold, so plain TCP does not; redirected bytes
// left unread at a switch to TCP could make it, and the writer would wait
// for its retransmission timer.
func requireNoReceiveDrops(t *testing.T, ns *testutil.Netns) {
	t.Helper()
	if drops := receiveDrops(t, ns); len(drops) > 0 {
		t.Fatalf("the receiver dropped segments for want of memory: %v", drops)
	}
}

// receiveDrops is ns's non-zero TCP receive-memory drop counters; it logs
// PruneCalled (TCP made room: collapsed its queue, grew its buffer).
func receiveDrops(t *testing.T, ns *testutil.Netns) map[string]int64 {
	t.Helper()
	var raw []byte
	if err := ns.Do(func() (err error) { raw, err = os.ReadFile("/proc/thread-self/net/netstat"); return }); err != nil {
		t.Fatal(err)
	}
	lines := strings.Split(string(raw), "\n")
	drops := map[string]int64{}
	for i := 0; i+1 < len(lines); i += 2 {
		names, values := strings.Fields(lines[i]), strings.Fields(lines[i+1])
		if len(names) == 0 || names[0] != "TcpExt:" || len(values) != len(names) {
			continue
		}
		for j, name := range names {
			v, _ := strconv.ParseInt(values[j], 10, 64)
			switch name {
			case "RcvPruned", "OfoPruned", "TCPRcvQDrop", "TCPZeroWindowDrop":
				if v != 0 {
					drops[name] = v
				}
			case "PruneCalled":
				t.Logf("PruneCalled %d", v)
			}
		}
	}
	if !strings.Contains(string(raw), "TCPRcvQDrop") {
		t.Fatalf("no TCP receive drop counters in /proc/net/netstat:\n%s", raw)
	}
	return drops
}

// The mismatch report names where the bytes read came from.
func TestPatternMismatchNamesTheOffset(t *testing.T) {
	stream := func(from, n int64) []byte {
		b := make([]byte, n)
		for i := range b {
			b[i] = pattern(from + int64(i))
		}
		return b
	}
	for _, c := range []struct {
		got  []byte
		want string
	}{
		{stream(2558, 40), "from offset 2558: 27 bytes before them are missing"},
		{stream(2504, 40), "from offset 2504 again: 27 bytes repeated"},
		{[]byte{1, 1, 1, 1, 1, 1, 1, 1, 1}, "match no offset"},
	} {
		if got := patternMismatch(c.got, 2531); !strings.Contains(got, c.want) {
			t.Errorf("patternMismatch = %q, want it to say %q", got, c.want)
		}
	}
}
