// SPDX-License-Identifier: Apache-2.0

package cli

import (
	"errors"

	"github.com/spf13/cobra"
)

// TODO: implemented by the run work.
func newRunCommand(g *globalOptions) *cobra.Command {
	return &cobra.Command{
		Use:   "run",
		Short: "run (not implemented yet)",
		RunE: func(cmd *cobra.Command, _ []string) error {
			return errors.New("run: not implemented yet")
		},
	}
}
