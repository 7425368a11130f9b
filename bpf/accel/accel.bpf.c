// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
/*
 * Same-node TCP acceleration: one object, one header per concern (the agent
 * loads every program but the tap's; `meshwarp tap` loads only the tap's).
 *
 * Attach points: mw_sockops on a cgroup v2 directory (BPF_CGROUP_SOCK_OPS),
 * mw_skmsg on mw_sock_map (BPF_SK_MSG_VERDICT), mw_skmsg_tap in its place
 * while a tap runs; mw_egress and mw_ingress (or their _obs variants) on
 * the cgroup (fin_order.h, hints.h, observe_skb.h); the programs of
 * learning.h (mw_sock_create, mw_post_bind4/6, mw_setsockopt, the syscall
 * watches) and observe_skb.h's mw_obs_recv.
 * Kernel: >= 6.1 (BPF atomics (5.12), bpf_timer (5.15), sk_storage in sk_msg,
 * bpf_skc_to_tcp_sock in sock_ops; sockmap links from 6.10, else
 * BPF_PROG_ATTACH: internal/probe decides per feature).
 * Maps owned (all pinned by name so a restarted agent adopts them):
 *   mw_sock_map     SOCKMAP                2 * slot + role - 1 -> socket
 *   mw_conns        ARRAY                  slot -> mw_conn (the pairing decision)
 *   mw_syn_notes    ARRAY                  who may have a local peer (hints.h)
 *   mw_unhinted_notes ARRAY                connections that found no note
 *   mw_sk_store     SK_STORAGE (cloned)    mw_sock per socket (program, pairing, observation)
 *   mw_stats        PERCPU_ARRAY           mw_counters
 *   mw_policy, mw_port_policy, mw_cidr_incl, mw_cidr_excl   policy
 *   mw_cgroup       CGROUP_ARRAY, mw_unfit_procs LRU_HASH     the syscall watches
 *   mw_unfit_progs  LRU_HASH, mw_learned_any ARRAY   learned programs (learning.h)
 *   mw_flows, mw_pair_flow_slots, mw_pair_flows (observe.h); the tap's own, not pinned (tap.h)
 *
 * Where each concern lives:
 *   accel.h        types shared with Go (bpf2go -type)
 *   maps.h         load-time settings, the shared maps, counters
 *   sock.h         reading sockets and contexts, sock_ops callback flags
 *   observe.h      observation in sock_ops and sk_msg; observe_skb.h its
 *                  cgroup_skb and tp_btf programs
 *   hints.h        pairing step 0: who has a local peer (mw_ingress)
 *   pairing.h      pairing steps 1 and 2 (sock_ops ESTABLISHED)
 *   leave.h        leaving mw_sock_map for TCP, and the close
 *   tap.h          what mw_skmsg_tap records
 *   redirect.h     the sk_msg decision and redirect
 *   learning.h     mw_sock_create, mw_post_bind4/6, mw_setsockopt, the
 *                  syscall watches
 *   fin_order.h    mw_egress: a FIN waits for its socket's redirect in flight
 * This file declares the programs that tie them together: mw_sockops,
 * mw_egress(_obs), mw_ingress(_obs), mw_skmsg and mw_skmsg_tap.
 */
#include "vmlinux.h"
#include "bpf_helpers.h"
#include "bpf_endian.h"
#include "bpf_core_read.h"
#include "pinned_map.h"
#include "accel.h"
#include "maps.h"
#include "sock.h"
#include "observe.h"
#include "observe_skb.h"
#include "hints.h"
#include "pairing.h"
#include "leave.h"
#include "tap.h"
#include "redirect.h"
#include "learning.h"
#include "fin_order.h"

char LICENSE[] SEC("license") = "Dual BSD/GPL";

/* The agent's cgroup (BPF_CGROUP_SOCK_OPS): observation, pairing (hints.h, pairing.h), leaving (leave.h). */
SEC("sockops")
int mw_sockops(struct bpf_sock_ops *skops)
{
	__u32 op = skops->op;

	/*
	 * The kernel also asks every program of the cgroup about each
	 * connection's timeouts, window, ECN, base RTT ... (ops no flag turns
	 * off): leave before the reads below.
	 */
	switch (op) {
	case BPF_SOCK_OPS_TCP_CONNECT_CB:
	case BPF_SOCK_OPS_ACTIVE_ESTABLISHED_CB:
	case BPF_SOCK_OPS_PASSIVE_ESTABLISHED_CB:
	case BPF_SOCK_OPS_HDR_OPT_LEN_CB:
	case BPF_SOCK_OPS_PARSE_HDR_OPT_CB:
	case BPF_SOCK_OPS_STATE_CB:
		break;
	default:
		return 1;
	}
	/* Read every ctx field up front (see sockops_tuple). */
	__u32 old_state = skops->args[0];
	__u32 new_state = skops->args[1];
	__u32 snd_nxt = skops->snd_nxt;
	__u32 rcv_nxt = skops->rcv_nxt;
	__u32 snd_una = skops->snd_una;
	__u32 cb_flags = skops->bpf_sock_ops_cb_flags;
	__u32 skb_len = skops->skb_len; /* the segment that made the callback; 0: none (TCP_REPAIR) */
	struct bpf_sock *sk = skops->sk;
	struct tcp_sock *tp;
	struct mw_sock *rec;
	__u64 now;

	if (!sk)
		return 1;
	/* Observation first: it may add STATE_CB to the flags the rest sets. */
	switch (op) {
	case BPF_SOCK_OPS_TCP_CONNECT_CB:
		/* One socket pointer and one clock read per callback, handed down. */
		tp = bpf_skc_to_tcp_sock(sk);
		now = bpf_ktime_get_ns();
		cb_flags = obs_start(skops, sk, tp, true, cb_flags, snd_nxt, rcv_nxt, skb_len, now);
		if (accelerate)
			on_connect(skops, tp, cb_flags, now);
		break;
	case BPF_SOCK_OPS_ACTIVE_ESTABLISHED_CB:
		tp = bpf_skc_to_tcp_sock(sk);
		now = bpf_ktime_get_ns();
		obs_established(sk, tp, snd_nxt, rcv_nxt, skb_len, now);
		if (accelerate)
			on_active_established(skops, sk, tp, snd_nxt, rcv_nxt, cb_flags, now);
		break;
	case BPF_SOCK_OPS_PASSIVE_ESTABLISHED_CB:
		tp = bpf_skc_to_tcp_sock(sk);
		now = bpf_ktime_get_ns();
		cb_flags = obs_start(skops, sk, tp, false, cb_flags, snd_nxt, rcv_nxt, skb_len, now);
		if (accelerate)
			on_passive_established(skops, sk, tp, snd_nxt, rcv_nxt, cb_flags, now);
		break;
	case BPF_SOCK_OPS_HDR_OPT_LEN_CB:
		on_leave_check(skops, sk, cb_flags, false);
		break;
	case BPF_SOCK_OPS_PARSE_HDR_OPT_CB:
		on_leave_check(skops, sk, cb_flags, true);
		break;
	case BPF_SOCK_OPS_STATE_CB:
		if (new_state != BPF_TCP_CLOSE) {
			closing_stops_leave_checks(skops, new_state, cb_flags);
			break;
		}
		if (old_state == BPF_TCP_SYN_SENT && accelerate)
			on_connect_failed(skops, snd_una);
		/* The socket's record, looked up once for the pairing's end and the observation's. */
		rec = sock_rec(sk, false);
		if (!rec)
			break;
		barrier_var(rec); /* the offsets below stay behind the NULL check (see obs_state) */
		if (old_state != BPF_TCP_SYN_SENT)
			on_close(sk, &rec->pair);
		if (observe)
			obs_end(&rec->obs, old_state);
		break;
	}
	return 1;
}

/*
 * The agent's cgroup, each way one program for every segment (each
 * attached program costs every packet its own run): the FIN order
 * (fin_order.h) and the SYN notes (hints.h), and with observation
 * (`run --observe`, the default) the segments' observation
 * (observe_skb.h) in the same run: the _obs variants replace the others
 * in place (pinned mw_fin_link, mw_syn_link).
 */
SEC("cgroup_skb/egress")
int mw_egress(struct __sk_buff *skb)
{
	return fin_order(skb);
}

SEC("cgroup_skb/egress")
int mw_egress_obs(struct __sk_buff *skb)
{
	int verdict = fin_order(skb);

	obs_skb(skb, true);
	return verdict;
}

SEC("cgroup_skb/ingress")
int mw_ingress(struct __sk_buff *skb)
{
	if (accelerate)
		syn_note(skb);
	return 1;
}

SEC("cgroup_skb/ingress")
int mw_ingress_obs(struct __sk_buff *skb)
{
	if (accelerate)
		syn_note(skb);
	obs_skb(skb, false);
	return 1;
}

/* mw_sock_map (BPF_SK_MSG_VERDICT): the redirect (redirect.h). */
SEC("sk_msg")
int mw_skmsg(struct sk_msg_md *msg)
{
	return skmsg(msg, false);
}

/* In mw_skmsg's place while `meshwarp tap` runs (tap.h); the agent does not load it. */
SEC("sk_msg")
int mw_skmsg_tap(struct sk_msg_md *msg)
{
	return skmsg(msg, true);
}
