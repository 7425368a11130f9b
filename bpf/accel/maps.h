/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * The data path's load-time settings and the maps pairing (sock_ops), the
 * redirect (sk_msg) and learning share, with the counters' helpers.
 * Attaches to nothing: every program of the object reads these. All maps
 * but mw_cgroup are pinned by name, so a restarted agent adopts them and the
 * connections they hold; observation and the tap keep their own maps
 * (observe.h, tap.h).
 */
#ifndef MESHWARP_MAPS_H
#define MESHWARP_MAPS_H

#define AF_INET 2
#define AF_INET6 10

/* Set by the loader before load; the defaults live in internal/accel (Config). */
const volatile __u32 sidecar_uid;
const volatile __u32 outbound_capture_port;
const volatile __u32 inbound_capture_port;

/*
 * How long a hinted active socket may wait in mw_sock_map for its peer. The
 * peer is on this node: its ESTABLISHED follows within microseconds unless
 * the handshake's last ACK is lost.
 */
const volatile __u64 unpaired_timeout_ns;
/*
 * Unread redirected bytes a receiver may hold before its sender falls back
 * to TCP, and how far that grows for a reader that keeps up (over_budget).
 */
const volatile __u32 redirect_budget_bytes;
const volatile __u32 redirect_budget_max_bytes;
/*
 * Pages of TCP memory the node's counter may not show yet: each CPU holds up
 * to net.core.mem_pcpu_rsv pages before it adds them (tcp_memory_tight).
 */
const volatile __u32 tcp_mem_slack_pages;
/* The node's possible CPUs (tcp_memory_tight). */
const volatile __u32 possible_cpus = 1;
/*
 * A small-message stream: stream_run_msgs messages one way without a message
 * back, averaging fewer bytes than the path's threshold. The redirect pays a
 * queued message and a wakeup per write where TCP coalesces small writes,
 * so such a connection continues on TCP. 0 turns the detection off.
 */
const volatile __u32 stream_run_msgs;
const volatile __u32 stream_small_bytes_local;  /* both ends in one netns (loopback) */
const volatile __u32 stream_small_bytes_remote; /* across namespaces (veth) */
/* A received SYN older than this is stale (a SYN-ACK round trip on one node is far shorter). */
#define MW_SYN_HINT_TTL_NS (1000ULL * 1000 * 1000)
/* A connect older than this is not in flight any more (SYN retransmits come at 1 s and 3 s). */
#define MW_CONNECT_TTL_NS (5000ULL * 1000 * 1000)

/* Capacity is set by the loader (MaxEntries); this is the default. */
#define MW_DEFAULT_CAPACITY 65536

/*
 * The connections: an array of slots, not a hash. A socket keeps its
 * connection's slot (mw_sk_state.conn_slot), so each message finds the
 * connection with an array lookup, which the verifier inlines, instead of a
 * hash lookup's calls (docs/BENCHMARKS.md section 35). A connection's home
 * slot comes from its identity; it takes the first free one of the
 * MW_CONN_PROBES from there (conn_claim), which is where the passive side
 * finds it (conn_find). Every slot is allocated up front, as a hash's
 * elements were.
 */
/* BPF_F_MMAPABLE for its page-aligned slots (struct mw_conn: a message reads one cache line); never mapped. */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(map_flags, BPF_F_MMAPABLE);
	__uint(max_entries, MW_DEFAULT_CAPACITY);
	__type(key, __u32);
	__type(value, struct mw_conn);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} mw_conns SEC(".maps");
/* mw_conns' size, set by the loader with it. */
const volatile __u32 conn_slots = MW_DEFAULT_CAPACITY;
/* At most this far from its home (mw_conn.probed has a bit for each). */
#define MW_CONN_PROBES 32

/*
 * The paired sockets, two per slot of mw_conns (sock_index): the redirect
 * indexes an array where a SOCKHASH had to hash a key, compare it and walk
 * a bucket, about three quarters of the redirect's cost (docs/BENCHMARKS.md
 * section 36). An index is written only by the connection that holds its
 * slot, and a slot is claimed again only when neither of its sockets can
 * send any more (mw_conn.holders), so a socket that may still send finds
 * its own peer at its peer's index, or nothing.
 */
MW_PINNED_MAP(BPF_MAP_TYPE_SOCKMAP, 2 * MW_DEFAULT_CAPACITY, __u32, __u64) mw_sock_map SEC(".maps");

static __always_inline __u32 sock_index(__u32 slot, __u32 role)
{
	return slot * 2 + (role == MW_ROLE_ACTIVE ? 0 : 1);
}

/*
 * mw_conn.holders bits. A sender holds its slot from before it can send
 * until its close (STATE_CB to CLOSE, which a socket reaches only under its
 * lock, so never inside its own sendmsg).
 */
#define MW_HOLD_ACTIVE 1   /* the connecting socket: from the claim to its close */
#define MW_HOLD_PASSIVE 2  /* the accepted socket, paired: from its join to its close */
#define MW_HOLD_RESERVED 4 /* for the accepted socket: from the claim until it joins or gives up */
/*
 * A socket closed while still in mw_sock_map: one that a reset or its
 * TIME_WAIT closed while its application has it open. The kernel unlinks
 * it only at that application's close() (and may not earlier: that drops
 * the redirected bytes it has not read), so until then a connection that
 * took the slot could not join at its index and would go to TCP.
 */
#define MW_HOLD_LINGER 8
/*
 * RESERVED and LINGER lapse this long after the last socket's close
 * (released_us): no accepted socket came (a late one no longer finds the
 * slot, whose state is 0, and one that found it before finishes within its
 * callback); LINGER ends earlier, when the sockets left (conn_free). A
 * connection that takes a slot whose index is still taken goes to TCP
 * (sockhash_full).
 */
#define MW_RESERVED_LAPSE_US (1000 * 1000)

/*
 * Whether c holds connection id (state read first: a claim writes the
 * identity before it publishes the state, so a published state comes with
 * its own identity).
 */
static __always_inline bool conn_is(const struct mw_conn *c, const struct mw_conn_id *id)
{
	__u32 state = c->state;

	barrier();
	return state && c->id.active_isn1 == id->active_isn1 && c->id.passive_isn1 == id->passive_isn1;
}

/* Connection id in slot, or NULL (its connecting side closed, or the slot holds another connection now). */
static __always_inline struct mw_conn *conn_at(__u32 slot, const struct mw_conn_id *id)
{
	struct mw_conn *c = bpf_map_lookup_elem(&mw_conns, &slot);

	return c && conn_is(c, id) ? c : NULL;
}

/* The slot of connection id, published or not: only for a holder of it (who keeps it from being claimed). */
static __always_inline struct mw_conn *conn_held(__u32 slot, const struct mw_conn_id *id)
{
	struct mw_conn *c = bpf_map_lookup_elem(&mw_conns, &slot);

	return c && c->id.active_isn1 == id->active_isn1 && c->id.passive_isn1 == id->passive_isn1 ? c : NULL;
}

/* sk's connection (st: its pairing state), or NULL: closed by its connecting side, or never paired. */
static __always_inline struct mw_conn *conn_of(const struct mw_sk_state *st)
{
	return conn_at(st->conn_slot, &st->conn);
}

/* The first slot where connection id may be (the initial sequence numbers are random), and how many. */
static __always_inline __u32 conn_home(const struct mw_conn_id *id, __u32 *slots)
{
	*slots = conn_slots ? conn_slots : 1;
	return (id->active_isn1 ^ (id->passive_isn1 * 0x9E3779B1u)) % *slots;
}

/* Connection id's slot (its number in *slot), or NULL: not claimed, or its connecting side closed. */
static __always_inline struct mw_conn *conn_find(const struct mw_conn_id *id, __u32 *slot)
{
	__u32 i, slots, idx = conn_home(id, &slots), probed;
	struct mw_conn *c = bpf_map_lookup_elem(&mw_conns, &idx);

	if (!c)
		return NULL;
	probed = c->probed | 1;
	for (i = 0; i < MW_CONN_PROBES; i++, idx = idx + 1 < slots ? idx + 1 : 0) {
		if (!(probed >> i))
			break;
		if (!(probed & (1u << i)))
			continue;
		c = conn_at(idx, id);
		if (c) {
			*slot = idx;
			return c;
		}
	}
	return NULL;
}

static __always_inline bool sock_linked(__u64 sk); /* sock.h */

/*
 * Whether nobody holds slot c any more (now_us: mw_now_us()). A LINGER hold
 * ends as soon as neither of the connection's sockets is in a SOCKMAP any
 * more (their applications closed them), read through the addresses the
 * slot keeps: a socket still linked is not freed (the map holds a
 * reference), so it reads as linked; a freed one may read as anything,
 * and reads as linked at worst until the hold lapses.
 */
static __always_inline bool conn_free(const struct mw_conn *c, __u32 holders, __u32 now_us)
{
	if (c->polls)
		return false;
	if (!holders)
		return true;
	if ((holders & ~(MW_HOLD_RESERVED | MW_HOLD_LINGER)) || c->state)
		return false;
	if (now_us - c->released_us > MW_RESERVED_LAPSE_US)
		return true;
	return !(holders & MW_HOLD_RESERVED) && !sock_linked(c->active_sk) && !sock_linked(c->passive_sk);
}

/*
 * Claim a free slot for connection id (its number in *slot), or NULL: all
 * MW_CONN_PROBES slots from its home are taken. The connecting socket holds
 * it, and it is reserved for the accepted one. The caller fills it and
 * sets state last (conn_publish); until then no lookup finds it.
 */
static __always_inline struct mw_conn *conn_claim(const struct mw_conn_id *id, __u32 *slot, __u32 now_us)
{
	__u32 i, slots, home = conn_home(id, &slots), idx = home, holders;
	struct mw_conn *c, *h;

	for (i = 0; i < MW_CONN_PROBES; i++, idx = idx + 1 < slots ? idx + 1 : 0) {
		c = bpf_map_lookup_elem(&mw_conns, &idx);
		if (!c)
			continue;
		holders = c->holders;
		if (!conn_free(c, holders, now_us) ||
		    __sync_val_compare_and_swap(&c->holders, holders, MW_HOLD_ACTIVE | MW_HOLD_RESERVED) != holders)
			continue;
		c->state = 0;
		c->id = *id;
		*slot = idx;
		h = i ? bpf_map_lookup_elem(&mw_conns, &home) : NULL;
		if (h && !(h->probed & (1u << i)))
			__sync_fetch_and_or(&h->probed, 1u << i);
		return c;
	}
	return NULL;
}

/* Make the filled slot c findable (it holds the connection claimed, with state). */
static __always_inline void conn_publish(struct mw_conn *c, enum mw_conn_state state)
{
	barrier();
	c->state = state;
}

/* This holder is done with slot c (conn_held or conn_at): the last one's drop frees it. */
static __always_inline void conn_drop(struct mw_conn *c, __u32 hold)
{
	__sync_fetch_and_and(&c->holders, ~hold);
}

/*
 * A closing socket that holds slot c with hold lets go of it; still in
 * mw_sock_map (in_map), it keeps it LINGER held. released_us comes first:
 * a claim that sees the LINGER bit reads the time it lapses from.
 */
static __always_inline void conn_release(struct mw_conn *c, __u32 hold, bool in_map, __u32 now_us)
{
	c->released_us = now_us;
	if (in_map)
		__sync_fetch_and_or(&c->holders, MW_HOLD_LINGER);
	conn_drop(c, hold);
}

/* The connecting side closed: lookups stop finding the connection, and it lets go of the slot. */
static __always_inline void conn_end(struct mw_conn *c, bool in_map, __u32 now_us)
{
	c->state = 0;
	conn_release(c, MW_HOLD_ACTIVE, in_map, now_us);
}

/*
 * The leave poll (leave.h): the connections whose sockets wait to leave
 * mw_sock_map after a switch to TCP, and the one timer that checks them.
 * One timer for the node, not one per connection: a timer is an allocation
 * freed through RCU, and on 6.18 each such free costs an interrupt
 * (docs/BENCHMARKS.md section 29).
 */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(map_flags, BPF_F_NO_PREALLOC); /* memory only for switched connections (few) */
	__uint(max_entries, MW_DEFAULT_CAPACITY);
	__type(key, struct mw_conn_id);
	__type(value, __u32);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} mw_leave_polls SEC(".maps");
MW_PINNED_MAP(BPF_MAP_TYPE_ARRAY, 1, __u32, struct mw_leave_clock) mw_leave_clock SEC(".maps");
/* Set by the loader, different for every load: the load whose callback the timer runs. */
const volatile __u64 leave_clock_owner;

/*
 * Step 0 notes (hints.h), not keyed by netns: the active side may be in
 * another namespace than its listener. They only let a socket join
 * mw_sock_map; the pairing itself is proven by both sequence numbers
 * (mw_conns), and the unpaired timeout bounds a wrong note. An array, not a
 * hash: a note is two plain stores into the pair of slots its SYN hashes to
 * (the LRU hash's update took about 800 ns of a connection's sock_ops time,
 * docs/BENCHMARKS.md section 46), and a note never taken is overwritten,
 * never evicted.
 */
#define MW_SYN_NOTES 8192 /* a power of two */
MW_PINNED_MAP(BPF_MAP_TYPE_ARRAY, MW_SYN_NOTES, __u32, struct mw_syn_note) mw_syn_notes SEC(".maps");

/*
 * Connections whose connecting socket found no note (no_local_peer), with
 * its source address: if the accepted side turns out to be in the cgroup,
 * it re-counts the connection under the precise reason (addr_mismatch,
 * hint_missed). Notes as mw_syn_notes': every connection to a remote host
 * or a server outside the cgroup writes one that nobody takes, so a hash
 * map's update was a cost on traffic meshwarp does not accelerate. A note
 * overwritten first leaves its connection counted as no_local_peer.
 */
#define MW_UNHINTED_NOTES 8192 /* a power of two */
/*
 * An accepted side on this node comes within a round trip of its
 * connecting side's establishment: a note older than this is free for
 * another (mw_now_us units, about 100 ms).
 */
#define MW_UNHINTED_TTL_US ((__u32)(100ULL * 1000 * 1000 >> 10))
MW_PINNED_MAP(BPF_MAP_TYPE_ARRAY, MW_UNHINTED_NOTES, __u32, struct mw_unhinted_note) mw_unhinted_notes SEC(".maps");

/*
 * Of the two slots of a note's pair (one cache line), whether a new note
 * takes the second: the first holds a note younger than ttl_us (live1: the
 * slot is not free; at: mw_now_us units), and the second is free, older
 * than ttl_us, or older than the first.
 */
static __always_inline bool note_takes_second(bool live1, __u32 at1, bool live2, __u32 at2, __u32 now_us,
					      __u32 ttl_us)
{
	if (!live1 || now_us - at1 >= ttl_us)
		return false;
	return !live2 || now_us - at2 >= ttl_us || (__s32)(at2 - at1) < 0;
}

/*
 * One record per socket (struct mw_sock). BPF_F_CLONE: a socket accepted
 * from a listener starts with a copy of the listener's record
 * (sk_clone_lock -> bpf_sk_storage_clone), so it names the server program
 * (a copy is an allocation the accepted socket needs anyway).
 */
struct {
	__uint(type, BPF_MAP_TYPE_SK_STORAGE);
	__uint(map_flags, BPF_F_NO_PREALLOC | BPF_F_CLONE);
	__type(key, int);
	__type(value, struct mw_sock);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} mw_sk_store SEC(".maps");

/* sk's record in mw_sk_store (created if create), or NULL. */
static __always_inline struct mw_sock *sock_rec(void *sk, bool create)
{
	return bpf_sk_storage_get(&mw_sk_store, sk, 0, create ? BPF_SK_STORAGE_GET_F_CREATE : 0);
}

/* sk's pairing state, or NULL. */
static __always_inline struct mw_sk_state *pair_state(void *sk, bool create)
{
	struct mw_sock *s = sock_rec(sk, create);

	return s ? &s->pair : NULL; /* offset 0: no arithmetic on a maybe-NULL pointer */
}

/* sk's observation state, or NULL. */
static __always_inline struct mw_obs_sock *obs_state(void *sk, bool create)
{
	struct mw_sock *s = sock_rec(sk, create);

	if (!s)
		return NULL;
	/* Keep the offset behind the NULL check (the verifier rejects it before). */
	barrier_var(s);
	return &s->obs;
}

/*
 * The program recorded on sk (learning.h), or NULL; create: the record to
 * write it into. A record that pairing or observation made (a socket older
 * than the agent, or accepted from such a listener) names none.
 */
static __always_inline struct mw_prog *prog_state(void *sk, bool create)
{
	struct mw_sock *s = sock_rec(sk, create);

	if (!s)
		return NULL;
	barrier_var(s);
	if (!create && !s->prog.comm[0])
		return NULL;
	return &s->prog;
}

MW_PINNED_MAP(BPF_MAP_TYPE_PERCPU_ARRAY, 1, __u32, struct mw_counters) mw_stats SEC(".maps");

MW_PINNED_MAP(BPF_MAP_TYPE_ARRAY, 1, __u32, struct mw_policy_cfg) mw_policy SEC(".maps");

/* Destination port (host order) -> enum mw_port_action. */
MW_PINNED_MAP(BPF_MAP_TYPE_HASH, 1024, __u32, __u32) mw_port_policy SEC(".maps");

/* The include and exclude lists of destinations (CIDRs): two maps, one shape. */
struct {
	__uint(type, BPF_MAP_TYPE_LPM_TRIE);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__uint(max_entries, 1024);
	__type(key, struct mw_cidr_key);
	__type(value, __u32);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} mw_cidr_incl SEC(".maps"), mw_cidr_excl SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_CGROUP_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, __u32);
} mw_cgroup SEC(".maps");

MW_PINNED_MAP(BPF_MAP_TYPE_LRU_HASH, 256, struct mw_unfit_key, struct mw_unfit_proc) mw_unfit_procs SEC(".maps");

/*
 * Ports (host order) of sockets that did what a redirect cannot honour ->
 * the reason (enum mw_reason): a later connection is not paired when its
 * accepting side listens on a port in mw_unfit_lport or its connecting side
 * dials a port in mw_unfit_rport.
 */
MW_PINNED_MAP(BPF_MAP_TYPE_LRU_HASH, 1024, __u32, __u32) mw_unfit_lport SEC(".maps");

MW_PINNED_MAP(BPF_MAP_TYPE_LRU_HASH, 1024, __u32, __u32) mw_unfit_rport SEC(".maps");

/*
 * Programs that did what a redirect cannot honour: none of their later
 * connections is paired, on any port (pairing.h, prog_unfit). Pinned, so
 * what was learned outlives the agent.
 */
MW_PINNED_MAP(BPF_MAP_TYPE_LRU_HASH, 256, struct mw_prog, struct mw_unfit_prog) mw_unfit_progs SEC(".maps");

/*
 * 0 -> whether mw_unfit_progs may hold anything: while not, the connection
 * path skips its lookup (an array lookup is inlined). Pinned with it.
 */
MW_PINNED_MAP(BPF_MAP_TYPE_ARRAY, 1, __u32, __u32) mw_learned_any SEC(".maps");

static __always_inline struct mw_counters *counters(void)
{
	__u32 zero = 0;
	return bpf_map_lookup_elem(&mw_stats, &zero);
}

static __always_inline void count_conn(__u32 reason)
{
	struct mw_counters *c = counters();
	if (c && reason < MW_REASON_MAX)
		c->passthrough_conns[reason]++;
}

/*
 * A connecting socket that stays off mw_sock_map from the start: counted as
 * a connection left to TCP and as a socket kept off the data path.
 */
static __always_inline void keep_off(__u32 reason)
{
	struct mw_counters *c = counters();

	if (c && reason < MW_REASON_MAX) {
		c->passthrough_conns[reason]++;
		c->sockets_removed[reason]++;
	}
}

/*
 * bpf_ktime_get_coarse_ns() as of the current tick, read once per tick for
 * the node. The coarse clock only moves with the tick (jiffies), and
 * bpf_jiffies64 is inlined into one load, while a helper call costs each
 * message and segment about 10 % of mw_skmsg on CPUs whose returns are
 * mitigated (docs/BENCHMARKS.md section 30). Racing writers store the same
 * values; a reader may get the previous tick's time: coarse all the same.
 */
static __u64 clock_jiffies;
static __u64 clock_coarse_ns;

static __always_inline __u64 coarse_ns(void)
{
	__u64 j = bpf_jiffies64();

	if (j != clock_jiffies) {
		clock_coarse_ns = bpf_ktime_get_coarse_ns();
		clock_jiffies = j;
	}
	return clock_coarse_ns;
}

#endif /* MESHWARP_MAPS_H */
