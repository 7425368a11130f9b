// SPDX-License-Identifier: Apache-2.0

package accel

import (
	"slices"
	"testing"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"
	"github.com/cilium/ebpf/link"

	"github.com/meshwarp/meshwarp/internal/probe"
	"github.com/meshwarp/meshwarp/internal/testutil"
)

// otherSockmapUser is an independent sock_ops + SOCKHASH + sk_msg user, like
// a CNI's or a tracer's: it puts every established socket of the cgroup into
// its own SOCKHASH (keyed by socket cookie) and passes every message.
type otherSockmapUser struct {
	hash    *ebpf.Map
	sockops *ebpf.Program
	skmsg   *ebpf.Program
}

func loadOtherSockmapUser(t *testing.T) *otherSockmapUser {
	t.Helper()
	o := &otherSockmapUser{}
	var err error
	o.hash, err = ebpf.NewMap(&ebpf.MapSpec{Name: "other_hash", Type: ebpf.SockHash, KeySize: 8, ValueSize: 8, MaxEntries: 1024})
	if err != nil {
		t.Fatalf("create other SOCKHASH: %v", err)
	}
	t.Cleanup(func() { o.hash.Close() })
	o.sockops, err = ebpf.NewProgram(&ebpf.ProgramSpec{
		Name: "other_sockops", Type: ebpf.SockOps, License: "GPL",
		Instructions: asm.Instructions{
			asm.Mov.Reg(asm.R6, asm.R1),
			asm.LoadMem(asm.R2, asm.R6, 0, asm.Word), // bpf_sock_ops.op
			asm.JEq.Imm(asm.R2, 4, "insert"),         // BPF_SOCK_OPS_ACTIVE_ESTABLISHED_CB
			asm.JEq.Imm(asm.R2, 5, "insert"),         // BPF_SOCK_OPS_PASSIVE_ESTABLISHED_CB
			asm.Mov.Imm(asm.R0, 1),
			asm.Return(),
			asm.Mov.Reg(asm.R1, asm.R6).WithSymbol("insert"),
			asm.FnGetSocketCookie.Call(),
			asm.StoreMem(asm.RFP, -8, asm.R0, asm.DWord),
			asm.Mov.Reg(asm.R1, asm.R6),
			asm.LoadMapPtr(asm.R2, o.hash.FD()),
			asm.Mov.Reg(asm.R3, asm.RFP),
			asm.Add.Imm(asm.R3, -8),
			asm.Mov.Imm(asm.R4, 0), // BPF_ANY
			asm.FnSockHashUpdate.Call(),
			asm.Mov.Imm(asm.R0, 1),
			asm.Return(),
		},
	})
	if err != nil {
		t.Fatalf("load other sock_ops: %v", err)
	}
	t.Cleanup(func() { o.sockops.Close() })
	o.skmsg, err = ebpf.NewProgram(&ebpf.ProgramSpec{
		Name: "other_skmsg", Type: ebpf.SkMsg, License: "GPL",
		Instructions: asm.Instructions{asm.Mov.Imm(asm.R0, 1), asm.Return()}, // SK_PASS
	})
	if err != nil {
		t.Fatalf("load other sk_msg: %v", err)
	}
	t.Cleanup(func() { o.skmsg.Close() })
	return o
}

func (o *otherSockmapUser) attach(t *testing.T, cgroup string) {
	t.Helper()
	if probe.HaveSockmapLink() != nil {
		// Linux < 6.10: the other tool attaches to its map itself, as the
		// agent does there; the map (closed with o) takes the program along.
		if err := link.RawAttachProgram(link.RawAttachProgramOptions{Target: o.hash.FD(), Program: o.skmsg, Attach: ebpf.AttachSkMsgVerdict}); err != nil {
			t.Fatalf("attach other sk_msg (BPF_PROG_ATTACH): %v", err)
		}
	} else {
		msg, err := link.AttachRawLink(link.RawLinkOptions{Target: o.hash.FD(), Program: o.skmsg, Attach: ebpf.AttachSkMsgVerdict})
		if err != nil {
			t.Fatalf("attach other sk_msg: %v", err)
		}
		t.Cleanup(func() { msg.Close() })
	}
	ops, err := link.AttachCgroup(link.CgroupOptions{Path: cgroup, Attach: ebpf.AttachCGroupSockOps, Program: o.sockops})
	if err != nil {
		t.Fatalf("attach other sock_ops: %v", err)
	}
	t.Cleanup(func() { ops.Close() })
}

// Another sock_ops/sk_msg user on the same cgroup: both programs run, no
// connection of either stalls or loses a byte, status names the other
// program, and when the other user's sk_msg owns a socket meshwarp leaves
// that connection to TCP (sockmap_busy).
func TestPrivilegedCoexistOtherSockmapUser(t *testing.T) {
	testutil.RequirePrivileged(t)
	for _, otherFirst := range []bool{true, false} {
		name := "meshwarp-first"
		if otherFirst {
			name = "other-first"
		}
		t.Run(name, func(t *testing.T) {
			cg := testutil.EnterCgroup(t)
			other := loadOtherSockmapUser(t)
			if otherFirst {
				other.attach(t, cg)
			}
			a := startAgent(t, Config{CgroupPath: cg})
			if !otherFirst {
				other.attach(t, cg)
			}
			target := echoOn(t, "127.0.0.1:0")
			if err := testutil.CheckIntegrity(dialer(target), fallbackOpts).Err(); err != nil {
				t.Fatal(err)
			}
			s := stats(t, a)
			t.Logf("paired %d, redirected %d bytes, passthrough conns %v", s.PairedSockets, s.RedirectedBytes, s.PassthroughConnections)
			if otherFirst {
				if s.PassthroughConnections["sockmap_busy"] != uint64(fallbackOpts.Conns) || s.RedirectedBytes != 0 {
					t.Fatalf("want every connection left to TCP as sockmap_busy, got %v and %d redirected bytes", s.PassthroughConnections, s.RedirectedBytes)
				}
			} else {
				// meshwarp attached first owns its sockets: the other tool
				// never pushes it off one (sockmap_busy). A connection is
				// paired, or lost its pairing race as without the other
				// tool (testutil.CheckPaired).
				if n := s.PassthroughConnections["sockmap_busy"]; n != 0 {
					t.Fatalf("meshwarp attached first: %d connections left to TCP as sockmap_busy (%v)", n, nonZero(s.PassthroughConnections))
				}
				if err := testutil.CheckPaired(s.PairedSockets/2, uint64(fallbackOpts.Conns), s.PassthroughConnections); err != nil {
					t.Fatalf("meshwarp attached first: %v", err)
				}
			}
			others, err := OtherSockmapPrograms()
			if err != nil {
				t.Fatal(err)
			}
			if !slices.ContainsFunc(others, func(p ProgramRef) bool { return p.Name == "other_sockops" }) ||
				!slices.ContainsFunc(others, func(p ProgramRef) bool { return p.Name == "other_skmsg" }) {
				t.Fatalf("the other user's programs are not reported: %+v", others)
			}
		})
	}
}
