// SPDX-License-Identifier: Apache-2.0

package accel

import (
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/meshwarp/meshwarp/internal/testutil"
)

// apiServer answers the one request the agent makes on exit (GET of its
// DaemonSet) the way the Kubernetes API does: the object while it exists,
// 404 once `helm uninstall` deleted it. There is no cluster on this machine;
// the agent's client is internal/kube's one REST GET, over HTTP.
type apiServer struct {
	*httptest.Server
	exists atomic.Bool
	gets   atomic.Int32
}

func newAPIServer(t *testing.T, ns, name string) (*apiServer, string) {
	t.Helper()
	s := &apiServer{}
	s.exists.Store(true)
	path := fmt.Sprintf("/apis/apps/v1/namespaces/%s/daemonsets/%s", ns, name)
	s.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		if r.Method != http.MethodGet || r.URL.Path != path {
			w.WriteHeader(http.StatusForbidden)
			fmt.Fprintf(w, `{"kind":"Status","apiVersion":"v1","status":"Failure","reason":"Forbidden","code":403,"message":"only %s may be read"}`, path)
			return
		}
		s.gets.Add(1)
		if !s.exists.Load() {
			w.WriteHeader(http.StatusNotFound)
			fmt.Fprintf(w, `{"kind":"Status","apiVersion":"v1","status":"Failure","reason":"NotFound","code":404,"details":{"name":%q,"group":"apps","kind":"daemonsets"}}`, name)
			return
		}
		fmt.Fprintf(w, `{"kind":"DaemonSet","apiVersion":"apps/v1","metadata":{"name":%q,"namespace":%q,"uid":"1"}}`, name, ns)
	}))
	t.Cleanup(s.Close)
	kubeconfig := filepath.Join(t.TempDir(), "kubeconfig")
	cfg := fmt.Sprintf(`apiVersion: v1
kind: Config
clusters: [{name: test, cluster: {server: %q}}]
users: [{name: agent, user: {token: test}}]
contexts: [{name: test, context: {cluster: test, user: agent}}]
current-context: test
`, s.URL)
	if err := os.WriteFile(kubeconfig, []byte(cfg), 0o600); err != nil {
		t.Fatal(err)
	}
	return s, kubeconfig
}

// The Helm chart's lifecycle, with the binary under load: the agent runs
// with the chart's flags (--keep-on-exit-while-daemonset, --config from a
// ConfigMap-like file). A rolling update stops the old pod while the
// DaemonSet exists: the data path stays pinned and the new pod adopts it.
// A policy change to the file applies without a restart. `helm uninstall`
// deletes the DaemonSet, then stops the pod: everything is detached and
// unpinned. 100 streams run throughout: 0 bytes lost, 0 resets.
func TestPrivilegedChartLifecycleUnderLoad(t *testing.T) {
	testutil.RequirePrivileged(t)
	cgroup := testutil.EnterCgroup(t)
	pinDir := testutil.PinDir(t)
	api, kubeconfig := newAPIServer(t, "meshwarp-system", "meshwarp")
	policyFile := filepath.Join(t.TempDir(), "policy.yaml")
	os.WriteFile(policyFile, []byte("exclude_ports: []\n"), 0o644)
	// --keep-small-streams: the load below writes without waiting for its
	// echo (small streams), and must stay accelerated across the update.
	chartFlags := []string{"--keep-on-exit-while-daemonset=meshwarp-system/meshwarp", "--kubeconfig", kubeconfig, "--config", policyFile, "--keep-small-streams"}

	srv := testutil.ServeEcho(mustListen(t, "127.0.0.1:0"))
	defer srv.Close()
	target := srv.Addr().String()
	dial := func() (net.Conn, error) { return net.Dial("tcp", target) }

	old := testutil.StartAgentProc(t, cgroup, pinDir, chartFlags...)
	stop, stopStreams := testutil.StopStreams()
	defer stopStreams()
	started := make(chan struct{}, 100)
	streams := make(chan testutil.IntegrityResult, 1)
	go func() {
		streams <- testutil.CheckIntegrity(dial, testutil.IntegrityOptions{
			Conns: 100, Messages: 50, MaxSize: 16 << 10, Seed: 13, Stop: stop, Started: started,
		})
	}()
	for range 100 {
		<-started
	}
	// Each stream's first write decided its pairing: paired, or lost its
	// race (testutil.CheckPaired). The pairing's count may still be on its
	// way on another CPU (it is taken after the peer learns it is paired):
	// poll until every stream is accounted for.
	counted := time.Now().Add(30 * time.Second)
	for {
		s, err := ReadPinnedStats(pinDir)
		if err != nil {
			stopStreams()
			t.Fatal(err)
		}
		err = testutil.CheckPaired(s.AcceleratedSockets/2, 100, s.PassthroughConnections)
		if err == nil {
			break
		}
		if time.Now().After(counted) {
			stopStreams()
			t.Fatalf("streams were not accelerated: %d sockets: %v", s.AcceleratedSockets, err)
		}
		time.Sleep(20 * time.Millisecond) // polling interval
	}

	// Rolling update: SIGTERM while the DaemonSet exists.
	if code := old.Stop(t, syscall.SIGTERM); code != 0 {
		stopStreams()
		t.Fatalf("old pod exit %d:\n%s", code, old.Stderr())
	}
	if !pinned(pinDir) || api.gets.Load() != 1 {
		stopStreams()
		t.Fatalf("rolling update: pinned=%v after %d API reads; the data path must stay for the new pod:\n%s", pinned(pinDir), api.gets.Load(), old.Stderr())
	}
	checkNewConnections(t, dial, "between the old and the new pod")
	next := testutil.StartAgentProc(t, cgroup, pinDir, chartFlags...)
	if !strings.Contains(next.Stderr(), "adopted=true") {
		stopStreams()
		t.Fatalf("the new pod did not adopt the pinned data path:\n%s", next.Stderr())
	}

	// The ConfigMap changes: new connections to the echo port stay on TCP.
	port := strconv.Itoa(int(portOf(t, target)))
	os.WriteFile(policyFile, []byte("exclude_ports: [\""+port+"\"]\n"), 0o644)
	deadline := time.Now().Add(30 * time.Second)
	for {
		pre, _ := ReadPinnedStats(pinDir)
		checkNewConnections(t, dial, "after the policy change")
		post, _ := ReadPinnedStats(pinDir)
		if post.Sub(pre).PassthroughConnections["policy"] >= 10 {
			break
		}
		if time.Now().After(deadline) {
			stopStreams()
			t.Fatalf("the changed policy file was not applied within 30s:\n%s", next.Stderr())
		}
		time.Sleep(100 * time.Millisecond) // polling interval
	}

	// helm uninstall: the DaemonSet is deleted, then the pod stops.
	api.exists.Store(false)
	if code := next.Stop(t, syscall.SIGTERM); code != 0 {
		stopStreams()
		t.Fatalf("new pod exit %d:\n%s", code, next.Stderr())
	}
	if pinned(pinDir) {
		stopStreams()
		t.Fatalf("after helm uninstall the data path is still pinned:\n%s", next.Stderr())
	}
	stopStreams()
	if err := (<-streams).Err(); err != nil {
		t.Fatalf("streams through the chart's rolling update and uninstall: %v", err)
	}
	if entries, _ := os.ReadDir(pinDir); len(entries) != 0 {
		t.Fatalf("pins left after uninstall: %v", entries)
	}
}
