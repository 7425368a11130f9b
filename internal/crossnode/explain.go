// SPDX-License-Identifier: Apache-2.0

package crossnode

import (
	"context"
	"path/filepath"
	"runtime"

	"github.com/meshwarp/meshwarp/internal/netns"
)

// Explain says, for each node with a family off, what keeps it off: the
// netfilter rules and rp_filter settings the agent's check meets, read
// again now from the node's namespace (the caller's own for "host", else
// the one named in /run/netns; NameNodes first). The agent's own reading
// is not pinned; this one lists devices as an agent without --uplinks does.
func (s *Stats) Explain(ctx context.Context) {
	for i := range s.Nodes {
		n := &s.Nodes[i]
		if (n.IPv4 && n.IPv6) || n.Netns == "" {
			continue
		}
		path := ""
		if n.Netns != "host" {
			path = filepath.Join(netns.NamedDir, n.Netns)
		}
		v4, v6, err := readBlockers(ctx, path)
		if err != nil {
			continue
		}
		if !n.IPv4 {
			n.IPv4BlockedBy = v4
		}
		if !n.IPv6 {
			n.IPv6BlockedBy = v6
		}
	}
}

// readBlockers reads what blocks each family in the namespace at path ("":
// the caller's), on a thread that joins it and is discarded afterwards.
func readBlockers(ctx context.Context, path string) (v4, v6 []string, err error) {
	done := make(chan error, 1)
	go func() {
		runtime.LockOSThread() // never unlocked: the thread may have changed namespace
		n := &nodeLoop{cfg: Node{Netns: path}, name: path}
		if err := n.enter(); err != nil {
			done <- err
			return
		}
		devs, err := n.readDevices()
		if err != nil {
			done <- err
			return
		}
		nf := readNetfilter(ctx)
		v4, v6 = append(nf.v4, rpFilterBlockers(devs.rpFilter)...), nf.v6
		done <- nil
	}()
	err = <-done
	return v4, v6, err
}
