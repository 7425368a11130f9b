// SPDX-License-Identifier: Apache-2.0

package cli

import (
	"fmt"

	"github.com/spf13/cobra"

	"github.com/meshwarp/meshwarp/internal/accel"
)

func newCleanupCommand(g *Global) *cobra.Command {
	var pinDir string
	var asJSON bool
	cmd := &cobra.Command{
		Use:   "cleanup",
		Short: "Detach and unpin everything meshwarp attached (safe under load)",
		Long: `cleanup detaches the programs pinned under --pin-dir and removes the pins
that a killed agent, or one stopped with --keep-on-exit, left. While an agent
runs there it refuses (exit 1, naming the agent's pid): the agent's own links
keep its programs attached, so stop the agent instead (SIGTERM uninstalls).
It never removes a socket from
the SOCKMAP (that could drop bytes queued for it): connections accelerated
before cleanup keep working until they close, then the kernel frees the rest.
New connections use the normal TCP stack at once. Only meshwarp's own pins are
removed; running it twice is harmless.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			res, err := accel.Cleanup(pinDir)
			if asJSON {
				if jerr := WriteJSON(cmd.OutOrStdout(), res); jerr != nil {
					return jerr
				}
				return err
			}
			out := cmd.OutOrStdout()
			if len(res.Removed) == 0 && err == nil {
				fmt.Fprintf(out, "nothing to clean: no meshwarp pins under %s\n", pinDir)
				return nil
			}
			for _, p := range res.Removed {
				fmt.Fprintf(out, "removed %s\n", p)
			}
			if res.OpenAcceleratedSockets > 0 {
				fmt.Fprintf(out, "%d accelerated sockets are still open; they keep working until they close\n", res.OpenAcceleratedSockets)
			}
			if res.ReleasedUnpairedSockets > 0 {
				fmt.Fprintf(out, "%d connecting sockets still waiting for a peer went back to plain TCP\n", res.ReleasedUnpairedSockets)
			}
			return err
		},
	}
	AddPinDirFlag(cmd, &pinDir)
	cmd.Flags().BoolVar(&asJSON, "json", false, "print JSON")
	return cmd
}
