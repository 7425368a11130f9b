// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
/*
 * Same-node TCP acceleration.
 *
 * Attach points: mw_sockops on a cgroup v2 directory (BPF_CGROUP_SOCK_OPS),
 * mw_skmsg on mw_sock_hash (BPF_SK_MSG_VERDICT).
 * Kernel: >= 6.10 (sockmap links; we also rely on BPF atomics (5.12),
 * sk_storage in sk_msg and bpf_skc_to_tcp_sock in sock_ops).
 * Maps owned (all pinned by name so a restarted agent adopts them):
 *   mw_sock_hash    SOCKHASH  mw_sock_key -> socket
 *   mw_conns        HASH      mw_conn_id  -> mw_conn (the pairing decision)
 *   mw_connecting, mw_src_addr, mw_unhinted   LRU_HASH   who may have a local peer
 *   mw_sk_store     SK_STORAGE             mw_sk_state per socket
 *   mw_stats        PERCPU_ARRAY           mw_counters
 *   mw_policy, mw_port_policy, mw_cidr_incl, mw_cidr_excl   policy
 *   mw_cgroup       CGROUP_ARRAY, mw_unfit_procs LRU_HASH     the syscall watches
 *
 * The syscall watches (tracepoints syscalls/sys_enter_*, for processes of
 * the cgroup) learn what a redirect cannot honour, because this kernel's
 * sockmap receive path does not: splice(2) reads only the TCP queue;
 * recv(MSG_WAITALL) and SO_RCVLOWAT set after pairing return what the
 * redirect queue holds; MSG_OOB has no urgent mark on redirected bytes;
 * close() with unread redirected bytes sends FIN where TCP sends RST;
 * connect(AF_UNSPEC) leaves unread redirected bytes for the next connection. The
 * connection that reveals it already runs; later connections on that
 * socket's ports are left to TCP (mw_unfit_lport, mw_unfit_rport), and
 * `meshwarp status` names the processes (mw_unfit_procs).
 *
 * How a connection is paired (once, never changed):
 *   0. a socket of the cgroup connects (TCP_CONNECT_CB): note its source
 *      endpoint in mw_connecting. A listener of the cgroup answers a SYN
 *      (RWND_INIT, on the request socket, before the SYN-ACK is sent): if a
 *      connecting socket uses the SYN's source endpoint, mark it answered;
 *      else, if a socket of the cgroup is connecting from the SYN's source
 *      address, NAT remapped the source port: count a remapped SYN for that
 *      address (mw_src_addr). Neither means no local peer in the cgroup (a
 *      remote host, a server outside the cgroup): such sockets never join
 *      mw_sock_hash. The listener cannot read the SYN's sequence number, so
 *      these notes only decide who joins; the pairing is proven in step 2.
 *   1. active side ESTABLISHED: if its SYN was answered, or it claims one
 *      remapped SYN of its address, create mw_conns[id] = PENDING, join
 *      mw_sock_hash, arm the unpaired timer.
 *   2. passive side ESTABLISHED: if mw_conns[id] is PENDING (both initial
 *      sequence numbers match) and the active side's address is our remote
 *      address, join mw_sock_hash, then PENDING -> PAIRED.
 *   3. active side's first sendmsg: if still PENDING, PENDING -> PASSTHROUGH:
 *      that byte goes by TCP, and so does every later byte in both directions.
 *   4. the timer: PENDING -> PASSTHROUGH (unpaired_timeout).
 * The passive side cannot send before step 2 (it is not accepted yet), and the
 * active side redirects only after it saw PAIRED, so no stream is ever split
 * between the two paths.
 *
 * Sockets that will not be paired leave mw_sock_hash, so the kernel gives
 * them plain TCP back (tcp_bpf's FIONREAD, sendmsg and splice differ). A
 * socket is removed only when its connection is PASSTHROUGH, a final state:
 * a socket is a redirect target only of a PAIRED peer, so a removed socket
 * has never had, and never gets, a redirected byte to lose. The passive side
 * removes the active socket when it finds the decision made (step 2), and
 * itself when it loses the race to step 3; the timer removes it otherwise.
 */
#include "vmlinux.h"
#include "bpf_helpers.h"
#include "bpf_endian.h"
#include "bpf_core_read.h"
#include "accel.h"

#define AF_INET 2
#define AF_INET6 10

char LICENSE[] SEC("license") = "Dual BSD/GPL";

/* Set by the loader before load; the defaults live in internal/accel (Config). */
const volatile __u32 sidecar_uid;
const volatile __u32 outbound_capture_port;
const volatile __u32 inbound_capture_port;

/*
 * How long a hinted active socket may wait in mw_sock_hash for its peer. The
 * peer is on this node: its ESTABLISHED follows within microseconds unless
 * the handshake's last ACK is lost.
 */
const volatile __u64 unpaired_timeout_ns;
/* Unread redirected bytes a receiver may hold before its sender falls back to TCP. */
const volatile __u32 redirect_budget_bytes;
/*
 * A small-message stream: stream_run_msgs messages one way without a message
 * back, averaging fewer bytes than the path's threshold. The redirect pays a
 * queued message and a wakeup per write where TCP coalesces small writes,
 * so such a connection continues on TCP. 0 turns the detection off.
 */
const volatile __u32 stream_run_msgs;
const volatile __u32 stream_small_bytes_local;  /* both ends in one netns (loopback) */
const volatile __u32 stream_small_bytes_remote; /* across namespaces (veth) */
/* An answered SYN older than this is stale (a SYN-ACK round trip on one node is far shorter). */
#define MW_SYN_HINT_TTL_NS (1000ULL * 1000 * 1000)
/* A connect older than this is not in flight any more (SYN retransmits come at 1 s and 3 s). */
#define MW_CONNECT_TTL_NS (5000ULL * 1000 * 1000)

#define CLOCK_MONOTONIC 1
/* SK_USER_DATA_NOCOPY | SK_USER_DATA_BPF | SK_USER_DATA_PSOCK (include/net/sock.h) */
#define MW_SK_USER_DATA_FLAGS 7
#define MW_SK_USER_DATA_PSOCK 4
#define EBUSY 16

/* Capacity is set by the loader (MaxEntries); this is the default. */
#define MW_DEFAULT_CAPACITY 65536

struct {
	__uint(type, BPF_MAP_TYPE_SOCKHASH);
	__uint(max_entries, MW_DEFAULT_CAPACITY);
	__type(key, struct mw_sock_key);
	__type(value, __u64);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} mw_sock_hash SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, MW_DEFAULT_CAPACITY);
	__type(key, struct mw_conn_id);
	__type(value, struct mw_conn);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} mw_conns SEC(".maps");

/*
 * Step 0 notes, not keyed by netns: the active side may be in another
 * namespace than its listener. They only let a socket join mw_sock_hash; the
 * pairing itself is proven by the sequence numbers (mw_conns), and the timer
 * bounds a wrong note.
 */
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, MW_DEFAULT_CAPACITY);
	__type(key, struct mw_endpoint);
	__type(value, struct mw_connect);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} mw_connecting SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, MW_DEFAULT_CAPACITY);
	__type(key, struct mw_addr);
	__type(value, struct mw_src_addr);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} mw_src_addr SEC(".maps");

/*
 * Connections whose connecting socket found no note (no_local_peer), with
 * its source endpoint: if the accepted side turns out to be in the cgroup,
 * it re-counts the connection under the precise reason (addr_mismatch,
 * hint_missed).
 */
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, MW_DEFAULT_CAPACITY);
	__type(key, struct mw_conn_id);
	__type(value, struct mw_endpoint);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} mw_unhinted SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_SK_STORAGE);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, int);
	__type(value, struct mw_sk_state);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} mw_sk_store SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct mw_counters);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} mw_stats SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct mw_policy_cfg);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} mw_policy SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 1024);
	__type(key, __u32); /* destination port, host order */
	__type(value, __u32); /* enum mw_port_action */
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} mw_port_policy SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LPM_TRIE);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__uint(max_entries, 1024);
	__type(key, struct mw_cidr_key);
	__type(value, __u32);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} mw_cidr_incl SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LPM_TRIE);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__uint(max_entries, 1024);
	__type(key, struct mw_cidr_key);
	__type(value, __u32);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} mw_cidr_excl SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_CGROUP_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, __u32);
} mw_cgroup SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 256);
	__type(key, struct mw_unfit_key);
	__type(value, struct mw_unfit_proc);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} mw_unfit_procs SEC(".maps");

/*
 * Ports of sockets that did what a redirect cannot honour, with the reason:
 * a later connection is not paired when its accepting side listens on a
 * port in mw_unfit_lport or its connecting side dials a port in
 * mw_unfit_rport (host order).
 */
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 1024);
	__type(key, __u32);
	__type(value, __u32); /* enum mw_reason */
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} mw_unfit_lport SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 1024);
	__type(key, __u32);
	__type(value, __u32); /* enum mw_reason */
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} mw_unfit_rport SEC(".maps");

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
 * A connecting socket that stays off mw_sock_hash from the start: counted as
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
 * Take a socket of a PASSTHROUGH connection out of mw_sock_hash (see the
 * header: it never was and never will be a redirect target). Only sock_ops
 * (and its timer callbacks) may delete from a SOCKHASH.
 */
static __always_inline void remove_socket(struct mw_sock_key *key, __u32 reason)
{
	struct mw_counters *c;

	if (bpf_map_delete_elem(&mw_sock_hash, key))
		return; /* already removed, or closed */
	c = counters();
	if (c && reason < MW_REASON_MAX)
		c->sockets_removed[reason]++;
}

static __always_inline void remove_active(const struct mw_conn_id *id, const struct mw_conn *c)
{
	struct mw_sock_key key = {
		.conn = *id,
		.active_cookie = c->active_cookie,
		.role = MW_ROLE_ACTIVE,
	};

	remove_socket(&key, c->reason);
}

/* IPv4 as ::ffff:a.b.c.d so v4 peers of dual-stack listeners compare equal. */
static __always_inline void set_v4_mapped(__u32 addr[4], __u32 ip4_be)
{
	addr[0] = 0;
	addr[1] = 0;
	addr[2] = bpf_htonl(0x0000ffff);
	addr[3] = ip4_be;
}

/*
 * The endpoints as sock_ops reports them. All ctx fields are read
 * unconditionally: clang merges loads across branches otherwise and the
 * verifier rejects the modified ctx pointer.
 */
struct mw_tuple {
	struct mw_endpoint local;
	struct mw_endpoint remote;
};

/* A volatile load stays a single ctx load at a fixed offset. */
#define CTX_READ(field) (*(volatile __u32 *)&(field))

/*
 * The address fields of a context (sock_ops, sk_msg and bpf_sock name them
 * alike), each read once at its fixed offset (network order).
 */
#define CTX_ADDRS(ctx, fam, l4, r4, l6, r6)                                                           \
	__u32 family = CTX_READ((ctx)->fam);                                                          \
	__u32 lip4 = CTX_READ((ctx)->l4), rip4 = CTX_READ((ctx)->r4);                                  \
	__u32 l6_[4] = { CTX_READ((ctx)->l6[0]), CTX_READ((ctx)->l6[1]), CTX_READ((ctx)->l6[2]),      \
			 CTX_READ((ctx)->l6[3]) };                                                    \
	__u32 r6_[4] = { CTX_READ((ctx)->r6[0]), CTX_READ((ctx)->r6[1]), CTX_READ((ctx)->r6[2]),      \
			 CTX_READ((ctx)->r6[3]) }

/* A tuple from CTX_ADDRS's values and the ports (host order); IPv4 as v4-mapped. */
static __always_inline void fill_tuple(struct mw_tuple *t, __u32 family, __u32 lip4, __u32 rip4,
				       const __u32 *l6, const __u32 *r6, __u32 lport, __u32 rport)
{
	if (family == AF_INET) {
		set_v4_mapped(t->local.addr, lip4);
		set_v4_mapped(t->remote.addr, rip4);
	} else {
		for (int i = 0; i < 4; i++) {
			t->local.addr[i] = l6[i];
			t->remote.addr[i] = r6[i];
		}
	}
	t->local.port_host = lport;
	t->remote.port_host = rport;
}

static __always_inline void sockops_tuple(struct bpf_sock_ops *skops, struct mw_tuple *t)
{
	CTX_ADDRS(skops, family, local_ip4, remote_ip4, local_ip6, remote_ip6);
	/* local_port: host order. remote_port: network order in the upper 16 bits. */
	__u32 lport = CTX_READ(skops->local_port);
	__u32 rport = bpf_ntohl(CTX_READ(skops->remote_port)) & 0xffff;

	fill_tuple(t, family, lip4, rip4, l6_, r6_, lport, rport);
}

static __always_inline bool addr_eq(const struct mw_endpoint *a, const struct mw_endpoint *b)
{
	return a->addr[0] == b->addr[0] && a->addr[1] == b->addr[1] && a->addr[2] == b->addr[2] &&
	       a->addr[3] == b->addr[3];
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
static __always_inline __u32 socket_unfit(struct bpf_sock *sk)
{
	struct tcp_sock *tp = bpf_skc_to_tcp_sock(sk);
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
static __always_inline bool wrote_early(struct bpf_sock *sk, __u32 snd_nxt)
{
	struct tcp_sock *tp = bpf_skc_to_tcp_sock(sk);

	if (!tp)
		return true;
	return tp->write_seq != snd_nxt || tp->bytes_sent != 0;
}

/* The uid owning the socket (the process that created it), via BTF. */
static __always_inline __u32 socket_uid(struct bpf_sock *sk)
{
	struct tcp_sock *tp = bpf_skc_to_tcp_sock(sk);
	if (!tp)
		return (__u32)-1;
	return tp->inet_conn.icsk_inet.sk.sk_uid.val;
}

#include "observe.h"

/* Give up on a PENDING connection; whoever wins the cmpxchg writes the reason. */
static __always_inline void conn_passthrough(struct mw_conn *c, __u32 reason)
{
	if (__sync_val_compare_and_swap(&c->state, MW_CONN_PENDING, MW_CONN_PASSTHROUGH) ==
	    MW_CONN_PENDING) {
		c->reason = reason;
		count_conn(reason);
	}
}

/* Why a socket could not join mw_sock_hash (bpf_sock_hash_update's error). */
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

/* mw_conns timer: a connection still unpaired gives up and leaves the hash. */
static int on_unpaired_timeout(void *map, struct mw_conn_id *id, struct mw_conn *c)
{
	if (c->state == MW_CONN_PENDING)
		conn_passthrough(c, MW_REASON_UNPAIRED_TIMEOUT);
	if (c->state == MW_CONN_PASSTHROUGH)
		remove_active(id, c);
	return 0;
}

static __always_inline void addr_of(struct mw_addr *a, const struct mw_endpoint *e)
{
	__builtin_memcpy(a->addr, e->addr, sizeof(a->addr));
}

/*
 * Ask for STATE_CB on this socket, keeping the callbacks other sock_ops
 * programs of the node asked for (the flags are the socket's, not ours).
 */
static __always_inline void want_state_cb(struct bpf_sock_ops *skops, __u32 flags)
{
	if (!(flags & BPF_SOCK_OPS_STATE_CB_FLAG))
		bpf_sock_ops_cb_flags_set(skops, flags | BPF_SOCK_OPS_STATE_CB_FLAG);
}

/*
 * For a socket in mw_sock_hash: STATE_CB (the close), and a callback for
 * each TCP packet the socket sends (WRITE_HDR_OPT_CB: HDR_OPT_LEN_CB) or
 * receives (PARSE_ALL_HDR_OPT_CB: PARSE_HDR_OPT_CB), where it leaves
 * mw_sock_hash once it will not redirect any more (on_leave_check). A paired
 * connection sends and receives no TCP packets while it redirects, so this
 * costs nothing until then.
 */
#define MW_CB_FLAGS                                                                                \
	(BPF_SOCK_OPS_STATE_CB_FLAG | BPF_SOCK_OPS_WRITE_HDR_OPT_CB_FLAG | BPF_SOCK_OPS_PARSE_ALL_HDR_OPT_CB_FLAG)

static __always_inline void want_callbacks(struct bpf_sock_ops *skops, __u32 flags)
{
	if ((flags & MW_CB_FLAGS) != MW_CB_FLAGS)
		bpf_sock_ops_cb_flags_set(skops, flags | MW_CB_FLAGS);
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

static __always_inline void on_active_established(struct bpf_sock_ops *skops, struct bpf_sock *sk,
						  __u32 snd_nxt, __u32 rcv_nxt, __u32 cb_flags)
{
	struct mw_tuple t = {};
	struct mw_conn conn = {};
	struct mw_sock_key key = {};
	struct mw_sk_state *st;
	struct mw_conn *c;
	struct mw_conn_id id = { .active_isn1 = snd_nxt, .passive_isn1 = rcv_nxt };
	__u32 reason, *learned;
	bool hinted;
	long err;

	sockops_tuple(skops, &t);
	/* Consume the connect's notes first, whatever happens next. */
	hinted = take_syn_hint(&t.local);
	reason = socket_unfit(sk);
	if (!reason && wrote_early(sk, snd_nxt))
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
	if (!hinted) {
		/* If the accepted side is ours after all, it finds out why (step 2). */
		bpf_map_update_elem(&mw_unhinted, &id, &t.local, BPF_ANY);
		keep_off(MW_REASON_NO_LOCAL_PEER);
		return;
	}
	st = bpf_sk_storage_get(&mw_sk_store, sk, 0, BPF_SK_STORAGE_GET_F_CREATE);
	if (!st)
		return;
	/* A socket reconnected after connect(AF_UNSPEC) keeps its storage: start clean. */
	__builtin_memset(st, 0, sizeof(*st));
	st->role = MW_ROLE_ACTIVE;

	conn.active_cookie = bpf_get_socket_cookie(skops);
	conn.active_sk = (__u64)(unsigned long)sk;
	conn.active_local = t.local;
	conn.active_remote = t.remote;
	conn.state = MW_CONN_PENDING;
	conn.active_is_sidecar = socket_uid(sk) == sidecar_uid;
	conn.active_netns = bpf_get_netns_cookie(skops);

	err = bpf_map_update_elem(&mw_conns, &id, &conn, BPF_NOEXIST);
	if (err) {
		/*
		 * Another live connection drew the same identity (or the map is
		 * full). Neither may be paired: a passive socket could not tell
		 * which active socket it belongs to.
		 */
		struct mw_conn *other = bpf_map_lookup_elem(&mw_conns, &id);

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
	st->owns_conn = 1;
	st->peer.conn = id;
	/* STATE_CB lets us drop the mw_conns entry when this socket closes. */
	want_callbacks(skops, cb_flags);
	c = bpf_map_lookup_elem(&mw_conns, &id);
	if (!c)
		return; /* cannot happen: this socket's close is the only delete */

	key.conn = id;
	key.active_cookie = conn.active_cookie;
	key.role = MW_ROLE_ACTIVE;
	err = bpf_sock_hash_update(skops, &mw_sock_hash, &key, BPF_NOEXIST);
	if (err) {
		reason = join_error_reason(err);
		conn_passthrough(c, reason);
		count_join_error(reason);
		st->decision = MW_CONN_PASSTHROUGH;
		st->reason = reason;
		return;
	}
	st->peer = key;
	st->peer.role = MW_ROLE_PASSIVE;
	/* A timer that cannot be armed leaves the socket to steps 2 and 3. */
	if (bpf_timer_init(&c->unpaired_timer, &mw_conns, CLOCK_MONOTONIC) == 0 &&
	    bpf_timer_set_callback(&c->unpaired_timer, on_unpaired_timeout) == 0)
		bpf_timer_start(&c->unpaired_timer, unpaired_timeout_ns, 0);
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
 * note was lost (a remapped port whose SYN another socket claimed, an
 * evicted or late note).
 */
static __always_inline void missed_local_peer(const struct mw_conn_id *id, const struct mw_endpoint *remote)
{
	struct mw_endpoint *active_local = bpf_map_lookup_elem(&mw_unhinted, id);
	struct mw_counters *c;
	__u32 reason;

	if (!active_local)
		return;
	reason = addr_eq(active_local, remote) ? MW_REASON_HINT_MISSED : MW_REASON_ADDR_MISMATCH;
	bpf_map_delete_elem(&mw_unhinted, id);
	c = counters();
	if (!c)
		return;
	/* Per-CPU values may wrap below zero here; their sum stays exact. */
	c->passthrough_conns[MW_REASON_NO_LOCAL_PEER]--;
	c->sockets_removed[MW_REASON_NO_LOCAL_PEER]--;
	c->passthrough_conns[reason]++;
	c->sockets_removed[reason]++;
}

/* The connection will not be paired: the active socket leaves the hash. */
static __always_inline void passive_gives_up(struct mw_conn_id *id, struct mw_conn *c, __u32 reason)
{
	conn_passthrough(c, reason);
	if (c->state == MW_CONN_PASSTHROUGH)
		remove_active(id, c);
}

static __always_inline void on_passive_established(struct bpf_sock_ops *skops, struct bpf_sock *sk,
						   __u32 snd_nxt, __u32 rcv_nxt, __u32 cb_flags)
{
	struct mw_tuple t = {};
	struct mw_sock_key key = {};
	struct mw_sk_state *st;
	struct mw_counters *cnt;
	struct mw_conn *c;
	struct mw_conn_id id = { .active_isn1 = rcv_nxt, .passive_isn1 = snd_nxt };
	__u32 hop, reason, *learned;
	long err;

	sockops_tuple(skops, &t);
	c = bpf_map_lookup_elem(&mw_conns, &id);
	if (!c) {
		/* The connecting socket is not ours (remote host, other cgroup, excluded) or found no note. */
		missed_local_peer(&id, &t.remote);
		return;
	}
	if (c->state != MW_CONN_PENDING) {
		/* Decided before we got here (first byte sent, timeout): release the active side. */
		if (c->state == MW_CONN_PASSTHROUGH)
			remove_active(&id, c);
		return;
	}

	reason = socket_unfit(sk);
	if (reason) {
		passive_gives_up(&id, c, reason);
		return;
	}
	if (policy_excludes(&t.local)) {
		passive_gives_up(&id, c, MW_REASON_POLICY);
		return;
	}
	learned = bpf_map_lookup_elem(&mw_unfit_lport, &t.local.port_host);
	if (learned) {
		passive_gives_up(&id, c, *learned);
		return;
	}
	/*
	 * REDIRECT/DNAT rewrite the destination; the source address stays and
	 * must match. The source port may not: conntrack remaps it when the
	 * rewritten tuple collides with another entry.
	 */
	if (!addr_eq(&c->active_local, &t.remote)) {
		passive_gives_up(&id, c, MW_REASON_ADDR_MISMATCH);
		return;
	}
	st = bpf_sk_storage_get(&mw_sk_store, sk, 0, BPF_SK_STORAGE_GET_F_CREATE);
	if (!st) {
		passive_gives_up(&id, c, MW_REASON_SOCKHASH_FULL);
		return;
	}
	st->role = MW_ROLE_PASSIVE;

	key.conn = id;
	key.active_cookie = c->active_cookie;
	key.role = MW_ROLE_PASSIVE;
	/* Join the hash before announcing PAIRED: the active side redirects to us then. */
	err = bpf_sock_hash_update(skops, &mw_sock_hash, &key, BPF_NOEXIST);
	if (err) {
		reason = join_error_reason(err);
		count_join_error(reason);
		st->decision = MW_CONN_PASSTHROUGH;
		st->reason = reason;
		passive_gives_up(&id, c, reason);
		return;
	}

	hop = classify_hop(t.local.port_host, c);
	c->hop = hop;
	c->passive_sk = (__u64)(unsigned long)sk;
	c->same_netns = bpf_get_netns_cookie(skops) == c->active_netns;
	if (__sync_val_compare_and_swap(&c->state, MW_CONN_PENDING, MW_CONN_PAIRED) != MW_CONN_PENDING) {
		/*
		 * The active side sent its first byte by TCP (or timed out) since
		 * we looked: nobody redirected to either socket, both leave.
		 */
		st->decision = MW_CONN_PASSTHROUGH;
		st->reason = c->reason;
		remove_socket(&key, c->reason);
		remove_active(&id, c);
		return;
	}
	st->peer = key;
	st->peer.role = MW_ROLE_ACTIVE;
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
		if (c->active_local.port_host != t.remote.port_host)
			cnt->nat_port_remaps++;
	}
}

/*
 * Bytes redirected to the peer socket that it has not read yet: its psock's
 * msg_tot_len (the queue FIONREAD reports on a paired socket). sk_msg cannot
 * take a reference on the peer (no bpf_sk_release here), so the address
 * recorded at pairing is read with fault-free probe reads.
 */
static __always_inline struct sk_psock *psock_of(struct sock *sk)
{
	/* The low bits of sk_user_data are flags (SK_USER_DATA_PTRMASK). */
	__u64 user_data = (__u64)BPF_CORE_READ(sk, sk_user_data) & ~(__u64)MW_SK_USER_DATA_FLAGS;

	return (struct sk_psock *)user_data;
}

/* Kernels without msg_tot_len: how many queued messages redirect_backlog adds up. */
#define MW_BACKLOG_WALK 64
/* ... and what it reports when more are queued: over any sensible budget. */
#define MW_BACKLOG_MANY (1U << 30)

/*
 * Redirected bytes waiting unread in sk's psock (0 without one). Kernels
 * without msg_tot_len (before commit 929e30f93125: 6.1, 6.6 < 6.6.128,
 * 6.12 < 6.12.75) get the sum of the first MW_BACKLOG_WALK messages of the
 * ingress_msg list (tcp_bpf's recvmsg lowers a message's sg.size as it is
 * read and unlinks it at its last byte), MW_BACKLOG_MANY beyond them. 0 is
 * exact there too: only an empty list gives it.
 */
static __always_inline __u32 redirect_backlog(struct sock *sk)
{
	struct sk_psock *psock = psock_of(sk);
	__u64 head, pos;
	__u32 sum = 0;

	if (!psock)
		return 0;
	if (bpf_core_field_exists(psock->msg_tot_len))
		return BPF_CORE_READ(psock, msg_tot_len);
	head = (__u64)psock + bpf_core_field_offset(struct sk_psock, ingress_msg);
	pos = (__u64)BPF_CORE_READ(psock, ingress_msg.next);
	for (int i = 0; i < MW_BACKLOG_WALK; i++) {
		if (pos == head || !pos)
			return sum ? sum : (pos == head && i == 0 ? 0 : 1);
		sum += BPF_CORE_READ((struct sk_msg *)(pos - bpf_core_field_offset(struct sk_msg, list)), sg.size);
		pos = (__u64)BPF_CORE_READ((struct list_head *)pos, next);
	}
	return MW_BACKLOG_MANY;
}

static __always_inline __u32 peer_backlog(__u64 peer_sk)
{
	return peer_sk ? redirect_backlog((struct sock *)peer_sk) : 0;
}

/* dir[] index of a role. */
static __always_inline __u32 dir_index(__u32 role)
{
	return role == MW_ROLE_ACTIVE ? 0 : 1;
}

/* References on sk's psock (0 without one): mw_sock_hash holds one, each running sendmsg/recvmsg one. */
static __always_inline __u32 psock_refs(struct sock *sk)
{
	struct sk_psock *psock = psock_of(sk);

	return psock ? BPF_CORE_READ(psock, refcnt.refs.counter) : 0;
}

/*
 * Nothing the peer redirected can still be on its way to us, nor come later:
 * its direction is on TCP (its sk_msg program passes from now on) and no
 * sendmsg of it that decided to redirect is still running. NEVER: it never
 * redirected; DRAINED: it switched when nothing of it was in flight. Else
 * every tcp_bpf sendmsg holds a reference on its psock from start to end
 * (redirect included), so a psock that is gone, or held by mw_sock_hash
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

static __always_inline void stop_leave_checks(struct bpf_sock_ops *skops, __u32 cb_flags)
{
	__u32 mask = BPF_SOCK_OPS_WRITE_HDR_OPT_CB_FLAG | BPF_SOCK_OPS_PARSE_ALL_HDR_OPT_CB_FLAG;

	if (cb_flags & mask)
		bpf_sock_ops_cb_flags_set(skops, cb_flags & ~mask);
}

/*
 * HDR_OPT_LEN_CB (the socket sends a TCP packet) and PARSE_HDR_OPT_CB (it
 * received one; the callback runs before the segment's bytes are queued). A
 * socket that will not (or no longer) redirect leaves mw_sock_hash, which
 * restores the plain TCP socket (tcp_sendmsg, native FIONREAD, PEEK,
 * SO_PEEK_OFF ...), once that cannot lose or reorder a byte:
 *  - its connection is PASSTHROUGH: it never was a redirect target;
 *  - PENDING and a segment arrives (the active side only is in the hash):
 *    the peer sends by TCP, so it is no local peer of ours: PASSTHROUGH;
 *  - PAIRED and gone to TCP: the peer will never redirect to it again
 *    (peer_quiet), its own redirect queue is empty (the kernel frees what is
 *    queued when the psock goes), and its own direction is drained.
 * Receiving, it leaves before the first TCP byte lands, so a reader never
 * sees two queues. Until then it asks again with the next packet either
 * way. Sockets with nothing left to decide stop the callbacks.
 */
static __always_inline void on_leave_check(struct bpf_sock_ops *skops, struct bpf_sock *sk, __u32 cb_flags,
					   bool receiving)
{
	struct mw_sk_state *st = bpf_sk_storage_get(&mw_sk_store, sk, 0, 0);
	struct mw_sock_key key;
	struct mw_counters *cnt;
	struct tcp_sock *tp;
	struct mw_conn *c;
	__u32 me, reason;

	if (!st || st->left || !st->role)
		goto done;
	c = bpf_map_lookup_elem(&mw_conns, &st->peer.conn);
	if (!c)
		goto done; /* the active side closed: nothing is redirected to us any more */
	if (c->state == MW_CONN_PENDING && receiving)
		conn_passthrough(c, MW_REASON_NO_PEER);
	key = st->peer;
	key.role = st->role;
	if (c->state == MW_CONN_PASSTHROUGH) {
		remove_socket(&key, c->reason);
		goto done;
	}
	if (c->state != MW_CONN_PAIRED || !c->to_tcp)
		return;
	me = dir_index(st->role);
	if (!peer_quiet(c, 1 - me))
		return;
	tp = bpf_skc_to_tcp_sock(sk);
	if (!tp || redirect_backlog((struct sock *)tp))
		return;
	/* Sending, our own sendmsg holds a reference; receiving in softirq, none does. */
	if (!own_dir_drained(c, me, (struct sock *)tp, receiving ? 1 : 2))
		return;
	c->dir[me] = MW_DIR_DRAINED;
	reason = c->to_tcp_reason;
	if (bpf_map_delete_elem(&mw_sock_hash, &key) == 0) {
		cnt = counters();
		if (cnt) {
			cnt->sockets_left++;
			if (reason < MW_REASON_MAX)
				cnt->sockets_removed[reason]++;
		}
	}
	st->left = 1;
	st->paired = 0;
done:
	stop_leave_checks(skops, cb_flags);
}

static __always_inline void on_close(struct bpf_sock *sk)
{
	struct mw_sk_state *st = bpf_sk_storage_get(&mw_sk_store, sk, 0, 0);
	struct mw_counters *cnt;
	bool was_paired;

	if (!st)
		return;
	/* Not the current decision: it turns to PASSTHROUGH once the peer has closed. */
	was_paired = st->paired;
	if (st->owns_conn) {
		struct mw_conn_id id = st->peer.conn;
		struct mw_conn *c = bpf_map_lookup_elem(&mw_conns, &id);

		/* The active side may never have sent, so it may not know yet. */
		if (c && c->state == MW_CONN_PAIRED && !st->left)
			was_paired = true;
		if (c)
			obs_conn_end(sk, c);
		/* Deleting the entry also cancels its timer. */
		bpf_map_delete_elem(&mw_conns, &id);
		st->owns_conn = 0;
	}
	if (was_paired) {
		cnt = counters();
		if (cnt)
			cnt->sockets_closed++;
	}
	st->decision = MW_CONN_PASSTHROUGH;
	st->reason = MW_REASON_PEER_CLOSED;
	/* Counted once: a socket reconnected after connect(AF_UNSPEC) closes again. */
	st->paired = 0;
}

SEC("sockops")
int mw_sockops(struct bpf_sock_ops *skops)
{
	/* Read every ctx field up front (see sockops_tuple). */
	__u32 op = skops->op;
	__u32 old_state = skops->args[0];
	__u32 new_state = skops->args[1];
	__u32 snd_nxt = skops->snd_nxt;
	__u32 rcv_nxt = skops->rcv_nxt;
	__u32 cb_flags = skops->bpf_sock_ops_cb_flags;
	struct bpf_sock *sk = skops->sk;

	/*
	 * RWND_INIT runs for a listener's request socket (sk is NULL: not a full
	 * socket), and also for a connecting socket (tcp_connect_init), which is
	 * not a SYN being answered. Never set reply.
	 */
	if (op == BPF_SOCK_OPS_RWND_INIT) {
		if (!sk && accelerate)
			on_syn(skops);
		return 1;
	}
	if (!sk)
		return 1;
	/* Observation first: it may add STATE_CB to the flags the rest sets. */
	switch (op) {
	case BPF_SOCK_OPS_TCP_CONNECT_CB:
		cb_flags = obs_start(skops, sk, true, cb_flags);
		if (accelerate)
			on_connect(skops, cb_flags);
		break;
	case BPF_SOCK_OPS_ACTIVE_ESTABLISHED_CB:
		obs_established(skops, sk);
		if (accelerate)
			on_active_established(skops, sk, snd_nxt, rcv_nxt, cb_flags);
		break;
	case BPF_SOCK_OPS_PASSIVE_ESTABLISHED_CB:
		cb_flags = obs_start(skops, sk, false, cb_flags);
		if (accelerate)
			on_passive_established(skops, sk, snd_nxt, rcv_nxt, cb_flags);
		break;
	case BPF_SOCK_OPS_HDR_OPT_LEN_CB:
		on_leave_check(skops, sk, cb_flags, false);
		break;
	case BPF_SOCK_OPS_PARSE_HDR_OPT_CB:
		on_leave_check(skops, sk, cb_flags, true);
		break;
	case BPF_SOCK_OPS_STATE_CB:
		if (new_state != BPF_TCP_CLOSE)
			break;
		if (old_state == BPF_TCP_SYN_SENT) {
			if (accelerate)
				on_connect_failed(skops);
		} else {
			on_close(sk);
		}
		if (observe)
			obs_end(sk, old_state);
		break;
	}
	return 1;
}

/* Decide once per socket, on its first message; cache the answer in sk_storage. */
static __always_inline void decide(struct mw_sk_state *st, struct bpf_sock *sk)
{
	struct mw_conn_id id = st->peer.conn;
	struct mw_conn *c = bpf_map_lookup_elem(&mw_conns, &id);
	struct tcp_sock *tp;

	/*
	 * A write that entered sendmsg before this socket joined mw_sock_hash
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
		return;
	}
	st->decision = MW_CONN_PASSTHROUGH;
	st->reason = c->reason;
}

#ifdef MW_TAP
/*
 * The tap (built only into bpf/tap/tap.bpf.c's object): `meshwarp tap`
 * swaps mw_skmsg_tap into the sk_msg link while it runs and swaps mw_skmsg
 * back, so the agent's program never pays for it. Its settings are
 * constants of the tap's own load.
 */
const volatile __u32 tap_snaplen;
const volatile __u32 tap_port;  /* 0: every port; else one end's port */
const volatile __u64 tap_netns; /* 0: every namespace; else the sender's netns cookie */

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
	struct mw_conn_id id = st->peer.conn;
	struct mw_conn *c;
	bool active = st->role == MW_ROLE_ACTIVE;

	if (!ts || !b)
		return;
	if (tap_netns && bpf_get_netns_cookie(msg) != tap_netns)
		return;
	/* One tuple per connection: the connecting side's view. */
	c = bpf_map_lookup_elem(&mw_conns, &id);
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
#else
static __always_inline void tap_record(struct sk_msg_md *msg, struct mw_sk_state *st, __u32 size) {}
#endif

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
 * This side's direction continues on TCP (dir: DRAINED, or TCP when bytes
 * may still be unread or on their way), and with it the whole connection:
 * a peer that never redirected never will (NEVER). Order holds either way:
 * the receiver reads its redirect queue (tcp_bpf_recvmsg) before its TCP
 * queue, and a write that returned had its redirect queued.
 */
static __always_inline void to_tcp(struct mw_sk_state *st, struct mw_conn *c, __u32 reason, __u32 dir)
{
	__u32 me = dir_index(st->role);

	request_tcp(c, reason);
	st->decision = MW_CONN_PASSTHROUGH;
	st->reason = c->to_tcp_reason;
	__sync_val_compare_and_swap(&c->dir[me], MW_DIR_REDIRECT, dir);
	__sync_val_compare_and_swap(&c->dir[1 - me], MW_DIR_UNDECIDED, MW_DIR_NEVER);
}

/*
 * Whether this side may move its direction to TCP now without any reader
 * seeing two queues: both redirect queues are empty (the peer read all we
 * sent, we read all it sent) and no other sendmsg of ours is on its way
 * (own_dir_drained). Then each socket leaves mw_sock_hash at its first TCP
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
 * Whether this message ends a small-message stream: stream_run_msgs messages
 * since the peer last sent, averaging below the path's threshold.
 */
static __always_inline bool small_stream(struct mw_sk_state *st, struct mw_conn *c, __u32 size)
{
	__u32 threshold;

	if (c->last_sender != st->role) {
		c->last_sender = st->role;
		st->run_msgs = 0;
		st->run_bytes = 0;
	}
	st->run_msgs++;
	st->run_bytes += size;
	if (!stream_run_msgs || st->run_msgs < stream_run_msgs)
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
	st = bpf_sk_storage_get(&mw_sk_store, sk, 0, 0);
	if (!st)
		return SK_PASS;
	if (!st->decision)
		decide(st, sk);

	cnt = counters();
	if (st->decision == MW_CONN_PAIRED) {
		__u32 hop = st->hop;
		__u32 state = sk->state;

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
		 * receiver has more than redirect_budget_bytes unread, this
		 * direction continues on TCP for good, whose flow control then
		 * blocks the writer. Order holds as in to_tcp.
		 */
		c = bpf_map_lookup_elem(&mw_conns, &st->peer.conn);
		if (c && !c->to_tcp && small_stream(st, c, size))
			request_tcp(c, MW_REASON_SMALL_STREAM);
		if (c && c->to_tcp && switch_point(c, st, sk)) {
			/* Asked by either side; until a switch point, keep redirecting. */
			to_tcp(st, c, c->to_tcp_reason, MW_DIR_DRAINED);
		} else if (peer_backlog(st->peer_sk) + size > redirect_budget_bytes) {
			/*
			 * A one-way stream (the peer never redirected) goes to TCP as a
			 * whole, so that its sockets can leave (unless streams are to
			 * stay redirected: stream_run_msgs 0); else this direction
			 * only: the other one may well stay fast.
			 */
			if (stream_run_msgs && c && c->dir[1 - dir_index(st->role)] == MW_DIR_UNDECIDED) {
				to_tcp(st, c, MW_REASON_BACKPRESSURE, MW_DIR_TCP);
			} else {
				st->decision = MW_CONN_PASSTHROUGH;
				st->reason = MW_REASON_BACKPRESSURE;
				count_conn(MW_REASON_BACKPRESSURE);
				if (c)
					__sync_val_compare_and_swap(&c->dir[dir_index(st->role)], MW_DIR_REDIRECT,
								    MW_DIR_TCP);
			}
		} else if (bpf_msg_redirect_hash(msg, &mw_sock_hash, &st->peer, BPF_F_INGRESS) == SK_PASS) {
			if (tap)
				tap_record(msg, st, size);
			if (observe && c)
				obs_msg(msg, st, c, size);
			st->sent += size;
			if (cnt) {
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

SEC("sk_msg")
int mw_skmsg(struct sk_msg_md *msg)
{
	return skmsg(msg, false);
}

#ifdef MW_TAP
SEC("sk_msg")
int mw_skmsg_tap(struct sk_msg_md *msg)
{
	return skmsg(msg, true);
}
#endif

#include "watches.h"
