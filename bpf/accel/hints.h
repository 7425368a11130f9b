/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * Pairing, step 0 (see pairing.h): notes of who has a local peer.
 * TCP_CONNECT_CB (sock_ops) notes a connecting socket's SYN by its source
 * address and sequence number (mw_syn_notes); mw_ingress (cgroup_skb
 * ingress on the agent's cgroup, pinned mw_syn_link: syn_note) marks the
 * note when a listener of the cgroup receives that SYN; STATE_CB of a failed connect
 * withdraws it. Only a socket whose own SYN a listener of the cgroup
 * received joins mw_sock_map: connections to remote hosts or to servers
 * outside the cgroup never pay for the socket map, and a client outside the
 * cgroup cannot lend its SYN to one of ours (NAT rewrites ports, never the
 * sequence number).
 */
#ifndef MESHWARP_HINTS_H
#define MESHWARP_HINTS_H

#define MW_TCP_SYN 0x02
#define MW_TCP_ACK 0x10

/* Their time-outs in mw_now_us units (1.024 us; the u32 clock wraps after 73 minutes). */
#define MW_SYN_HINT_TTL_US ((__u32)(MW_SYN_HINT_TTL_NS >> 10))
#define MW_CONNECT_TTL_US ((__u32)(MW_CONNECT_TTL_NS >> 10))

/*
 * The first of the two adjacent slots of mw_syn_notes (one cache line) a
 * SYN's note may take. The ISN is a keyed hash already (RFC 6528); the
 * source address tells pods apart.
 */
static __always_inline __u32 syn_slot(const __u32 addr[4], __u32 isn1)
{
	return ((isn1 ^ addr[3] ^ addr[1]) * 2654435761u >> 16) & (MW_SYN_NOTES - 2);
}

static __always_inline bool note_is(const struct mw_syn_note *n, const __u32 addr[4], __u32 isn1)
{
	return n->isn1 == isn1 && addrs_eq(n->addr, addr);
}

/*
 * The note of the SYN from addr with sequence number isn1 - 1, or NULL. An
 * isn1 of 0 marks a free slot, so the one SYN in 2^32 whose number is
 * 0xffffffff has no note (its connection stays on TCP, as one whose note
 * was overwritten).
 */
static __always_inline struct mw_syn_note *find_note(const __u32 addr[4], __u32 isn1)
{
	__u32 slot = syn_slot(addr, isn1), next = slot + 1;
	struct mw_syn_note *n;

	if (!isn1)
		return NULL;
	n = bpf_map_lookup_elem(&mw_syn_notes, &slot);
	if (n && note_is(n, addr, isn1))
		return n;
	n = bpf_map_lookup_elem(&mw_syn_notes, &next);
	return n && note_is(n, addr, isn1) ? n : NULL;
}

/*
 * Step 0: a socket of the cgroup connects; its SYN is about to leave. The
 * note takes a free slot of its pair, or one whose connect is past
 * MW_CONNECT_TTL_NS, else the older note's: a note overwritten before its
 * SYN-ACK costs its connection the redirect (hint_missed, once the accepted
 * side finds the connection), never a wrong pairing (step 2 proves it). Its sequence number is written last, so a
 * reader on another CPU matches no note half written (a torn match could
 * only make a socket join and wait: PENDING, then TCP).
 */
static __always_inline void on_connect(struct bpf_sock_ops *skops, struct tcp_sock *tp, __u32 cb_flags, __u64 now)
{
	struct mw_syn_note *n, *other;
	struct mw_tuple t = {};
	__u32 isn1, slot, next, now_us = now >> 10;

	if (!tp)
		return;
	sockops_tuple(skops, &t);
	/* tcp_connect runs this callback before it sends the SYN: write_seq is the ISN. */
	isn1 = tp->write_seq + 1;
	if (!isn1)
		return;
	slot = syn_slot(t.local.addr, isn1);
	next = slot + 1;
	n = bpf_map_lookup_elem(&mw_syn_notes, &slot);
	other = bpf_map_lookup_elem(&mw_syn_notes, &next);
	if (!n || !other)
		return;
	if (note_takes_second(n->isn1, n->connect_us, other->isn1, other->connect_us, now_us, MW_CONNECT_TTL_US))
		n = other;
	n->isn1 = 0;
	__builtin_memcpy(n->addr, t.local.addr, sizeof(n->addr));
	n->connect_us = now_us;
	n->received = 0;
	asm volatile("" ::: "memory");
	n->isn1 = isn1;
	/* STATE_CB tells us when the connect fails (SYN_SENT -> CLOSE). */
	want_state_cb(skops, cb_flags);
}

/*
 * Step 0: a SYN reaches a listener of the cgroup (mw_ingress, accel.bpf.c:
 * its socket filter runs before the listener answers). Every other segment
 * leaves after a look at the TCP flags.
 */
static __always_inline void syn_note(struct __sk_buff *skb)
{
	void *data = (void *)(long)skb->data, *data_end = (void *)(long)skb->data_end;
	struct mw_syn_note *n;
	__u32 addr[4], off, now_us;
	__u8 *tcp = skb_tcp_header(skb, &off);
	bool v6;

	if (!tcp || (tcp[13] & (MW_TCP_SYN | MW_TCP_ACK)) != MW_TCP_SYN || data + 40 > data_end)
		return;
	/* The hook runs for every protocol: TCP only (IPv4 protocol, IPv6 next header). */
	v6 = *(__u8 *)data >> 4 == 6;
	if (*(__u8 *)(data + (v6 ? 6 : 9)) != IPPROTO_TCP)
		return;
	if (v6)
		__builtin_memcpy(addr, data + 8, sizeof(addr));
	else
		set_v4_mapped(addr, *(__u32 *)(data + 12));
	n = find_note(addr, bpf_ntohl(*(__u32 *)(tcp + 4)) + 1);
	if (!n)
		return;
	now_us = bpf_ktime_get_ns() >> 10;
	if (now_us - n->connect_us < MW_CONNECT_TTL_US) {
		n->received_us = now_us;
		n->received = 1;
	}
}

/*
 * Whether a listener of the cgroup received this socket's SYN (source
 * address local, sequence number isn1 - 1). The note is consumed either way.
 */
static __always_inline bool take_syn_hint(const struct mw_endpoint *local, __u32 isn1, __u64 now)
{
	struct mw_syn_note *n = find_note(local->addr, isn1);
	bool received;

	if (!n)
		return false;
	received = n->received && (__u32)(now >> 10) - n->received_us < MW_SYN_HINT_TTL_US;
	n->isn1 = 0;
	return received;
}

/* A connect failed (SYN_SENT -> CLOSE; snd_una is still the ISN): its note goes. */
static __always_inline void on_connect_failed(struct bpf_sock_ops *skops, __u32 snd_una)
{
	struct mw_syn_note *n;
	struct mw_tuple t = {};

	sockops_tuple(skops, &t);
	n = find_note(t.local.addr, snd_una + 1);
	if (n)
		n->isn1 = 0;
}

#endif /* MESHWARP_HINTS_H */
