// SPDX-License-Identifier: Apache-2.0

package cli

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"sort"
	"text/tabwriter"

	"github.com/spf13/cobra"

	"github.com/meshwarp/meshwarp/internal/accel"
	"github.com/meshwarp/meshwarp/internal/crossnode"
	"github.com/meshwarp/meshwarp/internal/probe"
)

func newStatusCommand(g *Global) *cobra.Command {
	var pinDir string
	var asJSON bool
	cmd := &cobra.Command{
		Use:   "status",
		Short: "Show what the attached accelerator did (reads the pinned maps)",
		Long: `status reads the counters pinned under --pin-dir. It works from any terminal
while 'meshwarp run' runs, and after the agent was killed (the data path stays
attached). Counters are cumulative across agent restarts.

  accelerated_sockets     sockets paired right now (both ends of a connection count, until
                          they leave to TCP or close; the connecting side's close ends both)
  redirected_*            bytes/messages moved socket-to-socket
  passthrough_*           traffic and connections that used the normal stack, by reason:
` + accel.ReasonsHelp(4, 88) + `
  removed_sockets_by_reason  sockets kept off the SOCKMAP (the connecting socket of a
                          no_local_peer, policy or splice_reader connection) or taken out
                          of it once their connection was left to TCP: from then on they
                          are plain TCP sockets (no per-message cost, native FIONREAD and splice).
                          A paired socket of a connection that went to TCP as a whole
                          (small_stream, one-way backpressure) leaves once its redirected
                          bytes are read
  paired_sockets_total    sockets that joined a paired connection
  left_sockets_total      those paired sockets that left (not counted as accelerated any more)
  sockhash_full           sockets not accelerated because the SOCKMAP was at capacity
  nat_port_remapped_connections  connections paired although NAT (conntrack under REDIRECT
                          or DNAT) rewrote their source port between the two ends
  observe_flows_full      observations lost because the flow table was full
  other_sockmap_programs  sock_ops/sk_msg programs of other tools on this node; a socket
                          whose sk_msg belongs to them stays on TCP (sockmap_busy)
  hops                    per mesh hop: app_to_sidecar, sidecar_to_sidecar, sidecar_to_app, direct
  splice_socket_reads     splice(2) reads of sockets by processes of the cgroup
  unfit_calls_by_reason   calls on accelerated sockets that taught a learned reason
  unfit_processes         the processes that taught a learned reason, with their calls
                          (watched while 'meshwarp run' runs)
  learned_programs        the programs (by task name: programs with the same name count as
                          one) that taught a learned reason: none of their later connections
                          is paired, on any port, as client or as server; kept across agent
                          restarts (pinned), with the connections kept off since;
                          meshwarp forget --program NAME pairs them again
  cross_node              with run --cross-node: packets redirected to_wire (local pod to
                          another node) and to_pod (another node into a local pod), with
                          bytes; packets passed to the normal path by reason; per node
                          namespace (netns cookie; named "host" or as in /run/netns when
                          found) whether the agent's check is current
                          (verified) and which families it redirects (netfilter rules in
                          the node's forwarding hooks, or IPv4 rp_filter, turn a family off;
                          ipv4_blocked_by / ipv6_blocked_by list them, read from the node
                          when status runs)
  kernel_features_differ  what this kernel does differently (the features of
                          'meshwarp probe' that are off, or use an older mechanism), each
                          with why: e.g. on 6.1 meshwarp tap and --cross-node are off`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			s, err := accel.ReadPinnedStats(pinDir)
			if errors.Is(err, os.ErrNotExist) {
				return printDetached(cmd.OutOrStdout(), pinDir, asJSON, err)
			}
			if err != nil {
				return err
			}
			if s.CrossNode != nil {
				s.CrossNode.NameNodes()
				s.CrossNode.Explain(cmd.Context())
			}
			// What this kernel does differently (probe.KernelFeatures): the
			// same rows `meshwarp probe` prints, those that are off or use
			// an older mechanism.
			var differs []probe.Feature
			for _, f := range probe.KernelFeatures() {
				if !f.On || f.Reason != "" {
					differs = append(differs, f)
				}
			}
			if asJSON {
				enc := json.NewEncoder(cmd.OutOrStdout())
				enc.SetIndent("", "  ")
				return enc.Encode(struct {
					accel.Stats
					KernelFeatures []probe.Feature `json:"kernel_features_differ,omitempty"`
				}{s, differs})
			}
			printStatus(cmd.OutOrStdout(), pinDir, s)
			if len(differs) > 0 {
				fmt.Fprintf(cmd.OutOrStdout(), "\non this kernel (see meshwarp probe):\n")
				if err := writeFeatures(cmd.OutOrStdout(), differs); err != nil {
					return err
				}
			}
			return nil
		},
	}
	AddPinDirFlag(cmd, &pinDir)
	cmd.Flags().BoolVar(&asJSON, "json", false, "print JSON")
	return cmd
}

func printStatus(w io.Writer, pinDir string, s accel.Stats) {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintf(tw, "pin dir\t%s\n", pinDir)
	fmt.Fprintf(tw, "accelerated sockets\t%d\n", s.AcceleratedSockets)
	fmt.Fprintf(tw, "redirected\t%d messages, %d bytes\n", s.RedirectedMessages, s.RedirectedBytes)
	fmt.Fprintf(tw, "passthrough\t%d messages, %d bytes\n", s.PassthroughMessages, s.PassthroughBytes)
	for _, r := range sortedKeys(s.PassthroughByReason) {
		if s.PassthroughByReason[r] == 0 && s.PassthroughConnections[r] == 0 {
			continue
		}
		fmt.Fprintf(tw, "  %s\t%d messages, %d connections, %d sockets removed\n", r, s.PassthroughByReason[r], s.PassthroughConnections[r], s.RemovedSockets[r])
	}
	fmt.Fprintf(tw, "paired sockets that left for TCP\t%d\n", s.LeftSockets)
	fmt.Fprintf(tw, "sockhash full\t%d\n", s.SockhashFull)
	fmt.Fprintf(tw, "paired across a NAT port remap\t%d connections\n", s.NATPortRemaps)
	tw.Flush()
	fmt.Fprintln(w)
	tw = tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "hop\tpaired conns\tmessages\tbytes\t")
	for _, h := range accel.HopNames() {
		hs := s.Hops[h]
		fmt.Fprintf(tw, "%s\t%d\t%d\t%d\t\n", h, hs.PairedConnections, hs.RedirectedMessages, hs.RedirectedBytes)
	}
	tw.Flush()
	if x := s.CrossNode; x != nil {
		printCrossNode(w, x)
	}
	if len(s.OtherSockmapPrograms) > 0 {
		fmt.Fprintf(w, "\nnote: other sock_ops/sk_msg programs run on this node; both run, and a socket whose\n"+
			"sk_msg program is theirs stays on TCP (passthrough reason sockmap_busy):\n")
		for _, p := range s.OtherSockmapPrograms {
			fmt.Fprintf(w, "  %s program id %d %q\n", p.Type, p.ID, p.Name)
		}
	}
	if s.SpliceSocketReads > 0 {
		fmt.Fprintf(w, "\nwarning: %d splice(2) reads from sockets in the accelerated cgroup. A socket read with\n"+
			"splice cannot see redirected bytes.\n", s.SpliceSocketReads)
	}
	if len(s.UnfitProcesses) > 0 {
		fmt.Fprintf(w, "\nlearned: these processes did on accelerated sockets what a redirect cannot honour; later\n"+
			"connections on those sockets' ports stay on TCP. Exclude their ports up front (--exclude-ports)\n"+
			"so that no first connection is affected:\n")
		for _, r := range s.UnfitProcesses {
			fmt.Fprintf(w, "  pid %d (%s): %s, %d calls\n", r.PID, r.Comm, r.Reason, r.Calls)
		}
	}
	if len(s.LearnedPrograms) > 0 {
		fmt.Fprintf(w, "\nlearned programs: none of their connections is paired any more, on any port (by task name;\n"+
			"kept across agent restarts; `meshwarp forget --program NAME` pairs one again):\n")
		for _, p := range s.LearnedPrograms {
			fmt.Fprintf(w, "  %s: %s, %d connections kept off since\n", p.Comm, p.Reason, p.KeptOffConnections)
		}
	}
}

// printDetached reports data paths that were uninstalled while accelerated
// connections were open: nothing is attached, but those connections still
// move socket-to-socket until they close.
func printDetached(w io.Writer, pinDir string, asJSON bool, notPinned error) error {
	open, _ := accel.DetachedSockets(pinDir)
	if asJSON {
		enc := json.NewEncoder(w)
		enc.SetIndent("", "  ")
		if err := enc.Encode(map[string]any{"attached": false, "detached_accelerated_sockets": open}); err != nil {
			return err
		}
		return WithExit(ExitFailure, fmt.Errorf("no agent pinned at %s", pinDir))
	}
	if open > 0 {
		fmt.Fprintf(w, "no agent attached at %s; %d sockets accelerated by an earlier agent are still open\n"+
			"(they keep working until they close; new connections use the normal stack)\n", pinDir, open)
	}
	return WithExit(ExitFailure, notPinned)
}

func sortedKeys(m map[string]uint64) []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	return keys
}

func printCrossNode(w io.Writer, x *crossnode.Stats) {
	fmt.Fprintf(w, "\ncross-node forwarding (%d devices)\n", x.Devices)
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	for _, d := range crossnode.DirectionNames() {
		fmt.Fprintf(tw, "  redirected %s\t%d packets, %d bytes\n", d, x.RedirectedPackets[d], x.RedirectedBytes[d])
	}
	for _, r := range crossnode.ReasonNames() {
		if x.PassedPackets[r] > 0 {
			fmt.Fprintf(tw, "  passed: %s\t%d packets\n", r, x.PassedPackets[r])
		}
	}
	for _, n := range x.Nodes {
		state := "redirecting"
		if !n.Verified {
			state = "not verified by a running agent: everything takes the normal path"
		}
		name := fmt.Sprintf("netns cookie %d", n.NetnsCookie)
		if n.Netns != "" {
			name = fmt.Sprintf("%s (netns cookie %d)", n.Netns, n.NetnsCookie)
		}
		fmt.Fprintf(tw, "  node %s\t%s; ipv4 %s, ipv6 %s\n", name, state, OnOff(n.IPv4), OnOff(n.IPv6))
		for _, b := range []struct {
			fam string
			by  []string
		}{{"ipv4", n.IPv4BlockedBy}, {"ipv6", n.IPv6BlockedBy}} {
			for _, why := range b.by {
				fmt.Fprintf(tw, "    %s off:\t%s\n", b.fam, why)
			}
		}
	}
	tw.Flush()
}
