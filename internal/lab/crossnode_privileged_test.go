// SPDX-License-Identifier: Apache-2.0

package lab

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http/httptest"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/meshwarp/meshwarp/internal/accel"
	"github.com/meshwarp/meshwarp/internal/crossnode"
	"github.com/meshwarp/meshwarp/internal/metrics"
	"github.com/meshwarp/meshwarp/internal/netns"
	"github.com/meshwarp/meshwarp/internal/testutil"
	"github.com/meshwarp/meshwarp/internal/testutil/agenttest"
)

// Cross-node forwarding on the two-node lab: the client pod on node 0, the
// server pod on node 1, Istio capture in both. IPv4 goes through both
// sidecars (the sidecar-to-sidecar hop crosses the nodes), IPv6 directly
// (the lab captures IPv4 only). Every case runs with and without the
// agents, with the same assertions. As on real nodes there is one agent per
// node, on the node's cgroup: the lab's nodes share one kernel, and one
// agent over both would pair the sockets of the two nodes directly.

const crossNodePort = 8077

var crossNodeIntegrityOpts = testutil.IntegrityOptions{Conns: 16, Messages: 8, MaxSize: 64 << 10, Seed: 14}

// nodeCookie is the network namespace cookie of a node (what the status
// reports its state under).
func nodeCookie(t *testing.T, name string) uint64 {
	t.Helper()
	cookie, err := netns.Cookie(netnsPath(name))
	if err != nil {
		t.Fatal(err)
	}
	return cookie
}

// crossNodeStats sums the counters of the agents pinned at pinDirs.
func crossNodeStats(t *testing.T, pinDirs ...string) crossnode.Stats {
	t.Helper()
	sum := crossnode.Stats{RedirectedPackets: map[string]uint64{}, RedirectedBytes: map[string]uint64{}, PassedPackets: map[string]uint64{}}
	for _, dir := range pinDirs {
		s, err := crossnode.ReadPinnedStats(dir)
		if err != nil {
			t.Fatalf("cross-node stats of %s: %v", dir, err)
		}
		for k, v := range s.RedirectedPackets {
			sum.RedirectedPackets[k] += v
		}
		for k, v := range s.RedirectedBytes {
			sum.RedirectedBytes[k] += v
		}
		for k, v := range s.PassedPackets {
			sum.PassedPackets[k] += v
		}
		sum.Devices += s.Devices
		sum.Nodes = append(sum.Nodes, s.Nodes...)
	}
	return sum
}

// nodePinDirs names one pin directory per node, removed on cleanup.
func nodePinDirs(t *testing.T, l *Lab) []string {
	base := testutil.PinDir(t)
	var dirs []string
	for i := range l.Nodes() {
		dir := fmt.Sprintf("%s-node%d", base, i)
		t.Cleanup(func() { os.RemoveAll(dir) })
		dirs = append(dirs, dir)
	}
	return dirs
}

// startNodeAgents starts one agent per node (its cgroup, its namespace),
// checking the nodes every interval, and uninstalls them on cleanup.
func startNodeAgents(t *testing.T, l *Lab, pinDirs []string, interval time.Duration) {
	t.Helper()
	for i, n := range l.Nodes() {
		// Registered first, so it runs after the agent's uninstall.
		t.Cleanup(func() {
			if _, err := crossnode.ReadPinnedStats(pinDirs[i]); !errors.Is(err, crossnode.ErrNotInstalled) {
				t.Errorf("after uninstall the cross-node pins remain: %v", err)
			}
		})
		agenttest.Start(t, accel.Config{CgroupPath: l.NodeCgroup(i), PinDir: pinDirs[i], CrossNode: true,
			CrossNodes: []crossnode.Node{{Netns: netnsPath(n.Netns)}}, CrossNodeInterval: interval})
	}
}

// crossNodeEcho brings up two pods on two nodes with an echo app on
// crossNodePort in the server's node (its listener passed through wrap when
// wrap is not nil) and moves this process into the client node's cgroup:
// the setup of the cross-node tests.
func crossNodeEcho(t *testing.T, wrap func(net.Listener) net.Listener) (l *Lab, clientNs *testutil.Netns, echo *testutil.EchoServer) {
	t.Helper()
	l = upForTest(t, Options{Pods: 2, Nodes: 2, Capture: true})
	client, server := l.Client(), l.Server()
	if client.Node == server.Node {
		t.Fatal("client and server on one node")
	}
	clientNs = testutil.OpenNetns(t, client.Netns)
	ln := listenInNode(t, l, server)
	testutil.JoinCgroup(t, l.NodeCgroup(client.Node))
	if wrap != nil {
		ln = wrap(ln)
	}
	echo = testutil.ServeEcho(ln)
	t.Cleanup(echo.Close)
	return l, clientNs, echo
}

// listenInNode opens the server's listener with the server node's cgroup
// (accepted sockets keep it), as a process of that node would.
func listenInNode(t *testing.T, l *Lab, pod Pod) net.Listener {
	t.Helper()
	var ln net.Listener
	t.Run("listen on the server's node", func(t *testing.T) {
		testutil.JoinCgroup(t, l.NodeCgroup(pod.Node))
		err := testutil.OpenNetns(t, pod.Netns).Do(func() (err error) {
			ln, err = net.Listen("tcp", fmt.Sprintf(":%d", crossNodePort))
			return err
		})
		if err != nil {
			t.Fatal(err)
		}
	})
	if ln == nil {
		t.FailNow()
	}
	return ln
}

// waitNodeState polls until the node's state as the programs see it
// satisfies ok.
func waitNodeState(t *testing.T, pinDir string, cookie uint64, what string, ok func(crossnode.NodeState) bool) {
	t.Helper()
	var last []crossnode.NodeState
	var lastErr error
	err := poll(context.Background(), 20*time.Second, 20*time.Millisecond, func() (bool, error) {
		s, err := crossnode.ReadPinnedStats(pinDir)
		if err != nil {
			lastErr = err
			return false, nil
		}
		last = s.Nodes
		for _, n := range s.Nodes {
			if n.NetnsCookie == cookie {
				return ok(n), nil
			}
		}
		return false, nil
	})
	if err != nil {
		t.Fatalf("node %d never %s (nodes %+v, read error %v)", cookie, what, last, lastErr)
	}
}

// echoOnce sends msg and expects it back within timeout.
func echoOnce(ns *testutil.Netns, network, addr string, msg []byte, timeout time.Duration) error {
	var c net.Conn
	err := ns.Do(func() (err error) {
		c, err = net.DialTimeout(network, addr, timeout)
		return err
	})
	if err != nil {
		return err
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(timeout))
	if _, err := c.Write(msg); err != nil {
		return err
	}
	got := make([]byte, len(msg))
	if _, err := io.ReadFull(c, got); err != nil {
		return err
	}
	if !bytes.Equal(got, msg) {
		return fmt.Errorf("echo differs: %q", got)
	}
	return nil
}

func TestPrivilegedCrossNode(t *testing.T) {
	testutil.RequirePrivileged(t)
	rec := &sourceRecorder{sources: map[netip.Addr]int{}}
	l, clientNs, echo := crossNodeEcho(t, func(ln net.Listener) net.Listener { rec.Listener = ln; return rec })
	client, server := l.Client(), l.Server()
	serverNode := l.Nodes()[server.Node]
	serverCookie := nodeCookie(t, serverNode.Netns)

	v4 := netip.AddrPortFrom(server.IP, crossNodePort).String()
	v6 := netip.AddrPortFrom(server.IP6, crossNodePort).String()
	dialer := func(network, addr string) func() (net.Conn, error) {
		return func() (c net.Conn, err error) {
			err = clientNs.Do(func() error { c, err = net.DialTimeout(network, addr, 30*time.Second); return err })
			return c, err
		}
	}
	inNode := func(t *testing.T, args ...string) {
		t.Helper()
		testutil.Run(t, "ip", append([]string{"netns", "exec", serverNode.Netns}, args...)...)
	}

	testutil.WithAndWithout(t, func(t *testing.T, withAgent bool) {
		var pinDirs []string
		serverPins := ""
		if withAgent {
			pinDirs = nodePinDirs(t, l)
			serverPins = pinDirs[server.Node]
			startNodeAgents(t, l, pinDirs, 100*time.Millisecond)
			s := crossNodeStats(t, pinDirs...)
			if s.Devices != 4 || len(s.Nodes) != 2 {
				t.Fatalf("agents attached to %d devices in %d nodes, want 4 (pod port and wire in each) in 2", s.Devices, len(s.Nodes))
			}
			for _, n := range s.Nodes {
				if !n.Verified || !n.IPv4 || !n.IPv6 {
					t.Fatalf("node %+v: want verified with both families on (no netfilter rules in the lab's nodes)", n)
				}
			}
		}

		t.Run("bytes intact across nodes, ipv4 through both sidecars and ipv6 direct", func(t *testing.T) {
			var before crossnode.Stats
			if withAgent {
				before = crossNodeStats(t, pinDirs...)
			}
			srcBefore := rec.snapshot()
			var sent int64
			for _, tc := range []struct{ network, addr string }{{"tcp4", v4}, {"tcp6", v6}} {
				res := testutil.CheckIntegrity(dialer(tc.network, tc.addr), crossNodeIntegrityOpts)
				t.Logf("%s %s: %d conns, sent %d bytes, echoed %d", tc.network, tc.addr, res.Conns, res.BytesSent, res.BytesEcho)
				if err := res.Err(); err != nil {
					t.Errorf("%s: %v", tc.addr, err)
				}
				sent += res.BytesSent
			}
			if r := echo.Resets.Load(); r != 0 {
				t.Errorf("the server app saw %d connections end in an error", r)
			}
			// Istio's capture still sees every IPv4 connection: the app
			// accepts them from the inbound sidecar.
			src := rec.snapshot()
			n := crossNodeIntegrityOpts.Conns
			if d := src[netip.MustParseAddr(InboundSource)] - srcBefore[netip.MustParseAddr(InboundSource)]; d != n {
				t.Errorf("app accepted %d IPv4 connections from the inbound sidecar, want %d (capture must still apply)", d, n)
			}
			if d := src[client.IP6] - srcBefore[client.IP6]; d != n {
				t.Errorf("app accepted %d IPv6 connections from the client %s, want %d", d, client.IP6, n)
			}
			if !withAgent {
				return
			}
			after := crossNodeStats(t, pinDirs...)
			for _, dir := range crossnode.DirectionNames() {
				got := after.RedirectedBytes[dir] - before.RedirectedBytes[dir]
				t.Logf("redirected %s: %d packets, %d bytes", dir, after.RedirectedPackets[dir]-before.RedirectedPackets[dir], got)
				// Each payload byte crosses the wire twice (there and
				// echoed), once through each direction's program.
				if got < uint64(2*sent) {
					t.Errorf("redirected %s %d bytes, want >= %d (every payload byte, both ways)", dir, got, 2*sent)
				}
			}
			t.Logf("passed: %v", after.PassedPackets)

			// The same counters as users read them: /metrics and `meshwarp status`.
			srv := httptest.NewServer(metrics.Handler(func() (accel.Stats, error) { return accel.ReadPinnedStats(serverPins) }, nil))
			defer srv.Close()
			resp, err := srv.Client().Get(srv.URL + "/metrics")
			if err != nil {
				t.Fatal(err)
			}
			body, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			for _, re := range []string{
				`meshwarp_crossnode_redirected_packets_total\{direction="to_pod"\} [1-9]`,
				`meshwarp_crossnode_redirected_bytes_total\{direction="to_wire"\} [1-9]`,
				`meshwarp_crossnode_passed_packets_total\{reason="netfilter"\} 0`,
				fmt.Sprintf(`meshwarp_crossnode_redirect_enabled\{family="ipv6",netns_cookie="%d"\} 1`, serverCookie),
			} {
				if !regexp.MustCompile(re).Match(body) {
					t.Errorf("/metrics lacks %s", re)
				}
			}
			out, err := exec.Command(testutil.MeshwarpBinary(t), "status", "--pin-dir", serverPins).CombinedOutput()
			if err != nil {
				t.Fatalf("meshwarp status: %v\n%s", err, out)
			}
			for _, want := range []string{"cross-node forwarding (2 devices)", "redirected to_pod", fmt.Sprintf("node %s (netns cookie %d)", l.Nodes()[server.Node].Netns, serverCookie), "ipv4 on, ipv6 on"} {
				if !strings.Contains(string(out), want) {
					t.Errorf("meshwarp status lacks %q:\n%s", want, out)
				}
			}
		})

		t.Run("an ip6tables FORWARD drop on the server's node is obeyed", func(t *testing.T) {
			rule := []string{"ip6tables", "-w", "FORWARD", "-p", "tcp", "--dport", fmt.Sprint(crossNodePort), "-j", "DROP"}
			inNode(t, append([]string{rule[0], rule[1], "-I"}, rule[2:]...)...)
			removed := false
			remove := func() {
				if !removed {
					removed = true
					inNode(t, append([]string{rule[0], rule[1], "-D"}, rule[2:]...)...)
				}
			}
			defer remove()
			var before crossnode.Stats
			if withAgent {
				waitNodeState(t, serverPins, serverCookie, "turned IPv6 off", func(n crossnode.NodeState) bool { return n.Verified && !n.IPv6 && n.IPv4 })
				before = crossNodeStats(t, serverPins)
				// status says why.
				out, err := exec.Command(testutil.MeshwarpBinary(t), "status", "--pin-dir", serverPins).CombinedOutput()
				if err != nil || !regexp.MustCompile(`ipv6 off:\s+.*FORWARD: 1 rule`).Match(out) {
					t.Errorf("meshwarp status does not say which rule keeps IPv6 off (%v):\n%s", err, out)
				}
			}
			if err := echoOnce(clientNs, "tcp6", v6, []byte("dropped\n"), 2*time.Second); err == nil {
				t.Error("an IPv6 connection passed the node's FORWARD DROP rule")
			}
			if err := echoOnce(clientNs, "tcp4", v4, []byte("ipv4 unaffected\n"), 10*time.Second); err != nil {
				t.Errorf("IPv4 (not matched by ip6tables): %v", err)
			}
			if withAgent {
				if d := crossNodeStats(t, serverPins).PassedPackets["netfilter"] - before.PassedPackets["netfilter"]; d == 0 {
					t.Error("no packet counted as passed for netfilter")
				}
			}
			remove()
			if withAgent {
				waitNodeState(t, serverPins, serverCookie, "turned IPv6 back on", func(n crossnode.NodeState) bool { return n.Verified && n.IPv6 })
			}
			if err := echoOnce(clientNs, "tcp6", v6, []byte("allowed again\n"), 10*time.Second); err != nil {
				t.Errorf("IPv6 after the rule went: %v", err)
			}
		})

		t.Run("a DNAT rule on the server's node is applied", func(t *testing.T) {
			// Only DNAT makes :9077 reach the app: a packet that skipped
			// it would reach the pod's sidecar for a port nobody serves.
			rule := []string{"iptables", "-w", "-t", "nat", "PREROUTING", "-d", server.IP.String(), "-p", "tcp", "--dport", "9077",
				"-j", "DNAT", "--to-destination", fmt.Sprintf("%s:%d", server.IP, crossNodePort)}
			inNode(t, append([]string{rule[0], rule[1], rule[2], rule[3], "-A"}, rule[4:]...)...)
			removed := false
			remove := func() {
				if !removed {
					removed = true
					inNode(t, append([]string{rule[0], rule[1], rule[2], rule[3], "-D"}, rule[4:]...)...)
				}
			}
			defer remove()
			if withAgent {
				waitNodeState(t, serverPins, serverCookie, "turned IPv4 off", func(n crossnode.NodeState) bool { return n.Verified && !n.IPv4 && n.IPv6 })
			}
			to := netip.AddrPortFrom(server.IP, 9077).String()
			if err := echoOnce(clientNs, "tcp4", to, []byte("through the node's DNAT\n"), 10*time.Second); err != nil {
				t.Errorf("echo through the node's DNAT rule: %v", err)
			}
			res := testutil.CheckIntegrity(dialer("tcp4", to), testutil.IntegrityOptions{Conns: 4, Messages: 4, MaxSize: 16 << 10, Seed: 9})
			if err := res.Err(); err != nil {
				t.Error(err)
			}
			remove()
			if withAgent {
				waitNodeState(t, serverPins, serverCookie, "turned IPv4 back on", func(n crossnode.NodeState) bool { return n.Verified && n.IPv4 })
			}
		})
	})
	waitIdle(t, l)
}

// TestPrivilegedCrossNodeLifecycle: streams across nodes (IPv4 through the
// sidecars, IPv6 direct) keep every byte while a real `meshwarp run
// --cross-node` is started, killed, restarted (adopting the pinned
// programs) and stopped (uninstalling).
func TestPrivilegedCrossNodeLifecycle(t *testing.T) {
	testutil.RequirePrivileged(t)
	l, clientNs, echo := crossNodeEcho(t, nil)
	server := l.Server()

	pinDirs := nodePinDirs(t, l)
	// run starts one `meshwarp run --cross-node` per node.
	run := func() []*testutil.AgentProc {
		var procs []*testutil.AgentProc
		for i, n := range l.Nodes() {
			procs = append(procs, testutil.StartAgentProc(t, l.NodeCgroup(i), pinDirs[i], "--cross-node", "--node-netns", netnsPath(n.Netns)))
		}
		return procs
	}
	redirected := func() (sum uint64) {
		for _, dir := range pinDirs {
			if s, err := crossnode.ReadPinnedStats(dir); err == nil {
				sum += s.RedirectedPackets["to_pod"] + s.RedirectedPackets["to_wire"]
			}
		}
		return sum
	}
	waitRedirecting := func(what string) {
		t.Helper()
		from := redirected()
		if err := poll(context.Background(), 30*time.Second, 20*time.Millisecond, func() (bool, error) {
			return redirected() > from+100, nil
		}); err != nil {
			t.Fatalf("%s: no packets redirected under load", what)
		}
	}

	stop := make(chan struct{})
	started := make(chan struct{}, 2*crossNodeIntegrityOpts.Conns)
	results := make(chan testutil.IntegrityResult, 2)
	for _, tc := range []struct{ network, addr string }{
		{"tcp4", netip.AddrPortFrom(server.IP, crossNodePort).String()},
		{"tcp6", netip.AddrPortFrom(server.IP6, crossNodePort).String()},
	} {
		opts := crossNodeIntegrityOpts
		opts.Stop, opts.Started = stop, started
		go func() {
			results <- testutil.CheckIntegrity(func() (c net.Conn, err error) {
				err = clientNs.Do(func() error { c, err = net.DialTimeout(tc.network, tc.addr, 30*time.Second); return err })
				return c, err
			}, opts)
		}()
	}
	for range 2 * crossNodeIntegrityOpts.Conns {
		<-started
	}

	// Both agents attached: a pod port and the wire in each node, verified.
	waitAttached := func(what string) {
		t.Helper()
		for i, n := range l.Nodes() {
			waitNodeState(t, pinDirs[i], nodeCookie(t, n.Netns), what, func(s crossnode.NodeState) bool { return s.Verified && s.IPv4 && s.IPv6 })
		}
		if d := crossNodeStats(t, pinDirs...).Devices; d != 2*len(l.Nodes()) {
			t.Errorf("%s: %d devices attached, want %d", what, d, 2*len(l.Nodes()))
		}
	}
	agents := run()
	waitAttached("first agents")
	waitRedirecting("first agents")

	// kill: the pinned programs stay; without an agent's check they stop
	// redirecting (everything takes the normal path) within VerifiedFor.
	for _, a := range agents {
		a.Stop(t, syscall.SIGKILL)
	}
	for i, n := range l.Nodes() {
		waitNodeState(t, pinDirs[i], nodeCookie(t, n.Netns), "unverified after the agent was killed", func(s crossnode.NodeState) bool { return !s.Verified })
	}
	if p := crossNodeStats(t, pinDirs...).PassedPackets["unverified"]; p == 0 {
		t.Error("no packet took the normal path as unverified while no agent ran")
	}

	agents = run()
	waitAttached("restarted agents (adopting the pinned links)")
	waitRedirecting("restarted agents")

	// SIGTERM: uninstall under load.
	for _, a := range agents {
		if code := a.Stop(t, syscall.SIGTERM); code != 0 {
			t.Errorf("agent exit %d\n%s", code, a.Stderr())
		}
	}
	for _, dir := range pinDirs {
		if left, _ := filepath.Glob(filepath.Join(dir, "mw_xn_*")); len(left) > 0 {
			t.Errorf("pins left after uninstall: %v", left)
		}
	}
	// New connections take the normal path after the uninstall.
	if err := echoOnce(clientNs, "tcp6", netip.AddrPortFrom(server.IP6, crossNodePort).String(), []byte("after\n"), 10*time.Second); err != nil {
		t.Errorf("echo after the uninstall: %v", err)
	}
	close(stop)
	for range 2 {
		res := <-results
		t.Logf("stream: %d conns, sent %d bytes, echoed %d", res.Conns, res.BytesSent, res.BytesEcho)
		if err := res.Err(); err != nil {
			t.Error(err)
		}
	}
	if r := echo.Resets.Load(); r != 0 {
		t.Errorf("the server app saw %d connections end in an error", r)
	}
}

// TestPrivilegedCrossNodeNetfilterAtOnce: a netfilter change on a node is
// obeyed by the very next packet, not at the agent's next check: a table the
// node did not have, a rule in a chain it has, a chain's policy, NAT rules.
// The agents here check the nodes only when they start (an interval of an
// hour): only the programs' own look at the node's netfilter can make them
// step aside. Each case starts fresh agents (which check the node as it is),
// proves they redirect, changes the rules and connects at once. The same
// assertions hold without the agents (run second: the tables stay).
func TestPrivilegedCrossNodeNetfilterAtOnce(t *testing.T) {
	testutil.RequirePrivileged(t)
	l, clientNs, _ := crossNodeEcho(t, nil)
	server := l.Server()
	serverNode := l.Nodes()[server.Node]

	const natPort = 9077 // reaches the app only through the node's DNAT
	type change struct {
		name     string
		do, undo []string // iptables arguments after the tool
		port     int      // connect here while the change stands
		refused  bool     // the change must stop the connection (else: make it work)
	}
	port := fmt.Sprint(crossNodePort)
	drop := []string{"-p", "tcp", "--dport", port, "-j", "DROP"}
	changes := []change{
		{"a DROP in a table the node did not have", append([]string{"-t", "mangle", "-I", "FORWARD"}, drop...),
			append([]string{"-t", "mangle", "-D", "FORWARD"}, drop...), crossNodePort, true},
		{"a DROP in a chain the node has", append([]string{"-t", "mangle", "-I", "FORWARD"}, drop...),
			append([]string{"-t", "mangle", "-D", "FORWARD"}, drop...), crossNodePort, true},
		{"a DROP policy on a chain the node has", []string{"-t", "mangle", "-P", "FORWARD", "DROP"},
			[]string{"-t", "mangle", "-P", "FORWARD", "ACCEPT"}, crossNodePort, true},
	}
	for _, f := range []struct{ tool, network string }{{"iptables", "tcp4"}, {"ip6tables", "tcp6"}} {
		addr, to := server.IP.String(), server.IP.String()
		if f.network == "tcp6" {
			addr, to = server.IP6.String(), "["+server.IP6.String()+"]"
		}
		dnat := []string{"PREROUTING", "-d", addr, "-p", "tcp", "--dport", fmt.Sprint(natPort),
			"-j", "DNAT", "--to-destination", fmt.Sprintf("%s:%d", to, crossNodePort)}
		t.Run(f.network, func(t *testing.T) {
			cases := append(append([]change(nil), changes...),
				change{"a DNAT in a table the node did not have", append([]string{"-t", "nat", "-A"}, dnat...),
					append([]string{"-t", "nat", "-D"}, dnat...), natPort, false},
				change{"a DNAT in a chain the node has", append([]string{"-t", "nat", "-A"}, dnat...),
					append([]string{"-t", "nat", "-D"}, dnat...), natPort, false})
			testutil.WithThenWithout(t, func(t *testing.T, withAgent bool) {
				for _, c := range cases {
					t.Run(c.name, func(t *testing.T) {
						nodeRules := func(args []string) {
							testutil.Run(t, "ip", append([]string{"netns", "exec", serverNode.Netns, f.tool, "-w"}, args...)...)
						}
						direct := netip.AddrPortFrom(netip.MustParseAddr(addr), crossNodePort).String()
						target := netip.AddrPortFrom(netip.MustParseAddr(addr), uint16(c.port)).String()
						var pinDirs []string
						var before crossnode.Stats
						if withAgent {
							pinDirs = nodePinDirs(t, l)
							startNodeAgents(t, l, pinDirs, time.Hour)
							start := crossNodeStats(t, pinDirs...)
							if err := echoOnce(clientNs, f.network, direct, []byte("redirected\n"), 10*time.Second); err != nil {
								t.Fatalf("before the change: %v", err)
							}
							before = crossNodeStats(t, pinDirs...)
							if before.RedirectedPackets["to_pod"] == start.RedirectedPackets["to_pod"] {
								t.Fatalf("nothing was redirected before the change (passed %v): the case would prove nothing", before.PassedPackets)
							}
						}
						nodeRules(c.do)
						undone := false
						undo := func() {
							if !undone {
								undone = true
								nodeRules(c.undo)
							}
						}
						defer undo()
						// A dropped connection is given 2 s; one that must work, 10 s.
						timeout := 10 * time.Second
						if c.refused {
							timeout = 2 * time.Second
						}
						err := echoOnce(clientNs, f.network, target, []byte("right after the change\n"), timeout)
						if c.refused && err == nil {
							t.Errorf("a new connection passed %s the node had just got", c.name)
						}
						if !c.refused && err != nil {
							t.Errorf("%s the node had just got was not applied: %v", c.name, err)
						}
						if withAgent {
							if d := crossNodeStats(t, pinDirs...).PassedPackets["netfilter"] - before.PassedPackets["netfilter"]; d == 0 {
								t.Error("no packet counted as passed for netfilter")
							}
						}
						undo()
						if err := echoOnce(clientNs, f.network, direct, []byte("after the change went\n"), 10*time.Second); err != nil {
							t.Errorf("after the change went: %v", err)
						}
					})
				}
			})
		})
	}
	waitIdle(t, l)
}
