// SPDX-License-Identifier: Apache-2.0

package accel

import (
	"errors"
	"fmt"
	"path/filepath"
	"slices"

	"github.com/cilium/ebpf"
)

// The tap (bpf/accel/tap.h) is a program of the accel object that the agent
// never loads: `meshwarp tap` (internal/tap) loads mw_skmsg_tap and its own
// maps with LoadTap, against the agent's pinned maps, and swaps it into the
// agent's sk_msg link while it runs.

// TapRecord is one record of the tap's ring (struct mw_tap_rec), followed
// by Caplen payload bytes; TapEndpoint is one of its addresses.
type (
	TapRecord   = accelMwTapRec
	TapEndpoint = accelMwEndpoint
)

// TapSettings are the tap's own load-time settings.
type TapSettings struct {
	Snaplen uint32 // payload bytes kept per message
	Port    uint32 // 0: every port; else connections with this port at either end
	Netns   uint64 // 0: every namespace; else the sender's netns cookie
}

// Tap is a loaded tap program and its maps; Close releases them.
type Tap struct {
	Program  *ebpf.Program // mw_skmsg_tap
	Ring     *ebpf.Map     // TapRecords
	counters *ebpf.Map
}

// RodataSection is the ELF and BTF name of the object's load-time constants.
const RodataSection = ".rodata"

// ErrOtherBuild: the agent's program lacks a constant the tap's expects.
var ErrOtherBuild = errors.New("the agent runs another meshwarp build than this tap: use the agent's meshwarp binary, or restart `meshwarp run` with this one")

// TapProgram is the tap program's name (the kernel's too).
const TapProgram = accelProgMwSkmsgTap

// LoadTap loads the tap's program against the maps of the agent pinned at
// pinDir. It runs in place of the agent's sk_msg program, so every constant
// of the object but the tap's own takes the value the agent's program was
// loaded with: agent holds them by name (the .rodata variables read back
// from the kernel). Only the tap's program, ring and counters are new: a
// tap never creates agent state.
func LoadTap(pinDir string, agent map[string][]byte, ts TapSettings) (*Tap, error) {
	spec, err := loadAccel()
	if err != nil {
		return nil, fmt.Errorf("load accel spec: %w", err)
	}
	s, err := assignSpecs(spec)
	if err != nil {
		return nil, err
	}
	if err := useAgentConstants(spec, agent); err != nil {
		return nil, err
	}
	if err := setConstants(constant{s.TapSnaplen, ts.Snaplen}, constant{s.TapPort, ts.Port}, constant{s.TapNetns, ts.Netns}); err != nil {
		return nil, err
	}
	cpus, err := ebpf.PossibleCPU()
	if err != nil {
		return nil, err
	}
	// One scratch buffer per CPU (a per-CPU value may not exceed 32 KiB).
	s.MwTapScratch.MaxEntries = uint32(cpus)
	replace := map[string]*ebpf.Map{}
	for name, m := range spec.Maps {
		if m.Pinning != ebpf.PinByName {
			continue
		}
		pinned, err := ebpf.LoadPinnedMap(filepath.Join(pinDir, name), nil)
		if err != nil {
			continue // a map the tap's program does not use may be missing
		}
		defer pinned.Close()
		replace[name] = pinned
	}
	var objs accelObjects
	want := []string{accelProgMwSkmsgTap, accelMapMwTapRing, accelMapMwTapCounters}
	if err := loadObjects(spec, &objs, &ebpf.CollectionOptions{MapReplacements: replace}, func(name string) bool {
		return slices.Contains(want, name)
	}); err != nil {
		return nil, fmt.Errorf("load the tap program against the agent's maps at %s (same meshwarp build?): %w", pinDir, err)
	}
	return &Tap{Program: objs.MwSkmsgTap, Ring: objs.MwTapRing, counters: objs.MwTapCounters}, nil
}

// useAgentConstants sets every .rodata variable of spec to its value in
// agent (the tap's own are in .rodata.tap).
func useAgentConstants(spec *ebpf.CollectionSpec, agent map[string][]byte) error {
	for name, v := range spec.Variables {
		if v.SectionName != RodataSection {
			continue
		}
		b, ok := agent[name]
		if !ok {
			return fmt.Errorf("%w (its sk_msg program has no %s)", ErrOtherBuild, name)
		}
		if len(b) != int(v.Size()) {
			return fmt.Errorf("%w (%s: %d bytes there, %d here)", ErrOtherBuild, name, len(b), v.Size())
		}
		if err := v.Set(b); err != nil {
			return fmt.Errorf("set %s: %w", name, err)
		}
	}
	return nil
}

// TapStats are the tap's counters, summed over CPUs.
type TapStats struct {
	Records  uint64
	RingFull uint64 // messages not recorded: the reader fell behind
	Cut      uint64 // messages longer than the snaplen (recorded cut)
}

// Stats reads the tap's counters.
func (t *Tap) Stats() (TapStats, error) {
	var perCPU []accelMwTapStats
	var sum TapStats
	if err := t.counters.Lookup(uint32(0), &perCPU); err != nil {
		return sum, fmt.Errorf("read tap counters: %w", err)
	}
	for _, c := range perCPU {
		sum.Records += c.Records
		sum.RingFull += c.RingFull
		sum.Cut += c.Cut
	}
	return sum, nil
}

// Close releases the tap's program and maps. Safe to call twice.
func (t *Tap) Close() error {
	if t == nil {
		return nil
	}
	err := errors.Join(t.Program.Close(), t.Ring.Close(), t.counters.Close())
	t.Program, t.Ring, t.counters = nil, nil, nil
	return err
}
