// SPDX-License-Identifier: Apache-2.0

package probe

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"
	"github.com/cilium/ebpf/features"
	"github.com/cilium/ebpf/link"
	"github.com/cilium/ebpf/rlimit"
	"golang.org/x/sys/unix"
)

// DefaultBPFFSPath is where meshwarp pins its maps and links.
const DefaultBPFFSPath = "/sys/fs/bpf"

// MinKernel is the oldest kernel that has everything `meshwarp run` needs:
// the sk_msg program attached to the SOCKHASH as a pinnable link came last
// (BPF_LINK_CREATE for sockmaps, Linux 6.10).
const MinKernel = kernelLinkSock

const btfVmlinux = "/sys/kernel/btf/vmlinux"

// tempPrefix names what the probe creates on bpffs and cgroupfs; each is
// removed before Run returns.
const tempPrefix = "meshwarp-probe-"

// Options tune Run.
type Options struct {
	// MountBPFFS mounts bpffs at BPFFSPath when nothing is mounted there
	// (needs CAP_SYS_ADMIN). The mount stays: the agent needs it.
	MountBPFFS bool
	// BPFFSPath is where meshwarp pins; empty means DefaultBPFFSPath.
	BPFFSPath string
}

// Fixes that several checks share, so the verdict names them once.
const (
	fixPrivileges = "run as root, or grant CAP_BPF, CAP_NET_ADMIN and CAP_PERFMON " +
		"(setcap cap_bpf,cap_net_admin,cap_perfmon+ep meshwarp; Kubernetes: securityContext.capabilities.add)"
	fixMemlock = "grant CAP_SYS_RESOURCE or raise the limit (ulimit -l unlimited; systemd: LimitMEMLOCK=infinity)"
	fixBTF     = "use a kernel built with CONFIG_DEBUG_INFO_BTF=y (most distribution kernels since 5.4 are)"
	fixBlocked = "allow the bpf() syscall for meshwarp (seccomp profile, LSM policy or kernel lockdown blocks it)"
	fixProbe   = "inconclusive: rerun meshwarp probe --debug as root; check that seccomp, an LSM or lockdown does not block bpf()"
)

// runMu serialises Run: the scratch bpffs directory and cgroup are named
// after the pid, so two concurrent runs in one process would collide.
var runMu sync.Mutex

// Run checks this kernel and process and returns the report. It never
// fails: what it cannot determine becomes a warn row. Side effects that
// outlive it: the bpffs mount (Options.MountBPFFS) and, on kernels < 5.11
// only, a raised RLIMIT_MEMLOCK for this process (rlimit.RemoveMemlock),
// which the agent needs anyway.
func Run(opts Options) Report {
	runMu.Lock()
	defer runMu.Unlock()
	if opts.BPFFSPath == "" {
		opts.BPFFSPath = DefaultBPFFSPath
	}
	p := &prober{opts: opts}
	p.kernelInfo()
	p.privileges()
	p.memlock()
	p.bpfSyscall()
	p.mounts()
	p.btf()
	p.programTypes()
	p.mapTypes()
	p.helpers()
	p.atomics()
	p.cgroupLink()
	p.sockmapLink()
	p.spliceLimitation()
	return NewReport(p.release, p.checks)
}

type prober struct {
	opts    Options
	checks  []Check
	release string
	version [3]int // zero when unknown
	caps    CapSet
	capsOK  bool // caps was read
	// bpfErr is non-nil when the bpf syscall is unusable; kernel feature
	// checks are then reported as not probed rather than missing.
	bpfErr  error
	cgroup2 string
}

func (p *prober) add(c Check) { p.checks = append(p.checks, c) }

func (p *prober) kernelInfo() {
	var uts unix.Utsname
	if err := unix.Uname(&uts); err != nil {
		p.add(Check{Name: CheckKernel, Status: StatusWarn, Detail: fmt.Sprintf("uname: %v", err), Fix: fixProbe})
		return
	}
	p.release = unix.ByteSliceToString(uts.Release[:])
	p.version, _ = parseKernelRelease(p.release)
	machine := unix.ByteSliceToString(uts.Machine[:])
	p.add(Check{Name: CheckKernel, Status: StatusOK,
		Detail: fmt.Sprintf("Linux %s %s (meshwarp needs >= %s)", p.release, machine, MinKernel)})
}

// parseKernelRelease reads "6.18.44-fc-v669" as [6 18 44]; a missing patch
// level is 0.
func parseKernelRelease(release string) ([3]int, error) {
	var v [3]int
	num := release
	if i := strings.IndexFunc(release, func(r rune) bool { return (r < '0' || r > '9') && r != '.' }); i >= 0 {
		num = release[:i]
	}
	parts := strings.Split(strings.Trim(num, "."), ".")
	if len(parts) < 2 {
		return v, fmt.Errorf("kernel release %q: want major.minor", release)
	}
	for i := 0; i < len(parts) && i < 3; i++ {
		n, err := strconv.Atoi(parts[i])
		if err != nil {
			return [3]int{}, fmt.Errorf("kernel release %q: %w", release, err)
		}
		v[i] = n
	}
	return v, nil
}

// kernelAtLeast reports whether the running kernel is >= want ("5.15");
// unknown versions are assumed new enough so fixes point at the config.
func (p *prober) kernelAtLeast(want string) bool {
	if p.version == ([3]int{}) {
		return true
	}
	w, err := parseKernelRelease(want)
	if err != nil {
		return true
	}
	for i := range w {
		if p.version[i] != w[i] {
			return p.version[i] > w[i]
		}
	}
	return true
}

// kernelFix says what to do about a missing kernel feature that appeared in
// Linux min and needs config.
func (p *prober) kernelFix(min, config string) string {
	if !p.kernelAtLeast(min) {
		return "upgrade to Linux >= " + min
	}
	return "use a kernel built with " + config
}

func (p *prober) privileges() {
	euid := os.Geteuid()
	caps, err := effectiveCaps()
	if err != nil {
		p.add(Check{Name: CheckRoot, Status: StatusWarn, Detail: fmt.Sprintf("euid %d; %v", euid, err), Fix: fixProbe})
	} else {
		p.caps, p.capsOK = caps, true
		root := Check{Name: CheckRoot, Status: StatusOK, Detail: fmt.Sprintf("euid %d, CapEff %016x", euid, uint64(caps))}
		switch {
		case euid == 0:
		case p.hasBPFCaps():
			root.Detail += ": not root, the capabilities below suffice"
		default:
			root.Status, root.Fix = StatusWarn, fixPrivileges
		}
		p.add(root)
	}
	for _, c := range []struct {
		cap      int
		alt      int // also sufficient (CAP_SYS_ADMIN covers CAP_BPF and CAP_PERFMON); -1 for none
		required bool
		use      string
		fix      string
	}{
		{unix.CAP_BPF, unix.CAP_SYS_ADMIN, true, "load programs, create maps", fixPrivileges},
		{unix.CAP_NET_ADMIN, -1, true, "SOCKHASH, sock_ops/sk_msg programs, cgroup attach", fixPrivileges},
		{unix.CAP_PERFMON, unix.CAP_SYS_ADMIN, true, "bpf_skc_to_tcp_sock and other BTF-pointer helpers", fixPrivileges},
		{unix.CAP_SYS_ADMIN, -1, false, "mount bpffs, list every BPF program/link (cleanup)",
			"grant CAP_SYS_ADMIN, or mount bpffs yourself (" + fixBPFFS + ")"},
	} {
		name := capNames[c.cap]
		chk := Check{Name: name, Required: c.required}
		switch {
		case !p.capsOK:
			chk.Status, chk.Detail, chk.Fix = StatusWarn, "not probed: CapEff unreadable", fixProbe
		case caps.Has(c.cap):
			chk.Status, chk.Detail = StatusOK, "effective; for: "+c.use
		case c.alt >= 0 && caps.Has(c.alt):
			chk.Status, chk.Detail = StatusOK, "via "+capNames[c.alt]+"; for: "+c.use
		default:
			chk.Status, chk.Detail, chk.Fix = StatusMissing, "not effective; needed for: "+c.use, c.fix
		}
		p.add(chk)
	}
}

// memlock removes the RLIMIT_MEMLOCK cap on BPF memory where the kernel
// still applies it (< 5.11). On newer kernels BPF memory is charged to the
// memory cgroup; rlimit.RemoveMemlock detects that and does not call
// setrlimit, which fails with EPERM without CAP_SYS_RESOURCE.
func (p *prober) memlock() {
	chk := Check{Name: CheckMemlock, Required: true}
	if err := rlimit.RemoveMemlock(); err != nil {
		if p.kernelAtLeast("5.11") {
			// RemoveMemlock's detection creates a map; without CAP_BPF that
			// fails and reads as "no memcg accounting". The kernel version
			// settles it: 5.11 moved BPF memory to the memory cgroup.
			chk.Status = StatusOK
			chk.Detail = fmt.Sprintf("Linux >= 5.11 charges BPF memory to the memory cgroup; RLIMIT_MEMLOCK does not apply (ignored: %v)", err)
			p.add(chk)
			return
		}
		chk.Status = StatusMissing
		chk.Detail = fmt.Sprintf("kernel < 5.11 charges BPF memory to RLIMIT_MEMLOCK and it cannot be raised: %v", err)
		chk.Fix = fixMemlock
		p.add(chk)
		return
	}
	var lim unix.Rlimit
	chk.Status = StatusOK
	if err := unix.Getrlimit(unix.RLIMIT_MEMLOCK, &lim); err == nil && lim.Cur == unix.RLIM_INFINITY {
		chk.Detail = "RLIMIT_MEMLOCK unlimited"
	} else {
		chk.Detail = "BPF memory is charged to the memory cgroup (Linux >= 5.11); RLIMIT_MEMLOCK does not apply"
	}
	p.add(chk)
}

func (p *prober) bpfSyscall() {
	chk := Check{Name: CheckBPFSyscall, Required: true}
	m, err := ebpf.NewMap(&ebpf.MapSpec{Type: ebpf.Array, KeySize: 4, ValueSize: 4, MaxEntries: 1})
	if err == nil {
		m.Close()
		chk.Status, chk.Detail = StatusOK, "created and closed an ARRAY map"
		p.add(chk)
		return
	}
	p.bpfErr = err
	chk.Status = StatusMissing
	chk.Detail = fmt.Sprintf("create map: %v", err)
	if errors.Is(err, unix.EPERM) {
		// cilium/ebpf suggests MEMLOCK on EPERM; the memlock row covers that.
		chk.Detail = "create map: operation not permitted"
		if b, rerr := os.ReadFile("/proc/sys/kernel/unprivileged_bpf_disabled"); rerr == nil && !p.hasBPFCaps() {
			chk.Detail += " (kernel.unprivileged_bpf_disabled=" + strings.TrimSpace(string(b)) + ")"
		}
	}
	switch {
	case errors.Is(err, unix.ENOSYS):
		chk.Fix = "use a kernel built with CONFIG_BPF_SYSCALL=y"
	case errors.Is(err, unix.EPERM) && !p.hasBPFCaps():
		chk.Fix = fixPrivileges
	case errors.Is(err, unix.EPERM):
		chk.Fix = fixBlocked
	default:
		chk.Status, chk.Fix = StatusWarn, fixProbe
	}
	p.add(chk)
}

func (p *prober) hasBPFCaps() bool {
	return p.capsOK && p.caps.Has(unix.CAP_NET_ADMIN) &&
		(p.caps.Has(unix.CAP_BPF) || p.caps.Has(unix.CAP_SYS_ADMIN)) &&
		(p.caps.Has(unix.CAP_PERFMON) || p.caps.Has(unix.CAP_SYS_ADMIN))
}

func (p *prober) mounts() {
	var mounts []Mount
	f, err := os.Open(procMounts)
	if err == nil {
		mounts, err = ParseMounts(f)
		f.Close()
	}
	if err != nil {
		for _, name := range []string{CheckCgroup2, CheckBPFFS, CheckBPFFSWritable} {
			p.add(Check{Name: name, Status: StatusWarn, Required: true,
				Detail: fmt.Sprintf("read %s: %v", procMounts, err), Fix: fixProbe})
		}
		return
	}
	p.cgroup2Check(mounts)
	if p.bpffsCheck(mounts) {
		p.bpffsWritable()
	} else {
		p.add(Check{Name: CheckBPFFSWritable, Status: StatusWarn, Required: true,
			Detail: "not probed: bpffs missing", Fix: "fix " + CheckBPFFS + " first"})
	}
}

func (p *prober) cgroup2Check(mounts []Mount) {
	chk := Check{Name: CheckCgroup2, Required: true}
	for _, m := range mounts {
		if m.FSType != "cgroup2" {
			continue
		}
		if !hasMagic(m.Point, unix.CGROUP2_SUPER_MAGIC) {
			continue // listed but shadowed by a later mount
		}
		p.cgroup2 = m.Point
		chk.Status, chk.Detail = StatusOK, "mounted at "+m.Point
		p.add(chk)
		return
	}
	chk.Status = StatusMissing
	chk.Detail = "no cgroup2 mount in " + procMounts + " (sock_ops attaches to a cgroup v2 directory)"
	chk.Fix = fixCgroup2
	p.add(chk)
}

// bpffsCheck reports whether bpffs is (now) mounted at the pin path.
func (p *prober) bpffsCheck(mounts []Mount) bool {
	path := p.opts.BPFFSPath
	chk := Check{Name: CheckBPFFS, Required: true}
	if hasMagic(path, unix.BPF_FS_MAGIC) {
		chk.Status, chk.Detail = StatusOK, "mounted at "+path
		p.add(chk)
		return true
	}
	elsewhere := ""
	for _, m := range mounts {
		if m.FSType == "bpf" {
			elsewhere = fmt.Sprintf("; bpffs is mounted at %s, but meshwarp pins under %s", m.Point, path)
			break
		}
	}
	chk.Fix = "mount -t bpf bpf " + path
	if !p.opts.MountBPFFS {
		chk.Status = StatusMissing
		chk.Detail = "not mounted at " + path + elsewhere
		chk.Fix += " (or let meshwarp probe mount it: run it as root without --no-mount)"
		p.add(chk)
		return false
	}
	if err := unix.Mount("bpf", path, "bpf", 0, ""); err != nil {
		chk.Status = StatusMissing
		chk.Detail = fmt.Sprintf("not mounted at %s%s; mount: %v", path, elsewhere, err)
		if errors.Is(err, unix.EPERM) {
			chk.Fix = "run as root (mounting needs CAP_SYS_ADMIN), or " + chk.Fix
		}
		p.add(chk)
		return false
	}
	chk.Status, chk.Detail, chk.Fix = StatusOK, "was not mounted: the probe mounted it at "+path, ""
	p.add(chk)
	return true
}

// bpffsWritable creates and removes a directory where the agent pins.
func (p *prober) bpffsWritable() {
	chk := Check{Name: CheckBPFFSWritable, Required: true}
	dir := filepath.Join(p.opts.BPFFSPath, fmt.Sprintf("%s%d", tempPrefix, os.Getpid()))
	err := os.Mkdir(dir, 0o700)
	if errors.Is(err, os.ErrExist) { // left by an earlier process with our pid
		if err = os.Remove(dir); err == nil {
			err = os.Mkdir(dir, 0o700)
		}
	}
	if err == nil {
		err = os.Remove(dir)
	}
	switch {
	case err == nil:
		chk.Status, chk.Detail = StatusOK, "created and removed "+dir
	case errors.Is(err, unix.EROFS):
		chk.Status, chk.Detail = StatusMissing, err.Error()
		chk.Fix = "mount -o remount,rw " + p.opts.BPFFSPath + " (containers: mount the host's bpffs read-write)"
	case errors.Is(err, unix.EACCES), errors.Is(err, unix.EPERM):
		chk.Status, chk.Detail = StatusMissing, err.Error()
		chk.Fix = fixPrivileges
	default:
		chk.Status, chk.Detail, chk.Fix = StatusMissing, err.Error(), fixProbe
	}
	p.add(chk)
}

func (p *prober) btf() {
	chk := Check{Name: CheckBTF, Required: true}
	fi, err := os.Stat(btfVmlinux)
	switch {
	case err == nil && fi.Size() > 0:
		chk.Status = StatusOK
		chk.Detail = fmt.Sprintf("%s (%d KiB): CO-RE and BTF-pointer helpers work", btfVmlinux, fi.Size()/1024)
	case err == nil:
		chk.Status, chk.Detail, chk.Fix = StatusMissing, btfVmlinux+" is empty", fixBTF
	default:
		chk.Status, chk.Detail, chk.Fix = StatusMissing, err.Error(), fixBTF
	}
	p.add(chk)
}

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
	kernelTrace    = "4.7"
	kernelLinkSock = "6.10"
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
	{"prog tracepoint", ebpf.TracePoint, false, "observability of non-accelerated traffic", configTrace},
}

func (p *prober) programTypes() {
	for _, pt := range programTypes {
		min := MinKernel
		if !pt.required {
			min = kernelTrace
		}
		p.feature(pt.name, pt.required, pt.use, min, pt.config, func() error { return features.HaveProgramType(pt.typ) })
	}
}

var mapTypes = []struct {
	name   string
	typ    ebpf.MapType
	use    string
	config string
}{

	{"map SOCKHASH", ebpf.SockHash, "holds the accelerated sockets", configSockMsg},
	{"map HASH", ebpf.Hash, "socket pairing and policy", configBPF},
	{"map PERCPU_ARRAY", ebpf.PerCPUArray, "counters", configBPF},
	{"map ARRAY", ebpf.Array, "settings", configBPF},
	{"map LPM_TRIE", ebpf.LPMTrie, "CIDR policy", configBPF},
	{"map LRU_HASH", ebpf.LRUHash, "SYN hints, splice readers", configBPF},
	{"map SK_STORAGE", ebpf.SkStorage, "per-socket pairing state", configBPF},
	{"map CGROUP_ARRAY", ebpf.CGroupArray, "the cgroup the splice watch covers", configBPF},
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
	{ebpf.SockOps, "sock_ops", asm.FnSockHashUpdate, "bpf_sock_hash_update", "adds sockets to the SOCKHASH", configSockMsg},
	{ebpf.SockOps, "sock_ops", asm.FnSkStorageGet, "bpf_sk_storage_get", "per-socket pairing state", configCgroup},
	{ebpf.SockOps, "sock_ops", asm.FnTimerInit, "bpf_timer_init", "bounds how long a socket waits unpaired (Linux 5.15)", configCgroup},
	{ebpf.SockOps, "sock_ops", asm.FnMapDeleteElem, "bpf_map_delete_elem", "takes unpaired sockets out of the SOCKHASH", configCgroup},
	{ebpf.SockOps, "sock_ops", asm.FnGetSocketCookie, "bpf_get_socket_cookie", "per-connection identity", configCgroup},
	{ebpf.SockOps, "sock_ops", asm.FnSockOpsCbFlagsSet, "bpf_sock_ops_cb_flags_set", "state-change callbacks (close)", configCgroup},
	{ebpf.SockOps, "sock_ops", asm.FnSkcToTcpSock, "bpf_skc_to_tcp_sock", "reads TCP state (Linux 5.9, BTF, CAP_PERFMON)", configBTF},
	{ebpf.SkMsg, "sk_msg", asm.FnMsgRedirectHash, "bpf_msg_redirect_hash", "the redirect itself", configSockMsg},
	{ebpf.SkMsg, "sk_msg", asm.FnSkStorageGet, "bpf_sk_storage_get", "per-socket decision cache", configSockMsg},
}

// baseHelpers are available to every program type meshwarp loads on every
// kernel >= MinKernel; the probe does not check them one by one.
var baseHelpers = map[asm.BuiltinFunc]bool{
	asm.FnMapLookupElem: true, asm.FnMapUpdateElem: true, asm.FnMapDeleteElem: true,
	asm.FnKtimeGetNs: true, asm.FnGetCurrentPidTgid: true, asm.FnGetCurrentComm: true,
	asm.FnGetCurrentTask: true, asm.FnProbeReadKernel: true, asm.FnCurrentTaskUnderCgroup: true,
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
		p.feature(name, true, h.use, MinKernel, h.config, func() error {
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
	prog, err := ebpf.NewProgramWithOptions(&ebpf.ProgramSpec{
		Type:       ebpf.SockOps,
		AttachType: ebpf.AttachCGroupSockOps,
		License:    "GPL",
		// Returns 1 without writing reply: every sock_ops decision keeps the
		// kernel default (reply 0 reads as "no opinion") and the replies of
		// other programs attached to the same cgroup are kept. Returning 0
		// would make the kernel discard their replies.
		Instructions: asm.Instructions{asm.Mov.Imm(asm.R0, 1), asm.Return()},
	}, ebpf.ProgramOptions{})
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
	l, err := link.AttachRawLink(link.RawLinkOptions{
		Target:  int(dir.Fd()),
		Program: prog,
		Attach:  ebpf.AttachCGroupSockOps,
	})
	if err != nil {
		if errors.Is(err, unix.EINVAL) {
			err = fmt.Errorf("%v: %w", err, ebpf.ErrNotSupported)
		}
		return where, fmt.Errorf("attach sock_ops link to %s: %w", where, err)
	}
	return where, l.Close()
}

// sockmapLink attaches an sk_msg program to an empty SOCKHASH with
// BPF_LINK_CREATE (Linux 6.10). Required: the agent pins the sk_msg link so a
// restarted agent can replace the program atomically.
// spliceLimitation names what no kernel meshwarp runs on can do yet: splice(2)
// from a socket reads only its TCP queue (tcp_splice_read), never the queue
// that redirected bytes wait in. Upstream patches adding splice_read to
// tcp_bpf were not merged when this was written; no BPF hook here can make
// such a splice fail over to read(2) (no BPF LSM, no kprobes: EPERM).
func (p *prober) spliceLimitation() {
	p.add(Check{Name: CheckSpliceLimit, Status: StatusWarn,
		Detail: "limitation: a process that reads an accelerated socket with splice(2) does not see the " +
			"redirected bytes (this kernel has no splice_read for sockmap ingress). meshwarp " +
			"watches splice(2) in the attached cgroup and keeps later connections on that socket's ports " +
			"on TCP, but the connection that revealed the reader has already lost them",
		Fix: "exclude the ports of splice readers up front: --exclude-ports (HAProxy with option splice-*, " +
			"Go io.Copy/ReadFrom between two TCP connections)"})
}

func (p *prober) sockmapLink() {
	p.feature(CheckSockmapLink, true, "sk_msg attach as a pinnable link (Linux 6.10)",
		kernelLinkSock, configSockMsg, attachSockmapLink)
}

func attachSockmapLink() error {
	m, err := ebpf.NewMap(&ebpf.MapSpec{Type: ebpf.SockHash, KeySize: 4, ValueSize: 8, MaxEntries: 1})
	if err != nil {
		return fmt.Errorf("create sockhash: %w", err)
	}
	defer m.Close()
	prog, err := ebpf.NewProgramWithOptions(&ebpf.ProgramSpec{
		Type:         ebpf.SkMsg,
		AttachType:   ebpf.AttachSkMsgVerdict,
		License:      "GPL",
		Instructions: asm.Instructions{asm.Mov.Imm(asm.R0, 1 /* SK_PASS */), asm.Return()},
	}, ebpf.ProgramOptions{})
	if err != nil {
		return fmt.Errorf("load sk_msg program: %w", err)
	}
	defer prog.Close()
	l, err := link.AttachRawLink(link.RawLinkOptions{
		Target:  m.FD(),
		Program: prog,
		Attach:  ebpf.AttachSkMsgVerdict,
	})
	if err != nil {
		if errors.Is(err, unix.EINVAL) {
			err = fmt.Errorf("%v: %w", err, ebpf.ErrNotSupported)
		}
		return fmt.Errorf("attach sk_msg link to sockhash: %w", err)
	}
	return l.Close()
}

// hasMagic reports whether path is the root of a filesystem of that type.
func hasMagic(path string, magic int64) bool {
	var st unix.Statfs_t
	if err := unix.Statfs(path, &st); err != nil {
		return false
	}
	return int64(st.Type) == magic
}
