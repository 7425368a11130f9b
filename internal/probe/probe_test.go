// SPDX-License-Identifier: Apache-2.0

package probe

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"
	"golang.org/x/sys/unix"
)

// statusFixture is /proc/self/status as root on the project machine: every
// capability but CAP_SYS_RESOURCE (bit 24).
const statusFixture = `Name:	meshwarp
Umask:	0022
State:	R (running)
Uid:	0	0	0	0
CapInh:	0000000000000000
CapPrm:	000001fffeffffff
CapEff:	000001fffeffffff
CapBnd:	000001fffeffffff
CapAmb:	0000000000000000
NoNewPrivs:	0
`

func TestParseCapEff(t *testing.T) {
	caps, err := parseCapEff(strings.NewReader(statusFixture))
	if err != nil {
		t.Fatal(err)
	}
	if caps != 0x1fffeffffff {
		t.Fatalf("CapEff = %#x, want 0x1fffeffffff", uint64(caps))
	}
	for _, c := range []int{unix.CAP_BPF, unix.CAP_NET_ADMIN, unix.CAP_PERFMON, unix.CAP_SYS_ADMIN} {
		if !caps.Has(c) {
			t.Errorf("%s not in %#x", capNames[c], uint64(caps))
		}
	}
	if caps.Has(unix.CAP_SYS_RESOURCE) {
		t.Errorf("CAP_SYS_RESOURCE in %#x, want absent", uint64(caps))
	}
	if caps.Has(64) || caps.Has(-1) {
		t.Error("out-of-range capability reported present")
	}

	// Only CAP_NET_ADMIN (12) and CAP_BPF (39).
	caps, err = parseCapEff(strings.NewReader("CapEff:\t0000008000001000\n"))
	if err != nil {
		t.Fatal(err)
	}
	if !caps.Has(unix.CAP_NET_ADMIN) || !caps.Has(unix.CAP_BPF) || caps.Has(unix.CAP_PERFMON) || caps.Has(unix.CAP_SYS_ADMIN) {
		t.Errorf("CapEff 0000008000001000 decoded as %#x", uint64(caps))
	}

	for _, bad := range []string{
		"Name:\tx\nCapPrm:\t0000000000000000\n", // no CapEff
		"CapEff:\t\n",
		"CapEff:\tzz\n",
		"CapEff:\t1ffffffffffffffff\n", // 65 bits
	} {
		if _, err := parseCapEff(strings.NewReader(bad)); err == nil {
			t.Errorf("parseCapEff(%q) succeeded, want error", bad)
		}
	}
}

// mountsFixture is /proc/mounts of the project machine (hybrid cgroups, no
// bpffs yet) plus a path with an escaped space.
const mountsFixture = `sysfs /sys sysfs rw,nosuid,nodev,noexec,relatime 0 0
proc /proc proc rw,nosuid,nodev,noexec,relatime 0 0
tmpfs /sys/fs/cgroup tmpfs rw,relatime,mode=755 0 0
cgroup /sys/fs/cgroup/cpu cgroup rw,relatime,cpu 0 0
cgroup /sys/fs/cgroup/systemd cgroup rw,relatime,name=systemd 0 0
cgroup2 /sys/fs/cgroup/unified cgroup2 rw,relatime 0 0
/dev/vdb /mnt/my\040data ext4 ro,relatime 0 0
short line
`

func TestParseMounts(t *testing.T) {
	mounts, err := ParseMounts(strings.NewReader(mountsFixture))
	if err != nil {
		t.Fatal(err)
	}
	if len(mounts) != 7 {
		t.Fatalf("parsed %d mounts, want 7 (the short line skipped): %+v", len(mounts), mounts)
	}
	want := Mount{Source: "/dev/vdb", Point: "/mnt/my data", FSType: "ext4", Options: []string{"ro", "relatime"}, ReadOnly: true}
	if got := mounts[6]; !reflect.DeepEqual(got, want) {
		t.Errorf("escaped mount = %+v, want %+v", got, want)
	}
	if mounts[5].ReadOnly {
		t.Error("cgroup2 mount parsed as read-only")
	}

	m, err := findMountIn(strings.NewReader(mountsFixture), "cgroup2")
	if err != nil || m == nil || m.Point != "/sys/fs/cgroup/unified" {
		t.Errorf("cgroup2 mount = %+v, %v; want /sys/fs/cgroup/unified", m, err)
	}
	// A hybrid host's cgroup v1 mounts are not cgroup2.
	m, err = findMountIn(strings.NewReader(mountsFixture), "bpf")
	if err != nil || m != nil {
		t.Errorf("bpf mount = %+v, %v; want none", m, err)
	}
}

func TestUnescapeMountField(t *testing.T) {
	for in, want := range map[string]string{
		`/plain`:         "/plain",
		`/a\040b`:        "/a b",
		`/tab\011x\134y`: "/tab\tx\\y",
		`/trailing\04`:   `/trailing\04`, // too short to be an escape
		`/not\999octal`:  `/not\999octal`,
		`/nl\012`:        "/nl\n",
	} {
		if got := unescapeMountField(in); got != want {
			t.Errorf("unescapeMountField(%q) = %q, want %q", in, got, want)
		}
	}
}

func TestMountRootsFromFixture(t *testing.T) {
	path := filepath.Join(t.TempDir(), "mounts")
	if err := os.WriteFile(path, []byte(mountsFixture), 0o600); err != nil {
		t.Fatal(err)
	}
	old := procMounts
	procMounts = path
	t.Cleanup(func() { procMounts = old })

	root, err := Cgroup2Root()
	if err != nil || root != "/sys/fs/cgroup/unified" {
		t.Errorf("Cgroup2Root() = %q, %v; want /sys/fs/cgroup/unified", root, err)
	}
	if _, err := BPFFSRoot(); err == nil || !strings.Contains(err.Error(), "mount -t bpf bpf /sys/fs/bpf") {
		t.Errorf("BPFFSRoot() error = %v; want one naming the mount command", err)
	}

	if err := os.WriteFile(path, []byte("proc /proc proc rw 0 0\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := Cgroup2Root(); !errors.Is(err, ErrNoCgroup2) || !strings.Contains(err.Error(), "mount -t cgroup2") {
		t.Errorf("Cgroup2Root() without cgroup2 = %v; want ErrNoCgroup2 with the mount command", err)
	}
}

func TestParseKernelRelease(t *testing.T) {
	for in, want := range map[string][3]int{
		"6.18.44-fc-v669":        {6, 18, 44},
		"5.15.0-91-generic":      {5, 15, 0},
		"6.1.0-18-amd64":         {6, 1, 0},
		"6.10":                   {6, 10, 0},
		"4.19.0+":                {4, 19, 0},
		"5.4.17-2136.el8uek.x86": {5, 4, 17},
	} {
		got, err := parseKernelRelease(in)
		if err != nil || got != want {
			t.Errorf("parseKernelRelease(%q) = %v, %v; want %v", in, got, err, want)
		}
	}
	for _, bad := range []string{"", "6", "linux"} {
		if _, err := parseKernelRelease(bad); err == nil {
			t.Errorf("parseKernelRelease(%q) succeeded, want error", bad)
		}
	}
}

func TestKernelFix(t *testing.T) {
	p := &prober{version: [3]int{5, 10, 0}}
	if got := p.kernelFix("5.15", configCgroup); got != "upgrade to Linux >= 5.15" {
		t.Errorf("5.10 kernelFix = %q", got)
	}
	p.version = [3]int{6, 18, 44}
	if got := p.kernelFix("5.15", configCgroup); got != "use a kernel built with "+configCgroup {
		t.Errorf("6.18 kernelFix = %q", got)
	}
	if !p.kernelAtLeast("6.18") || p.kernelAtLeast("6.19") || !p.kernelAtLeast("5.11") {
		t.Error("kernelAtLeast wrong for 6.18.44")
	}
}

func TestFeatureClassification(t *testing.T) {
	p := &prober{version: [3]int{5, 10, 0}, capsOK: true}
	p.feature("f ok", true, "use", "5.15", configBPF, func() error { return nil })
	p.feature("f missing", true, "use", "5.15", configBPF, func() error {
		return fmt.Errorf("helper: %w", ebpf.ErrNotSupported)
	})
	p.feature("f eperm", true, "use", "5.15", configBPF, func() error { return unix.EPERM })
	p.feature("f odd", false, "use", "5.15", configBPF, func() error { return errors.New("boom") })
	p.bpfErr = unix.EPERM
	called := false
	p.feature("f blocked", true, "use", "5.15", configBPF, func() error { called = true; return nil })
	if called {
		t.Error("feature probed although the bpf syscall is unusable")
	}

	want := []struct {
		status Status
		fix    string
	}{
		{StatusOK, ""},
		{StatusMissing, "upgrade to Linux >= 5.15"},
		{StatusWarn, fixPrivileges},
		{StatusWarn, fixProbe},
		{StatusWarn, "fix bpf syscall first"},
	}
	for i, w := range want {
		c := p.checks[i]
		if c.Status != w.status || c.Fix != w.fix {
			t.Errorf("%s: status %q fix %q; want %q %q", c.Name, c.Status, c.Fix, w.status, w.fix)
		}
	}
}

func fabricated() []Check {
	return []Check{
		{Name: CheckKernel, Status: StatusOK, Detail: "Linux 6.18"},
		{Name: "CAP_BPF", Status: StatusMissing, Fix: fixPrivileges, Required: true},
		{Name: "CAP_NET_ADMIN", Status: StatusMissing, Fix: fixPrivileges, Required: true},
		{Name: CheckCgroup2, Status: StatusMissing, Fix: fixCgroup2, Required: true},
		{Name: "prog tracepoint", Status: StatusMissing, Fix: "upgrade", Required: false},
		{Name: "link sk_msg sockhash", Status: StatusWarn, Fix: "x", Required: false},
		{Name: CheckBTF, Status: StatusWarn, Fix: fixProbe, Required: true},
	}
}

func TestVerdictAndErr(t *testing.T) {
	r := NewReport("6.18.44", fabricated())
	if r.Ready {
		t.Fatal("Ready with required checks missing")
	}
	var names []string
	for _, c := range r.Missing() {
		names = append(names, c.Name)
	}
	if want := []string{"CAP_BPF", "CAP_NET_ADMIN", CheckCgroup2, CheckBTF}; !reflect.DeepEqual(names, want) {
		t.Errorf("Missing() = %v, want %v (optional rows excluded, required warn included)", names, want)
	}
	want := "not ready: CAP_BPF, CAP_NET_ADMIN -- " + fixPrivileges +
		"; cgroup v2 -- " + fixCgroup2 + "; BTF -- " + fixProbe
	if r.Verdict != want {
		t.Errorf("Verdict =\n%s\nwant\n%s", r.Verdict, want)
	}
	err := r.Err()
	if err == nil || err.Error() != want {
		t.Fatalf("Err() = %v, want %q", err, want)
	}
	if !errors.Is(err, ErrNotReady) {
		t.Error("Err() is not ErrNotReady")
	}
	var nre *NotReadyError
	if !errors.As(fmt.Errorf("start agent: %w", err), &nre) || len(nre.Missing) != 4 {
		t.Errorf("errors.As NotReadyError: %+v", nre)
	}
	if strings.Contains(err.Error(), "tracepoint") {
		t.Error("Err() names an optional check")
	}

	// Ready: only optional rows are not ok.
	ready := NewReport("6.18.44", []Check{
		{Name: CheckKernel, Status: StatusOK},
		{Name: "CAP_BPF", Status: StatusOK, Required: true},
		{Name: "prog tracepoint", Status: StatusMissing, Fix: "upgrade"},
	})
	if !ready.Ready || ready.Verdict != "ready: this kernel can accelerate" || ready.Err() != nil {
		t.Errorf("ready report: Ready=%v Verdict=%q Err=%v", ready.Ready, ready.Verdict, ready.Err())
	}
	if c, ok := ready.Check("CAP_BPF"); !ok || c.Status != StatusOK {
		t.Errorf("Check(CAP_BPF) = %+v, %v", c, ok)
	}
	if _, ok := ready.Check("nope"); ok {
		t.Error("Check(nope) found")
	}
}

func TestVerdictCollapsesLongGroups(t *testing.T) {
	checks := []Check{{Name: CheckBPFSyscall, Status: StatusMissing, Fix: fixBlocked, Required: true}}
	for i := range 7 {
		checks = append(checks, Check{Name: fmt.Sprintf("map %d", i), Status: StatusWarn, Fix: "fix bpf syscall first", Required: true})
	}
	want := "not ready: bpf syscall -- " + fixBlocked + "; map 0, map 1, map 2, map 3 and 3 more -- fix bpf syscall first"
	if got := NewReport("", checks).Verdict; got != want {
		t.Errorf("Verdict =\n%s\nwant\n%s", got, want)
	}
	// A missing check without a fix still gets named.
	if got := notReadyText([]Check{{Name: "x", Required: true}}); got != "not ready: x" {
		t.Errorf("no-fix verdict = %q", got)
	}
}

// TestAtomicMemEncoding checks the bytes the atomics probe sends: imm must
// be BPF_CMPXCHG (0xf0 | BPF_FETCH), or the probe would test an atomic add.
func TestAtomicMemEncoding(t *testing.T) {
	var buf bytes.Buffer
	if _, err := atomicMem(asm.CmpXchg, asm.R1, asm.R2, asm.DWord, 0).Marshal(&buf, binary.LittleEndian); err != nil {
		t.Fatal(err)
	}
	raw := buf.Bytes()
	if raw[0] != 0xdb { // BPF_STX | BPF_ATOMIC | BPF_DW
		t.Errorf("opcode %#x, want 0xdb", raw[0])
	}
	if imm := binary.LittleEndian.Uint32(raw[4:8]); imm != 0xf1 {
		t.Errorf("imm %#x, want 0xf1 (BPF_CMPXCHG)", imm)
	}
}
