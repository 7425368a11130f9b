// SPDX-License-Identifier: Apache-2.0

// Package lab builds a Kubernetes-like node out of network namespaces on this
// machine, with Istio-style sidecar capture and real HAProxy sidecars, so that
// meshwarp's acceleration can be measured side by side (see internal/bench).
//
// Topology (nothing is created in the root network namespace):
//
//	netns meshwarp-node:   bridge mw-br0 10.211.0.1/24 fd00:211::1/64, veths mw-pN-br
//	netns meshwarp-pod-N:  mw-pN-eth 10.211.0.(N+2)/24 fd00:211::(N+2)/64, lo
//	                       nat chains MESHWARP_* (capture -> :15001 / :15006)
//	                       haproxy (uid 1337) on :15001 and :15006
//	                       pod-1..: fortio HTTP echo :8080, TCP echo :8078, qperf :19765
//	cgroup v2 meshwarp-lab: every process the lab starts (and Lab.Command runs)
//	/run/meshwarp-lab:      state.json, pids/, logs/, pods/<pod>/haproxy.cfg
//
// pod-0 is the client, pod-1 the server. With --nodes 2 a second node
// namespace meshwarp-node-1 (10.211.1.0/24, fd00:211:0:1::/64) is joined to
// the first by a veth wire mw-wire (10.211.254.0/24, fd00:211:0:fe::/64) with
// routes to each other's pods; pod i lives on node i%2, so the client and
// pod-1 talk across nodes, routed by the node namespaces.
package lab

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// Options configure Up. Use DefaultOptions() for the CLI's defaults: the zero
// value of Capture is false (capture off), Pods 0 means 2, Nodes 0 means 1
// and SidecarUID 0 means 1337.
type Options struct {
	Pods       int    // number of pods, >= 2 (pod-0 client, the rest servers)
	Nodes      int    // number of node namespaces, 1 or 2 (0 means 1); pod i lives on node i%Nodes
	SidecarUID uint32 // uid HAProxy runs as and the capture rules exempt (1337)
	Capture    bool   // install the capture jumps (sidecar mode); see Lab.SetCapture
}

// DefaultOptions returns the CLI defaults: 2 pods, uid 1337, capture on.
func DefaultOptions() Options {
	return Options{Pods: DefaultPods, Nodes: DefaultNodes, SidecarUID: DefaultSidecarUID, Capture: true}
}

// ErrNotUp is returned by Load when no lab is running.
var ErrNotUp = errors.New("no lab is running: run `meshwarp lab up`")

// Lab is a running lab. Methods are safe for concurrent use.
type Lab struct {
	logger *slog.Logger
	r      *runner
	nodes  []Node
	pods   []podPlan
	cgroup string
	uid    uint32

	mu      sync.Mutex
	capture bool
	cgFDs   map[int]int // per node, opened lazily for Command
	closed  bool
}

// state is /run/meshwarp-lab/state.json.
type state struct {
	Phase      string    `json:"phase"` // phaseBuilding until Up finished, then phaseReady
	Pods       int       `json:"pods"`
	Nodes      int       `json:"nodes,omitempty"` // 0 (a lab from before nodes existed) means 1
	SidecarUID uint32    `json:"sidecar_uid"`
	SidecarGID uint32    `json:"sidecar_gid"`
	Capture    bool      `json:"capture"`
	Cgroup     string    `json:"cgroup"`
	CreatedAt  time.Time `json:"created_at"`
	// NetnsDirCreated: /run/netns did not exist before the lab, so down
	// removes it again when it is empty.
	NetnsDirCreated bool `json:"netns_dir_created"`
	// UserCreated: the lab added the SidecarUser account (down keeps it).
	UserCreated bool `json:"user_created"`
}

const (
	phaseBuilding = "building"
	phaseReady    = "ready"
)

func statePath() string { return filepath.Join(RunDir, "state.json") }

func readState() (*state, error) {
	b, err := os.ReadFile(statePath())
	if err != nil {
		return nil, err
	}
	var st state
	if err := json.Unmarshal(b, &st); err != nil {
		return nil, fmt.Errorf("read lab state %s: %w", statePath(), err)
	}
	return &st, nil
}

func writeState(st *state) error {
	b, err := json.MarshalIndent(st, "", "  ")
	if err != nil {
		return err
	}
	return writeFileAtomic(statePath(), append(b, '\n'))
}

// Load returns the running lab, or an error that says to run `meshwarp lab up`.
func Load() (*Lab, error) {
	st, err := readState()
	if errors.Is(err, os.ErrNotExist) {
		return nil, ErrNotUp
	}
	if err != nil {
		return nil, err
	}
	if st.Phase != phaseReady {
		return nil, errors.New("the lab is half-built (an earlier `meshwarp lab up` did not finish): run `meshwarp lab down` and `meshwarp lab up`")
	}
	l := &Lab{
		logger:  slog.Default().With("subsys", "lab"),
		nodes:   planNodes(max(st.Nodes, 1)),
		pods:    planPods(st.Pods, max(st.Nodes, 1)),
		cgroup:  st.Cgroup,
		uid:     st.SidecarUID,
		capture: st.Capture,
	}
	l.r = &runner{logger: l.logger}
	for _, ns := range l.netnsNames() {
		if !netnsExists(ns) {
			return nil, fmt.Errorf("lab state is stale (netns %s is gone): run `meshwarp lab down` and `meshwarp lab up`", ns)
		}
	}
	return l, nil
}

// SetLogger replaces the logger of a Lab from Load (which logs to
// slog.Default) for SetCapture and RestartSidecars. Call it before using the
// Lab from several goroutines.
func (l *Lab) SetLogger(logger *slog.Logger) {
	if logger == nil {
		return
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	l.logger = logger.With("subsys", "lab")
	l.r = &runner{logger: l.logger}
}

// Client returns pod-0, where load generators run.
func (l *Lab) Client() Pod { return l.pods[0].Pod }

// Server returns pod-1, where the apps and qperf server run.
func (l *Lab) Server() Pod { return l.pods[1].Pod }

// Nodes returns the node namespaces, node 0 (the client's) first.
func (l *Lab) Nodes() []Node { return slices.Clone(l.nodes) }

// netnsNames lists every namespace of this lab: nodes, then pods.
func (l *Lab) netnsNames() []string {
	var out []string
	for _, n := range l.nodes {
		out = append(out, n.Netns)
	}
	for _, p := range l.pods {
		out = append(out, p.Netns)
	}
	return out
}

// Pods returns every pod, client first.
func (l *Lab) Pods() []Pod {
	out := make([]Pod, len(l.pods))
	for i, p := range l.pods {
		out[i] = p.Pod
	}
	return out
}

// CgroupPath is the lab's cgroup v2 directory (<cgroup2 root>/meshwarp-lab):
// attach sock_ops here to see every lab socket.
func (l *Lab) CgroupPath() string { return l.cgroup }

// NodeCgroup is the cgroup of the processes of node i's pods: the lab's
// cgroup with one node, meshwarp-lab/node-<i> with two. One agent per node
// attached there sees that node's sockets only, as on separate machines
// (the lab's nodes share one kernel; an agent on the lab cgroup would pair
// sockets across nodes).
func (l *Lab) NodeCgroup(i int) string { return nodeCgroup(l.cgroup, i, len(l.nodes)) }

func nodeCgroup(labCgroup string, i, nodes int) string {
	if nodes <= 1 {
		return labCgroup
	}
	return filepath.Join(labCgroup, fmt.Sprintf("node-%d", i))
}

// Capture reports whether capture is on, as last set by Up or SetCapture.
func (l *Lab) Capture() bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.capture
}

// SetCapture adds (on) or removes (off) the jumps into the capture chains in
// every pod. New connections follow the new setting at once; connections
// already open keep the path they were set up with (conntrack keeps their NAT).
func (l *Lab) SetCapture(on bool) error {
	unlock, err := lockLab()
	if err != nil {
		return err
	}
	defer unlock()
	ctx := context.Background()
	if err := l.applyCapture(ctx, on); err != nil {
		return err
	}
	st, err := readState()
	if err != nil {
		return fmt.Errorf("update lab state: %w", err)
	}
	st.Capture = on
	return writeState(st)
}

func (l *Lab) applyCapture(ctx context.Context, on bool) error {
	for _, p := range l.pods {
		if err := l.r.setJumps(ctx, p.Netns, on); err != nil {
			return err
		}
	}
	l.mu.Lock()
	l.capture = on
	l.mu.Unlock()
	return nil
}

// RestartSidecars stops every pod's HAProxy (which closes every connection it
// carries) and starts it again, and returns when all listen again.
func (l *Lab) RestartSidecars(ctx context.Context) error {
	unlock, err := lockLab()
	if err != nil {
		return err
	}
	defer unlock()
	st, err := readState()
	if err != nil {
		return fmt.Errorf("read lab state: %w", err)
	}
	var pids []int
	for _, p := range l.pods {
		if pid := ownedPid(p.Name, p.Netns, procSidecar); pid != 0 {
			pids = append(pids, pid)
		}
	}
	if left := terminate(ctx, pids, 5*time.Second); len(left) > 0 {
		return fmt.Errorf("stop sidecars: pids %v did not exit", left)
	}
	fds, err := l.openNodeCgroups()
	if err != nil {
		return err
	}
	defer closeFDs(fds)
	for _, p := range l.pods {
		if err := l.writeSidecarConfig(p, st.SidecarGID); err != nil {
			return err
		}
		ds, err := l.daemons(p)
		if err != nil {
			return err
		}
		if _, err := startDaemon(ds[0], fds[p.Node]); err != nil {
			return err
		}
	}
	for _, p := range l.pods {
		ds, _ := l.daemons(p)
		if err := l.waitListening(ctx, ds[0]); err != nil {
			return err
		}
	}
	l.logger.Info("sidecars restarted", "pods", len(l.pods))
	return nil
}

// Command returns a command that runs name inside pod's network namespace and
// inside the lab cgroup from its first instruction (clone3 with
// CLONE_INTO_CGROUP), so every socket it creates is visible to programs
// attached to CgroupPath(). It runs as `ip netns exec <netns> name args...`
// (same pid). If you replace cmd.SysProcAttr, keep UseCgroupFD and CgroupFD.
// The Lab keeps one descriptor of the cgroup open for this; Close releases it.
func (l *Lab) Command(ctx context.Context, pod Pod, name string, args ...string) *exec.Cmd {
	cmd := exec.CommandContext(ctx, "ip", append([]string{"netns", "exec", pod.Netns, name}, args...)...)
	fd, err := l.commandCgroupFD(pod.Node)
	if err != nil {
		cmd.Err = err
		return cmd
	}
	cmd.SysProcAttr = &syscall.SysProcAttr{UseCgroupFD: true, CgroupFD: fd}
	return cmd
}

func (l *Lab) commandCgroupFD(node int) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.closed {
		return -1, errors.New("lab: Command after Close")
	}
	if fd, ok := l.cgFDs[node]; ok {
		return fd, nil
	}
	fd, err := openCgroup(l.NodeCgroup(node))
	if err != nil {
		return -1, fmt.Errorf("%w: is the lab up? run `meshwarp lab up`", err)
	}
	if l.cgFDs == nil {
		l.cgFDs = map[int]int{}
	}
	l.cgFDs[node] = fd
	return fd, nil
}

// openNodeCgroups opens every node's cgroup, by node index.
func (l *Lab) openNodeCgroups() ([]int, error) {
	var fds []int
	for i := range l.nodes {
		fd, err := openCgroup(l.NodeCgroup(i))
		if err != nil {
			closeFDs(fds)
			return nil, err
		}
		fds = append(fds, fd)
	}
	return fds, nil
}

func closeFDs(fds []int) {
	for _, fd := range fds {
		unix.Close(fd)
	}
}

// Close releases the cgroup descriptors Command uses. It does not stop the
// lab (that is Down). Safe to call twice.
func (l *Lab) Close() error {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.closed = true
	var errs []error
	for node, fd := range l.cgFDs {
		errs = append(errs, unix.Close(fd))
		delete(l.cgFDs, node)
	}
	return errors.Join(errs...)
}

// SidecarStats reads a pod's HAProxy counters from its stats socket.
func (l *Lab) SidecarStats(ctx context.Context, pod Pod) ([]ProxyStat, error) {
	out, err := haproxyCommand(ctx, filepath.Join(podDir(pod.Name), "haproxy.sock"), "show stat")
	if err != nil {
		return nil, fmt.Errorf("sidecar stats of %s: %w", pod.Name, err)
	}
	return parseShowStat(out)
}

// leftovers lists what exists of a lab, found by name.
func leftovers(cg string) []string {
	var out []string
	for _, ns := range labNetnsOnDisk() {
		out = append(out, "netns "+ns)
	}
	if _, err := os.Stat(cg); err == nil {
		out = append(out, "cgroup "+cg)
	}
	if _, err := os.Stat(RunDir); err == nil {
		out = append(out, "dir "+RunDir)
	}
	return out
}

// Leftovers lists what exists of a lab (namespaces, cgroup, run directory),
// found by name, whether or not a lab is up.
func Leftovers() []string {
	cg, err := cgroupPath()
	if err != nil {
		cg = ""
	}
	return leftovers(cg)
}
