// SPDX-License-Identifier: Apache-2.0

package lab

import (
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
)

func TestPlanPods(t *testing.T) {
	pods := planPods(3, 1)
	want := []struct{ name, netns, ip, ip6, host, pod string }{
		{"pod-0", "meshwarp-pod-0", "10.211.0.2", "fd00:211::2", "mw-p0-br", "mw-p0-eth"},
		{"pod-1", "meshwarp-pod-1", "10.211.0.3", "fd00:211::3", "mw-p1-br", "mw-p1-eth"},
		{"pod-2", "meshwarp-pod-2", "10.211.0.4", "fd00:211::4", "mw-p2-br", "mw-p2-eth"},
	}
	for i, w := range want {
		p := pods[i]
		if p.Name != w.name || p.Netns != w.netns || p.IP.String() != w.ip || p.IP6.String() != w.ip6 ||
			p.HostVeth != w.host || p.PodVeth != w.pod || p.Node != 0 {
			t.Errorf("pod %d = %+v, want %+v on node 0", i, p, w)
		}
	}
	if pods[0].role() != "client" || pods[1].role() != "server" || pods[0].runsApps() || !pods[2].runsApps() {
		t.Errorf("roles: pod-0 must be the client without apps, the rest servers with apps")
	}
}

func TestPlanTwoNodes(t *testing.T) {
	nodes := planNodes(2)
	if nodes[0].Netns != "meshwarp-node" || nodes[1].Netns != "meshwarp-node-1" {
		t.Errorf("node namespaces %s, %s", nodes[0].Netns, nodes[1].Netns)
	}
	if nodes[1].Prefix.String() != "10.211.1.0/24" || nodes[1].Bridge.String() != "10.211.1.1" ||
		nodes[1].Prefix6.String() != "fd00:211:0:1::/64" || nodes[1].Wire.String() != "10.211.254.2" || nodes[0].Wire6.String() != "fd00:211:0:fe::1" {
		t.Errorf("node 1 plan %+v, node 0 wire %s", nodes[1], nodes[0].Wire6)
	}
	pods := planPods(4, 2)
	for i, w := range []struct {
		node    int
		ip, ip6 string
	}{{0, "10.211.0.2", "fd00:211::2"}, {1, "10.211.1.2", "fd00:211:0:1::2"}, {0, "10.211.0.3", "fd00:211::3"}, {1, "10.211.1.3", "fd00:211:0:1::3"}} {
		p := pods[i]
		if p.Node != w.node || p.IP.String() != w.ip || p.IP6.String() != w.ip6 {
			t.Errorf("pod %d on node %d %s %s, want node %d %s %s", i, p.Node, p.IP, p.IP6, w.node, w.ip, w.ip6)
		}
		if !nodes[p.Node].Prefix.Contains(p.IP) || !nodes[p.Node].Prefix6.Contains(p.IP6) {
			t.Errorf("pod %d outside its node's prefixes", i)
		}
	}
}

func TestPlanLimits(t *testing.T) {
	for nodes := 1; nodes <= MaxNodes; nodes++ {
		last := planPod(MaxPods-1, nodes)
		for _, name := range []string{last.HostVeth, last.PodVeth, BridgeName, WireName} {
			if len(name) > 15 || !strings.HasPrefix(name, "mw-") {
				t.Errorf("link name %q: want mw- prefix and at most 15 characters (IFNAMSIZ-1)", name)
			}
		}
		seen := map[string]bool{}
		for _, n := range planNodes(nodes) {
			seen[n.Bridge.String()], seen[n.Bridge6.String()] = true, true
			seen[n.Wire.String()], seen[n.Wire6.String()] = true, true
		}
		for _, p := range planPods(MaxPods, nodes) {
			n := planNode(p.Node)
			if !n.Prefix.Contains(p.IP) || p.IP == n.Prefix.Addr() || !n.Prefix6.Contains(p.IP6) {
				t.Errorf("pod %d address %s %s outside %s %s", p.Index, p.IP, p.IP6, n.Prefix, n.Prefix6)
			}
			for _, a := range []string{p.IP.String(), p.IP6.String()} {
				if seen[a] {
					t.Fatalf("address %s used twice", a)
				}
				seen[a] = true
			}
		}
	}
}

func TestOptionsDefaults(t *testing.T) {
	o, err := Options{}.withDefaults()
	if err != nil || o.Pods != 2 || o.Nodes != 1 || o.SidecarUID != 1337 || o.Capture {
		t.Errorf("zero Options -> %+v, %v; want 2 pods, 1 node, uid 1337, capture as given (false)", o, err)
	}
	if d := DefaultOptions(); !d.Capture || d.Pods != 2 || d.SidecarUID != 1337 {
		t.Errorf("DefaultOptions() = %+v", d)
	}
	for _, n := range []int{1, -1, MaxPods + 1} {
		if _, err := (Options{Pods: n}).withDefaults(); err == nil {
			t.Errorf("Pods %d accepted", n)
		}
	}
	for _, n := range []int{-1, MaxNodes + 1} {
		if _, err := (Options{Nodes: n}).withDefaults(); err == nil {
			t.Errorf("Nodes %d accepted", n)
		}
	}
}

func TestNetnsNames(t *testing.T) {
	for name, want := range map[string]bool{
		"meshwarp-node":       true,
		"meshwarp-pod-0":      true,
		"meshwarp-pod-12":     true,
		"meshwarp-pod-":       false,
		"meshwarp-pod-01":     false, // never created, so never ours
		"meshwarp-pod-x":      false,
		"meshwarp-t-foo":      false, // testutil's throwaway namespaces
		"meshwarp-node2":      false,
		"meshwarp-node-1":     true,
		"meshwarp-node-2":     false, // beyond MaxNodes
		"meshwarp-node-0":     false, // node 0 is meshwarp-node
		"other":               false,
		"meshwarp-pod-1-kept": false,
	} {
		if got := isLabNetns(name); got != want {
			t.Errorf("isLabNetns(%q) = %v, want %v", name, got, want)
		}
	}
}

func TestCaptureChains(t *testing.T) {
	got := captureChains(1337)
	want := `*nat
:MESHWARP_OUTPUT - [0:0]
:MESHWARP_REDIRECT - [0:0]
:MESHWARP_INBOUND - [0:0]
:MESHWARP_IN_REDIRECT - [0:0]
-A MESHWARP_OUTPUT -p tcp ! -d 127.0.0.0/8 -m owner ! --uid-owner 1337 -j MESHWARP_REDIRECT
-A MESHWARP_REDIRECT -p tcp -j REDIRECT --to-ports 15001
-A MESHWARP_INBOUND -p tcp -j MESHWARP_IN_REDIRECT
-A MESHWARP_IN_REDIRECT -p tcp -j REDIRECT --to-ports 15006
COMMIT
`
	if got != want {
		t.Errorf("captureChains:\n%s\nwant:\n%s", got, want)
	}
	wantJumps := [][]string{
		{"OUTPUT", "-p", "tcp", "-j", "MESHWARP_OUTPUT"},
		{"PREROUTING", "-p", "tcp", "-j", "MESHWARP_INBOUND"},
	}
	if !reflect.DeepEqual(jumpRules(), wantJumps) {
		t.Errorf("jumpRules = %v, want %v", jumpRules(), wantJumps)
	}
}

func TestIptablesCleanup(t *testing.T) {
	// `iptables -t nat -S` after a crash: a duplicated jump, someone else's rule and chain.
	in := `-P PREROUTING ACCEPT
-P INPUT ACCEPT
-P OUTPUT ACCEPT
-P POSTROUTING ACCEPT
-N MESHWARP_INBOUND
-N MESHWARP_IN_REDIRECT
-N MESHWARP_OUTPUT
-N OTHER
-A PREROUTING -p tcp -j MESHWARP_INBOUND
-A OUTPUT -p tcp -j MESHWARP_OUTPUT
-A OUTPUT -p tcp -j MESHWARP_OUTPUT
-A OUTPUT -p udp -j OTHER
-A MESHWARP_INBOUND -p tcp -j MESHWARP_IN_REDIRECT
-A MESHWARP_IN_REDIRECT -p tcp -j REDIRECT --to-ports 15006
`
	want := [][]string{
		{"-D", "PREROUTING", "-p", "tcp", "-j", "MESHWARP_INBOUND"},
		{"-D", "OUTPUT", "-p", "tcp", "-j", "MESHWARP_OUTPUT"},
		{"-D", "OUTPUT", "-p", "tcp", "-j", "MESHWARP_OUTPUT"},
		{"-F", "MESHWARP_INBOUND"}, {"-F", "MESHWARP_IN_REDIRECT"}, {"-F", "MESHWARP_OUTPUT"},
		{"-X", "MESHWARP_INBOUND"}, {"-X", "MESHWARP_IN_REDIRECT"}, {"-X", "MESHWARP_OUTPUT"},
	}
	if got := iptablesCleanup(in); !reflect.DeepEqual(got, want) {
		t.Errorf("iptablesCleanup:\n got %v\nwant %v", got, want)
	}
}

func TestSidecarConfig(t *testing.T) {
	cfg, err := sidecarConfig{UID: 1337, GID: 995, StatsSocket: "/run/x/haproxy.sock", HTTPPorts: []int{8080}}.render()
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{
		"uid 1337\n", "gid 995\n", "maxconn 4000\n",
		"stats socket /run/x/haproxy.sock mode 600 level admin",
		"bind 0.0.0.0:15001", "bind 0.0.0.0:15006",
		"tcp-request connection reject if { dst_port 15001 } || { dst_port 15006 }",
		"use_backend outbound_http if { dst_port 8080 }",
		"use_backend inbound_http if { dst_port 8080 }",
		"default_backend outbound_tcp", "default_backend inbound_tcp",
		"server original_dst 0.0.0.0\n", // no port: the original destination port
		"source 127.0.0.6\n",
		"server local_app 127.0.0.1\n", // no port: the original destination port
	} {
		if !strings.Contains(cfg, want) {
			t.Errorf("config lacks %q:\n%s", want, cfg)
		}
	}
	// Every mode http backend must pin server connections to their client.
	for _, be := range []string{"\nbackend outbound_http\n", "\nbackend inbound_http\n"} {
		i := strings.Index(cfg, be)
		if i < 0 {
			t.Fatalf("no %s", be)
		}
		section := cfg[i:]
		if j := strings.Index(section[1:], "\nbackend "); j > 0 {
			section = section[:j+1]
		}
		if !strings.Contains(section, "mode http") || !strings.Contains(section, "http-reuse never") {
			t.Errorf("%s: want mode http and http-reuse never:\n%s", be, section)
		}
	}

	// HAProxy itself must accept it (no privileges needed for -c).
	haproxy, err := exec.LookPath("haproxy")
	if err != nil {
		t.Skip("haproxy not installed (scripts/install-deps.sh): config not validated by haproxy -c")
	}
	path := filepath.Join(t.TempDir(), "haproxy.cfg")
	if err := os.WriteFile(path, []byte(cfg), 0o644); err != nil {
		t.Fatal(err)
	}
	if out, err := exec.Command(haproxy, "-c", "-f", path).CombinedOutput(); err != nil {
		t.Fatalf("haproxy -c: %v\n%s", err, out)
	} else if strings.Contains(string(out), "WARNING") {
		t.Errorf("haproxy -c warns:\n%s", out)
	}
}

func TestParseShowStat(t *testing.T) {
	in := "# pxname,svname,qcur,qmax,scur,smax,slim,stot,bin,bout,dreq,dresp,ereq,econ,eresp,wretr,wredis,status,weight,act,bck,chkfail,chkdown,lastchg,downtime,qlimit,pid,iid,sid,throttle,lbtot,tracked,type,rate,rate_lim,rate_max,check_status,check_code,check_duration,hrsp_1xx,hrsp_2xx,hrsp_3xx,hrsp_4xx,hrsp_5xx,hrsp_other,hanafail,req_rate,req_rate_max,req_tot\n" +
		"outbound,FRONTEND,,,1,2,4000,7,700,1400,0,0,0,,,,,OPEN,,,,,,,,,1,2,0,,,,0,0,0,3,,,,,,,,,,,0,0,\n" +
		"outbound_http,original_dst,0,0,0,1,,5,500,1000,,0,,0,0,0,0,no check,1,1,0,,,4,,,1,3,1,,5,,2,0,,2,,,,0,5,0,0,0,0,,,,\n" +
		"outbound_http,BACKEND,0,0,0,1,400,5,500,1000,0,0,,0,0,0,0,UP,1,1,0,,0,4,0,,1,3,0,,5,,1,0,,2,,,,0,5,0,0,0,0,,,,9\n"
	got, err := parseShowStat(in)
	if err != nil {
		t.Fatal(err)
	}
	want := []ProxyStat{
		{Proxy: "outbound", Kind: "frontend", Sessions: 7, Current: 1, BytesIn: 700, BytesOut: 1400},
		{Proxy: "outbound_http", Kind: "backend", Sessions: 5, BytesIn: 500, BytesOut: 1000, Requests: 9},
	}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("parseShowStat:\n got %+v\nwant %+v", got, want)
	}
	if _, err := parseShowStat("Unknown command\n"); err == nil {
		t.Error("parseShowStat accepted an error reply")
	}
}
