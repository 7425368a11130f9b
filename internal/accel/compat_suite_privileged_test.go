// SPDX-License-Identifier: Apache-2.0

package accel

import (
	"errors"
	"fmt"
	"io"
	"net"
	"runtime"
	"slices"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/meshwarp/meshwarp/internal/probe"
	"github.com/meshwarp/meshwarp/internal/testutil"
)

// The socket API compatibility suite, runner and call rows: every row (the
// option rows of compat_privileged_test.go and the call rows here) runs at
// every moment of a connection's life, without the agent and with it, with
// the same assertions. docs/ARCHITECTURE.md "What an application can see"
// is generated from these rows (TestCompatTableInDocs).

// blockingRecv runs recvfrom on c's descriptor in blocking mode on a thread
// of its own, bounded by SO_RCVTIMEO (hangGuard).
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
			tv := unix.NsecToTimeval(hangGuard.Nanoseconds())
			unix.SetsockoptTimeval(fd, unix.SOL_SOCKET, unix.SO_RCVTIMEO, &tv)
			unix.SetNonblock(fd, false)
			r.n, _, r.err = unix.Recvfrom(fd, buf, flags)
			for errors.Is(r.err, unix.EINTR) { // a signal, not the socket: call again, as applications do
				r.n, _, r.err = unix.Recvfrom(fd, buf, flags)
			}
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

// awaitInqOf fails unless FIONREAD reaches want (within hangGuard).
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

// readUntilEOF reads r to EOF (hangGuard at most) and returns what it read.
func readUntilEOF(t *testing.T, r net.Conn) ([]byte, error) {
	t.Helper()
	r.SetReadDeadline(time.Now().Add(hangGuard))
	defer r.SetReadDeadline(time.Time{})
	return io.ReadAll(r)
}

// epollReader reads r the way an event loop does: it waits for events on
// an epoll instance (edge-triggered or level-triggered, with EPOLLRDHUP),
// and on each readiness reads 4 KB at a time until a short read, which
// it takes as "drained" unless EPOLLRDHUP was reported (nginx's
// ngx_unix_recv does exactly this). It returns the bytes
// read before the peer's FIN and whether EPOLLRDHUP was reported; a wait
// of hangGuard without an event is a stall.
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
			n, err := unix.EpollWait(ep, evs, int(hangGuard.Milliseconds()))
			if errors.Is(err, unix.EINTR) {
				continue
			}
			if err != nil {
				t.Fatalf("epoll_wait: %v", err)
			}
			if n == 0 {
				t.Fatalf("stalled: no event for %v after %d bytes (FIONREAD %d)", hangGuard, len(got), inqOrMinus(fd))
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
					// EOF read before an event told of it (the FIN came
					// while this loop read): epoll must report it now.
					if !rdhup {
						n, err := unix.EpollWait(ep, evs, 0)
						for errors.Is(err, unix.EINTR) {
							n, err = unix.EpollWait(ep, evs, 0)
						}
						if n == 1 && evs[0].Events&unix.EPOLLRDHUP != 0 {
							rdhup = true
						}
					}
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

// allCompatRows is the whole table: option rows, then call rows.
func allCompatRows() []compatRow { return slices.Concat(compatRows, callRows) }

// moments returns the moments a row runs at: option rows also at
// "accepted" (option set before any byte).
func (row compatRow) moments() []compatMoment {
	if row.hasOption() {
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
		deadline := time.Now().Add(hangGuard)
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
		t.Fatalf("the writer never blocked in %v", hangGuard)
	})
	if _, err := io.ReadFull(server, make([]byte, total)); err != nil {
		t.Fatal(err)
	}
	pingPong(t, client, server)
}

// unlearnedListener listens on a loopback port the agent has not learned
// for an earlier row (a port is reused once its listener closed, and a
// learned port keeps later connections on TCP by design).
func unlearnedListener(t *testing.T, a *Agent) net.Listener {
	t.Helper()
	for range 100 {
		ln := mustListen(t, "127.0.0.1:0")
		if a == nil {
			return ln
		}
		port := uint32(ln.Addr().(*net.TCPAddr).Port)
		var reason uint32
		if a.objs.MwUnfitLport.Lookup(&port, &reason) != nil && a.objs.MwUnfitRport.Lookup(&port, &reason) != nil {
			return ln
		}
		defer ln.Close() // held until a fresh port is found, so it is not handed out again
	}
	t.Fatal("no loopback port the agent has not learned in 100 tries")
	return nil
}

// compatConn brings a connection to moment m and returns the writer and
// reader of row; with the agent, it requires that the moment happened
// (paired, switched, backpressure).
func compatConn(t *testing.T, a *Agent, row compatRow, m compatMoment) (w, r net.Conn) {
	t.Helper()
	ln := unlearnedListener(t, a)
	t.Cleanup(func() { ln.Close() })
	d := net.Dialer{}
	if m == momentFirst && row.hasOption() {
		d.Control = func(_, _ string, rc syscall.RawConn) error {
			return rc.Control(func(fd uintptr) { row.set(t, int(fd)) })
		}
	}
	dial := func() (net.Conn, error) { return d.Dial("tcp", ln.Addr().String()) }
	var client, server net.Conn
	if m == momentFirst && row.hasOption() || m == momentAccepted {
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
	if m == momentFirst && row.hasOption() {
		// The option is on the client: it writes (onClient) or reads.
		if !row.onClient {
			w, r = r, w
		}
		return w, r
	}
	if row.hasOption() {
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
	fionreadOff := probe.HaveMsgTotLen()
	forEachAgent(t, func(t *testing.T, a *Agent) {
		for _, row := range allCompatRows() {
			if a != nil && row.readsFIONREAD && fionreadOff != nil {
				// A limitation `meshwarp probe` names on this kernel (6.1).
				t.Logf("%s: left out with the agent here: %s is off (%v)", row.name, probe.FeatureFIONREAD, fionreadOff)
				continue
			}
			for _, m := range row.moments() {
				t.Run(fmt.Sprintf("%s/%s", row.name, m), func(t *testing.T) {
					for range max(row.repeat, 1) {
						var before Stats
						if a != nil {
							before = stats(t, a)
						}
						if row.hasOption() {
							if refused := row.kernelRefuses(t); refused != nil {
								// Nothing for the redirect to ignore: the application
								// must get the kernel's own refusal, and a working stream.
								compatRefused(t, a, row, m, refused)
								return
							}
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
				if a != nil {
					forgetPrograms(t, a)
				}
			}
		}
	})
}

// forgetPrograms empties the agent's learned programs. Every row's
// connections come from this one test program, and a row set after bytes
// were redirected teaches it (on purpose, on its own fresh ports): the next
// row would find it learned instead of pairing.
func forgetPrograms(t *testing.T, a *Agent) {
	t.Helper()
	learned, err := readLearnedPrograms(a.objs.MwUnfitProgs)
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, p := range learned {
		names = append(names, p.Comm)
	}
	if _, err := Forget(a.cfg.PinDir, ForgetRequest{Programs: names}); err != nil {
		t.Fatal(err)
	}
}

// readOOB waits for the peer's FIN, takes the urgent byte if there is one
// (recv(MSG_OOB)), then reads the normal data to EOF.
func readOOB(t *testing.T, r net.Conn) (urgent, data string) {
	t.Helper()
	onFD(t, r, func(fd int) {
		if rev, _ := testutil.Poll(fd, unix.POLLRDHUP, hangGuard); rev == 0 {
			t.Fatalf("no FIN from the writer in %v", hangGuard)
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

// compatRefused: on a kernel without row's option, setting it at moment m
// gives the same error with the agent as without, and the stream stays intact.
func compatRefused(t *testing.T, a *Agent, row compatRow, m compatMoment, want error) {
	t.Helper()
	ln := mustListen(t, "127.0.0.1:0")
	t.Cleanup(func() { ln.Close() })
	dial := func() (net.Conn, error) { return net.Dial("tcp", ln.Addr().String()) }
	var w, r net.Conn
	if m == momentFirst || m == momentAccepted {
		w, r = acceptedPair(t, ln, dial)
	} else {
		w, r = pairedConn(t, a, ln, dial)
	}
	target := r
	if row.onClient || m == momentFirst {
		target = w
	}
	onFD(t, target, func(fd int) {
		if err := unix.SetsockoptInt(fd, row.level, row.opt, row.val); !errors.Is(err, want) {
			t.Errorf("setsockopt %s on a connected socket: %v; the kernel says %v on a plain one", row.name, err, want)
		}
	})
	for _, dir := range [][2]net.Conn{{w, r}, {r, w}} {
		mustWrite(t, dir[0], []byte("ping"))
		if _, err := io.ReadFull(dir[1], make([]byte, 4)); err != nil {
			t.Fatalf("read after a refused %s: %v", row.name, err)
		}
	}
}
