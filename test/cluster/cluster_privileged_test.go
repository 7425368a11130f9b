//go:build cluster

// SPDX-License-Identifier: Apache-2.0

// Package cluster tests meshwarp on a real one-node Kubernetes cluster:
// scripts/cluster.sh brings it up (Kubernetes built from Go modules, Debian's
// containerd, runc and CNI plugins), installs the Helm chart and the demo pods
// (the lab's capture and HAProxy sidecars), and this test checks what only a
// real kubelet and runtime show. Build tag `cluster`: scripts/test.sh runs it
// as its own step (`go test -tags cluster ./test/cluster`), as root.
package cluster

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"

	"github.com/meshwarp/meshwarp/internal/accel"
	"github.com/meshwarp/meshwarp/internal/lab"
	"github.com/meshwarp/meshwarp/internal/testutil"
)

const (
	agentNS = "meshwarp-system"
	release = "meshwarp"
	demoNS  = "meshwarp-demo"
	repo    = "../.."
)

// clusterStatus is `scripts/cluster.sh status --json`.
type clusterStatus struct {
	APIServerReady bool            `json:"api_server_ready"`
	NodeReady      bool            `json:"node_ready"`
	DaemonSetReady bool            `json:"daemonset_ready"`
	Kubeconfig     string          `json:"kubeconfig"`
	Bin            string          `json:"bin"`
	Containerd     string          `json:"containerd"`
	Cgroup2Mount   string          `json:"cgroup2_mount"`
	PodsCgroup     string          `json:"pods_cgroup"`
	PinDir         string          `json:"pin_dir"`
	Agent          json.RawMessage `json:"agent_status"`
}

type kube struct {
	t  *testing.T
	st clusterStatus
}

func script(t *testing.T, timeout time.Duration, args ...string) []byte {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	cmd := exec.CommandContext(ctx, filepath.Join(repo, "scripts/cluster.sh"), args...)
	var stderr bytes.Buffer
	cmd.Stderr = io.MultiWriter(&stderr, testWriter{t})
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("scripts/cluster.sh %s: %v\n%s", strings.Join(args, " "), err, out)
	}
	return out
}

type testWriter struct{ t *testing.T }

func (w testWriter) Write(b []byte) (int, error) {
	w.t.Logf("%s", strings.TrimRight(string(b), "\n"))
	return len(b), nil
}

func (k *kube) run(timeout time.Duration, name string, args ...string) ([]byte, error) {
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	cmd := exec.CommandContext(ctx, filepath.Join(k.st.Bin, name), append([]string{"--kubeconfig", k.st.Kubeconfig}, args...)...)
	cmd.Dir = repo
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		return out, fmt.Errorf("%s %s: %w: %s", name, strings.Join(args, " "), err, stderr.String())
	}
	return out, nil
}

func (k *kube) kubectl(args ...string) []byte {
	k.t.Helper()
	out, err := k.run(3*time.Minute, "kubectl", args...)
	if err != nil {
		k.t.Fatal(err)
	}
	return out
}

func (k *kube) helm(args ...string) {
	k.t.Helper()
	out, err := k.run(5*time.Minute, "helm", args...)
	if err != nil {
		k.t.Fatal(err)
	}
	k.t.Logf("helm %s:\n%s", args[0], out)
}

func (k *kube) getJSON(v any, args ...string) {
	k.t.Helper()
	if err := json.Unmarshal(k.kubectl(append(args, "-o", "json")...), v); err != nil {
		k.t.Fatalf("decode kubectl get %v: %v", args, err)
	}
}

// agentPod is the one running, ready agent pod.
func (k *kube) agentPod() corev1.Pod {
	k.t.Helper()
	var pods corev1.PodList
	for deadline := time.Now().Add(3 * time.Minute); ; {
		k.getJSON(&pods, "-n", agentNS, "get", "pods", "-l", "app.kubernetes.io/name=meshwarp")
		var ready []corev1.Pod
		for _, p := range pods.Items {
			if p.DeletionTimestamp == nil && podReady(p) {
				ready = append(ready, p)
			}
		}
		if len(ready) == 1 && len(pods.Items) == 1 {
			return ready[0]
		}
		if time.Now().After(deadline) {
			k.t.Fatalf("no single ready agent pod: %d pods", len(pods.Items))
		}
		time.Sleep(2 * time.Second)
	}
}

func podReady(p corev1.Pod) bool {
	for _, c := range p.Status.Conditions {
		if c.Type == corev1.PodReady {
			return c.Status == corev1.ConditionTrue
		}
	}
	return false
}

// hostPID is the node PID of a container's first process, from containerd.
func (k *kube) hostPID(p corev1.Pod, container string) int {
	k.t.Helper()
	for _, cs := range p.Status.ContainerStatuses {
		if cs.Name != container {
			continue
		}
		id := strings.TrimPrefix(cs.ContainerID, "containerd://")
		out, err := exec.Command("ctr", "--address", k.st.Containerd, "-n", "k8s.io", "task", "ls").Output()
		if err != nil {
			k.t.Fatalf("ctr task ls: %v", err)
		}
		for _, line := range strings.Split(string(out), "\n") {
			f := strings.Fields(line)
			if len(f) >= 2 && f[0] == id {
				pid, _ := strconv.Atoi(f[1])
				return pid
			}
		}
		k.t.Fatalf("container %s of %s (%s) has no task", container, p.Name, id)
	}
	k.t.Fatalf("pod %s has no container %s", p.Name, container)
	return 0
}

func (k *kube) agentStatus() accel.Stats {
	k.t.Helper()
	var s accel.Stats
	out := k.kubectl("-n", agentNS, "exec", "ds/"+release, "--", "/meshwarp-agent", "status", "--json")
	if err := json.Unmarshal(out, &s); err != nil {
		k.t.Fatalf("decode agent status: %v\n%s", err, out)
	}
	return s
}

// client runs `meshwarp lab pod client` in the client pod's app container.
func (k *kube) client(serverIP string, args ...string) lab.ClientResult {
	k.t.Helper()
	out, err := k.run(10*time.Minute, "kubectl", append([]string{"-n", demoNS, "exec", "client", "-c", "app", "--",
		"/meshwarp", "lab", "pod", "client", "--server", serverIP}, args...)...)
	if err != nil {
		k.t.Fatalf("client: %v\n%s", err, out)
	}
	var r lab.ClientResult
	if err := json.Unmarshal(out, &r); err != nil {
		k.t.Fatalf("decode client result: %v\n%s", err, out)
	}
	return r
}

func scrape(t *testing.T, podIP string) string {
	t.Helper()
	hc := http.Client{Timeout: 10 * time.Second}
	resp, err := hc.Get("http://" + podIP + ":9464/metrics")
	if err != nil {
		t.Fatalf("scrape the agent: %v", err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

// sumSeries adds the values of every sample of name whose labels contain all of labels.
func sumSeries(metrics, name string, labels ...string) float64 {
	var sum float64
	sc := bufio.NewScanner(strings.NewReader(metrics))
	sc.Buffer(make([]byte, 1<<20), 1<<20)
next:
	for sc.Scan() {
		line := sc.Text()
		if !strings.HasPrefix(line, name+"{") && !strings.HasPrefix(line, name+" ") {
			continue
		}
		for _, l := range labels {
			if !strings.Contains(line, l) {
				continue next
			}
		}
		f := strings.Fields(line)
		v, err := strconv.ParseFloat(f[len(f)-1], 64)
		if err == nil {
			sum += v
		}
	}
	return sum
}

// Capabilities by number (include/uapi/linux/capability.h) for the ones a
// chart may add.
var capNumber = map[string]uint{
	"CHOWN": 0, "DAC_OVERRIDE": 1, "KILL": 5, "SETGID": 6, "SETUID": 7, "NET_BIND_SERVICE": 10,
	"NET_ADMIN": 12, "NET_RAW": 13, "IPC_LOCK": 14, "SYS_PTRACE": 19, "SYS_ADMIN": 21,
	"SYS_RESOURCE": 24, "PERFMON": 38, "BPF": 39,
}

func procField(t *testing.T, pid int, field string) string {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, field+":"); ok {
			return strings.TrimSpace(v)
		}
	}
	t.Fatalf("/proc/%d/status has no %s", pid, field)
	return ""
}

// cgroup2Path is a process's cgroup v2 path, relative to the v2 mount.
func cgroup2Path(t *testing.T, pid int) string {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/cgroup", pid))
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(string(b), "\n") {
		if p, ok := strings.CutPrefix(line, "0::"); ok {
			return p
		}
	}
	t.Fatalf("process %d is in no cgroup v2", pid)
	return ""
}

func sockopsAttached(t *testing.T, cgroup string) int {
	t.Helper()
	f, err := os.Open(cgroup)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	r, err := link.QueryPrograms(link.QueryOptions{Target: int(f.Fd()), Attach: ebpf.AttachCGroupSockOps})
	if err != nil {
		t.Fatalf("query sock_ops programs of %s: %v", cgroup, err)
	}
	return len(r.Programs)
}

func sysctls(t *testing.T, keys []string) []string {
	t.Helper()
	var v []string
	for _, k := range keys {
		b, err := os.ReadFile("/proc/sys/" + k)
		if err != nil {
			t.Fatal(err)
		}
		v = append(v, k+"="+strings.TrimSpace(string(b)))
	}
	return v
}

func TestPrivilegedCluster(t *testing.T) {
	testutil.RequirePrivileged(t)
	// A fresh cluster: whatever an earlier run or a user left up goes first.
	script(t, 10*time.Minute, "down")
	// The kubelet sets these at start; the node's values must hold while the
	// cluster runs (panic settings) and come back with down (all).
	kernel := []string{"kernel/panic", "kernel/panic_on_oops", "vm/overcommit_memory"}
	node := sysctls(t, kernel)
	// Registered before up: down also cleans after a failed up.
	t.Cleanup(func() {
		t1 := time.Now()
		script(t, 10*time.Minute, "down")
		t.Logf("down took %s", time.Since(t1).Round(time.Second))
		if after := sysctls(t, kernel); fmt.Sprint(after) != fmt.Sprint(node) {
			t.Errorf("kernel settings after down %v, before up %v", after, node)
		}
	})
	t0 := time.Now()
	script(t, 60*time.Minute, "up")
	t.Logf("up took %s", time.Since(t0).Round(time.Second))
	if during := sysctls(t, kernel[:2]); fmt.Sprint(during) != fmt.Sprint(node[:2]) {
		t.Errorf("kernel panic settings while the cluster runs %v, the node's %v", during, node[:2])
	}
	var st clusterStatus
	if err := json.Unmarshal(script(t, 3*time.Minute, "status", "--json"), &st); err != nil {
		t.Fatalf("decode status: %v", err)
	}
	if !st.NodeReady || !st.DaemonSetReady || len(st.Agent) == 0 || string(st.Agent) == "null" {
		t.Fatalf("status after up: %+v", st)
	}
	k := &kube{t: t, st: st}

	var server, client corev1.Pod
	k.getJSON(&server, "-n", demoNS, "get", "pod", "server")
	k.getJSON(&client, "-n", demoNS, "get", "pod", "client")
	serverIP := server.Status.PodIP

	t.Run("agent pod has exactly the chart's capabilities and mounts", func(t *testing.T) {
		k := &kube{t: t, st: st}
		var ds appsv1.DaemonSet
		k.getJSON(&ds, "-n", agentNS, "get", "ds", release)
		c := ds.Spec.Template.Spec.Containers[0]
		var want uint64
		for _, name := range c.SecurityContext.Capabilities.Add {
			n, ok := capNumber[string(name)]
			if !ok {
				t.Fatalf("capability %s: add it to capNumber", name)
			}
			want |= 1 << n
		}
		pid := k.hostPID(k.agentPod(), "agent")
		for _, set := range []string{"CapEff", "CapPrm", "CapBnd"} {
			got, err := strconv.ParseUint(procField(t, pid, set), 16, 64)
			if err != nil {
				t.Fatal(err)
			}
			if got != want {
				t.Errorf("%s of the agent = %#x, the chart's capabilities %v = %#x", set, got, c.SecurityContext.Capabilities.Add, want)
			}
		}
		t.Logf("agent pid %d: CapEff %s (chart: %v), Seccomp %s", pid, procField(t, pid, "CapEff"),
			c.SecurityContext.Capabilities.Add, procField(t, pid, "Seccomp"))
		if s := procField(t, pid, "Seccomp"); s != "0" {
			t.Errorf("agent seccomp mode %s, the chart says Unconfined (0)", s)
		}
		if s := procField(t, pid, "NoNewPrivs"); s != "1" {
			t.Errorf("agent NoNewPrivs %s, the chart says allowPrivilegeEscalation: false", s)
		}
		mi, err := os.ReadFile(fmt.Sprintf("/proc/%d/mountinfo", pid))
		if err != nil {
			t.Fatal(err)
		}
		mounts := map[string]string{} // mount point -> options
		for _, line := range strings.Split(string(mi), "\n") {
			f := strings.Fields(line)
			if len(f) > 5 {
				mounts[f[4]] = f[5]
			}
		}
		for _, m := range c.VolumeMounts {
			opts, ok := mounts[m.MountPath]
			if !ok {
				t.Errorf("chart mount %s (%s) not in the agent's mount namespace", m.MountPath, m.Name)
				continue
			}
			if m.ReadOnly != strings.HasPrefix(opts, "ro") {
				t.Errorf("mount %s: options %s, chart readOnly %v", m.MountPath, opts, m.ReadOnly)
			}
		}
		if !strings.HasPrefix(mounts["/"], "ro") {
			t.Errorf("root filesystem %s, the chart says readOnlyRootFilesystem", mounts["/"])
		}
		var probe struct {
			Ready   bool   `json:"ready"`
			Verdict string `json:"verdict"`
		}
		out := k.kubectl("-n", agentNS, "exec", "ds/"+release, "--", "/meshwarp-agent", "probe", "--json")
		if err := json.Unmarshal(out, &probe); err != nil || !probe.Ready {
			t.Errorf("probe in the agent pod: ready=%v %s (%v)\n%s", probe.Ready, probe.Verdict, err, out)
		}
	})

	t.Run("agent attaches where the pods' processes are", func(t *testing.T) {
		k := &kube{t: t, st: st}
		// The chart's default cgroupPath (empty): the agent finds the pods cgroup.
		logs := string(k.kubectl("-n", agentNS, "logs", k.agentPod().Name))
		m := regexp.MustCompile(`acceleration attached.*cgroup=(\S+)`).FindStringSubmatch(logs)
		if m == nil {
			t.Fatalf("no attach line in the agent's logs:\n%s", logs)
		}
		attach := strings.TrimPrefix(m[1], "/host")
		if attach != st.PodsCgroup {
			t.Errorf("agent attached to %q, the pods' cgroup is %q", attach, st.PodsCgroup)
		}
		for _, p := range []struct {
			pod       corev1.Pod
			container string
		}{{server, "app"}, {server, "sidecar"}, {client, "app"}, {client, "sidecar"}} {
			cg := filepath.Join(st.Cgroup2Mount, cgroup2Path(t, k.hostPID(p.pod, p.container)))
			if !strings.HasPrefix(cg, attach+"/") {
				t.Errorf("%s/%s runs in cgroup %s, not under the agent's %s", p.pod.Name, p.container, cg, attach)
			}
		}
		if n := sockopsAttached(t, attach); n != 1 {
			t.Errorf("%d sock_ops programs on %s, want meshwarp's 1", n, attach)
		}
	})

	t.Run("client to server through both sidecars is accelerated on every hop", func(t *testing.T) {
		k := &kube{t: t, st: st}
		agent := k.agentPod()
		before := k.agentStatus()
		mBefore := scrape(t, agent.Status.PodIP)
		const n = 200
		r := k.client(serverIP, "--requests", strconv.Itoa(n), "--echoes", strconv.Itoa(n))
		if r.RequestsOK != n || r.EchoesOK != n || len(r.Errors) > 0 {
			t.Fatalf("client: %+v", r)
		}
		after := k.agentStatus()
		for _, hop := range []string{"app_to_sidecar", "sidecar_to_sidecar", "sidecar_to_app"} {
			d := after.Hops[hop].PairedConnections - before.Hops[hop].PairedConnections
			// Per pod pair: one HTTP and one echo connection, on every hop.
			if d < 2 {
				t.Errorf("hop %s: %d new paired connections, want >= 2 (status %+v)", hop, d, after.Hops)
			}
			if after.Hops[hop].RedirectedBytes <= before.Hops[hop].RedirectedBytes {
				t.Errorf("hop %s: no redirected bytes", hop)
			}
		}
		m := scrape(t, agent.Status.PodIP)
		for _, hop := range []string{"app_to_sidecar", "sidecar_to_sidecar", "sidecar_to_app"} {
			l := `hop="` + hop + `"`
			if sumSeries(m, "meshwarp_accel_hop_paired_connections_total", l) <= sumSeries(mBefore, "meshwarp_accel_hop_paired_connections_total", l) {
				t.Errorf("/metrics: meshwarp_accel_hop_paired_connections_total{%s} did not grow", l)
			}
		}
		// RED: the server app's requests, once each (not once per proxy).
		got := sumSeries(m, "http_server_request_duration_seconds_count", `server_port="8080"`) -
			sumSeries(mBefore, "http_server_request_duration_seconds_count", `server_port="8080"`)
		if got < n {
			t.Errorf("http_server_request_duration_seconds_count{server_port=8080} grew by %v, want >= %d", got, n)
		}
		// The dashboard's queries: every metric they select is served.
		d, err := os.ReadFile(filepath.Join(repo, "deploy/grafana/meshwarp.json"))
		if err != nil {
			t.Fatal(err)
		}
		for _, name := range regexp.MustCompile(`\b((?:meshwarp|http)_[a-z_]+)\{`).FindAllStringSubmatch(string(d), -1) {
			base := name[1]
			if !strings.Contains(m, "\n"+base+"{") && !strings.Contains(m, "\n"+base+" ") &&
				!strings.Contains(m, "# TYPE "+strings.TrimSuffix(strings.TrimSuffix(strings.TrimSuffix(base, "_bucket"), "_count"), "_sum")+" ") {
				t.Errorf("dashboard query metric %s: not served by the agent", base)
			}
		}
	})

	t.Run("helm upgrade under 100 streams: nothing lost, data path adopted", func(t *testing.T) {
		k := &kube{t: t, st: st}
		old := k.agentPod()
		pinsBefore, _ := os.ReadDir(st.PinDir)
		done := make(chan lab.ClientResult, 1)
		// Echo streams: lockstep writes and reads, so they stay accelerated
		// (not small_stream); each is 6 sockets on 3 hops.
		go func() {
			done <- k.client(serverIP, "--streams", "100", "--duration", "90s", "--size", "512")
		}()
		time.Sleep(15 * time.Second)
		s1 := k.agentStatus()
		if s1.AcceleratedSockets < 600 {
			t.Errorf("%d accelerated sockets under 100 streams before the upgrade, want >= 600", s1.AcceleratedSockets)
		}
		k.helm("upgrade", release, "deploy/helm/meshwarp", "-n", agentNS, "--reuse-values", "--set", "image.tag=cluster-b", "--wait", "--timeout", "4m")
		k.kubectl("-n", agentNS, "rollout", "status", "ds/"+release, "--timeout=180s")
		now := k.agentPod()
		if now.Name == old.Name || !strings.HasSuffix(now.Spec.Containers[0].Image, ":cluster-b") {
			t.Fatalf("no rolling update: pod %s image %s", now.Name, now.Spec.Containers[0].Image)
		}
		// The new pod reads the adopted maps: the streams' sockets are still
		// paired, and the counters went on from where the old pod left them.
		time.Sleep(3 * time.Second)
		s2 := k.agentStatus()
		if s2.AcceleratedSockets < 600 || s2.RedirectedBytes <= s1.RedirectedBytes {
			t.Errorf("after the upgrade: %d accelerated sockets (want >= 600), redirected bytes %d -> %d",
				s2.AcceleratedSockets, s1.RedirectedBytes, s2.RedirectedBytes)
		}
		t.Logf("accelerated sockets before/after the upgrade: %d/%d; redirected bytes %d -> %d",
			s1.AcceleratedSockets, s2.AcceleratedSockets, s1.RedirectedBytes, s2.RedirectedBytes)
		var r lab.ClientResult
		select {
		case r = <-done:
		case <-time.After(5 * time.Minute):
			t.Fatal("streams did not finish")
		}
		if r.StreamsOK != 100 || r.Mismatches != 0 || r.Resets != 0 || r.StreamBytes != r.StreamBytesBck || len(r.Errors) > 0 {
			t.Errorf("streams across the upgrade: %+v", r)
		}
		t.Logf("streams: %d ok, %d bytes each way", r.StreamsOK, r.StreamBytes)
		logs := string(k.kubectl("-n", agentNS, "logs", now.Name))
		if !regexp.MustCompile(`acceleration attached.*adopted[=":]+true`).MatchString(logs) {
			t.Errorf("new agent did not adopt the pinned data path:\n%s", logs)
		}
		pinsAfter, _ := os.ReadDir(st.PinDir)
		if len(pinsBefore) == 0 || len(pinsAfter) != len(pinsBefore) {
			t.Errorf("pins before %d, after %d", len(pinsBefore), len(pinsAfter))
		}
		if n := sockopsAttached(t, st.PodsCgroup); n != 1 {
			t.Errorf("%d sock_ops programs after the upgrade, want 1", n)
		}
	})

	t.Run("policy change in the ConfigMap reaches the agent and is applied", func(t *testing.T) {
		k := &kube{t: t, st: st}
		agent := k.agentPod()
		k.helm("upgrade", release, "deploy/helm/meshwarp", "-n", agentNS, "--reuse-values",
			"--set", fmt.Sprintf("policy.excludePorts[0]=%d", lab.TCPEchoPort), "--wait")
		deadline := time.Now().Add(3 * time.Minute)
		for !strings.Contains(string(k.kubectl("-n", agentNS, "logs", agent.Name)), "policy reloaded") {
			if time.Now().After(deadline) {
				t.Fatal("agent did not reload the policy within 3 minutes")
			}
			time.Sleep(2 * time.Second)
		}
		if now := k.agentPod(); now.Name != agent.Name {
			t.Errorf("the policy change restarted the agent (%s -> %s)", agent.Name, now.Name)
		}
		before := k.agentStatus()
		if r := k.client(serverIP, "--echoes", "20"); r.EchoesOK != 20 {
			t.Fatalf("echo with the port excluded: %+v", r)
		}
		after := k.agentStatus()
		for hop, h := range after.Hops {
			if d := h.PairedConnections - before.Hops[hop].PairedConnections; d != 0 {
				t.Errorf("hop %s: %d connections paired to the excluded port %d", hop, d, lab.TCPEchoPort)
			}
		}
		if r := k.client(serverIP, "--requests", "20"); r.RequestsOK != 20 {
			t.Fatalf("http: %+v", r)
		}
		if d := k.agentStatus().Hops["sidecar_to_app"].PairedConnections - after.Hops["sidecar_to_app"].PairedConnections; d == 0 {
			t.Errorf("port %d no longer accelerated after excluding %d", lab.HTTPPort, lab.TCPEchoPort)
		}
	})

	t.Run("helm uninstall detaches everything, traffic goes on", func(t *testing.T) {
		k := &kube{t: t, st: st}
		// The stopping pod's own account of its exit, followed while it stops.
		ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
		defer cancel()
		follow := exec.CommandContext(ctx, filepath.Join(st.Bin, "kubectl"), "--kubeconfig", st.Kubeconfig,
			"-n", agentNS, "logs", "-f", k.agentPod().Name)
		var logs bytes.Buffer
		follow.Stdout = &logs
		if err := follow.Start(); err != nil {
			t.Fatal(err)
		}
		time.Sleep(time.Second)
		k.helm("uninstall", release, "-n", agentNS, "--wait", "--timeout", "3m")
		deadline := time.Now().Add(2 * time.Minute)
		for {
			var pods corev1.PodList
			k.getJSON(&pods, "-n", agentNS, "get", "pods", "-l", "app.kubernetes.io/name=meshwarp")
			if len(pods.Items) == 0 {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("agent pod still there after uninstall")
			}
			time.Sleep(2 * time.Second)
		}
		_ = follow.Wait()
		if !regexp.MustCompile(`msg="on exit" keep=false`).MatchString(logs.String()) ||
			!strings.Contains(logs.String(), "acceleration uninstalled") {
			t.Errorf("the stopping agent did not decide to uninstall:\n%s", logs.String())
		}
		t.Logf("agent's exit: %s", regexp.MustCompile(`.*msg="on exit".*`).FindString(logs.String()))
		if pins, err := os.ReadDir(st.PinDir); err == nil && len(pins) > 0 {
			t.Errorf("pinned after uninstall: %d entries in %s", len(pins), st.PinDir)
		}
		if n := sockopsAttached(t, st.PodsCgroup); n != 0 {
			t.Errorf("%d sock_ops programs still attached to %s", n, st.PodsCgroup)
		}
		if r := k.client(serverIP, "--requests", "20", "--echoes", "20"); r.RequestsOK != 20 || r.EchoesOK != 20 {
			t.Errorf("traffic after uninstall: %+v", r)
		}
	})
}
