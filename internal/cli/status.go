// SPDX-License-Identifier: Apache-2.0

package cli

import (
	"errors"

	"github.com/spf13/cobra"
)

// TODO: implemented by the status work.
func newStatusCommand(g *globalOptions) *cobra.Command {
	return &cobra.Command{
		Use:   "status",
		Short: "status (not implemented yet)",
		RunE: func(cmd *cobra.Command, _ []string) error {
			return errors.New("status: not implemented yet")
		},
	}
}
