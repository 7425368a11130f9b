// SPDX-License-Identifier: Apache-2.0

// Package crossnode forwards pod packets between nodes past the node's
// bridge, netfilter and routing code (bpf/crossnode/crossnode.bpf.c): tcx
// programs on the pod-facing bridge ports and on the uplinks of each node
// namespace, the FIB deciding where a packet goes as the kernel would.
//
// The agent keeps what the programs rely on true: which devices are pod
// ports, bridges and uplinks (scanned every Interval, programs attached to
// new devices), and whether the node's netfilter rulesets leave forwarded
// packets alone (a family with rules where forwarded packets would meet
// them is not redirected). Its word expires after VerifiedFor: a stopped or
// killed agent stops the redirect (packets take the normal path), and a
// restarted one adopts the pinned programs and resumes it.
package crossnode

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"github.com/cilium/ebpf"
)

// Defaults.
const (
	DefaultInterval = time.Second
	// verifiedIntervals: how many scan intervals the agent's last check of a
	// node stays valid for the programs.
	verifiedIntervals = 3
)

// Node is one node network namespace to forward in.
type Node struct {
	// Netns is the path of the node's network namespace (/run/netns/NAME,
	// /proc/PID/ns/net); empty means the agent's own.
	Netns string
	// Uplinks name the devices towards other nodes; empty means every
	// device that carries a route through a gateway (that is not a bridge
	// or a pod port).
	Uplinks []string
}

// Config selects the nodes.
type Config struct {
	PinDir   string // the agent's pin directory (required)
	Nodes    []Node
	Interval time.Duration // 0 means DefaultInterval
}

// ErrBadConfig marks a configuration error.
var ErrBadConfig = errors.New("bad cross-node configuration")

// Agent runs the scans of every node.
type Agent struct {
	cfg    Config
	logger *slog.Logger
	objs   crossnodeObjects
	cancel context.CancelFunc
	wg     sync.WaitGroup
	nodes  []*nodeLoop
	closed bool
	// The modules the hook functions were last read with (refreshHookFunctions).
	hookMu      sync.Mutex
	hookModules string
	slotMu      sync.Mutex // mw_xn_dev_slots, shared by the node loops
}

// linkPinPrefix names the pinned tcx links: mw_xn_link_<netns cookie>_<ifindex>.
const linkPinPrefix = "mw_xn_link_"

// Start loads the programs (adopting pinned maps and links of an earlier
// agent), scans every node once, attaching to its devices, and keeps
// scanning until Close. On error nothing this call attached is left.
func Start(cfg Config, logger *slog.Logger) (_ *Agent, err error) {
	if cfg.PinDir == "" {
		return nil, fmt.Errorf("%w: no pin directory", ErrBadConfig)
	}
	if len(cfg.Nodes) == 0 {
		cfg.Nodes = []Node{{}}
	}
	if cfg.Interval <= 0 {
		cfg.Interval = DefaultInterval
	}
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}
	logger = logger.With("subsys", "crossnode")
	spec, err := loadCrossnode()
	if err != nil {
		return nil, fmt.Errorf("load cross-node spec: %w", err)
	}
	a := &Agent{cfg: cfg, logger: logger}
	if err := spec.LoadAndAssign(&a.objs, &ebpf.CollectionOptions{Maps: ebpf.MapOptions{PinPath: cfg.PinDir}}); err != nil {
		return nil, fmt.Errorf("load cross-node programs: %w", err)
	}
	defer func() {
		if err != nil {
			a.stop()
			for _, n := range a.nodes {
				n.detachAll()
			}
			a.objs.Close()
		}
	}()
	if err := a.refreshHookFunctions(); err != nil {
		return nil, err
	}
	ctx, cancel := context.WithCancel(context.Background())
	a.cancel = cancel
	seen := map[uint64]string{}
	for _, nc := range cfg.Nodes {
		n, err := startNode(ctx, a, nc)
		// Kept also on error: a first scan that failed half-way may have
		// attached some devices, which the deferred cleanup detaches.
		a.nodes = append(a.nodes, n)
		if err != nil {
			return nil, err
		}
		if other, dup := seen[n.cookie]; dup {
			return nil, fmt.Errorf("%w: %s and %s are the same network namespace", ErrBadConfig, other, n.name)
		}
		seen[n.cookie] = n.name
	}
	return a, nil
}

func (a *Agent) stop() {
	if a.cancel != nil {
		a.cancel()
	}
	a.wg.Wait()
}

// Close stops scanning and releases this process's handles. The programs
// stay attached and pinned; they redirect until the last check expires
// (VerifiedFor), then pass everything until an agent checks again.
func (a *Agent) Close() error {
	if a == nil || a.closed {
		return nil
	}
	a.closed = true
	a.stop()
	var errs []error
	for _, n := range a.nodes {
		errs = append(errs, n.closeLinks())
	}
	errs = append(errs, a.objs.Close())
	return errors.Join(errs...)
}

// Uninstall detaches every program and removes every pin.
func (a *Agent) Uninstall() error {
	if a == nil || a.closed {
		return nil
	}
	a.stop()
	var errs []error
	for _, n := range a.nodes {
		n.detachAll()
	}
	errs = append(errs, a.Close())
	_, err := Cleanup(a.cfg.PinDir)
	errs = append(errs, err)
	a.logger.Info("cross-node forwarding uninstalled", "pin_dir", a.cfg.PinDir)
	return errors.Join(errs...)
}

// VerifiedFor is how long the programs trust an agent's last check.
func (a *Agent) VerifiedFor() time.Duration { return verifiedIntervals * a.cfg.Interval }

// Cleanup removes every pin of cross-node forwarding under pinDir (which
// detaches its programs), without a running agent. It returns what it
// removed.
func Cleanup(pinDir string) ([]string, error) {
	entries, err := os.ReadDir(pinDir)
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	names := mapNames()
	var removed []string
	var errs []error
	// Links first (they detach when their last reference goes), then maps.
	for _, links := range []bool{true, false} {
		for _, e := range entries {
			if strings.HasPrefix(e.Name(), linkPinPrefix) != links || (!links && !names[e.Name()]) {
				continue
			}
			p := filepath.Join(pinDir, e.Name())
			if err := os.Remove(p); err != nil && !errors.Is(err, os.ErrNotExist) {
				errs = append(errs, fmt.Errorf("unpin %s: %w", p, err))
				continue
			}
			removed = append(removed, p)
		}
	}
	return removed, errors.Join(errs...)
}

// mapNames are the maps the object pins.
func mapNames() map[string]bool {
	spec, err := loadCrossnode()
	if err != nil {
		return nil
	}
	out := map[string]bool{}
	for name, m := range spec.Maps {
		if m.Pinning == ebpf.PinByName {
			out[name] = true
		}
	}
	return out
}

// IsPinName reports whether a name in the pin directory is one cross-node
// forwarding pins.
func IsPinName(name string) bool {
	return strings.HasPrefix(name, linkPinPrefix) || mapNames()[name]
}

// Spec is the object as built, before loading (what it needs from the kernel).
func Spec() (*ebpf.CollectionSpec, error) { return loadCrossnode() }
