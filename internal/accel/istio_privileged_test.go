// SPDX-License-Identifier: Apache-2.0

package accel

import (
	"bytes"
	"encoding/csv"
	"fmt"
	"io"
	"maps"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/meshwarp/meshwarp/internal/testutil"
)

// The Istio-capture topology of issue 2 ("What is accelerated"), built for
// real: two pod network namespaces joined by a veth pair, Istio's iptables
// capture in each (nat OUTPUT -> 15001 for every uid but the sidecar's,
// nat PREROUTING -> 15006), a HAProxy sidecar per pod running as uid 1337,
// an echo app in the server pod and a client in the client pod:
//
//	client pod                                  server pod
//	app --REDIRECT--> haproxy :15001 ==veth==> REDIRECT :15006 haproxy --127.0.0.6--> app :8078
//	    app_to_sidecar        sidecar_to_sidecar                      sidecar_to_app
//
// Everything is created inside namespaces the test owns (meshwarp-t-*,
// veth mw-t-*) and removed on cleanup.

const (
	istioProxyUID   = 1337
	istioProxyUser  = "meshwarp-proxy"
	istioAppPort    = 8078
	istioClientIP   = "10.213.0.1"
	istioServerIP   = "10.213.0.2"
	istioInboundSrc = "127.0.0.6" // Istio's inbound sidecar connects to the app from here
)

// istioIntegrityOpts: >= 50 concurrent connections, random payloads 1 B..64 KB.
var istioIntegrityOpts = testutil.IntegrityOptions{Conns: 64, Messages: 6, MaxSize: 64 << 10, Seed: 1337}

// ensureProxyUser creates the sidecar's user (uid 1337) if no user has that uid.
func ensureProxyUser(t *testing.T) {
	t.Helper()
	if _, err := user.LookupId(strconv.Itoa(istioProxyUID)); err == nil {
		return
	}
	out, err := exec.Command("useradd", "-r", "-u", strconv.Itoa(istioProxyUID), "-M", "-s", "/usr/sbin/nologin", istioProxyUser).CombinedOutput()
	if err != nil {
		// Another test may have created it meanwhile.
		if _, lerr := user.LookupId(strconv.Itoa(istioProxyUID)); lerr != nil {
			t.Fatalf("useradd %s (uid %d): %v\n%s", istioProxyUser, istioProxyUID, err, out)
		}
	}
}

// istioPod is one pod: its netns and its sidecar's stats socket.
type istioPod struct {
	ns        *testutil.Netns
	statsSock string
	proxyLog  *testutil.SyncBuffer
}

// istioTopology builds both pods, the veth between them and the capture
// rules, and starts both sidecars. The caller must already be inside the
// test cgroup so that the sidecars' sockets belong to it.
func istioTopology(t *testing.T) (client, server *istioPod) {
	t.Helper()
	id := strconv.Itoa(os.Getpid() % 100000)
	client = &istioPod{ns: testutil.NewNetns(t, "ic"+id+"c")}
	server = &istioPod{ns: testutil.NewNetns(t, "ic"+id+"s")}

	// The veth is created inside the client pod with its peer directly in
	// the server pod: it never exists in the root namespace.
	vc, vs := "mw-t-"+id+"c", "mw-t-"+id+"s"
	testutil.Run(t, "ip", "-n", client.ns.Name, "link", "add", vc, "type", "veth", "peer", "name", vs, "netns", server.ns.Name)
	t.Cleanup(func() { exec.Command("ip", "-n", client.ns.Name, "link", "del", vc).Run() })
	for _, p := range []struct{ ns, dev, ip string }{{client.ns.Name, vc, istioClientIP}, {server.ns.Name, vs, istioServerIP}} {
		testutil.Run(t, "ip", "-n", p.ns, "addr", "add", p.ip+"/24", "dev", p.dev)
		testutil.Run(t, "ip", "-n", p.ns, "link", "set", p.dev, "up")
	}

	for _, pod := range []*istioPod{client, server} {
		istioCapture(t, pod.ns.Name)
		startSidecar(t, pod)
	}
	return client, server
}

// istioCapture installs Istio-style capture in the pod's nat table, in
// chains of its own.
func istioCapture(t *testing.T, ns string) {
	t.Helper()
	ipt := func(args ...string) {
		t.Helper()
		testutil.Run(t, "ip", append([]string{"netns", "exec", ns, "iptables", "-w", "-t", "nat"}, args...)...)
	}
	ipt("-N", "MESHWARP_T_OUTPUT")
	ipt("-A", "MESHWARP_T_OUTPUT", "-p", "tcp", "-m", "owner", "!", "--uid-owner", strconv.Itoa(istioProxyUID),
		"!", "-d", "127.0.0.0/8", "-j", "REDIRECT", "--to-ports", "15001")
	ipt("-A", "OUTPUT", "-p", "tcp", "-j", "MESHWARP_T_OUTPUT")
	ipt("-N", "MESHWARP_T_INBOUND")
	ipt("-A", "MESHWARP_T_INBOUND", "-p", "tcp", "-j", "REDIRECT", "--to-ports", "15006")
	ipt("-A", "PREROUTING", "-p", "tcp", "-j", "MESHWARP_T_INBOUND")
}

// sidecarConfig is the pod's HAProxy: plain TCP proxying (no splice option:
// splice readers cannot see redirected bytes). The outbound server 0.0.0.0
// without a port forwards to the original destination of the REDIRECTed
// connection (HAProxy reads SO_ORIGINAL_DST); the inbound one forwards to
// the app from 127.0.0.6 like Istio. A connection made straight to a capture
// port (dst_port is the port itself) is refused: that is the readiness
// probe, and forwarding it would loop back into the proxy.
func sidecarConfig(statsSock string) string {
	return fmt.Sprintf(`global
    maxconn 4000
    uid %d
    stats socket %s mode 600 level admin

defaults
    mode tcp
    timeout connect 10s
    timeout client 3m
    timeout server 3m

frontend outbound
    bind 0.0.0.0:15001
    tcp-request connection reject if { dst_port 15001 }
    default_backend outbound_orig_dst

backend outbound_orig_dst
    server orig 0.0.0.0

frontend inbound
    bind 0.0.0.0:15006
    tcp-request connection reject if { dst_port 15006 }
    default_backend inbound_app

backend inbound_app
    server app 127.0.0.1:%d source %s
`, istioProxyUID, statsSock, istioAppPort, istioInboundSrc)
}

// startSidecar runs HAProxy in the foreground inside the pod (and, through
// this process, inside the test cgroup) and waits until both capture ports
// accept connections.
func startSidecar(t *testing.T, pod *istioPod) {
	t.Helper()
	dir := t.TempDir()
	pod.statsSock = filepath.Join(dir, "haproxy.sock")
	cfg := filepath.Join(dir, "haproxy.cfg")
	if err := os.WriteFile(cfg, []byte(sidecarConfig(pod.statsSock)), 0o644); err != nil {
		t.Fatal(err)
	}
	pod.proxyLog = &testutil.SyncBuffer{}
	cmd := exec.Command("ip", "netns", "exec", pod.ns.Name, "haproxy", "-f", cfg, "-db")
	cmd.Stdout, cmd.Stderr = pod.proxyLog, pod.proxyLog
	if err := cmd.Start(); err != nil {
		t.Fatalf("start haproxy in %s: %v", pod.ns.Name, err)
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	t.Cleanup(func() {
		cmd.Process.Kill()
		<-exited
		if t.Failed() {
			t.Logf("haproxy in %s:\n%s", pod.ns.Name, pod.proxyLog.String())
		}
	})

	deadline := time.Now().Add(time.Minute)
	for _, port := range []int{15001, 15006} {
		addr := net.JoinHostPort("127.0.0.1", strconv.Itoa(port))
		for {
			err := pod.ns.Do(func() error {
				c, err := net.DialTimeout("tcp4", addr, time.Second)
				if err == nil {
					c.Close()
				}
				return err
			})
			if err == nil {
				break
			}
			select {
			case err := <-exited:
				t.Fatalf("haproxy in %s exited: %v\n%s", pod.ns.Name, err, pod.proxyLog.String())
			case <-time.After(20 * time.Millisecond): // poll interval, not a wait for a condition
			}
			if time.Now().After(deadline) {
				t.Fatalf("haproxy in %s does not listen on %s: %v\n%s", pod.ns.Name, addr, err, pod.proxyLog.String())
			}
		}
	}
}

// proxyStats reads HAProxy's "show stat" CSV, keyed "proxy/server" (server
// "FRONTEND" or "BACKEND" for a proxy's totals), each row by column name.
func proxyStats(t *testing.T, pod *istioPod) map[string]map[string]string {
	t.Helper()
	c, err := net.DialTimeout("unix", pod.statsSock, 10*time.Second)
	if err != nil {
		t.Fatalf("haproxy stats socket of %s: %v", pod.ns.Name, err)
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(10 * time.Second))
	if _, err := io.WriteString(c, "show stat\n"); err != nil {
		t.Fatal(err)
	}
	raw, err := io.ReadAll(c)
	if err != nil {
		t.Fatal(err)
	}
	raw = bytes.TrimPrefix(bytes.TrimSpace(raw), []byte("# "))
	r := csv.NewReader(bytes.NewReader(raw))
	r.FieldsPerRecord = -1
	rows, err := r.ReadAll()
	if err != nil || len(rows) < 2 {
		t.Fatalf("haproxy show stat of %s: %v\n%s", pod.ns.Name, err, raw)
	}
	head := rows[0]
	out := map[string]map[string]string{}
	for _, row := range rows[1:] {
		if len(row) < 2 {
			continue
		}
		m := map[string]string{}
		for i, h := range head {
			if i < len(row) {
				m[h] = row[i]
			}
		}
		out[row[0]+"/"+row[1]] = m
	}
	return out
}

func statNum(t *testing.T, st map[string]map[string]string, key, field string) int64 {
	t.Helper()
	row, ok := st[key]
	if !ok {
		t.Fatalf("haproxy stats have no %s", key)
	}
	if row[field] == "" {
		return 0
	}
	n, err := strconv.ParseInt(row[field], 10, 64)
	if err != nil {
		t.Fatalf("haproxy stat %s %s=%q: %v", key, field, row[field], err)
	}
	return n
}

// sourceRecorder records the source address of every accepted connection.
type sourceRecorder struct {
	net.Listener
	mu      sync.Mutex
	sources map[netip.Addr]int
}

func (l *sourceRecorder) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err == nil {
		ap := c.RemoteAddr().(*net.TCPAddr).AddrPort()
		l.mu.Lock()
		l.sources[ap.Addr().Unmap()]++
		l.mu.Unlock()
	}
	return c, err
}

func (l *sourceRecorder) snapshot() map[netip.Addr]int {
	l.mu.Lock()
	defer l.mu.Unlock()
	m := make(map[netip.Addr]int, len(l.sources))
	for k, v := range l.sources {
		m[k] = v
	}
	return m
}

func TestPrivilegedIstioCapture(t *testing.T) {
	testutil.RequirePrivileged(t)
	for _, tool := range []string{"haproxy", "iptables", "ip"} {
		if _, err := exec.LookPath(tool); err != nil {
			t.Fatalf("%s not installed (scripts/install-deps.sh installs it): %v", tool, err)
		}
	}
	ensureProxyUser(t)
	// Join the cgroup before starting the sidecars: they inherit it, so
	// their sockets are seen by sock_ops like the test's own.
	cg := testutil.EnterCgroup(t)
	client, server := istioTopology(t)

	dial := func() (net.Conn, error) {
		var c net.Conn
		err := client.ns.Do(func() error {
			var err error
			c, err = net.DialTimeout("tcp4", net.JoinHostPort(istioServerIP, strconv.Itoa(istioAppPort)), 30*time.Second)
			return err
		})
		return c, err
	}

	apps := []struct{ name, network, addr string }{
		{"app-ipv4", "tcp4", "0.0.0.0:" + strconv.Itoa(istioAppPort)},
		// Dual-stack listener: the sidecar's IPv4 connection arrives v4-mapped.
		{"app-dual-stack", "tcp", "[::]:" + strconv.Itoa(istioAppPort)},
	}
	for _, app := range apps {
		for _, withAgent := range []bool{false, true} {
			name := app.name + "/without-agent"
			if withAgent {
				name = app.name + "/with-agent"
			}
			t.Run(name, func(t *testing.T) {
				var ln net.Listener
				if err := server.ns.Do(func() error {
					var err error
					ln, err = net.Listen(app.network, app.addr)
					return err
				}); err != nil {
					t.Fatalf("listen %s %s in %s: %v", app.network, app.addr, server.ns.Name, err)
				}
				rec := &sourceRecorder{Listener: ln, sources: map[netip.Addr]int{}}
				echo := testutil.ServeEcho(rec)
				defer echo.Close()

				var a *Agent
				if withAgent {
					a = startAgent(t, Config{CgroupPath: cg, SidecarUID: istioProxyUID})
				}
				outBefore, inBefore := proxyStats(t, client), proxyStats(t, server)

				res := testutil.CheckIntegrity(dial, istioIntegrityOpts)
				t.Logf("integrity: %d conns, sent %d bytes, echoed %d", res.Conns, res.BytesSent, res.BytesEcho)
				if err := res.Err(); err != nil {
					t.Error(err)
				}

				// The proxies' own evidence that every connection went through both sidecars.
				outAfter, inAfter := proxyStats(t, client), proxyStats(t, server)
				n := int64(istioIntegrityOpts.Conns)
				for _, c := range []struct {
					pod           string
					before, after map[string]map[string]string
					key           string
				}{
					{"client pod", outBefore, outAfter, "outbound/FRONTEND"},
					{"client pod", outBefore, outAfter, "outbound_orig_dst/orig"},
					{"server pod", inBefore, inAfter, "inbound/FRONTEND"},
					{"server pod", inBefore, inAfter, "inbound_app/app"},
				} {
					d := statNum(t, c.after, c.key, "stot") - statNum(t, c.before, c.key, "stot")
					t.Logf("%s haproxy %s: %d sessions", c.pod, c.key, d)
					if d < n {
						t.Errorf("%s haproxy %s handled %d sessions, want >= %d: traffic bypassed the sidecar", c.pod, c.key, d, n)
					}
				}
				for _, key := range []string{"outbound_orig_dst/orig", "inbound_app/app"} {
					st := outAfter
					if strings.HasPrefix(key, "inbound") {
						st = inAfter
					}
					if e := statNum(t, st, key, "econ"); e > 0 {
						t.Logf("haproxy %s: %d connection errors", key, e)
					}
				}
				want := map[netip.Addr]int{netip.MustParseAddr(istioInboundSrc): istioIntegrityOpts.Conns}
				if got := rec.snapshot(); !maps.Equal(got, want) {
					t.Errorf("app accepted connections from %v, want all %d from the inbound sidecar's %s", got, istioIntegrityOpts.Conns, istioInboundSrc)
				}
				if r := echo.Resets.Load(); r != 0 {
					t.Errorf("app saw %d connections end in an error", r)
				}

				if a == nil {
					return
				}
				s := stats(t, a)
				t.Logf("agent: paired sockets %d, redirected %d msgs / %d bytes, passthrough %d msgs / %d bytes",
					s.PairedSockets, s.RedirectedMessages, s.RedirectedBytes, s.PassthroughMessages, s.PassthroughBytes)
				t.Logf("agent: passthrough connections by reason %v, messages by reason %v", s.PassthroughConnections, s.PassthroughByReason)
				for _, hop := range HopNames() {
					h := s.Hops[hop]
					t.Logf("agent: hop %-18s paired %4d conns, redirected %6d msgs / %9d bytes", hop, h.PairedConnections, h.RedirectedMessages, h.RedirectedBytes)
				}
				for _, hop := range []string{"app_to_sidecar", "sidecar_to_sidecar", "sidecar_to_app"} {
					h := s.Hops[hop]
					if h.PairedConnections == 0 || h.RedirectedBytes == 0 {
						t.Errorf("hop %s was not accelerated: %+v (passthrough connections by reason: %v)", hop, h, s.PassthroughConnections)
					}
				}
			})
		}
	}
}
