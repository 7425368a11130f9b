// SPDX-License-Identifier: Apache-2.0

package accel

import (
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
	"unsafe"

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
			for errors.Is(cerr, unix.EINTR) { // a signal, not the socket: call again, as applications do
				n, cerr = call(fd)
			}
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
	}, func(t *testing.T, client, server net.Conn) { checkWaitall(t, client, server) })
}

// checkWaitall: a blocking recv(8000, MSG_WAITALL) on r, with w writing in
// 1000-byte pieces, returns 8000.
func checkWaitall(t *testing.T, r, w net.Conn) {
	t.Helper()
	buf := make([]byte, 8000)
	done := blockingCall(t, r, unix.SYS_RECVFROM, func(fd int) (int, error) {
		n, _, err := unix.Recvfrom(fd, buf, unix.MSG_WAITALL)
		return n, err
	})
	piece := make([]byte, 1000)
	for i := range 8 {
		for j := range piece {
			piece[j] = byte(i)
		}
		if _, err := w.Write(piece); err != nil {
			t.Fatal(err)
		}
		// Let the reader take this piece before the next one comes, so a
		// recv that returns early shows: wait until nothing is queued
		// (the reader holds it) or the recv returned.
		deadline := time.Now().Add(10 * time.Second)
		for len(done) == 0 {
			if n, err := inq(r); err == nil && n == 0 {
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

// asProgram runs fn on a thread of its own that the kernel names name
// (PR_SET_NAME, at most 15 bytes): the sockets fn creates belong to that
// program, not to accel.test. The thread stays locked and so ends with fn:
// no other goroutine ever runs under the name. t fails after fn when fn failed.
func asProgram(t *testing.T, name string, fn func()) {
	t.Helper()
	done := make(chan struct{})
	go func() {
		defer close(done)
		runtime.LockOSThread()
		b := append([]byte(name), 0)
		if err := unix.Prctl(unix.PR_SET_NAME, uintptr(unsafe.Pointer(&b[0])), 0, 0, 0); err != nil {
			t.Errorf("name the thread %s: %v", name, err)
			return
		}
		fn()
	}()
	<-done
	if t.Failed() {
		t.FailNow()
	}
}

// learnedProgram is the agent's entry for the program called comm, if any.
func learnedProgram(t *testing.T, a *Agent, comm string) (LearnedProgram, bool) {
	t.Helper()
	for _, p := range stats(t, a).LearnedPrograms {
		if p.Comm == comm {
			return p, true
		}
	}
	return LearnedProgram{}, false
}

// keptOff requires that client and server form a connection left to TCP
// for reason, counted once, with neither socket in the SOCKMAP.
func keptOff(t *testing.T, a *Agent, before Stats, reason string, client, server net.Conn) {
	t.Helper()
	requireOutsideSockhash(t, a, client, server)
	if d := stats(t, a).Sub(before); d.PassthroughConnections[reason] != 1 {
		t.Fatalf("the connection was not left to TCP as %s once: %v", reason, nonZero(d.PassthroughConnections))
	}
}

// A program that showed, on one port, that it reads with MSG_WAITALL gets
// plain TCP on its first connection on any other port, as server and as
// client, also under the next agent, which adopts what was learned; another
// program on the same ports is still paired. The teacher is a thread named
// mw-teacher, so this agent never learns accel.test itself.
func TestPrivilegedLearnedProgramAnyPort(t *testing.T) {
	testutil.RequirePrivileged(t)
	const teacher, reason = "mw-teacher", "waitall_reader"
	a := startAgent(t, Config{LearnFromSyscalls: true})
	asProgram(t, teacher, func() {
		lnA := mustListen(t, "127.0.0.1:0")
		defer lnA.Close()
		c, s := pairedConn(t, a, lnA, dialer(lnA.Addr().String()))
		defer c.Close()
		defer s.Close()
		onFD(t, c, func(fd int) { unix.Recvfrom(fd, make([]byte, 10), unix.MSG_WAITALL|unix.MSG_DONTWAIT) })
	})
	if p, ok := learnedProgram(t, a, teacher); !ok || p.Reason != reason {
		t.Fatalf("the agent did not learn %s as %s: %+v", teacher, reason, stats(t, a).LearnedPrograms)
	}
	if _, ok := learnedProgram(t, a, "accel.test"); ok {
		t.Fatal("the agent learned accel.test, which only dialled and accepted")
	}

	// As server: the teacher's listener on a fresh port, another program dials.
	var lnB net.Listener
	asProgram(t, teacher, func() { lnB = mustListen(t, "127.0.0.1:0") })
	before := stats(t, a)
	client, server := acceptedConn(t, lnB)
	keptOff(t, a, before, reason, client, server)
	checkWaitall(t, server, client)
	portB := lnB.Addr().String()
	client.Close()
	server.Close()
	lnB.Close()

	// Another program on that port is paired: the port was not learned.
	lnB2 := mustListen(t, portB)
	defer lnB2.Close()
	c, s := pairedConn(t, a, lnB2, dialer(portB))
	c.Close()
	s.Close()

	// As client: the teacher dials another program's listener on a fresh port.
	lnC := mustListen(t, "127.0.0.1:0")
	defer lnC.Close()
	before = stats(t, a)
	asProgram(t, teacher, func() { client, server = acceptedConn(t, lnC) })
	keptOff(t, a, before, reason, client, server)
	checkWaitall(t, client, server)
	if p, _ := learnedProgram(t, a, teacher); p.KeptOffConnections != 2 {
		t.Fatalf("%s: %d connections kept off, want 2", teacher, p.KeptOffConnections)
	}

	// The next agent adopts what was learned: status says it from the pins,
	// and the teacher's first connection on yet another port stays on TCP.
	cfg := a.cfg
	if err := a.Close(); err != nil {
		t.Fatal(err)
	}
	pinned, err := ReadPinnedStats(cfg.PinDir)
	if err != nil {
		t.Fatal(err)
	}
	if !slices.ContainsFunc(pinned.LearnedPrograms, func(p LearnedProgram) bool { return p.Comm == teacher && p.Reason == reason }) {
		t.Fatalf("status between agents does not name %s: %+v", teacher, pinned.LearnedPrograms)
	}
	b := startAgent(t, cfg)
	if !b.Adopted {
		t.Fatal("the second agent did not adopt the first one's pins")
	}
	lnD := mustListen(t, "127.0.0.1:0")
	defer lnD.Close()
	before = stats(t, b)
	asProgram(t, teacher, func() { client, server = acceptedConn(t, lnD) })
	keptOff(t, b, before, reason, client, server)
	checkWaitall(t, client, server)
	c, s = pairedConn(t, b, lnD, dialer(lnD.Addr().String()))
	c.Close()
	s.Close()

	// Forgotten (meshwarp forget): the teacher's next connection is paired.
	res, err := Forget(cfg.PinDir, ForgetRequest{Programs: []string{teacher}})
	if err != nil || !slices.Equal(res.Programs, []string{teacher}) || len(res.NotLearned) != 0 {
		t.Fatalf("forget %s: %+v, %v", teacher, res, err)
	}
	if _, ok := learnedProgram(t, b, teacher); ok {
		t.Fatalf("%s still learned after forget", teacher)
	}
	asProgram(t, teacher, func() {
		c, s := pairedConn(t, b, lnD, dialer(lnD.Addr().String()))
		c.Close()
		s.Close()
	})
	if res, err := Forget(cfg.PinDir, ForgetRequest{Programs: []string{teacher}}); err != nil || !slices.Equal(res.NotLearned, []string{"program " + teacher}) {
		t.Fatalf("forgetting %s twice: %+v, %v (want it named as not learned)", teacher, res, err)
	}
}

// A socket accepted from a listener older than the agent has a record that
// names no program (pairing and observation made it). An option that
// teaches the agent on such a socket learns the calling program, never a
// nameless one, which every such socket would then match: later connections
// from another old listener are still paired.
func TestPrivilegedLearnedProgramNeverNameless(t *testing.T) {
	testutil.RequirePrivileged(t)
	cg := testutil.EnterCgroup(t)
	old := mustListen(t, "127.0.0.1:0") // before the agent: no program recorded
	defer old.Close()
	other := mustListen(t, "127.0.0.1:0")
	defer other.Close()
	a := startAgent(t, Config{CgroupPath: cg})
	t.Cleanup(func() { forgetPrograms(t, a) })

	c, s := pairedConn(t, a, old, dialer(old.Addr().String()))
	defer c.Close()
	defer s.Close()
	if _, err := c.Write([]byte("redirected")); err != nil {
		t.Fatal(err)
	}
	if _, err := io.ReadFull(s, make([]byte, len("redirected"))); err != nil {
		t.Fatal(err)
	}
	// A thread named otherwise: this test program must stay unlearned.
	asProgram(t, "mw-teacher", func() {
		onFD(t, s, func(fd int) {
			if err := unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_RCVLOWAT, 2); err != nil {
				t.Error(err)
			}
		})
	})
	learned := stats(t, a).LearnedPrograms
	if !slices.ContainsFunc(learned, func(p LearnedProgram) bool { return p.Comm == "mw-teacher" }) {
		t.Fatalf("SO_RCVLOWAT after redirected bytes did not teach the calling program: %+v", learned)
	}
	for _, p := range learned {
		if p.Comm == "" {
			t.Fatalf("the agent learned a nameless program: %+v", learned)
		}
	}
	// Another old listener's connection: its accepted socket names no
	// program either, and is paired.
	c2, s2 := pairedConn(t, a, other, dialer(other.Addr().String()))
	c2.Close()
	s2.Close()
}
