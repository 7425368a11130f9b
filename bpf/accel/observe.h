/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * Observation (`meshwarp run --observe`): RED data for every connection of
 * the cgroup, accelerated or not, into mw_flows, and the exchanges of paired
 * connections into mw_pair_flows (Go renders the Prometheus series,
 * `meshwarp top` and `meshwarp trace` from them).
 *
 *   sock_ops     classifies each socket once (enum mw_point) when it
 *                connects or is established, and records how it ends
 *                (TCP flows: closed, reset, connect failed, with lifetime).
 *   sk_msg       paired connections: their bytes never become packets, so
 *                the redirect itself looks at each message's first bytes.
 *   cgroup_skb   every other connection: the first bytes of each segment
 *                (retransmissions skipped by sequence number); a socket older
 *                than the observation is classified at its first request.
 *   tp_btf       sock:sock_recv_length: a client application's first read of
 *                its response (attached by `meshwarp trace` while it samples).
 * HTTP/1.x only by its first line ("shallow parsing"): a request line starts
 * an exchange, the next final status line (>= 200) the other way ends it.
 * One exchange in flight per connection: a pipelined request replaces the
 * one before it. A connection whose first bytes rule HTTP/1.x out
 * (http_ruled_out) is counted from then on, not parsed. The programs never
 * change a packet's or message's fate.
 *
 * Included by accel.bpf.c (one object: the maps and constants are shared);
 * the cgroup_skb and tp_btf programs are in observe_skb.h.
 */
#ifndef MESHWARP_OBSERVE_H
#define MESHWARP_OBSERVE_H

/* Set by the loader (internal/accel Config: Observe, Accelerate, the bucket bounds). */
const volatile __u32 observe;
const volatile __u32 accelerate = 1;
const volatile __u64 obs_bounds_ns[MW_OBS_BUCKETS - 1];

/* Bytes are added to mw_flows at least this often per connection (and at its end). */
#define MW_OBS_FLUSH_NS (1000ULL * 1000 * 1000)
/* Bytes of a message or segment looked at: the longest line start we match. */
#define MW_OBS_PEEK 12

/*
 * mw_obs_sock.seq_set. SND and RCV: snd_next, rcv_next hold the end of
 * the highest segment seen that way. The _START bits: set at establishment
 * with snd_next, rcv_next at the stream's first byte; that way's next
 * payload segment (it clears its bit) may be the stream's start.
 * NOT_HTTP: the connection's first bytes ruled HTTP/1.x out
 * (http_ruled_out): its later messages and segments are counted, not
 * parsed.
 */
#define MW_SEQ_SND 1
#define MW_SEQ_RCV 2
#define MW_SEQ_SND_START 4
#define MW_SEQ_RCV_START 8
#define MW_OBS_NOT_HTTP 16

/* Per CPU, allocated per flow: sizeof(struct mw_flow) (216 B) per CPU and flow. */
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_HASH);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__uint(max_entries, 8192);
	__type(key, struct mw_flow_key);
	__type(value, struct mw_flow);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} mw_flows SEC(".maps");

/*
 * The exchanges of paired connections (obs_msg): one record and one update
 * per exchange for the two points that see it, where mw_flows would take
 * two. Its own map, so that the flows of every other path keep their
 * shorter key.
 */
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_HASH);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__uint(max_entries, 8192);
	__type(key, struct mw_pair_flow_key);
	__type(value, struct mw_flow);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} mw_pair_flows SEC(".maps");

/*
 * The same records in the first place, per CPU: a per-CPU array of slots,
 * a key in the slot its hash picks or the next one, taken for good (a
 * slot is never freed: the keys are few, an exchange's points, status and
 * method). An exchange's update is then an array lookup, which the
 * verifier inlines, not a hash map's call and two more cache lines; a key
 * that finds both slots taken by others goes to mw_pair_flows. Go adds
 * both (flows.go).
 */
#define MW_PAIR_SLOTS 256
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, MW_PAIR_SLOTS);
	__type(key, __u32);
	__type(value, struct mw_pair_flow_slot);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} mw_pair_flow_slots SEC(".maps");

/* The points of mw_pair_flows' records, by content (struct mw_pair_points_key) -> id. */
#define MW_PAIR_POINTS_MAX 8192
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__uint(max_entries, MW_PAIR_POINTS_MAX);
	__type(key, struct mw_pair_points_key);
	__type(value, __u32);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} mw_pair_points SEC(".maps");

/* The last id mw_pair_points gave: pinned with it, so that a restarted agent does not give one twice. */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, __u32);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} mw_pair_ids SEC(".maps");

#define MW_EEXIST 17

/* Add one observation (counted) or bytes to flow record f (this CPU's copy: plain adds, a program does not migrate while it runs). */
static __always_inline void obs_count(struct mw_flow *f, __u64 d_ns, __u64 bytes, bool counted)
{
	__u32 i;

	f->bytes += bytes;
	if (!counted)
		return;
	f->count++;
	f->sum_ns += d_ns;
	for (i = 0; i < MW_OBS_BUCKETS - 1; i++) {
		if (d_ns <= obs_bounds_ns[i])
			break;
	}
	if (i < MW_OBS_BUCKETS)
		f->buckets[i]++;
}

/*
 * Add one observation (counted) or bytes to k's flow in flows (mw_flows,
 * or mw_pair_flows with its key); a full map counts in flows_full.
 */
static __always_inline void obs_add_to(void *flows, const void *k, __u64 d_ns, __u64 bytes, bool counted)
{
	struct mw_flow zero = {}, *f;

	f = bpf_map_lookup_elem(flows, k);
	if (!f) {
		long err = bpf_map_update_elem(flows, k, &zero, BPF_NOEXIST);

		if (err && err != -MW_EEXIST) {
			struct mw_counters *c = counters();

			if (c)
				c->flows_full++;
			return;
		}
		f = bpf_map_lookup_elem(flows, k);
		if (!f)
			return;
	}
	obs_count(f, d_ns, bytes, counted);
}

static __always_inline bool pair_key_eq(const struct mw_pair_flow_key *a, const struct mw_pair_flow_key *b)
{
	return a->points == b->points && a->status == b->status && a->method == b->method;
}

/*
 * One exchange of a paired connection, of duration d_ns, in k's record:
 * this CPU's slot for k (mw_pair_flow_slots), else mw_pair_flows. A slot
 * is claimed and published by compare-and-swap (a full barrier), so that
 * another program on this CPU (one that preempted this one) never compares
 * a half-written key, and a reader that sees it held sees its key.
 */
static __always_inline void obs_pair_exchange(const struct mw_pair_flow_key *k, __u64 d_ns)
{
	__u32 h = (k->points * 0x9e3779b1u) ^ (k->status * 0x85ebca6bu) ^ (k->method * 0xc2b2ae35u);
	struct mw_pair_flow_slot *s;
	__u32 i, idx;

	h ^= h >> 16;
	for (i = 0; i < 2; i++) {
		idx = (h + i) & (MW_PAIR_SLOTS - 1);
		s = bpf_map_lookup_elem(&mw_pair_flow_slots, &idx);
		if (!s)
			break;
		if (s->state == MW_SLOT_HELD) {
			if (!pair_key_eq(&s->key, k))
				continue;
		} else if (s->state != MW_SLOT_FREE ||
			   __sync_val_compare_and_swap(&s->state, MW_SLOT_FREE, MW_SLOT_CLAIMING) != MW_SLOT_FREE) {
			continue;
		} else {
			s->key = *k;
			__sync_val_compare_and_swap(&s->state, MW_SLOT_CLAIMING, MW_SLOT_HELD);
		}
		obs_count(&s->flow, d_ns, 0, true);
		return;
	}
	obs_add_to(&mw_pair_flows, k, d_ns, 0, true);
}

static __always_inline void obs_add(const struct mw_flow_key *k, __u64 d_ns, __u64 bytes, bool counted)
{
	obs_add_to(&mw_flows, k, d_ns, bytes, counted);
}

/* Little-endian word of up to 8 characters (how the first bytes load). */
#define MW_W8(a, b, c, d, e, f, g, h)                                                              \
	((__u64)(a) | (__u64)(b) << 8 | (__u64)(c) << 16 | (__u64)(d) << 24 | (__u64)(e) << 32 |      \
	 (__u64)(f) << 40 | (__u64)(g) << 48 | (__u64)(h) << 56)
#define MW_MASK(n) ((n) == 8 ? ~0ULL : ((1ULL << ((n) * 8)) - 1))

enum { MW_HTTP_NONE = 0, MW_HTTP_REQUEST = 1, MW_HTTP_RESPONSE = 2 };

/*
 * A request line's method (with its space) or a final status line's code at
 * the start of b. Anything else is not the start of an HTTP/1.x message.
 */
static __always_inline __u32 http_start(const __u8 *b, __u32 *method, __u32 *status)
{
	__u64 w = 0;

	__builtin_memcpy(&w, b, 8);
#define MW_IS(s, n, a, b_, c, d, e, f, g, h) ((w & MW_MASK(n)) == (MW_W8(a, b_, c, d, e, f, g, h) & MW_MASK(n)))
	if (MW_IS("GET ", 4, 'G', 'E', 'T', ' ', 0, 0, 0, 0))
		*method = MW_METHOD_GET;
	else if (MW_IS("POST ", 5, 'P', 'O', 'S', 'T', ' ', 0, 0, 0))
		*method = MW_METHOD_POST;
	else if (MW_IS("PUT ", 4, 'P', 'U', 'T', ' ', 0, 0, 0, 0))
		*method = MW_METHOD_PUT;
	else if (MW_IS("HEAD ", 5, 'H', 'E', 'A', 'D', ' ', 0, 0, 0))
		*method = MW_METHOD_HEAD;
	else if (MW_IS("DELETE ", 7, 'D', 'E', 'L', 'E', 'T', 'E', ' ', 0))
		*method = MW_METHOD_DELETE;
	else if (MW_IS("PATCH ", 6, 'P', 'A', 'T', 'C', 'H', ' ', 0, 0))
		*method = MW_METHOD_PATCH;
	else if (MW_IS("OPTIONS ", 8, 'O', 'P', 'T', 'I', 'O', 'N', 'S', ' '))
		*method = MW_METHOD_OPTIONS;
	else if (MW_IS("CONNECT ", 8, 'C', 'O', 'N', 'N', 'E', 'C', 'T', ' '))
		*method = MW_METHOD_CONNECT;
	else if (MW_IS("TRACE ", 6, 'T', 'R', 'A', 'C', 'E', ' ', 0, 0))
		*method = MW_METHOD_TRACE;
	else if (MW_IS("HTTP/1.", 7, 'H', 'T', 'T', 'P', '/', '1', '.', 0) && b[8] == ' ') {
		__u8 d1 = b[9] - '0', d2 = b[10] - '0', d3 = b[11] - '0';

		if (d1 > 9 || d2 > 9 || d3 > 9 || d1 < 2)
			return MW_HTTP_NONE; /* 1xx is not the final answer */
		*status = d1 * 100 + d2 * 10 + d3;
		return MW_HTTP_RESPONSE;
	} else
		return MW_HTTP_NONE;
#undef MW_IS
	return MW_HTTP_REQUEST;
}

/*
 * Whether a stream's first bytes rule HTTP/1.x out: an HTTP/1.x message,
 * and a PROXY protocol header before one, starts with a token and a space
 * (a request line's method, "HTTP/1.1 ", "PROXY "), or with CR LF (empty
 * lines a server ignores before a request line, RFC 9112 2.2; PROXY v2's
 * signature). Anything else (a byte that is not printable ASCII before the
 * first space, or a space first) is another protocol (TLS, RESP, a binary
 * protocol), and such a connection never carries HTTP/1.x: parsing its
 * later messages could only miscount its payload as requests. Twelve
 * printable bytes without a space (a long method) do not rule it out.
 */
static __always_inline bool http_ruled_out(const __u8 *b)
{
	int i;

	if (b[0] == '\r' || b[0] == '\n')
		return false;
	for (i = 0; i < MW_OBS_PEEK; i++) {
		if (b[i] == ' ')
			return i == 0;
		if (b[i] < 0x21 || b[i] > 0x7e)
			return true;
	}
	return false;
}

static __always_inline bool loopback(const struct mw_endpoint *e)
{
	/* v4-mapped: addr[3] holds the IPv4 address in network order (127/8: first byte 127). */
	if (e->addr[0] == 0 && e->addr[1] == 0 && e->addr[2] == bpf_htonl(0xffff) && (e->addr[3] & 0xff) == 127)
		return true;
	return e->addr[0] == 0 && e->addr[1] == 0 && e->addr[2] == 0 && e->addr[3] == bpf_htonl(1);
}

/*
 * A connection within this network namespace: either end on loopback (the
 * sidecar's connections to its app come from 127.0.0.6 in Istio) or both
 * ends on one address.
 */
static __always_inline bool local_remote(const struct mw_tuple *t)
{
	return loopback(&t->local) || loopback(&t->remote) || addr_eq(&t->local, &t->remote);
}

/*
 * The point a socket observes from: connecting sockets by owner (the sidecar
 * uid's connections to its own pod are its inbound side), accepted ones by
 * the port they were captured to.
 */
static __always_inline __u32 obs_point(__u32 uid, const struct mw_tuple *t, bool active)
{
	if (active) {
		if (uid != sidecar_uid)
			return MW_POINT_CLIENT;
		return local_remote(t) ? MW_POINT_INBOUND_OUT : MW_POINT_OUTBOUND_OUT;
	}
	if (t->local.port_host == outbound_capture_port)
		return MW_POINT_OUTBOUND_IN;
	if (t->local.port_host == inbound_capture_port)
		return MW_POINT_INBOUND_IN;
	return MW_POINT_SERVER;
}

static __always_inline void obs_flow_key(struct mw_flow_key *k, const struct mw_obs_sock *o, __u32 proto)
{
	k->server = o->server;
	k->netns = o->netns;
	k->point = o->point;
	k->proto = proto;
}

/* Add o's unflushed bytes to its TCP flow. */
static __always_inline void obs_flush(struct mw_obs_sock *o, __u64 now)
{
	struct mw_flow_key k = {};
	__u64 b = o->bytes;

	o->flushed_ns = now;
	if (!b)
		return;
	o->bytes = 0;
	obs_flow_key(&k, o, MW_PROTO_TCP);
	k.outcome = MW_TCP_OPEN;
	k.accelerated = o->accelerated;
	obs_add(&k, 0, b, false);
}

/*
 * Whether o's bytes are due in mw_flows. now is the coarse clock or the
 * precise one, which runs up to a tick ahead: signed, so that a coarse now
 * just behind a precise flushed_ns is not a flush.
 */
static __always_inline bool flush_due(const struct mw_obs_sock *o, __u64 now)
{
	return (__s64)(now - o->flushed_ns) > (__s64)MW_OBS_FLUSH_NS;
}

/*
 * The socket's network namespace as /proc/PID/ns/net names it (its inode):
 * BTF loads through the socket, no probe-read calls (0 without tp).
 */
static __always_inline __u64 netns_of(struct tcp_sock *tp)
{
	return tp ? tp->inet_conn.icsk_inet.sk.__sk_common.skc_net.net->ns.inum : 0;
}

static __always_inline __u64 netns_inode(struct bpf_sock *sk)
{
	return netns_of(bpf_skc_to_tcp_sock(sk));
}

/*
 * Where the socket's streams start (snd_nxt, rcv_nxt at establishment: the
 * first byte each way), unless a segment was seen already (data in a SYN).
 * Only an establishment by a handshake (skb_len: its segment) of a plain TCP
 * connection starts them: a socket restored with TCP_REPAIR is established
 * without one, mid-stream, and an MPTCP subflow carries a part of its
 * connection's stream.
 */
static __always_inline void obs_stream_starts(struct tcp_sock *tp, struct mw_obs_sock *o, __u32 snd_nxt,
					      __u32 rcv_nxt, __u32 skb_len)
{
	if (!skb_len || !tp)
		return;
	if (bpf_core_field_exists(((struct tcp_sock *)0)->is_mptcp) && tp->is_mptcp)
		return;
	if (!(o->seq_set & MW_SEQ_SND)) {
		o->snd_next = snd_nxt;
		o->seq_set |= MW_SEQ_SND | MW_SEQ_SND_START;
	}
	if (!(o->seq_set & MW_SEQ_RCV)) {
		o->rcv_next = rcv_nxt;
		o->seq_set |= MW_SEQ_RCV | MW_SEQ_RCV_START;
	}
}

/*
 * sock_ops: a socket connects (active) or is established. Returns the
 * socket's callback flags with STATE_CB (its end is observed).
 */
static __always_inline __u32 obs_start(struct bpf_sock_ops *skops, struct bpf_sock *sk, struct tcp_sock *tp, bool active,
				       __u32 cb_flags, __u32 snd_nxt, __u32 rcv_nxt, __u32 skb_len, __u64 now)
{
	struct mw_obs_sock *o;
	struct mw_tuple t = {};

	if (!observe)
		return cb_flags;
	o = obs_state(sk, true);
	if (!o)
		return cb_flags;
	sockops_tuple(skops, &t);
	__builtin_memset(o, 0, sizeof(*o));
	o->server = active ? t.remote : t.local;
	o->netns = netns_of(tp);
	o->point = obs_point(socket_uid(tp), &t, active);
	o->start_ns = now;
	o->flushed_ns = now;
	o->started = 1;
	if (!active)
		obs_stream_starts(tp, o, snd_nxt, rcv_nxt, skb_len); /* the active side's at its establishment */
	if (!(cb_flags & BPF_SOCK_OPS_STATE_CB_FLAG)) {
		cb_flags |= BPF_SOCK_OPS_STATE_CB_FLAG;
		bpf_sock_ops_cb_flags_set(skops, cb_flags);
	}
	return cb_flags;
}

/* sock_ops: an established connection's socket is now established (not just connecting). */
static __always_inline void obs_established(struct bpf_sock *sk, struct tcp_sock *tp, __u32 snd_nxt, __u32 rcv_nxt,
					    __u32 skb_len, __u64 now)
{
	struct mw_obs_sock *o;

	if (!observe)
		return;
	o = obs_state(sk, false);
	if (!o)
		return;
	o->start_ns = o->flushed_ns = now;
	if (o->started)
		obs_stream_starts(tp, o, snd_nxt, rcv_nxt, skb_len);
}

/* sock_ops STATE_CB to CLOSE: how the connection ended, and its lifetime. */
static __always_inline void obs_end(struct mw_obs_sock *o, __u32 old_state)
{
	struct mw_flow_key k = {};
	__u64 now;

	if (!o->start_ns)
		return;
	now = bpf_ktime_get_ns();
	/*
	 * Its unflushed bytes go with its end: one flow update, not two
	 * (readers sum a server's bytes over every outcome).
	 */
	obs_flow_key(&k, o, MW_PROTO_TCP);
	k.accelerated = o->accelerated;
	if (old_state == BPF_TCP_SYN_SENT)
		k.outcome = MW_TCP_CONNECT_FAILED;
	else if (old_state == BPF_TCP_ESTABLISHED || old_state == BPF_TCP_CLOSE_WAIT || old_state == BPF_TCP_SYN_RECV)
		k.outcome = MW_TCP_RESET;
	else
		k.outcome = MW_TCP_CLOSED;
	obs_add(&k, now - o->start_ns, o->bytes, true);
	o->bytes = 0;
	o->flushed_ns = now;
	o->start_ns = 0; /* once: a socket reconnected after connect(AF_UNSPEC) starts again */
}

/* One HTTP exchange ended: record it at point k (status, method set by the caller). */
static __always_inline void obs_exchange(struct mw_flow_key *k, __u64 d_ns)
{
	k->proto = MW_PROTO_HTTP;
	obs_add(k, d_ns, 0, true);
}

/* A client application sent a request: its first read after this ends it (obs_recv). */
static __always_inline void obs_app_request(struct mw_obs_sock *o, __u32 method, __u64 now)
{
	if (o->point != MW_POINT_CLIENT)
		return;
	o->app_req_ns = now;
	o->req_method = method;
}

/*
 * Claim for side me's flow what the other side redirected since me was
 * last given it; 0 when another claimant got there first (cmpxchg: the
 * active side's close may claim for the passive side while it flushes).
 */
static __always_inline __u64 obs_claim_peer_bytes(struct mw_conn *c, __u32 me)
{
	__u64 peer = c->obs.sent[1 - me], seen = c->obs.seen[me];

	if (peer <= seen || __sync_val_compare_and_swap(&c->obs.seen[me], seen, peer) != seen)
		return 0;
	return peer - seen;
}

/*
 * The observation part of the record whose pairing part is st (its first:
 * no second lookup).
 */
static __always_inline struct mw_obs_sock *obs_of(struct mw_sk_state *st)
{
	return &((struct mw_sock *)st)->obs;
}

/*
 * sock_ops: a socket (its record's pairing part st) joins connection c:
 * its point, in the side of c->obs its role names (me: role - 1). The
 * active side's slot is not published yet, the passive side's before
 * PAIRED: each side is written by its own socket, before the other reads it.
 */
static __always_inline void obs_joins(struct mw_sk_state *st, struct mw_conn *c, __u32 me)
{
	struct mw_obs_sock *o = obs_of(st);
	struct mw_obs_side *side = &c->obs.side[me & 1];

	if (!observe || !o->started)
		return;
	side->netns = o->netns;
	side->server = o->server;
	side->point = o->point;
	c->obs.observed |= 1u << (me & 1);
}

/*
 * The id of connection c's two points (mw_pair_points), interned at its
 * first exchange; 0 when mw_pair_points is full (counted in flows_full).
 * Two sides interning the same new points at once draw two ids; the one
 * that loses the insert reads the winner's. Entries are never deleted, so
 * no id is drawn once as many were given as the map holds: the count
 * never wraps onto a given id.
 */
static __always_inline __u32 pair_points(struct mw_conn *c)
{
	struct mw_pair_points_key p = {};
	struct mw_counters *cnt;
	__u32 zero = 0, *id, *last, fresh;
	long err;

	if (c->obs.points)
		return c->obs.points;
	p.active_netns = c->obs.side[0].netns;
	p.active_server = c->obs.side[0].server;
	p.active_point = c->obs.side[0].point;
	p.passive_netns = c->obs.side[1].netns;
	p.passive_server = c->obs.side[1].server;
	p.passive_point = c->obs.side[1].point;
	id = bpf_map_lookup_elem(&mw_pair_points, &p);
	if (!id) {
		last = bpf_map_lookup_elem(&mw_pair_ids, &zero);
		if (!last)
			return 0;
		err = -1;
		if (*last < MW_PAIR_POINTS_MAX) {
			fresh = __sync_add_and_fetch(last, 1);
			err = bpf_map_update_elem(&mw_pair_points, &p, &fresh, BPF_NOEXIST);
		}
		if (err && err != -MW_EEXIST) {
			cnt = counters();
			if (cnt)
				cnt->flows_full++;
			return 0;
		}
		id = err ? bpf_map_lookup_elem(&mw_pair_points, &p) : &fresh;
		if (!id)
			return 0;
	}
	c->obs.points = *id;
	return c->obs.points;
}

/*
 * sk_msg: a message of a paired connection was redirected. The exchange in
 * flight lives in the connection (mw_conn.obs): its response is sent by the
 * other socket. Both points of the connection record it, with one duration
 * (the redirect has no transit of its own to measure), in one mw_pair_flows
 * record: each side's point is in the connection, so an exchange reads no
 * socket's observation record but the sender's.
 */
static __always_inline void obs_msg(struct sk_msg_md *msg, struct mw_sk_state *st, struct mw_conn *c, __u32 size,
				    __u64 coarse_now)
{
	struct mw_obs_sock *o = obs_of(st);
	__u32 kind = MW_HTTP_NONE, method = MW_METHOD_OTHER, status = 0;
	struct mw_pair_flow_key k = {};
	__u8 buf[MW_OBS_PEEK] = {};
	void *data, *end;
	__u64 now, d;
	__u32 me;

	if (!o->started)
		return; /* established before observation started */
	if (!o->accelerated)
		o->accelerated = 1;
	if (size >= MW_OBS_PEEK && !(o->seq_set & MW_OBS_NOT_HTTP)) {
		bool peeked = false;

		data = (void *)(long)msg->data;
		end = (void *)(long)msg->data_end;
		/* Pulled (copied) only when the first page holds fewer bytes. */
		if (data + MW_OBS_PEEK > end && bpf_msg_pull_data(msg, 0, MW_OBS_PEEK, 0) == 0) {
			data = (void *)(long)msg->data;
			end = (void *)(long)msg->data_end;
			if (data + MW_OBS_PEEK <= end) {
				__builtin_memcpy(buf, data, MW_OBS_PEEK);
				peeked = true;
			}
		} else if (data + MW_OBS_PEEK <= end) {
			__builtin_memcpy(buf, data, MW_OBS_PEEK);
			peeked = true;
		}
		kind = http_start(buf, &method, &status);
		/* Its first redirected message starts its stream (redirected from the first byte). */
		if (peeked && !st->sent && kind == MW_HTTP_NONE && http_ruled_out(buf))
			o->seq_set |= MW_OBS_NOT_HTTP;
	}
	/* The precise clock only for an exchange's duration; the flush needs no more than the coarse one. */
	now = kind == MW_HTTP_NONE ? coarse_now : bpf_ktime_get_ns();
	if (kind == MW_HTTP_REQUEST) {
		/* Only a client's own socket (obs_point) waits for its answer. */
		obs_app_request(o, method, now);
		c->obs.req_role = st->role;
		c->obs.req_method = method;
		c->obs.req_ns = now;
	} else if (kind == MW_HTTP_RESPONSE && c->obs.req_ns && c->obs.req_role != st->role) {
		d = now - c->obs.req_ns;
		c->obs.req_ns = 0;
		/* Both sides observed, as both sent: the requester set req_ns, and o is started. */
		if (c->obs.observed == 3) {
			k.points = pair_points(c);
			k.status = status;
			k.method = c->obs.req_method;
			if (k.points)
				obs_pair_exchange(&k, d);
		}
	}
	/* Each socket counts what it sent, and adds what its peer sent when it flushes. */
	me = st->role == MW_ROLE_ACTIVE ? 0 : 1;
	c->obs.sent[me] += size;
	o->bytes += size;
	if (flush_due(o, now)) {
		o->bytes += obs_claim_peer_bytes(c, me);
		obs_flush(o, now);
	}
}

/*
 * sock_ops: a passive side that was paired closes after its active side
 * (which gave it its last bytes): its end is an accelerated one even if it
 * never sent (sk_msg never saw it).
 */
static __always_inline void obs_passive_end(struct mw_obs_sock *o)
{
	if (observe)
		o->accelerated = 1;
}

/*
 * sock_ops: a paired connection's socket closes: its flow gets the last
 * bytes its peer redirected. The active side releases the slot at its close,
 * so it also gives a passive side that outlives it the active side's last
 * bytes (in the passive side's open flow: the passive end records its
 * outcome when it closes).
 */
static __always_inline void obs_conn_end(struct mw_obs_sock *o, struct mw_conn *c, __u32 role)
{
	struct mw_flow_key k = {};
	__u32 me = role == MW_ROLE_ACTIVE ? 0 : 1;
	__u64 b;

	if (!observe)
		return;
	b = obs_claim_peer_bytes(c, me);
	o->bytes += b;
	if (b)
		o->accelerated = 1; /* a one-way receiver: sk_msg never saw it send */
	if (me != 0 || !(c->obs.observed & 2))
		return;
	b = obs_claim_peer_bytes(c, 1);
	if (!b)
		return;
	k.server = c->obs.side[1].server;
	k.netns = c->obs.side[1].netns;
	k.point = c->obs.side[1].point;
	k.proto = MW_PROTO_TCP;
	k.outcome = MW_TCP_OPEN;
	k.accelerated = 1;
	obs_add(&k, 0, b, false);
}

#endif /* MESHWARP_OBSERVE_H */
