// SPDX-License-Identifier: Apache-2.0

package cli

import (
	"errors"

	"github.com/spf13/cobra"
)

// TODO: implemented by the bench work.
func newBenchCommand(g *globalOptions) *cobra.Command {
	return &cobra.Command{
		Use:   "bench",
		Short: "bench (not implemented yet)",
		RunE: func(cmd *cobra.Command, _ []string) error {
			return errors.New("bench: not implemented yet")
		},
	}
}
