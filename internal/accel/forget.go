// SPDX-License-Identifier: Apache-2.0

package accel

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"

	"github.com/cilium/ebpf"
)

// ForgetRequest names what the agent learned that an operator takes back:
// programs (as `meshwarp status` lists them), server ports, or everything.
type ForgetRequest struct {
	Programs []string
	Ports    []uint16
	All      bool
}

// ForgetResult says what was forgotten and what was named but not learned.
type ForgetResult struct {
	Programs   []string `json:"programs"`
	Ports      []uint16 `json:"ports"`
	NotLearned []string `json:"not_learned"`
}

// maxComm is the longest task name the kernel keeps (TASK_COMM_LEN - 1).
const maxComm = 15

// Forget removes learned programs and ports from the maps pinned in pinDir:
// the next connections of a forgotten program or port are paired again
// (until it shows again what a redirect cannot honour). Connections already
// open keep their path. Works with or without a running agent.
func Forget(pinDir string, req ForgetRequest) (ForgetResult, error) {
	res := ForgetResult{Programs: []string{}, Ports: []uint16{}, NotLearned: []string{}}
	for _, p := range req.Programs {
		if p == "" || len(p) > maxComm {
			return res, fmt.Errorf("program %q: a program is named as the kernel names its task, 1 to %d bytes (see `meshwarp status`)", p, maxComm)
		}
	}
	progs, err := openLearned(pinDir, accelMapMwUnfitProgs)
	if err != nil {
		return res, err
	}
	defer progs.Close()
	procs, err := openLearned(pinDir, accelMapMwUnfitProcs)
	if err != nil {
		return res, err
	}
	defer procs.Close()

	learned, err := readLearnedPrograms(progs)
	if err != nil {
		return res, err
	}
	names := req.Programs
	if req.All {
		names = nil
		for _, p := range learned {
			names = append(names, p.Comm)
		}
	}
	for _, name := range names {
		if !slices.ContainsFunc(learned, func(p LearnedProgram) bool { return p.Comm == name }) {
			res.NotLearned = append(res.NotLearned, "program "+name)
			continue
		}
		var key accelMwProg
		for i := range min(len(name), len(key.Comm)) {
			key.Comm[i] = int8(name[i])
		}
		if err := progs.Delete(&key); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
			return res, fmt.Errorf("forget program %s: %w", name, err)
		}
		res.Programs = append(res.Programs, name)
	}
	// The processes that taught them: status names them as the reason.
	var pkey accelMwUnfitKey
	var pval accelMwUnfitProc
	var stale []accelMwUnfitKey
	for it := procs.Iterate(); it.Next(&pkey, &pval); {
		if req.All || slices.Contains(res.Programs, commString(pval.Comm)) {
			stale = append(stale, pkey)
		}
	}
	for _, k := range stale {
		_ = procs.Delete(&k) // gone already: evicted by the LRU
	}
	if err := forgetPorts(pinDir, req, &res); err != nil {
		return res, err
	}
	return res, resetLearnedAny(pinDir, progs)
}

// openLearned opens a learning map pinned in pinDir for writing.
func openLearned(pinDir, name string) (*ebpf.Map, error) {
	m, err := ebpf.LoadPinnedMap(filepath.Join(pinDir, name), nil)
	if errors.Is(err, os.ErrNotExist) {
		return nil, fmt.Errorf("no meshwarp pins at %s (%s missing): nothing was learned there; is --pin-dir right?", pinDir, name)
	}
	if err != nil {
		return nil, fmt.Errorf("open %s: %w", name, err)
	}
	return m, nil
}

// forgetPorts removes the named ports (or all) from both learned-port maps.
func forgetPorts(pinDir string, req ForgetRequest, res *ForgetResult) error {
	found := map[uint16]bool{}
	for _, name := range []string{accelMapMwUnfitLport, accelMapMwUnfitRport} {
		m, err := openLearned(pinDir, name)
		if err != nil {
			return err
		}
		ports := req.Ports
		if req.All {
			ports = nil
			var k, v uint32
			for it := m.Iterate(); it.Next(&k, &v); {
				ports = append(ports, uint16(k))
			}
		}
		for _, p := range ports {
			k := uint32(p)
			err := m.Delete(&k)
			if err == nil {
				found[p] = true
			} else if !errors.Is(err, ebpf.ErrKeyNotExist) {
				m.Close()
				return fmt.Errorf("forget port %d in %s: %w", p, name, err)
			}
		}
		m.Close()
	}
	for _, p := range req.Ports {
		if !found[p] {
			res.NotLearned = append(res.NotLearned, "port "+strconv.Itoa(int(p)))
		}
	}
	for p := range found {
		res.Ports = append(res.Ports, p)
	}
	slices.Sort(res.Ports)
	return nil
}

// resetLearnedAny lets the connection path skip the program lookup again
// once no program is learned. A program learned meanwhile sets the flag
// again itself; one learned between the check and the reset is caught by
// the check after it.
func resetLearnedAny(pinDir string, progs *ebpf.Map) error {
	var key accelMwProg
	if err := progs.NextKey(nil, &key); !errors.Is(err, ebpf.ErrKeyNotExist) {
		return nil // still learned programs (or unreadable: leave the flag set)
	}
	anyMap, err := openLearned(pinDir, accelMapMwLearnedAny)
	if err != nil {
		return err
	}
	defer anyMap.Close()
	if err := anyMap.Put(uint32(0), uint32(0)); err != nil {
		return fmt.Errorf("reset %s: %w", accelMapMwLearnedAny, err)
	}
	if err := progs.NextKey(nil, &key); !errors.Is(err, ebpf.ErrKeyNotExist) {
		return anyMap.Put(uint32(0), uint32(1))
	}
	return nil
}
