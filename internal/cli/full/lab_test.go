// SPDX-License-Identifier: Apache-2.0

package full

import (
	"bytes"
	"strings"
	"testing"

	"github.com/meshwarp/meshwarp/internal/lab"
)

// TestLabStatusAgentCommands: a two-node lab's status names one agent per
// node, each on its node's namespace and cgroup, with its own pin directory
// and metrics port (two agents on one pin directory are refused).
func TestLabStatusAgentCommands(t *testing.T) {
	st := lab.Status{Up: true, Healthy: true, Cgroup: "/cg/meshwarp-lab", Nodes: []lab.NodeStatus{
		{Netns: "meshwarp-node", Cgroup: "/cg/meshwarp-lab/node-0", Wire: "10.211.254.1"},
		{Netns: "meshwarp-node-1", Cgroup: "/cg/meshwarp-lab/node-1", Wire: "10.211.254.2"},
	}}
	var b bytes.Buffer
	if err := writeLabStatus(&b, st); err != nil {
		t.Fatal(err)
	}
	var cmds []string
	for _, line := range strings.Split(b.String(), "\n") {
		if strings.HasPrefix(strings.TrimSpace(line), "meshwarp run --cross-node") {
			cmds = append(cmds, strings.TrimSpace(line))
		}
	}
	if len(cmds) != 2 {
		t.Fatalf("want 2 agent commands, got %d:\n%s", len(cmds), b.String())
	}
	seen := map[string]bool{}
	for i, c := range cmds {
		f := strings.Fields(c)
		flag := func(name string) string {
			for j := range f[:len(f)-1] {
				if f[j] == name {
					return f[j+1]
				}
			}
			t.Fatalf("command %q has no %s", c, name)
			return ""
		}
		if got, want := flag("--node-netns"), "/run/netns/"+st.Nodes[i].Netns; got != want {
			t.Errorf("node %d: --node-netns %s, want %s", i, got, want)
		}
		if got := flag("--cgroup"); got != st.Nodes[i].Cgroup {
			t.Errorf("node %d: --cgroup %s, want %s", i, got, st.Nodes[i].Cgroup)
		}
		for _, name := range []string{"--pin-dir", "--metrics-addr"} {
			v := flag(name)
			if seen[name+v] {
				t.Errorf("%s %s is given to both agents", name, v)
			}
			seen[name+v] = true
		}
	}
	// Parse them as run does.
	for _, c := range cmds {
		cmd := NewRootCommand()
		cmd.SetArgs(append(strings.Fields(c)[1:], "--help"))
		cmd.SetOut(&bytes.Buffer{})
		if err := cmd.Execute(); err != nil {
			t.Errorf("%q does not parse: %v", c, err)
		}
	}
}
