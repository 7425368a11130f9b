// SPDX-License-Identifier: Apache-2.0

package lab

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/netip"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/meshwarp/meshwarp/internal/testutil"
)

// The privileged tests build the one lab the machine can have (fixed names),
// so they run one after another and refuse to start over a lab they did not
// build: run them with `go test -p 1` next to other packages that use the lab.

const forceEnv = "MESHWARP_LAB_TEST_FORCE" // =1: take down an existing lab first

func requireNoLab(t *testing.T) {
	t.Helper()
	testutil.RequirePrivileged(t)
	if left := Leftovers(); len(left) > 0 {
		if os.Getenv(forceEnv) == "" {
			t.Fatalf("a lab (or its leftovers) exists: %v; these tests would destroy it. "+
				"Run `meshwarp lab down` first (or set %s=1)", left, forceEnv)
		}
		if err := Down(context.Background(), testLogger(t)); err != nil {
			t.Fatal(err)
		}
	}
}

type testWriter struct{ t *testing.T }

func (w testWriter) Write(p []byte) (int, error) {
	w.t.Helper()
	w.t.Log(strings.TrimRight(string(p), "\n"))
	return len(p), nil
}

func testLogger(t *testing.T) *slog.Logger {
	return slog.New(slog.NewTextHandler(testWriter{t}, &slog.HandlerOptions{Level: slog.LevelInfo}))
}

// upForTest brings the lab up and registers a cleanup that takes it down
// and checks nothing is left, also when the test failed.
func upForTest(t *testing.T, opts Options) *Lab {
	t.Helper()
	requireNoLab(t)
	linksBefore := rootLabLinks(t)
	t.Cleanup(func() {
		var pids []int
		if l, err := Load(); err == nil {
			pids = labPids(t, l)
			l.Close()
		}
		if err := Down(context.Background(), testLogger(t)); err != nil {
			t.Errorf("cleanup: %v", err)
		}
		assertLabGone(t, pids, linksBefore)
	})
	l, err := Up(context.Background(), opts, testLogger(t))
	if err != nil {
		t.Fatalf("lab up: %v", err)
	}
	t.Cleanup(func() { l.Close() })
	return l
}

func labPids(t *testing.T, l *Lab) []int {
	t.Helper()
	st, err := l.Status()
	if err != nil {
		t.Fatalf("status: %v", err)
	}
	var pids []int
	for _, p := range st.Pods {
		for _, pr := range p.Processes {
			if pr.Alive {
				pids = append(pids, pr.PID)
			}
		}
	}
	return append(pids, cgroupPids(l.CgroupPath())...)
}

// rootLabLinks lists links with the lab's prefix in the root namespace
// (there must never be any).
func rootLabLinks(t *testing.T) []string {
	t.Helper()
	out, err := exec.Command("ip", "-o", "link", "show").Output()
	if err != nil {
		t.Fatalf("ip link: %v", err)
	}
	var links []string
	for _, line := range strings.Split(string(out), "\n") {
		if f := strings.Fields(line); len(f) > 1 && strings.HasPrefix(f[1], "mw-") {
			links = append(links, f[1])
		}
	}
	return links
}

// assertLabGone checks that nothing of the lab is left: namespaces, its cgroup,
// its run directory, its processes and links in the root namespace.
func assertLabGone(t *testing.T, pids []int, rootLinksBefore []string) {
	t.Helper()
	if ns := labNetnsOnDisk(); len(ns) > 0 {
		t.Errorf("namespaces left: %v", ns)
	}
	cg, _ := cgroupPath()
	if exists(cg) {
		t.Errorf("cgroup left: %s", cg)
	}
	if exists(RunDir) {
		t.Errorf("%s left", RunDir)
	}
	for _, p := range pids {
		if readProc(p).alive {
			t.Errorf("process %d left running", p)
		}
	}
	if got := rootLabLinks(t); len(got) != len(rootLinksBefore) {
		t.Errorf("links in the root namespace: before %v, after %v", rootLinksBefore, got)
	}
	if out, _ := exec.Command("pgrep", "-af", RunDir).Output(); len(bytes.TrimSpace(out)) > 0 {
		t.Errorf("processes using %s left:\n%s", RunDir, out)
	}
	if len(Leftovers()) > 0 {
		t.Errorf("Leftovers() = %v after down", Leftovers())
	}
}

func TestPrivilegedUpDownLeavesNothing(t *testing.T) {
	requireNoLab(t)
	ctx := context.Background()
	linksBefore := rootLabLinks(t)
	if _, err := Load(); !errors.Is(err, ErrNotUp) {
		t.Fatalf("Load with no lab: %v, want ErrNotUp", err)
	}
	for round := range 2 {
		t.Logf("round %d", round)
		l, err := Up(ctx, Options{Pods: 3, Capture: true}, testLogger(t))
		if err != nil {
			Down(ctx, testLogger(t))
			t.Fatalf("up: %v", err)
		}
		pids := labPids(t, l)
		if len(pids) < 2*(2+3) { // 3 haproxy + 2x(apps, qperf), from status and from the cgroup
			t.Errorf("expected 7 processes twice, got %v", pids)
		}
		st, err := l.Status()
		if err != nil || !st.Healthy {
			t.Errorf("status after up: healthy=%v problems=%v err=%v", st.Healthy, st.Problems, err)
		}
		if got := rootLabLinks(t); len(got) != len(linksBefore) {
			t.Errorf("lab created links in the root namespace: %v", got)
		}
		// the pods' own sysctls (per network namespace)
		for _, p := range l.Pods() {
			for _, kv := range PodSysctls {
				key := strings.ReplaceAll(kv[0], "/", ".")
				out, err := exec.Command("ip", "netns", "exec", p.Netns, "sysctl", "-n", key).Output()
				if got := strings.Join(strings.Fields(string(out)), " "); err != nil || got != kv[1] {
					t.Errorf("%s in %s: %q (%v), want %q", key, p.Name, got, err, kv[1])
				}
			}
		}

		// up twice is harmless: same processes, still healthy.
		l2, err := Up(ctx, Options{Pods: 3, Capture: true}, testLogger(t))
		if err != nil {
			t.Fatalf("second up: %v", err)
		}
		if again := labPids(t, l2); fmt.Sprint(again) != fmt.Sprint(pids) {
			t.Errorf("second up restarted processes: %v -> %v", pids, again)
		}
		if _, err := Up(ctx, Options{Pods: 2}, testLogger(t)); err == nil || !strings.Contains(err.Error(), "lab down") {
			t.Errorf("up with another pod count: %v, want an error naming `meshwarp lab down`", err)
		}
		l.Close()
		l2.Close()

		if err := Down(ctx, testLogger(t)); err != nil {
			t.Fatalf("down: %v", err)
		}
		assertLabGone(t, pids, linksBefore)
	}
	if err := Down(ctx, testLogger(t)); err != nil {
		t.Errorf("down without a lab: %v", err)
	}
}

// podHTTPClient makes HTTP requests from inside a pod (as root, so capture
// applies to them like to any app).
func podHTTPClient(pod Pod) (*http.Client, *http.Transport) {
	tr := &http.Transport{
		DialContext: func(ctx context.Context, network, addr string) (net.Conn, error) {
			return dialIn(ctx, pod.Netns, network, addr)
		},
		MaxIdleConnsPerHost: 1,
	}
	return &http.Client{Transport: tr, Timeout: 10 * time.Second}, tr
}

func statsOf(t *testing.T, l *Lab, pod Pod) map[string]ProxyStat {
	t.Helper()
	stats, err := l.SidecarStats(context.Background(), pod)
	if err != nil {
		t.Fatal(err)
	}
	m := map[string]ProxyStat{}
	for _, s := range stats {
		m[s.Proxy+"/"+s.Kind] = s
	}
	return m
}

type hop struct{ pod, key string }

// sidecarDelta returns how many sessions and HTTP requests each hop gained.
func sidecarDelta(before, after map[hop]ProxyStat) map[hop][2]uint64 {
	d := map[hop][2]uint64{}
	for k, a := range after {
		b := before[k]
		d[k] = [2]uint64{a.Sessions - b.Sessions, a.Requests - b.Requests}
	}
	return d
}

func snapshotStats(t *testing.T, l *Lab) map[hop]ProxyStat {
	t.Helper()
	out := map[hop]ProxyStat{}
	for _, p := range []Pod{l.Client(), l.Server()} {
		for k, s := range statsOf(t, l, p) {
			out[hop{p.Name, k}] = s
		}
	}
	return out
}

// waitIdle polls until no sidecar holds a connection and no TCP connection
// is established in any pod: no server connection outlives the client
// connection that caused it (an idle pooled connection would show in ss, not
// in HAProxy's session counts).
func waitIdle(t *testing.T, l *Lab) {
	t.Helper()
	var busy []string
	err := poll(context.Background(), 10*time.Second, 20*time.Millisecond, func() (bool, error) {
		busy = nil
		for h, s := range snapshotStats(t, l) {
			if s.Current != 0 {
				busy = append(busy, fmt.Sprintf("%s %s: %d", h.pod, h.key, s.Current))
			}
		}
		for _, p := range l.Pods() {
			out, err := l.r.inNetns(context.Background(), p.Netns, "ss", "-Htn", "state", "established")
			if err != nil {
				return false, err
			}
			if out = strings.TrimSpace(out); out != "" {
				busy = append(busy, p.Name+" established: "+out)
			}
		}
		return len(busy) == 0, nil
	})
	if err != nil {
		t.Errorf("sidecar connections still open after the client closed: %v", busy)
	}
}

func TestPrivilegedTrafficThroughSidecars(t *testing.T) {
	ctx := context.Background()
	l := upForTest(t, Options{Pods: 2, Capture: true})
	client, server := l.Client(), l.Server()
	url := fmt.Sprintf("http://%s:%d/", server.IP, HTTPPort)

	request := func(hc *http.Client, path, body string) string {
		t.Helper()
		resp, err := hc.Post(url+path, "text/plain", strings.NewReader(body))
		if err != nil {
			t.Fatalf("POST %s%s from %s: %v", url, path, client.Name, err)
		}
		defer resp.Body.Close()
		b, err := io.ReadAll(resp.Body)
		if err != nil || resp.StatusCode != 200 {
			t.Fatalf("POST %s%s: %s %v", url, path, resp.Status, err)
		}
		return string(b)
	}

	t.Run("capture on: HTTP through both sidecars", func(t *testing.T) {
		before := snapshotStats(t, l)
		hc, tr := podHTTPClient(client)
		const n = 5
		for i := range n {
			body := fmt.Sprintf("hello %d through the mesh", i)
			if got := request(hc, "echo", body); got != body {
				t.Errorf("echo: got %q, want %q", got, body)
			}
		}
		if dbg := request(hc, "debug", ""); !strings.Contains(dbg, "request from "+InboundSource+":") {
			t.Errorf("app did not see the inbound sidecar's source %s:\n%.300s", InboundSource, dbg)
		}
		tr.CloseIdleConnections()
		d := sidecarDelta(before, snapshotStats(t, l))
		// one keep-alive connection, n+1 requests, through each hop
		for _, h := range []hop{{"pod-0", "outbound/frontend"}, {"pod-1", "inbound/frontend"}} {
			if d[h][0] != 1 {
				t.Errorf("%v: %d new connections, want 1 (deltas %v)", h, d[h][0], d)
			}
		}
		for _, h := range []hop{{"pod-0", "outbound_http/backend"}, {"pod-1", "inbound_http/backend"}} {
			if d[h][1] != n+1 {
				t.Errorf("%v: %d HTTP requests, want %d (mode http parses them)", h, d[h][1], n+1)
			}
		}
		waitIdle(t, l)
	})

	t.Run("capture on: TCP echo byte-exact through both sidecars", func(t *testing.T) {
		before := snapshotStats(t, l)
		payload := make([]byte, 4<<20)
		rand.Read(payload)
		c, err := dialIn(ctx, client.Netns, "tcp", fmt.Sprintf("%s:%d", server.IP, TCPEchoPort))
		if err != nil {
			t.Fatal(err)
		}
		_ = c.SetDeadline(time.Now().Add(30 * time.Second))
		werr := make(chan error, 1)
		go func() {
			_, err := c.Write(payload)
			werr <- err
		}()
		got := make([]byte, len(payload))
		if _, err := io.ReadFull(c, got); err != nil {
			t.Fatalf("read echo: %v", err)
		}
		if err := <-werr; err != nil {
			t.Fatalf("write: %v", err)
		}
		c.Close()
		if !bytes.Equal(got, payload) {
			t.Fatal("echo differs from what was sent")
		}
		d := sidecarDelta(before, snapshotStats(t, l))
		for _, h := range []hop{{"pod-0", "outbound_tcp/backend"}, {"pod-1", "inbound_tcp/backend"}} {
			if d[h][0] != 1 {
				t.Errorf("%v: %d connections, want 1 (deltas %v)", h, d[h][0], d)
			}
		}
		waitIdle(t, l)
	})

	t.Run("Command runs in the pod netns and the lab cgroup", func(t *testing.T) {
		out, err := l.Command(ctx, client, "sh", "-c", "cat /proc/self/cgroup; readlink /proc/self/ns/net").CombinedOutput()
		if err != nil {
			t.Fatalf("%v: %s", err, out)
		}
		ns, _ := statNs(netnsPath(client.Netns))
		if !strings.Contains(string(out), "0::"+cgroupRel+"\n") || !strings.Contains(string(out), fmt.Sprintf("net:[%d]", ns.ino)) {
			t.Errorf("Command output %q: want cgroup %s and net:[%d]", out, cgroupRel, ns.ino)
		}
	})

	t.Run("qperf through the sidecars", func(t *testing.T) {
		before := snapshotStats(t, l)
		out, err := l.Command(ctx, client, "qperf", server.IP.String(), "-lp", fmt.Sprint(QperfPort),
			"-t", "1", "-m", "64", "tcp_lat").CombinedOutput()
		if err != nil || !strings.Contains(string(out), "latency") {
			t.Fatalf("qperf: %v\n%s", err, out)
		}
		d := sidecarDelta(before, snapshotStats(t, l))
		// control connection to :19765 and a data connection to qperf's own port
		if h := (hop{"pod-1", "inbound_tcp/backend"}); d[h][0] < 2 {
			t.Errorf("qperf: %d connections through the server sidecar, want >= 2", d[h][0])
		}
	})

	t.Run("capture off: direct", func(t *testing.T) {
		if err := l.SetCapture(false); err != nil {
			t.Fatal(err)
		}
		if l.Capture() {
			t.Error("Capture() = true after SetCapture(false)")
		}
		if st, _ := l.Status(); !st.Healthy || st.Pods[0].Capture || st.Pods[1].Capture {
			t.Errorf("status with capture off: %+v", st)
		}
		before := snapshotStats(t, l)
		hc, tr := podHTTPClient(client)
		if dbg := request(hc, "debug", ""); !strings.Contains(dbg, "request from "+client.IP.String()+":") {
			t.Errorf("capture off: app did not see the client's own address %s:\n%.300s", client.IP, dbg)
		}
		tr.CloseIdleConnections()
		if err := l.echo(ctx, client, netipAddrPort(server, TCPEchoPort), []byte("direct\n")); err != nil {
			t.Errorf("tcp echo direct: %v", err)
		}
		for h, v := range sidecarDelta(before, snapshotStats(t, l)) {
			if v != [2]uint64{} {
				t.Errorf("capture off, yet %v counted %v", h, v)
			}
		}
		// Load sees what SetCapture recorded.
		if l2, err := Load(); err != nil || l2.Capture() {
			t.Errorf("Load after SetCapture(false): capture=%v err=%v", l2 != nil && l2.Capture(), err)
		}
		if err := l.SetCapture(true); err != nil {
			t.Fatal(err)
		}
		if err := l.checkEndToEnd(ctx); err != nil {
			t.Errorf("capture back on: %v", err)
		}
	})

	t.Run("RestartSidecars", func(t *testing.T) {
		old := []int{ownedPid("pod-0", client.Netns, procSidecar), ownedPid("pod-1", server.Netns, procSidecar)}
		if err := l.RestartSidecars(ctx); err != nil {
			t.Fatal(err)
		}
		for i, p := range []Pod{client, server} {
			now := ownedPid(p.Name, p.Netns, procSidecar)
			if now == 0 || now == old[i] || readProc(old[i]).alive {
				t.Errorf("%s: haproxy pid %d -> %d (old alive: %v)", p.Name, old[i], now, readProc(old[i]).alive)
			}
		}
		if err := l.checkEndToEnd(ctx); err != nil {
			t.Errorf("after restart: %v", err)
		}
	})

	t.Run("up repairs a dead process", func(t *testing.T) {
		pid := ownedPid(server.Name, server.Netns, procApps)
		syscall.Kill(pid, syscall.SIGKILL)
		if left := waitExited(ctx, []int{pid}, 5*time.Second); len(left) > 0 {
			t.Fatalf("apps %d did not die", pid)
		}
		if st, _ := l.Status(); st.Healthy {
			t.Error("status healthy with the apps dead")
		}
		l2, err := Up(ctx, Options{Pods: 2, Capture: true}, testLogger(t))
		if err != nil {
			t.Fatalf("repair up: %v", err)
		}
		defer l2.Close()
		if st, _ := l2.Status(); !st.Healthy {
			t.Errorf("after repair: %v", st.Problems)
		}
	})
}

// TestPrivilegedCrashHelper is not a test: TestPrivilegedDownAfterCrash runs
// the test binary with it selected, and it kills itself during Up.
func TestPrivilegedCrashHelper(t *testing.T) {
	step := os.Getenv("MESHWARP_LAB_TEST_CRASH_AFTER")
	if step == "" {
		t.Skip("helper process for TestPrivilegedDownAfterCrash")
	}
	testHookAfterStep = func(s string) {
		if s == step {
			syscall.Kill(os.Getpid(), syscall.SIGKILL)
		}
	}
	nodes, _ := strconv.Atoi(os.Getenv("MESHWARP_LAB_TEST_CRASH_NODES"))
	_, err := Up(context.Background(), Options{Pods: 2, Nodes: nodes, Capture: true}, testLogger(t))
	t.Fatalf("Up returned (%v) instead of being killed after %s", err, step)
}

func crashUp(t *testing.T, step string, nodes int) {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^TestPrivilegedCrashHelper$", "-test.v")
	cmd.Env = append(os.Environ(), "MESHWARP_LAB_TEST_CRASH_AFTER="+step, fmt.Sprintf("MESHWARP_LAB_TEST_CRASH_NODES=%d", nodes))
	out, err := cmd.CombinedOutput()
	var ee *exec.ExitError
	if !errors.As(err, &ee) || ee.Sys().(syscall.WaitStatus).Signal() != syscall.SIGKILL {
		t.Fatalf("helper was not killed during up (%v):\n%s", err, out)
	}
}

func TestPrivilegedDownAfterCrash(t *testing.T) {
	requireNoLab(t)
	ctx := context.Background()
	linksBefore := rootLabLinks(t)
	t.Cleanup(func() { Down(context.Background(), testLogger(t)) })
	cg, _ := cgroupPath()

	t.Run("after namespaces, before sidecars, two nodes", func(t *testing.T) {
		crashUp(t, "iptables", 2)
		if len(labNetnsOnDisk()) != 4 {
			t.Fatalf("crash left %v, want 4 namespaces (2 nodes, 2 pods)", labNetnsOnDisk())
		}
		if _, err := Load(); err == nil {
			t.Error("Load accepted a half-built lab")
		}
		if err := Down(ctx, testLogger(t)); err != nil {
			t.Fatal(err)
		}
		assertLabGone(t, nil, linksBefore)
	})

	t.Run("after sidecars started, before ready", func(t *testing.T) {
		crashUp(t, "daemons", 1)
		pids := cgroupPids(cg)
		if len(pids) < 4 { // 3 + haproxy in the client pod; a qperf server may have forked
			t.Fatalf("crash left processes %v, want at least 4", pids)
		}
		if err := Down(ctx, testLogger(t)); err != nil {
			t.Fatal(err)
		}
		assertLabGone(t, pids, linksBefore)
	})

	t.Run("up after a crash rebuilds", func(t *testing.T) {
		crashUp(t, "daemons", 1)
		pids := cgroupPids(cg)
		l, err := Up(ctx, Options{Pods: 2, Capture: true}, testLogger(t))
		if err != nil {
			t.Fatalf("up over a crashed up: %v", err)
		}
		defer l.Close()
		for _, p := range pids {
			if readProc(p).alive {
				t.Errorf("process %d of the crashed up still runs", p)
			}
		}
		if st, _ := l.Status(); !st.Healthy {
			t.Errorf("rebuilt lab: %v", st.Problems)
		}
		all := labPids(t, l)
		if err := Down(ctx, testLogger(t)); err != nil {
			t.Fatal(err)
		}
		assertLabGone(t, all, linksBefore)
	})
}

func netipAddrPort(p Pod, port int) netip.AddrPort { return netip.AddrPortFrom(p.IP, uint16(port)) }

// TestPrivilegedTwoNodes: with --nodes 2 the client and the server live on
// different nodes, and their traffic (captured IPv4 through both sidecars,
// direct IPv6) is routed by both node namespaces across the wire.
func TestPrivilegedTwoNodes(t *testing.T) {
	ctx := context.Background()
	l := upForTest(t, Options{Pods: 3, Nodes: 2, Capture: true})
	client, server := l.Client(), l.Server()
	if client.Node != 0 || server.Node != 1 || l.Pods()[2].Node != 0 {
		t.Fatalf("pods on nodes %d, %d, %d: want 0, 1, 0", client.Node, server.Node, l.Pods()[2].Node)
	}
	st, err := l.Status()
	if err != nil || !st.Healthy || len(st.Nodes) != 2 || st.Nodes[1].Netns != "meshwarp-node-1" || st.Pods[1].Node != "meshwarp-node-1" {
		t.Fatalf("status: %+v, %v", st, err)
	}
	for i, n := range st.Nodes {
		if n.Cgroup != l.NodeCgroup(i) || !strings.HasSuffix(n.Cgroup, fmt.Sprintf("/node-%d", i)) {
			t.Errorf("status node %d: cgroup %q, want %q", i, n.Cgroup, l.NodeCgroup(i))
		}
	}
	wireBytes := func(node Node) uint64 {
		out, err := l.r.ip(ctx, "-n", node.Netns, "-j", "-s", "link", "show", "dev", WireName)
		if err != nil {
			t.Fatal(err)
		}
		var links []struct {
			Stats struct {
				TX struct{ Bytes uint64 } `json:"tx"`
			} `json:"stats64"`
		}
		if err := json.Unmarshal([]byte(out), &links); err != nil || len(links) != 1 {
			t.Fatalf("ip -j -s link: %v: %s", err, out)
		}
		return links[0].Stats.TX.Bytes
	}
	payload := make([]byte, 1<<20)
	rand.Read(payload)
	for _, to := range []netip.AddrPort{netipAddrPort(server, TCPEchoPort), netip.AddrPortFrom(server.IP6, TCPEchoPort)} {
		before := [2]uint64{wireBytes(l.Nodes()[0]), wireBytes(l.Nodes()[1])}
		c, err := dialIn(ctx, client.Netns, "tcp", to.String())
		if err != nil {
			t.Fatalf("dial %s: %v", to, err)
		}
		_ = c.SetDeadline(time.Now().Add(30 * time.Second))
		go c.Write(payload)
		got := make([]byte, len(payload))
		if _, err := io.ReadFull(c, got); err != nil || !bytes.Equal(got, payload) {
			t.Errorf("echo of 1 MiB to %s across nodes: %v, intact %v", to, err, bytes.Equal(got, payload))
		}
		c.Close()
		after := [2]uint64{wireBytes(l.Nodes()[0]), wireBytes(l.Nodes()[1])}
		if after[0]-before[0] < uint64(len(payload)) || after[1]-before[1] < uint64(len(payload)) {
			t.Errorf("echo to %s: wire sent %d and %d bytes each way, want >= %d: not routed across the wire",
				to, after[0]-before[0], after[1]-before[1], len(payload))
		}
	}
	// Captured IPv4 went through both sidecars; the app saw the inbound one.
	hc, tr := podHTTPClient(client)
	resp, err := hc.Get(fmt.Sprintf("http://%s/debug", netipAddrPort(server, HTTPPort)))
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	tr.CloseIdleConnections()
	if !strings.Contains(string(b), "request from "+InboundSource+":") {
		t.Errorf("across nodes the app did not see the inbound sidecar's source:\n%.300s", b)
	}
	// A pod on the client's node is reached over its bridge, not the wire.
	if err := l.echo(ctx, client, netipAddrPort(l.Pods()[2], TCPEchoPort), []byte("same node\n")); err != nil {
		t.Errorf("echo to pod-2 on the same node: %v", err)
	}
	if _, err := Up(ctx, Options{Pods: 3, Nodes: 1}, testLogger(t)); err == nil || !strings.Contains(err.Error(), "lab down") {
		t.Errorf("up with another node count: %v, want an error naming `meshwarp lab down`", err)
	}
}
