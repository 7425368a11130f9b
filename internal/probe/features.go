// SPDX-License-Identifier: Apache-2.0

package probe

// Kernel features: what the BPF objects use (program, map and helper types,
// atomics, links), each probed by loading or attaching something small.

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strings"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"
	"github.com/cilium/ebpf/btf"
	"github.com/cilium/ebpf/features"
	"github.com/cilium/ebpf/link"
	"golang.org/x/sys/unix"
)

// feature turns a kernel probe's error into a row. Per cilium/ebpf's
// features package only nil and ErrNotSupported are conclusive; anything
// else is a warn.
func (p *prober) feature(name string, required bool, use, min, config string, probe func() error) {
	chk := Check{Name: name, Required: required}
	if p.bpfErr != nil {
		chk.Status, chk.Detail, chk.Fix = StatusWarn, "not probed: bpf syscall unusable", "fix "+CheckBPFSyscall+" first"
		p.add(chk)
		return
	}
	err := probe()
	switch {
	case err == nil:
		chk.Status, chk.Detail = StatusOK, use
	case errors.Is(err, ebpf.ErrNotSupported):
		chk.Status = StatusMissing
		chk.Detail = fmt.Sprintf("%v; needed for: %s", err, use)
		chk.Fix = p.kernelFix(min, config)
	case errors.Is(err, unix.EPERM), errors.Is(err, unix.EACCES):
		chk.Status, chk.Detail = StatusWarn, fmt.Sprintf("not probed: %v", err)
		chk.Fix = fixPrivileges
		if p.hasBPFCaps() {
			chk.Fix = fixBlocked
		}
	default:
		chk.Status, chk.Detail, chk.Fix = StatusWarn, fmt.Sprintf("probe failed: %v", err), fixProbe
	}
	p.add(chk)
}

const (
	configSockMsg  = "CONFIG_BPF_SYSCALL=y and CONFIG_NET_SOCK_MSG=y"
	configCgroup   = "CONFIG_BPF_SYSCALL=y and CONFIG_CGROUP_BPF=y"
	configBPF      = "CONFIG_BPF_SYSCALL=y"
	configBPFJIT   = "CONFIG_BPF_SYSCALL=y and CONFIG_BPF_JIT=y"
	configBTF      = "CONFIG_DEBUG_INFO_BTF=y"
	configTrace    = "CONFIG_BPF_EVENTS=y"
	configTC       = "CONFIG_NET_CLS_BPF=y and CONFIG_NET_XGRESS=y"
	kernelTrace    = "4.7"
	kernelLinkSock = "6.10"
	// kernelOldest is the oldest kernel meshwarp is tested on (a VM in
	// scripts/vmtest.sh). What it needs came by 5.15 (bpf_timer, the newest
	// required helper); 5.15 itself is not tested.
	kernelOldest = "6.1"
)

// programTypes, mapTypes and helpers list what the BPF objects use; a test
// (internal/cli) fails when an object uses something not listed here.
var programTypes = []struct {
	name     string
	typ      ebpf.ProgramType
	required bool
	use      string
	config   string
}{
	{"prog sock_ops", ebpf.SockOps, true, "registers sockets as TCP connections establish", configCgroup},
	{"prog sk_msg", ebpf.SkMsg, true, "redirects sendmsg data to the peer socket", configSockMsg},
	{"prog cgroup_sockopt", ebpf.CGroupSockopt, true, "sees socket options the redirect ignores, set by the cgroup's processes", configCgroup},
	{"prog cgroup_sock", ebpf.CGroupSock, true, "names the program that creates each socket (learned programs)", configCgroup},
	{"prog tracepoint", ebpf.TracePoint, false, "syscall watches (run --learn-from-syscalls)", configTrace},
	{"prog tracing", ebpf.Tracing, false, "observation: the client application's read (tp_btf sock:sock_recv_length)", configTrace},
	{"prog cgroup_skb", ebpf.CGroupSKB, false, "observation of connections that are not accelerated (run --observe)", configCgroup},
	{"prog sched_cls", ebpf.SchedCLS, false, "cross-node forwarding (run --cross-node; tcx links, Linux 6.6: see the features below)", configTC},
}

func (p *prober) programTypes() {
	for _, pt := range programTypes {
		min := MinKernel
		if !pt.required {
			min = kernelTrace
		}
		probe := func() error { return features.HaveProgramType(pt.typ) }
		if pt.typ == ebpf.Tracing {
			// Tracing programs load only with their attach target.
			probe = func() error { return haveRawTracepoint("sock_recv_length") }
		}
		p.feature(pt.name, pt.required, pt.use, min, pt.config, probe)
	}
}

var mapTypes = []struct {
	name   string
	typ    ebpf.MapType
	use    string
	config string
}{

	{"map SOCKMAP", ebpf.SockMap, "holds the accelerated sockets", configSockMsg},
	{"map HASH", ebpf.Hash, "socket pairing and policy", configBPF},
	{"map PERCPU_ARRAY", ebpf.PerCPUArray, "counters", configBPF},
	{"map PERCPU_HASH", ebpf.PerCPUHash, "observation: the flow table", configBPF},
	{"map ARRAY", ebpf.Array, "settings", configBPF},
	{"map LPM_TRIE", ebpf.LPMTrie, "CIDR policy", configBPF},
	{"map LRU_HASH", ebpf.LRUHash, "connect and SYN notes, learned ports and processes", configBPF},
	{"map SK_STORAGE", ebpf.SkStorage, "per-socket pairing state; the program of a socket, copied to the sockets it accepts", configBPF},
	{"map CGROUP_ARRAY", ebpf.CGroupArray, "the cgroup the syscall watches cover", configBPF},
	{"map RINGBUF", ebpf.RingBuf, "meshwarp tap: redirected messages to user space (Linux 5.8)", configBPF},
}

func (p *prober) mapTypes() {
	for _, mt := range mapTypes {
		p.feature(mt.name, true, mt.use, MinKernel, mt.config, func() error { return features.HaveMapType(mt.typ) })
	}
}

var helpers = []struct {
	prog   ebpf.ProgramType
	pname  string
	fn     asm.BuiltinFunc
	name   string
	use    string
	config string
}{
	{ebpf.SockOps, "sock_ops", asm.FnSockMapUpdate, "bpf_sock_map_update", "adds sockets to the SOCKMAP", configSockMsg},
	{ebpf.SockOps, "sock_ops", asm.FnSkStorageGet, "bpf_sk_storage_get", "per-socket pairing state", configCgroup},
	{ebpf.SockOps, "sock_ops", asm.FnTimerInit, "bpf_timer_init", "the leave poll's timer: switched sockets leave the SOCKMAP (Linux 5.15)", configCgroup},
	{ebpf.SockOps, "sock_ops", asm.FnForEachMapElem, "bpf_for_each_map_elem", "the leave poll walks the switched connections (Linux 5.13)", configCgroup},
	{ebpf.SockOps, "sock_ops", asm.FnMapDeleteElem, "bpf_map_delete_elem", "takes unpaired sockets out of the SOCKMAP", configCgroup},
	{ebpf.SockOps, "sock_ops", asm.FnGetSocketCookie, "bpf_get_socket_cookie", "per-connection identity", configCgroup},
	{ebpf.SockOps, "sock_ops", asm.FnSockOpsCbFlagsSet, "bpf_sock_ops_cb_flags_set", "state-change callbacks (close)", configCgroup},
	{ebpf.SockOps, "sock_ops", asm.FnSkcToTcpSock, "bpf_skc_to_tcp_sock", "reads TCP state (Linux 5.9, BTF, CAP_PERFMON)", configBTF},
	{ebpf.SockOps, "sock_ops", asm.FnGetNetnsCookie, "bpf_get_netns_cookie", "whether a pair shares a namespace (small-stream threshold)", configCgroup},
	{ebpf.SkMsg, "sk_msg", asm.FnMsgRedirectMap, "bpf_msg_redirect_map", "the redirect itself", configSockMsg},
	{ebpf.SkMsg, "sk_msg", asm.FnSkStorageGet, "bpf_sk_storage_get", "per-socket decision cache", configSockMsg},
	{ebpf.SkMsg, "sk_msg", asm.FnSkcToTcpSock, "bpf_skc_to_tcp_sock", "sees bytes written before pairing (early_data)", configBTF},
	{ebpf.SkMsg, "sk_msg", asm.FnKtimeGetCoarseNs, "bpf_ktime_get_coarse_ns", "when a socket last redirected (keeps its FIN behind it; Linux 5.11)", configSockMsg},
	{ebpf.SkMsg, "sk_msg", asm.FnJiffies64, "bpf_jiffies64", "reads the coarse clock once per tick (Linux 5.5, CAP_BPF)", configSockMsg},
	{ebpf.SkMsg, "sk_msg", asm.FnMsgPullData, "bpf_msg_pull_data", "meshwarp tap: reads the message payload", configSockMsg},
	{ebpf.SkMsg, "sk_msg", asm.FnRingbufOutput, "bpf_ringbuf_output", "meshwarp tap: hands messages to user space", configSockMsg},
	{ebpf.SkMsg, "sk_msg", asm.FnGetNetnsCookie, "bpf_get_netns_cookie", "meshwarp tap --pod/--netns", configSockMsg},
	{ebpf.Tracing, "tracing", asm.FnSkStorageGet, "bpf_sk_storage_get", "observation: per-socket state at the client's read (Linux 5.11; probed as the tracepoint's BTF)", configTrace},
	{ebpf.CGroupSockopt, "cgroup_sockopt", asm.FnSkStorageGet, "bpf_sk_storage_get", "finds the connection of a socket whose options change", configCgroup},
	{ebpf.CGroupSock, "cgroup_sock", asm.FnSkStorageGet, "bpf_sk_storage_get", "records the program that creates a socket", configCgroup},
	{ebpf.CGroupSKB, "cgroup_skb", asm.FnSkFullsock, "bpf_sk_fullsock", "observation and FIN order: the segment's socket", configCgroup},
	{ebpf.CGroupSKB, "cgroup_skb", asm.FnKtimeGetCoarseNs, "bpf_ktime_get_coarse_ns", "FIN order: whether a redirect may be on its way", configCgroup},
	{ebpf.CGroupSKB, "cgroup_skb", asm.FnJiffies64, "bpf_jiffies64", "FIN order and observation: the coarse clock once per tick (Linux 5.5, CAP_BPF)", configCgroup},
	{ebpf.CGroupSKB, "cgroup_skb", asm.FnSkStorageGet, "bpf_sk_storage_get", "observation: per-socket state", configCgroup},
	{ebpf.CGroupSKB, "cgroup_skb", asm.FnSkbLoadBytes, "bpf_skb_load_bytes", "observation: the segment's first bytes", configCgroup},
	{ebpf.CGroupSKB, "cgroup_skb", asm.FnGetSocketUid, "bpf_get_socket_uid", "observation: a socket older than the agent, its owner", configCgroup},
	{ebpf.CGroupSKB, "cgroup_skb", asm.FnSkcToTcpSock, "bpf_skc_to_tcp_sock", "observation: a socket older than the agent, its network namespace (BTF)", configBTF},
	{ebpf.SchedCLS, "sched_cls", asm.FnFibLookup, "bpf_fib_lookup", "cross-node: the kernel's routing decision", configTC},
	{ebpf.SchedCLS, "sched_cls", asm.FnRedirect, "bpf_redirect", "cross-node: to the uplink, neighbour resolved", configTC},
	{ebpf.SchedCLS, "sched_cls", asm.FnRedirectNeigh, "bpf_redirect_neigh", "cross-node: to the uplink, neighbour unresolved (Linux 5.10)", configTC},
	{ebpf.SchedCLS, "sched_cls", asm.FnRedirectPeer, "bpf_redirect_peer", "cross-node: into the pod (Linux 5.10)", configTC},
	{ebpf.SchedCLS, "sched_cls", asm.FnSkbPullData, "bpf_skb_pull_data", "cross-node: headers in the linear area", configTC},
	{ebpf.SchedCLS, "sched_cls", asm.FnSkbStoreBytes, "bpf_skb_store_bytes", "cross-node: the IPv6 hop limit, with the packet checksum", configTC},
	{ebpf.SchedCLS, "sched_cls", asm.FnCheckMtu, "bpf_check_mtu", "cross-node: GSO packets checked by segment against the egress MTU (Linux 5.12)", configTC},
	{ebpf.TracePoint, "tracepoint", asm.FnProbeReadUser, "bpf_probe_read_user", "reads connect()'s address family (syscall watch)", configTrace},
}

// baseHelpers are available to every program type meshwarp loads on every
// kernel >= MinKernel; the probe does not check them one by one.
var baseHelpers = map[asm.BuiltinFunc]bool{
	asm.FnMapLookupElem: true, asm.FnMapUpdateElem: true, asm.FnMapDeleteElem: true,
	asm.FnKtimeGetNs: true, asm.FnGetCurrentPidTgid: true, asm.FnGetCurrentComm: true,
	asm.FnGetCurrentTask: true, asm.FnProbeReadKernel: true, asm.FnCurrentTaskUnderCgroup: true,
	asm.FnGetSmpProcessorId: true,
	// Checked through bpf_timer_init: the timer helpers came together (5.15).
	asm.FnTimerSetCallback: true, asm.FnTimerStart: true,
}

// Uncovered lists what spec's programs use that the probe does not check:
// program types, map types and helpers. Empty means a "ready" verdict covers
// everything the object needs.
func Uncovered(spec *ebpf.CollectionSpec) []string {
	var out []string
	progOK := map[ebpf.ProgramType]bool{}
	for _, pt := range programTypes {
		progOK[pt.typ] = true
	}
	mapOK := map[ebpf.MapType]bool{}
	for _, mt := range mapTypes {
		mapOK[mt.typ] = true
	}
	helperOK := map[ebpf.ProgramType]map[asm.BuiltinFunc]bool{}
	for _, h := range helpers {
		if helperOK[h.prog] == nil {
			helperOK[h.prog] = map[asm.BuiltinFunc]bool{}
		}
		helperOK[h.prog][h.fn] = true
	}
	for name, m := range spec.Maps {
		if !mapOK[m.Type] && !strings.HasPrefix(name, ".") {
			out = append(out, fmt.Sprintf("map %s: type %s", name, m.Type))
		}
	}
	for name, prog := range spec.Programs {
		if !progOK[prog.Type] {
			out = append(out, fmt.Sprintf("program %s: type %s", name, prog.Type))
		}
		for _, ins := range prog.Instructions {
			if !ins.IsBuiltinCall() {
				continue
			}
			fn := asm.BuiltinFunc(ins.Constant)
			if !baseHelpers[fn] && !helperOK[prog.Type][fn] {
				out = append(out, fmt.Sprintf("program %s (%s): helper %s", name, prog.Type, fn))
			}
		}
	}
	sort.Strings(out)
	return slices.Compact(out)
}

func (p *prober) helpers() {
	for _, h := range helpers {
		name := h.pname + ": " + h.name
		if h.prog == ebpf.Tracing {
			// A tracing program's helpers cannot be probed without its attach
			// target; the target is what a kernel may lack.
			p.feature(name, false, h.use, MinKernel, h.config, func() error { return haveRawTracepoint("sock_recv_length") })
			continue
		}
		// Cross-node forwarding is optional: its helpers do not make a node unready.
		p.feature(name, h.prog != ebpf.SchedCLS, h.use, MinKernel, h.config, func() error {
			err := features.HaveProgramHelper(h.prog, h.fn)
			// skc_to_* helpers are hidden from programs loaded without
			// CAP_PERFMON: that reads as "not supported" but is a privilege.
			if errors.Is(err, ebpf.ErrNotSupported) && h.fn == asm.FnSkcToTcpSock && p.capsOK &&
				!p.caps.Has(unix.CAP_PERFMON) && !p.caps.Has(unix.CAP_SYS_ADMIN) {
				return fmt.Errorf("%v (without CAP_PERFMON): %w", err, unix.EPERM)
			}
			return err
		})
	}
}

// haveRawTracepoint reports whether the kernel's BTF has tracepoint name
// (what tp_btf programs attach to).
func haveRawTracepoint(name string) error {
	spec, err := btf.LoadKernelSpec()
	if err != nil {
		return fmt.Errorf("kernel BTF: %w", err)
	}
	var td *btf.Typedef
	if err := spec.TypeByName("btf_trace_"+name, &td); err != nil {
		return fmt.Errorf("tracepoint %s not in the kernel's BTF: %w", name, ebpf.ErrNotSupported)
	}
	return nil
}

// atomics loads a sock_ops program doing a 64-bit atomic compare-and-exchange
// on a map value (BPF_ATOMIC | BPF_CMPXCHG, Linux 5.12).
func (p *prober) atomics() {
	p.feature(CheckAtomicCmpXchg, true, "claims a socket pairing exactly once (Linux 5.12)", MinKernel, configBPFJIT, probeCmpXchg)
}

func probeCmpXchg() error { return probeAtomic(asm.CmpXchg) }

// probeAtomic loads a program applying op to a 64-bit map value; an old
// verifier rejects an unknown atomic opcode with EINVAL.
func probeAtomic(op asm.AtomicOp) error {
	m, err := ebpf.NewMap(&ebpf.MapSpec{Type: ebpf.Array, KeySize: 4, ValueSize: 8, MaxEntries: 1})
	if err != nil {
		return fmt.Errorf("create map: %w", err)
	}
	defer m.Close()
	prog, err := ebpf.NewProgramWithOptions(&ebpf.ProgramSpec{
		Type:    ebpf.SockOps,
		License: "GPL",
		Instructions: asm.Instructions{
			// key = 0 on the stack; r0 = bpf_map_lookup_elem(map, &key)
			asm.Mov.Imm(asm.R1, 0),
			asm.StoreMem(asm.RFP, -4, asm.R1, asm.Word),
			asm.Mov.Reg(asm.R2, asm.RFP),
			asm.Add.Imm(asm.R2, -4),
			asm.LoadMapPtr(asm.R1, m.FD()),
			asm.FnMapLookupElem.Call(),
			asm.JEq.Imm(asm.R0, 0, "exit"),
			// r0 = cmpxchg(*(u64 *)r1, old r0 = 0, new r2 = 1)
			asm.Mov.Reg(asm.R1, asm.R0),
			asm.Mov.Imm(asm.R0, 0),
			asm.Mov.Imm(asm.R2, 1),
			atomicMem(op, asm.R1, asm.R2, asm.DWord, 0),
			asm.Mov.Imm(asm.R0, 1).WithSymbol("exit"),
			asm.Return(),
		},
	}, ebpf.ProgramOptions{LogLevel: ebpf.LogLevelBranch})
	if err != nil {
		var verr *ebpf.VerifierError
		if errors.As(err, &verr) && errors.Is(err, unix.EINVAL) {
			return fmt.Errorf("verifier rejects atomic %v (%s): %w", op, lastLine(verr.Log), ebpf.ErrNotSupported)
		}
		return fmt.Errorf("load program: %w", err)
	}
	return prog.Close()
}

// atomicMem is op.Mem with the operation also in the immediate. cilium/ebpf
// v0.22.0 reads the immediate before it derives it from the opcode when
// marshaling, so op.Mem alone reaches the kernel with imm 0: an atomic ADD,
// which every kernel with BPF_ATOMIC accepts. Programs loaded from ELF keep
// their immediate and are not affected. TestAtomicMemEncoding guards this.
func atomicMem(op asm.AtomicOp, dst, src asm.Register, size asm.Size, off int16) asm.Instruction {
	ins := op.Mem(dst, src, size, off)
	ins.Constant = int64(op >> 8)
	return ins
}

func lastLine(log []string) string {
	for i := len(log) - 1; i >= 0; i-- {
		if s := strings.TrimSpace(log[i]); s != "" {
			return s
		}
	}
	return "no verifier log"
}

// cgroupLink attaches a sock_ops program with BPF_LINK_CREATE to a throwaway
// child of the cgroup v2 root (no process is in it, so nothing runs) and
// closes it again. Links are what make the attachment pinnable and
// replaceable without a gap.
func (p *prober) cgroupLink() {
	if p.cgroup2 == "" {
		p.add(Check{Name: CheckCgroupLink, Required: true, Status: StatusWarn,
			Detail: "not probed: cgroup v2 missing", Fix: "fix " + CheckCgroup2 + " first"})
		return
	}
	var where string
	p.feature(CheckCgroupLink, true, "pinnable, atomically replaceable cgroup attach", MinKernel, configCgroup, func() error {
		var err error
		where, err = attachCgroupLink(p.cgroup2)
		return err
	})
	if c := &p.checks[len(p.checks)-1]; c.Status == StatusOK {
		c.Detail = "BPF_LINK_CREATE on " + where + ": pinnable, atomically replaceable attach"
	}
}

func attachCgroupLink(root string) (where string, err error) {
	prog, err := ebpf.NewProgram(passProgram(ebpf.SockOps, ebpf.AttachCGroupSockOps))
	if err != nil {
		return "", fmt.Errorf("load sock_ops program: %w", err)
	}
	defer prog.Close()

	where = filepath.Join(root, fmt.Sprintf("%s%d", tempPrefix, os.Getpid()))
	if mkErr := os.Mkdir(where, 0o755); mkErr == nil {
		defer os.Remove(where)
	} else {
		// No write access to cgroupfs (a container, or capabilities without
		// CAP_DAC_OVERRIDE): attach to the root itself for an instant; the
		// program above changes nothing for the sockets it sees.
		where = root
	}
	dir, err := os.Open(where)
	if err != nil {
		return where, fmt.Errorf("open cgroup: %w", err)
	}
	defer dir.Close()
	return where, attachLinkBriefly(link.RawLinkOptions{
		Target:  int(dir.Fd()),
		Program: prog,
		Attach:  ebpf.AttachCGroupSockOps,
	}, "sock_ops link to "+where)
}

// passProgram is a program that only returns 1, so that attaching it for an
// instant changes nothing for the sockets it sees: for sk_msg that is
// SK_PASS; for sock_ops, returning without writing reply keeps the kernel
// default of every decision (reply 0 reads as "no opinion") and the replies
// of other programs attached to the same cgroup. Returning 0 would make the
// kernel discard their replies.
func passProgram(typ ebpf.ProgramType, attach ebpf.AttachType) *ebpf.ProgramSpec {
	return &ebpf.ProgramSpec{
		Type:         typ,
		AttachType:   attach,
		License:      "GPL",
		Instructions: asm.Instructions{asm.Mov.Imm(asm.R0, 1), asm.Return()},
	}
}

// attachLinkBriefly attaches a link with BPF_LINK_CREATE and closes it at
// once; what names the link in the error. A kernel that lacks this kind of
// link rejects its attach type with EINVAL, which makes the answer a
// conclusive "not supported" (see feature); other errors stay inconclusive.
func attachLinkBriefly(opts link.RawLinkOptions, what string) error {
	l, err := link.AttachRawLink(opts)
	if err != nil {
		if errors.Is(err, unix.EINVAL) {
			err = fmt.Errorf("%v: %w", err, ebpf.ErrNotSupported)
		}
		return fmt.Errorf("attach %s: %w", what, err)
	}
	return l.Close()
}

// learnedLater is what `run --learn-from-syscalls` does about a call the
// redirect cannot honour (off by default: its tracepoints tax every process).
const learnedLater = "With run --learn-from-syscalls, meshwarp watches for such calls in the attached cgroup and keeps later " +
	"connections on that socket's ports, and every later connection of that program, on TCP; the connection " +
	"that revealed one has already run accelerated"

// spliceLimitation names what no kernel meshwarp runs on can do yet: splice(2)
// from a socket reads only its TCP queue (tcp_splice_read), never the queue
// that redirected bytes wait in. Upstream patches adding splice_read to
// tcp_bpf were not merged when this was written; no BPF hook here can make
// such a splice fail over to read(2) (no BPF LSM, no kprobes: EPERM).
func (p *prober) spliceLimitation() {
	p.add(Check{Name: CheckSpliceLimit, Status: StatusWarn,
		Detail: "limitation: a process that reads an accelerated socket with splice(2) does not see the " +
			"redirected bytes (this kernel has no splice_read for sockmap ingress). " + learnedLater,
		Fix: "exclude the ports of splice readers up front: --exclude-ports (HAProxy with option splice-*, " +
			"Go io.Copy/ReadFrom between two TCP connections)"})
}

// receiveLimitation names the TCP guarantees this kernel's sockmap receive
// and close paths (tcp_bpf_recvmsg, sock_map_close) do not give a redirected
// connection (docs/ARCHITECTURE.md, "TCP guarantees").
func (p *prober) receiveLimitation() {
	p.add(Check{Name: CheckReceiveLimit, Status: StatusWarn,
		Detail: "limitation: on an accelerated socket, recv(MSG_WAITALL) returns what is queued, MSG_OOB carries no urgent mark, close() with unread " +
			"bytes sends FIN, not RST, and connect(AF_UNSPEC) keeps unread redirected bytes for the socket's " +
			"next connection. " + learnedLater + ". FIONREAD after a writer fell back to TCP (backpressure) " +
			"while the receiver also sends counts only the redirected bytes (when the whole connection went to " +
			"TCP, small_stream or a one-way stream's backpressure, its sockets leave the SOCKMAP once those are " +
			"read: native FIONREAD from then on)",
		Fix: "exclude the ports of programs that rely on these up front: --exclude-ports"})
}

// sockmapLink attaches an sk_msg program to an empty SOCKMAP with
// BPF_LINK_CREATE (Linux 6.10): the agent pins the link so a restarted agent
// can replace the program atomically. Optional: without it (Linux < 6.10) the agent attaches
// sk_msg with BPF_PROG_ATTACH to the pinned SOCKMAP, and `meshwarp tap` is
// off (see KernelFeatures).
func (p *prober) sockmapLink() {
	p.feature(CheckSockmapLink, false, "sk_msg attach as a pinnable link (Linux 6.10); without it: BPF_PROG_ATTACH to the pinned SOCKMAP, and no meshwarp tap",
		kernelLinkSock, configSockMsg, attachSockmapLink)
}

func attachSockmapLink() error {
	m, err := ebpf.NewMap(&ebpf.MapSpec{Type: ebpf.SockMap, KeySize: 4, ValueSize: 8, MaxEntries: 1})
	if err != nil {
		return fmt.Errorf("create sockhash: %w", err)
	}
	defer m.Close()
	prog, err := ebpf.NewProgram(passProgram(ebpf.SkMsg, ebpf.AttachSkMsgVerdict))
	if err != nil {
		return fmt.Errorf("load sk_msg program: %w", err)
	}
	defer prog.Close()
	return attachLinkBriefly(link.RawLinkOptions{
		Target:  m.FD(),
		Program: prog,
		Attach:  ebpf.AttachSkMsgVerdict,
	}, "sk_msg link to sockhash")
}
