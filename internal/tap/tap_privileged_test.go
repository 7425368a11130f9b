// SPDX-License-Identifier: Apache-2.0

package tap

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/meshwarp/meshwarp/internal/accel"
	"github.com/meshwarp/meshwarp/internal/testutil"
	"github.com/meshwarp/meshwarp/internal/testutil/agenttest"
)

// startTap runs Run in the background until the returned stop is called.
func startTap(t *testing.T, o Options) (stop func() Result) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	var res Result
	var err error
	go func() {
		defer close(done)
		res, err = Run(ctx, o)
	}()
	// Wait until the tap program is in the agent's link.
	deadline := time.Now().Add(10 * time.Second)
	for !tapAttached(t, o.PinDir) {
		if time.Now().After(deadline) {
			cancel()
			<-done
			t.Fatalf("tap never attached: %v", err)
		}
		time.Sleep(5 * time.Millisecond) // polling interval
	}
	return func() Result {
		cancel()
		<-done
		if err != nil {
			t.Fatalf("tap: %v", err)
		}
		return res
	}
}

// HTTP through paired connections while tapping: tshark finds every request
// and response, with clean stream reassembly, for IPv4, IPv6 and an IPv4
// client of a dual-stack listener. After the tap, the agent runs its own
// program again.
func TestPrivilegedTapHTTP(t *testing.T) {
	testutil.RequirePrivileged(t)
	pinDir := testutil.PinDir(t)
	a := agenttest.Start(t, accel.Config{PinDir: pinDir})
	for _, tc := range []struct{ name, network, listen, dial string }{
		{"ipv4", "tcp4", "127.0.0.1:0", "127.0.0.1"},
		{"ipv6", "tcp6", "[::1]:0", "::1"},
		{"v4-mapped", "tcp", "[::]:0", "127.0.0.1"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ln, err := net.Listen(tc.network, tc.listen)
			if err != nil {
				t.Fatal(err)
			}
			srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				io.Copy(io.Discard, r.Body)
				fmt.Fprintf(w, "reply to %s %s", r.Method, strings.Repeat("x", 2000))
			})}
			go srv.Serve(ln)
			defer srv.Close()
			port := ln.Addr().(*net.TCPAddr).Port
			file := filepath.Join(t.TempDir(), "tap.pcapng")
			f, err := os.Create(file)
			if err != nil {
				t.Fatal(err)
			}
			stop := startTap(t, Options{PinDir: pinDir, Port: uint16(port), Snaplen: DefaultSnaplen, Out: f})

			// The tap sees what is redirected: a connection that lost its
			// pairing race (testutil.PairingRaceReasons) runs on TCP, out
			// of the tap's sight. Connections are opened one at a time
			// until conns were paired, each one's requests numbered by
			// attempt; a clear majority of the attempts must pair.
			const conns, perConn = 5, 10
			var pairedAttempts []int
			lost := map[string]uint64{}
			attempt := 0
			for ; len(pairedAttempts) < conns; attempt++ {
				if lostAttempts := attempt - len(pairedAttempts); float64(conns) < testutil.MinPairedShare*float64(conns+lostAttempts) {
					stop()
					t.Fatalf("%d connections lost their pairing race before %d were paired, want >= %.0f%% of them paired: left to TCP: %v",
						lostAttempts, conns, 100*testutil.MinPairedShare, lost)
				}
				before, err := a.Stats()
				if err != nil {
					t.Fatal(err)
				}
				client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 1}}
				for i := range perConn {
					url := fmt.Sprintf("http://%s/req-%d-%d", net.JoinHostPort(tc.dial, fmt.Sprint(port)), attempt, i)
					resp, err := client.Post(url, "text/plain", strings.NewReader(strings.Repeat("b", 300)))
					if err != nil {
						t.Fatal(err)
					}
					io.Copy(io.Discard, resp.Body)
					resp.Body.Close()
				}
				client.CloseIdleConnections()
				if awaitPairing(t, a, before) {
					pairedAttempts = append(pairedAttempts, attempt)
				} else {
					for r, n := range agentDelta(t, a, before).PassthroughConnections {
						if n > 0 {
							lost[r] += n
						}
					}
				}
			}
			res := stop()
			f.Close()
			t.Logf("tap: %+v; %d of %d connections paired, left to TCP: %v", res, conns, attempt, lost)
			if res.RingFull != 0 || res.Cut != 0 {
				t.Fatalf("drops: %+v", res)
			}
			uris := strings.Fields(testutil.Tshark(t, file, "-Y", "http.request", "-T", "fields", "-e", "http.request.uri"))
			codes := strings.Fields(testutil.Tshark(t, file, "-Y", "http.response", "-T", "fields", "-e", "http.response.code"))
			if len(uris) != conns*perConn || len(codes) != conns*perConn {
				t.Fatalf("tshark found %d requests and %d responses, want %d each (those of the %d paired connections):\n%s", len(uris), len(codes), conns*perConn, conns,
					testutil.Tshark(t, file, "-Y", "http"))
			}
			for _, c := range pairedAttempts {
				for i := range perConn {
					if !strings.Contains(strings.Join(uris, " "), fmt.Sprintf("/req-%d-%d", c, i)) {
						t.Fatalf("request /req-%d-%d missing", c, i)
					}
				}
			}
			if bad := testutil.Tshark(t, file, "-Y", "tcp.analysis.lost_segment || tcp.analysis.retransmission || tcp.analysis.out_of_order || tcp.analysis.ack_lost_segment"); strings.TrimSpace(bad) != "" {
				t.Fatalf("stream analysis flags:\n%s", bad)
			}
			if n := strings.Count(testutil.Tshark(t, file, "-Y", "tcp.flags.syn == 1 && tcp.flags.ack == 0"), "\n"); n != conns {
				t.Fatalf("%d handshakes, want %d", n, conns)
			}
		})
	}
	if tapAttached(t, pinDir) {
		t.Fatal("the tap program is still in the agent's link after the tap ended")
	}
}

// agentDelta is the agent's counters since before.
func agentDelta(t *testing.T, a *accel.Agent, before accel.Stats) accel.Stats {
	t.Helper()
	s, err := a.Stats()
	if err != nil {
		t.Fatal(err)
	}
	return s.Sub(before)
}

// awaitPairing reports whether the one connection made since before was
// paired, failing t unless it was paired or lost its pairing race. Its
// exchange is over, so its pairing was decided; the count may still be on
// its way on another CPU: poll until it shows.
func awaitPairing(t *testing.T, a *accel.Agent, before accel.Stats) bool {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		d := agentDelta(t, a, before)
		switch {
		case d.PairedSockets == 2:
			return true
		case d.PairedSockets == 0 && testutil.RaceLost(d.PassthroughConnections) == 1:
			return false
		case d.PairedSockets > 2 || time.Now().After(deadline):
			t.Fatalf("one connection: %d sockets paired, left to TCP: %v; want it paired or lost to a pairing race (%v)",
				d.PairedSockets, d.PassthroughConnections, testutil.PairingRaceReasons)
		}
		time.Sleep(5 * time.Millisecond) // polling interval
	}
}

// tapAttached reports whether the agent's sk_msg link runs the tap program.
func tapAttached(t *testing.T, pinDir string) bool {
	t.Helper()
	name, err := LinkProgram(pinDir)
	if err != nil {
		t.Fatal(err)
	}
	return name == accel.TapProgram
}
