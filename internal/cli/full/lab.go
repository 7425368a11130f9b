// SPDX-License-Identifier: Apache-2.0

package full

import (
	"context"
	"errors"
	"fmt"
	"io"
	"strings"
	"text/tabwriter"

	"github.com/spf13/cobra"

	"github.com/meshwarp/meshwarp/internal/accel"
	"github.com/meshwarp/meshwarp/internal/bench"
	"github.com/meshwarp/meshwarp/internal/cli"
	"github.com/meshwarp/meshwarp/internal/lab"
)

func newLabCommand(g *cli.Global) *cobra.Command {
	cmd := &cobra.Command{
		Use:   "lab",
		Short: "Build a node of network namespaces with HAProxy sidecars to measure meshwarp on",
		Long: `lab builds a Kubernetes-like node out of network namespaces on this machine:

  netns meshwarp-node    bridge mw-br0 10.211.0.1/24
  netns meshwarp-pod-N   veth into the bridge, 10.211.0.(N+2); pod-0 is the client,
                         pod-1 (and any further pod) a server running fortio's HTTP echo
                         (:8080), TCP echo (:8078) and a qperf server (:19765)
  in every pod           Istio-style capture in the nat table (chains MESHWARP_*):
                         outbound TCP not from uid 1337 and not to 127/8 -> :15001,
                         inbound TCP -> :15006; a real HAProxy as uid 1337 listening on
                         both, forwarding to the original destination (outbound) and to
                         the local app from 127.0.0.6 (inbound); mode http for :8080
  cgroup v2 meshwarp-lab every process the lab starts, from its first instruction
  /run/meshwarp-lab      state, pid files, HAProxy configs and stats sockets, logs/

Traffic only flows inside these namespaces; nothing is created in the root network
namespace. Needs root and the packages from scripts/install-deps.sh.`,
		Example: `  sudo meshwarp lab up
  sudo meshwarp lab status
  sudo meshwarp lab capture off     # direct mode: pods talk without sidecars
  sudo meshwarp lab down`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			return cmd.Help()
		},
		SilenceUsage: true,
	}
	cmd.AddCommand(
		newLabUpCommand(g),
		newLabDownCommand(g),
		newLabStatusCommand(),
		newLabCaptureCommand(),
		newLabPodCommand(),
	)
	return cmd
}

func newLabUpCommand(g *cli.Global) *cobra.Command {
	opts := lab.DefaultOptions()
	cmd := &cobra.Command{
		Use:   "up",
		Short: "Build the lab (or verify and repair the one that is up)",
		Long: `up creates the namespaces, bridge, veths, capture rules, HAProxy sidecars and apps,
waits until every listener accepts, and checks that a request from the client pod
reaches the server pod's apps (through both sidecars when capture is on).

up is idempotent: on a lab that is up it verifies and restarts what is missing;
a lab left half-built by an interrupted up is removed and rebuilt. Progress goes
to stderr, a summary to stdout.

--nodes 2 builds a second node namespace joined to the first by a veth wire,
with routes between the nodes' pod prefixes (no overlay): pod i lives on node
i%2, so the client (pod-0) and the server (pod-1) talk across nodes, routed by
both nodes, with the same capture in every pod. Every pod also has an IPv6
address (not captured: the sidecars serve IPv4).`,
		Example: `  sudo meshwarp lab up
  sudo meshwarp lab up --pods 3 --capture=false
  sudo meshwarp lab up --nodes 2          # client and server on different nodes`,
		Args:         cobra.NoArgs,
		SilenceUsage: true,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if opts.Pods < 2 || opts.Pods > lab.MaxPods {
				return cli.UsageError("--pods %d: want 2..%d (pod-0 is the client, pod-1 the server)", opts.Pods, lab.MaxPods)
			}
			if opts.Nodes < 1 || opts.Nodes > lab.MaxNodes {
				return cli.UsageError("--nodes %d: want 1..%d", opts.Nodes, lab.MaxNodes)
			}
			logger := g.Logger(cmd.ErrOrStderr())
			l, err := lab.Up(cmd.Context(), opts, logger)
			if err != nil {
				return fmt.Errorf("lab up: %w", err)
			}
			defer l.Close()
			st, err := l.Status()
			if err != nil {
				return err
			}
			return writeLabStatus(cmd.OutOrStdout(), st)
		},
	}
	cmd.Flags().IntVar(&opts.Pods, "pods", opts.Pods, "number of pods: pod-0 is the client, the others are servers")
	cmd.Flags().IntVar(&opts.Nodes, "nodes", opts.Nodes, "number of node namespaces (1 or 2); pod i lives on node i%nodes")
	cmd.Flags().BoolVar(&opts.Capture, "capture", opts.Capture, "install the sidecar capture rules (false: pods talk directly)")
	cmd.Flags().Uint32Var(&opts.SidecarUID, "sidecar-uid", opts.SidecarUID, "uid the HAProxy sidecars run as; the capture rules exempt it")
	return cmd
}

func newLabDownCommand(g *cli.Global) *cobra.Command {
	return &cobra.Command{
		Use:   "down",
		Short: "Remove everything the lab made (also after an interrupted up)",
		Long: `down stops the lab's processes, deletes its iptables chains, links, namespaces
and cgroup, and removes /run/meshwarp-lab. It finds things by their meshwarp names
and pid files, not only through the state file, so it also cleans up after an up
that crashed half-way. It never touches anything it did not create. Running it
without a lab is harmless.

The system user meshwarp-proxy (uid 1337), created by up when that uid had no
account, is kept.`,
		Args:         cobra.NoArgs,
		SilenceUsage: true,
		RunE: func(cmd *cobra.Command, _ []string) error {
			// Cleanup must finish even after Ctrl-C.
			ctx := context.WithoutCancel(cmd.Context())
			if err := lab.Down(ctx, g.Logger(cmd.ErrOrStderr())); err != nil {
				return err
			}
			return nil
		},
	}
}

func newLabStatusCommand() *cobra.Command {
	var asJSON bool
	cmd := &cobra.Command{
		Use:   "status",
		Short: "Show the lab: namespaces, pods and IPs, processes, capture on/off",
		Long: `status reads the running lab: namespaces, pods with their IPs, whether each
process is alive, and whether the capture rules are installed in each pod.
With two nodes it also names each node's cgroup and prints the two agent
commands to run, one per node (its namespace, cgroup, pin directory and
metrics port), as on separate machines.

Exit status: 0 the lab is up and healthy, 1 it is down or something is wrong
(listed under problems).`,
		Example: `  sudo meshwarp lab status
  sudo meshwarp lab status --json | jq '.pods[] | {name, ip}'`,
		Args:         cobra.NoArgs,
		SilenceUsage: true,
		RunE: func(cmd *cobra.Command, _ []string) error {
			out := cmd.OutOrStdout()
			l, err := lab.Load()
			if err != nil {
				left := lab.Leftovers()
				if asJSON {
					if err := cli.WriteJSON(out, struct {
						Up        bool     `json:"up"`
						Healthy   bool     `json:"healthy"`
						Error     string   `json:"error"`
						Leftovers []string `json:"leftovers,omitempty"`
					}{false, false, err.Error(), left}); err != nil {
						return err
					}
				} else {
					fmt.Fprintln(out, "lab: down")
					if len(left) > 0 {
						fmt.Fprintf(out, "leftovers: %s\n", strings.Join(left, ", "))
					}
				}
				if len(left) > 0 && errors.Is(err, lab.ErrNotUp) {
					err = fmt.Errorf("%w (leftovers of an earlier lab exist: `meshwarp lab down` removes them)", err)
				}
				return err
			}
			defer l.Close()
			st, err := l.Status()
			if err != nil {
				return fmt.Errorf("lab status: %w", err)
			}
			if asJSON {
				err = cli.WriteJSON(out, st)
			} else {
				err = writeLabStatus(out, st)
			}
			if err != nil {
				return err
			}
			if !st.Healthy {
				return fmt.Errorf("lab is up but unhealthy: %s", strings.Join(st.Problems, "; "))
			}
			return nil
		},
	}
	cmd.Flags().BoolVar(&asJSON, "json", false, "print JSON")
	return cmd
}

func newLabCaptureCommand() *cobra.Command {
	return &cobra.Command{
		Use:   "capture on|off",
		Short: "Switch the sidecar capture rules on or off in every pod",
		Long: `capture adds (on) or removes (off) the jumps into the MESHWARP_* capture chains in
every pod. With capture off, pods talk to each other directly and the sidecars sit
idle. New connections follow at once; open connections keep their path.`,
		Args: func(_ *cobra.Command, args []string) error {
			if len(args) != 1 || (args[0] != "on" && args[0] != "off") {
				return cli.UsageError("capture takes one argument, on or off")
			}
			return nil
		},
		SilenceUsage: true,
		RunE: func(cmd *cobra.Command, args []string) error {
			l, err := lab.Load()
			if err != nil {
				return err
			}
			defer l.Close()
			if err := l.SetCapture(args[0] == "on"); err != nil {
				return fmt.Errorf("lab capture %s: %w", args[0], err)
			}
			fmt.Fprintf(cmd.OutOrStdout(), "capture %s\n", args[0])
			return nil
		},
	}
}

func writeLabStatus(w io.Writer, st lab.Status) error {
	health := "healthy"
	if !st.Healthy {
		health = "UNHEALTHY"
	}
	capture := "off (direct)"
	if st.Capture {
		capture = "on (sidecars)"
	}
	fmt.Fprintf(w, "lab: up, %s\ncapture: %s\ncgroup: %s\n", health, capture, st.Cgroup)
	for _, n := range st.Nodes {
		fmt.Fprintf(w, "node: netns %s, bridge %s %s %s", n.Netns, n.Bridge, n.IP, n.IP6)
		if n.Wire != "" {
			fmt.Fprintf(w, ", wire %s, cgroup %s", n.Wire, n.Cgroup)
		}
		fmt.Fprintln(w)
	}
	if len(st.Nodes) > 1 {
		// One agent per node, as on separate machines: an agent over the lab's
		// whole cgroup would pair sockets across the nodes (they share a kernel).
		fmt.Fprintln(w, "agents (one per node, each in its own shell):")
		pins := bench.AgentPinDirs(accel.DefaultPinDir, len(st.Nodes))
		for i, n := range st.Nodes {
			fmt.Fprintf(w, "  meshwarp run --cross-node --node-netns /run/netns/%s --cgroup %s --pin-dir %s --metrics-addr 127.0.0.1:%d\n",
				n.Netns, n.Cgroup, pins[i], cli.DefaultMetricsPort+i)
		}
	}
	fmt.Fprintln(w)
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "POD\tROLE\tNODE\tNETNS\tIP\tIPV6\tCAPTURE\tPROCESSES")
	for _, p := range st.Pods {
		var procs []string
		for _, pr := range p.Processes {
			if pr.Alive {
				procs = append(procs, fmt.Sprintf("%s(%d)", pr.Name, pr.PID))
			} else {
				procs = append(procs, pr.Name+"(DEAD)")
			}
		}
		ns := p.Netns
		if !p.Exists {
			ns += " (MISSING)"
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n", p.Name, p.Role, p.Node, ns, p.IP, p.IP6, cli.OnOff(p.Capture), strings.Join(procs, " "))
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	if len(st.Problems) > 0 {
		fmt.Fprintln(w, "\nproblems:")
		for _, p := range st.Problems {
			fmt.Fprintf(w, "  - %s\n", p)
		}
	}
	return nil
}
