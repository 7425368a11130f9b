// SPDX-License-Identifier: Apache-2.0

package bench

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"time"

	"github.com/meshwarp/meshwarp/internal/accel"
	"github.com/meshwarp/meshwarp/internal/crossnode"
	"github.com/meshwarp/meshwarp/internal/lab"
)

// labEnv adapts a running lab to Env.
type labEnv struct{ l *lab.Lab }

func (e labEnv) ServerIP() netip.Addr { return e.l.Server().IP }
func (e labEnv) HTTPPort() int        { return lab.HTTPPort }
func (e labEnv) TCPEchoPort() int     { return lab.TCPEchoPort }

// QperfPorts: qperf's data connection uses a port of its own; the lab's
// sidecars route any original destination port (HAProxy dst_port), so an
// ephemeral data port works through them too.
func (e labEnv) QperfPorts() (int, int) { return lab.QperfPort, 0 }

func (e labEnv) ClientCommand(ctx context.Context, name string, args ...string) *exec.Cmd {
	return e.l.Command(ctx, e.l.Client(), name, args...)
}
func (e labEnv) ServerCommand(ctx context.Context, name string, args ...string) *exec.Cmd {
	return e.l.Command(ctx, e.l.Server(), name, args...)
}
func (e labEnv) OutsideServerCommand(ctx context.Context, name string, args ...string) *exec.Cmd {
	return exec.CommandContext(ctx, "ip", append([]string{"netns", "exec", e.l.Server().Netns, name}, args...)...)
}
func (e labEnv) SetCapture(on bool) error                  { return e.l.SetCapture(on) }
func (e labEnv) RestartSidecars(ctx context.Context) error { return e.l.RestartSidecars(ctx) }
func (e labEnv) CgroupPath() string                        { return e.l.CgroupPath() }

func (e labEnv) AgentTargets() []AgentTarget {
	nodes := e.l.Nodes()
	if len(nodes) == 1 {
		return []AgentTarget{{Cgroup: e.l.CgroupPath()}}
	}
	var out []AgentTarget
	for i, n := range nodes {
		out = append(out, AgentTarget{Cgroup: e.l.NodeCgroup(i), NodeNetns: filepath.Join("/run/netns", n.Netns)})
	}
	return out
}

// LabSession is a lab for one bench run: the one already up (used and left
// as found, capture setting included), or one that bench brought up itself
// and takes down in Close unless kept.
type LabSession struct {
	Lab *lab.Lab
	// BroughtUp is true when bench started the lab.
	BroughtUp   bool
	keep        bool
	origCapture bool
	logger      *slog.Logger
	status      io.Writer
}

// OpenLab uses the running lab or, when none is up, brings one up with
// nodes node namespaces (0 means 1). It says which on status (nil: silent).
func OpenLab(ctx context.Context, keep bool, nodes int, logger *slog.Logger, status io.Writer) (*LabSession, error) {
	if status == nil {
		status = io.Discard
	}
	nodes = max(nodes, 1)
	l, err := lab.Load()
	if err == nil && len(l.Nodes()) != nodes {
		l.Close()
		return nil, fmt.Errorf("the lab that is up has %d node(s), bench --nodes %d needs %d: run `meshwarp lab down` (bench then brings up its own)",
			len(l.Nodes()), nodes, nodes)
	}
	if err == nil {
		fmt.Fprintln(status, "bench: using the lab that is up (left as found)")
		return &LabSession{Lab: l, origCapture: l.Capture(), logger: logger, status: status}, nil
	}
	if !errors.Is(err, lab.ErrNotUp) {
		return nil, fmt.Errorf("use the running lab: %w", err)
	}
	if keep {
		fmt.Fprintln(status, "bench: no lab is up: bringing one up (kept at the end: --keep-lab)")
	} else {
		fmt.Fprintln(status, "bench: no lab is up: bringing one up (taken down at the end)")
	}
	l, err = lab.Up(ctx, lab.Options{Pods: lab.DefaultPods, Nodes: nodes, SidecarUID: SidecarUID, Capture: true}, logger)
	if err != nil {
		// lab.Up may have left a half-built lab: take it down again.
		if derr := downLab(logger); derr != nil {
			err = errors.Join(err, derr)
		}
		return nil, fmt.Errorf("bring up the lab: %w", err)
	}
	return &LabSession{Lab: l, BroughtUp: true, keep: keep, origCapture: true, logger: logger, status: status}, nil
}

// Env returns the lab as a bench Env.
func (s *LabSession) Env() Env { return labEnv{s.Lab} }

// Close leaves the lab as it was found: a lab bench brought up is taken down
// (unless kept), a lab that was already up gets its capture setting back.
// Safe to call twice.
func (s *LabSession) Close() error {
	if s == nil || s.Lab == nil {
		return nil
	}
	var errs []error
	if !s.BroughtUp || s.keep {
		if s.Lab.Capture() != s.origCapture {
			if err := s.Lab.SetCapture(s.origCapture); err != nil {
				errs = append(errs, fmt.Errorf("restore lab capture: %w", err))
			}
		}
	}
	errs = append(errs, s.Lab.Close())
	if s.BroughtUp && !s.keep {
		fmt.Fprintln(s.status, "bench: taking the lab down")
		errs = append(errs, downLab(s.logger))
	}
	s.Lab = nil
	return errors.Join(errs...)
}

func downLab(logger *slog.Logger) error {
	// Runs also after Ctrl-C: the caller's context is already done.
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	if err := lab.Down(ctx, logger); err != nil {
		return fmt.Errorf("take the lab down: %w", err)
	}
	return nil
}

// accelAgent adapts accel.Agent.
type accelAgent struct {
	a       *accel.Agent
	observe bool
	pinDir  string
}

// StartAccel is the StartAgentFunc of the real agent.
func StartAccel(logger *slog.Logger) StartAgentFunc {
	return func(cgroupPath, pinDir string, s AgentSettings) (Agent, error) {
		a, err := accel.Start(accel.Config{
			CgroupPath: cgroupPath, PinDir: pinDir, SidecarUID: SidecarUID,
			Observe: s.Observe, ObserveOnly: !s.Accelerate,
			// The breakdown in the report starts at the client's own read.
			ObserveReads: s.ObserveReads,
			CrossNode:    s.CrossNodeNetns != "",
			CrossNodes:   []crossnode.Node{{Netns: s.CrossNodeNetns}},
		}, logger)
		if err != nil {
			return nil, err
		}
		return accelAgent{a, s.Observe, pinDir}, nil
	}
}

func (x accelAgent) Stats() (accel.Stats, error) { return x.a.Stats() }

func (x accelAgent) Flows() ([]accel.Flow, error) {
	if !x.observe {
		return nil, nil
	}
	return x.a.Flows()
}

func (x accelAgent) Uninstall() error {
	_, err := x.a.Uninstall()
	return err
}

// PinDirLeft reports whether the bench pin directory still exists.
func PinDirLeft(pinDir string) bool {
	_, err := os.Stat(pinDir)
	return err == nil
}
