// SPDX-License-Identifier: Apache-2.0

package accel

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"runtime"
	"slices"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/meshwarp/meshwarp/internal/testutil"
)

// The socket API compatibility suite, runner and call rows: every row (the
// option rows of compat_privileged_test.go and the call rows here) runs at
// every moment of a connection's life, without the agent and with it, with
// the same assertions. docs/ARCHITECTURE.md "What an application can see"
// is generated from these rows (TestCompatTableInDocs).

// blockingRecv runs recvfrom on c's descriptor in blocking mode on a thread
// of its own, bounded by SO_RCVTIMEO (5 s).
func blockingRecv(t *testing.T, c net.Conn, buf []byte, flags int) (int, error) {
	t.Helper()
	type ret struct {
		n   int
		err error
	}
	res := make(chan ret, 1)
	go func() {
		runtime.LockOSThread()
		defer runtime.UnlockOSThread()
		var r ret
		onFD(t, c, func(fd int) {
			tv := unix.Timeval{Sec: 5}
			unix.SetsockoptTimeval(fd, unix.SOL_SOCKET, unix.SO_RCVTIMEO, &tv)
			unix.SetNonblock(fd, false)
			r.n, _, r.err = unix.Recvfrom(fd, buf, flags)
			unix.SetNonblock(fd, true)
		})
		res <- r
	}()
	r := <-res
	return r.n, r.err
}

// writeChunks writes n chunks of size pattern bytes, one write each.
func writeChunks(t *testing.T, w net.Conn, n, size int) []byte {
	t.Helper()
	all := make([]byte, 0, n*size)
	for i := range n * size {
		all = append(all, pattern(int64(i)))
	}
	for i := range n {
		mustWrite(t, w, all[i*size:(i+1)*size])
	}
	return all
}

// awaitInqOf fails unless FIONREAD reaches want within 5 s.
func awaitInqOf(t *testing.T, r net.Conn, want int) {
	t.Helper()
	if err := awaitInq(r, want); err != nil {
		t.Fatal(err)
	}
}

func fdIoctl(t *testing.T, c net.Conn, req uint) int {
	t.Helper()
	var n int
	var err error
	onFD(t, c, func(fd int) { n, err = unix.IoctlGetInt(fd, req) })
	if err != nil {
		t.Fatalf("ioctl %#x: %v", req, err)
	}
	return n
}

// readUntilEOF reads r to EOF (5 s at most) and returns what it read.
func readUntilEOF(t *testing.T, r net.Conn) ([]byte, error) {
	t.Helper()
	r.SetReadDeadline(time.Now().Add(5 * time.Second))
	defer r.SetReadDeadline(time.Time{})
	return io.ReadAll(r)
}

// epollReader reads r the way an event loop does: it waits for events on
// an epoll instance (edge-triggered or level-triggered, with EPOLLRDHUP),
// and on each readiness reads 4 KB at a time until a short read, which
// it takes as "drained" unless EPOLLRDHUP was reported (nginx's
// ngx_unix_recv does exactly this). It returns the bytes
// read before the peer's FIN and whether EPOLLRDHUP was reported; a wait
// of 5 s without an event is a stall.
func epollReader(t *testing.T, r net.Conn, edge bool) ([]byte, bool) {
	t.Helper()
	var got []byte
	rdhup := false
	onFD(t, r, func(fd int) {
		ep, err := unix.EpollCreate1(unix.EPOLL_CLOEXEC)
		if err != nil {
			t.Fatal(err)
		}
		defer unix.Close(ep)
		ev := unix.EpollEvent{Events: unix.EPOLLIN | unix.EPOLLRDHUP, Fd: int32(fd)}
		if edge {
			ev.Events |= unix.EPOLLET
		}
		if err := unix.EpollCtl(ep, unix.EPOLL_CTL_ADD, fd, &ev); err != nil {
			t.Fatal(err)
		}
		evs := make([]unix.EpollEvent, 1)
		buf := make([]byte, 4096)
		for {
			n, err := unix.EpollWait(ep, evs, 5000)
			if errors.Is(err, unix.EINTR) {
				continue
			}
			if err != nil {
				t.Fatalf("epoll_wait: %v", err)
			}
			if n == 0 {
				t.Fatalf("stalled: no event for 5 s after %d bytes (FIONREAD %d)", len(got), inqOrMinus(fd))
			}
			if evs[0].Events&unix.EPOLLRDHUP != 0 {
				rdhup = true
			}
			for {
				m, err := unix.Read(fd, buf)
				if errors.Is(err, unix.EAGAIN) {
					break
				}
				if err != nil {
					t.Fatalf("read: %v", err)
				}
				if m == 0 {
					return
				}
				got = append(got, buf[:m]...)
				if m < len(buf) && !rdhup {
					break // a short read: drained, wait for the next event (nginx reads on once EPOLLRDHUP came)
				}
			}
		}
	})
	return got, rdhup
}

func inqOrMinus(fd int) int {
	n, err := unix.IoctlGetInt(fd, unix.SIOCINQ)
	if err != nil {
		return -1
	}
	return n
}

func epollRow(edge bool) func(t *testing.T, w, r net.Conn, _ bool) {
	return func(t *testing.T, w, r net.Conn, _ bool) {
		var want []byte
		done := make(chan struct{})
		go func() {
			defer close(done)
			for i := range 200 {
				b := bytes.Repeat([]byte{byte('a' + i%26)}, 50+i%7*700)
				want = append(want, b...)
				if _, err := w.Write(b); err != nil {
					return
				}
				if i%20 == 0 {
					runtime.Gosched()
				}
			}
			w.(*net.TCPConn).CloseWrite()
		}()
		got, rdhup := epollReader(t, r, edge)
		<-done
		if !bytes.Equal(got, want) {
			t.Fatalf("read %d bytes, %d were written (or they differ)", len(got), len(want))
		}
		if !rdhup {
			t.Fatal("no EPOLLRDHUP after the peer's FIN")
		}
	}
}

var callRows = []compatRow{
	{
		name: "recv size",
		// 200 writes of 50 B wait; one recv(64 KB) returns all of them.
		check: func(t *testing.T, w, r net.Conn, _ bool) {
			want := writeChunks(t, w, 200, 50)
			awaitInqOf(t, r, len(want))
			buf := make([]byte, 65536)
			n, err := r.Read(buf)
			if err != nil || n != len(want) || !bytes.Equal(buf[:n], want) {
				t.Fatalf("recv(64 KB) with %d bytes waiting returned %d (%v): a short read", len(want), n, err)
			}
		},
	},
	{
		name: "MSG_PEEK",
		// A reader that peeks until a whole frame is visible.
		check: func(t *testing.T, w, r net.Conn, _ bool) {
			want := writeChunks(t, w, 200, 50)
			awaitInqOf(t, r, len(want))
			buf := make([]byte, 65536)
			var n int
			var err error
			onFD(t, r, func(fd int) { n, _, err = unix.Recvfrom(fd, buf, unix.MSG_PEEK) })
			if err != nil || n != len(want) || !bytes.Equal(buf[:n], want) {
				t.Fatalf("MSG_PEEK with %d bytes waiting showed %d (%v)", len(want), n, err)
			}
			if _, err := io.ReadFull(r, buf[:len(want)]); err != nil || !bytes.Equal(buf[:len(want)], want) {
				t.Fatalf("read after peek: %v", err)
			}
		},
	},
	{
		name: "FIONREAD",
		// A reader that reads exactly what FIONREAD reports (Java's available()).
		check: func(t *testing.T, w, r net.Conn, _ bool) {
			want := writeChunks(t, w, 30, 333)
			var got []byte
			deadline := time.Now().Add(5 * time.Second)
			for len(got) < len(want) {
				if time.Now().After(deadline) {
					t.Fatalf("FIONREAD reported %d of %d bytes in 5 s", len(got), len(want))
				}
				n := fdIoctl(t, r, unix.SIOCINQ)
				if n == 0 {
					time.Sleep(time.Millisecond) // polling interval
					continue
				}
				if len(got)+n > len(want) {
					t.Fatalf("FIONREAD = %d with %d bytes left", n, len(want)-len(got))
				}
				b := make([]byte, n)
				if _, err := io.ReadFull(r, b); err != nil {
					t.Fatal(err)
				}
				got = append(got, b...)
			}
			if !bytes.Equal(got, want) {
				t.Fatal("bytes differ")
			}
			if n := fdIoctl(t, r, unix.SIOCINQ); n != 0 {
				t.Fatalf("FIONREAD = %d after every byte was read", n)
			}
		},
	},
	{
		name: "SIOCOUTQ",
		// A writer that waits for its send queue to empty before closing.
		check: func(t *testing.T, w, r net.Conn, _ bool) {
			writeChunks(t, w, 10, 100)
			deadline := time.Now().Add(5 * time.Second)
			for {
				n := fdIoctl(t, w, unix.SIOCOUTQ)
				if n > 1000 {
					t.Fatalf("SIOCOUTQ = %d, only 1000 bytes were written", n)
				}
				if n == 0 {
					break
				}
				if time.Now().After(deadline) {
					t.Fatalf("SIOCOUTQ stuck at %d", n)
				}
				time.Sleep(time.Millisecond) // polling interval
			}
			awaitInqOf(t, r, 1000)
		},
	},
	{
		name: "MSG_WAITALL",
		// recv(MSG_WAITALL) returns only when the whole size arrived.
		check: func(t *testing.T, w, r net.Conn, limited bool) {
			go func() {
				for i := range 10 {
					w.Write(bytes.Repeat([]byte{byte('0' + i)}, 100))
					time.Sleep(2 * time.Millisecond) // pacing the writes apart, not synchronisation
				}
			}()
			buf := make([]byte, 1000)
			n, err := blockingRecv(t, r, buf, unix.MSG_WAITALL)
			if err != nil {
				t.Fatalf("recv(MSG_WAITALL): %v", err)
			}
			if limited {
				// What the application sees: a short count; the bytes are intact and in order.
				if n == 0 || n > 1000 || buf[0] != '0' {
					t.Fatalf("recv(MSG_WAITALL) returned %d bytes", n)
				}
				if _, err := io.ReadFull(r, buf[n:]); err != nil || buf[999] != '9' {
					t.Fatalf("rest of the bytes: %v", err)
				}
				return
			}
			if n != 1000 {
				t.Fatalf("recv(MSG_WAITALL, 1000) returned %d", n)
			}
		},
		limitedAt: []compatMoment{momentFirst, momentPaired},
		limit: "recv returns what has arrived (tcp_bpf_recvmsg does not loop for MSG_WAITALL; docs/kernel/01-msg-waitall.md); " +
			"with `run --learn-from-syscalls` later connections on its ports stay on TCP",
	},
	{
		name: "MSG_OOB",
		// Urgent data: read stops at the mark, recv(MSG_OOB) returns the urgent byte.
		check: func(t *testing.T, w, r net.Conn, limited bool) {
			mustWrite(t, w, []byte("abc"))
			onFD(t, w, func(fd int) {
				if err := unix.Sendto(fd, []byte("x"), unix.MSG_OOB, nil); err != nil {
					t.Fatalf("send(MSG_OOB): %v", err)
				}
			})
			mustWrite(t, w, []byte("def"))
			w.(*net.TCPConn).CloseWrite()
			urgent, data := readOOB(t, r)
			if limited {
				// What the application sees: recv(MSG_OOB) takes a normal byte; the stream carries x inline.
				if urgent+data != "abcxdef" {
					t.Fatalf("recv(MSG_OOB) returned %q, then read %q", urgent, data)
				}
				return
			}
			if data != "abcdef" || urgent != "x" {
				t.Fatalf("recv(MSG_OOB) returned %q, then read %q; want x, then abcdef", urgent, data)
			}
		},
		limitedAt: []compatMoment{momentFirst, momentPaired},
		limit: "the urgent byte arrives inline and recv(MSG_OOB) returns normal data (the redirect, bpf_tcp_ingress, drops the flag, and tcp_bpf_recvmsg ignores it; docs/kernel/02-msg-oob.md); " +
			"with `run --learn-from-syscalls` later connections on its ports stay on TCP",
	},
	{
		name: "SO_OOBINLINE", reason: "oob",
		set: setInt(unix.SOL_SOCKET, unix.SO_OOBINLINE, 1),
		check: func(t *testing.T, w, r net.Conn, _ bool) {
			mustWrite(t, w, []byte("abc"))
			onFD(t, w, func(fd int) {
				if err := unix.Sendto(fd, []byte("x"), unix.MSG_OOB, nil); err != nil {
					t.Fatalf("send(MSG_OOB): %v", err)
				}
			})
			w.(*net.TCPConn).CloseWrite()
			awaitInqOf(t, r, 4)
			// A read stops at the mark; SIOCATMARK then says the urgent byte is next.
			buf := make([]byte, 10)
			if n, err := r.Read(buf); err != nil || string(buf[:n]) != "abc" {
				t.Fatalf("read %q (%v), want abc: a read stops at the urgent mark", buf[:n], err)
			}
			if fdIoctl(t, r, unix.SIOCATMARK) != 1 {
				t.Fatal("SIOCATMARK is not set at the urgent byte")
			}
			got, err := readUntilEOF(t, r)
			if err != nil || string(got) != "x" {
				t.Fatalf("read %q (%v), want the urgent byte x inline", got, err)
			}
		},
	},
	{
		name: "SO_LINGER 0",
		// close() with SO_LINGER 0 resets the connection: the peer reads ECONNRESET.
		check: func(t *testing.T, w, r net.Conn, _ bool) {
			mustWrite(t, w, []byte("abc"))
			awaitInqOf(t, r, 3)
			w.(*net.TCPConn).SetLinger(0)
			w.Close()
			_, err := readUntilEOF(t, r)
			if !errors.Is(err, syscall.ECONNRESET) {
				t.Fatalf("after the peer's close with SO_LINGER 0, read ended with %v, want ECONNRESET", err)
			}
		},
	},
	{
		name: "close with unread bytes",
		// A reader that closes with bytes unread resets the connection: the writer reads ECONNRESET.
		check: func(t *testing.T, w, r net.Conn, limited bool) {
			mustWrite(t, w, []byte("unread"))
			awaitInqOf(t, r, 6)
			r.Close()
			_, err := readUntilEOF(t, w)
			if limited {
				if err != nil {
					t.Fatalf("read ended with %v, want EOF (the FIN tcp_close sends)", err)
				}
				return
			}
			if !errors.Is(err, syscall.ECONNRESET) {
				t.Fatalf("after the peer closed with unread bytes, read ended with %v, want ECONNRESET", err)
			}
		},
		limitedAt: []compatMoment{momentFirst, momentPaired},
		limit: "the peer sees FIN, not RST (tcp_close counts only sk_receive_queue as unread, not the redirect queue; docs/kernel/03-close-unread-rst.md); " +
			"with `run --learn-from-syscalls` later connections on its ports stay on TCP",
	},
	{
		name: "shutdown racing send", repeat: 60,
		// One thread writes 40-64 KB messages while another calls
		// shutdown(SHUT_WR): the reader gets every accepted byte, then EOF,
		// and nothing after EOF.
		check: func(t *testing.T, w, r net.Conn, _ bool) {
			written := make(chan int64, 1)
			started := make(chan struct{})
			go func() {
				var total int64
				buf := make([]byte, 64<<10)
				for i := 0; ; i++ {
					sz := 40<<10 + i*4099%(24<<10)
					for j := range sz {
						buf[j] = pattern(total + int64(j))
					}
					n, err := w.Write(buf[:sz])
					total += int64(n)
					if err != nil {
						break
					}
				}
				written <- total
			}()
			go func() {
				// The second thread: shut the writer down once bytes flow.
				<-started
				w.(*net.TCPConn).CloseWrite()
			}()
			var read int64
			buf := make([]byte, 64<<10)
			r.SetReadDeadline(time.Now().Add(10 * time.Second))
			for {
				n, err := r.Read(buf)
				for i := range n {
					if buf[i] != pattern(read+int64(i)) {
						t.Fatalf("byte at offset %d differs", read+int64(i))
					}
				}
				if read == 0 && n > 0 {
					close(started)
				}
				read += int64(n)
				if errors.Is(err, io.EOF) {
					break
				}
				if err != nil {
					t.Fatalf("read at %d: %v", read, err)
				}
			}
			total := <-written
			if n := fdIoctl(t, r, unix.SIOCINQ); n != 0 {
				t.Fatalf("EOF after %d bytes, then FIONREAD = %d: bytes after EOF", read, n)
			}
			if read != total {
				t.Fatalf("EOF after %d bytes; send() accepted %d", read, total)
			}
		},
	},
	{name: "epoll edge-triggered", check: epollRow(true)},
	{name: "epoll level-triggered", check: epollRow(false)},
	{
		name: "poll",
		check: func(t *testing.T, w, r net.Conn, _ bool) {
			mustWrite(t, w, []byte("hello"))
			if !waitReadable(t, r, 5*time.Second) {
				t.Fatal("not readable with 5 bytes waiting")
			}
			if _, err := io.ReadFull(r, make([]byte, 5)); err != nil {
				t.Fatal(err)
			}
			if waitReadable(t, r, 0) {
				t.Fatal("readable with nothing waiting")
			}
			w.(*net.TCPConn).CloseWrite()
			var rev int16
			onFD(t, r, func(fd int) {
				pfd := []unix.PollFd{{Fd: int32(fd), Events: unix.POLLIN | unix.POLLRDHUP}}
				unix.Poll(pfd, 5000)
				rev = pfd[0].Revents
			})
			if rev&unix.POLLRDHUP == 0 || rev&unix.POLLIN == 0 {
				t.Fatalf("after the peer's FIN poll reported %#x, want POLLIN|POLLRDHUP", rev)
			}
		},
	},
	{
		name: "splice",
		// splice(2) from the socket into a pipe (Go's io.Copy between sockets does this).
		check: func(t *testing.T, w, r net.Conn, limited bool) {
			want := writeChunks(t, w, 20, 500)
			awaitInqOf(t, r, len(want))
			var p [2]int
			if err := unix.Pipe2(p[:], unix.O_CLOEXEC|unix.O_NONBLOCK); err != nil {
				t.Fatal(err)
			}
			defer unix.Close(p[0])
			defer unix.Close(p[1])
			var got []byte
			var err error
			onFD(t, r, func(fd int) {
				for len(got) < len(want) {
					var n int64
					n, err = unix.Splice(fd, nil, p[1], nil, 65536, unix.SPLICE_F_NONBLOCK)
					if err != nil || n == 0 {
						return
					}
					b := make([]byte, n)
					for off := 0; off < len(b); {
						m, rerr := unix.Read(p[0], b[off:])
						if rerr != nil {
							err = rerr
							return
						}
						off += m
					}
					got = append(got, b...)
				}
			})
			if limited {
				// What the application sees: nothing to splice while FIONREAD counts the bytes.
				if len(got) != 0 || !errors.Is(err, unix.EAGAIN) {
					t.Fatalf("splice: %d bytes, %v", len(got), err)
				}
				return
			}
			if err != nil || !bytes.Equal(got, want) {
				t.Fatalf("splice with %d bytes waiting moved %d (%v), or they differ", len(want), len(got), err)
			}
		},
		limitedAt: []compatMoment{momentFirst, momentPaired},
		limit: "splice finds nothing: the bytes wait in the redirect queue, which tcp_splice_read does not read (docs/kernel/04-splice.md); " +
			"with `run --learn-from-syscalls` later connections on its ports stay on TCP",
	},
	{
		name: "sendfile",
		check: func(t *testing.T, w, r net.Conn, _ bool) {
			f, err := os.CreateTemp("", "meshwarp-sendfile-")
			if err != nil {
				t.Fatal(err)
			}
			defer os.Remove(f.Name())
			defer f.Close()
			want := make([]byte, 100_000)
			for i := range want {
				want[i] = pattern(int64(i))
			}
			if _, err := f.Write(want); err != nil {
				t.Fatal(err)
			}
			rc, _ := w.(syscall.Conn).SyscallConn()
			go rc.Control(func(fd uintptr) {
				off := int64(0)
				for off < int64(len(want)) {
					if _, err := unix.Sendfile(int(fd), int(f.Fd()), &off, len(want)-int(off)); err != nil && !errors.Is(err, unix.EAGAIN) {
						return
					}
				}
			})
			got := make([]byte, len(want))
			r.SetReadDeadline(time.Now().Add(5 * time.Second))
			if _, err := io.ReadFull(r, got); err != nil || !bytes.Equal(got, want) {
				t.Fatalf("sendfile: %v (or bytes differ)", err)
			}
		},
	},
}

// allCompatRows is the whole table: option rows, then call rows.
func allCompatRows() []compatRow { return slices.Concat(compatRows, callRows) }

// moments returns the moments a row runs at: option rows also at
// "accepted" (option set before any byte).
func (row compatRow) moments() []compatMoment {
	if row.set != nil {
		return compatMoments
	}
	return slices.DeleteFunc(slices.Clone(compatMoments), func(m compatMoment) bool { return m == momentAccepted })
}

func (row compatRow) limitedAtMoment(m compatMoment) bool { return slices.Contains(row.limitedAt, m) }

// pingPong sends a request and a response through a connection.
func pingPong(t *testing.T, client, server net.Conn) {
	t.Helper()
	mustWrite(t, client, []byte("ping"))
	if _, err := io.ReadFull(server, make([]byte, 4)); err != nil {
		t.Fatal(err)
	}
	mustWrite(t, server, []byte("pong"))
	if _, err := io.ReadFull(client, make([]byte, 4)); err != nil {
		t.Fatal(err)
	}
}

// smallStream sends 200 writes of 50 B client->server, read as they
// come, then a reply: the agent moves such a stream to TCP (small_stream).
func smallStream(t *testing.T, client, server net.Conn) {
	t.Helper()
	errc := make(chan error, 1)
	go func() {
		_, err := io.ReadFull(server, make([]byte, 200*50))
		errc <- err
	}()
	for range 200 {
		mustWrite(t, client, make([]byte, 50))
	}
	if err := <-errc; err != nil {
		t.Fatal(err)
	}
	pingPong(t, client, server)
}

// fillAndDrain writes client->server until the writer would block, then
// drains the reader: the agent moves the direction to TCP (backpressure).
func fillAndDrain(t *testing.T, client, server net.Conn) {
	t.Helper()
	var total int
	buf := make([]byte, 64<<10)
	onFD(t, client, func(fd int) {
		deadline := time.Now().Add(5 * time.Second)
		for time.Now().Before(deadline) {
			n, err := unix.Write(fd, buf)
			if errors.Is(err, unix.EAGAIN) {
				return
			}
			if err != nil {
				t.Fatalf("write: %v", err)
			}
			total += n
		}
		t.Fatal("the writer never blocked in 5 s")
	})
	if _, err := io.ReadFull(server, make([]byte, total)); err != nil {
		t.Fatal(err)
	}
	pingPong(t, client, server)
}

// compatConn brings a connection to moment m and returns the writer and
// reader of row; with the agent, it requires that the moment happened
// (paired, switched, backpressure).
func compatConn(t *testing.T, a *Agent, row compatRow, m compatMoment) (w, r net.Conn) {
	t.Helper()
	ln := mustListen(t, "127.0.0.1:0")
	t.Cleanup(func() { ln.Close() })
	d := net.Dialer{}
	if m == momentFirst && row.set != nil {
		d.Control = func(_, _ string, rc syscall.RawConn) error {
			return rc.Control(func(fd uintptr) { row.set(t, int(fd)) })
		}
	}
	dial := func() (net.Conn, error) { return d.Dial("tcp", ln.Addr().String()) }
	var client, server net.Conn
	if m == momentFirst && row.set != nil || m == momentAccepted {
		client, server = acceptedPair(t, ln, dial)
	} else {
		client, server = pairedConn(t, a, ln, dial)
	}
	var before Stats
	if a != nil {
		before = stats(t, a)
	}
	want := ""
	switch m {
	case momentPaired:
		pingPong(t, client, server)
	case momentSwitched:
		smallStream(t, client, server)
		want = "small_stream"
	case momentBackpressure:
		fillAndDrain(t, client, server)
		want = "backpressure"
	}
	if a != nil && want != "" {
		if got := stats(t, a).Sub(before).PassthroughConnections[want]; got == 0 {
			t.Fatalf("the agent counted no %s: the moment did not happen", want)
		}
	}
	w, r = client, server
	if m == momentFirst && row.set != nil {
		// The option is on the client: it writes (onClient) or reads.
		if !row.onClient {
			w, r = r, w
		}
		return w, r
	}
	if row.set != nil {
		target := r
		if row.onClient {
			target = w
		}
		onFD(t, target, func(fd int) { row.set(t, fd) })
	}
	return w, r
}

func TestPrivilegedCompat(t *testing.T) {
	testutil.RequirePrivileged(t)
	forEachAgent(t, func(t *testing.T, a *Agent) {
		for _, row := range allCompatRows() {
			for _, m := range row.moments() {
				t.Run(fmt.Sprintf("%s/%s", row.name, m), func(t *testing.T) {
					for range max(row.repeat, 1) {
						var before Stats
						if a != nil {
							before = stats(t, a)
						}
						w, r := compatConn(t, a, row, m)
						row.check(t, w, r, a != nil && row.limitedAtMoment(m))
						if a == nil || row.reason == "" || m == momentSwitched || m == momentBackpressure {
							// After a path change the sockets are plain TCP: nothing to count.
							continue
						}
						if d := stats(t, a).Sub(before); d.PassthroughConnections[row.reason] == 0 {
							t.Fatalf("the agent counted no %s connection (passthrough %v)", row.reason, d.PassthroughConnections)
						}
					}
				})
			}
		}
	})
}

// readOOB waits for the peer's FIN, takes the urgent byte if there is one
// (recv(MSG_OOB)), then reads the normal data to EOF.
func readOOB(t *testing.T, r net.Conn) (urgent, data string) {
	t.Helper()
	onFD(t, r, func(fd int) {
		pfd := []unix.PollFd{{Fd: int32(fd), Events: unix.POLLRDHUP}}
		if n, _ := unix.Poll(pfd, 5000); n != 1 {
			t.Fatal("no FIN from the writer in 5 s")
		}
		b := make([]byte, 1)
		if n, _, err := unix.Recvfrom(fd, b, unix.MSG_OOB|unix.MSG_DONTWAIT); err == nil {
			urgent = string(b[:n])
		}
	})
	got, err := readUntilEOF(t, r)
	if err != nil {
		t.Fatalf("read: %v", err)
	}
	return urgent, string(got)
}
