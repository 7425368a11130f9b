/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * Pairing, step 0 (sock_ops on the agent's cgroup; see pairing.h): notes of
 * who may have a local peer. TCP_CONNECT_CB notes a connecting socket's
 * source endpoint (mw_connecting, mw_src_addr); RWND_INIT on a listener's
 * request socket marks the SYN it answers; STATE_CB of a failed connect
 * withdraws the note. Only a socket whose SYN a listener of the cgroup
 * answered joins mw_sock_hash, so connections to remote hosts never pay
 * for the SOCKHASH.
 */
#ifndef MESHWARP_HINTS_H
#define MESHWARP_HINTS_H

static __always_inline void addr_of(struct mw_addr *a, const struct mw_endpoint *e)
{
	__builtin_memcpy(a->addr, e->addr, sizeof(a->addr));
}

/* One fewer connect from this address waits for its SYN to be answered. */
static __always_inline void src_addr_settled(struct mw_src_addr *h)
{
	for (int i = 0; i < 4; i++) {
		__u32 n = h->in_flight;

		if (!n || __sync_val_compare_and_swap(&h->in_flight, n, n - 1) == n)
			return;
	}
}

/* Step 0: a socket of the cgroup connects; its SYN is about to leave. */
static __always_inline void on_connect(struct bpf_sock_ops *skops, __u32 cb_flags)
{
	struct mw_tuple t = {};
	struct mw_connect conn = {};
	struct mw_src_addr fresh = {}, *h;
	struct mw_addr addr = {};
	__u64 now = bpf_ktime_get_ns();

	sockops_tuple(skops, &t);
	conn.connect_ns = now;
	if (bpf_map_update_elem(&mw_connecting, &t.local, &conn, BPF_ANY))
		return;
	/* STATE_CB tells us when the connect fails (SYN_SENT -> CLOSE). */
	want_state_cb(skops, cb_flags);
	addr_of(&addr, &t.local);
	h = bpf_map_lookup_elem(&mw_src_addr, &addr);
	if (!h) {
		bpf_map_update_elem(&mw_src_addr, &addr, &fresh, BPF_NOEXIST);
		h = bpf_map_lookup_elem(&mw_src_addr, &addr);
		if (!h)
			return;
	}
	/* A count left by connects that vanished unseen (LRU eviction) expires. */
	if (now - h->connect_ns > MW_CONNECT_TTL_NS)
		h->in_flight = 0;
	h->connect_ns = now;
	__sync_fetch_and_add(&h->in_flight, 1);
}

/* Step 0: a listener of the cgroup answers a SYN (skops->sk is NULL here). */
static __always_inline void on_syn(struct bpf_sock_ops *skops)
{
	struct mw_tuple t = {};
	struct mw_connect *c;
	struct mw_src_addr *h;
	struct mw_addr addr = {};
	__u64 now = bpf_ktime_get_ns();

	sockops_tuple(skops, &t);
	addr_of(&addr, &t.remote);
	h = bpf_map_lookup_elem(&mw_src_addr, &addr);
	c = bpf_map_lookup_elem(&mw_connecting, &t.remote);
	if (c && now - c->connect_ns < MW_CONNECT_TTL_NS) {
		if (!c->answered_ns && h)
			src_addr_settled(h);
		c->answered_ns = now;
		return;
	}
	/*
	 * No socket of the cgroup connects from this endpoint. If one connects
	 * from this address and still waits for its answer, NAT gave its SYN
	 * another source port: it claims this SYN at ESTABLISHED. Otherwise the
	 * client is not ours (outside the cgroup): nothing to note.
	 */
	if (!h || !h->in_flight || now - h->connect_ns > MW_CONNECT_TTL_NS)
		return;
	src_addr_settled(h);
	if (now - h->remapped_ns > MW_SYN_HINT_TTL_NS)
		h->remapped = 0;
	h->remapped_ns = now;
	__sync_fetch_and_add(&h->remapped, 1);
}

/* Claim one remapped SYN of this address, if a fresh one is left. */
static __always_inline bool claim_remapped(struct mw_src_addr *h, __u64 now)
{
	if (now - h->remapped_ns >= MW_SYN_HINT_TTL_NS)
		return false;
	for (int i = 0; i < 4; i++) {
		__u32 n = h->remapped;

		if (!n)
			return false;
		if (__sync_val_compare_and_swap(&h->remapped, n, n - 1) == n)
			return true;
	}
	return false;
}

/*
 * Whether a listener of the cgroup answered this socket's SYN: under its own
 * source endpoint, or under a remapped port (claimed by address). The
 * connect's notes are consumed either way.
 */
static __always_inline bool take_syn_hint(const struct mw_endpoint *local)
{
	struct mw_connect *c = bpf_map_lookup_elem(&mw_connecting, local);
	struct mw_addr addr = {};
	struct mw_src_addr *h;
	__u64 now = bpf_ktime_get_ns();
	bool answered = false;

	if (c) {
		answered = c->answered_ns && now - c->answered_ns < MW_SYN_HINT_TTL_NS;
		bpf_map_delete_elem(&mw_connecting, local);
	}
	if (answered)
		return true;
	addr_of(&addr, local);
	h = bpf_map_lookup_elem(&mw_src_addr, &addr);
	if (!h)
		return false;
	if (claim_remapped(h, now))
		return true;
	/* Not answered here: its peer is remote, or the answer went unnoticed. */
	src_addr_settled(h);
	return false;
}

/* A connect failed (SYN_SENT -> CLOSE): it no longer waits for an answer. */
static __always_inline void on_connect_failed(struct bpf_sock_ops *skops)
{
	struct mw_tuple t = {};
	struct mw_connect *c;
	struct mw_src_addr *h;
	struct mw_addr addr = {};

	sockops_tuple(skops, &t);
	c = bpf_map_lookup_elem(&mw_connecting, &t.local);
	if (!c)
		return;
	if (!c->answered_ns) {
		addr_of(&addr, &t.local);
		h = bpf_map_lookup_elem(&mw_src_addr, &addr);
		if (h)
			src_addr_settled(h);
	}
	bpf_map_delete_elem(&mw_connecting, &t.local);
}

#endif /* MESHWARP_HINTS_H */
