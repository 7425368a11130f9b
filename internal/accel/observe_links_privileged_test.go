// SPDX-License-Identifier: Apache-2.0

package accel

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"

	"github.com/meshwarp/meshwarp/internal/testutil"
)

// Observation rides in the cgroup_skb programs of the data path: one
// program per packet each way, switched in place by a restart with or
// without --observe. A restart over an earlier agent that had observation
// links of their own (mw_obs_egress_link, mw_obs_ingress_link) removes them:
// the cgroup ends with one program each way, and `meshwarp trace`/`top`
// (ReadPinnedFlows) read the observation only while the agent observes.
func TestPrivilegedObservationInTheDataPathPrograms(t *testing.T) {
	testutil.RequirePrivileged(t)
	a := startAgent(t, Config{Observe: true})
	cg, pinDir := a.cfg.CgroupPath, a.cfg.PinDir
	requireObserving(t, pinDir, true)
	requireCgroupPrograms(t, cg, 1)

	// An earlier agent's observation links, each way.
	for i, attach := range []ebpf.AttachType{ebpf.AttachCGroupInetEgress, ebpf.AttachCGroupInetIngress} {
		prog := map[ebpf.AttachType]*ebpf.Program{ebpf.AttachCGroupInetEgress: a.objs.MwEgressObs, ebpf.AttachCGroupInetIngress: a.objs.MwIngressObs}[attach]
		l, err := link.AttachCgroup(link.CgroupOptions{Path: cg, Attach: attach, Program: prog})
		if err != nil {
			t.Fatal(err)
		}
		if err := l.Pin(filepath.Join(pinDir, retiredLinkPins[i])); err != nil {
			t.Fatal(err)
		}
		l.Close()
	}
	requireCgroupPrograms(t, cg, 2)
	if err := a.Close(); err != nil {
		t.Fatal(err)
	}

	for _, observe := range []bool{false, true} {
		b := startAgent(t, Config{CgroupPath: cg, PinDir: pinDir, Observe: observe})
		for _, name := range retiredLinkPins {
			if _, err := os.Stat(filepath.Join(pinDir, name)); err == nil {
				t.Fatalf("observe=%v: %s is still pinned", observe, name)
			}
		}
		requireCgroupPrograms(t, cg, 1)
		requireObserving(t, pinDir, observe)
		if _, err := ReadPinnedFlows(pinDir); (err == nil) != observe {
			t.Fatalf("observe=%v: ReadPinnedFlows: %v", observe, err)
		}
		if err := b.Close(); err != nil {
			t.Fatal(err)
		}
	}
}

func requireObserving(t *testing.T, pinDir string, want bool) {
	t.Helper()
	got, err := Observing(pinDir)
	if err != nil || got != want {
		t.Fatalf("Observing(%s) = %v, %v; want %v", pinDir, got, err, want)
	}
}

// requireCgroupPrograms requires n cgroup_skb programs each way on cg.
func requireCgroupPrograms(t *testing.T, cg string, n int) {
	t.Helper()
	f, err := os.Open(cg)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	for _, attach := range []ebpf.AttachType{ebpf.AttachCGroupInetEgress, ebpf.AttachCGroupInetIngress} {
		q, err := link.QueryPrograms(link.QueryOptions{Target: int(f.Fd()), Attach: attach})
		if err != nil {
			t.Fatal(err)
		}
		if len(q.Programs) != n {
			t.Fatalf("%v: %d programs on %s, want %d", attach, len(q.Programs), cg, n)
		}
	}
}
