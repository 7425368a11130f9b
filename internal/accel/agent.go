// SPDX-License-Identifier: Apache-2.0

// Package accel loads, attaches and pins the acceleration programs
// (sock_ops + sk_msg + SOCKHASH), turns policy into maps, and owns the
// lifecycle: adopt on restart, atomic upgrade, safe uninstall.
package accel

import (
	"errors"
	"log/slog"
)

// DefaultPinDir is where the agent pins what must survive a restart.
const DefaultPinDir = "/sys/fs/bpf/meshwarp"

// Config selects what the agent attaches to and what it accelerates.
type Config struct {
	// CgroupPath is the cgroup v2 directory sock_ops attaches to; empty means the v2 root.
	CgroupPath string
	// PinDir holds pinned maps and links; empty means DefaultPinDir.
	PinDir string
	// SidecarUID is the uid the sidecar proxy runs as (Istio: 1337); used to name hops.
	SidecarUID uint32
	// Policy decides which connections may be accelerated.
	Policy Policy
	// SockhashCapacity bounds the number of accelerated sockets; 0 means the default.
	SockhashCapacity uint32
}

// Stats are cumulative counters read from the pinned maps.
type Stats struct {
	AcceleratedSockets  uint64            `json:"accelerated_sockets"`
	RedirectedMessages  uint64            `json:"redirected_messages"`
	RedirectedBytes     uint64            `json:"redirected_bytes"`
	PassthroughMessages uint64            `json:"passthrough_messages"`
	PassthroughByReason map[string]uint64 `json:"passthrough_by_reason"`
	SockhashFull        uint64            `json:"sockhash_full"`
	// Hops splits the redirect counters by mesh hop (app_to_sidecar,
	// sidecar_to_sidecar, sidecar_to_app, direct).
	Hops map[string]HopStats `json:"hops"`
}

// HopStats counts one hop kind.
type HopStats struct {
	PairedConnections  uint64 `json:"paired_connections"`
	RedirectedMessages uint64 `json:"redirected_messages"`
	RedirectedBytes    uint64 `json:"redirected_bytes"`
}

// Agent is an attached acceleration data path.
type Agent struct {
	cfg    Config
	logger *slog.Logger
}

var errNotImplemented = errors.New("accel: not implemented yet")

// Start loads (or adopts pinned) programs and maps, attaches them and pins them.
func Start(cfg Config, logger *slog.Logger) (*Agent, error) { return nil, errNotImplemented }

// Stats reads the counters.
func (a *Agent) Stats() (Stats, error) { return Stats{}, errNotImplemented }

// Close releases this process's handles and keeps the data path pinned (restart/upgrade).
func (a *Agent) Close() error { return nil }

// Uninstall stops accelerating new connections and removes the pins; open
// accelerated connections keep working until they close.
func (a *Agent) Uninstall() error { return errNotImplemented }

// ReadPinnedStats reads the counters of the agent pinned at pinDir.
func ReadPinnedStats(pinDir string) (Stats, error) { return Stats{}, errNotImplemented }
