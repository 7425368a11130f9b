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
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/meshwarp/meshwarp/internal/probe"
	"github.com/meshwarp/meshwarp/internal/testutil"
)

// TCP guarantees that this kernel's sockmap receive path cannot give a
// paired socket (recv(MSG_WAITALL), MSG_OOB, SO_RCVLOWAT set after pairing,
// close with unread bytes): the agent learns the socket's ports from the
// syscall and leaves later connections on them to TCP. Each test lets a
// paired connection reveal the call (with the agent), then runs the same
// TCP assertion on a new connection with and without the agent.

// onFD runs fn with the socket's file descriptor.
func onFD(t *testing.T, c net.Conn, fn func(fd int)) {
	t.Helper()
	rc, err := c.(syscall.Conn).SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	if err := rc.Control(func(fd uintptr) { fn(int(fd)) }); err != nil {
		t.Fatal(err)
	}
}

// blockingCall runs call on c's descriptor switched to blocking mode, on a
// thread of its own, and returns once that thread sleeps inside syscall nr
// (a condition read from /proc, not a guess) or call has returned. The
// result arrives on the returned channel. SO_RCVTIMEO bounds a hang.
func blockingCall(t *testing.T, c net.Conn, nr int, call func(fd int) (int, error)) <-chan error {
	t.Helper()
	type ret struct {
		n   int
		err error
	}
	tids := make(chan int, 1)
	res := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		defer runtime.UnlockOSThread()
		var n int
		var cerr error
		onFD(t, c, func(fd int) {
			tv := unix.Timeval{Sec: 20}
			unix.SetsockoptTimeval(fd, unix.SOL_SOCKET, unix.SO_RCVTIMEO, &tv)
			unix.SetNonblock(fd, false)
			tids <- unix.Gettid()
			n, cerr = call(fd)
			unix.SetNonblock(fd, true)
		})
		if cerr != nil {
			res <- cerr
			return
		}
		res <- fmt.Errorf("returned %d", n)
	}()
	tid := <-tids
	deadline := time.Now().Add(10 * time.Second)
	for time.Now().Before(deadline) {
		b, err := os.ReadFile(fmt.Sprintf("/proc/self/task/%d/syscall", tid))
		if err == nil && strings.HasPrefix(string(b), strconv.Itoa(nr)+" ") {
			if st, err := os.ReadFile(fmt.Sprintf("/proc/self/task/%d/stat", tid)); err == nil && strings.Contains(string(st), ") S ") {
				return res
			}
		}
		if len(res) > 0 {
			return res
		}
		time.Sleep(time.Millisecond) // polling interval
	}
	t.Fatalf("thread %d never blocked in syscall %d", tid, nr)
	return nil
}

// acceptedConn dials ln (in the test's cgroup) and returns both ends.
func acceptedConn(t *testing.T, ln net.Listener) (client, server net.Conn) {
	t.Helper()
	acc := make(chan net.Conn, 1)
	go func() {
		c, _ := ln.Accept()
		acc <- c
	}()
	client, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { client.Close() })
	if server = <-acc; server == nil {
		t.Fatal("accept failed")
	}
	t.Cleanup(func() { server.Close() })
	return client, server
}

// learnedCase: reveal does the call on a paired connection; check asserts
// plain TCP behaviour on a later connection to the same listener.
func learnedCase(t *testing.T, reason string, reveal, check func(t *testing.T, client, server net.Conn)) {
	noSetup := func(*testing.T) net.Listener { return nil }
	forEachAgentConfig(t, Config{LearnFromSyscalls: true}, noSetup, func(t *testing.T, a *Agent, _ net.Listener) {
		ln := mustListen(t, "127.0.0.1:0")
		defer ln.Close()
		if a != nil {
			c1, s1 := pairedConn(t, a, ln, func() (net.Conn, error) { return net.Dial("tcp", ln.Addr().String()) })
			reveal(t, c1, s1)
			deadline := time.Now().Add(10 * time.Second)
			for stats(t, a).UnfitCalls[reason] == 0 {
				if time.Now().After(deadline) {
					t.Fatalf("the agent did not learn %s", reason)
				}
				time.Sleep(5 * time.Millisecond) // polling interval
			}
			c1.Close()
			s1.Close()
		}
		var before Stats
		if a != nil {
			before = stats(t, a)
		}
		client, server := acceptedConn(t, ln)
		if a != nil {
			requireOutsideSockhash(t, a, client, server)
			if d := stats(t, a).Sub(before); d.PassthroughConnections[reason] != 1 {
				t.Fatalf("the later connection was not left to TCP as %s: %v", reason, d.PassthroughConnections)
			}
			if !hasUnfitProcess(t, a, reason) {
				t.Fatalf("status does not name this process for %s", reason)
			}
		}
		check(t, client, server)
	})
}

func hasUnfitProcess(t *testing.T, a *Agent, reason string) bool {
	for _, p := range stats(t, a).UnfitProcesses {
		if p.PID == uint32(os.Getpid()) && p.Reason == reason && p.Calls > 0 {
			return true
		}
	}
	return false
}

// A blocking recv(8000, MSG_WAITALL) with the data arriving in 1000-byte
// pieces returns 8000.
func TestPrivilegedFaithfulLearnedWaitall(t *testing.T) {
	testutil.RequirePrivileged(t)
	learnedCase(t, "waitall_reader", func(t *testing.T, client, _ net.Conn) {
		onFD(t, client, func(fd int) { unix.Recvfrom(fd, make([]byte, 10), unix.MSG_WAITALL|unix.MSG_DONTWAIT) })
	}, func(t *testing.T, client, server net.Conn) {
		buf := make([]byte, 8000)
		done := blockingCall(t, client, unix.SYS_RECVFROM, func(fd int) (int, error) {
			n, _, err := unix.Recvfrom(fd, buf, unix.MSG_WAITALL)
			return n, err
		})
		piece := make([]byte, 1000)
		for i := range 8 {
			for j := range piece {
				piece[j] = byte(i)
			}
			if _, err := server.Write(piece); err != nil {
				t.Fatal(err)
			}
			// Let the reader take this piece before the next one comes, so a
			// recv that returns early shows: wait until nothing is queued
			// (the reader holds it) or the recv returned.
			deadline := time.Now().Add(10 * time.Second)
			for len(done) == 0 {
				if n, err := inq(client); err == nil && n == 0 {
					break
				}
				if time.Now().After(deadline) {
					t.Fatal("the blocked reader never took the piece")
				}
				time.Sleep(time.Millisecond) // polling interval
			}
		}
		if err := <-done; err.Error() != "returned 8000" {
			t.Fatalf("recv(8000, MSG_WAITALL): %v, want 8000 bytes", err)
		}
		for i := range 8 {
			if buf[i*1000] != byte(i) || buf[i*1000+999] != byte(i) {
				t.Fatalf("piece %d out of place", i)
			}
		}
	})
}

// send("!", MSG_OOB) between "abc" and "def": the receiver reads "!" with
// recv(MSG_OOB) and "abcdef" as the stream.
func TestPrivilegedFaithfulLearnedOOB(t *testing.T) {
	testutil.RequirePrivileged(t)
	learnedCase(t, "oob", func(t *testing.T, client, _ net.Conn) {
		onFD(t, client, func(fd int) { unix.Sendto(fd, []byte("!"), unix.MSG_OOB, nil) })
	}, func(t *testing.T, client, server net.Conn) {
		if _, err := client.Write([]byte("abc")); err != nil {
			t.Fatal(err)
		}
		var serr error
		onFD(t, client, func(fd int) { serr = unix.Sendto(fd, []byte("!"), unix.MSG_OOB, nil) })
		if serr != nil {
			t.Fatalf("send(MSG_OOB): %v", serr)
		}
		if _, err := client.Write([]byte("def")); err != nil {
			t.Fatal(err)
		}
		client.(*net.TCPConn).CloseWrite()
		// Poll until the urgent byte has arrived (recv(MSG_OOB) fails with
		// EINVAL/EAGAIN before).
		oob := make([]byte, 1)
		deadline := time.Now().Add(10 * time.Second)
		for {
			var n int
			var rerr error
			onFD(t, server, func(fd int) { n, _, rerr = unix.Recvfrom(fd, oob, unix.MSG_OOB) })
			if rerr == nil && n == 1 {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("recv(MSG_OOB) never returned the urgent byte: %v", rerr)
			}
			time.Sleep(time.Millisecond) // polling interval
		}
		if oob[0] != '!' {
			t.Fatalf("recv(MSG_OOB) = %q, want \"!\"", oob)
		}
		stream, err := io.ReadAll(server)
		if err != nil {
			t.Fatal(err)
		}
		if string(stream) != "abcdef" {
			t.Fatalf("stream = %q, want \"abcdef\"", stream)
		}
	})
}

// close() with unread data: the peer's next read fails with ECONNRESET.
func TestPrivilegedFaithfulLearnedUnreadClose(t *testing.T) {
	testutil.RequirePrivileged(t)
	unread := func(t *testing.T, client, server net.Conn) {
		if _, err := client.Write(make([]byte, 100)); err != nil {
			t.Fatal(err)
		}
		if err := awaitInq(server, 100); err != nil {
			t.Fatal(err)
		}
		server.Close()
	}
	learnedCase(t, "unread_close", unread, func(t *testing.T, client, server net.Conn) {
		unread(t, client, server)
		client.SetReadDeadline(time.Now().Add(20 * time.Second))
		_, err := io.ReadAll(client)
		if !errors.Is(err, syscall.ECONNRESET) {
			t.Fatalf("read after the peer closed with unread data: %v, want ECONNRESET", err)
		}
	})
}

// A reader that sizes its read with ioctl(FIONREAD) after the peer wrote
// 300 bytes sees 300. Kernels whose tcp_bpf has no ioctl (6.1) leave the
// redirect queue out of that answer: there the call is learned (the watch is
// attached only on such kernels) and later connections on the port stay on
// TCP. Elsewhere FIONREAD is exact on the paired connection itself.
func TestPrivilegedFaithfulLearnedFIONREAD(t *testing.T) {
	testutil.RequirePrivileged(t)
	check := func(t *testing.T, client, server net.Conn) {
		if _, err := server.Write(make([]byte, 300)); err != nil {
			t.Fatal(err)
		}
		if err := awaitInq(client, 300); err != nil {
			t.Fatal(err)
		}
	}
	if probe.HaveMsgTotLen() == nil {
		noSetup := func(*testing.T) net.Listener { return nil }
		forEachAgentConfig(t, Config{LearnFromSyscalls: true}, noSetup, func(t *testing.T, a *Agent, _ net.Listener) {
			ln := mustListen(t, "127.0.0.1:0")
			defer ln.Close()
			client, server := pairedConn(t, a, ln, func() (net.Conn, error) { return net.Dial("tcp", ln.Addr().String()) })
			defer client.Close()
			defer server.Close()
			check(t, client, server)
			if a != nil {
				if n := stats(t, a).UnfitCalls["fionread_reader"]; n != 0 {
					t.Fatalf("FIONREAD learned (%d calls) on a kernel where it counts redirected bytes", n)
				}
			}
		})
		return
	}
	learnedCase(t, "fionread_reader", func(t *testing.T, client, _ net.Conn) {
		fdIoctl(t, client, unix.SIOCINQ)
	}, check)
}
