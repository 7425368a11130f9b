// SPDX-License-Identifier: Apache-2.0

package lab

import (
	"maps"
	"net"
	"net/netip"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/meshwarp/meshwarp/internal/accel"
	"github.com/meshwarp/meshwarp/internal/testutil"
	"github.com/meshwarp/meshwarp/internal/testutil/agenttest"
)

// The acceleration of the three mesh hops on the topology users run: the
// lab's Istio capture and HAProxy sidecars (uid 1337, inbound connections
// from 127.0.0.6):
//
//	client pod                                  server pod
//	app --REDIRECT--> haproxy :15001 ==veth==> REDIRECT :15006 haproxy --127.0.0.6--> app
//	    app_to_sidecar        sidecar_to_sidecar                      sidecar_to_app
//
// The apps are the test's own echo servers in the server pod (an IPv4
// listener, and a dual-stack one whose IPv4 peers arrive v4-mapped); the
// sidecars route them by original destination port. Every case runs with
// and without the agent, with the same assertions on the bytes.

// istioIntegrityOpts: 64 concurrent connections, random payloads 1 B..64 KB.
var istioIntegrityOpts = testutil.IntegrityOptions{Conns: 64, Messages: 6, MaxSize: 64 << 10, Seed: 1337}

// sourceRecorder counts the source addresses of accepted connections.
type sourceRecorder struct {
	net.Listener
	mu      sync.Mutex
	sources map[netip.Addr]int
}

func (l *sourceRecorder) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err == nil {
		if ap, perr := netip.ParseAddrPort(c.RemoteAddr().String()); perr == nil {
			l.mu.Lock()
			l.sources[ap.Addr().Unmap()]++
			l.mu.Unlock()
		}
	}
	return c, err
}

func (l *sourceRecorder) snapshot() map[netip.Addr]int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return maps.Clone(l.sources)
}

func TestPrivilegedAcceleratedHops(t *testing.T) {
	testutil.RequirePrivileged(t)
	l := upForTest(t, Options{Pods: 2, Capture: true})
	client, server := l.Client(), l.Server()
	// The test's sockets belong to the lab cgroup, like the lab's own apps.
	testutil.JoinCgroup(t, l.CgroupPath())
	clientNs, serverNs := testutil.OpenNetns(t, client.Netns), testutil.OpenNetns(t, server.Netns)

	apps := []struct {
		name, network string
		port          int
	}{
		{"app-ipv4", "tcp4", 8079},
		{"app-dual-stack", "tcp", 8077},
	}
	for _, app := range apps {
		t.Run(app.name, func(t *testing.T) {
			testutil.WithAndWithout(t, func(t *testing.T, withAgent bool) {
				var ln net.Listener
				if err := serverNs.Do(func() (err error) {
					ln, err = net.Listen(app.network, ":"+strconv.Itoa(app.port))
					return err
				}); err != nil {
					t.Fatalf("listen %s :%d in %s: %v", app.network, app.port, server.Netns, err)
				}
				rec := &sourceRecorder{Listener: ln, sources: map[netip.Addr]int{}}
				echo := testutil.ServeEcho(rec)
				defer echo.Close()

				var a *accel.Agent
				if withAgent {
					a = agenttest.Start(t, accel.Config{CgroupPath: l.CgroupPath()})
				}
				before := snapshotStats(t, l)
				target := netip.AddrPortFrom(server.IP, uint16(app.port)).String()
				dial := func() (c net.Conn, err error) {
					err = clientNs.Do(func() error { c, err = net.DialTimeout("tcp4", target, 30*time.Second); return err })
					return c, err
				}
				res := testutil.CheckIntegrity(dial, istioIntegrityOpts)
				t.Logf("integrity: %d conns, sent %d bytes, echoed %d", res.Conns, res.BytesSent, res.BytesEcho)
				if err := res.Err(); err != nil {
					t.Error(err)
				}

				// The proxies' own evidence that every connection went through both sidecars.
				n := uint64(istioIntegrityOpts.Conns)
				d := sidecarDelta(before, snapshotStats(t, l))
				for _, h := range []hop{{client.Name, "outbound_tcp/backend"}, {server.Name, "inbound_tcp/backend"}} {
					if d[h][0] < n {
						t.Errorf("%v handled %d connections, want >= %d: traffic bypassed the sidecar", h, d[h][0], n)
					}
				}
				want := map[netip.Addr]int{netip.MustParseAddr("127.0.0.6"): istioIntegrityOpts.Conns}
				if got := rec.snapshot(); !maps.Equal(got, want) {
					t.Errorf("app accepted connections from %v, want all %d from the inbound sidecar's 127.0.0.6", got, istioIntegrityOpts.Conns)
				}
				if r := echo.Resets.Load(); r != 0 {
					t.Errorf("app saw %d connections end in an error", r)
				}
				if a == nil {
					return
				}
				s, err := a.Stats()
				if err != nil {
					t.Fatal(err)
				}
				t.Logf("agent: paired sockets %d, redirected %d msgs / %d bytes, passthrough %d msgs, connections by reason %v",
					s.PairedSockets, s.RedirectedMessages, s.RedirectedBytes, s.PassthroughMessages, s.PassthroughConnections)
				// Pairing is decided per connection at its handshake; a
				// connection whose client writes before its peer is
				// established, or whose peer comes after the unpaired
				// timeout, stays on TCP (a race a busy machine loses now
				// and then: testutil.CheckPaired). Each connection of the
				// three hops is paired or lost that race, and a clear
				// majority of each hop's are paired.
				hops := []string{"app_to_sidecar", "sidecar_to_sidecar", "sidecar_to_app"}
				var paired uint64
				for _, name := range hops {
					h := s.Hops[name]
					t.Logf("agent: hop %-18s paired %4d conns, redirected %6d msgs / %9d bytes", name, h.PairedConnections, h.RedirectedMessages, h.RedirectedBytes)
					paired += h.PairedConnections
					if float64(h.PairedConnections) < testutil.MinPairedShare*float64(n) || h.RedirectedBytes == 0 {
						t.Errorf("hop %s: %d of %d connections paired, want >= %.0f%% (left to TCP: %v)", name, h.PairedConnections, n, 100*testutil.MinPairedShare, s.PassthroughConnections)
					}
				}
				if err := testutil.CheckPaired(paired, uint64(len(hops))*n, s.PassthroughConnections); err != nil {
					t.Errorf("the %d hops: %v", len(hops), err)
				}
				// The messages of connections that lost the race went by TCP
				// by design; of the others, >= 95 % were redirected.
				raced := testutil.RaceLost(s.PassthroughByReason)
				if total := s.RedirectedMessages + s.PassthroughMessages - raced; s.RedirectedMessages*100 < total*95 {
					t.Errorf("only %d of %d messages redirected, want >= 95%% (%d more went by TCP on connections that lost their pairing race; by reason: %v)",
						s.RedirectedMessages, total, raced, s.PassthroughByReason)
				}
			})
		})
	}
}
