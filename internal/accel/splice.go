// SPDX-License-Identifier: Apache-2.0

package accel

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sort"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"golang.org/x/sys/unix"
)

// tracefsDir is where the tracepoint ids are read from.
const tracefsDir = "/sys/kernel/tracing"

// SpliceReader is a process of the accelerated cgroup seen reading a socket
// with splice(2): redirected bytes are invisible to such a read.
type SpliceReader struct {
	PID   uint32 `json:"pid"`
	Comm  string `json:"comm"`
	Calls uint64 `json:"calls"`
}

// watchSplice attaches mw_splice_watch to syscalls:sys_enter_splice for the
// processes of cgroupPath, mounting tracefs if nothing is mounted there.
func watchSplice(prog *ebpf.Program, cgroups *ebpf.Map, cgroupPath string) (link.Link, error) {
	cg, err := os.Open(cgroupPath)
	if err != nil {
		return nil, err
	}
	defer cg.Close()
	if err := cgroups.Put(uint32(0), uint32(cg.Fd())); err != nil {
		return nil, fmt.Errorf("set watched cgroup: %w", err)
	}
	if err := ensureTracefs(); err != nil {
		return nil, err
	}
	l, err := link.Tracepoint("syscalls", "sys_enter_splice", prog, nil)
	if err != nil {
		return nil, fmt.Errorf("attach to syscalls:sys_enter_splice: %w", err)
	}
	return l, nil
}

func ensureTracefs() error {
	if _, err := os.Stat(filepath.Join(tracefsDir, "events")); err == nil {
		return nil
	}
	if err := unix.Mount("tracefs", tracefsDir, "tracefs", 0, ""); err != nil {
		return fmt.Errorf("tracefs not mounted and mounting it failed (mount -t tracefs tracefs %s): %w", tracefsDir, err)
	}
	return nil
}

// readSpliceReaders lists the processes seen splicing from sockets.
func readSpliceReaders(m *ebpf.Map) ([]SpliceReader, error) {
	var out []SpliceReader
	var pid uint32
	var v accelMwSpliceProc
	it := m.Iterate()
	for it.Next(&pid, &v) {
		comm := make([]byte, 0, len(v.Comm))
		for _, c := range v.Comm {
			comm = append(comm, byte(c))
		}
		out = append(out, SpliceReader{PID: pid, Comm: string(bytes.TrimRight(comm, "\x00")), Calls: v.Calls})
	}
	if err := it.Err(); err != nil {
		return nil, fmt.Errorf("read mw_splice_procs: %w", err)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].PID < out[j].PID })
	return out, nil
}

// pinnedSpliceReaders reads mw_splice_procs from pinDir; a missing map
// (older agent) is no error.
func pinnedSpliceReaders(pinDir string) ([]SpliceReader, error) {
	m, err := ebpf.LoadPinnedMap(filepath.Join(pinDir, "mw_splice_procs"), &ebpf.LoadPinOptions{ReadOnly: true})
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	defer m.Close()
	return readSpliceReaders(m)
}
