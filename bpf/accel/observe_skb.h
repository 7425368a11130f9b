/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * Observation of what sock_ops and sk_msg do not see (observe.h has the
 * rest): the second part of the cgroup_skb programs on the agent's cgroup
 * (mw_egress_obs, mw_ingress_obs in accel.bpf.c, attached in place of
 * mw_egress and mw_ingress with `run --observe`) looks at every other
 * connection's segments, and tp_btf/sock_recv_length (mw_obs_recv) at a
 * client application's first read of its response (attached by `meshwarp
 * trace` while it samples). They never change a packet's fate.
 */
#ifndef MESHWARP_OBSERVE_SKB_H
#define MESHWARP_OBSERVE_SKB_H

/* A full socket's endpoints (cgroup_skb). */
static __always_inline void bpf_sock_tuple(struct bpf_sock *sk, struct mw_tuple *t)
{
	CTX_ADDRS(sk, family, src_ip4, dst_ip4, src_ip6, dst_ip6);
	__u32 lport = CTX_READ(sk->src_port);
	__u16 rport = *(volatile __u16 *)&sk->dst_port;

	fill_tuple(t, family, lip4, rip4, l6_, r6_, lport, bpf_ntohs(rport));
}

/*
 * A socket established before the observation started (an agent installed
 * under load) carries an HTTP request: classify it now, by the request's
 * direction (the side that sends requests is the client). Its TCP end is not
 * recorded (no STATE_CB), its HTTP exchanges are.
 */
static __always_inline struct mw_obs_sock *obs_late(struct __sk_buff *skb, struct bpf_sock *sk, bool egress, __u64 now)
{
	struct mw_obs_sock *o = obs_state(sk, true);
	struct mw_tuple t = {};

	if (!o)
		return NULL;
	bpf_sock_tuple(sk, &t);
	o->server = egress ? t.remote : t.local;
	o->netns = netns_inode(sk);
	o->point = obs_point(bpf_get_socket_uid(skb), &t, egress);
	o->start_ns = now;
	o->flushed_ns = now;
	o->started = 1;
	return o;
}

/* Serial-number order of TCP sequence numbers. */
static __always_inline bool seq_after(__u32 a, __u32 b)
{
	return (__s32)(a - b) > 0;
}

/*
 * cgroup_skb: a segment of a connection that is not redirected (at egress
 * before it leaves the socket, at ingress before TCP takes it). skb->data is
 * the network header in both directions.
 */
static __always_inline void obs_skb(struct __sk_buff *skb, bool egress)
{
	__u32 kind = MW_HTTP_NONE, method = MW_METHOD_OTHER, status = 0;
	struct mw_flow_key k = {};
	struct mw_obs_sock *o = NULL;
	struct mw_sock *rec;
	struct bpf_sock *sk;
	__u8 buf[MW_OBS_PEEK] = {};
	__u32 off, len, seq, end, next, start_bit;
	bool stream_start = false;
	void *tcp;
	__u8 doff;
	__u64 now;

	/* No TCP segment of 40 bytes or fewer (IPv4 and TCP headers without options) carries payload. */
	if (skb->len <= 40)
		return;
	/*
	 * Pure ACKs out next, before the socket's record is looked up. The
	 * headers are in the linear part (direct reads); the payload may be in
	 * page fragments (bpf_skb_load_bytes).
	 */
	tcp = skb_tcp_header(skb, &off);
	if (!tcp)
		return;
	seq = *(__u32 *)(tcp + 4);
	doff = *(__u8 *)(tcp + 12);
	off += (doff >> 4) * 4;
	if (skb->len <= off)
		return;
	len = skb->len - off;
	sk = skb->sk;
	if (!sk)
		return;
	sk = bpf_sk_fullsock(sk);
	/*
	 * A listener's: the segment that completes a handshake (with its
	 * data: TCP_DEFER_ACCEPT, a lost final ACK) passes the listener's
	 * filter before the accepted socket exists. It is not the listener's.
	 */
	if (!sk || sk->protocol != IPPROTO_TCP || sk->state == BPF_TCP_LISTEN)
		return;
	rec = sock_rec(sk, false);
	if (rec) {
		barrier_var(rec); /* the offset behind the NULL check (see obs_state) */
		o = &rec->obs;
	}
	if (o && !o->started)
		o = NULL; /* a record without observation (created with the socket) */
	if (o && !o->start_ns)
		return; /* its end was recorded */
	if (!o) {
		/* Unknown socket: only a request makes it known. */
		if (len < MW_OBS_PEEK || bpf_skb_load_bytes(skb, off, buf, MW_OBS_PEEK) ||
		    http_start(buf, &method, &status) != MW_HTTP_REQUEST)
			return;
		o = obs_late(skb, sk, egress, bpf_ktime_get_ns());
		if (!o)
			return;
		kind = MW_HTTP_REQUEST;
	}
	seq = bpf_ntohl(seq);
	end = seq + len;
	next = egress ? o->snd_next : o->rcv_next;
	/* Seen already (a retransmission): neither its bytes nor its start count twice. */
	if (o->seq_set & (egress ? MW_SEQ_SND : MW_SEQ_RCV)) {
		if (!seq_after(end, next))
			return;
	}
	/*
	 * The first payload segment this way since establishment, at the
	 * stream's first byte, of a socket that never joined mw_sock_map (a
	 * redirected byte does not move TCP's sequence numbers, so after a
	 * switch to TCP the first segment is not the stream's start).
	 */
	start_bit = egress ? MW_SEQ_SND_START : MW_SEQ_RCV_START;
	if (o->seq_set & start_bit) {
		stream_start = seq == next && rec && !rec->pair.role;
		o->seq_set &= ~start_bit;
	}
	o->seq_set |= egress ? MW_SEQ_SND : MW_SEQ_RCV;
	if (egress)
		o->snd_next = end;
	else
		o->rcv_next = end;
	if (kind == MW_HTTP_NONE && len >= MW_OBS_PEEK && !(o->seq_set & MW_OBS_NOT_HTTP) &&
	    bpf_skb_load_bytes(skb, off, buf, MW_OBS_PEEK) == 0) {
		kind = http_start(buf, &method, &status);
		if (stream_start && kind == MW_HTTP_NONE && http_ruled_out(buf))
			o->seq_set |= MW_OBS_NOT_HTTP;
	}
	/* The precise clock only for an exchange's duration (as in obs_msg). */
	now = kind == MW_HTTP_NONE ? coarse_ns() : bpf_ktime_get_ns();
	if (kind == MW_HTTP_REQUEST) {
		if (egress)
			obs_app_request(o, method, now);
		o->req_ns = now;
		o->req_method = method;
		o->req_egress = egress;
	} else if (kind == MW_HTTP_RESPONSE && o->req_ns && o->req_egress != egress) {
		obs_flow_key(&k, o, MW_PROTO_HTTP);
		k.status = status;
		k.method = o->req_method;
		obs_exchange(&k, now - o->req_ns);
		o->req_ns = 0;
	}
	o->bytes += len;
	if (flush_due(o, now))
		obs_flush(o, now);
}

#define MW_MSG_PEEK 2

/*
 * A socket read returned data (tracepoint sock:sock_recv_length, in the
 * reader's context): for a client application with a request out, the
 * response reached the application. Its time from the socket (MW_POINT_CLIENT)
 * to here is the wakeup and the read: what the client sees beyond its socket.
 */
SEC("tp_btf/sock_recv_length")
int mw_obs_recv(__u64 *ctx)
{
	struct sock *sk = (struct sock *)ctx[0];
	int ret = (int)ctx[1], flags = (int)ctx[2];
	struct mw_flow_key k = {};
	struct mw_obs_sock *o;
	__u64 now;

	if (!observe || ret <= 0 || (flags & MW_MSG_PEEK) || !sk)
		return 0;
	o = obs_state(sk, false);
	if (!o || !o->app_req_ns)
		return 0;
	now = bpf_ktime_get_ns();
	obs_flow_key(&k, o, MW_PROTO_HTTP);
	k.point = MW_POINT_CLIENT_APP;
	k.method = o->req_method;
	k.accelerated = o->accelerated;
	obs_add(&k, now - o->app_req_ns, 0, true);
	o->app_req_ns = 0;
	return 0;
}

#endif /* MESHWARP_OBSERVE_SKB_H */
