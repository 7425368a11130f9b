/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * The tap (sk_msg, mw_skmsg_tap in accel.bpf.c): `meshwarp tap` loads it
 * from this object against the agent's pinned maps, with the constants the
 * agent's program was loaded with, and swaps it into the agent's sk_msg link
 * while it runs; then the agent's program goes back. It redirects exactly as
 * mw_skmsg does and also copies each redirected message (up to tap_snaplen
 * bytes) to mw_tap_ring. The agent loads neither the program nor its maps,
 * so its own program never pays for it. Its settings are constants of the
 * tap's own load.
 */
#ifndef MESHWARP_TAP_H
#define MESHWARP_TAP_H

/*
 * The tap's own settings, in a section of their own: the agent's .rodata
 * (the data path's settings, which the tap copies from the agent's loaded
 * program) stays the same in both programs, and the agent, which never loads
 * the tap, creates no map for them.
 */
const volatile __u32 tap_snaplen SEC(".rodata.tap");
const volatile __u32 tap_port SEC(".rodata.tap");  /* 0: every port; else one end's port */
const volatile __u64 tap_netns SEC(".rodata.tap"); /* 0: every namespace; else the sender's netns cookie */

#define MW_TAP_MAX 65536

struct {
	__uint(type, BPF_MAP_TYPE_RINGBUF);
	__uint(max_entries, 16 << 20);
} mw_tap_ring SEC(".maps");

struct mw_tap_buf {
	struct mw_tap_rec rec;
	__u8 data[MW_TAP_MAX];
};

/* One buffer per CPU (a per-CPU map value may not exceed 32 KiB); the loader sizes it. */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct mw_tap_buf);
} mw_tap_scratch SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct mw_tap_stats);
} mw_tap_counters SEC(".maps");

static __always_inline void msg_endpoints(struct sk_msg_md *msg, struct mw_endpoint *local, struct mw_endpoint *remote)
{
	CTX_ADDRS(msg, family, local_ip4, remote_ip4, local_ip6, remote_ip6);
	__u32 lport = CTX_READ(msg->local_port);
	__u32 rport = bpf_ntohl(CTX_READ(msg->remote_port)) & 0xffff;
	struct mw_tuple t = {};

	fill_tuple(&t, family, lip4, rip4, l6_, r6_, lport, rport);
	*local = t.local;
	*remote = t.remote;
}

static __always_inline void tap_record(struct sk_msg_md *msg, struct mw_sk_state *st, __u32 size)
{
	__u32 zero = 0, cpu = bpf_get_smp_processor_id(), caplen = size;
	struct mw_tap_stats *ts = bpf_map_lookup_elem(&mw_tap_counters, &zero);
	struct mw_tap_buf *b = bpf_map_lookup_elem(&mw_tap_scratch, &cpu);
	struct mw_endpoint local = {}, remote = {};
	struct mw_conn_id id = st->conn;
	struct mw_conn *c;
	bool active = st->role == MW_ROLE_ACTIVE;

	if (!ts || !b)
		return;
	if (tap_netns && bpf_get_netns_cookie(msg) != tap_netns)
		return;
	/* One tuple per connection: the connecting side's view. */
	c = conn_of(st);
	if (c) {
		b->rec.src = active ? c->active_local : c->active_remote;
		b->rec.dst = active ? c->active_remote : c->active_local;
	} else {
		msg_endpoints(msg, &local, &remote);
		b->rec.src = local;
		b->rec.dst = remote;
	}
	if (tap_port && b->rec.src.port_host != tap_port && b->rec.dst.port_host != tap_port)
		return;
	if (caplen > tap_snaplen)
		caplen = tap_snaplen;
	if (caplen > MW_TAP_MAX)
		caplen = MW_TAP_MAX;
	if (caplen < size)
		ts->cut++;
	if (caplen && bpf_msg_pull_data(msg, 0, caplen, 0) == 0) {
		void *data = (void *)(long)msg->data;
		void *end = (void *)(long)msg->data_end;

		if (data + caplen > end)
			caplen = end - data;
		caplen &= MW_TAP_MAX - 1 | MW_TAP_MAX;
		if (caplen > MW_TAP_MAX)
			caplen = MW_TAP_MAX;
		if (bpf_probe_read_kernel(b->data, caplen, data))
			caplen = 0;
	} else {
		caplen = 0;
	}
	b->rec.ts_ns = bpf_ktime_get_ns();
	b->rec.offset = st->sent;
	b->rec.sender_isn1 = active ? id.active_isn1 : id.passive_isn1;
	b->rec.peer_isn1 = active ? id.passive_isn1 : id.active_isn1;
	b->rec.size = size;
	b->rec.caplen = caplen;
	b->rec.hop = st->hop;
	b->rec.from_active = active;
	if (bpf_ringbuf_output(&mw_tap_ring, b, sizeof(b->rec) + (caplen & (MW_TAP_MAX * 2 - 1)), 0))
		ts->ring_full++;
	else
		ts->records++;
}

#endif /* MESHWARP_TAP_H */
