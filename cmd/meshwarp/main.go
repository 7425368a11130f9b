// SPDX-License-Identifier: Apache-2.0

// Command meshwarp is the node agent and lab of meshwarp: it accelerates
// same-node TCP with sock_ops + sk_msg, shows what it does, and proves it.
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
	code := cli.Execute(ctx, os.Args[1:])
	stop()
	os.Exit(code)
}
