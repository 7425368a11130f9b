// SPDX-License-Identifier: Apache-2.0

package accel

import (
	"errors"
	"fmt"
	"io"
	"path/filepath"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"

	"github.com/meshwarp/meshwarp/internal/btfenum"
	"github.com/meshwarp/meshwarp/internal/crossnode"
)

// Stats are cumulative counters read from the pinned maps (they survive
// agent restarts because the maps are pinned): the data path's Counters and
// what else the agent knows of its work.
type Stats struct {
	Counters
	// BPFRunSeconds and BPFRuns are the CPU time and runs of the agent's BPF
	// programs, from the kernel's per-program statistics (counted only while
	// they are enabled: sysctl kernel.bpf_stats_enabled, or EnableBPFStats).
	// Filled by Agent.Stats.
	BPFRunSeconds float64 `json:"bpf_run_seconds"`
	BPFRuns       uint64  `json:"bpf_runs"`
	// UnfitProcesses names the processes that taught a learned reason
	// (Counters.UnfitCalls): later connections on those sockets' ports stay on
	// TCP (and every later connection of their programs: LearnedPrograms).
	UnfitProcesses []UnfitProcess `json:"unfit_processes,omitempty"`
	// LearnedPrograms are the programs none of whose connections is paired
	// any more (kept across agent restarts).
	LearnedPrograms []LearnedProgram `json:"learned_programs,omitempty"`
	// OtherSockmapPrograms lists sock_ops and sk_msg programs on this node
	// that are not meshwarp's (filled by ReadPinnedStats).
	OtherSockmapPrograms []ProgramRef `json:"other_sockmap_programs,omitempty"`
	// CrossNode counts cross-node forwarding, when it is installed.
	CrossNode *crossnode.Stats `json:"cross_node,omitempty"`
}

// ProgramRef names a loaded BPF program.
type ProgramRef struct {
	ID   uint32 `json:"id"`
	Name string `json:"name"`
	Type string `json:"type"`
}

// OtherSockmapPrograms lists the loaded sock_ops and sk_msg programs that
// meshwarp did not load: another tool (a CNI, a tracer, a mesh's own
// sockmap) whose programs run beside meshwarp's on the same sockets.
func OtherSockmapPrograms() ([]ProgramRef, error) {
	ours := map[string]bool{}
	spec, err := loadAccel()
	if err != nil {
		return nil, err
	}
	for name := range spec.Programs {
		ours[name] = true
	}
	var out []ProgramRef
	EachProgram(func(id ebpf.ProgramID, p *ebpf.Program) {
		info, err := p.Info()
		if err != nil || ours[info.Name] {
			return
		}
		switch info.Type {
		case ebpf.SockOps, ebpf.SkMsg:
			out = append(out, ProgramRef{ID: uint32(id), Name: info.Name, Type: info.Type.String()})
		}
	})
	return out, nil
}

// EachProgram calls fn with every BPF program loaded on the node (closed
// after fn returns); programs unloaded meanwhile are skipped.
func EachProgram(fn func(id ebpf.ProgramID, p *ebpf.Program)) {
	var id ebpf.ProgramID
	for {
		next, err := ebpf.ProgramGetNextID(id)
		if err != nil {
			return // ErrNotExist: the end of the list
		}
		id = next
		p, err := ebpf.NewProgramFromID(id)
		if err != nil {
			continue // unloaded meanwhile
		}
		fn(id, p)
		p.Close()
	}
}

// Reason and hop names come from the C enums in the object's BTF
// (MW_REASON_NO_PEER -> "no_peer"), indexed by value: bpf/accel/accel.h is
// the only list. Read on first use, not at init (see btfenum.Lazy).
var (
	enumNames   = btfenum.Lazy("accel", _AccelBytes)
	reasonNames = enumNames("mw_reason", "MW_REASON_")
	hopNames    = enumNames("mw_hop", "MW_HOP_")
)

// ReasonNames lists every passthrough reason (for metrics and docs); "none" is left out.
func ReasonNames() []string { return append([]string(nil), reasonNames()[1:]...) }

// HopNames lists every hop kind.
func HopNames() []string { return append([]string(nil), hopNames()...) }

// ReadPinnedStats reads the counters of the agent pinned at pinDir, from any
// process, while the agent runs or after it was killed.
func ReadPinnedStats(pinDir string) (Stats, error) {
	if pinDir == "" {
		pinDir = DefaultPinDir
	}
	p := filepath.Join(pinDir, accelMapMwStats)
	m, err := ebpf.LoadPinnedMap(p, &ebpf.LoadPinOptions{ReadOnly: true})
	if err != nil {
		return Stats{}, fmt.Errorf("open %s: %w (is `meshwarp run` attached? see `meshwarp probe`)", p, err)
	}
	defer m.Close()
	s, err := readStats(m)
	if err != nil {
		return s, err
	}
	s.UnfitProcesses, err = pinnedUnfitProcesses(pinDir)
	if err != nil {
		return s, err
	}
	s.LearnedPrograms, err = pinnedLearnedPrograms(pinDir)
	if err != nil {
		return s, err
	}
	if xs, xerr := crossnode.ReadPinnedStats(pinDir); xerr == nil {
		s.CrossNode = &xs
	} else if !errors.Is(xerr, crossnode.ErrNotInstalled) {
		return s, xerr
	}
	s.OtherSockmapPrograms, err = OtherSockmapPrograms()
	return s, err
}

func readStats(m *ebpf.Map) (Stats, error) {
	var perCPU []accelMwCounters
	if err := m.Lookup(uint32(0), &perCPU); err != nil {
		return Stats{}, fmt.Errorf("read mw_stats: %w", err)
	}
	return sumCounters(perCPU), nil
}

// sumCounters folds the per-CPU copies into Stats.
func sumCounters(perCPU []accelMwCounters) Stats {
	var t accelMwCounters
	for i := range perCPU {
		addCounters(&t, &perCPU[i])
	}
	return Stats{Counters: countersFromC(&t)}
}

// Sub returns s - before, counter by counter (AcceleratedSockets is a gauge
// and is taken from s): the activity of one measured interval.
func (s Stats) Sub(before Stats) Stats { return s.combine(before, true) }

// Add sums the counters of two agents (the bench's one agent per lab node).
func (s Stats) Add(o Stats) Stats { return s.combine(o, false) }

// combine subtracts (sub) or adds o's cumulative counters to s's; the
// rest is s's.
func (s Stats) combine(o Stats, sub bool) Stats {
	op := func(a, b uint64) uint64 { return a + b }
	if sub {
		op = func(a, b uint64) uint64 { return a - b }
	}
	d := s
	d.Counters = s.Counters.combine(o.Counters, op)
	d.BPFRuns = op(s.BPFRuns, o.BPFRuns)
	d.BPFRunSeconds = s.BPFRunSeconds + o.BPFRunSeconds
	if sub {
		d.BPFRunSeconds = s.BPFRunSeconds - o.BPFRunSeconds
	}
	if s.CrossNode != nil || o.CrossNode != nil {
		var a, b crossnode.Stats
		if s.CrossNode != nil {
			a = *s.CrossNode
		}
		if o.CrossNode != nil {
			b = *o.CrossNode
		}
		d.CrossNode = &crossnode.Stats{
			RedirectedPackets: combineMap(a.RedirectedPackets, b.RedirectedPackets, op),
			RedirectedBytes:   combineMap(a.RedirectedBytes, b.RedirectedBytes, op),
			NeighRedirects:    op(a.NeighRedirects, b.NeighRedirects),
			PassedPackets:     combineMap(a.PassedPackets, b.PassedPackets, op),
			Devices:           a.Devices,
			Nodes:             a.Nodes,
		}
	}
	return d
}

// combineMap applies op per key of either map.
func combineMap(a, b map[string]uint64, op func(a, b uint64) uint64) map[string]uint64 {
	out := make(map[string]uint64, len(a))
	for k, v := range a {
		out[k] = op(v, b[k])
	}
	for k, v := range b {
		if _, ok := a[k]; !ok {
			out[k] = op(0, v)
		}
	}
	return out
}

// DetachedSockets counts the sockets still in the SOCKMAP of data paths
// that are no longer pinned (after an uninstall or cleanup) but alive
// because those sockets hold them: their connections keep moving
// socket-to-socket until they close, and the kernel takes each socket out
// of the map when it closes, so the count is exact (counters are not: with
// sock_ops detached, no close is counted any more). The map pinned at
// pinDir, if any, is skipped, and so is the map of any data path whose
// mw_sockops is still loaded (a live agent with another pin directory).
func DetachedSockets(pinDir string) (uint64, error) {
	live := map[ebpf.MapID]bool{}
	if m, err := ebpf.LoadPinnedMap(filepath.Join(pinDir, accelMapMwSockMap), &ebpf.LoadPinOptions{ReadOnly: true}); err == nil {
		if info, err := m.Info(); err == nil {
			id, _ := info.ID()
			live[id] = true
		}
		m.Close()
	}
	EachProgram(func(_ ebpf.ProgramID, p *ebpf.Program) {
		info, err := p.Info()
		if err != nil || info.Name != accelProgMwSockops {
			return
		}
		ids, _ := info.MapIDs()
		for _, id := range ids {
			live[id] = true
		}
	})
	var open uint64
	for id, err := ebpf.MapGetNextID(0); err == nil; id, err = ebpf.MapGetNextID(id) {
		if live[id] {
			continue
		}
		m, err := ebpf.NewMapFromID(id)
		if err != nil {
			continue // gone meanwhile, or not ours to open
		}
		info, err := m.Info()
		if err == nil && info.Name == accelMapMwSockMap && info.Type == ebpf.SockMap {
			// Every index (an empty one is skipped): rare, after an uninstall.
			var index uint32
			var cookie uint64
			it := m.Iterate()
			for it.Next(&index, &cookie) {
				open++
			}
		}
		m.Close()
	}
	return open, nil
}

// SockhashCookies lists the socket cookies (SO_COOKIE) of the sockets in
// mw_sock_map right now: the sockets whose bytes meshwarp may redirect.
// Only the indices of held mw_conns slots can hold one (bpf/accel/maps.h).
func (a *Agent) SockhashCookies() ([]uint64, error) {
	var (
		cookies []uint64
		errs    []error
	)
	err := eachConn(a.objs.MwConns, func(slot uint32, c *accelMwConn) {
		if c.Holders == 0 {
			return
		}
		for _, role := range []accelMwRole{accelMwRoleMW_ROLE_ACTIVE, accelMwRoleMW_ROLE_PASSIVE} {
			index := sockIndex(slot, role)
			var cookie uint64
			switch err := a.objs.MwSockMap.Lookup(&index, &cookie); {
			case err == nil:
				cookies = append(cookies, cookie)
			case !errors.Is(err, ebpf.ErrKeyNotExist):
				errs = append(errs, fmt.Errorf("read mw_sock_map: %w", err))
			}
		}
	})
	return cookies, errors.Join(append(errs, err)...)
}

// InSockMap reports whether the socket open as fd (in this process) is in
// mw_sock_map right now, from its own record: one lookup each, where
// SockhashCookies reads every mw_conns slot (tens of ms at the default
// capacity, longer than the leave poll takes to move a socket out).
func (a *Agent) InSockMap(fd int) (bool, error) {
	var rec accelMwSock
	key := int32(fd)
	switch err := a.objs.MwSkStore.Lookup(&key, &rec); {
	case errors.Is(err, ebpf.ErrKeyNotExist):
		return false, nil // never seen by sock_ops
	case err != nil:
		return false, fmt.Errorf("read mw_sk_store: %w", err)
	}
	if rec.Pair.Role == 0 {
		return false, nil // never paired
	}
	cookie, err := unix.GetsockoptUint64(fd, unix.SOL_SOCKET, unix.SO_COOKIE)
	if err != nil {
		return false, fmt.Errorf("SO_COOKIE: %w", err)
	}
	index := sockIndex(rec.Pair.ConnSlot, accelMwRole(rec.Pair.Role))
	var in uint64
	switch err := a.objs.MwSockMap.Lookup(&index, &in); {
	case errors.Is(err, ebpf.ErrKeyNotExist):
		return false, nil
	case err != nil:
		return false, fmt.Errorf("read mw_sock_map: %w", err)
	}
	return in == cookie, nil
}

// Stats reads the counters.
func (a *Agent) Stats() (Stats, error) {
	s, err := readStats(a.objs.MwStats)
	if err != nil {
		return s, err
	}
	s.UnfitProcesses, err = readUnfitProcesses(a.objs.MwUnfitProcs)
	if err != nil {
		return s, err
	}
	s.LearnedPrograms, err = readLearnedPrograms(a.objs.MwUnfitProgs)
	for _, p := range []*ebpf.Program{a.objs.MwSockops, a.objs.MwSkmsg, a.objs.MwSetsockopt, a.objs.MwSockCreate, a.objs.MwPostBind4, a.objs.MwPostBind6, a.objs.MwEgress, a.objs.MwEgressObs, a.objs.MwIngress, a.objs.MwIngressObs, a.objs.MwObsRecv,
		a.objs.MwSysSplice, a.objs.MwSysRecvfrom, a.objs.MwSysRecvmsg, a.objs.MwSysRecvmmsg, a.objs.MwSysSendto,
		a.objs.MwSysSendmsg, a.objs.MwSysSendmmsg, a.objs.MwSysClose, a.objs.MwSysConnect, a.objs.MwSysIoctl} {
		if ps, perr := p.Stats(); perr == nil {
			s.BPFRunSeconds += ps.Runtime.Seconds()
			s.BPFRuns += ps.RunCount
		}
	}
	if a.xn != nil {
		xs, xerr := a.xn.Stats()
		s.CrossNode = &xs
		err = errors.Join(err, xerr)
	}
	return s, err
}

// EnableBPFStats turns on the kernel's per-program run-time statistics
// (Stats.BPFRunSeconds) until the returned closer is closed. They cost a
// clock read per program run, so they are off by default.
func EnableBPFStats() (io.Closer, error) {
	c, err := ebpf.EnableStats(uint32(unix.BPF_STATS_RUN_TIME))
	if err != nil {
		return nil, fmt.Errorf("enable BPF run-time statistics: %w", err)
	}
	return c, nil
}
