// SPDX-License-Identifier: Apache-2.0

package lab

import (
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
)

// Names of everything the lab creates. down finds leftovers by these names, so
// every object the lab creates carries one of them (and nothing else does).
const (
	NodeNetns      = "meshwarp-node"
	PodNetnsPrefix = "meshwarp-pod-"
	BridgeName     = "mw-br0"
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

// Address plan: one /24, the bridge in the node namespace gets .1, pod i gets .(i+2).
var (
	labPrefix = netip.MustParsePrefix("10.211.0.0/24")
	bridgeIP  = netip.MustParseAddr("10.211.0.1")
)

// Pod is one network namespace on the lab bridge.
type Pod struct {
	Name  string     // "pod-0"
	Netns string     // "meshwarp-pod-0"
	IP    netip.Addr // 10.211.0.2
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

func planPod(i int) podPlan {
	ip := bridgeIP
	for range i + 1 {
		ip = ip.Next()
	}
	return podPlan{
		Pod: Pod{
			Name:  "pod-" + strconv.Itoa(i),
			Netns: PodNetnsPrefix + strconv.Itoa(i),
			IP:    ip,
		},
		Index:    i,
		HostVeth: fmt.Sprintf("mw-p%d-br", i),
		PodVeth:  fmt.Sprintf("mw-p%d-eth", i),
	}
}

func planPods(n int) []podPlan {
	out := make([]podPlan, n)
	for i := range out {
		out[i] = planPod(i)
	}
	return out
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
	if name == NodeNetns {
		return true
	}
	_, ok := podIndexFromNetns(name)
	return ok
}

// validate fills defaults and checks limits.
func (o Options) withDefaults() (Options, error) {
	if o.Pods == 0 {
		o.Pods = DefaultPods
	}
	if o.SidecarUID == 0 {
		o.SidecarUID = DefaultSidecarUID
	}
	if o.Pods < 2 || o.Pods > MaxPods {
		return o, fmt.Errorf("--pods %d: want 2..%d (pod-0 is the client, pod-1 the server)", o.Pods, MaxPods)
	}
	return o, nil
}
