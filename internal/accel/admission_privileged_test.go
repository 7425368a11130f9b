// SPDX-License-Identifier: Apache-2.0

package accel

import (
	"bytes"
	"errors"
	"fmt"
	"net"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/meshwarp/meshwarp/internal/testutil"
)

// Admission: a socket joins the data path only with evidence of a local
// peer: a listener of the cgroup received its own SYN (same source address
// and sequence number; NAT may have remapped the port). A client outside
// the cgroup, connecting to a cgroup listener from the same address while a
// cgroup socket's connect to a server outside the cgroup is in flight, must
// not lend its SYN to that socket: the cgroup socket stays out of the
// SOCKMAP, and neither connection shows a difference: FIONREAD, reads and
// writes are plain TCP's on all four sockets.

func rawListen(t *testing.T, backlog int) (fd int, addr *unix.SockaddrInet4) {
	t.Helper()
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Close(fd) })
	if err := unix.Bind(fd, &unix.SockaddrInet4{Addr: [4]byte{127, 0, 0, 1}}); err != nil {
		t.Fatal(err)
	}
	if err := unix.Listen(fd, backlog); err != nil {
		t.Fatal(err)
	}
	sa, err := unix.Getsockname(fd)
	if err != nil {
		t.Fatal(err)
	}
	return fd, sa.(*unix.SockaddrInet4)
}

func rawSocket(t *testing.T) int {
	t.Helper()
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Close(fd) })
	return fd
}

// fdExchange writes n bytes on w; r must report them with FIONREAD and read them.
func fdExchange(w, r int, n int) error {
	msg := bytes.Repeat([]byte{'a'}, n)
	if _, err := unix.Write(w, msg); err != nil {
		return fmt.Errorf("write: %w", err)
	}
	deadline := time.Now().Add(hangGuard)
	for {
		got, err := unix.IoctlGetInt(r, unix.SIOCINQ)
		if err != nil {
			return err
		}
		if got == n {
			break
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("FIONREAD = %d while %d bytes wait", got, n)
		}
		time.Sleep(time.Millisecond) // polling interval
	}
	buf := make([]byte, n)
	for off := 0; off < n; {
		m, err := unix.Read(r, buf[off:])
		if err != nil || m == 0 {
			return fmt.Errorf("read: %d, %v", m, err)
		}
		off += m
	}
	return nil
}

func waitFD(t *testing.T, fd int, events int16) {
	t.Helper()
	if rev, err := testutil.Poll(fd, events, hangGuard); rev == 0 || err != nil {
		t.Fatalf("poll(%#x): %#x after %v, %v", events, rev, hangGuard, err)
	}
}

func TestPrivilegedAdmissionOutsideClientDuringConnect(t *testing.T) {
	testutil.RequirePrivileged(t)
	testutil.WithAndWithout(t, func(t *testing.T, withAgent bool) {
		// Outside the cgroup (created before it is entered): a server
		// whose accept queue is full, so a SYN to it is dropped and
		// retransmitted after 1 s; a client socket.
		srv, srvAddr := rawListen(t, 0)
		filler := rawSocket(t)
		if err := unix.Connect(filler, srvAddr); err != nil {
			t.Fatal(err)
		}
		outsideClient := rawSocket(t)
		var a *Agent
		var before Stats
		if withAgent {
			a = startAgent(t, Config{})
			before = stats(t, a)
		}
		ln := mustListen(t, "127.0.0.1:0") // in the cgroup
		defer ln.Close()
		lnAddr := ln.Addr().(*net.TCPAddr)

		// A socket of the cgroup connects to the outside server: its SYN waits.
		inside := rawSocket(t)
		unix.SetNonblock(inside, true)
		if err := unix.Connect(inside, srvAddr); !errors.Is(err, unix.EINPROGRESS) {
			t.Fatalf("connect: %v", err)
		}
		// Shortly before the retransmission, the outside client connects
		// to the cgroup's listener from the same address.
		time.Sleep(300 * time.Millisecond) // places the SYN inside the in-flight connect's window; not synchronisation
		if err := unix.Connect(outsideClient, &unix.SockaddrInet4{Port: lnAddr.Port, Addr: [4]byte{127, 0, 0, 1}}); err != nil {
			t.Fatal(err)
		}
		accepted, err := ln.Accept()
		if err != nil {
			t.Fatal(err)
		}
		defer accepted.Close()
		// Make room at the outside server: the retransmitted SYN is answered.
		f, _, err := unix.Accept(srv)
		if err != nil {
			t.Fatal(err)
		}
		unix.Close(f)
		waitFD(t, inside, unix.POLLOUT)
		if v, err := unix.GetsockoptInt(inside, unix.SOL_SOCKET, unix.SO_ERROR); err != nil || v != 0 {
			t.Fatalf("connect to the outside server: %v %v", v, err)
		}
		unix.SetNonblock(inside, false)
		waitFD(t, srv, unix.POLLIN)
		outsideServer, _, err := unix.Accept(srv)
		if err != nil {
			t.Fatal(err)
		}
		defer unix.Close(outsideServer)

		// The outside server speaks first, then each side answers; the
		// outside client and the cgroup's accepted socket likewise.
		var accFD int
		onFD(t, accepted, func(fd int) { accFD = fd; unix.SetNonblock(fd, false) })
		for _, step := range []struct {
			name string
			w, r int
		}{
			{"outside server -> cgroup client", outsideServer, inside},
			{"cgroup client -> outside server", inside, outsideServer},
			{"outside client -> cgroup server", outsideClient, accFD},
			{"cgroup server -> outside client", accFD, outsideClient},
		} {
			if err := fdExchange(step.w, step.r, 200); err != nil {
				t.Fatalf("%s: %v", step.name, err)
			}
		}
		onFD(t, accepted, func(fd int) { unix.SetNonblock(fd, true) })
		if a == nil {
			return
		}
		d := stats(t, a).Sub(before)
		if d.RedirectedMessages != 0 {
			t.Fatalf("%d messages redirected between sockets without a local peer", d.RedirectedMessages)
		}
		// The cgroup's client has no local peer: it is kept out of the
		// SOCKMAP from the start (no_local_peer), never let in and taken
		// out again (no_peer, unpaired_timeout).
		if got := nonZero(d.RemovedSockets); len(got) != 1 || got["no_local_peer"] != 1 {
			t.Fatalf("sockets kept off or taken out of the SOCKMAP: %v, want only the cgroup's client, kept off as no_local_peer", got)
		}
		t.Logf("left to TCP: %v; removed: %v", nonZero(d.PassthroughConnections), nonZero(d.RemovedSockets))
	})
}
