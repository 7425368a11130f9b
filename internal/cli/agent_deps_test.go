// SPDX-License-Identifier: Apache-2.0

package cli

import (
	"os/exec"
	"strings"
	"testing"
)

// The agent binary links only what the DaemonSet needs (issue 23): none of
// the people's commands and their libraries, no client-go.
func TestAgentDependencies(t *testing.T) {
	out, err := exec.Command("go", "list", "-deps", "../../cmd/meshwarp-agent").CombinedOutput()
	if err != nil {
		t.Fatalf("go list -deps ./cmd/meshwarp-agent: %v\n%s", err, out)
	}
	forbidden := []string{
		"github.com/meshwarp/meshwarp/internal/cli/full",
		"github.com/meshwarp/meshwarp/internal/lab",
		"github.com/meshwarp/meshwarp/internal/bench",
		"github.com/meshwarp/meshwarp/internal/top",
		"github.com/meshwarp/meshwarp/internal/tap",
		"github.com/meshwarp/meshwarp/internal/observe",
		"fortio.org/",
		"github.com/charmbracelet/",
		"github.com/google/gopacket",
		"github.com/gopacket/",
		"k8s.io/",
		"sigs.k8s.io/",
	}
	for _, pkg := range strings.Fields(string(out)) {
		for _, f := range forbidden {
			if strings.HasPrefix(pkg, f) {
				t.Errorf("meshwarp-agent links %s", pkg)
			}
		}
	}
}
