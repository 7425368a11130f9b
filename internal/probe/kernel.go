// SPDX-License-Identifier: Apache-2.0

package probe

// What differs between the kernels meshwarp runs on (6.1 LTS, 6.12 LTS and
// later): each kernel-dependent choice of the agent, found by probing the
// kernel (its BTF, or a link attached for an instant), never by version.
// The agent (internal/accel, internal/crossnode, internal/tap) asks the same
// functions, so `probe`, `status` and what `run` does cannot disagree.

import (
	"errors"
	"fmt"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/btf"
)

// Feature is one kernel-dependent part of meshwarp: on (and how, where the
// kernel offers a choice) or off, and why.
type Feature struct {
	Name string `json:"name"`
	On   bool   `json:"on"`
	// How names the mechanism used on this kernel when there is a choice.
	How string `json:"how,omitempty"`
	// Reason says why the feature is off, or why an older mechanism is used.
	Reason string `json:"reason,omitempty"`
}

// Names of the kernel-dependent features.
const (
	FeatureSkMsgAttach  = "sk_msg attach"
	FeatureTap          = "meshwarp tap"
	FeatureCrossNode    = "cross-node forwarding"
	FeatureClientRead   = "client read time"
	FeatureRedirectLoad = "receiver backlog"
	FeatureFIONREAD     = "FIONREAD of redirected bytes"
)

// Kernel releases where the features below appeared (for the reasons).
const (
	kernelTCX        = "6.6"
	kernelRecvTP     = "6.3"
	kernelMsgTotLen  = "6.6.128, 6.12.75 or 6.18.14"
	backlogWalkLimit = 64 // MW_BACKLOG_WALK in bpf/accel/sock.h; keep in sync
)

// HaveSockmapLink reports whether an sk_msg program can be attached to a
// SOCKMAP as a link (BPF_LINK_CREATE, Linux 6.10): pinnable, and its
// program replaceable with BPF_LINK_UPDATE. Without it the agent attaches
// with BPF_PROG_ATTACH (the pinned SOCKMAP keeps the program) and
// `meshwarp tap`, which swaps programs inside the link, is off.
func HaveSockmapLink() error { return attachSockmapLink() }

// HaveTCX reports whether the kernel has tcx links (BPF_TCX_INGRESS, Linux
// 6.6), which cross-node forwarding attaches with.
func HaveTCX() error {
	return haveEnumValue("bpf_attach_type", "BPF_TCX_INGRESS", "tcx links")
}

// HaveRecvTracepoint reports whether tracepoint sock:sock_recv_length (Linux
// 6.3) has BTF for tp_btf programs: the client application's read time.
func HaveRecvTracepoint() error { return haveRawTracepoint("sock_recv_length") }

// HaveMsgTotLen reports whether struct sk_psock counts its unread
// redirected bytes (msg_tot_len, kernel commit 929e30f93125).
func HaveMsgTotLen() error {
	spec, err := btf.LoadKernelSpec()
	if err != nil {
		return fmt.Errorf("kernel BTF: %w", err)
	}
	var psock *btf.Struct
	if err := spec.TypeByName("sk_psock", &psock); err != nil {
		return fmt.Errorf("struct sk_psock not in the kernel's BTF: %w", ebpf.ErrNotSupported)
	}
	for _, m := range psock.Members {
		if m.Name == "msg_tot_len" {
			return nil
		}
	}
	return fmt.Errorf("struct sk_psock has no msg_tot_len: %w", ebpf.ErrNotSupported)
}

func haveEnumValue(enum, value, what string) error {
	spec, err := btf.LoadKernelSpec()
	if err != nil {
		return fmt.Errorf("kernel BTF: %w", err)
	}
	var e *btf.Enum
	if err := spec.TypeByName(enum, &e); err != nil {
		return fmt.Errorf("enum %s not in the kernel's BTF: %w", enum, ebpf.ErrNotSupported)
	}
	for _, v := range e.Values {
		if v.Name == value {
			return nil
		}
	}
	return fmt.Errorf("%s: no %s in enum %s: %w", what, value, enum, ebpf.ErrNotSupported)
}

// KernelFeatures probes each kernel-dependent feature. A probe that fails
// for another reason than "not supported" (permissions, no BTF) reports the
// feature off with that error: the required checks of Run say more.
func KernelFeatures() []Feature {
	var out []Feature
	add := func(f Feature) { out = append(out, f) }
	why := func(err error) string {
		if errors.Is(err, ebpf.ErrNotSupported) {
			return err.Error()
		}
		return "not probed: " + err.Error()
	}

	linkErr := HaveSockmapLink()
	if linkErr == nil {
		add(Feature{Name: FeatureSkMsgAttach, On: true, How: "sockmap link (pinned mw_skmsg_link, replaced with BPF_LINK_UPDATE)"})
		add(Feature{Name: FeatureTap, On: true, How: "swaps mw_skmsg_tap into the sk_msg link while it runs"})
	} else {
		add(Feature{Name: FeatureSkMsgAttach, On: true,
			How:    "BPF_PROG_ATTACH to mw_sock_map (the pinned map keeps the program; a restarted agent attaches again, an atomic replace)",
			Reason: "no sockmap links before Linux " + kernelLinkSock + " (" + why(linkErr) + ")"})
		add(Feature{Name: FeatureTap, On: false,
			Reason: "needs the sk_msg program in a link to swap (BPF_LINK_UPDATE on a sockmap link, Linux " + kernelLinkSock + "): " + why(linkErr)})
	}

	if err := HaveTCX(); err == nil {
		add(Feature{Name: FeatureCrossNode, On: true, How: "tcx ingress links on bridge ports and uplinks (run --cross-node)"})
	} else {
		add(Feature{Name: FeatureCrossNode, On: false,
			Reason: "needs tcx links (Linux " + kernelTCX + "); run --cross-node is ignored with a warning here, pod traffic between nodes takes the normal path: " + why(err)})
	}

	if err := HaveRecvTracepoint(); err == nil {
		add(Feature{Name: FeatureClientRead, On: true, How: "tp_btf sock:sock_recv_length (meshwarp trace, bench)"})
	} else {
		add(Feature{Name: FeatureClientRead, On: false,
			Reason: "needs tracepoint sock:sock_recv_length (Linux " + kernelRecvTP + "): meshwarp trace and the bench show no client_app point; " +
				"RED metrics and every other point are unaffected: " + why(err)})
	}

	// The same kernel commit gave tcp_bpf its ioctl, which counts msg_tot_len.
	if err := HaveMsgTotLen(); err == nil {
		add(Feature{Name: FeatureRedirectLoad, On: true, How: "exact: struct sk_psock msg_tot_len"})
		add(Feature{Name: FeatureFIONREAD, On: true, How: "tcp_bpf's ioctl counts the redirect queue (sk_psock msg_tot_len)"})
	} else {
		add(Feature{Name: FeatureFIONREAD, On: false,
			Reason: "limitation: tcp_bpf has no ioctl before Linux " + kernelMsgTotLen + ": ioctl(FIONREAD/SIOCINQ) on a paired " +
				"socket counts only its TCP queue, 0 while redirected bytes wait; a reader that waits for FIONREAD > 0 stalls. " +
				"run --learn-from-syscalls learns such readers (ioctl watch) and keeps later connections on their ports, and of their programs, on TCP; " +
				"or exclude their ports up front (--exclude-ports), or use a kernel with the fix (docs/kernel/07-fionread-6.1.md): " + why(err)})
		add(Feature{Name: FeatureRedirectLoad, On: true,
			How:    fmt.Sprintf("counted from the psock's message queue (first %d messages; more count as over the redirect budget, so a slow reader's direction goes to TCP sooner)", backlogWalkLimit),
			Reason: "struct sk_psock has no msg_tot_len before Linux " + kernelMsgTotLen + ": " + why(err)})
	}
	return out
}

// Off returns the features that are off, in order.
func Off(features []Feature) []Feature {
	var out []Feature
	for _, f := range features {
		if !f.On {
			out = append(out, f)
		}
	}
	return out
}
