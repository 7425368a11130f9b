// SPDX-License-Identifier: Apache-2.0

package accel

import (
	"strings"
	"testing"

	"github.com/meshwarp/meshwarp/internal/testutil"
)

// The object has an agent's part and a tap's part: every name the agent
// leaves out is in the object, and the tap's settings are the only
// variables outside .rodata, so the agent's .rodata and the tap's are the
// same variables (internal/tap copies them by name).
func TestTapPartOfObject(t *testing.T) {
	spec, err := loadAccel()
	if err != nil {
		t.Fatal(err)
	}
	for _, name := range tapOnly {
		if spec.Programs[name] == nil && spec.Maps[name] == nil && spec.Variables[name] == nil {
			t.Errorf("tapOnly names %s, which the object does not have", name)
		}
	}
	for name, v := range spec.Variables {
		if tap := strings.HasPrefix(name, "tap_"); tap != (v.SectionName != RodataSection) {
			t.Errorf("variable %s is in %s", name, v.SectionName)
		}
	}
}

// The agent loads neither the tap's program nor its maps.
func TestPrivilegedAgentLoadsNoTap(t *testing.T) {
	testutil.RequirePrivileged(t)
	a := startAgent(t, Config{})
	if a.objs.MwSkmsgTap != nil || a.objs.MwTapRing != nil || a.objs.MwTapScratch != nil || a.objs.MwTapCounters != nil {
		t.Fatalf("the agent loaded the tap: %+v", a.objs)
	}
	if a.objs.MwSkmsg == nil || a.objs.MwSockMap == nil || a.objs.MwObsRecv == nil || a.objs.MwSysConnect == nil {
		t.Fatalf("the agent did not load its own programs and maps: %+v", a.objs)
	}
}
