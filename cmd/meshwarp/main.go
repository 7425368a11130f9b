// SPDX-License-Identifier: Apache-2.0

// Command meshwarp is meshwarp for people: the node agent's commands and the
// lab, bench, top, trace and tap. It accelerates same-node TCP with
// sock_ops + sk_msg, shows what it does, and proves it. The DaemonSet runs
// the smaller cmd/meshwarp-agent.
package main

import (
	"context"
	"os"
	"os/signal"
	"syscall"

	"github.com/meshwarp/meshwarp/internal/cli"
	"github.com/meshwarp/meshwarp/internal/cli/full"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	code := cli.Execute(ctx, full.NewRootCommand(), os.Args[1:])
	stop()
	os.Exit(code)
}
