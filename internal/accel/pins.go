// SPDX-License-Identifier: Apache-2.0

package accel

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"golang.org/x/sys/unix"

	"github.com/meshwarp/meshwarp/internal/probe"
)

// What survives a restart is pinned under the pin directory: each map by
// its BPF name (the generated specs name them: mapPin), each link by one of
// the names below, defined here only.

// DefaultPinDir is where the agent pins what must survive a restart.
const DefaultPinDir = "/sys/fs/bpf/meshwarp"

// Names of the pinned links under the pin directory.
const (
	SockopsLinkPin = "mw_sockops_link"  // mw_sockops on the cgroup
	SockoptLinkPin = "mw_sockopt_link"  // mw_setsockopt on the cgroup
	EgressLinkPin  = "mw_fin_link"      // mw_egress(_obs) on the cgroup (named for the FIN order, its first job)
	IngressLinkPin = "mw_syn_link"      // mw_ingress(_obs) on the cgroup (named for the SYN notes, its first job)
	ProgLinkPin    = "mw_prog_link"     // mw_sock_create on the cgroup
	Bind4LinkPin   = "mw_bind4_link"    // mw_post_bind4 on the cgroup
	Bind6LinkPin   = "mw_bind6_link"    // mw_post_bind6 on the cgroup
	SkmsgLinkPin   = "mw_skmsg_link"    // mw_skmsg on mw_sock_map (mw_skmsg_tap while a tap runs)
	ObsRecvLinkPin = "mw_obs_recv_link" // mw_obs_recv (Config.ObserveReads)
)

// retiredLinkPins are links of earlier agents that this one no longer
// makes: each cgroup_skb direction had a program of observation beside the
// data path's, now one program (mw_egress_obs, mw_ingress_obs). Removed at
// start, after the links above took over their work.
var retiredLinkPins = []string{"mw_obs_egress_link", "mw_obs_ingress_link"}

// linkPins are every link meshwarp pins, in the order they are removed.
var linkPins = append([]string{SockopsLinkPin, SockoptLinkPin, EgressLinkPin, IngressLinkPin, ProgLinkPin, Bind4LinkPin, Bind6LinkPin, SkmsgLinkPin, ObsRecvLinkPin}, retiredLinkPins...)

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

// retiredMapNames are maps that earlier builds pinned and this one no
// longer has: an upgrade adopts the rest, uninstall and cleanup remove these too.
var retiredMapNames = []string{"mw_syn_hint", "mw_splice_procs", "mw_splice_lport", "mw_splice_rport", "mw_obs_store", "mw_sock_hash", "mw_connecting", "mw_unhinted"}

// mapNames lists every map name meshwarp pins or pinned.
func mapNames() []string {
	spec, err := objectSpec()
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

// cgroupHook is a program the agent attaches to its cgroup beside mw_sockops.
type cgroupHook struct {
	pin    string
	prog   *ebpf.Program
	attach ebpf.AttachType
	what   string
}

// cgroupHooks are the cgroup hooks of the data path, in attach order: the
// program of each new socket, recorded before sock_ops reads it, and the
// SYN notes before any socket may need them (bpf/accel/learning.h,
// hints.h), setsockopt learning (learning.h), the FIN order (fin_order.h).
// With observe, the segments' observation runs in the cgroup_skb programs
// (their _obs variants: one program per packet each way, not two).
func cgroupHooks(o *accelObjects, observe bool) []cgroupHook {
	ingress, egress, seen := o.MwIngress, o.MwEgress, ""
	if observe {
		ingress, egress, seen = o.MwIngressObs, o.MwEgressObs, ", observation"
	}
	return []cgroupHook{
		{ProgLinkPin, o.MwSockCreate, ebpf.AttachCGroupInetSockCreate, "cgroup sock_create (socket programs)"},
		{Bind4LinkPin, o.MwPostBind4, ebpf.AttachCGroupInet4PostBind, "cgroup post_bind4 (socket programs)"},
		{Bind6LinkPin, o.MwPostBind6, ebpf.AttachCGroupInet6PostBind, "cgroup post_bind6 (socket programs)"},
		{IngressLinkPin, ingress, ebpf.AttachCGroupInetIngress, "cgroup ingress (SYN notes" + seen + ")"},
		{SockoptLinkPin, o.MwSetsockopt, ebpf.AttachCGroupSetsockopt, "cgroup setsockopt"},
		{EgressLinkPin, egress, ebpf.AttachCGroupInetEgress, "cgroup egress (FIN order" + seen + ")"},
	}
}

// Observing says whether the agent pinned at pinDir observes: its egress
// link runs mw_egress_obs.
func Observing(pinDir string) (bool, error) {
	l, err := link.LoadPinnedLink(filepath.Join(pinDir, EgressLinkPin), nil)
	if err != nil {
		return false, err
	}
	defer l.Close()
	info, err := l.Info()
	if err != nil {
		return false, err
	}
	p, err := ebpf.NewProgramFromID(info.Program)
	if err != nil {
		return false, err
	}
	defer p.Close()
	pi, err := p.Info()
	if err != nil {
		return false, err
	}
	return pi.Name == accelProgMwEgressObs, nil
}
