// SPDX-License-Identifier: Apache-2.0

package accel

import (
	"cmp"
	"errors"
	"fmt"
	"math"
	"os"
	"runtime"
	"strconv"
	"strings"
	"time"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"

	"github.com/meshwarp/meshwarp/internal/crossnode"
)

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

// DefaultUnpairedTimeout bounds how long after a connecting socket whose
// peer is on this node that peer may be established and still be paired (a
// few microseconds normally; a second or more when the handshake's last ACK
// is lost). A later peer leaves the connection to plain TCP.
const DefaultUnpairedTimeout = 10 * time.Millisecond

// DefaultRedirectBudget bounds the redirected bytes a receiver may leave
// unread before its sender continues on TCP: the redirect itself ignores the
// receiver's buffer limits, TCP's flow control does not. With TCP's own
// buffers on top, a writer to a reader that never reads blocks after a few
// MB, as on plain TCP.
const DefaultRedirectBudget = 1 << 20

// RedirectBudgetGrowth: for a reader that keeps up the budget grows, as TCP
// grows such a reader's receive buffer. It doubles each time the reader
// took half of it between two looks at its backlog, up to this many times
// RedirectBudget and at most the receiver's tcp_rmem[2] (a receiver that set
// SO_RCVBUF gets half its buffer at most), so that a reader stalled for a moment (a
// preempted process) does not send a fast stream to TCP for good. A writer
// whose reader kept up and then stops blocks after the grown budget and
// TCP's buffers.
const RedirectBudgetGrowth = 4

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

// DefaultCapacity is the default number of connections tracked at once (mw_conns slots).
const DefaultCapacity = 65536

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
	// SockhashCapacity is the number of connections tracked at once (mw_conns slots, two
	// sockets each in mw_sock_map); 0 means DefaultCapacity.
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
	// ObserveOnly accelerates nothing: no socket joins the SOCKMAP (an
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
	// keeps later connections on that socket's ports, and every later
	// connection of that program, on TCP (mw_unfit_progs). Off by default:
	// syscall tracepoints put every process of the node on the kernel's
	// syscall tracing path (docs/BENCHMARKS.md).
	LearnFromSyscalls bool
}

// dataPathConstants are the data path's load-time settings for cfg (cfg
// with its defaults). The tap's program, which stands in for the agent's
// while it runs, takes the agent's loaded values instead (LoadTap).
func dataPathConstants(v *accelVariableSpecs, cfg Config) []constant {
	run := uint32(SmallStreamRun)
	if cfg.KeepSmallStreams {
		run = 0
	}
	return []constant{
		{v.SidecarUid, cfg.SidecarUID},
		{v.ConnSlots, cfg.SockhashCapacity},
		{v.OutboundCapturePort, uint32(cfg.OutboundPort)},
		{v.InboundCapturePort, uint32(cfg.InboundPort)},
		{v.UnpairedTimeoutNs, uint64(cfg.UnpairedTimeout.Nanoseconds())},
		{v.RedirectBudgetBytes, cfg.RedirectBudget},
		{v.RedirectBudgetMaxBytes, uint32(min(uint64(cfg.RedirectBudget)*RedirectBudgetGrowth, math.MaxUint32))},
		{v.TcpMemSlackPages, tcpMemSlackPages()},
		{v.PossibleCpus, uint32(possibleCPUs())},
		{v.StreamRunMsgs, run},
		{v.StreamSmallBytesLocal, uint32(SmallStreamLocalBytes)},
		{v.StreamSmallBytesRemote, uint32(SmallStreamRemoteBytes)},
	}
}

// setDefaults fills in every setting left at zero.
func (c *Config) setDefaults() {
	c.PinDir = cmp.Or(c.PinDir, DefaultPinDir)
	c.SockhashCapacity = cmp.Or(c.SockhashCapacity, DefaultCapacity)
	c.SidecarUID = cmp.Or(c.SidecarUID, DefaultSidecarUID)
	c.OutboundPort = cmp.Or(c.OutboundPort, DefaultOutboundPort)
	c.InboundPort = cmp.Or(c.InboundPort, DefaultInboundPort)
	c.UnpairedTimeout = cmp.Or(c.UnpairedTimeout, DefaultUnpairedTimeout)
	c.RedirectBudget = cmp.Or(c.RedirectBudget, DefaultRedirectBudget)
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

// tcpMemSlackPages is how far the node's TCP memory counter may lag: each
// possible CPU keeps up to net.core.mem_pcpu_rsv pages (1 MB of pages before
// that sysctl existed) before adding them to it.
func tcpMemSlackPages() uint32 {
	rsv := uint64(1<<20) / uint64(os.Getpagesize())
	if b, err := os.ReadFile("/proc/sys/net/core/mem_pcpu_rsv"); err == nil {
		if n, err := strconv.ParseUint(strings.TrimSpace(string(b)), 10, 32); err == nil {
			rsv = n
		}
	}
	return uint32(rsv * uint64(possibleCPUs()))
}

// possibleCPUs is the number of CPUs the kernel may ever run (per-CPU state
// is kept for each).
func possibleCPUs() int {
	cpus, err := ebpf.PossibleCPU()
	if err != nil {
		cpus = runtime.NumCPU()
	}
	return cpus
}
