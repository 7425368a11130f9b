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
// agent restarts because the maps are pinned).
type Stats struct {
	AcceleratedSockets  uint64            `json:"accelerated_sockets"`
	RedirectedMessages  uint64            `json:"redirected_messages"`
	RedirectedBytes     uint64            `json:"redirected_bytes"`
	PassthroughMessages uint64            `json:"passthrough_messages"`
	PassthroughBytes    uint64            `json:"passthrough_bytes"`
	PassthroughByReason map[string]uint64 `json:"passthrough_by_reason"`
	// PassthroughBytesByReason splits PassthroughBytes by reason.
	PassthroughBytesByReason map[string]uint64 `json:"passthrough_bytes_by_reason"`
	// PassthroughConnections counts connections left to TCP, by reason
	// (including those never seen by sk_msg, such as policy exclusions).
	PassthroughConnections map[string]uint64 `json:"passthrough_connections_by_reason"`
	// RemovedSockets counts sockets kept off the SOCKHASH from the start
	// (policy, splice_reader, no_local_peer: the connecting socket) or taken
	// out of it again because their connection was left to TCP, by reason:
	// from then on they are plain TCP sockets.
	RemovedSockets map[string]uint64 `json:"removed_sockets_by_reason"`
	PairedSockets  uint64            `json:"paired_sockets_total"`
	// LeftSockets counts paired sockets that left the SOCKHASH after their
	// connection went to TCP as a whole (small_stream, one-way backpressure), once nothing
	// redirected was in flight or unread: plain TCP sockets since.
	LeftSockets  uint64 `json:"left_sockets_total"`
	SockhashFull uint64 `json:"sockhash_full"`
	// NATPortRemaps counts paired connections whose source port NAT
	// rewrote between the two ends (conntrack under REDIRECT or DNAT).
	NATPortRemaps uint64 `json:"nat_port_remapped_connections"`
	// BPFRunSeconds and BPFRuns are the CPU time and runs of the agent's BPF
	// programs, from the kernel's per-program statistics (counted only while
	// they are enabled: sysctl kernel.bpf_stats_enabled, or EnableBPFStats).
	// Filled by Agent.Stats.
	BPFRunSeconds float64 `json:"bpf_run_seconds"`
	BPFRuns       uint64  `json:"bpf_runs"`
	// FlowsFull counts observations lost because the flow table was full.
	FlowsFull uint64 `json:"observe_flows_full"`
	// Hops splits the redirect counters by mesh hop.
	Hops map[string]HopStats `json:"hops"`
	// SpliceSocketReads counts splice(2) calls reading a socket by processes
	// of the accelerated cgroup. Such a reader cannot see redirected bytes.
	SpliceSocketReads uint64 `json:"splice_socket_reads"`
	// UnfitCalls counts the calls that taught a learned reason (splice_reader,
	// waitall_reader, oob, rcvlowat, unread_close); UnfitProcesses names
	// the processes. Later connections on those sockets' ports stay on TCP.
	UnfitCalls     map[string]uint64 `json:"unfit_calls_by_reason"`
	UnfitProcesses []UnfitProcess    `json:"unfit_processes,omitempty"`
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

// HopStats counts one hop kind.
type HopStats struct {
	PairedConnections  uint64 `json:"paired_connections"`
	RedirectedMessages uint64 `json:"redirected_messages"`
	RedirectedBytes    uint64 `json:"redirected_bytes"`
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
	for _, c := range perCPU {
		t.SocketsPaired += c.SocketsPaired
		t.SocketsClosed += c.SocketsClosed
		t.SocketsLeft += c.SocketsLeft
		t.RedirectedMsgs += c.RedirectedMsgs
		t.RedirectedBytes += c.RedirectedBytes
		t.SockhashFull += c.SockhashFull
		t.SpliceSocketReads += c.SpliceSocketReads
		t.NatPortRemaps += c.NatPortRemaps
		t.FlowsFull += c.FlowsFull
		for i := range t.PassthroughMsgs {
			t.PassthroughMsgs[i] += c.PassthroughMsgs[i]
			t.PassthroughBytes[i] += c.PassthroughBytes[i]
			t.PassthroughConns[i] += c.PassthroughConns[i]
			t.SocketsRemoved[i] += c.SocketsRemoved[i]
			t.UnfitCalls[i] += c.UnfitCalls[i]
		}
		for i := range t.HopConns {
			t.HopConns[i] += c.HopConns[i]
			t.HopMsgs[i] += c.HopMsgs[i]
			t.HopBytes[i] += c.HopBytes[i]
		}
	}
	s := Stats{
		RedirectedMessages:       t.RedirectedMsgs,
		RedirectedBytes:          t.RedirectedBytes,
		PairedSockets:            t.SocketsPaired,
		LeftSockets:              t.SocketsLeft,
		SockhashFull:             t.SockhashFull,
		SpliceSocketReads:        t.SpliceSocketReads,
		NATPortRemaps:            t.NatPortRemaps,
		FlowsFull:                t.FlowsFull,
		PassthroughByReason:      map[string]uint64{},
		PassthroughBytesByReason: map[string]uint64{},
		PassthroughConnections:   map[string]uint64{},
		RemovedSockets:           map[string]uint64{},
		UnfitCalls:               map[string]uint64{},
		Hops:                     map[string]HopStats{},
	}
	// Per-CPU counters are summed without a lock, so a close counted on one
	// CPU can be seen before the matching pairing on another: clamp at 0.
	if done := t.SocketsClosed + t.SocketsLeft; t.SocketsPaired > done {
		s.AcceleratedSockets = t.SocketsPaired - done
	}
	for i, name := range reasonNames() {
		if i == 0 {
			continue
		}
		s.PassthroughByReason[name] = t.PassthroughMsgs[i]
		s.PassthroughBytesByReason[name] = t.PassthroughBytes[i]
		s.PassthroughConnections[name] = t.PassthroughConns[i]
		s.RemovedSockets[name] = t.SocketsRemoved[i]
		s.UnfitCalls[name] = t.UnfitCalls[i]
		s.PassthroughMessages += t.PassthroughMsgs[i]
		s.PassthroughBytes += t.PassthroughBytes[i]
	}
	for i, name := range hopNames() {
		s.Hops[name] = HopStats{
			PairedConnections:  t.HopConns[i],
			RedirectedMessages: t.HopMsgs[i],
			RedirectedBytes:    t.HopBytes[i],
		}
	}
	return s
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
	d.RedirectedMessages = op(s.RedirectedMessages, o.RedirectedMessages)
	d.RedirectedBytes = op(s.RedirectedBytes, o.RedirectedBytes)
	d.PassthroughMessages = op(s.PassthroughMessages, o.PassthroughMessages)
	d.PassthroughBytes = op(s.PassthroughBytes, o.PassthroughBytes)
	d.PairedSockets = op(s.PairedSockets, o.PairedSockets)
	d.LeftSockets = op(s.LeftSockets, o.LeftSockets)
	d.SockhashFull = op(s.SockhashFull, o.SockhashFull)
	d.SpliceSocketReads = op(s.SpliceSocketReads, o.SpliceSocketReads)
	d.NATPortRemaps = op(s.NATPortRemaps, o.NATPortRemaps)
	d.FlowsFull = op(s.FlowsFull, o.FlowsFull)
	d.BPFRuns = op(s.BPFRuns, o.BPFRuns)
	d.BPFRunSeconds = s.BPFRunSeconds + o.BPFRunSeconds
	if sub {
		d.BPFRunSeconds = s.BPFRunSeconds - o.BPFRunSeconds
	}
	d.PassthroughByReason = combineMap(s.PassthroughByReason, o.PassthroughByReason, op)
	d.PassthroughBytesByReason = combineMap(s.PassthroughBytesByReason, o.PassthroughBytesByReason, op)
	d.PassthroughConnections = combineMap(s.PassthroughConnections, o.PassthroughConnections, op)
	d.RemovedSockets = combineMap(s.RemovedSockets, o.RemovedSockets, op)
	d.UnfitCalls = combineMap(s.UnfitCalls, o.UnfitCalls, op)
	d.Hops = map[string]HopStats{}
	keys := map[string]bool{}
	for k := range s.Hops {
		keys[k] = true
	}
	for k := range o.Hops {
		keys[k] = true
	}
	for k := range keys {
		v, b := s.Hops[k], o.Hops[k]
		d.Hops[k] = HopStats{
			PairedConnections:  op(v.PairedConnections, b.PairedConnections),
			RedirectedMessages: op(v.RedirectedMessages, b.RedirectedMessages),
			RedirectedBytes:    op(v.RedirectedBytes, b.RedirectedBytes),
		}
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

// DetachedSockets counts the sockets still in the SOCKHASH of data paths
// that are no longer pinned (after an uninstall or cleanup) but alive
// because those sockets hold them: their connections keep moving
// socket-to-socket until they close, and the kernel takes each socket out
// of the map when it closes, so the count is exact (counters are not: with
// sock_ops detached, no close is counted any more). The map pinned at
// pinDir, if any, is skipped.
func DetachedSockets(pinDir string) (uint64, error) {
	var pinnedID ebpf.MapID
	if m, err := ebpf.LoadPinnedMap(filepath.Join(pinDir, accelMapMwSockHash), &ebpf.LoadPinOptions{ReadOnly: true}); err == nil {
		if info, err := m.Info(); err == nil {
			pinnedID, _ = info.ID()
		}
		m.Close()
	}
	var open uint64
	for id, err := ebpf.MapGetNextID(0); err == nil; id, err = ebpf.MapGetNextID(id) {
		if id == pinnedID {
			continue
		}
		m, err := ebpf.NewMapFromID(id)
		if err != nil {
			continue // gone meanwhile, or not ours to open
		}
		info, err := m.Info()
		if err == nil && info.Name == accelMapMwSockHash && info.Type == ebpf.SockHash {
			var key accelMwSockKey
			var cookie uint64
			it := m.Iterate()
			for it.Next(&key, &cookie) {
				open++
			}
		}
		m.Close()
	}
	return open, nil
}

// SockhashCookies lists the socket cookies (SO_COOKIE) of the sockets in
// mw_sock_hash right now: the sockets whose bytes meshwarp may redirect.
func (a *Agent) SockhashCookies() ([]uint64, error) {
	var (
		key     accelMwSockKey
		cookie  uint64
		cookies []uint64
	)
	it := a.objs.MwSockHash.Iterate()
	for it.Next(&key, &cookie) {
		cookies = append(cookies, cookie)
	}
	if err := it.Err(); err != nil {
		return nil, fmt.Errorf("read mw_sock_hash: %w", err)
	}
	return cookies, nil
}

// Stats reads the counters.
func (a *Agent) Stats() (Stats, error) {
	s, err := readStats(a.objs.MwStats)
	if err != nil {
		return s, err
	}
	s.UnfitProcesses, err = readUnfitProcesses(a.objs.MwUnfitProcs)
	for _, p := range []*ebpf.Program{a.objs.MwSockops, a.objs.MwSkmsg, a.objs.MwSetsockopt, a.objs.MwFinOrder, a.objs.MwObsEgress, a.objs.MwObsIngress, a.objs.MwObsRecv,
		a.objs.MwSpliceWatch, a.objs.MwRecvfromWatch, a.objs.MwRecvmsgWatch, a.objs.MwRecvmmsgWatch, a.objs.MwSendtoWatch,
		a.objs.MwSendmsgWatch, a.objs.MwSendmmsgWatch, a.objs.MwCloseWatch, a.objs.MwConnectWatch, a.objs.MwIoctlWatch} {
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
