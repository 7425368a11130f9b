// SPDX-License-Identifier: Apache-2.0

package cli

import (
	"errors"

	"github.com/spf13/cobra"
)

// TODO: implemented by the cleanup work.
func newCleanupCommand(g *globalOptions) *cobra.Command {
	return &cobra.Command{
		Use:   "cleanup",
		Short: "cleanup (not implemented yet)",
		RunE: func(cmd *cobra.Command, _ []string) error {
			return errors.New("cleanup: not implemented yet")
		},
	}
}
