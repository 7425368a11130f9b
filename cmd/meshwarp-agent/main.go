// SPDX-License-Identifier: Apache-2.0

// Command meshwarp-agent is meshwarp's node agent, what the DaemonSet and
// its image run: probe, run, status, cleanup, version. It links none of the
// lab, bench or terminal UIs of cmd/meshwarp, so it stays small and starts
// without their init work.
package main

import (
	"os"

	"github.com/meshwarp/meshwarp/internal/cli"
)

func main() {
	os.Exit(cli.Main(cli.NewAgentCommand()))
}
