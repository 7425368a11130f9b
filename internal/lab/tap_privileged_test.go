// SPDX-License-Identifier: Apache-2.0

package lab

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/meshwarp/meshwarp/internal/accel"
	"github.com/meshwarp/meshwarp/internal/tap"
	"github.com/meshwarp/meshwarp/internal/testutil"
	"github.com/meshwarp/meshwarp/internal/testutil/agenttest"
)

// HTTP through the lab's accelerated sidecars while tapping: tshark reads
// the file and finds every request and response on each of the three hops
// (app -> sidecar, sidecar -> sidecar, sidecar -> app), with clean TCP
// stream analysis. The server is the lab's fortio HTTP echo app.
func TestPrivilegedTapThroughSidecars(t *testing.T) {
	testutil.RequirePrivileged(t)
	l := upForTest(t, Options{Pods: 2, Capture: true})
	client, server := l.Client(), l.Server()
	testutil.JoinCgroup(t, l.CgroupPath())
	clientNs := testutil.OpenNetns(t, client.Netns)
	pinDir := testutil.PinDir(t)
	a := agenttest.Start(t, accel.Config{CgroupPath: l.CgroupPath(), PinDir: pinDir})

	file := filepath.Join(t.TempDir(), "mesh.pcapng")
	f, err := os.Create(file)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	type outcome struct {
		res tap.Result
		err error
	}
	done := make(chan outcome, 1)
	go func() {
		r, err := tap.Run(ctx, tap.Options{PinDir: pinDir, Port: HTTPPort, Snaplen: tap.DefaultSnaplen, Out: f})
		done <- outcome{r, err}
	}()
	// The tap is in place once its program runs in the agent's link.
	deadline := time.Now().Add(10 * time.Second)
	for !skmsgIs(t, pinDir, accel.TapProgram) {
		if time.Now().After(deadline) {
			cancel()
			t.Fatalf("tap never attached: %v", (<-done).err)
		}
		time.Sleep(5 * time.Millisecond) // polling interval
	}

	// The tap sees what is redirected: a hop's connection that lost its
	// pairing race (testutil.PairingRaceReasons) runs on TCP, out of the
	// tap's sight. Client connections are made one at a time until conns
	// were paired on all three hops; a request is seen once per paired hop
	// of its connection, and a clear majority of the connections must be
	// paired on every hop.
	const conns, perConn = 4, 10
	hops := []string{"app_to_sidecar", "sidecar_to_sidecar", "sidecar_to_app"}
	target := netip.AddrPortFrom(server.IP, HTTPPort).String()
	var pairedHops []int // per attempt
	full := 0
	for attempt := 0; full < conns; attempt++ {
		if partial := attempt - full; float64(conns) < testutil.MinPairedShare*float64(conns+partial) {
			cancel()
			<-done
			t.Fatalf("%d connections lost a pairing race on some hop before %d were paired on all %d, want >= %.0f%% of them paired (paired hops per connection: %v)",
				partial, conns, len(hops), 100*testutil.MinPairedShare, pairedHops)
		}
		before, err := a.Stats()
		if err != nil {
			t.Fatal(err)
		}
		tr := &http.Transport{MaxIdleConnsPerHost: 1, DialContext: func(ctx context.Context, network, addr string) (conn net.Conn, err error) {
			err = clientNs.Do(func() error { conn, err = net.DialTimeout("tcp4", addr, 30*time.Second); return err })
			return conn, err
		}}
		hc := &http.Client{Transport: tr, Timeout: 30 * time.Second}
		for i := range perConn {
			resp, err := hc.Get(fmt.Sprintf("http://%s/echo?size=1500&id=req-%d-%d", target, attempt, i))
			if err != nil {
				t.Fatal(err)
			}
			io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			if resp.StatusCode != 200 {
				t.Fatalf("status %d", resp.StatusCode)
			}
		}
		tr.CloseIdleConnections()
		n := awaitHopPairing(t, a, before, hops)
		pairedHops = append(pairedHops, n)
		if n == len(hops) {
			full++
		}
	}
	cancel()
	out := <-done
	f.Close()
	if out.err != nil {
		t.Fatalf("tap: %v", out.err)
	}
	t.Logf("tap: %+v; paired hops per connection: %v", out.res, pairedHops)
	if out.res.RingFull != 0 || out.res.Cut != 0 {
		t.Fatalf("tap dropped or cut messages: %+v", out.res)
	}

	run := func(args ...string) string { return testutil.Tshark(t, file, args...) }
	uris := strings.Fields(run("-Y", "http.request", "-T", "fields", "-e", "http.request.uri"))
	codes := strings.Fields(run("-Y", "http.response", "-T", "fields", "-e", "http.response.code"))
	want := 0
	for _, n := range pairedHops {
		want += n * perConn
	}
	if len(uris) != want || len(codes) != want {
		t.Fatalf("tshark found %d requests and %d responses, want %d each (one per paired hop of each request's connection: %v):\n%s",
			len(uris), len(codes), want, pairedHops, run("-Y", "http", "-T", "fields", "-e", "frame.comment", "-e", "_ws.col.Info"))
	}
	seen := map[string]int{}
	for _, u := range uris {
		seen[u]++
	}
	for c, n := range pairedHops {
		for i := range perConn {
			u := fmt.Sprintf("/echo?size=1500&id=req-%d-%d", c, i)
			if seen[u] != n {
				t.Fatalf("request %s seen %d times, want once per paired hop of its connection (%d)", u, seen[u], n)
			}
		}
	}
	if bad := run("-Y", "tcp.analysis.lost_segment || tcp.analysis.retransmission || tcp.analysis.out_of_order || tcp.analysis.ack_lost_segment"); strings.TrimSpace(bad) != "" {
		t.Fatalf("stream analysis flags:\n%s", bad)
	}
	for _, hop := range hops {
		if !strings.Contains(run("-T", "fields", "-e", "frame.comment"), hop) {
			t.Errorf("no packet is marked with hop %s", hop)
		}
	}
}

// awaitHopPairing returns on how many of hops the one client connection
// made since before was paired, failing t unless each of its hop
// connections was paired or lost its pairing race. Its exchanges are over,
// so each pairing was decided; a count may still be on its way on another
// CPU: poll until all show.
func awaitHopPairing(t *testing.T, a *accel.Agent, before accel.Stats, hops []string) int {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		s, err := a.Stats()
		if err != nil {
			t.Fatal(err)
		}
		d := s.Sub(before)
		paired, other := 0, false
		for _, h := range hops {
			switch d.Hops[h].PairedConnections {
			case 0:
			case 1:
				paired++
			default:
				other = true
			}
		}
		lost := testutil.RaceLost(d.PassthroughConnections)
		if !other && uint64(paired)+lost == uint64(len(hops)) {
			return paired
		}
		if other || uint64(paired)+lost > uint64(len(hops)) || time.Now().After(deadline) {
			t.Fatalf("one client connection: paired per hop %v, left to TCP: %v; want each of its %d hop connections paired or lost to a pairing race (%v)",
				d.Hops, d.PassthroughConnections, len(hops), testutil.PairingRaceReasons)
		}
		time.Sleep(5 * time.Millisecond) // polling interval
	}
}

// skmsgIs reports whether the agent's sk_msg link runs the named program.
func skmsgIs(t *testing.T, pinDir, prog string) bool {
	t.Helper()
	name, err := tap.LinkProgram(pinDir)
	if err != nil {
		t.Fatal(err)
	}
	return name == prog
}
