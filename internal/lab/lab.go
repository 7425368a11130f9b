// SPDX-License-Identifier: Apache-2.0

// Package lab builds a Kubernetes-like node out of network namespaces on this
// machine, with Istio-style sidecar capture and real HAProxy sidecars, so that
// meshwarp's acceleration can be measured side by side (see internal/bench).
//
// Topology (nothing is created in the root network namespace):
//
//	netns meshwarp-node:   bridge mw-br0 10.211.0.1/24, veths mw-pN-br
//	netns meshwarp-pod-N:  mw-pN-eth 10.211.0.(N+2)/24, lo
//	                       nat chains MESHWARP_* (capture -> :15001 / :15006)
//	                       haproxy (uid 1337) on :15001 and :15006
//	                       pod-1..: fortio HTTP echo :8080, TCP echo :8078, qperf :19765
//	cgroup v2 meshwarp-lab: every process the lab starts (and Lab.Command runs)
//	/run/meshwarp-lab:      state.json, pids/, logs/, pods/<pod>/haproxy.cfg
//
// pod-0 is the client, pod-1 the server.
package lab

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/netip"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/meshwarp/meshwarp/internal/probe"
)

// Options configure Up. Use DefaultOptions() for the CLI's defaults: the zero
// value of Capture is false (capture off), Pods 0 means 2 and SidecarUID 0
// means 1337.
type Options struct {
	Pods       int    // number of pods, >= 2 (pod-0 client, the rest servers)
	SidecarUID uint32 // uid HAProxy runs as and the capture rules exempt (1337)
	Capture    bool   // install the capture jumps (sidecar mode); see Lab.SetCapture
}

// DefaultOptions returns the CLI defaults: 2 pods, uid 1337, capture on.
func DefaultOptions() Options {
	return Options{Pods: DefaultPods, SidecarUID: DefaultSidecarUID, Capture: true}
}

// ErrNotUp is returned by Load when no lab is running.
var ErrNotUp = errors.New("no lab is running: run `meshwarp lab up`")

// Lab is a running lab. Methods are safe for concurrent use.
type Lab struct {
	logger *slog.Logger
	r      *runner
	pods   []podPlan
	cgroup string
	uid    uint32

	mu      sync.Mutex
	capture bool
	cgFD    int // opened lazily for Command; -1 until then
	closed  bool
}

// state is /run/meshwarp-lab/state.json.
type state struct {
	Phase      string    `json:"phase"` // phaseBuilding until Up finished, then phaseReady
	Pods       int       `json:"pods"`
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

// requiredTools are looked up before anything is created.
var requiredTools = []string{"ip", "iptables", "iptables-restore", "haproxy", "qperf"}

// checkPrereqs says what is missing and how to get it.
func checkPrereqs() error {
	if os.Geteuid() != 0 {
		return errors.New("the lab needs root (network namespaces, iptables, cgroups): run it as root, e.g. sudo meshwarp lab up")
	}
	var missing []string
	for _, t := range requiredTools {
		if _, err := exec.LookPath(t); err != nil {
			missing = append(missing, t)
		}
	}
	if len(missing) > 0 {
		return fmt.Errorf("%s not found in PATH: run scripts/install-deps.sh", strings.Join(missing, ", "))
	}
	if _, err := cgroupPath(); err != nil {
		return err
	}
	return nil
}

// Up builds the lab, or verifies and repairs the one that is running (Up is
// idempotent). A lab left half-built by an interrupted Up is removed first.
// Progress is logged at Info. Up returns when every listener accepts and a
// request from the client pod reached the server pod's apps (through both
// sidecars when capture is on).
func Up(ctx context.Context, opts Options, logger *slog.Logger) (*Lab, error) {
	if logger == nil {
		logger = slog.New(slog.NewTextHandler(io.Discard, nil))
	}
	logger = logger.With("subsys", "lab")
	opts, err := opts.withDefaults()
	if err != nil {
		return nil, err
	}
	if err := checkPrereqs(); err != nil {
		// The machine lacks something the lab needs; nothing was created.
		return nil, fmt.Errorf("%w: %w", probe.ErrNotReady, err)
	}
	unlock, err := lockLab()
	if err != nil {
		return nil, err
	}
	defer unlock()
	l, err := upLocked(ctx, opts, logger)
	if err != nil && len(Leftovers()) > 0 {
		return nil, fmt.Errorf("%w (logs: %s; `meshwarp lab down` removes the half-built lab, `meshwarp lab up` rebuilds it)", err, logsDir())
	}
	return l, err
}

// testHookAfterStep, when set (tests only), runs after each named Up step; it
// lets a test kill the process half-way to prove Down cleans up after a crash.
var testHookAfterStep func(step string)

func afterStep(step string) {
	if testHookAfterStep != nil {
		testHookAfterStep(step)
	}
}

func upLocked(ctx context.Context, opts Options, logger *slog.Logger) (*Lab, error) {
	r := &runner{logger: logger}
	cg, err := cgroupPath()
	if err != nil {
		return nil, err
	}
	st, err := readState()
	switch {
	case err == nil && st.Phase == phaseReady:
		if st.Pods != opts.Pods || st.SidecarUID != opts.SidecarUID {
			return nil, fmt.Errorf("a lab with %d pods (sidecar uid %d) is already up: run `meshwarp lab down` first to change it",
				st.Pods, st.SidecarUID)
		}
		logger.Info("lab already up: verifying and repairing", "pods", st.Pods)
	case err == nil || len(leftovers(cg)) > 0:
		logger.Info("found leftovers of an interrupted lab: cleaning up first", "leftovers", leftovers(cg))
		if err := downLocked(ctx, logger); err != nil {
			return nil, err
		}
		st = nil
	case !errors.Is(err, os.ErrNotExist):
		return nil, err
	}
	if err := os.MkdirAll(RunDir, 0o755); err != nil {
		return nil, fmt.Errorf("create %s: %w", RunDir, err)
	}
	for _, d := range []string{pidsDir(), logsDir()} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			return nil, fmt.Errorf("create %s: %w", d, err)
		}
	}
	if st == nil {
		_, statErr := os.Stat(netnsDir)
		st = &state{
			Phase:           phaseBuilding,
			Pods:            opts.Pods,
			SidecarUID:      opts.SidecarUID,
			Cgroup:          cg,
			CreatedAt:       time.Now().UTC(),
			NetnsDirCreated: errors.Is(statErr, os.ErrNotExist),
		}
		// Written before anything else exists, so down knows what it may remove.
		if err := writeState(st); err != nil {
			return nil, err
		}
	}

	l := &Lab{logger: logger, r: r, pods: planPods(opts.Pods), cgroup: cg, uid: opts.SidecarUID, capture: st.Capture, cgFD: -1}

	gid, created, err := ensureSidecarUser(ctx, r, opts.SidecarUID, logger)
	if err != nil {
		return nil, err
	}
	st.SidecarGID = gid
	st.UserCreated = st.UserCreated || created

	if err := os.Mkdir(cg, 0o755); err != nil && !errors.Is(err, os.ErrExist) {
		return nil, fmt.Errorf("create lab cgroup %s: %w", cg, err)
	}

	logger.Info("creating namespaces, bridge and veths", "pods", opts.Pods, "subnet", labPrefix.String())
	if err := l.ensureNetwork(ctx); err != nil {
		return nil, err
	}
	afterStep("network")

	logger.Info("installing iptables capture chains", "chains", chainPrefix+"*", "outbound", OutboundPort, "inbound", InboundPort)
	for _, p := range l.pods {
		if err := r.installCapture(ctx, p.Netns, opts.SidecarUID); err != nil {
			return nil, err
		}
	}
	afterStep("iptables")

	if err := l.ensureDaemons(ctx, gid); err != nil {
		return nil, err
	}
	afterStep("daemons")

	logger.Info("setting capture", "capture", opts.Capture)
	if err := l.applyCapture(ctx, opts.Capture); err != nil {
		return nil, err
	}
	st.Capture = opts.Capture

	logger.Info("checking requests from the client pod", "client", l.Client().IP, "through_sidecars", opts.Capture)
	if err := l.checkEndToEnd(ctx); err != nil {
		return nil, err
	}
	st.Phase = phaseReady
	if err := writeState(st); err != nil {
		return nil, err
	}
	logger.Info("lab is up", "client", l.Client().IP, "server", l.Server().IP, "capture", opts.Capture, "cgroup", cg)
	return l, nil
}

// ensureNetwork creates what is missing of namespaces, bridge, veths,
// addresses and routes, and leaves what is there.
func (l *Lab) ensureNetwork(ctx context.Context) error {
	r := l.r
	if err := r.ensureNetns(ctx, NodeNetns); err != nil {
		return err
	}
	if !r.linkExists(ctx, NodeNetns, BridgeName) {
		if _, err := r.ip(ctx, "-n", NodeNetns, "link", "add", BridgeName, "type", "bridge"); err != nil {
			return fmt.Errorf("create bridge: %w", err)
		}
	}
	bits := strconv.Itoa(labPrefix.Bits())
	steps := [][]string{
		{"-n", NodeNetns, "addr", "replace", bridgeIP.String() + "/" + bits, "dev", BridgeName},
		{"-n", NodeNetns, "link", "set", BridgeName, "up"},
	}
	for _, s := range steps {
		if _, err := r.ip(ctx, s...); err != nil {
			return fmt.Errorf("configure bridge: %w", err)
		}
	}
	for _, p := range l.pods {
		if err := r.ensureNetns(ctx, p.Netns); err != nil {
			return err
		}
		hostOK, podOK := r.linkExists(ctx, NodeNetns, p.HostVeth), r.linkExists(ctx, p.Netns, p.PodVeth)
		if !hostOK || !podOK {
			if hostOK {
				_, _ = r.ip(ctx, "-n", NodeNetns, "link", "del", p.HostVeth)
			}
			if podOK {
				_, _ = r.ip(ctx, "-n", p.Netns, "link", "del", p.PodVeth)
			}
			// Created inside the node namespace with the peer placed straight
			// into the pod: neither end ever exists in the root namespace.
			if _, err := r.ip(ctx, "-n", NodeNetns, "link", "add", p.HostVeth, "type", "veth",
				"peer", "name", p.PodVeth, "netns", p.Netns); err != nil {
				return fmt.Errorf("create veth for %s: %w", p.Name, err)
			}
		}
		steps := [][]string{
			{"-n", NodeNetns, "link", "set", p.HostVeth, "master", BridgeName},
			{"-n", NodeNetns, "link", "set", p.HostVeth, "up"},
			{"-n", p.Netns, "addr", "replace", p.IP.String() + "/" + bits, "dev", p.PodVeth},
			{"-n", p.Netns, "link", "set", p.PodVeth, "up"},
			{"-n", p.Netns, "link", "set", "lo", "up"},
			{"-n", p.Netns, "route", "replace", "default", "via", bridgeIP.String(), "dev", p.PodVeth},
		}
		for _, s := range steps {
			if _, err := r.ip(ctx, s...); err != nil {
				return fmt.Errorf("configure %s: %w", p.Name, err)
			}
		}
	}
	return nil
}

// daemons returns every long-running process of one pod.
func (l *Lab) daemons(p podPlan) ([]daemon, error) {
	haproxy, err := exec.LookPath("haproxy")
	if err != nil {
		return nil, errors.New("haproxy not found in PATH: run scripts/install-deps.sh")
	}
	ds := []daemon{{
		pod:   p,
		name:  procSidecar,
		argv:  []string{haproxy, "-db", "-f", filepath.Join(podDir(p.Name), "haproxy.cfg")},
		ports: []int{OutboundPort, InboundPort},
	}}
	if !p.runsApps() {
		return ds, nil
	}
	exe := selfExe()
	qperf, err := exec.LookPath("qperf")
	if err != nil {
		return nil, errors.New("qperf not found in PATH: run scripts/install-deps.sh")
	}
	ds = append(ds,
		daemon{
			pod:   p,
			name:  procApps,
			argv:  []string{exe, "lab", "serve-apps", "--http-port", strconv.Itoa(HTTPPort), "--tcp-port", strconv.Itoa(TCPEchoPort)},
			env:   []string{ReexecEnvFor(serveAppsHelper)},
			ports: []int{HTTPPort, TCPEchoPort},
		},
		daemon{
			pod:        p,
			name:       procQperf,
			argv:       []string{qperf, "--listen_port", strconv.Itoa(QperfPort)},
			ports:      []int{QperfPort},
			listenOnly: true,
		},
	)
	return ds, nil
}

// selfExe is the path to re-execute this binary by: its path on disk, or
// /proc/<pid>/exe (valid while this process lives) if the file was replaced or
// removed since it started (go build, go test's temporary binaries).
func selfExe() string {
	if exe, err := os.Executable(); err == nil && !strings.HasSuffix(exe, " (deleted)") {
		if fi, err := os.Stat(exe); err == nil && fi.Mode().IsRegular() {
			return exe
		}
	}
	return fmt.Sprintf("/proc/%d/exe", os.Getpid())
}

func (l *Lab) writeSidecarConfig(p podPlan, gid uint32) error {
	if err := os.MkdirAll(podDir(p.Name), 0o755); err != nil {
		return fmt.Errorf("create %s: %w", podDir(p.Name), err)
	}
	cfg, err := sidecarConfig{
		UID:         l.uid,
		GID:         gid,
		StatsSocket: filepath.Join(podDir(p.Name), "haproxy.sock"),
		HTTPPorts:   []int{HTTPPort},
	}.render()
	if err != nil {
		return err
	}
	return writeFileAtomic(filepath.Join(podDir(p.Name), "haproxy.cfg"), []byte(cfg))
}

// ensureDaemons writes configs and starts every process that is not running.
func (l *Lab) ensureDaemons(ctx context.Context, gid uint32) error {
	fd, err := openCgroup(l.cgroup)
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	var started []daemon
	for i, p := range l.pods {
		if err := l.writeSidecarConfig(p, gid); err != nil {
			return err
		}
		if i == 0 {
			cfg := filepath.Join(podDir(p.Name), "haproxy.cfg")
			if _, err := l.r.run(ctx, "", "haproxy", "-c", "-q", "-f", cfg); err != nil {
				return fmt.Errorf("haproxy rejects the generated config %s: %w", cfg, err)
			}
		}
		ds, err := l.daemons(p)
		if err != nil {
			return err
		}
		for _, d := range ds {
			if pid := ownedPid(p.Name, p.Netns, d.name); pid != 0 {
				l.logger.Debug("already running", "pod", p.Name, "proc", d.name, "pid", pid)
				continue
			}
			pid, err := startDaemon(d, fd)
			if err != nil {
				return err
			}
			l.logger.Info("started", "pod", p.Name, "proc", d.name, "pid", pid, "log", logFile(p.Name, d.name))
			started = append(started, d)
		}
	}
	if len(started) > 0 {
		l.logger.Info("waiting for listeners", "processes", len(started))
	}
	for _, p := range l.pods {
		ds, _ := l.daemons(p)
		for _, d := range ds {
			if err := l.waitListening(ctx, d); err != nil {
				return err
			}
		}
	}
	return nil
}

// waitListening polls until every port of d accepts on 127.0.0.1 inside its
// pod, failing early if the process died.
func (l *Lab) waitListening(ctx context.Context, d daemon) error {
	for _, port := range d.ports {
		addr := netip.AddrPortFrom(netip.MustParseAddr("127.0.0.1"), uint16(port)).String()
		var lastErr error
		err := poll(ctx, 20*time.Second, 20*time.Millisecond, func() (bool, error) {
			pid := ownedPid(d.pod.Name, d.pod.Netns, d.name)
			if pid == 0 {
				return false, fmt.Errorf("%s in %s exited: see %s", d.name, d.pod.Name, logFile(d.pod.Name, d.name))
			}
			if d.listenOnly {
				lastErr = errors.New("not listening yet")
				return listening(pid, port), nil
			}
			c, err := dialIn(ctx, d.pod.Netns, "tcp", addr)
			if err != nil {
				lastErr = err
				return false, nil
			}
			c.Close()
			return true, nil
		})
		if err != nil {
			if lastErr != nil && errors.Is(err, context.DeadlineExceeded) {
				err = fmt.Errorf("%w (last: %v)", err, lastErr)
			}
			return fmt.Errorf("wait for %s on %s in %s: %w; log: %s", d.name, addr, d.pod.Name, err, logFile(d.pod.Name, d.name))
		}
	}
	return nil
}

// checkEndToEnd sends an HTTP request and a TCP echo from the client pod to
// every server pod, and checks the app saw the source it should: 127.0.0.6
// (the inbound sidecar) with capture on, the client's IP with capture off.
func (l *Lab) checkEndToEnd(ctx context.Context) error {
	client := l.Client()
	capture := l.Capture()
	for _, p := range l.pods {
		if !p.runsApps() {
			continue
		}
		body, err := l.httpGet(ctx, client, fmt.Sprintf("http://%s/debug", netip.AddrPortFrom(p.IP, HTTPPort)))
		if err != nil {
			return fmt.Errorf("request from %s to %s:%d: %w", client.Name, p.Name, HTTPPort, err)
		}
		want := client.IP.String() + ":"
		if capture {
			want = InboundSource + ":"
		}
		if !strings.Contains(body, "request from "+want) && !strings.Contains(body, "request from [::ffff:"+strings.TrimSuffix(want, ":")+"]:") {
			return fmt.Errorf("request from %s to %s:%d: app did not see source %s (capture %v); reply: %.200q",
				client.Name, p.Name, HTTPPort, strings.TrimSuffix(want, ":"), capture, body)
		}
		if err := l.echo(ctx, client, netip.AddrPortFrom(p.IP, TCPEchoPort), []byte("meshwarp lab check\n")); err != nil {
			return fmt.Errorf("tcp echo from %s to %s:%d: %w", client.Name, p.Name, TCPEchoPort, err)
		}
	}
	return nil
}

func (l *Lab) httpGet(ctx context.Context, from Pod, url string) (string, error) {
	tr := &http.Transport{
		DialContext: func(ctx context.Context, network, addr string) (net.Conn, error) {
			return dialIn(ctx, from.Netns, network, addr)
		},
		DisableKeepAlives: true,
	}
	defer tr.CloseIdleConnections()
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return "", err
	}
	resp, err := (&http.Client{Transport: tr}).Do(req)
	if err != nil {
		return "", err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		return "", err
	}
	if resp.StatusCode != http.StatusOK {
		return string(b), fmt.Errorf("status %s", resp.Status)
	}
	return string(b), nil
}

func (l *Lab) echo(ctx context.Context, from Pod, to netip.AddrPort, msg []byte) error {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	c, err := dialIn(ctx, from.Netns, "tcp", to.String())
	if err != nil {
		return err
	}
	defer c.Close()
	dl, _ := ctx.Deadline()
	_ = c.SetDeadline(dl)
	if _, err := c.Write(msg); err != nil {
		return err
	}
	got := make([]byte, len(msg))
	if _, err := io.ReadFull(c, got); err != nil {
		return err
	}
	if string(got) != string(msg) {
		return fmt.Errorf("echo mismatch: sent %q, got %q", msg, got)
	}
	return nil
}

// ensureSidecarUser returns the gid for the sidecar uid, creating the
// meshwarp-proxy system user when the uid has no passwd entry. HAProxy and the
// owner match only need numbers, so a failed useradd is logged, not fatal.
func ensureSidecarUser(ctx context.Context, r *runner, uid uint32, logger *slog.Logger) (gid uint32, created bool, err error) {
	id := strconv.FormatUint(uint64(uid), 10)
	if u, err := user.LookupId(id); err == nil {
		g, _ := strconv.ParseUint(u.Gid, 10, 32)
		return uint32(g), false, nil
	}
	if _, err := r.run(ctx, "", "useradd", "--system", "--uid", id, "--user-group", "--no-create-home",
		"--home-dir", "/nonexistent", "--shell", "/usr/sbin/nologin", SidecarUser); err != nil {
		logger.Warn("cannot create the sidecar user; using the bare uid", "uid", uid, "err", err)
		return uid, false, nil
	}
	logger.Info("created sidecar user", "user", SidecarUser, "uid", uid)
	if u, err := user.LookupId(id); err == nil {
		g, _ := strconv.ParseUint(u.Gid, 10, 32)
		return uint32(g), true, nil
	}
	return uid, true, nil
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
		pods:    planPods(st.Pods),
		cgroup:  st.Cgroup,
		uid:     st.SidecarUID,
		capture: st.Capture,
		cgFD:    -1,
	}
	l.r = &runner{logger: l.logger}
	for _, p := range l.pods {
		if !netnsExists(p.Netns) {
			return nil, fmt.Errorf("lab state is stale (netns %s is gone): run `meshwarp lab down` and `meshwarp lab up`", p.Netns)
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
	fd, err := openCgroup(l.cgroup)
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	for _, p := range l.pods {
		if err := l.writeSidecarConfig(p, st.SidecarGID); err != nil {
			return err
		}
		ds, err := l.daemons(p)
		if err != nil {
			return err
		}
		if _, err := startDaemon(ds[0], fd); err != nil {
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
	fd, err := l.commandCgroupFD()
	if err != nil {
		cmd.Err = err
		return cmd
	}
	cmd.SysProcAttr = &syscall.SysProcAttr{UseCgroupFD: true, CgroupFD: fd}
	return cmd
}

func (l *Lab) commandCgroupFD() (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.closed {
		return -1, errors.New("lab: Command after Close")
	}
	if l.cgFD >= 0 {
		return l.cgFD, nil
	}
	fd, err := openCgroup(l.cgroup)
	if err != nil {
		return -1, fmt.Errorf("%w: is the lab up? run `meshwarp lab up`", err)
	}
	l.cgFD = fd
	return fd, nil
}

// Close releases the cgroup descriptor Command uses. It does not stop the
// lab (that is Down). Safe to call twice.
func (l *Lab) Close() error {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.closed = true
	if l.cgFD >= 0 {
		err := unix.Close(l.cgFD)
		l.cgFD = -1
		return err
	}
	return nil
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
