// SPDX-License-Identifier: Apache-2.0

// Package cli holds the node agent's commands (probe, run, status, cleanup,
// version) and what every meshwarp command shares: global flags, exit codes,
// Execute. cmd/meshwarp-agent runs NewAgentCommand; the meshwarp binary adds
// the commands for people (internal/cli/full). One constructor per
// subcommand; main only wires signals.
//
// Keep this package's imports to what the agent needs: `go list -deps
// ./cmd/meshwarp-agent` must not list lab, bench, top, tap, fortio, Bubble
// Tea or gopacket (TestAgentDependencies).
package cli

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/signal"
	"syscall"

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

// WithExit wraps err so Execute exits with code.
func WithExit(code int, err error) error {
	if err == nil {
		return nil
	}
	return &exitError{code: code, err: err}
}

// UsageError is a bad-input error: exit code 2.
func UsageError(format string, args ...any) error {
	return WithExit(ExitUsage, fmt.Errorf(format, args...))
}

// Global holds the flags every command has.
type Global struct {
	Debug bool
}

// Logger logs to w at info level, debug with --debug.
func (g *Global) Logger(w io.Writer) *slog.Logger {
	level := slog.LevelInfo
	if g.Debug {
		level = slog.LevelDebug
	}
	return slog.New(slog.NewTextHandler(w, &slog.HandlerOptions{Level: level}))
}

// NewRoot returns a command tree without subcommands: use is the binary's
// name, long its help text.
func NewRoot(use, short, long string) (*cobra.Command, *Global) {
	g := &Global{}
	root := &cobra.Command{
		Use:           use,
		Short:         short,
		Long:          long,
		SilenceUsage:  true,
		SilenceErrors: true,
	}
	root.PersistentFlags().BoolVar(&g.Debug, "debug", false, "verbose logs")
	root.SetFlagErrorFunc(func(_ *cobra.Command, err error) error {
		return WithExit(ExitUsage, err)
	})
	return root, g
}

// AgentCommands are what the DaemonSet runs; both binaries have them.
func AgentCommands(g *Global) []*cobra.Command {
	return []*cobra.Command{
		newProbeCommand(g),
		newRunCommand(g),
		newStatusCommand(g),
		newCleanupCommand(g),
		newForgetCommand(g),
		newVersionCommand(),
	}
}

// NewAgentCommand returns the meshwarp-agent command tree.
func NewAgentCommand() *cobra.Command {
	root, g := NewRoot("meshwarp-agent", "meshwarp's node agent: accelerates same-node TCP with eBPF",
		`meshwarp-agent is what meshwarp's DaemonSet runs: it short-circuits TCP between
sockets on the same node with sock_ops + sk_msg + SOCKMAP and serves what it
does as Prometheus metrics. The meshwarp binary has the same commands and, for
people, lab, bench, top, trace and tap.

  meshwarp-agent probe     can this kernel accelerate? (names anything missing)
  meshwarp-agent run       attach and serve /metrics (root)
  meshwarp-agent status    what the running agent did
  meshwarp-agent cleanup   detach and unpin what a killed agent left
  meshwarp-agent forget    pair again a program or port the agent learned to leave to TCP`)
	root.AddCommand(AgentCommands(g)...)
	return root
}

// WriteJSON writes v to w as indented JSON, as every --json prints it
// (HTML characters as they are: "->" stays readable).
func WriteJSON(w io.Writer, v any) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	enc.SetEscapeHTML(false)
	if err := enc.Encode(v); err != nil {
		return fmt.Errorf("write json: %w", err)
	}
	return nil
}

// Main runs root with the process's arguments until it returns or SIGINT or
// SIGTERM cancels its context, and returns the exit code for os.Exit.
func Main(root *cobra.Command) int {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	return Execute(ctx, root, os.Args[1:])
}

// Execute runs the command line and returns the process exit code.
func Execute(ctx context.Context, root *cobra.Command, args []string) int {
	root.SetArgs(args)
	err := root.ExecuteContext(ctx)
	if err == nil {
		return ExitOK
	}
	fmt.Fprintf(os.Stderr, "%s: %v\n", root.Name(), err)
	return ExitCode(err)
}

// ExitCode is the one mapping of errors to exit codes: an explicit
// WithExit, then the refusal kinds of the packages below.
func ExitCode(err error) int {
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

// OnOff prints a switch.
func OnOff(b bool) string {
	if b {
		return "on"
	}
	return "off"
}

// PinDirEnv names the default pin directory of every command that takes
// --pin-dir. The chart sets it in the agent's container, so that
// `kubectl exec ds/meshwarp -- /meshwarp-agent status` reads the chart's
// pinDir without being told.
const PinDirEnv = "MESHWARP_PIN_DIR"

// DefaultPinDir is $MESHWARP_PIN_DIR, else accel.DefaultPinDir.
func DefaultPinDir() string {
	if d := os.Getenv(PinDirEnv); d != "" {
		return d
	}
	return accel.DefaultPinDir
}

// AddPinDirFlag gives a command that reads or changes what an agent pinned
// (status, cleanup, forget, top, trace, tap) its --pin-dir.
func AddPinDirFlag(cmd *cobra.Command, pinDir *string) {
	cmd.Flags().StringVar(pinDir, "pin-dir", DefaultPinDir(), "bpffs directory the agent pinned to; $"+PinDirEnv+" sets the default")
}
