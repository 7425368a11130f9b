/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * The redirect (sk_msg on mw_sock_map, BPF_SK_MSG_VERDICT; mw_skmsg in
 * accel.bpf.c): runs on every sendmsg of a socket in mw_sock_map. A paired
 * socket's message goes straight into its peer's receive queue
 * (BPF_F_INGRESS); the decision is taken once per socket on its first
 * message (step 3 of pairing.h) and cached in sk_storage. A direction that
 * would lose with the redirect (backpressure, a small-message stream)
 * continues on TCP at a point where no reader sees two queues (leave.h).
 */
#ifndef MESHWARP_REDIRECT_H
#define MESHWARP_REDIRECT_H

#define MW_SOCK_RCVBUF_LOCK 2 /* sk_userlocks: SO_RCVBUF set (include/net/sock.h) */

/*
 * The budget of a receiver that fixed its buffer with SO_RCVBUF (0: it did
 * not): half its sk_rcvbuf, about what TCP's window lets it leave unread.
 * The redirected bytes still unread at a switch to TCP count against that
 * buffer (bpf_tcp_ingress charges sk_rmem_alloc from 6.13), which TCP does
 * not grow for them as it does an autotuned one (tcp_clamp_window): with
 * more, TCP would drop the first segments after the switch (RcvPruned) and
 * the writer would wait for its retransmission timer. Probe reads through
 * the peer.
 */
static __always_inline __u32 fixed_buffer_budget(__u64 peer_sk)
{
	struct sock *sk = (struct sock *)peer_sk;

	if (!sk || !(BPF_CORE_READ_BITFIELD_PROBED(sk, sk_userlocks) & MW_SOCK_RCVBUF_LOCK))
		return 0;
	return (__u32)BPF_CORE_READ(sk, sk_rcvbuf) / 2;
}

/* Decide once per socket, on its first message; cache the answer in sk_storage. */
static __always_inline void decide(struct mw_sk_state *st, struct bpf_sock *sk)
{
	struct mw_conn_id id = st->conn;
	struct mw_conn *c = conn_of(st);
	struct tcp_sock *tp;

	/*
	 * A write that entered sendmsg before this socket joined mw_sock_map
	 * (one racing connect, TCP Fast Open's first write) went by TCP: this
	 * direction stays on TCP, or redirected bytes could overtake it.
	 */
	tp = st->role == MW_ROLE_ACTIVE ? bpf_skc_to_tcp_sock(sk) : NULL;
	if (tp && tp->write_seq != id.active_isn1) {
		if (c)
			conn_passthrough(c, MW_REASON_EARLY_DATA);
		if (!c || c->state == MW_CONN_PAIRED)
			count_conn(MW_REASON_EARLY_DATA);
		st->decision = MW_CONN_PASSTHROUGH;
		st->reason = MW_REASON_EARLY_DATA;
		return;
	}
	if (!c) {
		/* The passive side's entry goes when its (active) peer closes. */
		st->decision = MW_CONN_PASSTHROUGH;
		st->reason = st->paired ? MW_REASON_PEER_CLOSED : MW_REASON_NO_PEER;
		return;
	}
	if (c->state == MW_CONN_PENDING) {
		/* No peer yet: this byte and all later ones go by TCP. */
		if (__sync_val_compare_and_swap(&c->state, MW_CONN_PENDING, MW_CONN_PASSTHROUGH) ==
		    MW_CONN_PENDING) {
			c->reason = MW_REASON_NO_PEER;
			count_conn(MW_REASON_NO_PEER);
		}
	}
	if (c->state == MW_CONN_PAIRED) {
		__u32 me = dir_index(st->role);

		st->peer_sk = st->role == MW_ROLE_ACTIVE ? c->passive_sk : c->active_sk;
		st->hop = c->hop;
		st->paired = 1;
		/* NEVER: the connection went to TCP before this side sent. */
		if (__sync_val_compare_and_swap(&c->dir[me], MW_DIR_UNDECIDED, MW_DIR_REDIRECT) ==
		    MW_DIR_NEVER) {
			st->decision = MW_CONN_PASSTHROUGH;
			st->reason = c->to_tcp_reason;
			return;
		}
		st->decision = MW_CONN_PAIRED;
		/*
		 * The budget's first look, without reading through the peer: only
		 * this socket fills the peer's redirect queue, and it has sent
		 * nothing yet (over_budget).
		 */
		st->budget = fixed_buffer_budget(st->peer_sk) ?: redirect_budget_bytes;
		if (st->budget > redirect_budget_bytes)
			st->budget = redirect_budget_bytes;
		st->credit = st->budget;
		st->seen_backlog = 0;
		st->seen_sent = (__u32)st->sent;
		return;
	}
	st->decision = MW_CONN_PASSTHROUGH;
	st->reason = c->reason;
}

/* The connection is to continue on TCP as a whole (set once, counted once). */
static __always_inline void request_tcp(struct mw_conn *c, __u32 reason)
{
	if (!c->to_tcp) {
		c->to_tcp_reason = reason;
		if (__sync_val_compare_and_swap(&c->to_tcp, 0, 1) == 0)
			count_conn(reason);
	}
}

/*
 * This side's direction continues on TCP, and with it the whole connection:
 * a peer that never redirected never will (NEVER). Order holds: the
 * receiver reads its redirect queue (tcp_bpf_recvmsg) before its TCP queue,
 * and a write that returned had its redirect queued. TCP, never DRAINED,
 * even at a switch point: after a partial redirect (bpf_tcp_ingress could
 * charge only part of the message) tcp_bpf runs this program again on the
 * rest, and redirects it whatever the program returns (msg->sk_redir stays
 * set: sk_psock_map_verd), so this sendmsg may still redirect; TCP makes the
 * peer wait until it is over (peer_quiet reads our psock's references).
 */
static __always_inline void to_tcp(struct mw_sk_state *st, struct mw_conn *c, __u32 reason)
{
	__u32 me = dir_index(st->role);

	request_tcp(c, reason);
	st->decision = MW_CONN_PASSTHROUGH;
	st->reason = c->to_tcp_reason;
	__sync_val_compare_and_swap(&c->dir[me], MW_DIR_REDIRECT, MW_DIR_TCP);
	__sync_val_compare_and_swap(&c->dir[1 - me], MW_DIR_UNDECIDED, MW_DIR_NEVER);
	poll_leave(st, c);
}

/*
 * Whether this side may move its direction to TCP now without any reader
 * seeing two queues: both redirect queues are empty (the peer read all we
 * sent, we read all it sent) and no other sendmsg of ours is on its way
 * (own_dir_drained). Then each socket leaves mw_sock_map at its first TCP
 * packet, before the packet's bytes are queued (on_leave_check).
 */
static __always_inline bool switch_point(struct mw_conn *c, struct mw_sk_state *st, struct bpf_sock *sk)
{
	struct tcp_sock *tp = bpf_skc_to_tcp_sock(sk);

	if (!tp || redirect_backlog((struct sock *)tp))
		return false;
	return own_dir_drained(c, dir_index(st->role), (struct sock *)tp, 2);
}

/*
 * Whether this side's direction is still REDIRECT, read with a full barrier
 * after tcp_bpf took this sendmsg's psock reference: the leave poll (no
 * socket lock) marks the direction TCP and then reads that reference count
 * (leave_by_timer), so one of the two sees the other. The reference is
 * taken with a relaxed increment, which a plain load could pass on weakly
 * ordered CPUs. Only while the connection goes to TCP (a few messages).
 */
static __always_inline bool still_redirecting(struct mw_conn *c, const struct mw_sk_state *st)
{
	__u32 me = dir_index(st->role);

	return __sync_val_compare_and_swap(&c->dir[me], MW_DIR_REDIRECT, MW_DIR_REDIRECT) == MW_DIR_REDIRECT;
}

/*
 * How far a direction's budget may grow: to redirect_budget_max_bytes, and
 * not past what TCP lets the receiver's buffer grow to (its netns's
 * tcp_rmem[2]), which TCP grows to hold what the switch left unread
 * (tcp_clamp_window). A receiver with SO_RCVBUF keeps fixed_buffer_budget.
 * Probe reads through the peer, only when the budget is to grow.
 */
static __always_inline __u32 budget_ceiling(__u64 peer_sk)
{
	struct sock *sk = (struct sock *)peer_sk;
	struct net *net;
	int rmem_max = 0;

	if (!sk)
		return 0;
	net = BPF_CORE_READ(sk, __sk_common.skc_net.net);
	if (!net || bpf_core_read(&rmem_max, sizeof(rmem_max), &net->ipv4.sysctl_tcp_rmem[2]) || rmem_max < 0)
		return 0;
	return (__u32)rmem_max < redirect_budget_max_bytes ? (__u32)rmem_max : redirect_budget_max_bytes;
}

/*
 * Whether redirecting size more bytes would leave the peer more than this
 * direction's budget unread. Only this socket fills the peer's redirect
 * queue and only its reader empties it, so the budget left at the last read
 * of the peer's backlog (st->credit) is a lower bound of what is left now:
 * the backlog (probe reads through the peer) is read again only when a
 * message needs more than that.
 *
 * The budget starts at redirect_budget_bytes and doubles, up to
 * budget_ceiling, each time the reader took at least half of it between two
 * looks: as TCP grows the receive buffer of an application that reads
 * quickly, so that a reader that keeps up but stalls for a moment (a
 * preempted process) does not send its stream to TCP for good. A reader
 * that never reads keeps the first budget.
 */
static __always_inline bool over_budget(struct mw_sk_state *st, __u32 size)
{
	__u32 backlog, budget, ceiling, fixed;
	__s64 taken;

	if (size <= st->credit) {
		st->credit -= size;
		return false;
	}
	backlog = peer_backlog(st->peer_sk);
	budget = st->budget ? st->budget : redirect_budget_bytes;
	/* What the reader took since the last look: that backlog, plus what was redirected since, less this one. */
	taken = (__s64)st->seen_backlog + (__u32)((__u32)st->sent - st->seen_sent) - (__s64)backlog;
	/* Looked at each time: a receiver may set SO_RCVBUF after its first read. */
	fixed = fixed_buffer_budget(st->peer_sk);
	if (fixed) {
		if (budget > fixed)
			budget = fixed;
	} else if (st->budget && taken >= budget / 2) {
		ceiling = budget_ceiling(st->peer_sk);
		if (ceiling > budget)
			budget = (__u64)budget * 2 < ceiling ? budget * 2 : ceiling;
	}
	st->budget = budget;
	st->seen_backlog = backlog;
	st->seen_sent = (__u32)st->sent;
	if ((__u64)backlog + size > budget)
		return true;
	st->credit = budget - backlog - size;
	return false;
}

/*
 * Whether this message ends a small-message stream: stream_run_msgs messages
 * since the peer last sent, averaging below the path's threshold.
 */
static __always_inline bool small_stream(struct mw_sk_state *st, struct mw_conn *c, __u32 size)
{
	__u32 threshold;

	/* Turned off (--keep-small-streams): no write to the connection's line, which both sides read per message. */
	if (!stream_run_msgs)
		return false;
	if (c->last_sender != st->role) {
		c->last_sender = st->role;
		st->run_msgs = 0;
		st->run_bytes = 0;
	}
	st->run_msgs++;
	st->run_bytes += size;
	if (st->run_msgs < stream_run_msgs)
		return false;
	threshold = c->same_netns ? stream_small_bytes_local : stream_small_bytes_remote;
	if (st->run_bytes < (__u64)stream_run_msgs * threshold)
		return true;
	st->run_msgs = 0;
	st->run_bytes = 0;
	return false;
}

static __always_inline int skmsg(struct sk_msg_md *msg, bool tap)
{
	__u32 size = msg->size;
	struct bpf_sock *sk = msg->sk;
	struct mw_counters *cnt;
	struct mw_sk_state *st;
	struct mw_conn *c;
	__u32 reason;

	if (!sk)
		return SK_PASS;
	st = pair_state(sk, false);
	if (!st)
		return SK_PASS;
	if (!st->decision)
		decide(st, sk);

	cnt = counters();
	if (st->decision == MW_CONN_PAIRED) {
		__u32 state = sk->state;
		__u64 now = coarse_ns();

		/*
		 * After shutdown(SHUT_WR) (FIN_WAIT*, LAST_ACK, ...) TCP refuses the
		 * write with EPIPE; a redirect would deliver bytes after the FIN.
		 * The connection stays paired: the other direction is unchanged.
		 */
		if (state != BPF_TCP_ESTABLISHED && state != BPF_TCP_CLOSE_WAIT) {
			if (cnt) {
				cnt->passthrough_msgs[MW_REASON_SEND_SHUTDOWN]++;
				cnt->passthrough_bytes[MW_REASON_SEND_SHUTDOWN] += size;
			}
			return SK_PASS;
		}
		/*
		 * The redirect ignores the receiver's buffer limits. Once the
		 * receiver has more than its budget unread (over_budget), or the
		 * node's TCP memory is tight (where the redirect would fail with
		 * ENOMEM), this direction continues on TCP for good, whose flow
		 * control then blocks the writer. Order holds as in to_tcp.
		 */
		c = conn_of(st);
		if (c && !c->to_tcp && small_stream(st, c, size))
			request_tcp(c, MW_REASON_SMALL_STREAM);
		/*
		 * Asked by either side; until a switch point, keep redirecting. A
		 * direction that a sock_ops callback or the leave poll moved to
		 * TCP already (leave.h) never redirects again: they judged the
		 * peer's leave on it.
		 */
		if (c && c->to_tcp && (!still_redirecting(c, st) || switch_point(c, st, sk))) {
			to_tcp(st, c, c->to_tcp_reason);
		} else if (over_budget(st, size) || tcp_memory_tight(sk, size, now, cnt)) {
			/*
			 * The whole connection goes to TCP, so that its sockets can
			 * leave: a direction left redirected would keep both in the
			 * hash, and every later message of the bulk direction would
			 * pay tcp_bpf's pass-through and a leave check per packet. A
			 * peer that redirected and sends no more (a client awaiting a
			 * long response) switches at its next TCP packet (leave.h,
			 * quiet_switch). With streams to stay redirected
			 * (stream_run_msgs 0): this direction only.
			 */
			if (stream_run_msgs && c) {
				to_tcp(st, c, MW_REASON_BACKPRESSURE);
			} else {
				st->decision = MW_CONN_PASSTHROUGH;
				st->reason = MW_REASON_BACKPRESSURE;
				count_conn(MW_REASON_BACKPRESSURE);
				if (c)
					__sync_val_compare_and_swap(&c->dir[dir_index(st->role)], MW_DIR_REDIRECT,
								    MW_DIR_TCP);
			}
		} else if (bpf_msg_redirect_map(msg, &mw_sock_map, sock_index(st->conn_slot, st->peer_role), BPF_F_INGRESS) ==
			   SK_PASS) {
			if (tap)
				tap_record(msg, st, size);
			if (observe && c)
				obs_msg(msg, st, c, size, now);
			st->sent += size;
			st->redir_ns = now;
			if (cnt) {
				/* Read here, not kept across the calls above: 6.1's verifier loses the bound of a spilled index. */
				__u32 hop = st->hop;

				cnt->redirected_msgs++;
				cnt->redirected_bytes += size;
				if (hop < MW_HOP_MAX) {
					cnt->hop_msgs[hop]++;
					cnt->hop_bytes[hop] += size;
				}
			}
			return SK_PASS;
		} else {
			/*
			 * The peer socket is gone (closed): the connection is over on
			 * the other side, so TCP answers (RST) exactly as without meshwarp.
			 */
			st->decision = MW_CONN_PASSTHROUGH;
			st->reason = MW_REASON_PEER_CLOSED;
		}
	}
	reason = st->reason;
	if (cnt && reason < MW_REASON_MAX) {
		cnt->passthrough_msgs[reason]++;
		cnt->passthrough_bytes[reason] += size;
	}
	return SK_PASS;
}

#endif /* MESHWARP_REDIRECT_H */
