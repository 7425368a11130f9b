// SPDX-License-Identifier: Apache-2.0

package lab

import (
	"context"
	"fmt"
	"time"
)

// Status is what `meshwarp lab status` shows.
type Status struct {
	Up       bool         `json:"up"`      // a lab is up (state ready)
	Healthy  bool         `json:"healthy"` // up, every namespace there, every process alive, capture as recorded
	Capture  bool         `json:"capture"` // as recorded by Up/SetCapture
	Cgroup   string       `json:"cgroup"`
	RunDir   string       `json:"run_dir"`
	Nodes    []NodeStatus `json:"nodes"`
	Pods     []PodStatus  `json:"pods"`
	Problems []string     `json:"problems,omitempty"` // what is wrong, one line each
}

// NodeStatus describes a node namespace.
type NodeStatus struct {
	Netns  string `json:"netns"`
	Exists bool   `json:"exists"`
	Bridge string `json:"bridge"`
	IP     string `json:"ip"`             // the bridge's (the pods' gateway)
	IP6    string `json:"ip6"`            // the bridge's IPv6 address
	Wire   string `json:"wire,omitempty"` // the wire's address on this node (two nodes)
	Cgroup string `json:"cgroup"`         // its pods' processes: attach this node's agent here
}

// PodStatus describes one pod.
type PodStatus struct {
	Name      string          `json:"name"`
	Role      string          `json:"role"` // "client" or "server"
	Netns     string          `json:"netns"`
	Node      string          `json:"node"` // the node namespace it hangs off
	IP        string          `json:"ip"`
	IP6       string          `json:"ip6"`
	Exists    bool            `json:"exists"`  // the namespace exists
	Capture   bool            `json:"capture"` // capture jumps present (read from iptables)
	Processes []ProcessStatus `json:"processes"`
}

// ProcessStatus describes one lab process.
type ProcessStatus struct {
	Name  string `json:"name"` // "haproxy", "apps", "qperf"
	PID   int    `json:"pid,omitempty"`
	Alive bool   `json:"alive"`
	Log   string `json:"log"`
}

// Status inspects the running lab: namespaces, addresses, processes and the
// capture rules actually installed.
func (l *Lab) Status() (Status, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	capture := l.Capture()
	s := Status{
		Up:      true,
		Capture: capture,
		Cgroup:  l.cgroup,
		RunDir:  RunDir,
	}
	for i, n := range l.nodes {
		ns := NodeStatus{Netns: n.Netns, Exists: netnsExists(n.Netns), Bridge: BridgeName, IP: n.Bridge.String(), IP6: n.Bridge6.String(),
			Cgroup: l.NodeCgroup(i)}
		if len(l.nodes) > 1 {
			ns.Wire = n.Wire.String()
		}
		if !ns.Exists {
			s.Problems = append(s.Problems, "netns "+n.Netns+" is missing")
		}
		s.Nodes = append(s.Nodes, ns)
	}
	if !exists(l.cgroup) {
		s.Problems = append(s.Problems, "cgroup "+l.cgroup+" is missing")
	}
	for _, p := range l.pods {
		ps := PodStatus{Name: p.Name, Role: p.role(), Netns: p.Netns, Node: l.nodes[p.Node].Netns,
			IP: p.IP.String(), IP6: p.IP6.String(), Exists: netnsExists(p.Netns)}
		if !ps.Exists {
			s.Problems = append(s.Problems, "netns "+p.Netns+" is missing")
		} else {
			on, err := l.r.captureState(ctx, p.Netns)
			if err != nil {
				return s, err
			}
			ps.Capture = on
			if on != capture {
				s.Problems = append(s.Problems, fmt.Sprintf("%s: capture is %v, recorded %v", p.Name, onOff(on), onOff(capture)))
			}
		}
		ds, err := l.daemons(p)
		if err != nil {
			return s, err
		}
		for _, d := range ds {
			pid := ownedPid(p.Name, p.Netns, d.name)
			proc := ProcessStatus{Name: d.name, PID: pid, Alive: pid != 0, Log: logFile(p.Name, d.name)}
			if !proc.Alive {
				proc.PID = readPidFile(p.Name, d.name)
				s.Problems = append(s.Problems, fmt.Sprintf("%s: %s is not running (log: %s)", p.Name, d.name, proc.Log))
			}
			ps.Processes = append(ps.Processes, proc)
		}
		s.Pods = append(s.Pods, ps)
	}
	s.Healthy = len(s.Problems) == 0
	return s, nil
}

func onOff(b bool) string {
	if b {
		return "on"
	}
	return "off"
}
