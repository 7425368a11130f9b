// SPDX-License-Identifier: Apache-2.0

// Package cli builds the meshwarp command tree. One constructor per
// subcommand; main only wires signals.
package cli

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"

	"github.com/spf13/cobra"

	"github.com/meshwarp/meshwarp/internal/accel"
	"github.com/meshwarp/meshwarp/internal/probe"
)

// Exit codes scripts can rely on.
const (
	ExitOK       = 0
	ExitFailure  = 1 // the command ran and failed (or a check failed)
	ExitUsage    = 2 // bad flags or arguments
	ExitNotReady = 3 // the kernel or machine lacks something meshwarp needs
)

// exitError carries an exit code through cobra's error return.
type exitError struct {
	code int
	err  error
}

func (e *exitError) Error() string { return e.err.Error() }
func (e *exitError) Unwrap() error { return e.err }

// withExit wraps err so Execute exits with code.
func withExit(code int, err error) error {
	if err == nil {
		return nil
	}
	return &exitError{code: code, err: err}
}

// usageError is a bad-input error: exit code 2.
func usageError(format string, args ...any) error {
	return withExit(ExitUsage, fmt.Errorf(format, args...))
}

type globalOptions struct {
	debug bool
}

func (g *globalOptions) logger(w io.Writer) *slog.Logger {
	level := slog.LevelInfo
	if g.debug {
		level = slog.LevelDebug
	}
	return slog.New(slog.NewTextHandler(w, &slog.HandlerOptions{Level: level}))
}

// NewRootCommand returns the meshwarp command tree.
func NewRootCommand() *cobra.Command {
	g := &globalOptions{}
	root := &cobra.Command{
		Use:   "meshwarp",
		Short: "eBPF data-plane accelerator for service meshes",
		Long: `meshwarp short-circuits TCP between sockets on the same node (app <-> sidecar,
sidecar <-> sidecar, pod <-> pod) with sock_ops + sk_msg + SOCKHASH, shows what it
does, and proves it with a lab of network namespaces and real sidecar proxies.

Start with:
  meshwarp probe          can this kernel accelerate? (names anything missing)
  meshwarp run            attach and serve /metrics (root)
  meshwarp status         what the running agent did
  meshwarp tap -w F       accelerated traffic as pcapng (tcpdump cannot see it)
  meshwarp lab up         build a node of namespaces with HAProxy sidecars
  meshwarp bench --quick  direct / sidecar / sidecar+meshwarp side by side`,
		SilenceUsage:  true,
		SilenceErrors: true,
	}
	root.PersistentFlags().BoolVar(&g.debug, "debug", false, "verbose logs")
	root.SetFlagErrorFunc(func(_ *cobra.Command, err error) error {
		return withExit(ExitUsage, err)
	})
	root.AddCommand(
		newProbeCommand(g),
		newRunCommand(g),
		newStatusCommand(g),
		newCleanupCommand(g),
		newTapCommand(g),
		newTraceCommand(g),
		newTopCommand(g),
		newLabCommand(g),
		newBenchCommand(g),
		newVersionCommand(),
	)
	return root
}

// Execute runs the command line and returns the process exit code.
func Execute(ctx context.Context, args []string) int {
	root := NewRootCommand()
	root.SetArgs(args)
	err := root.ExecuteContext(ctx)
	if err == nil {
		return ExitOK
	}
	fmt.Fprintf(os.Stderr, "meshwarp: %v\n", err)
	return exitCode(err)
}

// exitCode is the one mapping of errors to exit codes: an explicit
// withExit, then the refusal kinds of the packages below.
func exitCode(err error) int {
	var ee *exitError
	switch {
	case errors.As(err, &ee):
		return ee.code
	case errors.Is(err, accel.ErrBadConfig):
		return ExitUsage
	case errors.Is(err, probe.ErrNotReady):
		return ExitNotReady
	}
	return ExitFailure
}
