// SPDX-License-Identifier: Apache-2.0

package crossnode

import (
	"cmp"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"

	"github.com/meshwarp/meshwarp/internal/btfenum"
	"github.com/meshwarp/meshwarp/internal/netns"
)

// Stats are the cumulative counters of cross-node forwarding, read from the
// pinned maps (they survive agent restarts).
type Stats struct {
	// RedirectedPackets and RedirectedBytes by direction: "to_wire" (from
	// a local pod to another node) and "to_pod" (from another node into a
	// local pod).
	RedirectedPackets map[string]uint64 `json:"redirected_packets"`
	RedirectedBytes   map[string]uint64 `json:"redirected_bytes"`
	// NeighRedirects counts to_wire packets whose neighbour the kernel
	// resolved (bpf_redirect_neigh) because the FIB had none yet.
	NeighRedirects uint64 `json:"neigh_redirects"`
	// PassedPackets counts packets left to the normal path, by reason.
	PassedPackets map[string]uint64 `json:"passed_packets_by_reason"`
	// Devices counts the devices with a program attached (pinned links).
	Devices int `json:"devices"`
	// Nodes says, per node namespace, which families are redirected now.
	Nodes []NodeState `json:"nodes"`
}

// NodeState is the agent's last check of one node, as the programs see it.
type NodeState struct {
	NetnsCookie uint64 `json:"netns_cookie"`
	// Netns names the namespace ("host", or its name in /run/netns) when
	// NameNodes found it.
	Netns string `json:"netns,omitempty"`
	// Verified: an agent checked the node within the last VerifiedFor.
	// Without it nothing is redirected there.
	Verified bool `json:"verified"`
	// IPv4 and IPv6: no netfilter rule (or IPv4 rp_filter) stands in the
	// way of redirecting that family.
	IPv4 bool `json:"ipv4"`
	IPv6 bool `json:"ipv6"`
	// IPv4BlockedBy and IPv6BlockedBy: what keeps a family off (Explain).
	IPv4BlockedBy []string `json:"ipv4_blocked_by,omitempty"`
	IPv6BlockedBy []string `json:"ipv6_blocked_by,omitempty"`
}

// Reason and direction names come from the C enums in the object's BTF
// (MW_XN_REASON_NO_NEIGHBOUR -> "no_neighbour"): bpf/crossnode is the only
// list. Read on first use, not at init (see btfenum.Lazy).
var (
	enumNames   = btfenum.Lazy("cross-node", _CrossnodeBytes)
	reasonNames = enumNames("mw_xn_reason", "MW_XN_REASON_")
	dirNames    = enumNames("mw_xn_dir", "MW_XN_DIR_")
)

// ReasonNames lists every reason a packet is passed for.
func ReasonNames() []string { return append([]string(nil), reasonNames()[1:]...) }

// DirectionNames lists the redirect directions.
func DirectionNames() []string { return append([]string(nil), dirNames()...) }

// ErrNotInstalled: no cross-node forwarding is pinned at the directory.
var ErrNotInstalled = errors.New("cross-node forwarding is not installed")

// ReadPinnedStats reads the counters pinned under pinDir.
func ReadPinnedStats(pinDir string) (Stats, error) {
	p := filepath.Join(pinDir, crossnodeMapMwXnStats)
	m, err := ebpf.LoadPinnedMap(p, &ebpf.LoadPinOptions{ReadOnly: true})
	if errors.Is(err, os.ErrNotExist) {
		return Stats{}, ErrNotInstalled
	}
	if err != nil {
		return Stats{}, fmt.Errorf("open %s: %w", p, err)
	}
	defer m.Close()
	var perCPU []crossnodeMwXnCounters
	if err := m.Lookup(uint32(0), &perCPU); err != nil {
		return Stats{}, fmt.Errorf("read %s: %w", p, err)
	}
	s := Stats{RedirectedPackets: map[string]uint64{}, RedirectedBytes: map[string]uint64{}, PassedPackets: map[string]uint64{}}
	for _, c := range perCPU {
		for i, name := range dirNames() {
			s.RedirectedPackets[name] += c.RedirectedPackets[i]
			s.RedirectedBytes[name] += c.RedirectedBytes[i]
		}
		s.NeighRedirects += c.NeighRedirects
		for i, name := range reasonNames() {
			if i > 0 && i < len(c.Passed) {
				s.PassedPackets[name] += c.Passed[i]
			}
		}
	}
	entries, _ := os.ReadDir(pinDir)
	for _, e := range entries {
		if strings.HasPrefix(e.Name(), linkPinPrefix) {
			s.Devices++
		}
	}
	s.Nodes, err = readNodes(filepath.Join(pinDir, crossnodeMapMwXnNodes))
	return s, err
}

func readNodes(path string) ([]NodeState, error) {
	m, err := ebpf.LoadPinnedMap(path, &ebpf.LoadPinOptions{ReadOnly: true})
	if err != nil {
		return nil, fmt.Errorf("open %s: %w", path, err)
	}
	defer m.Close()
	now, err := monotonicNs()
	if err != nil {
		return nil, err
	}
	var out []NodeState
	var cookie uint64
	var n crossnodeMwXnNode
	for it := m.Iterate(); it.Next(&cookie, &n); {
		out = append(out, NodeState{
			NetnsCookie: cookie,
			Verified:    n.ValidUntilNs >= now,
			IPv4:        n.Flags&nodeV4 != 0,
			IPv6:        n.Flags&nodeV6 != 0,
		})
	}
	slices.SortFunc(out, func(a, b NodeState) int { return cmp.Compare(a.NetnsCookie, b.NetnsCookie) })
	return out, nil
}

// NameNodes names the nodes' namespaces it can find (netns.Names). It
// enters every named namespace, so status calls it, not every scrape.
func (s *Stats) NameNodes() {
	names := netns.Names()
	for i := range s.Nodes {
		s.Nodes[i].Netns = names[s.Nodes[i].NetnsCookie]
	}
}

// Flags of mw_xn_node (MW_XN_NODE_V4, MW_XN_NODE_V6).
const (
	nodeV4 = 1
	nodeV6 = 2
)

// monotonicNs is the clock bpf_ktime_get_ns reads.
func monotonicNs() (uint64, error) {
	var ts unix.Timespec
	if err := unix.ClockGettime(unix.CLOCK_MONOTONIC, &ts); err != nil {
		return 0, err
	}
	return uint64(ts.Nano()), nil
}

// Stats reads this agent's counters.
func (a *Agent) Stats() (Stats, error) { return ReadPinnedStats(a.cfg.PinDir) }
