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
// directions, at both ends, whichever end closes first, and each end is one
// connection of its kind (accelerated or not): short connections (shorter
// than the one-second flush) on accelerated connections (sk_msg, where each
// end's flow learns its peer's redirected bytes at a flush or a close) and
// on TCP (cgroup_skb), request/response and one-way.
func TestPrivilegedTCPBytesExact(t *testing.T) {
	testutil.RequirePrivileged(t)
	cases := []struct {
		name         string
		response     int  // bytes the server answers; 0: a one-way upload
		serverCloses bool // the server closes first (else it reads the client's FIN)
	}{
		{"server-closes-first", 1300, true},
		{"client-closes-first", 1300, false},
		{"one-way-upload", 0, false},
	}
	for _, accelerate := range []bool{true, false} {
		for _, tc := range cases {
			t.Run(fmt.Sprintf("accelerate=%v/%s", accelerate, tc.name), func(t *testing.T) {
				cgroup := testutil.EnterCgroup(t)
				a := agenttest.Start(t, accel.Config{CgroupPath: cgroup, Observe: true, ObserveOnly: !accelerate})
				ln, err := net.Listen("tcp4", "127.0.0.1:0")
				if err != nil {
					t.Fatal(err)
				}
				defer ln.Close()
				const conns, request = 5, 700
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
						if tc.response > 0 {
							if _, err := c.Write(make([]byte, tc.response)); err != nil {
								done <- err
								return
							}
						}
						if !tc.serverCloses {
							io.Copy(io.Discard, c) // until the client's FIN
						}
						c.Close()
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
					if _, err := io.ReadFull(c, make([]byte, tc.response)); err != nil {
						t.Fatal(err)
					}
					if tc.serverCloses {
						io.Copy(io.Discard, c) // until the server's FIN
					}
					c.Close()
				}
				if err := <-done; err != nil {
					t.Fatal(err)
				}
				url := metricsURL(t, a)
				labels := func(point string) map[string]string {
					return map[string]string{
						"point": point, "server_port": strconv.Itoa(ln.Addr().(*net.TCPAddr).Port),
						"meshwarp_accelerated": strconv.FormatBool(accelerate),
					}
				}
				want := float64(conns * (request + tc.response))
				eventually(t, url, func(fams map[string]*dto.MetricFamily) (errs []error) {
					for _, point := range []string{"client", "server"} {
						if got := counterSum(fams["meshwarp_tcp_bytes_total"], labels(point)); got != want {
							errs = append(errs, fmt.Errorf("point %s: %.0f bytes, want %.0f", point, got, want))
						}
						if got := histogramCount(fams["meshwarp_tcp_connection_duration_seconds"], labels(point)); got != conns {
							errs = append(errs, fmt.Errorf("point %s: %d connection ends, want %d", point, got, conns))
						}
					}
					return errs
				})
			})
		}
	}
}

// counterSum sums the counters whose labels include want.
func counterSum(f *dto.MetricFamily, want map[string]string) float64 {
	var n float64
	for _, m := range matching(f, want) {
		n += m.GetCounter().GetValue()
	}
	return n
}

// histogramCount sums the observation counts of the histograms whose labels include want.
func histogramCount(f *dto.MetricFamily, want map[string]string) int {
	var n uint64
	for _, m := range matching(f, want) {
		n += m.GetHistogram().GetSampleCount()
	}
	return int(n)
}

// matching returns f's metrics whose labels include want (none of a missing family).
func matching(f *dto.MetricFamily, want map[string]string) []*dto.Metric {
	if f == nil {
		return nil
	}
	var out []*dto.Metric
	for _, m := range f.Metric {
		ok := true
		for _, l := range m.Label {
			if v, in := want[l.GetName()]; in && v != l.GetValue() {
				ok = false
			}
		}
		if ok {
			out = append(out, m)
		}
	}
	return out
}

// Segments of a few bytes count too, on a path without TCP timestamps
// (whose headers are 12 bytes shorter): request/response of 1 to 12 bytes,
// accelerated (sk_msg) and on TCP (cgroup_skb).
func TestPrivilegedTCPBytesExactTinySegments(t *testing.T) {
	testutil.RequirePrivileged(t)
	for _, accelerate := range []bool{true, false} {
		t.Run(fmt.Sprintf("accelerate=%v", accelerate), func(t *testing.T) {
			cgroup := testutil.EnterCgroup(t)
			ns := testutil.NewNetns(t, "tiny")
			testutil.Run(t, "ip", "netns", "exec", ns.Name, "sysctl", "-qw", "net.ipv4.tcp_timestamps=0")
			a := agenttest.Start(t, accel.Config{CgroupPath: cgroup, Observe: true, ObserveOnly: !accelerate})
			var ln net.Listener
			if err := ns.Do(func() (err error) { ln, err = net.Listen("tcp4", "127.0.0.1:0"); return err }); err != nil {
				t.Fatal(err)
			}
			defer ln.Close()
			const maxSize = 12
			done := make(chan error, 1)
			go func() {
				s, err := ln.Accept()
				if err != nil {
					done <- err
					return
				}
				defer s.Close()
				buf := make([]byte, maxSize)
				for size := 1; size <= maxSize; size++ {
					if _, err := io.ReadFull(s, buf[:size]); err != nil {
						done <- err
						return
					}
					if _, err := s.Write(buf[:size]); err != nil {
						done <- err
						return
					}
				}
				_, err = io.Copy(io.Discard, s) // until the client's FIN
				done <- err
			}()
			var c net.Conn
			if err := ns.Do(func() (err error) { c, err = net.Dial("tcp4", ln.Addr().String()); return err }); err != nil {
				t.Fatal(err)
			}
			buf := make([]byte, maxSize)
			for size := 1; size <= maxSize; size++ {
				if _, err := c.Write(buf[:size]); err != nil {
					t.Fatal(err)
				}
				if _, err := io.ReadFull(c, buf[:size]); err != nil {
					t.Fatal(err)
				}
			}
			c.Close()
			if err := <-done; err != nil {
				t.Fatal(err)
			}
			url := metricsURL(t, a)
			want := float64(2 * maxSize * (maxSize + 1) / 2) // 1..12 bytes each way
			port := strconv.Itoa(ln.Addr().(*net.TCPAddr).Port)
			eventually(t, url, func(fams map[string]*dto.MetricFamily) []error {
				return tcpBytesErrors(fams, port, accelerate, want)
			})
		})
	}
}

// metricsURL serves a's metrics (Handler) until the test ends.
func metricsURL(t *testing.T, a *accel.Agent) string {
	srv := httptest.NewServer(Handler(a.Stats, a.Flows))
	t.Cleanup(srv.Close)
	return srv.URL
}

// eventually scrapes url until check finds nothing wrong (connections end,
// and their last bytes reach the flows, asynchronously), or fails the test
// with what check found last.
func eventually(t *testing.T, url string, check func(map[string]*dto.MetricFamily) []error) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		errs := check(scrape(t, url))
		if len(errs) == 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatal(errors.Join(errs...))
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// tcpBytesErrors: meshwarp_tcp_bytes_total of server port at the client and
// the server point, accelerated or not, against want.
func tcpBytesErrors(fams map[string]*dto.MetricFamily, port string, accelerate bool, want float64) (errs []error) {
	for _, point := range []string{"client", "server"} {
		labels := map[string]string{"point": point, "server_port": port, "meshwarp_accelerated": strconv.FormatBool(accelerate)}
		if got := counterSum(fams["meshwarp_tcp_bytes_total"], labels); got != want {
			errs = append(errs, fmt.Errorf("point %s: %.0f bytes, want %.0f", point, got, want))
		}
	}
	return errs
}
