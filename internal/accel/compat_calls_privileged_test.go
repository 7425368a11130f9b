// SPDX-License-Identifier: Apache-2.0

package accel

import (
	"bytes"
	"errors"
	"io"
	"net"
	"os"
	"runtime"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/meshwarp/meshwarp/internal/testutil"
)

// The call rows of the socket API compatibility suite (runner and moments:
// compat_suite_privileged_test.go; option rows: compat_privileged_test.go).

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
		name: "recv size", readsFIONREAD: true,
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
		name: "MSG_PEEK", readsFIONREAD: true,
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
		name: "FIONREAD", readsFIONREAD: true,
		// A reader that reads exactly what FIONREAD reports (Java's available()).
		check: func(t *testing.T, w, r net.Conn, _ bool) {
			want := writeChunks(t, w, 30, 333)
			var got []byte
			deadline := time.Now().Add(hangGuard)
			for len(got) < len(want) {
				if time.Now().After(deadline) {
					t.Fatalf("FIONREAD reported %d of %d bytes in %v", len(got), len(want), hangGuard)
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
		name: "SIOCOUTQ", readsFIONREAD: true,
		// A writer that waits for its send queue to empty before closing.
		check: func(t *testing.T, w, r net.Conn, _ bool) {
			writeChunks(t, w, 10, 100)
			deadline := time.Now().Add(hangGuard)
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
			"with `run --learn-from-syscalls` later connections on its ports, and the program's on any port, stay on TCP",
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
			"with `run --learn-from-syscalls` later connections on its ports, and the program's on any port, stay on TCP",
	},
	{
		name: "SO_OOBINLINE", readsFIONREAD: true, reason: "oob",
		level: unix.SOL_SOCKET, opt: unix.SO_OOBINLINE, val: 1,
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
		name: "SO_LINGER 0", readsFIONREAD: true,
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
		name: "close with unread bytes", readsFIONREAD: true,
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
			"with `run --learn-from-syscalls` later connections on its ports, and the program's on any port, stay on TCP",
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
			r.SetReadDeadline(time.Now().Add(hangGuard))
			for {
				n, err := r.Read(buf)
				for i := range n {
					if buf[i] != pattern(read+int64(i)) {
						t.Fatal(patternMismatch(buf[i:n], read+int64(i)))
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
			if !waitReadable(t, r, hangGuard) {
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
				rev, _ = testutil.Poll(fd, unix.POLLIN|unix.POLLRDHUP, hangGuard)
			})
			if rev&unix.POLLRDHUP == 0 || rev&unix.POLLIN == 0 {
				t.Fatalf("after the peer's FIN poll reported %#x, want POLLIN|POLLRDHUP", rev)
			}
		},
	},
	{
		name: "splice", readsFIONREAD: true,
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
			"with `run --learn-from-syscalls` later connections on its ports, and the program's on any port, stay on TCP",
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
			r.SetReadDeadline(time.Now().Add(hangGuard))
			if _, err := io.ReadFull(r, got); err != nil || !bytes.Equal(got, want) {
				t.Fatalf("sendfile: %v (or bytes differ)", err)
			}
		},
	},
}
