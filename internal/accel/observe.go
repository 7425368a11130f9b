// SPDX-License-Identifier: Apache-2.0

package accel

import (
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"github.com/meshwarp/meshwarp/internal/probe"
)

// ReadObserverProgram is the program of the client read tracepoint
// (Config.ObserveReads): not attached by `run`, only by `trace` while it samples.
const ReadObserverProgram = accelProgMwObsRecv

// SockOpsProgram is the sock_ops program: it runs per connection event
// (connect, established, state changes, packets of sockets in the SOCKMAP).
const SockOpsProgram = accelProgMwSockops

// attachObservation attaches the client read tracepoint when
// cfg.Observe and cfg.ObserveReads, and detaches an earlier agent's
// otherwise. The segments' observation runs in the cgroup_skb programs
// (cgroupHooks), attached before this: an earlier agent's links of it go
// here (retiredLinkPins).
func (a *Agent) attachObservation() error {
	for _, name := range retiredLinkPins {
		if err := os.Remove(filepath.Join(a.cfg.PinDir, name)); err != nil && !errors.Is(err, os.ErrNotExist) {
			return fmt.Errorf("detach an earlier agent's observation (%s): %w", name, err)
		}
	}
	// A tracing link's program cannot be replaced (BPF_LINK_UPDATE): an
	// earlier agent's link goes and a new one comes. Only reads in between
	// are not seen.
	pin := filepath.Join(a.cfg.PinDir, ObsRecvLinkPin)
	if err := os.Remove(pin); err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("detach observation (%s): %w", pin, err)
	}
	if !a.cfg.Observe || !a.cfg.ObserveReads {
		return nil
	}
	if a.readsOff != nil {
		a.logger.Warn("observation without the client read time: no tracepoint sock:sock_recv_length here (Linux 6.3)", "err", a.readsOff)
		return nil
	}
	l, err := attachOrUpdate(pin, a.objs.MwObsRecv, func() (link.Link, error) {
		return link.AttachTracing(link.TracingOptions{Program: a.objs.MwObsRecv})
	}, nil)
	if err != nil {
		// Only the client application's own read time is lost (`meshwarp trace`).
		a.logger.Warn("observation without the client read time (tracepoint sock:sock_recv_length)", "err", err)
		return nil
	}
	a.obs = append(a.obs, l)
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

// obsConstants are the observation's load-time settings.
func obsConstants(v *accelVariableSpecs, cfg Config) ([]constant, error) {
	if len(ObsBucketBounds) != len(accelMwFlow{}.Buckets)-1 {
		return nil, errors.New("ObsBucketBounds does not match MW_OBS_BUCKETS")
	}
	var bounds [len(accelMwFlow{}.Buckets) - 1]uint64
	for i, d := range ObsBucketBounds {
		bounds[i] = uint64(d.Nanoseconds())
	}
	return []constant{
		{v.Observe, boolU32(cfg.Observe)},
		{v.Accelerate, boolU32(!cfg.ObserveOnly)},
		{v.ObsBoundsNs, bounds},
	}, nil
}

func boolU32(b bool) uint32 {
	if b {
		return 1
	}
	return 0
}

// TraceReads attaches the observation of client applications' reads
// (mw_obs_recv, the point client_app) against the maps of the agent pinned
// at pinDir, until the returned closer is closed or the process exits (the
// link is not pinned). `meshwarp trace` uses it while it samples.
func TraceReads(pinDir string) (io.Closer, error) {
	if pinDir == "" {
		pinDir = DefaultPinDir
	}
	if err := probe.HaveRecvTracepoint(); err != nil {
		return nil, fmt.Errorf("off on this kernel (%s needs tracepoint sock:sock_recv_length, Linux 6.3): %w", probe.FeatureClientRead, err)
	}
	spec, err := loadAccel()
	if err != nil {
		return nil, err
	}
	specs, err := assignSpecs(spec)
	if err != nil {
		return nil, err
	}
	consts, err := obsConstants(&specs.accelVariableSpecs, Config{Observe: true})
	if err != nil {
		return nil, err
	}
	if err := setConstants(consts...); err != nil {
		return nil, err
	}
	replace := map[string]*ebpf.Map{}
	for _, ms := range []*ebpf.MapSpec{specs.MwSkStore, specs.MwFlows, specs.MwStats} {
		m, err := ebpf.LoadPinnedMap(filepath.Join(pinDir, ms.Name), nil)
		if err != nil {
			return nil, fmt.Errorf("no meshwarp agent is attached at %s (%w): start one with `meshwarp run`", pinDir, errors.Unwrap(err))
		}
		defer m.Close()
		replace[ms.Name] = m
	}
	var objs accelObjects
	if err := loadObjects(spec, &objs, &ebpf.CollectionOptions{MapReplacements: replace}, func(name string) bool { return name == accelProgMwObsRecv }); err != nil {
		return nil, fmt.Errorf("load the read observation against the agent's maps at %s (same meshwarp build?): %w", pinDir, err)
	}
	defer objs.MwObsRecv.Close()
	l, err := link.AttachTracing(link.TracingOptions{Program: objs.MwObsRecv})
	if err != nil {
		return nil, fmt.Errorf("attach the read observation (tracepoint sock:sock_recv_length): %w", err)
	}
	return l, nil
}
