// SPDX-License-Identifier: Apache-2.0

package cli

import (
	"errors"

	"github.com/spf13/cobra"
)

// TODO: implemented by the lab work.
func newLabCommand(g *globalOptions) *cobra.Command {
	return &cobra.Command{
		Use:   "lab",
		Short: "lab (not implemented yet)",
		RunE: func(cmd *cobra.Command, _ []string) error {
			return errors.New("lab: not implemented yet")
		},
	}
}
