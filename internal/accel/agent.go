// SPDX-License-Identifier: Apache-2.0

// Package accel loads, attaches and pins the acceleration programs
// (sock_ops + sk_msg + SOCKHASH, bpf/accel/accel.bpf.c), turns policy into
// maps, and owns the lifecycle: adopt pinned state on restart, replace
// programs atomically on upgrade, uninstall without touching live sockets.
//
// Lifecycle facts this package is built around:
//   - Deleting a socket from the SOCKHASH can discard bytes queued for it, so
//     meshwarp never deletes entries: the kernel removes a socket when it closes.
//   - A socket in the SOCKHASH keeps its own reference to the sk_msg program,
//     which keeps the maps alive. Detaching and unpinning therefore stop only
//     new connections; open accelerated connections keep working until they close.
package accel

import (
	"errors"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"os"
	"path/filepath"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"
	"github.com/cilium/ebpf/link"
	"github.com/cilium/ebpf/rlimit"
	"golang.org/x/sys/unix"

	"github.com/meshwarp/meshwarp/internal/crossnode"
	"github.com/meshwarp/meshwarp/internal/probe"
)

// DefaultPinDir is where the agent pins what must survive a restart.
const DefaultPinDir = "/sys/fs/bpf/meshwarp"

// ErrBadConfig marks a refusal caused by the given configuration (a cgroup
// or pin directory that does not fit); the CLI maps it to a usage exit code.
var ErrBadConfig = errors.New("bad configuration")

// Istio's sidecar conventions, the defaults of every meshwarp component (the
// agent's hop names, the lab's capture and proxies, the bench): the one home
// of these numbers.
const (
	DefaultSidecarUID   = 1337  // the proxy's uid; the capture rules exempt it
	DefaultOutboundPort = 15001 // sidecar listener for captured outbound TCP
	DefaultInboundPort  = 15006 // sidecar listener for captured inbound TCP
)

// DefaultUnpairedTimeout bounds how long a connecting socket whose peer is
// on this node waits in the SOCKHASH for that peer to be established (a few
// microseconds normally; milliseconds only when the handshake's last ACK is
// lost) before it leaves for plain TCP.
const DefaultUnpairedTimeout = 10 * time.Millisecond

// DefaultRedirectBudget bounds the redirected bytes a receiver may leave
// unread before its sender continues on TCP: the redirect itself ignores the
// receiver's buffer limits, TCP's flow control does not. With TCP's own
// buffers on top, a writer to a reader that stops blocks after a few MB, as
// on plain TCP.
const DefaultRedirectBudget = 1 << 20

// Small-message streams (reason small_stream): a connection whose one side
// writes SmallStreamRun messages without a message back, averaging fewer
// bytes than the path's threshold, continues on TCP, which coalesces small
// writes where a redirect pays one queued message and one wakeup per write
// (docs/BENCHMARKS.md sections 2 and 8: a loopback stream redirected is
// slower up to 16 KB writes, pod to pod below 256 B).
const (
	SmallStreamRun         = 16
	SmallStreamLocalBytes  = 32 << 10 // both ends in one network namespace (loopback)
	SmallStreamRemoteBytes = 256      // across namespaces (veth)
)

// DefaultCapacity is the default number of sockets (and connections) tracked.
const DefaultCapacity = 65536

// Names of the pinned links under the pin directory (maps are pinned by their BPF names).
const (
	sockopsLinkPin = "mw_sockops_link"
	sockoptLinkPin = "mw_sockopt_link"
	skmsgLinkPin   = "mw_skmsg_link"
	obsEgressPin   = "mw_obs_egress_link"
	obsIngressPin  = "mw_obs_ingress_link"
	obsRecvPin     = "mw_obs_recv_link"
)

// linkPins are every link meshwarp pins, in the order they are removed.
var linkPins = []string{sockopsLinkPin, sockoptLinkPin, skmsgLinkPin, obsEgressPin, obsIngressPin, obsRecvPin}

// Config selects what the agent attaches to and what it accelerates.
type Config struct {
	// CgroupPath is the cgroup v2 directory sock_ops attaches to; empty means the v2 root.
	CgroupPath string
	// PinDir holds pinned maps and links; empty means DefaultPinDir.
	PinDir string
	// SidecarUID is the uid the sidecar proxy runs as; it names the sidecar -> app hop.
	// 0 means DefaultSidecarUID (root cannot be the sidecar uid).
	SidecarUID uint32
	// OutboundPort and InboundPort are the sidecar's capture ports; 0 = the defaults.
	OutboundPort, InboundPort uint16
	// Policy decides which connections may be accelerated.
	Policy Policy
	// SockhashCapacity bounds the number of accelerated sockets; 0 means DefaultCapacity.
	SockhashCapacity uint32
	// UnpairedTimeout: see DefaultUnpairedTimeout; 0 means that.
	UnpairedTimeout time.Duration
	// RedirectBudget: see DefaultRedirectBudget; 0 means that.
	RedirectBudget uint32
	// KeepSmallStreams keeps streams on the redirect: no small_stream (see
	// SmallStreamRun), and backpressure moves only the writer's direction
	// to TCP even when the receiver never sent.
	KeepSmallStreams bool
	// Observe records RED data (HTTP/1.x exchanges, TCP connections) of
	// every connection of the cgroup, accelerated or not (bpf/accel/observe.h):
	// /metrics, `meshwarp top`, `meshwarp trace`.
	Observe bool
	// ObserveOnly accelerates nothing: no socket joins the SOCKHASH (an
	// observe-only node, or the baseline of the observation's own cost).
	ObserveOnly bool
	// CrossNode forwards pod packets between nodes past the node's bridge,
	// netfilter and routing (internal/crossnode) in CrossNodes (empty: the
	// agent's own network namespace).
	CrossNode  bool
	CrossNodes []crossnode.Node
	// CrossNodeInterval: how often devices and rulesets are read; 0 means
	// crossnode.DefaultInterval.
	CrossNodeInterval time.Duration
	// ObserveReads also records client applications' reads of their
	// responses (the breakdown's outermost point). It runs a program on every
	// socket read of the node, so the agent leaves it to `meshwarp trace`,
	// which attaches it while it samples (TraceReads); the bench sets it.
	ObserveReads bool
	// LearnFromSyscalls attaches the syscall watches (watch.go): what a
	// process of the cgroup does on an accelerated socket with splice(2),
	// MSG_WAITALL, MSG_OOB, close() with unread bytes or connect(AF_UNSPEC)
	// keeps later connections on that socket's ports on TCP. Off by default:
	// syscall tracepoints put every process of the node on the kernel's
	// syscall tracing path (docs/BENCHMARKS.md).
	LearnFromSyscalls bool
}

// DataPathConstants are the data path's load-time settings for cfg (the
// tap's program, which replaces the agent's while it runs, takes them from
// the agent's loaded program instead: internal/tap).
func DataPathConstants(cfg Config) map[string]any {
	cfg.setDefaults()
	run := uint32(SmallStreamRun)
	if cfg.KeepSmallStreams {
		run = 0
	}
	return map[string]any{
		"redirect_budget_bytes":     cfg.RedirectBudget,
		"stream_run_msgs":           run,
		"stream_small_bytes_local":  uint32(SmallStreamLocalBytes),
		"stream_small_bytes_remote": uint32(SmallStreamRemoteBytes),
	}
}

func (c *Config) setDefaults() {
	if c.PinDir == "" {
		c.PinDir = DefaultPinDir
	}
	if c.SockhashCapacity == 0 {
		c.SockhashCapacity = DefaultCapacity
	}
	if c.SidecarUID == 0 {
		c.SidecarUID = DefaultSidecarUID
	}
	if c.OutboundPort == 0 {
		c.OutboundPort = DefaultOutboundPort
	}
	if c.InboundPort == 0 {
		c.InboundPort = DefaultInboundPort
	}
	if c.UnpairedTimeout == 0 {
		c.UnpairedTimeout = DefaultUnpairedTimeout
	}
	if c.RedirectBudget == 0 {
		c.RedirectBudget = DefaultRedirectBudget
	}
}

// Agent is an attached acceleration data path.
type Agent struct {
	cfg     Config
	logger  *slog.Logger
	objs    accelObjects
	sockops link.Link
	// sockopt sees the cgroup's setsockopt calls (bpf/accel/watches.h).
	sockopt link.Link
	skmsg   link.Link
	// obs are the observation's links (cgroup_skb egress and ingress, and the read
	// tracepoint with Config.ObserveReads), pinned like the rest.
	obs []link.Link
	// watches learn unfit sockets (watch.go) while this process runs: not
	// pinned, so between agents nothing is learned, while the data path
	// keeps running.
	watches []link.Link
	// xn is cross-node forwarding (Config.CrossNode).
	xn *crossnode.Agent
	// lock holds the pin directory while this process runs (lock.go).
	lock   *os.File
	closed bool
	// Adopted is true when Start found pinned state from an earlier agent and took it over.
	Adopted bool
	// CrossNodeOff says why Config.CrossNode was not honoured (nil when it was,
	// or was not asked for): this kernel lacks what it needs.
	CrossNodeOff error
	// readsOff says why the client read observation cannot attach here.
	readsOff error
}

// standInProgram is a program every kernel loads, put in place of one whose
// attach target this kernel lacks so that the rest of the object loads; it
// is never attached.
func standInProgram(name string) *ebpf.ProgramSpec {
	return &ebpf.ProgramSpec{
		Name:         name,
		Type:         ebpf.SocketFilter,
		License:      "Dual BSD/GPL",
		Instructions: asm.Instructions{asm.Mov.Imm(asm.R0, 0), asm.Return()},
	}
}

// Start loads the programs, adopts pinned maps and links from an earlier
// agent if there are any (replacing its programs atomically), attaches what
// is missing and pins everything under cfg.PinDir. On error nothing that this
// call attached or pinned is left behind.
func Start(cfg Config, logger *slog.Logger) (*Agent, error) {
	spec, err := loadAccel()
	if err != nil {
		return nil, fmt.Errorf("load accel spec: %w", err)
	}
	return start(cfg, logger, spec)
}

// start is Start with the object given (tests pass another build's layout).
func start(cfg Config, logger *slog.Logger, spec *ebpf.CollectionSpec) (_ *Agent, err error) {
	cfg.setDefaults()
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}
	logger = logger.With("subsys", "accel")
	if cfg.CgroupPath == "" {
		return nil, fmt.Errorf("%w: no cgroup given: pass the cgroup v2 directory to attach to", ErrBadConfig)
	}
	if err := checkCgroup2(cfg.CgroupPath); err != nil {
		return nil, err
	}
	createdDir, err := preparePinDir(cfg.PinDir)
	if err != nil {
		return nil, err
	}
	// Kernels >= 5.11 account BPF memory to the memory cgroup; RemoveMemlock
	// knows this and does nothing there (setrlimit would fail with EPERM here).
	if err := rlimit.RemoveMemlock(); err != nil {
		logger.Debug("memlock rlimit not raised", "err", err)
	}

	a := &Agent{cfg: cfg, logger: logger}
	var undo []func()
	defer func() {
		if err == nil {
			return
		}
		for i := len(undo) - 1; i >= 0; i-- {
			undo[i]()
		}
		a.objs.Close()
		if createdDir {
			os.Remove(cfg.PinDir)
		}
		if a.lock != nil {
			a.lock.Close()
		}
	}()

	preexisting := pinnedNames(cfg.PinDir)
	undo = append(undo, func() { unpinNew(cfg.PinDir, preexisting) })

	// Before anything is loaded, pinned or attached: refuse another build's maps.
	if err := checkPinnedLayout(spec, cfg.PinDir); err != nil {
		return nil, err
	}
	// Then nothing changes while another live agent holds the directory.
	if a.lock, err = lockPinDir(cfg.PinDir); err != nil {
		return nil, err
	}
	spec.Maps["mw_sock_hash"].MaxEntries = cfg.SockhashCapacity
	spec.Maps["mw_conns"].MaxEntries = cfg.SockhashCapacity
	consts := DataPathConstants(cfg)
	consts["sidecar_uid"] = cfg.SidecarUID
	consts["outbound_capture_port"] = uint32(cfg.OutboundPort)
	consts["inbound_capture_port"] = uint32(cfg.InboundPort)
	consts["unpaired_timeout_ns"] = uint64(cfg.UnpairedTimeout.Nanoseconds())
	obs, err := obsConstants(cfg)
	if err != nil {
		return nil, err
	}
	maps.Copy(consts, obs)
	for name, v := range consts {
		if err := spec.Variables[name].Set(v); err != nil {
			return nil, fmt.Errorf("set %s: %w", name, err)
		}
	}
	if rerr := probe.HaveRecvTracepoint(); rerr != nil {
		// tp_btf programs load only with their target (sock:sock_recv_length,
		// Linux 6.3): a stand-in keeps the object loadable, and the client
		// read time is off (probe.FeatureClientRead).
		a.readsOff = rerr
		spec.Programs["mw_obs_recv"] = standInProgram("mw_obs_recv")
	}
	opts := &ebpf.CollectionOptions{Maps: ebpf.MapOptions{PinPath: cfg.PinDir}}
	if err := spec.LoadAndAssign(&a.objs, opts); err != nil {
		return nil, loadError(err, cfg.PinDir)
	}
	if len(preexisting) > 0 {
		a.Adopted = true
	}

	if err := a.ApplyPolicy(cfg.Policy); err != nil {
		return nil, err
	}

	// sk_msg first: a socket that sock_ops puts in the hash must find its program.
	if lerr := probe.HaveSockmapLink(); lerr != nil {
		// Linux < 6.10 has no sockmap links: the program is attached to the
		// map itself (BPF_PROG_ATTACH), which is pinned, so the attachment
		// survives this process like a pinned link would. A restarted agent
		// attaches its program again: the kernel swaps the map's program
		// (sock_map_prog_update), as BPF_LINK_UPDATE does. Sockets already
		// in the map keep the program they joined with either way.
		logger.Debug("sk_msg attached without a link", "reason", lerr)
		if err := link.RawAttachProgram(link.RawAttachProgramOptions{
			Target:  a.objs.MwSockHash.FD(),
			Program: a.objs.MwSkmsg,
			Attach:  ebpf.AttachSkMsgVerdict,
		}); err != nil {
			return nil, fmt.Errorf("attach sk_msg to mw_sock_hash (BPF_PROG_ATTACH): %w", err)
		}
	} else {
		a.skmsg, err = attachOrUpdate(filepath.Join(cfg.PinDir, skmsgLinkPin), a.objs.MwSkmsg, func() (link.Link, error) {
			return link.AttachRawLink(link.RawLinkOptions{
				Target:  a.objs.MwSockHash.FD(),
				Program: a.objs.MwSkmsg,
				Attach:  ebpf.AttachSkMsgVerdict,
			})
		}, nil)
		if err != nil {
			return nil, fmt.Errorf("attach sk_msg to mw_sock_hash: %w", err)
		}
		skmsg := a.skmsg
		undo = append(undo, func() { skmsg.Close() })
	}

	a.sockops, err = attachOrUpdate(filepath.Join(cfg.PinDir, sockopsLinkPin), a.objs.MwSockops, func() (link.Link, error) {
		return link.AttachCgroup(link.CgroupOptions{
			Path:    cfg.CgroupPath,
			Attach:  ebpf.AttachCGroupSockOps,
			Program: a.objs.MwSockops,
		})
	}, func(l link.Link) error { return sameCgroup(l, cfg.CgroupPath) })
	if err != nil {
		return nil, fmt.Errorf("attach sock_ops to %s: %w", cfg.CgroupPath, err)
	}
	sockops := a.sockops
	undo = append(undo, func() { sockops.Close() })

	a.sockopt, err = attachOrUpdate(filepath.Join(cfg.PinDir, sockoptLinkPin), a.objs.MwSetsockopt, func() (link.Link, error) {
		return link.AttachCgroup(link.CgroupOptions{
			Path:    cfg.CgroupPath,
			Attach:  ebpf.AttachCGroupSetsockopt,
			Program: a.objs.MwSetsockopt,
		})
	}, func(l link.Link) error { return sameCgroup(l, cfg.CgroupPath) })
	if err != nil {
		return nil, fmt.Errorf("attach cgroup setsockopt to %s: %w", cfg.CgroupPath, err)
	}
	sockopt := a.sockopt
	undo = append(undo, func() { sockopt.Close() })

	if err := a.attachObservation(); err != nil {
		return nil, err
	}
	undo = append(undo, func() { a.closeObservation() })

	if cfg.LearnFromSyscalls {
		a.watches, err = watchSyscalls(&a.objs, cfg.CgroupPath)
	}
	if err != nil {
		// Acceleration works without them; what they learn is then not learned.
		logger.Warn("syscall watches off: splice(2), MSG_WAITALL, MSG_OOB, SO_RCVLOWAT and close with unread bytes "+
			"on accelerated sockets are not learned (exclude such ports with --exclude-ports)", "err", err)
		err = nil
	}

	// Last: nothing after it can fail, so a failed start never undoes an
	// earlier agent's cross-node links.
	xnOff := probe.HaveTCX()
	if cfg.CrossNode && xnOff != nil {
		// Cross-node forwarding is an optimisation of packets that the normal
		// path carries correctly: off, with the reason in probe and status.
		logger.Warn("cross-node forwarding off: this kernel has no tcx links (Linux 6.6); pod traffic between nodes takes the normal path", "err", xnOff)
		a.CrossNodeOff = xnOff
	}
	if cfg.CrossNode && xnOff == nil {
		a.xn, err = crossnode.Start(crossnode.Config{PinDir: cfg.PinDir, Nodes: cfg.CrossNodes, Interval: cfg.CrossNodeInterval}, logger)
		if errors.Is(err, crossnode.ErrBadConfig) {
			return nil, fmt.Errorf("%w: %w", ErrBadConfig, err)
		}
		if err != nil {
			return nil, err
		}
	} else if removed, cerr := crossnode.Cleanup(cfg.PinDir); cerr != nil {
		logger.Warn("cannot detach an earlier agent's cross-node forwarding", "err", cerr)
	} else if len(removed) > 0 {
		logger.Info("cross-node forwarding of an earlier agent detached (run without --cross-node)", "pins", len(removed))
	}

	logger.Info("acceleration attached", "cgroup", cfg.CgroupPath, "pin_dir", cfg.PinDir,
		"adopted", a.Adopted, "capacity", cfg.SockhashCapacity, "observe", cfg.Observe, "accelerate", !cfg.ObserveOnly)
	return a, nil
}

// attachOrUpdate adopts the link pinned at pin (replacing its program
// atomically) or attaches a new one and pins it.
func attachOrUpdate(pin string, prog *ebpf.Program, attach func() (link.Link, error), check func(link.Link) error) (link.Link, error) {
	if _, err := os.Stat(pin); err == nil {
		l, err := link.LoadPinnedLink(pin, nil)
		if err != nil {
			return nil, fmt.Errorf("load pinned link %s: %w", pin, err)
		}
		if check != nil {
			if err := check(l); err != nil {
				l.Close()
				return nil, err
			}
		}
		if err := l.Update(prog); err != nil {
			l.Close()
			return nil, fmt.Errorf("replace program of %s: %w", pin, err)
		}
		return l, nil
	}
	l, err := attach()
	if err != nil {
		return nil, err
	}
	if err := l.Pin(pin); err != nil {
		l.Close()
		return nil, fmt.Errorf("pin %s: %w", pin, err)
	}
	return l, nil
}

// sameCgroup refuses to adopt a sock_ops link attached to another cgroup.
func sameCgroup(l link.Link, path string) error {
	info, err := l.Info()
	if err != nil {
		return fmt.Errorf("inspect pinned sock_ops link: %w", err)
	}
	cg := info.Cgroup()
	if cg == nil {
		return nil
	}
	id, err := cgroupID(path)
	if err != nil {
		return err
	}
	if cg.CgroupId != id {
		return fmt.Errorf("the pinned agent is attached to another cgroup (id %d, not %s): run `meshwarp cleanup` first or pass the same --cgroup", cg.CgroupId, path)
	}
	return nil
}

// cgroupID is the cgroup v2 id, which is the inode number of its directory.
func cgroupID(path string) (uint64, error) {
	var st unix.Stat_t
	if err := unix.Stat(path, &st); err != nil {
		return 0, fmt.Errorf("stat cgroup %s: %w", path, err)
	}
	return st.Ino, nil
}

func loadError(err error, pinDir string) error {
	if errors.Is(err, ebpf.ErrMapIncompatible) {
		return fmt.Errorf("pinned maps under %s come from an incompatible meshwarp version or capacity: run `meshwarp cleanup` (open accelerated connections keep working), then start again: %w", pinDir, err)
	}
	var ve *ebpf.VerifierError
	if errors.As(err, &ve) {
		return fmt.Errorf("load accel programs: the kernel verifier rejected them (kernel too old?):\n%+v", ve)
	}
	if errors.Is(err, unix.EPERM) {
		return fmt.Errorf("load accel programs: permission denied: run as root (needs CAP_BPF, CAP_NET_ADMIN, CAP_SYS_ADMIN): %w", err)
	}
	return fmt.Errorf("load accel programs: %w", err)
}

func checkCgroup2(path string) error {
	var fs unix.Statfs_t
	if err := unix.Statfs(path, &fs); err != nil {
		return fmt.Errorf("%w: cgroup %s: %w (pass an existing cgroup v2 directory, e.g. the mount point shown by `meshwarp probe`)", ErrBadConfig, path, err)
	}
	if fs.Type != unix.CGROUP2_SUPER_MAGIC {
		return fmt.Errorf("%w: %s is not a cgroup v2 directory: pass a directory under the cgroup2 mount (see `grep cgroup2 /proc/mounts`)", ErrBadConfig, path)
	}
	return nil
}

// preparePinDir makes sure dir exists on a bpf filesystem and is writable.
func preparePinDir(dir string) (created bool, err error) {
	parent := filepath.Dir(dir)
	var fs unix.Statfs_t
	if err := unix.Statfs(parent, &fs); err != nil {
		return false, fmt.Errorf("%w: pin directory parent %s: %w (choose a --pin-dir on a bpffs mount, default %s; mount one with: mount -t bpf bpf /sys/fs/bpf)", ErrBadConfig, parent, err, DefaultPinDir)
	}
	if fs.Type != unix.BPF_FS_MAGIC {
		return false, fmt.Errorf("%w: %s is not on a bpf filesystem: choose a --pin-dir on a bpffs mount (default %s) or mount one there: mount -t bpf bpf %s", ErrBadConfig, parent, DefaultPinDir, parent)
	}
	if _, err := os.Stat(dir); err == nil {
		return false, checkWritable(dir)
	}
	if err := os.Mkdir(dir, 0o700); err != nil {
		if errors.Is(err, unix.EROFS) || errors.Is(err, unix.EACCES) || errors.Is(err, unix.EPERM) {
			return false, fmt.Errorf("%w: create pin directory %s: %w (run as root; if bpffs is read-only: mount -o remount,rw %s)", probe.ErrNotReady, dir, err, parent)
		}
		return false, fmt.Errorf("create pin directory %s: %w", dir, err)
	}
	return true, nil
}

func checkWritable(dir string) error {
	if err := unix.Access(dir, unix.W_OK); err != nil {
		return fmt.Errorf("%w: pin directory %s is not writable: %w (run as root; if bpffs is read-only: mount -o remount,rw %s)", probe.ErrNotReady, dir, err, filepath.Dir(dir))
	}
	return nil
}

func pinnedNames(dir string) map[string]bool {
	names := map[string]bool{}
	entries, _ := os.ReadDir(dir)
	for _, e := range entries {
		names[e.Name()] = true
	}
	return names
}

// unpinNew removes pins that were not there before (undo of a failed Start).
func unpinNew(dir string, before map[string]bool) {
	for name := range pinnedNames(dir) {
		if !before[name] {
			os.Remove(filepath.Join(dir, name))
		}
	}
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
	for _, p := range []*ebpf.Program{a.objs.MwSockops, a.objs.MwSkmsg, a.objs.MwSetsockopt, a.objs.MwObsEgress, a.objs.MwObsIngress, a.objs.MwObsRecv,
		a.objs.MwSpliceWatch, a.objs.MwRecvfromWatch, a.objs.MwRecvmsgWatch, a.objs.MwRecvmmsgWatch, a.objs.MwSendtoWatch,
		a.objs.MwSendmsgWatch, a.objs.MwSendmmsgWatch, a.objs.MwCloseWatch, a.objs.MwConnectWatch} {
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

// Close releases this process's handles. Everything stays attached and
// pinned: a restarted agent adopts it, `meshwarp cleanup` removes it.
// Safe to call twice.
func (a *Agent) Close() error {
	if a == nil || a.closed {
		return nil
	}
	a.closed = true
	var errs []error
	for _, l := range a.watches {
		errs = append(errs, l.Close())
	}
	errs = append(errs, a.xn.Close())
	errs = append(errs, a.closeObservation())
	if a.sockops != nil {
		errs = append(errs, a.sockops.Close())
	}
	if a.sockopt != nil {
		errs = append(errs, a.sockopt.Close())
	}
	if a.skmsg != nil {
		errs = append(errs, a.skmsg.Close())
	}
	errs = append(errs, a.objs.Close())
	if a.lock != nil {
		errs = append(errs, a.lock.Close())
	}
	return errors.Join(errs...)
}

// Uninstall stops accelerating new connections and removes every pin.
// Open accelerated connections keep working until they close (the kernel
// keeps their maps and program alive); nothing is deleted from the SOCKHASH.
// It returns how many accelerated sockets were still open.
func (a *Agent) Uninstall() (openSockets uint64, err error) {
	if a == nil || a.closed {
		return 0, nil
	}
	if st, err := a.Stats(); err == nil {
		openSockets = st.AcceleratedSockets
	}
	var errs []error
	if a.xn != nil {
		errs = append(errs, a.xn.Uninstall())
	}
	if _, err := crossnode.Cleanup(a.cfg.PinDir); err != nil {
		errs = append(errs, err)
	}
	// New sockets first: no socket joins the hash after this.
	if a.sockops != nil {
		errs = append(errs, a.sockops.Unpin(), a.sockops.Close())
		a.sockops = nil
	}
	if a.sockopt != nil {
		errs = append(errs, a.sockopt.Unpin(), a.sockopt.Close())
		a.sockopt = nil
	}
	if a.skmsg != nil {
		errs = append(errs, a.skmsg.Unpin(), a.skmsg.Close())
		a.skmsg = nil
	}
	for _, l := range a.obs {
		errs = append(errs, l.Unpin(), l.Close())
	}
	a.obs = nil
	// Links an earlier agent pinned that this one did not take over.
	for _, name := range linkPins {
		if err := os.Remove(filepath.Join(a.cfg.PinDir, name)); err != nil && !errors.Is(err, os.ErrNotExist) {
			errs = append(errs, fmt.Errorf("unpin %s: %w", name, err))
		}
	}
	errs = append(errs, unpinMaps(a.cfg.PinDir))
	// The directory goes while this agent still holds it (Close unlocks).
	errs = append(errs, removePinDir(a.cfg.PinDir))
	errs = append(errs, a.Close())
	a.logger.Info("acceleration uninstalled", "pin_dir", a.cfg.PinDir, "open_accelerated_sockets", openSockets)
	return openSockets, errors.Join(errs...)
}

// unpinMaps removes the pins of every map the object pins by name.
func unpinMaps(pinDir string) error {
	var errs []error
	for _, name := range mapNames() {
		if err := os.Remove(filepath.Join(pinDir, name)); err != nil && !errors.Is(err, os.ErrNotExist) {
			errs = append(errs, fmt.Errorf("unpin %s: %w", name, err))
		}
	}
	return errors.Join(errs...)
}

// removePinDir removes dir if it holds nothing but what meshwarp pins.
func removePinDir(dir string) error {
	if err := os.Remove(dir); err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("remove %s: %w", dir, err)
	}
	return nil
}

// CleanupResult says what Cleanup removed.
type CleanupResult struct {
	Removed                []string `json:"removed"`
	OpenAcceleratedSockets uint64   `json:"open_accelerated_sockets"`
}

// Cleanup removes whatever an agent pinned at pinDir (detaching its
// programs); it refuses while an agent runs there. Open accelerated connections keep
// working until they close. Only names meshwarp pins are removed; a missing
// pin directory is not an error.
func Cleanup(pinDir string) (CleanupResult, error) {
	var res CleanupResult
	if pinDir == "" {
		pinDir = DefaultPinDir
	}
	if _, err := os.Stat(pinDir); errors.Is(err, os.ErrNotExist) {
		return res, nil
	}
	// A live agent's open links keep its programs attached whatever is
	// unpinned; stopping it is what detaches them.
	if busy, pid := pinDirLocked(pinDir); busy {
		if pid == "" {
			pid = "unknown"
		}
		return res, fmt.Errorf("%w: %s (pid %s): stop it instead (SIGTERM; it uninstalls on exit); cleanup removes what a killed agent or --keep-on-exit left", ErrPinDirBusy, pinDir, pid)
	}
	if st, err := ReadPinnedStats(pinDir); err == nil {
		res.OpenAcceleratedSockets = st.AcceleratedSockets
	}
	var errs []error
	removed, err := crossnode.Cleanup(pinDir)
	res.Removed = append(res.Removed, removed...)
	errs = append(errs, err)
	// Links first (they detach when their last reference goes), then maps.
	names := append(append([]string(nil), linkPins...), mapNames()...)
	for _, name := range names {
		p := filepath.Join(pinDir, name)
		if _, err := os.Lstat(p); err != nil {
			continue
		}
		if err := os.Remove(p); err != nil {
			errs = append(errs, fmt.Errorf("unpin %s: %w", p, err))
			continue
		}
		res.Removed = append(res.Removed, p)
	}
	if left := pinnedNames(pinDir); len(left) > 0 {
		errs = append(errs, fmt.Errorf("%s still holds objects meshwarp did not pin (%d); left it in place", pinDir, len(left)))
	} else if err := removePinDir(pinDir); err != nil {
		errs = append(errs, err)
	} else {
		res.Removed = append(res.Removed, pinDir)
	}
	return res, errors.Join(errs...)
}

// Spec is the acceleration object as built (bpf/accel/accel.bpf.c), before
// the loader's settings: what it needs from the kernel.
func Spec() (*ebpf.CollectionSpec, error) { return loadAccel() }

// retiredMapNames are maps that earlier builds pinned and this one no
// longer has: an upgrade adopts the rest, uninstall and cleanup remove these too.
var retiredMapNames = []string{"mw_syn_hint", "mw_splice_procs", "mw_splice_lport", "mw_splice_rport"}

// mapNames lists every map name meshwarp pins or pinned.
func mapNames() []string {
	spec, err := loadAccel()
	if err != nil {
		return nil
	}
	names := append(make([]string, 0, len(spec.Maps)+len(retiredMapNames)), retiredMapNames...)
	for name, m := range spec.Maps {
		if m.Pinning == ebpf.PinByName {
			names = append(names, name)
		}
	}
	return names
}

// attachObservation attaches (or adopts) the observation's programs when
// cfg.Observe, and detaches an earlier agent's otherwise.
func (a *Agent) attachObservation() error {
	cgroup := func(prog *ebpf.Program, attach ebpf.AttachType) func() (link.Link, error) {
		return func() (link.Link, error) {
			return link.AttachCgroup(link.CgroupOptions{Path: a.cfg.CgroupPath, Attach: attach, Program: prog})
		}
	}
	sameCg := func(l link.Link) error { return sameCgroup(l, a.cfg.CgroupPath) }
	progs := []struct {
		pin    string
		prog   *ebpf.Program
		attach func() (link.Link, error)
		check  func(link.Link) error
	}{
		{obsEgressPin, a.objs.MwObsEgress, cgroup(a.objs.MwObsEgress, ebpf.AttachCGroupInetEgress), sameCg},
		{obsIngressPin, a.objs.MwObsIngress, cgroup(a.objs.MwObsIngress, ebpf.AttachCGroupInetIngress), sameCg},
		{obsRecvPin, a.objs.MwObsRecv, func() (link.Link, error) {
			return link.AttachTracing(link.TracingOptions{Program: a.objs.MwObsRecv})
		}, nil},
	}
	for _, p := range progs {
		pin := filepath.Join(a.cfg.PinDir, p.pin)
		if !a.cfg.Observe || (p.pin == obsRecvPin && !a.cfg.ObserveReads) {
			if err := os.Remove(pin); err != nil && !errors.Is(err, os.ErrNotExist) {
				return fmt.Errorf("detach observation (%s): %w", pin, err)
			}
			continue
		}
		if p.pin == obsRecvPin && a.readsOff != nil {
			a.logger.Warn("observation without the client read time: no tracepoint sock:sock_recv_length here (Linux 6.3)", "err", a.readsOff)
			continue
		}
		if p.pin == obsRecvPin {
			// A tracing link's program cannot be replaced (BPF_LINK_UPDATE):
			// an earlier agent's link goes and a new one comes. Only reads
			// in between are not seen.
			if err := os.Remove(pin); err != nil && !errors.Is(err, os.ErrNotExist) {
				return fmt.Errorf("replace observation link %s: %w", pin, err)
			}
		}
		l, err := attachOrUpdate(pin, p.prog, p.attach, p.check)
		if err != nil {
			if p.pin == obsRecvPin {
				// Only the client application's own read time is lost (`meshwarp trace`).
				a.logger.Warn("observation without the client read time (tracepoint sock:sock_recv_length)", "err", err)
				continue
			}
			return fmt.Errorf("attach observation to %s: %w", a.cfg.CgroupPath, err)
		}
		a.obs = append(a.obs, l)
	}
	return nil
}

// closeObservation releases this process's handles on the observation links.
func (a *Agent) closeObservation() error {
	var errs []error
	for _, l := range a.obs {
		errs = append(errs, l.Close())
	}
	a.obs = nil
	return errors.Join(errs...)
}
