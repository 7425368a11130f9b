// SPDX-License-Identifier: Apache-2.0

package kube

import (
	"context"
	"encoding/pem"
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
)

// apiServer answers GETs of DaemonSets the way the Kubernetes API does: the
// objects it holds by namespace/name, 404 for others, 403 when forbidden.
func apiServer(t *testing.T, forbidden bool, objects map[string]string) *httptest.Server {
	t.Helper()
	s := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		var ns, name string
		if _, err := fmt.Sscanf(strings.ReplaceAll(r.URL.Path, "/", " "), " apis apps v1 namespaces %s daemonsets %s", &ns, &name); err != nil || r.Method != http.MethodGet {
			http.Error(w, "unexpected request "+r.Method+" "+r.URL.Path, http.StatusBadRequest)
			return
		}
		if forbidden {
			w.WriteHeader(http.StatusForbidden)
			fmt.Fprint(w, `{"kind":"Status","apiVersion":"v1","status":"Failure","reason":"Forbidden","code":403,"message":"forbidden: rolebinding removed"}`)
			return
		}
		obj, ok := objects[ns+"/"+name]
		if !ok {
			w.WriteHeader(http.StatusNotFound)
			fmt.Fprintf(w, `{"kind":"Status","apiVersion":"v1","status":"Failure","reason":"NotFound","code":404,"details":{"name":%q,"group":"apps","kind":"daemonsets"}}`, name)
			return
		}
		fmt.Fprint(w, obj)
	}))
	t.Cleanup(s.Close)
	return s
}

func TestDaemonSetStays(t *testing.T) {
	ref := DaemonSetRef{Namespace: "mesh", Name: "meshwarp"}
	live := `{"kind":"DaemonSet","apiVersion":"apps/v1","metadata":{"name":"meshwarp","namespace":"mesh","uid":"1"}}`
	deleting := `{"kind":"DaemonSet","apiVersion":"apps/v1","metadata":{"name":"meshwarp","namespace":"mesh","uid":"1",` +
		`"deletionTimestamp":"2025-01-02T03:04:05Z","finalizers":["foregroundDeletion"]}}`
	for _, tc := range []struct {
		name      string
		forbidden bool
		objects   map[string]string
		want      bool
	}{
		{"rolling update: the daemonset stays", false, map[string]string{"mesh/meshwarp": live}, true},
		{"helm uninstall: the daemonset is gone", false, nil, false},
		{"foreground deletion in progress", false, map[string]string{"mesh/meshwarp": deleting}, false},
		{"unreadable (RBAC gone first)", true, map[string]string{"mesh/meshwarp": live}, false},
		{"another daemonset of the same name elsewhere", false, map[string]string{"other/meshwarp": live}, false},
	} {
		s := apiServer(t, tc.forbidden, tc.objects)
		c, err := newClient(s.URL, nil, bearer("test"))
		if err != nil {
			t.Fatal(err)
		}
		got, why := c.DaemonSetStays(context.Background(), ref)
		if got != tc.want {
			t.Errorf("%s: stays = %v (%s), want %v", tc.name, got, why, tc.want)
		}
	}
	c, _ := newClient("http://"+unusedAddr(t), nil, nil)
	if got, why := c.DaemonSetStays(context.Background(), ref); got || !strings.Contains(why, "unreadable") {
		t.Errorf("no API server: stays = %v (%s), want false, unreadable", got, why)
	}
}

func unusedAddr(t *testing.T) string {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().String()
}

// tokenServer is a TLS API server that records the bearer tokens it sees.
func tokenServer(t *testing.T) (*httptest.Server, *atomic.Value, []byte) {
	t.Helper()
	var seen atomic.Value
	s := httptest.NewTLSServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		seen.Store(r.Header.Get("Authorization"))
		w.Header().Set("Content-Type", "application/json")
		fmt.Fprint(w, `{"metadata":{"name":"meshwarp"}}`)
	}))
	t.Cleanup(s.Close)
	ca := pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: s.Certificate().Raw})
	return s, &seen, ca
}

// In a pod: the service account's CA verifies the server and the token is
// read per request, so a token the kubelet rotated is the one sent.
func TestInClusterRotatedToken(t *testing.T) {
	s, seen, ca := tokenServer(t)
	host, port, _ := net.SplitHostPort(strings.TrimPrefix(s.URL, "https://"))
	t.Setenv("KUBERNETES_SERVICE_HOST", host)
	t.Setenv("KUBERNETES_SERVICE_PORT", port)
	dir := t.TempDir()
	os.WriteFile(filepath.Join(dir, "ca.crt"), ca, 0o644)
	os.WriteFile(filepath.Join(dir, "token"), []byte("first\n"), 0o600)
	c, err := inCluster(dir)
	if err != nil {
		t.Fatal(err)
	}
	ref := DaemonSetRef{Namespace: "mesh", Name: "meshwarp"}
	for _, token := range []string{"first", "rotated"} {
		os.WriteFile(filepath.Join(dir, "token"), []byte(token+"\n"), 0o600)
		if ok, why := c.DaemonSetStays(context.Background(), ref); !ok {
			t.Fatalf("stays = false: %s", why)
		}
		if got := seen.Load(); got != "Bearer "+token {
			t.Errorf("Authorization %q, want Bearer %s", got, token)
		}
	}

	t.Setenv("KUBERNETES_SERVICE_HOST", "")
	if _, err := inCluster(dir); err == nil || !strings.Contains(err.Error(), "not in a pod") {
		t.Errorf("outside a pod: %v", err)
	}
}

func TestKubeconfig(t *testing.T) {
	s, seen, ca := tokenServer(t)
	dir := t.TempDir()
	os.WriteFile(filepath.Join(dir, "ca.pem"), ca, 0o644)
	write := func(user string) string {
		p := filepath.Join(dir, "kubeconfig")
		cfg := fmt.Sprintf(`apiVersion: v1
kind: Config
clusters: [{name: test, cluster: {server: %q, certificate-authority: ca.pem}}]
users: [{name: other, user: {token: wrong}}, {name: agent, user: %s}]
contexts: [{name: test, context: {cluster: test, user: agent}}]
current-context: test
`, s.URL, user)
		if err := os.WriteFile(p, []byte(cfg), 0o600); err != nil {
			t.Fatal(err)
		}
		return p
	}
	ref := DaemonSetRef{Namespace: "mesh", Name: "meshwarp"}
	c, err := NewClient(write("{token: test}"))
	if err != nil {
		t.Fatal(err)
	}
	if ok, why := c.DaemonSetStays(context.Background(), ref); !ok || seen.Load() != "Bearer test" {
		t.Fatalf("stays = %v (%s), Authorization %q", ok, why, seen.Load())
	}
	if _, err := NewClient(write("{exec: {command: aws}}")); err == nil || !strings.Contains(err.Error(), "not supported") {
		t.Errorf("exec plugin: %v", err)
	}
	if _, err := NewClient(filepath.Join(dir, "missing")); err == nil {
		t.Error("a missing kubeconfig was accepted")
	}
}

func TestParseDaemonSetRef(t *testing.T) {
	if r, err := ParseDaemonSetRef("mesh/meshwarp"); err != nil || r.Namespace != "mesh" || r.Name != "meshwarp" {
		t.Fatalf("parse: %+v %v", r, err)
	}
	for _, bad := range []string{"", "meshwarp", "/meshwarp", "mesh/", "a/b/c"} {
		if _, err := ParseDaemonSetRef(bad); err == nil {
			t.Errorf("%q accepted", bad)
		}
	}
}
