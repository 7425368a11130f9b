// SPDX-License-Identifier: Apache-2.0

// Package full is the meshwarp binary's command tree: the agent's commands
// (internal/cli) and those for people: lab, bench, top, trace, tap. They
// link what the agent must not (fortio, Bubble Tea, gopacket), so they live
// apart from it.
package full

import (
	"github.com/spf13/cobra"

	"github.com/meshwarp/meshwarp/internal/cli"
)

// NewRootCommand returns the meshwarp command tree.
func NewRootCommand() *cobra.Command {
	root, g := cli.NewRoot("meshwarp", "eBPF data-plane accelerator for service meshes",
		`meshwarp short-circuits TCP between sockets on the same node (app <-> sidecar,
sidecar <-> sidecar, pod <-> pod) with sock_ops + sk_msg + SOCKMAP, shows what it
does, and proves it with a lab of network namespaces and real sidecar proxies.
The DaemonSet runs meshwarp-agent, which has probe, run, status and cleanup only.

Start with:
  meshwarp probe          can this kernel accelerate? (names anything missing)
  meshwarp run            attach and serve /metrics (root)
  meshwarp status         what the running agent did
  meshwarp tap -w F       accelerated traffic as pcapng (tcpdump cannot see it)
  meshwarp lab up         build a node of namespaces with HAProxy sidecars
  meshwarp bench --quick  direct / sidecar / sidecar+meshwarp side by side`)
	root.AddCommand(cli.AgentCommands(g)...)
	root.AddCommand(
		newTapCommand(g),
		newTraceCommand(g),
		newTopCommand(g),
		newLabCommand(g),
		newBenchCommand(g),
	)
	return root
}
