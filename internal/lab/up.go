// SPDX-License-Identifier: Apache-2.0

package lab

// Up: prerequisites, network, sidecar configuration, daemons, and the
// end-to-end check, in that order.

import (
	"context"
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
	"time"

	"github.com/meshwarp/meshwarp/internal/probe"
)

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
	if err != nil && !errors.Is(err, ErrOtherLabUp) && len(Leftovers()) > 0 {
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
	st, err := prepareState(ctx, opts, cg, logger)
	if err != nil {
		return nil, err
	}

	l := &Lab{logger: logger, r: r, nodes: planNodes(opts.Nodes), pods: planPods(opts.Pods, opts.Nodes), cgroup: cg, uid: opts.SidecarUID, capture: st.Capture}

	gid, created, err := ensureSidecarUser(ctx, r, opts.SidecarUID, logger)
	if err != nil {
		return nil, err
	}
	st.SidecarGID = gid
	st.UserCreated = st.UserCreated || created

	for i := range opts.Nodes + 1 {
		dir := cg
		if i > 0 {
			if opts.Nodes == 1 {
				break
			}
			dir = l.NodeCgroup(i - 1)
		}
		if err := os.Mkdir(dir, 0o755); err != nil && !errors.Is(err, os.ErrExist) {
			return nil, fmt.Errorf("create lab cgroup %s: %w", dir, err)
		}
	}

	logger.Info("creating namespaces, bridges and veths", "nodes", opts.Nodes, "pods", opts.Pods)
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

// ErrOtherLabUp: a lab of another shape is up; Up leaves it as it is.
var ErrOtherLabUp = errors.New("another lab is up")

// prepareState returns the state of the lab to build on: the running lab's
// (same shape) or a fresh one written before anything exists, after
// removing the leftovers of an interrupted one; it creates the run
// directories.
func prepareState(ctx context.Context, opts Options, cg string, logger *slog.Logger) (*state, error) {
	st, err := readState()
	switch {
	case err == nil && st.Phase == phaseReady:
		if st.Pods != opts.Pods || max(st.Nodes, 1) != opts.Nodes || st.SidecarUID != opts.SidecarUID {
			return nil, fmt.Errorf("%w: %d pods on %d node(s) (sidecar uid %d), not the %d pods on %d node(s) (sidecar uid %d) asked for: run `meshwarp lab down` first to change it",
				ErrOtherLabUp, st.Pods, max(st.Nodes, 1), st.SidecarUID, opts.Pods, opts.Nodes, opts.SidecarUID)
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
			Nodes:           opts.Nodes,
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
	return st, nil
}

// ensureNetwork creates what is missing of namespaces, bridges, veths, the
// wire, addresses and routes, and leaves what is there.
func (l *Lab) ensureNetwork(ctx context.Context) error {
	r := l.r
	for _, n := range l.nodes {
		if err := l.ensureNode(ctx, n); err != nil {
			return err
		}
	}
	if len(l.nodes) == 2 {
		if err := l.ensureWire(ctx, l.nodes[0], l.nodes[1]); err != nil {
			return err
		}
	}
	for _, p := range l.pods {
		node := l.nodes[p.Node]
		if err := r.ensureNetns(ctx, p.Netns); err != nil {
			return err
		}
		if err := r.ensureVeth(ctx, node.Netns, p.HostVeth, p.Netns, p.PodVeth); err != nil {
			return fmt.Errorf("create veth for %s: %w", p.Name, err)
		}
		steps := [][]string{
			{"-n", node.Netns, "link", "set", p.HostVeth, "master", BridgeName},
			{"-n", node.Netns, "link", "set", p.HostVeth, "up"},
			{"-n", p.Netns, "addr", "replace", cidr(p.IP, node.Prefix), "dev", p.PodVeth},
			{"-n", p.Netns, "addr", "replace", cidr(p.IP6, node.Prefix6), "dev", p.PodVeth, "nodad"},
			{"-n", p.Netns, "link", "set", p.PodVeth, "up"},
			{"-n", p.Netns, "link", "set", "lo", "up"},
			{"-n", p.Netns, "route", "replace", "default", "via", node.Bridge.String(), "dev", p.PodVeth},
			{"-n", p.Netns, "-6", "route", "replace", "default", "via", node.Bridge6.String(), "dev", p.PodVeth},
		}
		for _, s := range steps {
			if _, err := r.ip(ctx, s...); err != nil {
				return fmt.Errorf("configure %s: %w", p.Name, err)
			}
		}
		for _, kv := range PodSysctls {
			if err := writeSysctlIn(p.Netns, kv[0], kv[1]); err != nil {
				return err
			}
		}
	}
	return nil
}

// ensureNode builds a node namespace with its bridge, and turns on
// forwarding (a node routes between its pods and the wire, as a Kubernetes
// node does).
func (l *Lab) ensureNode(ctx context.Context, n Node) error {
	r := l.r
	if err := r.ensureNetns(ctx, n.Netns); err != nil {
		return err
	}
	if !r.linkExists(ctx, n.Netns, BridgeName) {
		if _, err := r.ip(ctx, "-n", n.Netns, "link", "add", BridgeName, "type", "bridge"); err != nil {
			return fmt.Errorf("create bridge in %s: %w", n.Netns, err)
		}
	}
	steps := [][]string{
		{"-n", n.Netns, "addr", "replace", cidr(n.Bridge, n.Prefix), "dev", BridgeName},
		{"-n", n.Netns, "addr", "replace", cidr(n.Bridge6, n.Prefix6), "dev", BridgeName, "nodad"},
		{"-n", n.Netns, "link", "set", BridgeName, "up"},
	}
	for _, s := range steps {
		if _, err := r.ip(ctx, s...); err != nil {
			return fmt.Errorf("configure bridge in %s: %w", n.Netns, err)
		}
	}
	for _, key := range []string{"net/ipv4/ip_forward", "net/ipv6/conf/all/forwarding"} {
		if err := writeSysctlIn(n.Netns, key, "1"); err != nil {
			return err
		}
	}
	return nil
}

// ensureWire joins two nodes with a veth and routes each node's pod prefixes
// to the other across it.
func (l *Lab) ensureWire(ctx context.Context, a, b Node) error {
	r := l.r
	if err := r.ensureVeth(ctx, a.Netns, WireName, b.Netns, WireName); err != nil {
		return fmt.Errorf("create the wire between %s and %s: %w", a.Netns, b.Netns, err)
	}
	for _, pair := range [][2]Node{{a, b}, {b, a}} {
		n, peer := pair[0], pair[1]
		steps := [][]string{
			{"-n", n.Netns, "addr", "replace", cidr(n.Wire, wirePrefix), "dev", WireName},
			{"-n", n.Netns, "addr", "replace", cidr(n.Wire6, wire6), "dev", WireName, "nodad"},
			{"-n", n.Netns, "link", "set", WireName, "up"},
			{"-n", n.Netns, "route", "replace", peer.Prefix.String(), "via", peer.Wire.String(), "dev", WireName},
			{"-n", n.Netns, "-6", "route", "replace", peer.Prefix6.String(), "via", peer.Wire6.String(), "dev", WireName},
		}
		for _, s := range steps {
			if _, err := r.ip(ctx, s...); err != nil {
				return fmt.Errorf("configure the wire in %s: %w", n.Netns, err)
			}
		}
	}
	return nil
}

// ensureVeth creates a veth pair between two namespaces unless both ends
// exist; a lone end (an interrupted up) is deleted first. The pair is
// created in the first namespace with its peer placed straight into the
// second: neither end ever exists in the root namespace.
func (r *runner) ensureVeth(ctx context.Context, ns, name, peerNs, peerName string) error {
	ok, peerOK := r.linkExists(ctx, ns, name), r.linkExists(ctx, peerNs, peerName)
	if ok && peerOK {
		return nil
	}
	if ok {
		_, _ = r.ip(ctx, "-n", ns, "link", "del", name)
	}
	if peerOK {
		_, _ = r.ip(ctx, "-n", peerNs, "link", "del", peerName)
	}
	_, err := r.ip(ctx, "-n", ns, "link", "add", name, "type", "veth", "peer", "name", peerName, "netns", peerNs)
	return err
}

// cidr writes an address with its prefix's length: 10.211.0.2/24.
func cidr(a netip.Addr, p netip.Prefix) string {
	return netip.PrefixFrom(a, p.Bits()).String()
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
	fds, err := l.openNodeCgroups()
	if err != nil {
		return err
	}
	defer closeFDs(fds)
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
			pid, err := startDaemon(d, fds[p.Node])
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
		for _, ip := range []netip.Addr{p.IP, p.IP6} {
			to := netip.AddrPortFrom(ip, TCPEchoPort)
			if err := l.echo(ctx, client, to, []byte("meshwarp lab check\n")); err != nil {
				return fmt.Errorf("tcp echo from %s to %s %s: %w", client.Name, p.Name, to, err)
			}
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
