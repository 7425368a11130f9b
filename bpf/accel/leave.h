/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * Leaving mw_sock_map, and the close (sock_ops HDR_OPT_LEN_CB and
 * PARSE_HDR_OPT_CB, asked for only by sockets in the map; STATE_CB). A
 * paired connection whose direction went to TCP (redirect.h) gives its
 * sockets plain TCP back at their first TCP packet, once no byte can be lost
 * or reordered; a paired connection sends no TCP packets while it redirects,
 * so this costs nothing until then. The close releases the mw_conns slot.
 */
#ifndef MESHWARP_LEAVE_H
#define MESHWARP_LEAVE_H

/*
 * Nothing the peer redirected can still be on its way to us, nor come later:
 * its direction is on TCP (its sk_msg program passes from now on) and no
 * sendmsg of it that decided to redirect is still running. NEVER: it never
 * redirected; DRAINED: it switched when nothing of it was in flight. Else
 * every tcp_bpf sendmsg holds a reference on its psock from start to end
 * (redirect included), so a psock that is gone, or held by mw_sock_map
 * alone, has none running. A probe read after the peer was freed is
 * harmless: a closed peer has no sendmsg running either.
 */
static __always_inline bool peer_quiet(const struct mw_conn *c, __u32 peer_dir)
{
	__u64 peer = peer_dir == 0 ? c->active_sk : c->passive_sk;
	__u64 user_data, next;
	struct sk_psock *psock;
	__u32 d = c->dir[peer_dir & 1];

	if (d == MW_DIR_NEVER || d == MW_DIR_DRAINED)
		return true;
	if (d != MW_DIR_TCP || !peer)
		return false;
	user_data = (__u64)BPF_CORE_READ((struct sock *)peer, sk_user_data);
	if (!(user_data & MW_SK_USER_DATA_PSOCK))
		return true;
	psock = (struct sk_psock *)(user_data & ~(__u64)MW_SK_USER_DATA_FLAGS);
	next = (__u64)BPF_CORE_READ(psock, link.next);
	/* In no map: the one reference left may be a running sendmsg's. */
	if (next == (__u64)psock + bpf_core_field_offset(struct sk_psock, link))
		return false;
	return BPF_CORE_READ(psock, refcnt.refs.counter) == 1;
}

/*
 * Whether this socket's own direction may go to TCP now without its peer
 * ever seeing two queues: the peer has read everything this socket
 * redirected (its psock queue is empty) and nothing more is on its way
 * (refs: the references this socket's psock holds when no other sendmsg of
 * it runs: 2 from its own sk_msg, 1 from a sock_ops callback). Only this
 * socket redirects into its peer, so an empty queue stays empty.
 */
static __always_inline bool own_dir_drained(const struct mw_conn *c, __u32 me, struct sock *self, __u32 refs)
{
	__u64 peer = me == 0 ? c->passive_sk : c->active_sk;

	if (c->dir[me & 1] == MW_DIR_NEVER || c->dir[me & 1] == MW_DIR_DRAINED)
		return true;
	return psock_refs(self) == refs && peer_backlog(peer) == 0;
}

static __always_inline void stop_leave_checks(struct bpf_sock_ops *skops, __u32 cb_flags, __u32 mask)
{
	if (cb_flags & mask)
		bpf_sock_ops_cb_flags_set(skops, cb_flags & ~mask);
}

/*
 * STATE_CB of a closing socket. The leave checks run with the packets at
 * which a socket may leave (on_leave_check); a way that brings no new
 * bytes any more stops its check:
 *  - the socket queued its FIN (FIN_WAIT1/2; LAST_ACK, CLOSING, TIME_WAIT):
 *    nothing is written after it, and what it still transmits was written
 *    before and gets ACKs back, whose receive check stays until the
 *    peer's FIN;
 *  - it received the peer's FIN (CLOSE_WAIT; the same three): every byte
 *    before it is in (a FIN is processed in sequence), so no arriving
 *    packet queues a byte any more.
 * With both stopped, the leave poll (started by a switch) is what is left.
 * About four sock_ops runs fewer per connection.
 */
static __always_inline void closing_stops_leave_checks(struct bpf_sock_ops *skops, __u32 new_state, __u32 cb_flags)
{
	__u32 mask = 0;

	switch (new_state) {
	case BPF_TCP_FIN_WAIT1:
	case BPF_TCP_FIN_WAIT2:
		mask = BPF_SOCK_OPS_WRITE_HDR_OPT_CB_FLAG; /* queued its FIN */
		break;
	case BPF_TCP_CLOSE_WAIT:
		mask = BPF_SOCK_OPS_PARSE_ALL_HDR_OPT_CB_FLAG; /* received the peer's */
		break;
	case BPF_TCP_LAST_ACK:
	case BPF_TCP_CLOSING:
	case BPF_TCP_TIME_WAIT:
		mask = MW_LEAVE_CHECK_FLAGS; /* both */
		break;
	}
	stop_leave_checks(skops, cb_flags, mask);
}

/*
 * The connection goes to TCP (c->to_tcp), but this socket's direction is
 * still REDIRECT and may never send again (a client awaiting a long
 * response): only its own sk_msg switches it (redirect.h), so both sockets
 * would stay in the map. Its own callback, under its socket lock, switches
 * it where that sk_msg would (switch_point), when no sendmsg of it is under
 * way (its psock held by mw_sock_map alone: tcp_bpf's sendmsg holds a
 * reference from before its verdict to after its redirect). A sendmsg that
 * starts later runs its verdict under the same lock, after this, and finds
 * the decision PASSTHROUGH.
 */
static __always_inline void quiet_switch(struct mw_sk_state *st, struct mw_conn *c, __u32 me, struct sock *self)
{
	if (c->dir[me & 1] != MW_DIR_REDIRECT || redirect_backlog(self) || !own_dir_drained(c, me, self, 1))
		return;
	if (__sync_val_compare_and_swap(&c->dir[me & 1], MW_DIR_REDIRECT, MW_DIR_DRAINED) != MW_DIR_REDIRECT)
		return;
	st->decision = MW_CONN_PASSTHROUGH;
	st->reason = c->to_tcp_reason;
}

/*
 * A socket of a connection that went to TCP leaves at its next packet
 * (on_leave_check). One that gets none after its conditions came true (a
 * reader whose TCP bytes were all acknowledged while it still had
 * redirected bytes to read; a requester that stopped sending) would stay in
 * mw_sock_map, where FIONREAD counts only the empty redirect queue. So the
 * switch puts its connection on mw_leave_polls, and the node's one leave
 * timer (mw_leave_clock) re-runs the check of every listed connection every
 * MW_LEAVE_POLL_NS until both its sockets are out, with the rule of the
 * receive path (no psock call running: one reference). The sockets' own
 * state (st->left, the counters) is settled at their next callback or
 * close. sock_ops creates the timer at a pairing, once per load of the
 * programs (only sock_ops and its timer callbacks may delete from a
 * SOCKMAP: sk_msg may start the timer, not create it); the switch starts
 * it; it re-arms itself while the list is not empty. The poll ends with
 * the agent: the kernel cancels a map's timers once no file descriptor or
 * pin holds it, so a connection that switches after an uninstall keeps its
 * sockets in the map until it closes (docs/ARCHITECTURE.md, "Leaving").
 */
#define MW_LEAVE_POLL_NS (20 * 1000 * 1000ULL)

static int on_leave_clock(void *map, __u32 *key, struct mw_leave_clock *clock);

static __always_inline struct mw_leave_clock *leave_clock(void)
{
	__u32 zero = 0;

	return bpf_map_lookup_elem(&mw_leave_clock, &zero);
}

/* sock_ops, at a pairing: the timer exists and runs this load's callback (once per load). */
static __always_inline void leave_clock_ready(void)
{
	struct mw_leave_clock *clock = leave_clock();

	if (!clock || clock->owner == leave_clock_owner)
		return;
	/* EBUSY: an earlier load created it; the callback becomes ours either way. */
	bpf_timer_init(&clock->timer, &mw_leave_clock, CLOCK_MONOTONIC);
	if (bpf_timer_set_callback(&clock->timer, on_leave_clock) == 0)
		clock->owner = leave_clock_owner;
}

/* Start the timer unless it is armed already (a restart would push its expiry out). */
static __always_inline void arm_leave_clock(struct mw_leave_clock *clock)
{
	if (__sync_val_compare_and_swap(&clock->armed, 0, 1) != 0)
		return;
	/* Not created yet (no pairing since the maps were made): it is, at the next one. */
	if (bpf_timer_start(&clock->timer, MW_LEAVE_POLL_NS, 0))
		clock->armed = 0;
}

/* The switch (sk_msg, redirect.h): list the connection for the poll. */
static __always_inline void poll_leave(const struct mw_sk_state *st, struct mw_conn *c)
{
	struct mw_leave_clock *clock = leave_clock();
	__u32 slot = st->conn_slot;

	if (!clock)
		return;
	/*
	 * The listing holds the slot (mw_conn.polls) until the poll is done
	 * with it; the sender counts it before it lists, and takes its count
	 * back if the connection was listed already.
	 */
	__sync_fetch_and_add(&c->polls, 1);
	if (bpf_map_update_elem(&mw_leave_polls, &st->conn, &slot, BPF_NOEXIST) == 0)
		__sync_fetch_and_add(&clock->polls, 1);
	else
		__sync_fetch_and_sub(&c->polls, 1);
	arm_leave_clock(clock);
}

/* A socket of a connection gone to TCP left mw_sock_map (either way: at a packet or by the poll). */
static __always_inline void count_left(enum mw_reason reason)
{
	struct mw_counters *cnt = counters();

	if (!cnt)
		return;
	cnt->sockets_left++;
	if (reason < MW_REASON_MAX)
		cnt->sockets_removed[reason]++;
}

static __always_inline void count_closed(void)
{
	struct mw_counters *cnt = counters();

	if (cnt)
		cnt->sockets_closed++;
}

/*
 * Whether the caller is the one to count the socket of role index me of a
 * PAIRED connection out of accelerated_sockets (as left or closed): the
 * first to set its bit in c->counted_out. A leave at a packet, the leave
 * poll and the closes race for it; each socket is counted exactly once.
 */
static __always_inline bool claim_count(struct mw_conn *c, __u32 me)
{
	__u32 bit = 1u << (me & 1);

	return !(__sync_fetch_and_or(&c->counted_out, bit) & bit);
}

/*
 * Take the socket of role index me out of mw_sock_map, and count it out
 * unless counted already. Out already (a failed delete) means its
 * application closed it: close() unlinks it before its FIN. Counted closed.
 */
static __always_inline void leave_and_count(struct mw_conn *c, __u32 slot, __u32 me)
{
	bool mine = claim_count(c, me);
	__u32 index = sock_index(slot, me + 1);
	long err = bpf_map_delete_elem(&mw_sock_map, &index);

	if (!mine)
		return;
	if (err == 0)
		count_left(c->to_tcp_reason);
	else
		count_closed();
}

/*
 * HDR_OPT_LEN_CB (the socket sends a TCP packet) and PARSE_HDR_OPT_CB (it
 * received one; the callback runs before the segment's bytes are queued). A
 * socket that will not (or no longer) redirect leaves mw_sock_map, which
 * restores the plain TCP socket (tcp_sendmsg, native FIONREAD, PEEK,
 * SO_PEEK_OFF ...), once that cannot lose or reorder a byte:
 *  - its connection is PASSTHROUGH: it never was a redirect target;
 *  - PENDING and a segment arrives (the active side only is in the map):
 *    the peer sends by TCP, so it is no local peer of ours: PASSTHROUGH;
 *    or it sends one after the unpaired timeout: PASSTHROUGH too;
 *  - PAIRED and gone to TCP: the peer will never redirect to it again
 *    (peer_quiet), its own redirect queue is empty (the kernel frees what is
 *    queued when the psock goes), and its own direction is drained (one
 *    that still redirects and is quiet switches here first: quiet_switch).
 * Receiving, it leaves before the first TCP byte lands, so a reader never
 * sees two queues. Until then it asks again with the next packet either
 * way. Sockets with nothing left to decide stop the callbacks.
 */
static __always_inline void on_leave_check(struct bpf_sock_ops *skops, struct bpf_sock *sk, __u32 cb_flags,
					   bool receiving)
{
	struct mw_sk_state *st = pair_state(sk, false);
	struct tcp_sock *tp;
	struct mw_conn *c;
	__u32 me;

	if (!st || st->left || !st->role)
		goto done;
	c = conn_of(st);
	if (!c)
		goto done; /* the active side closed: nothing is redirected to us any more */
	if (c->state == MW_CONN_PENDING) {
		if (receiving)
			conn_passthrough(c, MW_REASON_NO_PEER);
		else if (pending_expired(c))
			conn_passthrough(c, MW_REASON_UNPAIRED_TIMEOUT);
	}
	if (c->state == MW_CONN_PASSTHROUGH) {
		remove_socket(st->conn_slot, st->role, c->reason);
		goto done;
	}
	if (c->state != MW_CONN_PAIRED || !c->to_tcp)
		return;
	me = dir_index(st->role);
	tp = bpf_skc_to_tcp_sock(sk);
	if (!tp)
		return;
	quiet_switch(st, c, me, (struct sock *)tp);
	/* Sending, a sendmsg of ours may hold a reference; receiving in softirq, none does. */
	if (!peer_quiet(c, 1 - me) || redirect_backlog((struct sock *)tp) ||
	    !own_dir_drained(c, me, (struct sock *)tp, receiving ? 1 : 2))
		return;
	/*
	 * Receiving, one reference proves that no sendmsg of ours runs: DRAINED,
	 * and the peer may leave at once. Sending, the second reference is not
	 * always the sendmsg that sends this packet: tcp_bpf releases our socket
	 * lock between a verdict to redirect and the redirect itself, and an ACK
	 * can go out then. The peer leaving under that redirect would fail it
	 * with EPIPE (tcp_bpf_sendmsg_redir finds no psock), or purge what it
	 * queued. So TCP: the peer waits until our psock is gone (peer_quiet).
	 */
	if (receiving)
		c->dir[me] = MW_DIR_DRAINED;
	else
		__sync_val_compare_and_swap(&c->dir[me], MW_DIR_REDIRECT, MW_DIR_TCP);
	leave_and_count(c, st->conn_slot, me);
	st->left = 1;
	st->paired = 0;
done:
	stop_leave_checks(skops, cb_flags, MW_LEAVE_CHECK_FLAGS);
}

/*
 * Whether the socket of role index me is out of mw_sock_map (now or before).
 * The timer holds no lock of the socket, whose sendmsg may decide to
 * redirect at any moment: it once marked the direction DRAINED after it saw
 * one reference, while a sendmsg that took its reference just after (its
 * verdict still redirecting: another reference, a reader's, failed its
 * switch point) redirected; the peer, finding DRAINED, left, and the kernel
 * freed the message (sk_psock_queue_msg drops it once the psock is stopped):
 * one message lost, its send() successful (BENCHMARKS 44). So the timer
 * marks the direction TCP first, then looks for a running sendmsg: one that
 * took its reference before the mark is seen here, one after finds TCP and
 * passes (skmsg redirects only while REDIRECT). TCP, not DRAINED: the peer
 * then waits until this socket's psock is gone (peer_quiet), which no
 * sendmsg that still redirects allows.
 */
static __always_inline bool leave_by_timer(__u32 slot, struct mw_conn *c, __u32 me)
{
	__u64 self = me == 0 ? c->active_sk : c->passive_sk;

	if (!self || !psock_of((struct sock *)self))
		return true;
	if (!peer_quiet(c, 1 - me) || redirect_backlog((struct sock *)self) ||
	    !own_dir_drained(c, me, (struct sock *)self, 1))
		return false;
	__sync_val_compare_and_swap(&c->dir[me & 1], MW_DIR_REDIRECT, MW_DIR_TCP);
	if (!own_dir_drained(c, me, (struct sock *)self, 1))
		return false;
	/* Its next packet finds it out (and counted): it only marks its own state. */
	leave_and_count(c, slot, me);
	return true;
}

/* The poll of one listed connection: whether it is done (both sockets out, or closed). */
static int leave_poll(void *map, struct mw_conn_id *id, __u32 *slot, void *ctx)
{
	/* The listing holds the slot (poll_leave): published or not, it is this connection's. */
	struct mw_conn *c = conn_held(*slot, id);
	struct mw_leave_clock *clock;
	bool out = true;

	if (c && c->state == MW_CONN_PAIRED && c->to_tcp) {
		out = leave_by_timer(*slot, c, 0);
		out = leave_by_timer(*slot, c, 1) && out;
	}
	if (!out || bpf_map_delete_elem(&mw_leave_polls, id))
		return 0;
	if (c)
		__sync_fetch_and_sub(&c->polls, 1);
	clock = leave_clock();
	if (clock)
		__sync_fetch_and_sub(&clock->polls, 1);
	return 0;
}

/* The timer: poll every listed connection; again later while any is left. */
static int on_leave_clock(void *map, __u32 *key, struct mw_leave_clock *clock)
{
	clock->armed = 0;
	bpf_for_each_map_elem(&mw_leave_polls, leave_poll, NULL, 0);
	if (clock->polls)
		arm_leave_clock(clock);
	return 0;
}

/*
 * Whether a socket reaching CLOSE is still in mw_sock_map: a reset or its
 * TIME_WAIT closed it before its application did (close() unlinks it
 * first). It has a psock then (a socket out of every SOCKMAP has none).
 */
static __always_inline bool closed_in_sock_map(struct bpf_sock *sk)
{
	struct tcp_sock *tp = bpf_skc_to_tcp_sock(sk);

	return tp && sock_linked((__u64)(unsigned long)tp);
}

/*
 * The close (STATE_CB to CLOSE) of a socket with pairing state. Counting:
 * a socket of a PAIRED connection is counted out of accelerated_sockets
 * once (claim_count), where it leaves or closes; the connecting side's
 * close ends the connection (its mw_conns slot is released: nothing is redirected
 * to or from the peer after that), so it counts the peer out too if it is
 * still counted. A peer closing after it has nothing left to count.
 */
static __always_inline void on_close(struct bpf_sock *sk, struct mw_sk_state *st)
{
	if (st->holds == MW_HOLD_ACTIVE) {
		/* Its own hold keeps the slot this connection's (published until now). */
		struct mw_conn *c = conn_held(st->conn_slot, &st->conn);

		/*
		 * A passive side in the middle of pairing (between its lookup and
		 * its cmpxchg to PAIRED, a sock_hash_update apart) must not pair
		 * with this closed socket: whichever cmpxchg comes first holds.
		 */
		if (c && c->state == MW_CONN_PENDING) {
			c->reason = MW_REASON_PEER_CLOSED;
			__sync_val_compare_and_swap(&c->state, MW_CONN_PENDING, MW_CONN_PASSTHROUGH);
		}
		if (c && c->state == MW_CONN_PAIRED) {
			if (claim_count(c, 0))
				count_closed();
			if (claim_count(c, 1))
				count_closed();
		}
		if (c) {
			if (c->state)
				obs_conn_end(obs_of(st), c, MW_ROLE_ACTIVE);
			conn_end(c, closed_in_sock_map(sk), mw_now_us());
		}
		st->holds = 0;
	} else if (st->role == MW_ROLE_PASSIVE && st->peer_role == MW_ROLE_ACTIVE) {
		/* Still there if the active side has not closed (it gave us its last bytes then). */
		struct mw_conn *c = conn_of(st);

		if (c) {
			if (c->state == MW_CONN_PAIRED && claim_count(c, 1))
				count_closed();
			obs_conn_end(obs_of(st), c, MW_ROLE_PASSIVE);
		} else if (st->paired) {
			obs_passive_end(obs_of(st));
		}
		if (st->holds == MW_HOLD_PASSIVE) {
			c = conn_held(st->conn_slot, &st->conn);
			if (c)
				conn_release(c, MW_HOLD_PASSIVE, closed_in_sock_map(sk), mw_now_us());
			st->holds = 0;
		}
	}
	st->decision = MW_CONN_PASSTHROUGH;
	st->reason = MW_REASON_PEER_CLOSED;
	st->paired = 0;
}

#endif /* MESHWARP_LEAVE_H */
