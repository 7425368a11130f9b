// SPDX-License-Identifier: Apache-2.0

// Command meshwarp-agent is meshwarp's node agent, what the DaemonSet and
// its image run: probe, run, status, cleanup, version. It links none of the
// lab, bench or terminal UIs of cmd/meshwarp, so it stays small and starts
// without their init work.
package main

import (
	"context"
	"os"
	"os/signal"
	"syscall"

	"github.com/meshwarp/meshwarp/internal/cli"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	code := cli.Execute(ctx, cli.NewAgentCommand(), os.Args[1:])
	stop()
	os.Exit(code)
}
