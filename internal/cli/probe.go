// SPDX-License-Identifier: Apache-2.0

package cli

import (
	"errors"

	"github.com/spf13/cobra"
)

// TODO: implemented by the probe work.
func newProbeCommand(g *globalOptions) *cobra.Command {
	return &cobra.Command{
		Use:   "probe",
		Short: "probe (not implemented yet)",
		RunE: func(cmd *cobra.Command, _ []string) error {
			return errors.New("probe: not implemented yet")
		},
	}
}
