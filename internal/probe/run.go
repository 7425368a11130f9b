// SPDX-License-Identifier: Apache-2.0

package probe

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/rlimit"
	"golang.org/x/sys/unix"
)

// DefaultBPFFSPath is where meshwarp pins its maps and links.
const DefaultBPFFSPath = "/sys/fs/bpf"

// MinKernel is the oldest kernel meshwarp supports: the oldest it is tested
// on (6.1 LTS, in a VM: scripts/vmtest.sh). What differs between kernels is
// probed feature by feature (KernelFeatures), never inferred from the version.
const MinKernel = kernelOldest

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
	p.receiveLimitation()
	r := NewReport(p.release, p.checks)
	if p.bpfErr == nil {
		r.Features = KernelFeatures()
	}
	return r
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
		{unix.CAP_NET_ADMIN, -1, true, "SOCKMAP, sock_ops/sk_msg programs, cgroup attach", fixPrivileges},
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

// hasMagic reports whether path is the root of a filesystem of that type.
func hasMagic(path string, magic int64) bool {
	var st unix.Statfs_t
	if err := unix.Statfs(path, &st); err != nil {
		return false
	}
	return int64(st.Type) == magic
}
