/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * Pairing (sock_ops ACTIVE_ESTABLISHED_CB and PASSIVE_ESTABLISHED_CB on the
 * agent's cgroup): which two sockets of the node are the ends of one
 * connection, proven by both initial sequence numbers, which NAT never
 * rewrites. Both join mw_sock_map, so sk_msg (redirect.h) can move each
 * message straight into the peer's receive queue.
 *
 * How a connection is paired (once, never changed):
 *   0. a socket of the cgroup connects (TCP_CONNECT_CB): note its SYN by
 *      source address and sequence number in mw_syn_notes; a listener of
 *      the cgroup receives a SYN (mw_ingress): mark its note received. No
 *      note received means no local peer in the cgroup (a remote host, a
 *      server outside the cgroup): such sockets never join mw_sock_map.
 *      The notes only decide who joins; the pairing is proven in step 2.
 *      (hints.h)
 *   1. active side ESTABLISHED: if a listener of the cgroup received its
 *      SYN, claim a slot of mw_conns for id, PENDING (with the time), join
 *      mw_sock_map.
 *   2. passive side ESTABLISHED: if id's slot is PENDING (both initial
 *      sequence numbers match), no older than unpaired_timeout_ns, and the
 *      active side's address is our remote address, join mw_sock_map, then
 *      PENDING -> PAIRED.
 *   3. active side's first sendmsg: if still PENDING, PENDING -> PASSTHROUGH:
 *      that byte goes by TCP, and so does every later byte in both directions.
 *      (redirect.h)
 *   4. a segment reaches the active side while PENDING: its peer sends by
 *      TCP, so it is none of ours: PENDING -> PASSTHROUGH; it sends one
 *      after unpaired_timeout_ns: PENDING -> PASSTHROUGH (leave.h).
 * The passive side cannot send before step 2 (it is not accepted yet), and the
 * active side redirects only after it saw PAIRED, so no stream is ever split
 * between the two paths.
 *
 * Either side's own unfitness keeps the connection off before step 1 or in
 * step 2: options on the socket, a learned port, a learned program (the one
 * that created the socket, or its listener: learning.h).
 *
 * Sockets that will not be paired leave mw_sock_map, so the kernel gives
 * them plain TCP back (tcp_bpf's FIONREAD, sendmsg and splice differ). A
 * socket is removed only when its connection is PASSTHROUGH, a final state:
 * a socket is a redirect target only of a PAIRED peer, so a removed socket
 * has never had, and never gets, a redirected byte to lose. The passive side
 * removes the active socket when it finds the decision made (step 2), and
 * itself when it loses the race to step 3; else the active socket removes
 * itself at its next packet (leave.h), before a byte of it is queued: one it
 * receives, or one it sends once the wait is over (its first byte, or the
 * ACK it gives a listener's retransmitted SYN-ACK when its handshake's last
 * ACK was lost). An active socket whose peer never comes and that sends and
 * receives nothing stays in the map until it closes: with nothing queued,
 * tcp_bpf answers every call as TCP does. That is the price of no timer
 * per connection (the leave poll has one timer for the node: leave.h).
 */
#ifndef MESHWARP_PAIRING_H
#define MESHWARP_PAIRING_H

#define EBUSY 16
#define CLOCK_MONOTONIC 1

static __always_inline void leave_clock_ready(void); /* leave.h */

/*
 * The monotonic clock in 1.024 us units, in the 4 bytes mw_conn has for it:
 * it wraps after 73 minutes, so an accepted side born that late may compute
 * a short wait and be paired, which is safe (neither side sent yet); the
 * timeout is a bound on waiting, not on correctness.
 */
static __always_inline __u32 mw_now_us(void)
{
	return bpf_ktime_get_ns() >> 10;
}

/* Whether a PENDING connection waited longer than unpaired_timeout_ns for its peer. */
static __always_inline bool pending_expired_at(const struct mw_conn *c, __u32 now_us)
{
	return now_us - c->pending_us > (__u32)(unpaired_timeout_ns >> 10);
}

static __always_inline bool pending_expired(const struct mw_conn *c)
{
	return pending_expired_at(c, mw_now_us());
}

/*
 * Take the socket of role in slot, of a PASSTHROUGH connection, out of
 * mw_sock_map (see the header: it never was and never will be a redirect
 * target). The caller holds the slot, so the index is this connection's.
 * Only sock_ops (and its timer callbacks) may delete from a SOCKMAP.
 */
static __always_inline void remove_socket(__u32 slot, __u32 role, __u32 reason)
{
	struct mw_counters *c;
	__u32 index = sock_index(slot, role);

	if (bpf_map_delete_elem(&mw_sock_map, &index))
		return; /* already removed, or closed */
	c = counters();
	if (c && reason < MW_REASON_MAX)
		c->sockets_removed[reason]++;
}

static __always_inline void remove_active(__u32 slot, const struct mw_conn *c)
{
	remove_socket(slot, MW_ROLE_ACTIVE, c->reason);
}

/* Policy on the destination the application asked for (the active side's remote). */
static __always_inline bool policy_allows(const struct mw_endpoint *dst)
{
	__u32 zero = 0;
	__u32 port = dst->port_host;
	__u32 *action = bpf_map_lookup_elem(&mw_port_policy, &port);
	struct mw_policy_cfg *cfg = bpf_map_lookup_elem(&mw_policy, &zero);
	struct mw_cidr_key key = { .prefixlen = 128 };

	if (action && *action == MW_PORT_EXCLUDE)
		return false;
	__builtin_memcpy(key.addr, dst->addr, sizeof(key.addr));
	if (bpf_map_lookup_elem(&mw_cidr_excl, &key))
		return false;
	if (!cfg)
		return true;
	if (cfg->include_ports_set && !(action && *action == MW_PORT_INCLUDE))
		return false;
	if (cfg->include_cidrs_set && !bpf_map_lookup_elem(&mw_cidr_incl, &key))
		return false;
	return true;
}

/*
 * Exclusions on the accepted side's own endpoint (the server as NAT
 * delivered the connection): an excluded server port or address stays on
 * TCP whatever the client dialled. Include lists apply to the dialled
 * destination only (under capture the accepted side is the sidecar's port).
 */
static __always_inline bool policy_excludes(const struct mw_endpoint *ep)
{
	__u32 port = ep->port_host;
	__u32 *action = bpf_map_lookup_elem(&mw_port_policy, &port);
	struct mw_cidr_key key = { .prefixlen = 128 };

	if (action && *action == MW_PORT_EXCLUDE)
		return true;
	__builtin_memcpy(key.addr, ep->addr, sizeof(key.addr));
	return bpf_map_lookup_elem(&mw_cidr_excl, &key) != NULL;
}

/*
 * Why this socket must not be paired, whatever its peer: 0 if none. Read at
 * ESTABLISHED, before the first byte, so options set before connect() or
 * inherited from the listener keep the connection on TCP from the start.
 * TCP_REPAIR: its owner chose its sequence numbers (no handshake), so they
 * prove nothing. The rest are options tcp_bpf's recvmsg/sendmsg do not
 * honour (net/ipv4/tcp_bpf.c): SO_RCVLOWAT > 1, SO_PEEK_OFF, TCP_INQ,
 * receive timestamps and SO_TIMESTAMPING, SO_ZEROCOPY.
 */
static __always_inline __u32 socket_unfit(struct tcp_sock *tp)
{
	struct sock *s;
	__u64 flags;

	if (!tp)
		return MW_REASON_TCP_REPAIR;
	if (BPF_CORE_READ_BITFIELD(tp, repair))
		return MW_REASON_TCP_REPAIR;
	s = &tp->inet_conn.icsk_inet.sk;
	if (s->sk_rcvlowat > 1)
		return MW_REASON_RCVLOWAT;
	if (s->sk_peek_off >= 0)
		return MW_REASON_PEEK_OFF;
	if (BPF_CORE_READ_BITFIELD(tp, recvmsg_inq))
		return MW_REASON_TCP_INQ;
	flags = s->__sk_common.skc_flags;
	if (flags & (1ULL << bpf_core_enum_value(enum sock_flags, SOCK_URGINLINE)))
		return MW_REASON_OOB;
	if (flags & (1ULL << bpf_core_enum_value(enum sock_flags, SOCK_ZEROCOPY)))
		return MW_REASON_ZEROCOPY;
	if ((flags & ((1ULL << bpf_core_enum_value(enum sock_flags, SOCK_RCVTSTAMP)) |
		      (1ULL << bpf_core_enum_value(enum sock_flags, SOCK_RCVTSTAMPNS)) |
		      (1ULL << bpf_core_enum_value(enum sock_flags, SOCK_TIMESTAMPING_RX_SOFTWARE)))) ||
	    BPF_CORE_READ_BITFIELD(s, sk_tsflags))
		return MW_REASON_TIMESTAMP;
	return 0;
}

/*
 * Whether the connecting socket wrote before it was established (TCP Fast
 * Open data in the SYN or queued behind it, a write that raced connect):
 * those bytes are on the TCP path, and redirected later bytes could overtake
 * them in the receiver (tcp_bpf_recvmsg reads the redirect queue first).
 */
static __always_inline bool wrote_early(struct tcp_sock *tp, __u32 snd_nxt)
{
	if (!tp)
		return true;
	return tp->write_seq != snd_nxt || tp->bytes_sent != 0;
}

/*
 * What the program that created the socket (for an accepted one: its
 * listener) taught (learning.h), or 0. One socket-storage read and one hash
 * lookup, only once anything was learned.
 */
static __always_inline __u32 prog_unfit(struct bpf_sock *sk)
{
	struct mw_unfit_prog *u;
	struct mw_prog *prog;
	__u32 zero = 0, *any;

	any = bpf_map_lookup_elem(&mw_learned_any, &zero);
	if (!any || !*any)
		return 0;
	prog = prog_state(sk, false);
	if (!prog)
		return 0; /* created before the agent, or outside the cgroup */
	u = bpf_map_lookup_elem(&mw_unfit_progs, prog);
	if (!u)
		return 0;
	__sync_fetch_and_add(&u->kept_off, 1);
	return u->reason;
}

/* Give up on a PENDING connection; whoever wins the cmpxchg writes the reason. */
static __always_inline void conn_passthrough(struct mw_conn *c, __u32 reason)
{
	if (__sync_val_compare_and_swap(&c->state, MW_CONN_PENDING, MW_CONN_PASSTHROUGH) ==
	    MW_CONN_PENDING) {
		c->reason = reason;
		count_conn(reason);
	}
}

/* Why a socket could not join mw_sock_map (bpf_sock_map_update's error; EEXIST: a closing socket still at the index). */
static __always_inline __u32 join_error_reason(long err)
{
	return err == -EBUSY ? MW_REASON_SOCKMAP_BUSY : MW_REASON_SOCKHASH_FULL;
}

static __always_inline void count_join_error(__u32 reason)
{
	struct mw_counters *cnt;

	if (reason != MW_REASON_SOCKHASH_FULL)
		return;
	cnt = counters();
	if (cnt)
		cnt->sockhash_full++;
}

/* The first of the pair of mw_unhinted_notes slots of connection id (see syn_slot). */
static __always_inline __u32 unhinted_slot(const struct mw_conn_id *id)
{
	return ((id->active_isn1 ^ id->passive_isn1 * 2246822519u) * 2654435761u >> 16) & (MW_UNHINTED_NOTES - 2);
}

/* The note of connection id, or NULL. */
static __always_inline struct mw_unhinted_note *find_unhinted(const struct mw_conn_id *id)
{
	__u32 slot = unhinted_slot(id), next = slot + 1;
	struct mw_unhinted_note *n;

	if (!id->active_isn1 && !id->passive_isn1)
		return NULL;
	n = bpf_map_lookup_elem(&mw_unhinted_notes, &slot);
	if (n && n->id.active_isn1 == id->active_isn1 && n->id.passive_isn1 == id->passive_isn1)
		return n;
	n = bpf_map_lookup_elem(&mw_unhinted_notes, &next);
	if (n && n->id.active_isn1 == id->active_isn1 && n->id.passive_isn1 == id->passive_isn1)
		return n;
	return NULL;
}

/*
 * The connecting socket of connection id (source local) found no SYN note:
 * note it for the accepted side, as on_connect notes a SYN (hints.h). The
 * accepted side comes within a round trip or never (a remote peer).
 */
static __always_inline void note_unhinted(const struct mw_conn_id *id, const struct mw_endpoint *local, __u32 now_us)
{
	__u32 slot = unhinted_slot(id), next = slot + 1;
	struct mw_unhinted_note *n, *other;

	if (!id->active_isn1 && !id->passive_isn1)
		return;
	n = bpf_map_lookup_elem(&mw_unhinted_notes, &slot);
	other = bpf_map_lookup_elem(&mw_unhinted_notes, &next);
	if (!n || !other)
		return;
	if (note_takes_second(n->id.active_isn1 || n->id.passive_isn1, n->noted_us,
			      other->id.active_isn1 || other->id.passive_isn1, other->noted_us, now_us,
			      MW_UNHINTED_TTL_US))
		n = other;
	n->id.active_isn1 = 0;
	n->id.passive_isn1 = 0;
	__builtin_memcpy(n->addr, local->addr, sizeof(n->addr));
	n->noted_us = now_us;
	asm volatile("" ::: "memory");
	n->id = *id;
}

static __always_inline void on_active_established(struct bpf_sock_ops *skops, struct bpf_sock *sk,
						  struct tcp_sock *tp, __u32 snd_nxt, __u32 rcv_nxt, __u32 cb_flags,
						  __u64 now)
{
	struct mw_tuple t = {};
	struct mw_sk_state *st;
	struct mw_conn *c, *other;
	struct mw_conn_id id = { .active_isn1 = snd_nxt, .passive_isn1 = rcv_nxt };
	__u32 reason, slot, index, now_us = now >> 10 /* mw_now_us */, *learned;
	bool hinted;
	long err;

	sockops_tuple(skops, &t);
	/* Consume the connect's notes first, whatever happens next. */
	hinted = take_syn_hint(&t.local, snd_nxt, now);
	reason = socket_unfit(tp);
	if (!reason && wrote_early(tp, snd_nxt))
		reason = MW_REASON_EARLY_DATA;
	if (reason) {
		keep_off(reason);
		return;
	}
	if (!policy_allows(&t.remote)) {
		keep_off(MW_REASON_POLICY);
		return;
	}
	learned = bpf_map_lookup_elem(&mw_unfit_rport, &t.remote.port_host);
	if (learned) {
		keep_off(*learned);
		return;
	}
	reason = prog_unfit(sk);
	if (reason) {
		keep_off(reason);
		return;
	}
	if (!hinted) {
		/* If the accepted side is ours after all, it finds out why (step 2). */
		note_unhinted(&id, &t.local, now_us);
		keep_off(MW_REASON_NO_LOCAL_PEER);
		return;
	}
	st = pair_state(sk, true);
	if (!st)
		return;
	/* A socket reconnected after connect(AF_UNSPEC) keeps its storage: start clean. */
	__builtin_memset(st, 0, sizeof(*st));
	st->role = MW_ROLE_ACTIVE;

	/*
	 * Another live connection drew the same identity (other), or every
	 * slot it may take is in use. Neither may be paired: a passive socket
	 * could not tell which active socket it belongs to.
	 */
	other = conn_find(&id, &slot);
	c = other ? NULL : conn_claim(&id, &slot, now_us);
	if (!c) {
		reason = other ? MW_REASON_KEY_COLLISION : MW_REASON_SOCKHASH_FULL;
		if (other && __sync_val_compare_and_swap(&other->state, MW_CONN_PENDING,
							 MW_CONN_PASSTHROUGH) == MW_CONN_PENDING)
			other->reason = MW_REASON_KEY_COLLISION;
		count_join_error(reason);
		st->decision = MW_CONN_PASSTHROUGH;
		st->reason = reason;
		count_conn(reason);
		return;
	}
	/* Everything of the connection after the identity (claimed): what the slot's last connection left goes. */
	__builtin_memset(&c->to_tcp, 0,
			 __builtin_offsetof(struct mw_conn, probed) - __builtin_offsetof(struct mw_conn, to_tcp));
	c->active_sk = (__u64)(unsigned long)sk;
	c->active_local = t.local;
	c->active_remote = t.remote;
	c->active_is_sidecar = socket_uid(tp) == sidecar_uid;
	c->active_netns = bpf_get_netns_cookie(skops);
	c->pending_us = now_us;
	obs_joins(st, c, 0);
	conn_publish(c, MW_CONN_PENDING);
	st->holds = MW_HOLD_ACTIVE;
	st->conn = id;
	st->conn_slot = slot;
	/* STATE_CB lets us let go of the slot when this socket closes. */
	want_callbacks(skops, cb_flags);

	index = sock_index(slot, MW_ROLE_ACTIVE);
	err = bpf_sock_map_update(skops, &mw_sock_map, &index, BPF_NOEXIST);
	if (err) {
		reason = join_error_reason(err);
		conn_passthrough(c, reason);
		count_join_error(reason);
		st->decision = MW_CONN_PASSTHROUGH;
		st->reason = reason;
		return;
	}
	st->peer_role = MW_ROLE_PASSIVE;
}

static __always_inline __u32 classify_hop(__u32 passive_local_port, const struct mw_conn *c)
{
	if (passive_local_port == outbound_capture_port)
		return MW_HOP_APP_TO_SIDECAR;
	if (passive_local_port == inbound_capture_port)
		return MW_HOP_SIDECAR_TO_SIDECAR;
	if (c->active_is_sidecar)
		return MW_HOP_SIDECAR_TO_APP;
	return MW_HOP_DIRECT;
}

/*
 * Both ends of this connection are in the cgroup, but its connecting socket
 * found no note (no_local_peer) and stayed off: re-count it under the
 * precise reason. The source address differs when SNAT rewrote it; else the
 * note was lost (evicted, or late).
 */
static __always_inline void missed_local_peer(const struct mw_conn_id *id, const struct mw_endpoint *remote)
{
	struct mw_unhinted_note *n = find_unhinted(id);
	struct mw_counters *c;
	__u32 reason;

	if (!n)
		return;
	reason = addrs_eq(n->addr, remote->addr) ? MW_REASON_HINT_MISSED : MW_REASON_ADDR_MISMATCH;
	n->id.active_isn1 = 0;
	n->id.passive_isn1 = 0;
	c = counters();
	if (!c)
		return;
	/* Per-CPU values may wrap below zero here; their sum stays exact. */
	c->passthrough_conns[MW_REASON_NO_LOCAL_PEER]--;
	c->sockets_removed[MW_REASON_NO_LOCAL_PEER]--;
	c->passthrough_conns[reason]++;
	c->sockets_removed[reason]++;
}

/* The connection will not be paired: the active socket leaves mw_sock_map. */
static __always_inline void passive_gives_up(__u32 slot, struct mw_conn *c, __u32 reason)
{
	conn_passthrough(c, reason);
	if (c->state == MW_CONN_PASSTHROUGH)
		remove_active(slot, c);
}

/*
 * Step 2 for the connection in slot c (found by its identity; the slot is
 * reserved for this socket): whether this socket joined and the connection
 * is PAIRED.
 */
static __always_inline bool passive_joins(struct bpf_sock_ops *skops, struct bpf_sock *sk, struct tcp_sock *tcp,
					  const struct mw_tuple *tp, struct mw_conn_id *idp, struct mw_conn *c,
					  __u32 slot, __u32 cb_flags, __u64 now)
{
	struct mw_conn_id id = *idp;
	struct mw_sk_state *st;
	struct mw_counters *cnt;
	__u32 hop, reason, index, *learned;
	long err;

	if (c->state != MW_CONN_PENDING) {
		/* Decided before we got here (first byte sent or received): release the active side. */
		if (c->state == MW_CONN_PASSTHROUGH)
			remove_active(slot, c);
		return false;
	}
	/* Born late (the handshake's last ACK lost, a listener's full queue). */
	if (pending_expired_at(c, now >> 10)) {
		passive_gives_up(slot, c, MW_REASON_UNPAIRED_TIMEOUT);
		return false;
	}

	reason = socket_unfit(tcp);
	if (reason) {
		passive_gives_up(slot, c, reason);
		return false;
	}
	if (policy_excludes(&tp->local)) {
		passive_gives_up(slot, c, MW_REASON_POLICY);
		return false;
	}
	learned = bpf_map_lookup_elem(&mw_unfit_lport, &tp->local.port_host);
	if (learned) {
		passive_gives_up(slot, c, *learned);
		return false;
	}
	reason = prog_unfit(sk);
	if (reason) {
		passive_gives_up(slot, c, reason);
		return false;
	}
	/*
	 * REDIRECT/DNAT rewrite the destination; the source address stays and
	 * must match. The source port may not: conntrack remaps it when the
	 * rewritten tuple collides with another entry.
	 */
	if (!addr_eq(&c->active_local, &tp->remote)) {
		passive_gives_up(slot, c, MW_REASON_ADDR_MISMATCH);
		return false;
	}
	st = pair_state(sk, true);
	if (!st) {
		passive_gives_up(slot, c, MW_REASON_SOCKHASH_FULL);
		return false;
	}
	st->role = MW_ROLE_PASSIVE;

	/* Join the map before announcing PAIRED: the active side redirects to us then. */
	index = sock_index(slot, MW_ROLE_PASSIVE);
	err = bpf_sock_map_update(skops, &mw_sock_map, &index, BPF_NOEXIST);
	if (err) {
		reason = join_error_reason(err);
		count_join_error(reason);
		st->decision = MW_CONN_PASSTHROUGH;
		st->reason = reason;
		passive_gives_up(slot, c, reason);
		return false;
	}

	hop = classify_hop(tp->local.port_host, c);
	c->hop = hop;
	c->passive_sk = (__u64)(unsigned long)sk;
	c->same_netns = bpf_get_netns_cookie(skops) == c->active_netns;
	obs_joins(st, c, 1);
	/* The leave poll's timer (leave.h), ready before a switch can start it. */
	leave_clock_ready();
	if (__sync_val_compare_and_swap(&c->state, MW_CONN_PENDING, MW_CONN_PAIRED) != MW_CONN_PENDING) {
		/*
		 * The active side sent its first byte by TCP (or timed out) since
		 * we looked: nobody redirected to either socket, both leave.
		 */
		st->decision = MW_CONN_PASSTHROUGH;
		st->reason = c->reason;
		remove_socket(slot, MW_ROLE_PASSIVE, c->reason);
		remove_active(slot, c);
		return false;
	}
	st->conn = id;
	st->peer_role = MW_ROLE_ACTIVE;
	st->conn_slot = slot;
	st->holds = MW_HOLD_PASSIVE;
	st->peer_sk = c->active_sk;
	st->hop = hop;
	/* The decision (and this side's direction) is claimed on the first message. */
	st->paired = 1;
	want_callbacks(skops, cb_flags);

	cnt = counters();
	if (cnt) {
		cnt->sockets_paired += 2;
		if (hop < MW_HOP_MAX)
			cnt->hop_conns[hop]++;
		if (c->active_local.port_host != tp->remote.port_host)
			cnt->nat_port_remaps++;
	}
	return true;
}

static __always_inline void on_passive_established(struct bpf_sock_ops *skops, struct bpf_sock *sk,
						   struct tcp_sock *tcp, __u32 snd_nxt, __u32 rcv_nxt, __u32 cb_flags,
						   __u64 now)
{
	struct mw_tuple t = {};
	struct mw_conn_id id = { .active_isn1 = rcv_nxt, .passive_isn1 = snd_nxt };
	struct mw_conn *c;
	__u32 slot;

	sockops_tuple(skops, &t);
	c = conn_find(&id, &slot);
	if (!c) {
		/* The connecting socket is not ours (remote host, other cgroup, excluded) or found no note. */
		missed_local_peer(&id, &t.remote);
		return;
	}
	/* Its own hold first, so the slot never goes free in between; then the reservation goes. */
	if (passive_joins(skops, sk, tcp, &t, &id, c, slot, cb_flags, now))
		__sync_fetch_and_or(&c->holders, MW_HOLD_PASSIVE);
	conn_drop(c, MW_HOLD_RESERVED);
}

#endif /* MESHWARP_PAIRING_H */
