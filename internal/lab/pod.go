// SPDX-License-Identifier: Apache-2.0

package lab

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
)

// The pieces of a lab pod, for running the lab's pods as containers on a real
// cluster (test/cluster): the same capture rules and the same HAProxy sidecar
// config as `meshwarp lab up`, applied from inside a pod instead of from the
// node. `meshwarp lab pod capture|sidecar|apps` runs them.

// CaptureRules returns iptables-restore input (for --noflush) that installs the
// lab's Istio-style capture in the current network namespace: the MESHWARP_
// chains and the two jumps into them (what an Istio init container does).
func CaptureRules(sidecarUID uint32) string {
	var b strings.Builder
	b.WriteString(strings.TrimSuffix(captureChains(sidecarUID), "COMMIT\n"))
	for _, rule := range jumpRules() {
		fmt.Fprintf(&b, "-A %s\n", strings.Join(rule, " "))
	}
	b.WriteString("COMMIT\n")
	return b.String()
}

// ApplyCapture installs CaptureRules in the current network namespace with
// iptables-restore. Applied once, by an init container, in a fresh namespace.
func ApplyCapture(ctx context.Context, sidecarUID uint32) error {
	cmd := exec.CommandContext(ctx, "iptables-restore", "-w", "--noflush")
	cmd.Stdin = strings.NewReader(CaptureRules(sidecarUID))
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("iptables-restore capture rules: %w: %s", err, strings.TrimSpace(string(out)))
	}
	return nil
}

// SidecarConfig renders the lab's HAProxy sidecar config: outbound :15001 and
// inbound :15006, mode http for httpPorts, running as uid/gid.
func SidecarConfig(uid, gid uint32, statsSocket string, httpPorts []int) (string, error) {
	return sidecarConfig{UID: uid, GID: gid, StatsSocket: statsSocket, HTTPPorts: httpPorts, MaxConn: podMaxConn()}.render()
}

// podMaxConn is the lab's maxconn, or less when the container's file limit
// cannot hold it: HAProxy needs about two descriptors per connection and
// cannot raise the hard limit without CAP_SYS_RESOURCE.
func podMaxConn() int {
	var lim syscall.Rlimit
	if err := syscall.Getrlimit(syscall.RLIMIT_NOFILE, &lim); err != nil || lim.Max >= 2*maxConn+100 {
		return maxConn
	}
	return max(int(lim.Max/2)-50, 100)
}

// ExecSidecar writes the sidecar config into dir and replaces the current
// process with HAProxy in the foreground (-db), as the lab starts it.
func ExecSidecar(dir string, uid, gid uint32, httpPorts []int) error {
	cfg, err := SidecarConfig(uid, gid, filepath.Join(dir, "haproxy.sock"), httpPorts)
	if err != nil {
		return err
	}
	path := filepath.Join(dir, "haproxy.cfg")
	if err := os.WriteFile(path, []byte(cfg), 0o644); err != nil {
		return fmt.Errorf("write haproxy config: %w", err)
	}
	haproxy, err := exec.LookPath("haproxy")
	if err != nil {
		return fmt.Errorf("find haproxy: %w", err)
	}
	if err := syscall.Exec(haproxy, []string{haproxy, "-db", "-f", path}, os.Environ()); err != nil {
		return fmt.Errorf("exec haproxy: %w", err)
	}
	return nil
}
