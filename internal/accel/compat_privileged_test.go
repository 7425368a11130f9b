// SPDX-License-Identifier: Apache-2.0

package accel

import (
	"bytes"
	"io"
	"net"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/meshwarp/meshwarp/internal/testutil"
)

// The socket API compatibility suite: each row is something applications
// do with a socket option the redirect's receive or send path does not
// honour (tcp_bpf), run on three moments the option can be set: before
// connect() (the first connection of a fresh listener), right after
// accept/connect before any byte, and after a
// request/response went through (redirected, with the agent). The same
// assertions run without the agent and with it.

// compatMoment is the point in a connection's life a row runs at.
type compatMoment string

const (
	// momentFirst: the first connection of a fresh listener; a row's option
	// is set on the client before connect() (the client reads, or writes
	// for onClient rows).
	momentFirst compatMoment = "first"
	// momentAccepted: the option is set on the connected socket before any
	// byte (option rows only).
	momentAccepted compatMoment = "accepted"
	// momentPaired: after a request/response went through (redirected,
	// with the agent).
	momentPaired compatMoment = "paired"
	// momentSwitched: after a small-message stream moved the connection to
	// TCP mid-stream (small_stream, with the agent).
	momentSwitched compatMoment = "switched"
	// momentBackpressure: after the writer filled the reader's buffers
	// (backpressure, with the agent) and the reader drained them.
	momentBackpressure compatMoment = "backpressure"
)

var compatMoments = []compatMoment{momentFirst, momentAccepted, momentPaired, momentSwitched, momentBackpressure}

type compatRow struct {
	name string
	// reason is the passthrough reason the agent counts for an option row.
	reason string
	// onClient: the option belongs on the writing (connecting) side, else on the reader (accepted side).
	onClient bool
	// level, opt, val: the setsockopt(2) an option row is about (opt 0: a row of calls).
	level, opt, val int
	// check asserts plain TCP behaviour: w writes, r reads. With limited it
	// asserts what the application sees instead on a kernel-limited moment.
	check func(t *testing.T, w, r net.Conn, limited bool)
	// limitedAt lists the moments at which, with the agent, the guarantee
	// cannot be kept (kernel-limited); limit says what the application sees
	// then and which kernel code prevents more (docs/ARCHITECTURE.md).
	limitedAt []compatMoment
	limit     string
	// repeat runs the row on that many connections (races).
	repeat int
	// readsFIONREAD: the check waits on FIONREAD, which counts redirected
	// bytes only where tcp_bpf has its ioctl (probe.FeatureFIONREAD).
	readsFIONREAD bool
}

func setInt(level, opt, v int) func(t *testing.T, fd int) {
	return func(t *testing.T, fd int) {
		t.Helper()
		if err := unix.SetsockoptInt(fd, level, opt, v); err != nil {
			t.Fatalf("setsockopt(%d, %d, %d): %v", level, opt, v, err)
		}
	}
}

func (row compatRow) hasOption() bool { return row.opt != 0 }

func (row compatRow) set(t *testing.T, fd int) { setInt(row.level, row.opt, row.val)(t, fd) }

// kernelRefuses is the error this kernel gives row's option on a TCP socket
// (nil when it has it): Linux 6.1 has no SO_PEEK_OFF for TCP (EOPNOTSUPP).
func (row compatRow) kernelRefuses(t *testing.T) error {
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_STREAM, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(fd)
	return unix.SetsockoptInt(fd, row.level, row.opt, row.val)
}

// waitReadable polls r until poll() reports it readable; false after timeout.
func waitReadable(t *testing.T, r net.Conn, timeout time.Duration) bool {
	t.Helper()
	ready := false
	onFD(t, r, func(fd int) {
		rev, err := testutil.Poll(fd, unix.POLLIN, timeout)
		ready = err == nil && rev&unix.POLLIN != 0
	})
	return ready
}

// recvmsgCmsgs reads once (blocking up to hangGuard) and returns the data and control messages.
func recvmsgCmsgs(t *testing.T, r net.Conn, size int) ([]byte, []unix.SocketControlMessage) {
	t.Helper()
	if !waitReadable(t, r, hangGuard) {
		t.Fatalf("nothing to read after %v", hangGuard)
	}
	buf, oob := make([]byte, size), make([]byte, 512)
	var n, oobn int
	var err error
	onFD(t, r, func(fd int) { n, oobn, _, _, err = unix.Recvmsg(fd, buf, oob, 0) })
	if err != nil {
		t.Fatalf("recvmsg: %v", err)
	}
	msgs, err := unix.ParseSocketControlMessage(oob[:oobn])
	if err != nil {
		t.Fatalf("parse control messages: %v", err)
	}
	return buf[:n], msgs
}

func hasCmsg(msgs []unix.SocketControlMessage, level, typ int32) bool {
	for _, m := range msgs {
		if m.Header.Level == level && m.Header.Type == typ {
			return true
		}
	}
	return false
}

func mustWrite(t *testing.T, c net.Conn, b []byte) {
	t.Helper()
	if _, err := c.Write(b); err != nil {
		t.Fatalf("write: %v", err)
	}
}

var compatRows = []compatRow{
	{
		name: "SO_PEEK_OFF", reason: "peek_off",
		level: unix.SOL_SOCKET, opt: unix.SO_PEEK_OFF, val: 0,
		check: func(t *testing.T, w, r net.Conn, _ bool) {
			mustWrite(t, w, []byte("abcdef"))
			if !waitReadable(t, r, hangGuard) {
				t.Fatal("nothing to read")
			}
			var got []byte
			for len(got) < 6 {
				b := make([]byte, 3)
				var n int
				var err error
				onFD(t, r, func(fd int) { n, _, err = unix.Recvfrom(fd, b, unix.MSG_PEEK) })
				if err != nil || n == 0 {
					t.Fatalf("peek: %d, %v", n, err)
				}
				got = append(got, b[:n]...)
				if len(got) > 6 {
					break
				}
			}
			if string(got) != "abcdef" {
				t.Fatalf("peeks with SO_PEEK_OFF returned %q, want %q (each peek continues where the last ended)", got, "abcdef")
			}
		},
	},
	{
		name: "TCP_INQ", reason: "tcp_inq",
		level: unix.IPPROTO_TCP, opt: unix.TCP_INQ, val: 1,
		check: func(t *testing.T, w, r net.Conn, _ bool) {
			mustWrite(t, w, bytes.Repeat([]byte{'i'}, 100))
			_, msgs := recvmsgCmsgs(t, r, 100)
			if !hasCmsg(msgs, unix.SOL_TCP, unix.TCP_CM_INQ) {
				t.Fatalf("no TCP_CM_INQ control message with TCP_INQ set (got %d control messages)", len(msgs))
			}
		},
	},
	{
		name: "SO_TIMESTAMPNS", reason: "timestamp",
		level: unix.SOL_SOCKET, opt: unix.SO_TIMESTAMPNS, val: 1,
		check: func(t *testing.T, w, r net.Conn, _ bool) {
			// The kernel turns receive timestamping on with a deferred
			// static key: the first segments may have none, later ones do.
			deadline := time.Now().Add(hangGuard)
			for time.Now().Before(deadline) {
				mustWrite(t, w, bytes.Repeat([]byte{'t'}, 100))
				_, msgs := recvmsgCmsgs(t, r, 100)
				if hasCmsg(msgs, unix.SOL_SOCKET, unix.SCM_TIMESTAMPNS) {
					return
				}
			}
			t.Fatalf("no SCM_TIMESTAMPNS control message within %v with SO_TIMESTAMPNS set", hangGuard)
		},
	},
	{
		name: "SO_RCVLOWAT", reason: "rcvlowat",
		level: unix.SOL_SOCKET, opt: unix.SO_RCVLOWAT, val: 3000,
		check: func(t *testing.T, w, r net.Conn, _ bool) {
			mustWrite(t, w, bytes.Repeat([]byte{'l'}, 1000))
			// TCP reports readable only at the mark; give the bytes time to arrive.
			if waitReadable(t, r, 200*time.Millisecond) {
				t.Fatal("readable with 1000 of SO_RCVLOWAT 3000 bytes")
			}
			mustWrite(t, w, bytes.Repeat([]byte{'l'}, 2000))
			if !waitReadable(t, r, hangGuard) {
				t.Fatal("not readable with SO_RCVLOWAT 3000 bytes waiting")
			}
		},
	},
	{
		name: "MSG_ZEROCOPY", reason: "zerocopy", onClient: true,
		level: unix.SOL_SOCKET, opt: unix.SO_ZEROCOPY, val: 1,
		check: func(t *testing.T, w, r net.Conn, _ bool) {
			payload := bytes.Repeat([]byte{'z'}, 8192)
			onFD(t, w, func(fd int) {
				if err := unix.Sendmsg(fd, payload, nil, nil, unix.MSG_ZEROCOPY); err != nil {
					t.Fatalf("send(MSG_ZEROCOPY): %v", err)
				}
			})
			// The completion reaches the sender's error queue (POLLERR).
			var got bool
			onFD(t, w, func(fd int) {
				deadline := time.Now().Add(hangGuard)
				for time.Now().Before(deadline) {
					if rev, _ := testutil.Poll(fd, 0, 100*time.Millisecond); rev&unix.POLLERR != 0 {
						break
					}
				}
				oob := make([]byte, 256)
				_, oobn, _, _, err := unix.Recvmsg(fd, nil, oob, unix.MSG_ERRQUEUE|unix.MSG_DONTWAIT)
				got = err == nil && oobn > 0
			})
			if !got {
				t.Fatalf("no MSG_ZEROCOPY completion on the error queue within %v", hangGuard)
			}
			if _, err := io.ReadFull(r, make([]byte, len(payload))); err != nil {
				t.Fatalf("read: %v", err)
			}
		},
	},
}

// acceptedPair dials ln and returns both ends (paired or not).
func acceptedPair(t testing.TB, ln net.Listener, dial func() (net.Conn, error)) (client, server net.Conn) {
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
	if server = <-acc; server == nil {
		t.Fatal("accept failed")
	}
	t.Cleanup(func() { server.Close() })
	return client, server
}
