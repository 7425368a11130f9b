// SPDX-License-Identifier: Apache-2.0

// Package image tests the agent's container image: built with podman from
// deploy/image/Containerfile, it runs meshwarp-agent; run with exactly the
// chart's capabilities (not privileged), it probes ready and accelerates a
// cgroup of the host.
package image

import (
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/meshwarp/meshwarp/internal/accel"
	"github.com/meshwarp/meshwarp/internal/probe"
	"github.com/meshwarp/meshwarp/internal/testutil"
)

func podman(t *testing.T, args ...string) (string, error) {
	t.Helper()
	out, err := exec.Command("podman", args...).CombinedOutput()
	return string(out), err
}

func TestPrivilegedImageRunsTheAgent(t *testing.T) {
	testutil.RequirePrivileged(t)
	image := "localhost/meshwarp-test:" + strconv.Itoa(os.Getpid())
	build := exec.Command("./build.sh", image)
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("build.sh: %v\n%s", err, out)
	}
	t.Cleanup(func() { podman(t, "rmi", "-f", image) })
	// The chart passes only args: the entrypoint must be the agent binary.
	if out, err := podman(t, "image", "inspect", "--format", "{{json .Config.Entrypoint}}", image); err != nil || strings.TrimSpace(out) != `["/meshwarp-agent"]` {
		t.Fatalf("image entrypoint: %v %s, want [\"/meshwarp-agent\"]", err, out)
	}

	cgroot, err := probe.Cgroup2Root()
	if err != nil {
		t.Fatal(err)
	}
	// The chart's pod: no host network, read-only root, all capabilities
	// dropped but BPF, NET_ADMIN, PERFMON and SYS_ADMIN, seccomp off, the
	// node's bpffs, cgroup v2 tree and tracefs mounted. runc and explicit
	// ulimits because this machine's crun refuses its hybrid cgroup layout.
	pod := []string{"--runtime", "runc", "run", "--network", "none", "--read-only",
		"--ulimit", "nofile=1024:1024", "--ulimit", "nproc=4096:4096",
		"--cap-drop", "ALL", "--cap-add", "BPF,NET_ADMIN,PERFMON,SYS_ADMIN", "--security-opt", "seccomp=unconfined",
		"-v", "/sys/fs/bpf:/sys/fs/bpf", "-v", cgroot + ":/host/sys/fs/cgroup", "-v", "/sys/kernel/tracing:/sys/kernel/tracing"}

	out, err := podman(t, append(append([]string{}, pod...), "--rm", image, "probe")...)
	if err != nil || !strings.Contains(out, "ready: this kernel can accelerate") {
		t.Fatalf("meshwarp probe in the image: %v\n%s", err, out)
	}

	cgroup := testutil.EnterCgroup(t)
	pinDir := testutil.PinDir(t)
	inside := "/host/sys/fs/cgroup" + strings.TrimPrefix(cgroup, cgroot)
	name := "meshwarp-test-agent-" + strconv.Itoa(os.Getpid())
	t.Cleanup(func() { podman(t, "rm", "-f", name) })
	if out, err := podman(t, append(append([]string{}, pod...), "-d", "--name", name, image,
		"run", "--cgroup="+inside, "--pin-dir="+pinDir, "--metrics-addr=")...); err != nil {
		t.Fatalf("start the agent container: %v\n%s", err, out)
	}
	deadline := time.Now().Add(60 * time.Second)
	for {
		if _, err := os.Stat(filepath.Join(pinDir, "mw_sockops_link")); err == nil {
			break
		}
		if time.Now().After(deadline) {
			logs, _ := podman(t, "logs", name)
			t.Fatalf("the agent in the container never attached:\n%s", logs)
		}
		time.Sleep(50 * time.Millisecond) // polling interval
	}

	ln, err := net.Listen("tcp", "127.0.0.1:0") // in the accelerated cgroup
	if err != nil {
		t.Fatal(err)
	}
	srv := testutil.ServeEcho(ln)
	defer srv.Close()
	const conns = 20
	res := testutil.CheckIntegrity(func() (net.Conn, error) { return net.Dial("tcp", ln.Addr().String()) },
		testutil.IntegrityOptions{Conns: conns, Messages: 10, MaxSize: 32 << 10, Seed: 3})
	if err := res.Err(); err != nil {
		t.Fatal(err)
	}
	st, err := accel.ReadPinnedStats(pinDir)
	if err != nil {
		t.Fatal(err)
	}
	if st.PairedSockets < 2*conns*95/100 {
		t.Fatalf("the containerised agent paired %d sockets of %d connections", st.PairedSockets, conns)
	}

	// The pod stops (SIGTERM, no keep flag): the agent uninstalls.
	if out, err := podman(t, "stop", "-t", "30", name); err != nil {
		t.Fatalf("podman stop: %v\n%s", err, out)
	}
	if _, err := os.Stat(filepath.Join(pinDir, "mw_sockops_link")); err == nil {
		logs, _ := podman(t, "logs", name)
		t.Fatalf("the stopped agent left its data path pinned:\n%s", logs)
	}
}
