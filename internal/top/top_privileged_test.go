// SPDX-License-Identifier: Apache-2.0

package top_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"maps"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/meshwarp/meshwarp/internal/accel"
	"github.com/meshwarp/meshwarp/internal/observe"
	"github.com/meshwarp/meshwarp/internal/testutil"
	"github.com/meshwarp/meshwarp/internal/testutil/agenttest"
)

// load runs HTTP requests against two applications of the agent's cgroup
// until the test ends: one answers 200, the other 503.
func load(t *testing.T) (okServer, failServer string) {
	ok := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { fmt.Fprintln(w, "ok") }))
	fail := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { w.WriteHeader(503) }))
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		c := &http.Client{Timeout: 5 * time.Second}
		for i := 0; ctx.Err() == nil; i++ {
			url := ok.URL
			if i%4 == 0 {
				url = fail.URL
			}
			if resp, err := c.Get(url); err == nil {
				io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
			}
			time.Sleep(2 * time.Millisecond)
		}
	}()
	t.Cleanup(func() { cancel(); <-done; ok.Close(); fail.Close() })
	return strings.TrimPrefix(ok.URL, "http://"), strings.TrimPrefix(fail.URL, "http://")
}

// startAgent starts an observing agent on a throwaway cgroup this test
// process joins and returns its pin directory.
func startAgent(t *testing.T) string {
	pin := testutil.PinDir(t)
	agenttest.Start(t, accel.Config{PinDir: pin, Observe: true})
	return pin
}

// `meshwarp top --once --json` lists both flows with their rates, and bad
// input is one line naming the fix.
func TestPrivilegedTopOnceJSON(t *testing.T) {
	testutil.RequirePrivileged(t)
	bin := testutil.MeshwarpBinary(t)
	pin := startAgent(t)
	okServer, failServer := load(t)

	// A paired socket adds its bytes to the flows at most once a second
	// (MW_OBS_FLUSH_NS): a 2 s window holds at least one addition per flow.
	out, err := exec.Command(bin, "top", "--pin-dir", pin, "--once", "--json", "--interval", "2s").Output()
	if err != nil {
		t.Fatalf("top --once --json: %v", err)
	}
	var snap struct {
		IntervalSeconds float64       `json:"interval_seconds"`
		Flows           []observe.Row `json:"flows"`
	}
	dec := json.NewDecoder(strings.NewReader(string(out)))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&snap); err != nil {
		t.Fatalf("decode %s: %v", out, err)
	}
	// The JSON names are what scripts read: exactly these, whatever observe.Row becomes.
	var raw struct {
		Flows []map[string]json.RawMessage `json:"flows"`
	}
	if err := json.Unmarshal(out, &raw); err != nil {
		t.Fatal(err)
	}
	const keys = "accelerated_share bytes_per_second client errors_per_second hop p50_seconds p99_seconds protocol requests_per_second server"
	for _, f := range raw.Flows {
		if got := strings.Join(slices.Sorted(maps.Keys(f)), " "); got != keys {
			t.Errorf("flow keys %q, want %q", got, keys)
		}
	}
	got := map[string]observe.Row{}
	for _, r := range snap.Flows {
		got[r.Server] = r
	}
	// A flow's requests run over one keep-alive connection: one that lost
	// its pairing race (testutil.PairingRaceReasons) carries them all on
	// TCP, as it should. Each flow shown unaccelerated must be such a
	// connection's, and some connection must be paired.
	st, err := accel.ReadPinnedStats(pin)
	if err != nil {
		t.Fatal(err)
	}
	var unaccelerated []observe.Row
	for _, server := range []string{okServer, failServer} {
		r, ok := got[server]
		if !ok {
			t.Fatalf("no flow to %s in %s", server, out)
		}
		if r.Protocol != "http" || r.RequestsPerSecond <= 0 || r.P50Seconds <= 0 || r.BytesPerSecond <= 0 || r.Client != "host" {
			t.Errorf("flow %+v: want http from host with requests, latency and bytes", r)
		}
		if r.AcceleratedShare < 0.9 {
			unaccelerated = append(unaccelerated, r)
		}
	}
	if lost := testutil.RaceLost(st.PassthroughConnections); uint64(len(unaccelerated)) > lost || st.PairedSockets == 0 {
		t.Errorf("flows %+v: loopback requests not accelerated (%d connections paired, %d lost a pairing race; left to TCP: %v)",
			unaccelerated, st.PairedSockets/2, lost, st.PassthroughConnections)
	} else if len(unaccelerated) > 0 {
		t.Logf("flows %+v: on connections that lost their pairing race (left to TCP: %v)", unaccelerated, st.PassthroughConnections)
	}
	if got[failServer].ErrorsPerSecond <= 0 || got[okServer].ErrorsPerSecond != 0 {
		t.Errorf("errors/s: %v to the 503 server, %v to the 200 server", got[failServer].ErrorsPerSecond, got[okServer].ErrorsPerSecond)
	}

	// No agent at that pin directory: exit 3, one line, the fix named.
	cmd := exec.Command(bin, "top", "--pin-dir", pin+"-none", "--once")
	msg, err := cmd.CombinedOutput()
	var exit *exec.ExitError
	if !errors.As(err, &exit) || exit.ExitCode() != 3 || strings.Count(strings.TrimSpace(string(msg)), "\n") != 0 || !strings.Contains(string(msg), "meshwarp run") {
		t.Errorf("top without an agent: %v, %q: want exit 3 and one line naming `meshwarp run`", err, msg)
	}
	// A port nobody serves: trace names the ports it saw.
	msg, err = exec.Command(bin, "trace", "--pin-dir", pin, "--duration", "1s", "--port", "1").CombinedOutput()
	okPort := okServer[strings.LastIndex(okServer, ":")+1:]
	if err == nil || !strings.Contains(string(msg), "no request to port 1") || !strings.Contains(string(msg), okPort) {
		t.Errorf("trace --port 1: %v, %q: want an error naming the ports requests went to", err, msg)
	}
}

// The live view in a real terminal (tmux): rows appear, s sorts by errors,
// / filters, q quits.
func TestPrivilegedTopLive(t *testing.T) {
	testutil.RequirePrivileged(t)
	if _, err := exec.LookPath("tmux"); err != nil {
		t.Fatal("tmux not installed: run scripts/install-deps.sh --test")
	}
	bin := testutil.MeshwarpBinary(t)
	pin := startAgent(t)
	okServer, failServer := load(t)

	session := fmt.Sprintf("meshwarp-test-top-%d", os.Getpid())
	testutil.Run(t, "tmux", "new-session", "-d", "-s", session, "-x", "160", "-y", "30",
		bin+" top --pin-dir "+pin+" --interval 300ms")
	t.Cleanup(func() { exec.Command("tmux", "kill-session", "-t", session).Run() })
	screen := func() string {
		out, _ := exec.Command("tmux", "capture-pane", "-p", "-t", session).Output()
		return string(out)
	}
	waitFor := func(what string, cond func(lines []string) bool) []string {
		t.Helper()
		deadline := time.Now().Add(15 * time.Second)
		for {
			s := screen()
			lines := strings.Split(s, "\n")
			if cond(lines) {
				return lines
			}
			if time.Now().After(deadline) {
				t.Fatalf("%s: the screen shows:\n%s", what, s)
			}
			time.Sleep(100 * time.Millisecond)
		}
	}
	rowOf := func(lines []string, server string) int {
		for i, l := range lines {
			if strings.Contains(l, server) && strings.Contains(l, "http") {
				return i
			}
		}
		return -1
	}
	waitFor("both flows", func(l []string) bool { return rowOf(l, okServer) > 0 && rowOf(l, failServer) > 0 })

	testutil.Run(t, "tmux", "send-keys", "-t", session, "s")
	waitFor("sorted by errors, the 503 server first", func(l []string) bool {
		return strings.Contains(l[0], "sorted by errors") && rowOf(l, failServer) > 0 && rowOf(l, failServer) < rowOf(l, okServer)
	})

	port := okServer[strings.LastIndex(okServer, ":")+1:]
	testutil.Run(t, "tmux", "send-keys", "-t", session, "/", port, "Enter")
	waitFor("filtered to the 200 server", func(l []string) bool {
		return strings.Contains(l[0], "filter: "+port) && rowOf(l, okServer) > 0 && rowOf(l, failServer) < 0
	})

	testutil.Run(t, "tmux", "send-keys", "-t", session, "q")
	deadline := time.Now().Add(10 * time.Second)
	for exec.Command("tmux", "has-session", "-t", session).Run() == nil {
		if time.Now().After(deadline) {
			t.Fatalf("q did not quit; the screen shows:\n%s", screen())
		}
		time.Sleep(100 * time.Millisecond)
	}
}
