// SPDX-License-Identifier: Apache-2.0

package metrics

import (
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"

	"github.com/meshwarp/meshwarp/internal/accel"
	"github.com/meshwarp/meshwarp/internal/testutil"
	"github.com/meshwarp/meshwarp/internal/testutil/agenttest"
)

// RED series from the live agent, on accelerated connections (sk_msg) and
// with --accelerate=false (cgroup_skb): every request counted once at the
// server and once at the client with its method and status, failed
// requests included, and TCP resets and failed connects counted.
func TestPrivilegedREDMetrics(t *testing.T) {
	testutil.RequirePrivileged(t)
	for _, accelerate := range []bool{true, false} {
		t.Run("accelerate="+strconv.FormatBool(accelerate), func(t *testing.T) {
			cgroup := testutil.EnterCgroup(t)
			// A connection established before the agent (installed under load).
			early := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { fmt.Fprintln(w, "early") }))
			defer early.Close()
			earlyClient := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 1, MaxConnsPerHost: 1}}
			get := func(c *http.Client, url string) {
				resp, err := c.Get(url)
				if err != nil {
					t.Fatal(err)
				}
				io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
			}
			get(earlyClient, early.URL)

			a := agenttest.Start(t, accel.Config{CgroupPath: cgroup, Observe: true, ObserveOnly: !accelerate})
			const earlyGets = 30
			for range earlyGets {
				get(earlyClient, early.URL)
			}

			// The application: 200 on /ok, 503 on /fail.
			app := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				io.Copy(io.Discard, r.Body)
				if r.URL.Path == "/fail" {
					w.WriteHeader(http.StatusServiceUnavailable)
				}
				fmt.Fprintln(w, "hello")
			}))
			defer app.Close()
			port := app.Listener.Addr().(*net.TCPAddr).Port

			const keepAliveGets, posts, freshGets = 200, 50, 20
			keep := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 4, DisableCompression: true}}
			fresh := &http.Client{Transport: &http.Transport{DisableKeepAlives: true}}
			do := func(c *http.Client, method, path string, want int) {
				req, _ := http.NewRequest(method, app.URL+path, strings.NewReader("body"))
				resp, err := c.Do(req)
				if err != nil {
					t.Fatalf("%s %s: %v", method, path, err)
				}
				io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
				if resp.StatusCode != want {
					t.Fatalf("%s %s: status %d, want %d", method, path, resp.StatusCode, want)
				}
			}
			for range keepAliveGets {
				do(keep, http.MethodGet, "/ok", 200)
			}
			for range posts {
				do(keep, http.MethodPost, "/fail", 503)
			}
			for range freshGets {
				do(fresh, http.MethodGet, "/ok", 200)
			}
			keep.CloseIdleConnections()

			// A connection the client aborts (RST) and a connect nobody answers.
			c, err := net.Dial("tcp4", app.Listener.Addr().String())
			if err != nil {
				t.Fatal(err)
			}
			c.(*net.TCPConn).SetLinger(0)
			c.Close()
			closed := mustClosedPort(t)
			if _, err := net.Dial("tcp4", closed); !errors.Is(err, syscall.ECONNREFUSED) {
				t.Fatalf("dial %s: %v, want connection refused", closed, err)
			}

			url := metricsURL(t, a)
			wantLabel := strconv.FormatBool(accelerate)
			p := strconv.Itoa(port)
			// Connections end asynchronously (FIN handshakes): poll until they are counted.
			deadline := time.Now().Add(10 * time.Second)
			for {
				fams := scrape(t, url)
				var errs []error
				for _, side := range []string{"http_server_request_duration_seconds", "http_client_request_duration_seconds"} {
					for _, w := range []struct {
						method, status string
						n              uint64
					}{{"GET", "200", keepAliveGets + freshGets}, {"POST", "503", posts}} {
						labels := map[string]string{"http_request_method": w.method, "http_response_status_code": w.status, "server_port": p}
						got := histCount(fams[side], labels)
						labels["meshwarp_accelerated"] = wantLabel
						if gotLabel := histCount(fams[side], labels); got != w.n || gotLabel != w.n {
							errs = append(errs, fmt.Errorf("%s %v: %d requests (%d with meshwarp_accelerated=%s), want %d", side, labels, got, gotLabel, wantLabel, w.n))
						}
					}
				}
				// Requests on the connection made before the agent: seen, not accelerated.
				earlyPort := strconv.Itoa(early.Listener.Addr().(*net.TCPAddr).Port)
				for _, side := range []string{"http_server_request_duration_seconds", "http_client_request_duration_seconds"} {
					labels := map[string]string{"server_port": earlyPort, "meshwarp_accelerated": "false", "http_response_status_code": "200"}
					if n := histCount(fams[side], labels); n != earlyGets {
						errs = append(errs, fmt.Errorf("%s on a connection older than the agent: %d requests, want %d", side, n, earlyGets))
					}
				}
				tcp := fams["meshwarp_tcp_connection_duration_seconds"]
				if n := histCount(tcp, map[string]string{"point": "client", "outcome": "reset", "server_port": p}); n < 1 {
					errs = append(errs, fmt.Errorf("client reset not counted"))
				}
				if n := histCount(tcp, map[string]string{"point": "client", "outcome": "connect_failed"}); n < 1 {
					errs = append(errs, fmt.Errorf("failed connect not counted"))
				}
				if n := histCount(tcp, map[string]string{"point": "client", "outcome": "closed", "server_port": p}); n < freshGets {
					errs = append(errs, fmt.Errorf("%d closed client connections counted, want >= %d", n, freshGets))
				}
				if len(errs) == 0 {
					break
				}
				if time.Now().After(deadline) {
					t.Fatal(errors.Join(errs...))
				}
				time.Sleep(50 * time.Millisecond)
			}
			// Buckets fine enough for tens of microseconds.
			if h := scrape(t, url)["http_server_request_duration_seconds"]; h == nil || h.Metric[0].Histogram.Bucket[0].GetUpperBound() > 10e-6 {
				t.Errorf("the first bucket is not <= 10us")
			}
		})
	}
}

func scrape(t *testing.T, url string) map[string]*dto.MetricFamily {
	t.Helper()
	resp, err := http.Get(url + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	parser := expfmt.NewTextParser(model.UTF8Validation)
	families, err := parser.TextToMetricFamilies(resp.Body)
	if err != nil {
		t.Fatalf("parse /metrics: %v", err)
	}
	return families
}

// histCount sums the counts of the histograms whose labels include want.
func histCount(f *dto.MetricFamily, want map[string]string) uint64 {
	if f == nil {
		return 0
	}
	var n uint64
	for _, m := range f.Metric {
		have := map[string]string{}
		for _, l := range m.Label {
			have[l.GetName()] = l.GetValue()
		}
		ok := true
		for k, v := range want {
			ok = ok && have[k] == v
		}
		if ok {
			n += m.GetHistogram().GetSampleCount()
		}
	}
	return n
}

// mustClosedPort returns a loopback address nothing listens on.
func mustClosedPort(t *testing.T) string {
	ln, err := net.Listen("tcp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close()
	return addr
}
