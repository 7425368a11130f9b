// SPDX-License-Identifier: Apache-2.0

// Command meshwarp is meshwarp for people: the node agent's commands and the
// lab, bench, top, trace and tap. It accelerates same-node TCP with
// sock_ops + sk_msg, shows what it does, and proves it. The DaemonSet runs
// the smaller cmd/meshwarp-agent.
package main

import (
	"os"

	"github.com/meshwarp/meshwarp/internal/cli"
	"github.com/meshwarp/meshwarp/internal/cli/full"
)

func main() {
	os.Exit(cli.Main(full.NewRootCommand()))
}
