// SPDX-License-Identifier: Apache-2.0

package cli

import (
	"errors"
	"fmt"
	"strings"

	"github.com/spf13/cobra"

	"github.com/meshwarp/meshwarp/internal/accel"
)

func newForgetCommand(g *Global) *cobra.Command {
	var (
		pinDir   string
		programs []string
		ports    []uint
		all      bool
		asJSON   bool
	)
	cmd := &cobra.Command{
		Use:   "forget (--program NAME | --port PORT)... | --all",
		Short: "Take back what the agent learned: pair a program's or a port's connections again",
		Long: `When a program does something a redirected socket cannot honour (MSG_WAITALL,
MSG_OOB, splice, an option set after bytes were redirected; see status --help),
the agent learns the program and the server port: their later connections stay
on TCP, across agent restarts. forget takes that back, after the program was
fixed or upgraded: their next connections are paired again (and learned again
if they still do it). Connections already open keep their path.

Programs are named as ` + "`meshwarp status`" + ` lists them (the kernel's task name, at
most 15 bytes). Exit 1 if something named was not learned (a typo shows), 2 on
bad usage.`,
		Example: `  meshwarp forget --program nginx
  meshwarp forget --port 8080 --port 9090
  meshwarp forget --all`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if all == (len(programs)+len(ports) > 0) {
				return WithExit(ExitUsage, errors.New("name what to forget: --program NAME or --port PORT (repeatable), or --all; `meshwarp status` lists what was learned"))
			}
			var port16 []uint16
			for _, p := range ports {
				if p == 0 || p > 65535 {
					return WithExit(ExitUsage, fmt.Errorf("--port %d: a TCP port is 1 to 65535", p))
				}
				port16 = append(port16, uint16(p))
			}
			res, err := accel.Forget(pinDir, accel.ForgetRequest{Programs: programs, Ports: port16, All: all})
			if err != nil {
				return err
			}
			if asJSON {
				if err := WriteJSON(cmd.OutOrStdout(), res); err != nil {
					return err
				}
			} else {
				out := cmd.OutOrStdout()
				for _, p := range res.Programs {
					fmt.Fprintf(out, "forgot program %s: its next connections are paired again\n", p)
				}
				for _, p := range res.Ports {
					fmt.Fprintf(out, "forgot port %d: its next connections are paired again\n", p)
				}
				if all && len(res.Programs)+len(res.Ports) == 0 {
					fmt.Fprintf(out, "nothing was learned under %s\n", pinDir)
				}
			}
			if len(res.NotLearned) > 0 {
				return WithExit(1, fmt.Errorf("not learned: %s (`meshwarp status` lists what was)", strings.Join(res.NotLearned, ", ")))
			}
			return nil
		},
	}
	AddPinDirFlag(cmd, &pinDir)
	cmd.Flags().StringArrayVar(&programs, "program", nil, "a learned program's name, as status lists it (repeatable)")
	cmd.Flags().UintSliceVar(&ports, "port", nil, "a learned server port (repeatable)")
	cmd.Flags().BoolVar(&all, "all", false, "forget every learned program and port")
	cmd.Flags().BoolVar(&asJSON, "json", false, "print JSON")
	return cmd
}
