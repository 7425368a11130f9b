// SPDX-License-Identifier: Apache-2.0

package testutil

import (
	"fmt"
	"maps"
	"strings"
)

// Pairing races. A connection is paired when its accepted side is
// established while its connecting side waits; by design it stays on TCP
// when the connecting side sends its first byte first (no_peer) or when the
// accepted side comes later than the unpaired timeout (unpaired_timeout).
// Which comes first is the scheduler's choice: on a busy machine (the
// softirq that establishes the accepted side deferred to ksoftirqd, a
// 2-core runner shared with benchmarks, software emulation) a correct data
// path loses some of these races. Tests of how much was accelerated
// therefore require every connection to be paired or lost to one of these
// races, and a clear majority paired: a regression that leaves connections
// to TCP for any other reason fails, and so does one to mostly TCP.

// PairingRaceReasons are the passthrough reasons of a lost pairing race
// (accel's reason names; TestPairingRaceReasonsAreReasons ties them).
var PairingRaceReasons = []string{"no_peer", "unpaired_timeout"}

// MinPairedShare is the share of its connections a test requires paired: a
// clear majority, with room for the races above.
const MinPairedShare = 2.0 / 3

// RaceLost sums byReason (the agent's connections, messages or bytes by
// passthrough reason) over PairingRaceReasons.
func RaceLost(byReason map[string]uint64) uint64 {
	var n uint64
	for _, r := range PairingRaceReasons {
		n += byReason[r]
	}
	return n
}

// CheckPaired is nil when each of conns connections was paired or lost a
// pairing race, and at least MinPairedShare of them were paired. paired
// counts paired connections (PairedSockets/2); byReason is the agent's
// passthrough connections by reason over the same time.
func CheckPaired(paired, conns uint64, byReason map[string]uint64) error {
	lost := RaceLost(byReason)
	if paired+lost >= conns && float64(paired) >= MinPairedShare*float64(conns) {
		return nil
	}
	return fmt.Errorf("%d of %d connections paired and %d lost a pairing race (%s); want each paired or lost to a race, and >= %.0f%% paired; left to TCP: %v",
		paired, conns, lost, strings.Join(PairingRaceReasons, ", "), 100*MinPairedShare, nonZero(byReason))
}

// nonZero keeps a counter map's non-zero entries (for failure messages).
func nonZero(m map[string]uint64) map[string]uint64 {
	out := maps.Clone(m)
	maps.DeleteFunc(out, func(_ string, v uint64) bool { return v == 0 })
	return out
}
