// SPDX-License-Identifier: Apache-2.0

package testutil

import "testing"

// CheckPaired passes a run whose unpaired connections all lost a pairing
// race, and fails one with a connection left to TCP for another reason or
// with most connections lost to the race.
func TestCheckPaired(t *testing.T) {
	for _, c := range []struct {
		name         string
		paired, conn uint64
		byReason     map[string]uint64
		ok           bool
	}{
		{"all paired", 200, 200, map[string]uint64{"no_peer": 0}, true},
		{"some lost the race", 190, 200, map[string]uint64{"no_peer": 7, "unpaired_timeout": 3, "policy": 0}, true},
		{"one left for another reason", 199, 200, map[string]uint64{"sockmap_busy": 1}, false},
		{"one unaccounted for", 199, 200, nil, false},
		{"mostly lost the race", 60, 200, map[string]uint64{"no_peer": 140}, false},
		{"a third lost the race", 20, 30, map[string]uint64{"unpaired_timeout": 10}, true},
	} {
		if err := CheckPaired(c.paired, c.conn, c.byReason); (err == nil) != c.ok {
			t.Errorf("%s: CheckPaired(%d, %d, %v) = %v, want ok=%v", c.name, c.paired, c.conn, c.byReason, err, c.ok)
		}
	}
}
