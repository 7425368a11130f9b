// SPDX-License-Identifier: Apache-2.0

package accel

import (
	"errors"
	"io"
	"net"
	"slices"
	"syscall"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/meshwarp/meshwarp/internal/testutil"
)

// Invariant 6 for paired sockets: TCP's guarantees hold. Each case runs
// without and with the agent; the assertions are the same.

// pairedConn dials a listener of the test's cgroup and returns both ends;
// with the agent it requires that they are paired.
func pairedConn(t *testing.T, a *Agent, ln net.Listener, dial func() (net.Conn, error)) (client, server net.Conn) {
	t.Helper()
	acc := make(chan net.Conn, 1)
	go func() {
		c, err := ln.Accept()
		if err != nil {
			acc <- nil
			return
		}
		acc <- c
	}()
	client, err := dial()
	if err != nil {
		t.Fatalf("dial: %v", err)
	}
	t.Cleanup(func() { client.Close() })
	server = <-acc
	if server == nil {
		t.Fatal("accept failed")
	}
	t.Cleanup(func() { server.Close() })
	if a != nil {
		// Pairing completes in the accepted side's handshake callback.
		in := sockhashCookies(t, a)
		if !slices.Contains(in, socketCookie(t, client)) || !slices.Contains(in, socketCookie(t, server)) {
			t.Fatal("the connection is not paired: the test would not exercise the redirect")
		}
	}
	return client, server
}

func forEachAgent(t *testing.T, fn func(t *testing.T, a *Agent)) {
	forEachAgentMode(t, func(*testing.T) net.Listener { return nil }, func(t *testing.T, a *Agent, _ net.Listener) { fn(t, a) })
}

// pattern is the byte at stream offset off.
func pattern(off int64) byte { return byte(off*7 + off>>8) }

// A writer to a receiver that does not read is blocked after a few MB, as
// on TCP, and every byte arrives in order once the receiver reads.
func TestPrivilegedFaithfulSlowReader(t *testing.T) {
	testutil.RequirePrivileged(t)
	const bound = 16 << 20 // plain TCP blocks after ~3 MB here
	forEachAgent(t, func(t *testing.T, a *Agent) {
		ln := mustListen(t, "127.0.0.1:0")
		defer ln.Close()
		client, server := pairedConn(t, a, ln, dialer(ln.Addr().String()))
		rc, err := client.(syscall.Conn).SyscallConn()
		if err != nil {
			t.Fatal(err)
		}
		// Non-blocking writes until the kernel says EAGAIN: how much a writer
		// gets rid of while nobody reads.
		var written int64
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
				t.Fatalf("write after %d bytes: %v", written, werr)
			}
			written += int64(n)
		}
		t.Logf("writer blocked after %d bytes", written)
		if written >= bound {
			t.Fatalf("a writer to a receiver that never reads got rid of %d bytes without blocking", written)
		}
		// The reader wakes up: a writer finishes 4 MB more while it reads.
		total := written + 4<<20
		werr := make(chan error, 1)
		go func() {
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
		buf := make([]byte, 256<<10)
		var read int64
		for {
			n, err := server.Read(buf)
			for i := range n {
				if buf[i] != pattern(read+int64(i)) {
					t.Fatalf("byte %d differs: stream out of order or corrupted", read+int64(i))
				}
			}
			read += int64(n)
			if err == io.EOF {
				break
			}
			if err != nil {
				t.Fatalf("read: %v", err)
			}
		}
		if err := <-werr; err != nil {
			t.Fatal(err)
		}
		if read != total {
			t.Fatalf("read %d bytes, %d were written", read, total)
		}
		if a != nil {
			if s := stats(t, a); s.PassthroughConnections["backpressure"] == 0 {
				t.Fatalf("the writer was not sent to TCP by backpressure: %v", s.PassthroughConnections)
			}
		}
	})
}

// send() after shutdown(SHUT_WR) fails with EPIPE; the peer reads what came
// before and then EOF, never bytes after the FIN.
func TestPrivilegedFaithfulSendAfterShutdown(t *testing.T) {
	testutil.RequirePrivileged(t)
	forEachAgent(t, func(t *testing.T, a *Agent) {
		ln := mustListen(t, "127.0.0.1:0")
		defer ln.Close()
		client, server := pairedConn(t, a, ln, dialer(ln.Addr().String()))
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
			if slices.Contains(sockhashCookies(t, a), socketCookie(t, client)) {
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

// A socket in TCP_REPAIR mode reaches ESTABLISHED with sequence numbers its
// owner chose and no handshake: it is never paired, whatever it claims.
func TestPrivilegedFaithfulRepairSocketNotPaired(t *testing.T) {
	testutil.RequirePrivileged(t)
	a := startAgent(t, Config{})
	ln := mustListen(t, "127.0.0.1:0")
	defer ln.Close()
	// A real connection whose sequence numbers a repair socket could copy.
	pairedConn(t, a, ln, dialer(ln.Addr().String()))

	before := stats(t, a)
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_STREAM, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(fd)
	for _, o := range [][2]int{{unix.TCP_REPAIR, 1}, {unix.TCP_REPAIR_QUEUE, 2 /* TCP_SEND_QUEUE */}, {unix.TCP_QUEUE_SEQ, 1000}} {
		if err := unix.SetsockoptInt(fd, unix.IPPROTO_TCP, o[0], o[1]); err != nil {
			t.Fatalf("setsockopt %d: %v", o[0], err)
		}
	}
	port := portOf(t, ln.Addr().String())
	if err := unix.Connect(fd, &unix.SockaddrInet4{Addr: [4]byte{127, 0, 0, 1}, Port: int(port)}); err != nil {
		t.Fatalf("repair-mode connect: %v", err)
	}
	cookie, err := unix.GetsockoptUint64(fd, unix.SOL_SOCKET, unix.SO_COOKIE)
	if err != nil {
		t.Fatal(err)
	}
	if slices.Contains(sockhashCookies(t, a), cookie) {
		t.Fatal("a TCP_REPAIR socket joined the SOCKHASH")
	}
	if d := stats(t, a).Sub(before); d.PassthroughConnections["tcp_repair"] != 1 {
		t.Fatalf("tcp_repair connections = %d, want 1 (%v)", d.PassthroughConnections["tcp_repair"], d.PassthroughConnections)
	}
}
