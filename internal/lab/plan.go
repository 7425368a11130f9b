// SPDX-License-Identifier: Apache-2.0

package lab

import (
	"cmp"
	"fmt"
	"net/netip"
	"strconv"
	"strings"

	"github.com/meshwarp/meshwarp/internal/accel"
)

// Ports of the lab's workloads and of the sidecar listeners.
const (
	HTTPPort    = 8080  // fortio HTTP echo server in every non-client pod (sidecar: mode http)
	TCPEchoPort = 8078  // fortio TCP echo server in every non-client pod (sidecar: mode tcp)
	QperfPort   = 19765 // qperf's default control port; its data port is picked per test

	OutboundPort = accel.DefaultOutboundPort // sidecar listener for captured outbound TCP
	InboundPort  = accel.DefaultInboundPort  // sidecar listener for captured inbound TCP

	DefaultPods       = 2
	DefaultSidecarUID = accel.DefaultSidecarUID
	MaxPods           = 64
	DefaultNodes      = 1
	MaxNodes          = 2 // joined by one veth wire
)

// Names of everything the lab creates. down finds leftovers by these names, so
// every object the lab creates carries one of them (and nothing else does).
const (
	NodeNetns      = "meshwarp-node" // node 0; node N > 0 is NodeNetns-N
	PodNetnsPrefix = "meshwarp-pod-"
	BridgeName     = "mw-br0"  // in every node namespace
	WireName       = "mw-wire" // both ends of the veth between two nodes
	CgroupName     = "meshwarp-lab"
	RunDir         = "/run/meshwarp-lab"

	// SidecarUser is the system user created for SidecarUID when that uid has
	// no passwd entry yet (HAProxy itself only needs the number).
	SidecarUser = "meshwarp-proxy"

	// InboundSource is the address the inbound sidecar connects to the app
	// from, as Istio's inbound does (so the app sees 127.0.0.6, not 127.0.0.1).
	InboundSource = "127.0.0.6"

	chainPrefix = "MESHWARP_"
)

// Address plan. Node n owns 10.211.n.0/24 and fd00:211:0:n::/64: its bridge
// is .1 / ::1 and its k-th pod .(k+2) / ::(k+2). Pod i lives on node
// i % nodes, so with two nodes the client (pod-0) and the first server
// (pod-1) are on different nodes. The wire between nodes is 10.211.254.0/24
// and fd00:211:0:fe::/64, node n at .(n+1) / ::(n+1).
var (
	wirePrefix = netip.MustParsePrefix("10.211.254.0/24")
	wire6      = netip.MustParsePrefix("fd00:211:0:fe::/64")
)

// Node is one node namespace: a bridge its pods hang off, and (with two
// nodes) a wire to the other node with a route to its pods.
type Node struct {
	Index   int
	Netns   string       // "meshwarp-node", "meshwarp-node-1"
	Prefix  netip.Prefix // its pods' IPv4 prefix
	Prefix6 netip.Prefix // its pods' IPv6 prefix
	Bridge  netip.Addr   // the bridge's IPv4 address: the pods' gateway
	Bridge6 netip.Addr
	Wire    netip.Addr // its end of the wire (valid with two nodes)
	Wire6   netip.Addr
}

func planNode(n int) Node {
	nt := NodeNetns
	if n > 0 {
		nt += "-" + strconv.Itoa(n)
	}
	p4 := netip.PrefixFrom(netip.AddrFrom4([4]byte{10, 211, byte(n), 0}), 24)
	p6 := netip.PrefixFrom(netip.AddrFrom16([16]byte{0xfd, 0x00, 0x02, 0x11, 0, 0, 0, byte(n)}), 64)
	return Node{
		Index:   n,
		Netns:   nt,
		Prefix:  p4,
		Prefix6: p6,
		Bridge:  hostAddr(p4, 1),
		Bridge6: hostAddr(p6, 1),
		Wire:    hostAddr(wirePrefix, n+1),
		Wire6:   hostAddr(wire6, n+1),
	}
}

func planNodes(n int) []Node {
	out := make([]Node, n)
	for i := range out {
		out[i] = planNode(i)
	}
	return out
}

// hostAddr is the k-th address of a prefix.
func hostAddr(p netip.Prefix, k int) netip.Addr {
	a := p.Addr()
	for range k {
		a = a.Next()
	}
	return a
}

// Pod is one network namespace on a node's bridge.
type Pod struct {
	Name  string     // "pod-0"
	Netns string     // "meshwarp-pod-0"
	IP    netip.Addr // 10.211.0.2
	IP6   netip.Addr // fd00:211::2 (not captured: the sidecars serve IPv4)
	Node  int        // index of the node it lives on
}

// podPlan is everything derived from a pod's index.
type podPlan struct {
	Pod
	Index    int
	HostVeth string // end in the node namespace, enslaved to the bridge
	PodVeth  string // end inside the pod namespace
}

func (p podPlan) role() string {
	if p.Index == 0 {
		return "client"
	}
	return "server"
}

// runsApps reports whether the pod runs the echo servers and qperf: every pod
// but the client.
func (p podPlan) runsApps() bool { return p.Index != 0 }

func planPod(i, nodes int) podPlan {
	node := planNode(i % nodes)
	k := i/nodes + 2
	return podPlan{
		Pod: Pod{
			Name:  "pod-" + strconv.Itoa(i),
			Netns: PodNetnsPrefix + strconv.Itoa(i),
			IP:    hostAddr(node.Prefix, k),
			IP6:   hostAddr(node.Prefix6, k),
			Node:  node.Index,
		},
		Index:    i,
		HostVeth: fmt.Sprintf("mw-p%d-br", i),
		PodVeth:  fmt.Sprintf("mw-p%d-eth", i),
	}
}

func planPods(n, nodes int) []podPlan {
	out := make([]podPlan, n)
	for i := range out {
		out[i] = planPod(i, nodes)
	}
	return out
}

// nodeIndexFromNetns parses "meshwarp-node" -> 0, "meshwarp-node-1" -> 1.
func nodeIndexFromNetns(name string) (int, bool) {
	if name == NodeNetns {
		return 0, true
	}
	rest, ok := strings.CutPrefix(name, NodeNetns+"-")
	if !ok {
		return 0, false
	}
	i, err := strconv.Atoi(rest)
	if err != nil || i < 1 || i >= MaxNodes || strconv.Itoa(i) != rest {
		return 0, false
	}
	return i, true
}

// podIndexFromNetns parses "meshwarp-pod-3" -> 3.
func podIndexFromNetns(name string) (int, bool) {
	rest, ok := strings.CutPrefix(name, PodNetnsPrefix)
	if !ok || rest == "" {
		return 0, false
	}
	i, err := strconv.Atoi(rest)
	if err != nil || i < 0 || strconv.Itoa(i) != rest {
		return 0, false
	}
	return i, true
}

// isLabNetns reports whether a namespace name is one the lab creates.
func isLabNetns(name string) bool {
	if _, ok := nodeIndexFromNetns(name); ok {
		return true
	}
	_, ok := podIndexFromNetns(name)
	return ok
}

// withDefaults fills defaults and checks limits.
func (o Options) withDefaults() (Options, error) {
	o.Pods = cmp.Or(o.Pods, DefaultPods)
	o.SidecarUID = cmp.Or(o.SidecarUID, DefaultSidecarUID)
	o.Nodes = cmp.Or(o.Nodes, DefaultNodes)
	if o.Pods < 2 || o.Pods > MaxPods {
		return o, fmt.Errorf("--pods %d: want 2..%d (pod-0 is the client, pod-1 the server)", o.Pods, MaxPods)
	}
	if o.Nodes < 1 || o.Nodes > MaxNodes {
		return o, fmt.Errorf("--nodes %d: want 1..%d (with 2, pod i lives on node i%%2: the client and pod-1 on different nodes)", o.Nodes, MaxNodes)
	}
	return o, nil
}

// PodSysctls are set in every pod's network namespace (they are per
// namespace: the host's stay as they are). Connection-per-request load
// (bench http-close) opens thousands of connections a second: with
// TIME_WAIT reuse and a wide ephemeral range the port space is not what it
// measures. The lab's listening ports stay out of the ephemeral range (the
// reserved ones are those inside it), so a restarted sidecar or server can
// always bind again.
var PodSysctls = [][2]string{
	{"net/ipv4/tcp_tw_reuse", "1"},
	{"net/ipv4/ip_local_port_range", "16384 65535"},
	{"net/ipv4/ip_local_reserved_ports", strconv.Itoa(QperfPort) + "-" + strconv.Itoa(QperfPort+1)}, // as the kernel prints it back
}
