// SPDX-License-Identifier: Apache-2.0

package probe

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"
	"golang.org/x/sys/unix"
)

func requireRoot(t *testing.T) {
	t.Helper()
	if os.Geteuid() != 0 {
		const why = "needs root: loads BPF programs, attaches links, mounts bpffs (run the tests as root, e.g. sudo go test)"
		// testutil.RequireEnv (testutil imports this package, so not by name).
		if os.Getenv("MESHWARP_REQUIRE_PRIVILEGED") != "" {
			t.Fatal(why)
		}
		t.Skip(why)
	}
}

// leftovers lists meshwarp-probe-* entries under dir.
func leftovers(t *testing.T, dir string) []string {
	t.Helper()
	m, err := filepath.Glob(filepath.Join(dir, tempPrefix+"*"))
	if err != nil {
		t.Fatal(err)
	}
	return m
}

// TestPrivilegedProbe runs the real probe on this machine, which DESIGN.md
// says can accelerate: every required check must be ok, and nothing the
// probe created may remain.
func TestPrivilegedProbe(t *testing.T) {
	requireRoot(t)
	r := Run(Options{MountBPFFS: true})
	for _, c := range r.Checks {
		t.Logf("%-36s %-7s required=%-5v %s", c.Name, c.Status, c.Required, c.Detail)
		if c.Required && c.Status != StatusOK {
			t.Errorf("required check %q is %s: %s (fix: %s)", c.Name, c.Status, c.Detail, c.Fix)
		}
	}
	if !r.Ready || r.Err() != nil || r.Verdict != verdictReady {
		t.Errorf("Ready=%v Err=%v Verdict=%q", r.Ready, r.Err(), r.Verdict)
	}
	if r.Kernel == "" {
		t.Error("no kernel release")
	}
	for _, name := range []string{CheckBPFFS, CheckBPFFSWritable, CheckCgroup2, CheckBTF, CheckAtomicCmpXchg,
		CheckCgroupLink, CheckSockmapLink, "sock_ops: bpf_timer_init", "sk_msg: bpf_msg_redirect_map", "map SOCKMAP"} {
		if _, ok := r.Check(name); !ok {
			t.Errorf("no %q row", name)
		}
	}
	if !hasMagic(DefaultBPFFSPath, unix.BPF_FS_MAGIC) {
		t.Error("bpffs not mounted at /sys/fs/bpf after a probe with MountBPFFS")
	}
	if left := leftovers(t, DefaultBPFFSPath); len(left) > 0 {
		t.Errorf("left behind on bpffs: %v", left)
	}
	if root, err := Cgroup2Root(); err == nil {
		if left := leftovers(t, root); len(left) > 0 {
			t.Errorf("left behind in cgroupfs: %v", left)
		}
	}
}

// TestPrivilegedProbeNoBPFFS points the pin path at a plain directory and
// forbids mounting: the probe must refuse, naming bpffs and the command.
func TestPrivilegedProbeNoBPFFS(t *testing.T) {
	requireRoot(t)
	dir := t.TempDir()
	r := Run(Options{BPFFSPath: dir})
	if r.Ready {
		t.Fatal("Ready without bpffs")
	}
	c, _ := r.Check(CheckBPFFS)
	if c.Status != StatusMissing || !strings.Contains(c.Fix, "mount -t bpf bpf "+dir) {
		t.Errorf("bpffs row = %+v", c)
	}
	err := r.Err()
	if err == nil || !strings.Contains(err.Error(), "bpffs") || !strings.Contains(err.Error(), "mount -t bpf bpf "+dir) {
		t.Errorf("Err() = %v; want it to name bpffs and the mount command", err)
	}
	if c, _ := r.Check(CheckBPFFSWritable); c.Status == StatusOK {
		t.Errorf("bpffs writable ok on a plain directory: %+v", c)
	}
}

// TestPrivilegedProbeMountsBPFFS lets the probe mount bpffs on a scratch
// directory (not /sys/fs/bpf, which other tests share) and unmounts it.
func TestPrivilegedProbeMountsBPFFS(t *testing.T) {
	requireRoot(t)
	dir := t.TempDir()
	r := Run(Options{BPFFSPath: dir, MountBPFFS: true})
	t.Cleanup(func() {
		if hasMagic(dir, unix.BPF_FS_MAGIC) {
			if err := unix.Unmount(dir, 0); err != nil {
				t.Errorf("unmount %s: %v", dir, err)
			}
		}
	})
	c, _ := r.Check(CheckBPFFS)
	if c.Status != StatusOK || !strings.Contains(c.Detail, "mounted it") {
		t.Errorf("bpffs row = %+v; want ok, mounted by the probe", c)
	}
	if c, _ := r.Check(CheckBPFFSWritable); c.Status != StatusOK {
		t.Errorf("bpffs writable row = %+v", c)
	}
	if !r.Ready {
		t.Errorf("not ready: %v", r.Err())
	}
	if left := leftovers(t, dir); len(left) > 0 {
		t.Errorf("left behind: %v", left)
	}
}

// TestPrivilegedAtomicProbeRejects checks that the atomics probe reads a
// verifier rejection of the opcode as "not supported" (what a kernel < 5.12
// does with cmpxchg), using an opcode no kernel knows.
func TestPrivilegedAtomicProbeRejects(t *testing.T) {
	requireRoot(t)
	if err := probeAtomic(asm.CmpXchg); err != nil {
		t.Fatalf("cmpxchg: %v", err)
	}
	err := probeAtomic(asm.AtomicOp(0x0000_d100)) // BPF_FETCH | 0xd0: undefined
	if !errors.Is(err, ebpf.ErrNotSupported) {
		t.Errorf("undefined atomic op: %v; want ErrNotSupported", err)
	}
}

// TestPrivilegedProbeKernelFeatures checks the kernel-dependent rows on the
// running kernel (the host, and each VM of scripts/vmtest.sh): every feature
// is listed, off ones say why and from which release, and the answers agree
// with the release where it is known when the kernel gained the feature.
// The probe itself never decides by version; this test does, as a second
// opinion.
func TestPrivilegedProbeKernelFeatures(t *testing.T) {
	requireRoot(t)
	r := Run(Options{MountBPFFS: true})
	if !r.Ready {
		t.Fatalf("not ready on Linux %s (supported: >= %s): %s", r.Kernel, MinKernel, r.Verdict)
	}
	got := map[string]Feature{}
	for _, f := range r.Features {
		t.Logf("%-22s on=%-5v how=%q reason=%q", f.Name, f.On, f.How, f.Reason)
		got[f.Name] = f
		if !f.On && !strings.Contains(f.Reason, "Linux ") {
			t.Errorf("%s is off without naming the kernel that has it: %q", f.Name, f.Reason)
		}
		if f.On && f.How == "" {
			t.Errorf("%s is on without saying how", f.Name)
		}
	}
	p := &prober{}
	p.version, _ = parseKernelRelease(r.Kernel)
	for _, want := range []struct {
		name    string
		on      bool
		howHas  string // when on
		release string // the feature is on from this release
	}{
		{FeatureSkMsgAttach, true, "link", kernelLinkSock},
		{FeatureTap, true, "link", kernelLinkSock},
		{FeatureCrossNode, true, "tcx", kernelTCX},
		{FeatureClientRead, true, "sock_recv_length", kernelRecvTP},
		{FeatureRedirectLoad, true, "", ""},
		{FeatureFIONREAD, true, "msg_tot_len", "6.12.75"},
	} {
		f, ok := got[want.name]
		if !ok {
			t.Errorf("no feature row %q", want.name)
			continue
		}
		if want.release == "" {
			if !f.On {
				t.Errorf("%s off: %s", f.Name, f.Reason)
			}
			continue
		}
		newEnough := p.kernelAtLeast(want.release)
		switch {
		case newEnough && !f.On:
			t.Errorf("%s off on Linux %s (>= %s): %s", f.Name, r.Kernel, want.release, f.Reason)
		case newEnough && !strings.Contains(f.How, want.howHas):
			t.Errorf("%s on Linux %s (>= %s) done by %q, want %s", f.Name, r.Kernel, want.release, f.How, want.howHas)
		case !newEnough && f.Name != FeatureSkMsgAttach && f.On:
			t.Errorf("%s on for Linux %s (< %s): %s", f.Name, r.Kernel, want.release, f.How)
		case !newEnough && f.Name == FeatureSkMsgAttach && (!f.On || !strings.Contains(f.How, "BPF_PROG_ATTACH")):
			t.Errorf("%s on Linux %s (< %s): on=%v how=%q, want BPF_PROG_ATTACH", f.Name, r.Kernel, want.release, f.On, f.How)
		}
	}
	if c, _ := r.Check(CheckSockmapLink); c.Required {
		t.Errorf("%s is required; kernels without it attach with BPF_PROG_ATTACH", c.Name)
	}
}
