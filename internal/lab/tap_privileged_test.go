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
	agenttest.Start(t, accel.Config{CgroupPath: l.CgroupPath(), PinDir: pinDir})

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

	const conns, perConn = 4, 10
	target := netip.AddrPortFrom(server.IP, HTTPPort).String()
	for c := range conns {
		tr := &http.Transport{MaxIdleConnsPerHost: 1, DialContext: func(ctx context.Context, network, addr string) (conn net.Conn, err error) {
			err = clientNs.Do(func() error { conn, err = net.DialTimeout("tcp4", addr, 30*time.Second); return err })
			return conn, err
		}}
		hc := &http.Client{Transport: tr, Timeout: 30 * time.Second}
		for i := range perConn {
			resp, err := hc.Get(fmt.Sprintf("http://%s/echo?size=1500&id=req-%d-%d", target, c, i))
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
	}
	cancel()
	out := <-done
	f.Close()
	if out.err != nil {
		t.Fatalf("tap: %v", out.err)
	}
	t.Logf("tap: %+v", out.res)
	if out.res.RingFull != 0 || out.res.Cut != 0 {
		t.Fatalf("tap dropped or cut messages: %+v", out.res)
	}

	run := func(args ...string) string { return testutil.Tshark(t, file, args...) }
	uris := strings.Fields(run("-Y", "http.request", "-T", "fields", "-e", "http.request.uri"))
	codes := strings.Fields(run("-Y", "http.response", "-T", "fields", "-e", "http.response.code"))
	const hops = 3
	if len(uris) != hops*conns*perConn || len(codes) != hops*conns*perConn {
		t.Fatalf("tshark found %d requests and %d responses, want %d each (%d per hop):\n%s",
			len(uris), len(codes), hops*conns*perConn, conns*perConn, run("-Y", "http", "-T", "fields", "-e", "frame.comment", "-e", "_ws.col.Info"))
	}
	seen := map[string]int{}
	for _, u := range uris {
		seen[u]++
	}
	for c := range conns {
		for i := range perConn {
			u := fmt.Sprintf("/echo?size=1500&id=req-%d-%d", c, i)
			if seen[u] != hops {
				t.Fatalf("request %s seen %d times, want once per hop (%d)", u, seen[u], hops)
			}
		}
	}
	if bad := run("-Y", "tcp.analysis.lost_segment || tcp.analysis.retransmission || tcp.analysis.out_of_order || tcp.analysis.ack_lost_segment"); strings.TrimSpace(bad) != "" {
		t.Fatalf("stream analysis flags:\n%s", bad)
	}
	for _, hop := range []string{"app_to_sidecar", "sidecar_to_sidecar", "sidecar_to_app"} {
		if !strings.Contains(run("-T", "fields", "-e", "frame.comment"), hop) {
			t.Errorf("no packet is marked with hop %s", hop)
		}
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
