/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * Pairing, step 0 (see pairing.h): notes of who has a local peer.
 * TCP_CONNECT_CB (sock_ops) notes a connecting socket's SYN by its source
 * address and sequence number (mw_connecting); mw_ingress (cgroup_skb
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

/* Step 0: a socket of the cgroup connects; its SYN (sequence number isn) is about to leave. */
static __always_inline void on_connect(struct bpf_sock_ops *skops, struct bpf_sock *sk, __u32 cb_flags)
{
	struct tcp_sock *tp = bpf_skc_to_tcp_sock(sk);
	struct mw_connect conn = { .connect_ns = bpf_ktime_get_ns() };
	struct mw_syn_id id = {};
	struct mw_tuple t = {};

	if (!tp)
		return;
	sockops_tuple(skops, &t);
	__builtin_memcpy(id.addr, t.local.addr, sizeof(id.addr));
	/* tcp_connect runs this callback before it sends the SYN: write_seq is the ISN. */
	id.isn1 = tp->write_seq + 1;
	if (bpf_map_update_elem(&mw_connecting, &id, &conn, BPF_ANY))
		return;
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
	struct mw_syn_id id = {};
	struct mw_connect *c;
	__u32 off;
	__u8 *tcp = skb_tcp_header(skb, &off);
	bool v6;

	if (!tcp || (tcp[13] & (MW_TCP_SYN | MW_TCP_ACK)) != MW_TCP_SYN || data + 40 > data_end)
		return;
	/* The hook runs for every protocol: TCP only (IPv4 protocol, IPv6 next header). */
	v6 = *(__u8 *)data >> 4 == 6;
	if (*(__u8 *)(data + (v6 ? 6 : 9)) != IPPROTO_TCP)
		return;
	if (v6)
		__builtin_memcpy(id.addr, data + 8, sizeof(id.addr));
	else
		set_v4_mapped(id.addr, *(__u32 *)(data + 12));
	id.isn1 = bpf_ntohl(*(__u32 *)(tcp + 4)) + 1;
	c = bpf_map_lookup_elem(&mw_connecting, &id);
	if (c && bpf_ktime_get_ns() - c->connect_ns < MW_CONNECT_TTL_NS)
		c->received_ns = bpf_ktime_get_ns();
}

/*
 * Whether a listener of the cgroup received this socket's SYN (source
 * address local, sequence number isn1 - 1). The note is consumed either way.
 */
static __always_inline bool take_syn_hint(const struct mw_endpoint *local, __u32 isn1)
{
	struct mw_syn_id id = { .isn1 = isn1 };
	struct mw_connect *c;
	bool received;

	__builtin_memcpy(id.addr, local->addr, sizeof(id.addr));
	c = bpf_map_lookup_elem(&mw_connecting, &id);
	if (!c)
		return false;
	received = c->received_ns && bpf_ktime_get_ns() - c->received_ns < MW_SYN_HINT_TTL_NS;
	bpf_map_delete_elem(&mw_connecting, &id);
	return received;
}

/* A connect failed (SYN_SENT -> CLOSE; snd_una is still the ISN): its note goes. */
static __always_inline void on_connect_failed(struct bpf_sock_ops *skops, __u32 snd_una)
{
	struct mw_syn_id id = { .isn1 = snd_una + 1 };
	struct mw_tuple t = {};

	sockops_tuple(skops, &t);
	__builtin_memcpy(id.addr, t.local.addr, sizeof(id.addr));
	bpf_map_delete_elem(&mw_connecting, &id);
}

#endif /* MESHWARP_HINTS_H */
