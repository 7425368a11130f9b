// SPDX-License-Identifier: Apache-2.0

package bench

import (
	"testing"
	"time"

	"github.com/meshwarp/meshwarp/internal/accel"
)

// costlyReadAgent is an agent whose counters take CPU time to read, as a
// real agent's maps and program statistics do.
type costlyReadAgent struct{ burn time.Duration }

func (a costlyReadAgent) Stats() (accel.Stats, error) {
	for start := processCPU(); processCPU()-start < a.burn.Seconds(); {
	}
	return accel.Stats{}, nil
}
func (costlyReadAgent) Flows() ([]accel.Flow, error) { return nil, nil }
func (costlyReadAgent) Uninstall() error             { return nil }

// The agent's CPU over a window is the hosting process's, without the
// bench's own reads of the agent at either end: they cost milliseconds,
// which over an idle second read as if the agent used a CPU percent.
func TestAgentWindowExcludesItsOwnReads(t *testing.T) {
	const burn = 200 * time.Millisecond
	r := &runner{env: fakeEnv{}}
	a := costlyReadAgent{burn: burn}
	before, err := r.agentSnapshot(a)
	if err != nil {
		t.Fatal(err)
	}
	d, err := r.agentDelta(a, before)
	if err != nil {
		t.Fatal(err)
	}
	// Both reads burned 2 x 200 ms; the window between them did nothing.
	if d.ProcessCPUSeconds >= burn.Seconds()/2 {
		t.Errorf("window counted %.3fs of CPU: the reads' %v each were counted", d.ProcessCPUSeconds, burn)
	}
}
