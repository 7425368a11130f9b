// SPDX-License-Identifier: Apache-2.0

package cli

import (
	"testing"

	"github.com/cilium/ebpf"

	"github.com/meshwarp/meshwarp/internal/accel"
	"github.com/meshwarp/meshwarp/internal/crossnode"
	"github.com/meshwarp/meshwarp/internal/probe"
)

// A "ready" probe must mean `meshwarp run` can load its programs: every
// program type, map type and helper the BPF object uses has a probe check.
func TestProbeCoversAccelObject(t *testing.T) {
	for name, load := range map[string]func() (*ebpf.CollectionSpec, error){"accel": accel.Spec, "crossnode": crossnode.Spec} {
		spec, err := load()
		if err != nil {
			t.Fatal(err)
		}
		for _, u := range probe.Uncovered(spec) {
			t.Errorf("the probe does not check %s (%s object): add it to internal/probe/features.go", u, name)
		}
	}
}
