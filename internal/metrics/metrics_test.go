// SPDX-License-Identifier: Apache-2.0

package metrics

import (
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/meshwarp/meshwarp/internal/accel"
)

func TestMetricsFromStats(t *testing.T) {
	read := func() (accel.Stats, error) {
		return accel.Stats{Counters: accel.Counters{
			AcceleratedSockets:  4,
			RedirectedBytes:     1024,
			RedirectedMessages:  2,
			PassthroughByReason: map[string]uint64{"no_peer": 3},
			Hops:                map[string]accel.HopStats{"app_to_sidecar": {RedirectedBytes: 512}},
		}}, nil
	}
	srv := httptest.NewServer(Handler(read, nil))
	defer srv.Close()
	body := get(t, srv.URL+"/metrics")
	for _, want := range []string{
		"meshwarp_accel_sockets 4",
		"meshwarp_accel_redirected_bytes_total 1024",
		"meshwarp_accel_redirected_messages_total 2",
		`meshwarp_accel_passthrough_messages_total{reason="no_peer"} 3`,
		`meshwarp_accel_hop_redirected_bytes_total{hop="app_to_sidecar"} 512`,
		"meshwarp_accel_sockhash_full_total 0",
		"meshwarp_build_info{",
		"meshwarp_process_cpu_seconds_total",
	} {
		if !strings.Contains(body, want) {
			t.Errorf("metrics lack %q", want)
		}
	}
	if got := get(t, srv.URL+"/healthz"); strings.TrimSpace(got) != "ok" {
		t.Errorf("healthz = %q", got)
	}
}

func TestHealthzFailsWhenMapsUnreadable(t *testing.T) {
	srv := httptest.NewServer(Handler(func() (accel.Stats, error) { return accel.Stats{}, errors.New("gone") }, nil))
	defer srv.Close()
	resp, err := srv.Client().Get(srv.URL + "/healthz")
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != 503 {
		t.Fatalf("healthz status %d, want 503", resp.StatusCode)
	}
}

func get(t *testing.T, url string) string {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return string(b)
}
