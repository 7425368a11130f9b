// SPDX-License-Identifier: Apache-2.0

package accel

import (
	"net"
	"os"
	"testing"
	"time"

	"github.com/meshwarp/meshwarp/internal/testutil"
)

// startAgent is testutil.StartAgent for cfg: by default a throwaway agent
// on a throwaway cgroup that this test process has joined, uninstalled on cleanup.
func startAgent(t testing.TB, cfg Config) *Agent {
	t.Helper()
	// Under emulation (scripts/vmtest.sh) a first handshake across namespaces
	// can outlast the default unpaired timeout, and a test that needs its
	// connection paired would refuse to run; tests about the timeout set their own.
	if cfg.UnpairedTimeout == 0 && os.Getenv("MESHWARP_VM_KERNEL") == "1" {
		cfg.UnpairedTimeout = 200 * time.Millisecond
	}
	return testutil.StartAgent(t, &cfg.CgroupPath, &cfg.PinDir, func() (*Agent, error) { return Start(cfg, nil) })
}

func stats(t testing.TB, a *Agent) Stats {
	t.Helper()
	s, err := a.Stats()
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// integrityOpts: 200 concurrent connections, random payloads 1 B..64 KB.
var integrityOpts = testutil.IntegrityOptions{Conns: 200, Messages: 6, MaxSize: 64 << 10, Seed: 42}

func TestPrivilegedIntegrityLoopback(t *testing.T) {
	testutil.RequirePrivileged(t)
	cases := []struct {
		name, listen, dial string
	}{
		{"ipv4", "tcp4:127.0.0.1:0", "127.0.0.1"},
		{"ipv6", "tcp6:[::1]:0", "::1"},
		{"v4-mapped", "tcp:[::]:0", "127.0.0.1"}, // dual-stack listener, IPv4 client
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			forEachAgent(t, func(t *testing.T, a *Agent) {
				network, addr, _ := cutNet(tc.listen)
				ln, err := net.Listen(network, addr)
				if err != nil {
					t.Fatal(err)
				}
				srv := testutil.ServeEcho(ln)
				defer srv.Close()
				port := ln.Addr().(*net.TCPAddr).Port
				target := net.JoinHostPort(tc.dial, itoa(port))
				res := testutil.CheckIntegrity(func() (net.Conn, error) { return net.Dial("tcp", target) }, integrityOpts)
				if err := res.Err(); err != nil {
					t.Fatal(err)
				}
				if a == nil {
					return
				}
				s := stats(t, a)
				t.Logf("paired sockets %d, redirected %d msgs / %d bytes, passthrough %v", s.PairedSockets, s.RedirectedMessages, s.RedirectedBytes, s.PassthroughConnections)
				requireShare(t, s, integrityOpts.Conns, 0.95)
				waitNoAcceleratedSockets(t, a)
			})
		})
	}
}

// requireShare fails unless each of conns connections was paired or lost
// its pairing race (no_peer, unpaired_timeout: a busy machine loses some,
// see testutil.CheckPaired), a clear majority was paired, and at least frac
// of the bytes sent on the connections that did not lose a race were
// redirected: a regression to mostly-TCP fails, and so does one that leaves
// any connection or byte to TCP for another reason, not only one to no
// acceleration at all.
func requireShare(t *testing.T, d Stats, conns int, frac float64) {
	t.Helper()
	if err := testutil.CheckPaired(d.PairedSockets/2, uint64(conns), d.PassthroughConnections); err != nil {
		t.Fatalf("acceleration share too low: %v", err)
	}
	raced := testutil.RaceLost(d.PassthroughBytesByReason)
	total := float64(d.RedirectedBytes + d.PassthroughBytes - raced)
	if total == 0 || float64(d.RedirectedBytes) < frac*total {
		t.Fatalf("acceleration share too low: %d of %.0f bytes redirected (want >= %.0f%%; %d more bytes went by TCP on connections that lost their pairing race); left to TCP: %v",
			d.RedirectedBytes, total, frac*100, raced, nonZero(d.PassthroughBytesByReason))
	}
}

// waitNoAcceleratedSockets polls until every paired socket has been seen
// closing (TCP state callbacks run as the FIN handshakes complete).
func waitNoAcceleratedSockets(t *testing.T, a *Agent) {
	t.Helper()
	waitAcceleratedSockets(t, a, 0)
}

// waitAcceleratedSockets polls until the accelerated_sockets gauge is want.
// The gauge is clamped at 0, so a socket counted gone twice shows only as a
// gauge below a want of open sockets.
func waitAcceleratedSockets(t *testing.T, a *Agent, want uint64) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		s := stats(t, a)
		if s.AcceleratedSockets == want {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("accelerated_sockets gauge stuck at %d, want %d once the other connections closed (paired %d, left %d)",
				s.AcceleratedSockets, want, s.PairedSockets, s.LeftSockets)
		}
		time.Sleep(20 * time.Millisecond) // polling interval, not synchronisation
	}
}
