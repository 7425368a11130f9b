// SPDX-License-Identifier: Apache-2.0

package metrics

import (
	"errors"
	"fmt"
	"io"
	"net"
	"net/http/httptest"
	"strconv"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"

	"github.com/meshwarp/meshwarp/internal/accel"
	"github.com/meshwarp/meshwarp/internal/testutil"
	"github.com/meshwarp/meshwarp/internal/testutil/agenttest"
)

// meshwarp_tcp_bytes_total counts every payload byte of a connection, both
// directions, at both ends, whichever end closes first: short connections
// (shorter than the one-second flush) on accelerated connections (sk_msg,
// where each end's flow learns its peer's redirected bytes at a flush or a
// close) and on TCP (cgroup_skb).
func TestPrivilegedTCPBytesExact(t *testing.T) {
	testutil.RequirePrivileged(t)
	for _, accelerate := range []bool{true, false} {
		for _, serverCloses := range []bool{true, false} {
			name := fmt.Sprintf("accelerate=%v/server-closes-first=%v", accelerate, serverCloses)
			t.Run(name, func(t *testing.T) {
				cgroup := testutil.EnterCgroup(t)
				a := agenttest.Start(t, accel.Config{CgroupPath: cgroup, Observe: true, ObserveOnly: !accelerate})
				ln, err := net.Listen("tcp4", "127.0.0.1:0")
				if err != nil {
					t.Fatal(err)
				}
				defer ln.Close()
				const conns, request, response = 5, 700, 1300
				done := make(chan error, 1)
				go func() {
					for range conns {
						c, err := ln.Accept()
						if err != nil {
							done <- err
							return
						}
						buf := make([]byte, request)
						if _, err := io.ReadFull(c, buf); err != nil {
							done <- err
							return
						}
						if _, err := c.Write(make([]byte, response)); err != nil {
							done <- err
							return
						}
						if serverCloses {
							c.Close()
						} else {
							io.Copy(io.Discard, c) // until the client's FIN
							c.Close()
						}
					}
					done <- nil
				}()
				for range conns {
					c, err := net.Dial("tcp4", ln.Addr().String())
					if err != nil {
						t.Fatal(err)
					}
					if _, err := c.Write(make([]byte, request)); err != nil {
						t.Fatal(err)
					}
					if _, err := io.ReadFull(c, make([]byte, response)); err != nil {
						t.Fatal(err)
					}
					if serverCloses {
						io.Copy(io.Discard, c) // until the server's FIN
					}
					c.Close()
				}
				if err := <-done; err != nil {
					t.Fatal(err)
				}
				srv := httptest.NewServer(Handler(a.Stats, a.Flows))
				defer srv.Close()
				port := strconv.Itoa(ln.Addr().(*net.TCPAddr).Port)
				want := float64(conns * (request + response))
				deadline := time.Now().Add(10 * time.Second)
				for {
					fams := scrape(t, srv.URL)
					var errs []error
					for _, point := range []string{"client", "server"} {
						got := counterSum(fams["meshwarp_tcp_bytes_total"], map[string]string{
							"point": point, "server_port": port, "meshwarp_accelerated": strconv.FormatBool(accelerate),
						})
						if got != want {
							errs = append(errs, fmt.Errorf("point %s: %.0f bytes, want %.0f", point, got, want))
						}
					}
					if len(errs) == 0 {
						break
					}
					if time.Now().After(deadline) {
						t.Fatal(errors.Join(errs...))
					}
					time.Sleep(50 * time.Millisecond)
				}
			})
		}
	}
}

// counterSum sums the counters whose labels include want.
func counterSum(f *dto.MetricFamily, want map[string]string) float64 {
	if f == nil {
		return 0
	}
	var n float64
	for _, m := range f.Metric {
		ok := true
		for _, l := range m.Label {
			if v, in := want[l.GetName()]; in && v != l.GetValue() {
				ok = false
			}
		}
		if ok {
			n += m.GetCounter().GetValue()
		}
	}
	return n
}
