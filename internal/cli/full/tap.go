// SPDX-License-Identifier: Apache-2.0

package full

import (
	"errors"
	"io"
	"os"
	"path/filepath"

	"github.com/spf13/cobra"
	"golang.org/x/term"

	"github.com/meshwarp/meshwarp/internal/cli"
	"github.com/meshwarp/meshwarp/internal/tap"
)

func newTapCommand(_ *cli.Global) *cobra.Command {
	var o tap.Options
	var out, pod string
	var port uint16
	cmd := &cobra.Command{
		Use:   "tap",
		Short: "Write redirected (accelerated) traffic as pcapng for tshark and Wireshark (root)",
		Long: `Bytes that meshwarp redirects socket-to-socket never become packets, so tcpdump
cannot see them. tap makes them visible: while it runs, the agent's sk_msg
program also copies each redirected message (up to --snaplen bytes) to tap,
which writes pcapng with synthesised Ethernet/IPv4 or IPv6/TCP headers: the
connection's real addresses (as the connecting side sees them), ports and
sequence numbers, so Wireshark reassembles streams and decodes HTTP.
Connections that start while tap runs get their handshake too. Packets are on
the interface "meshwarp-redirect" and carry a comment naming the mesh hop.
Traffic meshwarp does not redirect is not here: capture it with tcpdump.

Drops are never silent: messages lost because tap fell behind and messages
cut by the snaplen are counted on stderr and in the pcapng interface
statistics. With no tap running the agent's program does no tap work at all:
tap swaps its own program into the agent's link, with the settings the
agent's program runs with, and puts that same program back on exit (also on
Ctrl-C). One tap at a time.`,
		Example: `  meshwarp tap -w /tmp/mesh.pcapng --duration 30s
  meshwarp tap -w - --port 8080 | tshark -r - -Y http
  meshwarp tap -w app.pcapng --pod meshwarp-pod-1 --count 1000`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if pod != "" && o.Netns != "" {
				return cli.UsageError("--pod and --netns name the same thing: give one")
			}
			if pod != "" {
				o.Netns = filepath.Join("/run/netns", pod)
				if _, err := os.Stat(o.Netns); err != nil {
					return cli.UsageError("--pod %s: no network namespace %s (ip netns list shows the names; lab pods are meshwarp-pod-0, meshwarp-pod-1)", pod, o.Netns)
				}
			}
			o.Port = port
			var w io.Writer
			switch out {
			case "-":
				if f, ok := cmd.OutOrStdout().(*os.File); ok && term.IsTerminal(int(f.Fd())) {
					return cli.UsageError("pcapng is binary and stdout is a terminal: pass -w FILE, or pipe: meshwarp tap -w - | tshark -r -")
				}
				w = cmd.OutOrStdout()
			default:
				f, err := os.Create(out)
				if err != nil {
					return cli.UsageError("cannot write %s: %v (choose a writable path with -w)", out, err)
				}
				defer f.Close()
				w = f
			}
			o.Out = w
			o.Progress = cmd.ErrOrStderr()
			res, err := tap.Run(cmd.Context(), o)
			if err != nil && res.Messages == 0 && out != "-" {
				os.Remove(out) // nothing was captured: leave no empty file behind
			}
			switch {
			case errors.Is(err, tap.ErrNoAgent), errors.Is(err, tap.ErrUnsupported):
				return cli.WithExit(cli.ExitNotReady, err)
			case errors.Is(err, tap.ErrBadOptions):
				return cli.WithExit(cli.ExitUsage, err)
			}
			return err
		},
	}
	f := cmd.Flags()
	f.StringVarP(&out, "write", "w", "-", `pcapng file to write ("-": stdout)`)
	f.Uint16Var(&port, "port", 0, "only connections with this port at either end (0: all)")
	f.StringVar(&pod, "pod", "", "only messages sent from this pod (a network namespace name, as ip netns lists)")
	f.StringVar(&o.Netns, "netns", "", "only messages sent from this network namespace (a path, e.g. /proc/PID/ns/net)")
	f.IntVar(&o.Count, "count", 0, "stop after this many messages (0: no limit)")
	f.DurationVar(&o.Duration, "duration", 0, "stop after this long (0: until Ctrl-C)")
	f.IntVar(&o.Snaplen, "snaplen", tap.DefaultSnaplen, "payload bytes kept per message")
	cli.AddPinDirFlag(cmd, &o.PinDir)
	return cmd
}
