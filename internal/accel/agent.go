// SPDX-License-Identifier: Apache-2.0

// Package accel loads, attaches and pins the acceleration programs
// (sock_ops + sk_msg + SOCKMAP, bpf/accel/accel.bpf.c), turns policy into
// maps, and owns the lifecycle: adopt pinned state on restart, replace
// programs atomically on upgrade, uninstall without touching live sockets.
//
// Lifecycle facts this package is built around:
//   - Deleting a socket from the SOCKMAP can discard bytes queued for it, so
//     only sock_ops deletes one, and only when nothing redirected to it can be
//     lost (bpf/accel/pairing.h, leave.h); this package never deletes
//     entries, and the kernel removes the other sockets when they close.
//   - A socket in the SOCKMAP keeps its own reference to the sk_msg program,
//     which keeps the maps alive. Detaching and unpinning therefore stop only
//     new connections; open accelerated connections keep working until they close.
package accel

import (
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"github.com/cilium/ebpf/rlimit"
	"golang.org/x/sys/unix"

	"github.com/meshwarp/meshwarp/internal/crossnode"
	"github.com/meshwarp/meshwarp/internal/probe"
)

// Agent is an attached acceleration data path.
type Agent struct {
	cfg     Config
	logger  *slog.Logger
	objs    accelObjects
	sockops link.Link
	// hooks are the cgroup hooks beside sock_ops (cgroupHooks), pinned.
	hooks []link.Link
	skmsg link.Link
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
	specs, err := assignSpecs(spec)
	if err != nil {
		return nil, err
	}
	specs.MwSockMap.MaxEntries = 2 * cfg.SockhashCapacity // two sockets per mw_conns slot
	specs.MwConns.MaxEntries = cfg.SockhashCapacity
	specs.MwLeavePolls.MaxEntries = cfg.SockhashCapacity
	obs, err := obsConstants(&specs.accelVariableSpecs, cfg)
	if err != nil {
		return nil, err
	}
	// This load's programs take the pinned leave timer over at their first pairing (bpf/accel/leave.h).
	owner := constant{specs.LeaveClockOwner, uint64(time.Now().UnixNano())}
	if err := setConstants(append(dataPathConstants(&specs.accelVariableSpecs, cfg), append(obs, owner)...)...); err != nil {
		return nil, err
	}
	if rerr := probe.HaveRecvTracepoint(); rerr != nil {
		// tp_btf programs load only with their target (sock:sock_recv_length,
		// Linux 6.3): a stand-in keeps the object loadable, and the client
		// read time is off (probe.FeatureClientRead).
		a.readsOff = rerr
		spec.Programs[accelProgMwObsRecv] = standInProgram(accelProgMwObsRecv)
	}
	// Everything but the tap, which `meshwarp tap` loads while it runs (LoadTap).
	opts := &ebpf.CollectionOptions{Maps: ebpf.MapOptions{PinPath: cfg.PinDir}}
	if err := loadObjects(spec, &a.objs, opts, func(name string) bool { return !slices.Contains(tapOnly, name) }); err != nil {
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
			Target:  a.objs.MwSockMap.FD(),
			Program: a.objs.MwSkmsg,
			Attach:  ebpf.AttachSkMsgVerdict,
		}); err != nil {
			return nil, fmt.Errorf("attach sk_msg to mw_sock_map (BPF_PROG_ATTACH): %w", err)
		}
	} else {
		a.skmsg, err = attachOrUpdate(filepath.Join(cfg.PinDir, SkmsgLinkPin), a.objs.MwSkmsg, func() (link.Link, error) {
			return link.AttachRawLink(link.RawLinkOptions{
				Target:  a.objs.MwSockMap.FD(),
				Program: a.objs.MwSkmsg,
				Attach:  ebpf.AttachSkMsgVerdict,
			})
		}, nil)
		if err != nil {
			return nil, fmt.Errorf("attach sk_msg to mw_sock_map: %w", err)
		}
		skmsg := a.skmsg
		undo = append(undo, func() { skmsg.Close() })
	}

	// Before sock_ops: a connect it notes must find its SYN seen (hints.h).
	for _, h := range cgroupHooks(&a.objs, cfg.Observe) {
		l, err := attachOrUpdate(filepath.Join(cfg.PinDir, h.pin), h.prog, func() (link.Link, error) {
			return link.AttachCgroup(link.CgroupOptions{Path: cfg.CgroupPath, Attach: h.attach, Program: h.prog})
		}, func(l link.Link) error { return sameCgroup(l, cfg.CgroupPath) })
		if err != nil {
			return nil, fmt.Errorf("attach %s to %s: %w", h.what, cfg.CgroupPath, err)
		}
		a.hooks = append(a.hooks, l)
		undo = append(undo, func() { l.Close() })
	}

	a.sockops, err = attachOrUpdate(filepath.Join(cfg.PinDir, SockopsLinkPin), a.objs.MwSockops, func() (link.Link, error) {
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

// Spec is the acceleration object as built (bpf/accel/accel.bpf.c), before
// the loader's settings: what it needs from the kernel.
func Spec() (*ebpf.CollectionSpec, error) { return loadAccel() }
