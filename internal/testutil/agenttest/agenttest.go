// SPDX-License-Identifier: Apache-2.0

// Package agenttest starts an *accel.Agent for the tests of other packages
// (accel's own tests call testutil.StartAgent, as this package imports accel).
package agenttest

import (
	"testing"

	"github.com/meshwarp/meshwarp/internal/accel"
	"github.com/meshwarp/meshwarp/internal/testutil"
)

// Start is testutil.StartAgent for cfg: an empty cfg.CgroupPath is a
// throwaway cgroup this test process joins, an empty cfg.PinDir a throwaway
// pin directory; the agent is uninstalled on cleanup.
func Start(t testing.TB, cfg accel.Config) *accel.Agent {
	t.Helper()
	return testutil.StartAgent(t, &cfg.CgroupPath, &cfg.PinDir, func() (*accel.Agent, error) { return accel.Start(cfg, nil) })
}
