// SPDX-License-Identifier: Apache-2.0

package accel

import (
	"bytes"
	"errors"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"sort"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"golang.org/x/sys/unix"

	"github.com/meshwarp/meshwarp/internal/probe"
)

// tracefsDir is where the tracepoint ids are read from.
const tracefsDir = "/sys/kernel/tracing"

// UnfitProcess is a process of the accelerated cgroup seen doing, on an
// accelerated socket, what a redirect cannot honour (Reason: splice_reader,
// waitall_reader, oob, rcvlowat, unread_close, disconnect, fionread_reader). Later connections on that
// socket's ports are left to TCP.
type UnfitProcess struct {
	PID    uint32 `json:"pid"`
	Comm   string `json:"comm"`
	Reason string `json:"reason"`
	Calls  uint64 `json:"calls"`
}

// LearnedProgram is a program (the name of the task that created its
// sockets; for accepted sockets, their listener's) that did what a redirect
// cannot honour (Reason, the first one learned): none of its later
// connections is paired, on any port, across agent restarts.
// KeptOffConnections counts its connections left to TCP since.
type LearnedProgram struct {
	Comm               string `json:"comm"`
	Reason             string `json:"reason"`
	KeptOffConnections uint64 `json:"kept_off_connections"`
}

// syscallWatches are the tracepoints (syscalls:sys_enter_*) that learn
// unfit sockets, by program. ioctl(FIONREAD) is watched only on kernels
// where it leaves out redirected bytes (probe.HaveMsgTotLen).
func syscallWatches(o *accelObjects) map[string]*ebpf.Program {
	w := map[string]*ebpf.Program{
		"sys_enter_splice":   o.MwSysSplice,
		"sys_enter_recvfrom": o.MwSysRecvfrom,
		"sys_enter_recvmsg":  o.MwSysRecvmsg,
		"sys_enter_recvmmsg": o.MwSysRecvmmsg,
		"sys_enter_sendto":   o.MwSysSendto,
		"sys_enter_sendmsg":  o.MwSysSendmsg,
		"sys_enter_sendmmsg": o.MwSysSendmmsg,
		"sys_enter_close":    o.MwSysClose,
		"sys_enter_connect":  o.MwSysConnect,
	}
	if probe.HaveMsgTotLen() != nil {
		w["sys_enter_ioctl"] = o.MwSysIoctl
	}
	return w
}

// watchSyscalls attaches the syscall watches for the processes of
// cgroupPath, mounting tracefs if nothing is mounted there. All or none.
func watchSyscalls(o *accelObjects, cgroupPath string) ([]link.Link, error) {
	cg, err := os.Open(cgroupPath)
	if err != nil {
		return nil, err
	}
	defer cg.Close()
	if err := o.MwCgroup.Put(uint32(0), uint32(cg.Fd())); err != nil {
		return nil, fmt.Errorf("set watched cgroup: %w", err)
	}
	if err := ensureTracefs(); err != nil {
		return nil, err
	}
	var links []link.Link
	for _, tp := range slices.Sorted(maps.Keys(syscallWatches(o))) {
		l, err := link.Tracepoint("syscalls", tp, syscallWatches(o)[tp], nil)
		if err != nil {
			for _, l := range links {
				l.Close()
			}
			return nil, fmt.Errorf("attach to syscalls:%s: %w", tp, err)
		}
		links = append(links, l)
	}
	return links, nil
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

// readUnfitProcesses lists the processes that taught a learned reason.
func readUnfitProcesses(m *ebpf.Map) ([]UnfitProcess, error) {
	var out []UnfitProcess
	var key accelMwUnfitKey
	var v accelMwUnfitProc
	it := m.Iterate()
	for it.Next(&key, &v) {
		comm := make([]byte, 0, len(v.Comm))
		for _, c := range v.Comm {
			comm = append(comm, byte(c))
		}
		reason := ""
		if names := reasonNames(); int(key.Reason) < len(names) {
			reason = names[key.Reason]
		}
		out = append(out, UnfitProcess{PID: key.Tgid, Comm: string(bytes.TrimRight(comm, "\x00")), Reason: reason, Calls: v.Calls})
	}
	if err := it.Err(); err != nil {
		return nil, fmt.Errorf("read mw_unfit_procs: %w", err)
	}
	sort.Slice(out, func(i, j int) bool {
		if out[i].PID != out[j].PID {
			return out[i].PID < out[j].PID
		}
		return out[i].Reason < out[j].Reason
	})
	return out, nil
}

// readPinned reads the map name pinned in pinDir with read; a missing map
// (an older agent's pins) reads as nothing.
func readPinned[T any](pinDir, name string, read func(*ebpf.Map) ([]T, error)) ([]T, error) {
	m, err := ebpf.LoadPinnedMap(filepath.Join(pinDir, name), &ebpf.LoadPinOptions{ReadOnly: true})
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	defer m.Close()
	return read(m)
}

// pinnedUnfitProcesses reads mw_unfit_procs from pinDir.
func pinnedUnfitProcesses(pinDir string) ([]UnfitProcess, error) {
	return readPinned(pinDir, accelMapMwUnfitProcs, readUnfitProcesses)
}

// commString is a kernel task name without its padding.
func commString(c [16]int8) string {
	b := make([]byte, 0, len(c))
	for _, x := range c {
		if x == 0 {
			break
		}
		b = append(b, byte(x))
	}
	return string(b)
}

// readLearnedPrograms lists mw_unfit_progs, by name.
func readLearnedPrograms(m *ebpf.Map) ([]LearnedProgram, error) {
	var out []LearnedProgram
	var key accelMwProg
	var v accelMwUnfitProg
	names := reasonNames()
	it := m.Iterate()
	for it.Next(&key, &v) {
		p := LearnedProgram{Comm: commString(key.Comm), KeptOffConnections: v.KeptOff}
		if int(v.Reason) < len(names) {
			p.Reason = names[v.Reason]
		}
		out = append(out, p)
	}
	if err := it.Err(); err != nil {
		return nil, fmt.Errorf("read mw_unfit_progs: %w", err)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Comm < out[j].Comm })
	return out, nil
}

// pinnedLearnedPrograms reads mw_unfit_progs from pinDir.
func pinnedLearnedPrograms(pinDir string) ([]LearnedProgram, error) {
	return readPinned(pinDir, accelMapMwUnfitProgs, readLearnedPrograms)
}
