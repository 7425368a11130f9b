// SPDX-License-Identifier: Apache-2.0

package bench

import (
	"errors"
	"fmt"

	"github.com/meshwarp/meshwarp/internal/accel"
)

// AgentTarget is one node's agent: its cgroup and, with several nodes, its
// node namespace for cross-node forwarding.
type AgentTarget struct {
	Cgroup    string
	NodeNetns string // "" with one node
}

// AgentPinDirs are the pin directories of n agents: pinDir, pinDir-node1, ...
func AgentPinDirs(pinDir string, n int) []string {
	out := []string{pinDir}
	for i := 1; i < n; i++ {
		out = append(out, fmt.Sprintf("%s-node%d", pinDir, i))
	}
	return out
}

// nodeAgents are the agents of one mode, one per node, read as one.
type nodeAgents []Agent

func (as nodeAgents) Stats() (accel.Stats, error) {
	var sum accel.Stats
	for i, a := range as {
		s, err := a.Stats()
		if err != nil {
			return sum, err
		}
		if i == 0 {
			sum = s
		} else {
			sum = sum.Add(s)
		}
	}
	return sum, nil
}

func (as nodeAgents) Flows() ([]accel.Flow, error) {
	var all []accel.Flow
	for _, a := range as {
		f, err := a.Flows()
		if err != nil {
			return nil, err
		}
		all = append(all, f...)
	}
	return all, nil
}

func (as nodeAgents) Uninstall() error {
	var errs []error
	for _, a := range as {
		errs = append(errs, a.Uninstall())
	}
	return errors.Join(errs...)
}

// Agent is an attached acceleration agent.
type Agent interface {
	// Stats reads its cumulative counters (accel.Stats: the one shape of them).
	Stats() (accel.Stats, error)
	// Flows reads its observation (nil when it does not observe).
	Flows() ([]accel.Flow, error)
	// Uninstall stops accelerating new connections and removes the pins.
	Uninstall() error
}

// deltaOf is the report's view of the counters of one run (after.Sub(before)).
func deltaOf(d accel.Stats) *AgentDelta {
	out := &AgentDelta{Counters: d.Counters.NonZero(), BPFRunSeconds: d.BPFRunSeconds}
	if x := d.CrossNode; x != nil {
		out.CrossNodeRedirected = x.RedirectedPackets
		for k, v := range x.PassedPackets {
			if v > 0 {
				if out.CrossNodePassed == nil {
					out.CrossNodePassed = map[string]uint64{}
				}
				out.CrossNodePassed[k] = v
			}
		}
	}
	return out
}

// StartAgentFunc attaches an agent to cgroupPath, pinning under pinDir.
type StartAgentFunc func(cgroupPath, pinDir string, settings AgentSettings) (Agent, error)
