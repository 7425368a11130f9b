// SPDX-License-Identifier: Apache-2.0

package crossnode

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"net"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/meshwarp/meshwarp/internal/netns"
)

// nodeLoop scans one node namespace. Everything it does runs on one OS
// thread that joined the namespace (ifindexes, netlink, sysctls and the
// rulesets tools are all per namespace); the thread dies with the loop.
type nodeLoop struct {
	a      *Agent
	cfg    Node
	name   string // for logs: the namespace path, or "host"
	cookie uint64
	links  map[uint32]attached // attached by this agent, by ifindex
	// last reasons logged, to log changes only
	lastV4, lastV6 string
}

type attached struct {
	l    link.Link
	prog *ebpf.Program
}

// devices is one scan's view of a node.
type devices struct {
	bridges  map[uint32]netlink.Link
	pods     map[uint32]netlink.Link // veths that are ports of a bridge
	uplinks  map[uint32]netlink.Link
	rpFilter []string // devices the kernel would check the source of (IPv4)
}

func startNode(ctx context.Context, a *Agent, cfg Node) (*nodeLoop, error) {
	n := &nodeLoop{a: a, cfg: cfg, name: cfg.Netns, links: map[uint32]attached{}}
	if n.name == "" {
		n.name = "host"
	}
	first := make(chan error, 1)
	a.wg.Add(1)
	go func() {
		defer a.wg.Done()
		runtime.LockOSThread()
		// No UnlockOSThread: the thread may be in another namespace; it
		// dies with this goroutine.
		if err := n.enter(); err != nil {
			first <- err
			return
		}
		err := n.scan(ctx)
		first <- err
		if err != nil {
			return
		}
		t := time.NewTicker(a.cfg.Interval)
		defer t.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case <-t.C:
				if err := n.scan(ctx); err != nil {
					a.logger.Warn("cross-node scan failed; the last check expires and packets take the normal path", "node", n.name, "err", err)
				}
			}
		}
	}()
	if err := <-first; err != nil {
		return n, fmt.Errorf("cross-node forwarding in %s: %w", n.name, err)
	}
	a.logger.Info("cross-node forwarding attached", "node", n.name, "netns_cookie", n.cookie, "devices", len(n.links))
	return n, nil
}

// enter joins the node's namespace and reads its cookie.
func (n *nodeLoop) enter() error {
	if n.cfg.Netns != "" {
		fd, err := unix.Open(n.cfg.Netns, unix.O_RDONLY|unix.O_CLOEXEC, 0)
		if err != nil {
			return fmt.Errorf("%w: open network namespace %s: %w", ErrBadConfig, n.cfg.Netns, err)
		}
		err = unix.Setns(fd, unix.CLONE_NEWNET)
		unix.Close(fd)
		if err != nil {
			return fmt.Errorf("%w: enter network namespace %s: %w", ErrBadConfig, n.cfg.Netns, err)
		}
	}
	var err error
	n.cookie, err = netns.CurrentCookie()
	return err
}

// scan brings maps and attachments in line with the node's devices and
// rulesets, then renews the node's check.
func (n *nodeLoop) scan(ctx context.Context) error {
	devs, err := n.readDevices()
	if err != nil {
		return err
	}
	if err := n.syncDevices(devs); err != nil {
		return err
	}
	if err := n.syncLinks(devs); err != nil {
		return err
	}
	// The hook lists packets meet now, read before the rulesets: the check
	// below holds for these lists only (packets that meet others pass at
	// once; see nf_hooks_ident). With the hook functions of modules loaded
	// since the last scan, so that the rules behind them count from now.
	if err := n.a.refreshHookFunctions(); err != nil {
		return err
	}
	hooks, err := n.hooksIdent()
	if err != nil {
		return err
	}
	nf := readNetfilter(ctx)
	if len(nf.v4) == 0 {
		nf.v4 = rpFilterBlockers(devs.rpFilter)
	}
	n.logChange(nf)
	var flags uint32
	if len(nf.v4) == 0 {
		flags |= nodeV4
	}
	if len(nf.v6) == 0 {
		flags |= nodeV6
	}
	now, err := monotonicNs()
	if err != nil {
		return err
	}
	until := now + uint64(n.a.VerifiedFor().Nanoseconds())
	return n.a.objs.MwXnNodes.Put(n.cookie, crossnodeMwXnNode{Flags: flags, ValidUntilNs: until, Hooks: hooks})
}

// hooksIdent reads the node's netfilter digest as the programs see it.
func (n *nodeLoop) hooksIdent() ([2]uint32, error) { return netfilterDigest(n.a.objs.MwXnHooks) }

// netfilterDigest runs mw_xn_hooks on a test frame per family, IPv4 and
// IPv6, from the calling thread, whose namespace's loopback device the
// frame gets: the digest (nf_hooks_ident) of that namespace.
func netfilterDigest(prog *ebpf.Program) ([2]uint32, error) {
	var out [2]uint32
	for i, etherType := range []uint16{unix.ETH_P_IP, unix.ETH_P_IPV6} {
		ret, err := prog.Run(&ebpf.RunOptions{Data: digestFrame(etherType)})
		if err != nil {
			return out, fmt.Errorf("read the node's netfilter hooks (BPF_PROG_TEST_RUN): %w", err)
		}
		out[i] = ret
	}
	return out, nil
}

// digestFrame is an Ethernet frame of the given type for mw_xn_hooks.
func digestFrame(etherType uint16) []byte {
	frame := make([]byte, 64)
	frame[12], frame[13] = byte(etherType>>8), byte(etherType)
	return frame
}

func (n *nodeLoop) logChange(nf netfilterState) {
	v4, v6 := strings.Join(nf.v4, "; "), strings.Join(nf.v6, "; ")
	if v4 == n.lastV4 && v6 == n.lastV6 {
		return
	}
	n.lastV4, n.lastV6 = v4, v6
	for _, f := range []struct{ fam, why string }{{"ipv4", v4}, {"ipv6", v6}} {
		if f.why == "" {
			n.a.logger.Info("cross-node redirect on: no netfilter rule where forwarded packets would meet it", "node", n.name, "family", f.fam)
		} else {
			n.a.logger.Warn("cross-node redirect off: forwarded packets must meet the node's rules", "node", n.name, "family", f.fam, "rules", f.why)
		}
	}
}

func (n *nodeLoop) readDevices() (devices, error) {
	d := devices{bridges: map[uint32]netlink.Link{}, pods: map[uint32]netlink.Link{}, uplinks: map[uint32]netlink.Link{}}
	all, err := netlink.LinkList()
	if err != nil {
		return d, fmt.Errorf("list devices: %w", err)
	}
	byName := map[string]netlink.Link{}
	for _, l := range all {
		byName[l.Attrs().Name] = l
		if l.Type() == "bridge" {
			d.bridges[uint32(l.Attrs().Index)] = l
		}
	}
	for _, l := range all {
		if _, ok := d.bridges[uint32(l.Attrs().MasterIndex)]; ok && l.Type() == "veth" {
			d.pods[uint32(l.Attrs().Index)] = l
		}
	}
	if len(n.cfg.Uplinks) > 0 {
		for _, name := range n.cfg.Uplinks {
			l, ok := byName[name]
			if !ok {
				return d, fmt.Errorf("%w: no device %q in %s (see `ip link`)", ErrBadConfig, name, n.name)
			}
			d.uplinks[uint32(l.Attrs().Index)] = l
		}
	} else {
		routes, err := netlink.RouteList(nil, netlink.FAMILY_ALL)
		if err != nil {
			return d, fmt.Errorf("list routes: %w", err)
		}
		for _, r := range routes {
			idx := uint32(r.LinkIndex)
			if r.Gw == nil || idx == 0 {
				continue
			}
			if _, br := d.bridges[idx]; br {
				continue
			}
			if _, pod := d.pods[idx]; pod {
				continue
			}
			for _, l := range all {
				if uint32(l.Attrs().Index) == idx && l.Attrs().Flags&net.FlagLoopback == 0 {
					d.uplinks[idx] = l
				}
			}
		}
	}
	d.rpFilter = []string{"all"}
	for _, m := range []map[uint32]netlink.Link{d.bridges, d.uplinks} {
		for _, l := range m {
			d.rpFilter = append(d.rpFilter, l.Attrs().Name)
		}
	}
	return d, nil
}

// rpFilterBlockers: the kernel checks an IPv4 packet's source against the
// routes (rp_filter, the larger of "all" and the input device's) before it
// forwards; the FIB lookup does not, so IPv4 stays on the normal path there.
func rpFilterBlockers(devs []string) []string {
	var out []string
	for _, dev := range devs {
		b, err := os.ReadFile(filepath.Join("/proc/sys/net/ipv4/conf", dev, "rp_filter"))
		if err != nil {
			continue
		}
		if v := strings.TrimSpace(string(b)); v != "0" {
			out = append(out, fmt.Sprintf("net.ipv4.conf.%s.rp_filter=%s", dev, v))
		}
	}
	return out
}

func macOf(l netlink.Link) [6]uint8 {
	var m [6]uint8
	copy(m[:], l.Attrs().HardwareAddr)
	return m
}

// syncDevices writes the node's devices to mw_xn_devs and deletes what is
// gone, with the MACs learned on ports that are gone.
func (n *nodeLoop) syncDevices(d devices) error {
	want := map[crossnodeMwXnDevKey]crossnodeMwXnDev{}
	key := func(l netlink.Link) crossnodeMwXnDevKey {
		return crossnodeMwXnDevKey{NetnsCookie: n.cookie, Ifindex: uint32(l.Attrs().Index)}
	}
	for _, l := range d.bridges {
		want[key(l)] = crossnodeMwXnDev{Kind: uint32(crossnodeMwXnKindMW_XN_KIND_BRIDGE), Mac: macOf(l)}
	}
	for _, l := range d.uplinks {
		want[key(l)] = crossnodeMwXnDev{Kind: uint32(crossnodeMwXnKindMW_XN_KIND_UPLINK), Mac: macOf(l)}
	}
	for _, l := range d.pods {
		br := d.bridges[uint32(l.Attrs().MasterIndex)]
		want[key(l)] = crossnodeMwXnDev{Kind: uint32(crossnodeMwXnKindMW_XN_KIND_POD), L3Ifindex: uint32(br.Attrs().Index), Mac: macOf(br)}
	}
	all := maps.Clone(want)
	m := n.a.objs.MwXnDevs
	var k crossnodeMwXnDevKey
	var v crossnodeMwXnDev
	var stale []crossnodeMwXnDevKey
	for it := m.Iterate(); it.Next(&k, &v); {
		if k.NetnsCookie != n.cookie {
			continue
		}
		if w, ok := want[k]; !ok {
			stale = append(stale, k)
		} else if w == v {
			delete(want, k)
		}
	}
	for k, v := range want {
		if err := m.Put(k, v); err != nil {
			return fmt.Errorf("write mw_xn_devs: %w", err)
		}
	}
	if err := n.syncDevSlots(all, stale); err != nil {
		return err
	}
	for _, k := range stale {
		if err := m.Delete(k); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
			return fmt.Errorf("delete from mw_xn_devs: %w", err)
		}
	}
	var mk crossnodeMwXnMacKey
	var port uint32
	var gone []crossnodeMwXnMacKey
	for it := n.a.objs.MwXnMacs.Iterate(); it.Next(&mk, &port); {
		if _, ok := d.pods[port]; mk.NetnsCookie == n.cookie && !ok {
			gone = append(gone, mk)
		}
	}
	for _, k := range gone {
		_ = n.a.objs.MwXnMacs.Delete(k)
	}
	return nil
}

// syncDevSlots puts the node's devices (all of them, as in mw_xn_devs) in
// their slots of mw_xn_dev_slots, where the programs look first, and empties
// the slots of its devices that are gone. A slot that holds another node's
// device stays that node's: this one is found in mw_xn_devs.
func (n *nodeLoop) syncDevSlots(all map[crossnodeMwXnDevKey]crossnodeMwXnDev, gone []crossnodeMwXnDevKey) error {
	slots := n.a.objs.MwXnDevSlots
	count := slots.MaxEntries()
	n.a.slotMu.Lock() // node loops share the array
	defer n.a.slotMu.Unlock()
	for _, k := range gone {
		var cur crossnodeMwXnDevSlot
		idx := k.Ifindex % count
		if err := slots.Lookup(idx, &cur); err != nil {
			return fmt.Errorf("read mw_xn_dev_slots: %w", err)
		}
		if cur.Key == k {
			if err := slots.Put(idx, crossnodeMwXnDevSlot{}); err != nil {
				return fmt.Errorf("write mw_xn_dev_slots: %w", err)
			}
		}
	}
	for k, dev := range all {
		var cur crossnodeMwXnDevSlot
		idx := k.Ifindex % count
		if err := slots.Lookup(idx, &cur); err != nil {
			return fmt.Errorf("read mw_xn_dev_slots: %w", err)
		}
		want := crossnodeMwXnDevSlot{Key: k, Dev: dev}
		// Empty, or this node's device that is gone: ours to take. Another
		// device of this node that is still there keeps it (no churn).
		_, wanted := all[cur.Key]
		free := cur.Key.Ifindex == 0 || cur.Key.NetnsCookie == n.cookie && !wanted
		if cur == want || cur.Key != k && !free {
			continue
		}
		if err := slots.Put(idx, want); err != nil {
			return fmt.Errorf("write mw_xn_dev_slots: %w", err)
		}
	}
	return nil
}

func (n *nodeLoop) pinPath(ifindex uint32) string {
	return filepath.Join(n.a.cfg.PinDir, fmt.Sprintf("%s%d_%d", linkPinPrefix, n.cookie, ifindex))
}

// syncLinks attaches the programs to new devices (adopting links pinned by
// an earlier agent, with this build's program) and detaches from devices
// that are no longer pod ports or uplinks.
func (n *nodeLoop) syncLinks(d devices) error {
	want := map[uint32]*ebpf.Program{}
	for idx := range d.pods {
		want[idx] = n.a.objs.MwXnFromPod
	}
	for idx := range d.uplinks {
		want[idx] = n.a.objs.MwXnFromWire
	}
	// Pins of this node for devices we do not want (gone, or changed role).
	prefix := fmt.Sprintf("%s%d_", linkPinPrefix, n.cookie)
	entries, _ := os.ReadDir(n.a.cfg.PinDir)
	for _, e := range entries {
		rest, ok := strings.CutPrefix(e.Name(), prefix)
		if !ok {
			continue
		}
		idx, err := strconv.ParseUint(rest, 10, 32)
		if err != nil {
			continue
		}
		if _, ok := want[uint32(idx)]; !ok {
			n.detach(uint32(idx))
		}
	}
	for idx := range n.links {
		if _, ok := want[idx]; !ok {
			n.detach(idx)
		}
	}
	for _, idx := range slices.Sorted(maps.Keys(want)) {
		prog := want[idx]
		if at, ok := n.links[idx]; ok {
			if at.prog == prog {
				continue
			}
			// The device changed role between scans.
			if err := at.l.Update(prog); err == nil {
				n.links[idx] = attached{at.l, prog}
				continue
			}
			n.detach(idx)
		}
		l, err := n.attach(idx, prog)
		if err != nil {
			if _, gone := netlink.LinkByIndex(int(idx)); gone != nil {
				continue // removed meanwhile
			}
			return err
		}
		n.links[idx] = attached{l, prog}
	}
	return nil
}

// attach adopts the pinned link of a device or attaches a new one.
func (n *nodeLoop) attach(idx uint32, prog *ebpf.Program) (link.Link, error) {
	pin := n.pinPath(idx)
	if _, err := os.Stat(pin); err == nil {
		if l, err := link.LoadPinnedLink(pin, nil); err == nil {
			info, ierr := l.Info()
			if ierr == nil && info.TCX() != nil && info.TCX().Ifindex == idx && l.Update(prog) == nil {
				return l, nil
			}
			l.Close()
		}
		// Defunct (its device was replaced) or not ours to update: replace it.
		os.Remove(pin)
	}
	l, err := link.AttachTCX(link.TCXOptions{Interface: int(idx), Program: prog, Attach: ebpf.AttachTCXIngress})
	if err != nil {
		return nil, fmt.Errorf("attach %s to ifindex %d (tcx ingress): %w", prog, idx, err)
	}
	if err := l.Pin(pin); err != nil {
		l.Close()
		return nil, fmt.Errorf("pin %s: %w", pin, err)
	}
	return l, nil
}

// detach removes a device's link (and its pin).
func (n *nodeLoop) detach(idx uint32) {
	if at, ok := n.links[idx]; ok {
		_ = at.l.Unpin()
		_ = at.l.Close()
		delete(n.links, idx)
	}
	_ = os.Remove(n.pinPath(idx))
}

// detachAll removes every link of this node (uninstall, failed start).
func (n *nodeLoop) detachAll() {
	for idx := range n.links {
		n.detach(idx)
	}
	prefix := fmt.Sprintf("%s%d_", linkPinPrefix, n.cookie)
	entries, _ := os.ReadDir(n.a.cfg.PinDir)
	for _, e := range entries {
		if strings.HasPrefix(e.Name(), prefix) {
			_ = os.Remove(filepath.Join(n.a.cfg.PinDir, e.Name()))
		}
	}
}

// closeLinks releases this process's handles; the pins keep the links.
func (n *nodeLoop) closeLinks() error {
	var errs []error
	for idx, at := range n.links {
		errs = append(errs, at.l.Close())
		delete(n.links, idx)
	}
	return errors.Join(errs...)
}
