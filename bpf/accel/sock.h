/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * What the programs read from a socket: the endpoints a context reports
 * (sock_ops, sk_msg and bpf_sock name them alike), the owner's uid, the
 * socket's psock (the redirect queue, through CO-RE), the sock_ops
 * callbacks a socket asks for, and where a cgroup_skb segment's TCP header
 * is. Attaches to nothing; pairing, the redirect, observation, the tap,
 * learning and the FIN order use it.
 */
#ifndef MESHWARP_SOCK_H
#define MESHWARP_SOCK_H

/* SK_USER_DATA_NOCOPY | SK_USER_DATA_BPF | SK_USER_DATA_PSOCK (include/net/sock.h) */
#define MW_SK_USER_DATA_FLAGS 7
#define MW_SK_USER_DATA_PSOCK 4

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

static __always_inline bool addrs_eq(const __u32 a[4], const __u32 b[4])
{
	return a[0] == b[0] && a[1] == b[1] && a[2] == b[2] && a[3] == b[3];
}

static __always_inline bool addr_eq(const struct mw_endpoint *a, const struct mw_endpoint *b)
{
	return addrs_eq(a->addr, b->addr);
}

/* The uid owning the socket (the process that created it), via BTF. */
static __always_inline __u32 socket_uid(struct tcp_sock *tp)
{
	if (!tp)
		return (__u32)-1;
	return tp->inet_conn.icsk_inet.sk.sk_uid.val;
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
 * For a socket in mw_sock_map: STATE_CB (the close), and a callback for
 * each TCP packet the socket sends (WRITE_HDR_OPT_CB: HDR_OPT_LEN_CB) or
 * receives (PARSE_ALL_HDR_OPT_CB: PARSE_HDR_OPT_CB), where it leaves
 * mw_sock_map once it will not redirect any more (on_leave_check). A paired
 * connection sends and receives no TCP packets while it redirects, so this
 * costs nothing until then.
 */
#define MW_LEAVE_CHECK_FLAGS (BPF_SOCK_OPS_WRITE_HDR_OPT_CB_FLAG | BPF_SOCK_OPS_PARSE_ALL_HDR_OPT_CB_FLAG)
#define MW_CB_FLAGS (BPF_SOCK_OPS_STATE_CB_FLAG | MW_LEAVE_CHECK_FLAGS)

static __always_inline void want_callbacks(struct bpf_sock_ops *skops, __u32 flags)
{
	if ((flags & MW_CB_FLAGS) != MW_CB_FLAGS)
		bpf_sock_ops_cb_flags_set(skops, flags | MW_CB_FLAGS);
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

/* Whether the socket at kernel address sk (0: none) has a psock: it is in a SOCKMAP (maps.h, conn_free). */
static __always_inline bool sock_linked(__u64 sk)
{
	return sk && psock_of((struct sock *)sk);
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

/* tcp_mem[0] and [1] (pages) as last read, and when (coarse clock): the sysctl rarely changes. */
#define MW_TCP_MEM_REREAD_NS (100 * 1000 * 1000ULL)
static long tcp_mem_low_pages;
static long tcp_mem_pressure_pages;
static __u64 tcp_mem_read_ns;
/*
 * The node's TCP memory (pages, low 32 bits) as a message read it, and in
 * which tick (high 32 bits: the jiffies' low half): one word, so that no
 * CPU pairs a tick with another tick's reading.
 */
static __u64 tcp_mem_seen;
/* A CPU reads the node's counter at least once per 64 KiB it redirects (tcp_memory_tight). */
#define MW_MEM_CHECK_SHIFT 16
/*
 * What one CPU's redirects may have added to the node's TCP memory since
 * the last reading: under 64 KiB without a reading, and the message
 * charged just after one (at most MAX_SKB_FRAGS, up to 45, page fragments
 * of up to 32 KiB: 1.4 MiB). 2 MiB in pages.
 */
#define MW_MEM_UNSEEN_PAGES_PER_CPU 512

/*
 * Whether the redirect's receive charge (bpf_tcp_ingress on the receiver:
 * sk_wmem_schedule, or __sk_rmem_schedule from 6.13 and in later stable
 * kernels, 6.1.192 among them) may fail with size more bytes, where TCP
 * would make the writer wait: the writer would get ENOMEM. A memory
 * cgroup's refusal is not seen here (a limitation). __sk_mem_raise_allocated grants
 * every charge while the node's TCP memory, with the per-CPU reserves it
 * may not show yet (tcp_mem_slack_pages), is at most tcp_mem[0]; from
 * tcp_mem[1] on it may refuse; in between it may refuse while the node is
 * in TCP memory pressure (the flag set when the memory crossed tcp_mem[1],
 * or an allocation failed, and cleared only under tcp_mem[0]). All TCP
 * sockets share one account (tcp_prot and tcpv6_prot alike), read here
 * through the writer's own socket (BTF loads); the flag is read only above
 * tcp_mem[0].
 *
 * Well below tcp_mem[0] the answer is no without a look (about 25 ns less
 * per message where returns are mitigated: docs/BENCHMARKS.md section 48):
 * a message of under 64 KiB that does not take its CPU's redirected bytes
 * (cnt, this CPU's counters) past a 64 KiB boundary uses this tick's
 * reading, if the node's TCP memory then, the per-CPU reserves, and what
 * every CPU's redirects may have added unseen since
 * (MW_MEM_UNSEEN_PAGES_PER_CPU) stay under three quarters of tcp_mem[0]:
 * the last quarter is for what plain TCP may add within the tick (a
 * quarter of tcp_mem[0] is RAM / 85 with the defaults: 48 MB in 4 ms on a
 * 4 GB node). Otherwise, and for a CPU's first message in a tick, it reads
 * the node's counter: no helper call, and none of the counter's line,
 * which every CPU's TCP writes, on most messages.
 */
static __always_inline bool tcp_memory_tight(struct bpf_sock *sk, __u32 size, __u64 now, const struct mw_counters *cnt)
{
	unsigned long *pressure, flag = 0;
	long *limits, limit[2], pages;
	__u32 tick = (__u32)bpf_jiffies64();
	__u64 seen = tcp_mem_seen;
	struct tcp_sock *tp;
	struct proto *prot;

	if (cnt && (__u32)(seen >> 32) == tick && size < (1u << MW_MEM_CHECK_SHIFT) &&
	    (cnt->redirected_bytes + size) >> MW_MEM_CHECK_SHIFT == cnt->redirected_bytes >> MW_MEM_CHECK_SHIFT &&
	    (long)(__u32)seen + tcp_mem_slack_pages + (long)possible_cpus * MW_MEM_UNSEEN_PAGES_PER_CPU <=
		    tcp_mem_low_pages - (tcp_mem_low_pages >> 2))
		return false;
	tp = bpf_skc_to_tcp_sock(sk);
	if (!tp)
		return false;
	prot = tp->inet_conn.icsk_inet.sk.__sk_common.skc_prot;
	if (now - tcp_mem_read_ns > MW_TCP_MEM_REREAD_NS) {
		limits = BPF_CORE_READ(prot, sysctl_mem);
		if (limits && !bpf_core_read(limit, sizeof(limit), limits)) {
			tcp_mem_low_pages = limit[0];
			tcp_mem_pressure_pages = limit[1];
			tcp_mem_read_ns = now;
		}
	}
	if (!tcp_mem_pressure_pages)
		return false;
	/* size in 4 KiB pages: an overestimate where pages are larger */
	pages = prot->memory_allocated->counter;
	tcp_mem_seen = (__u64)tick << 32 | (pages >= 0 && pages < 0xffffffffL ? (__u32)pages : 0xffffffff);
	pages += (size >> 12) + 1 + tcp_mem_slack_pages;
	if (pages >= tcp_mem_pressure_pages)
		return true;
	if (pages <= tcp_mem_low_pages)
		return false;
	pressure = BPF_CORE_READ(prot, memory_pressure);
	return pressure && !bpf_core_read(&flag, sizeof(flag), pressure) && flag;
}

/* dir[] index of a role. */
static __always_inline __u32 dir_index(__u32 role)
{
	return role == MW_ROLE_ACTIVE ? 0 : 1;
}

/* References on sk's psock (0 without one): mw_sock_map holds one, each running sendmsg/recvmsg one. */
static __always_inline __u32 psock_refs(struct sock *sk)
{
	struct sk_psock *psock = psock_of(sk);

	return psock ? BPF_CORE_READ(psock, refcnt.refs.counter) : 0;
}

/*
 * The TCP header of a TCP socket's segment as cgroup_skb sees it (skb->data
 * is the network header, in the linear part) and its offset, or NULL when
 * its fixed 20 bytes are not there. By the packet's version: a dual-stack
 * socket carries IPv4 too.
 */
static __always_inline void *skb_tcp_header(struct __sk_buff *skb, __u32 *off)
{
	void *data = (void *)(long)skb->data, *data_end = (void *)(long)skb->data_end;
	__u32 o;
	__u8 b0;

	if (data + 1 > data_end)
		return NULL;
	b0 = *(__u8 *)data;
	if (b0 >> 4 == 4)
		o = (b0 & 0xf) * 4;
	else
		o = 40; /* a TCP socket's own segments carry no extension headers */
	o &= 0x3f;
	if (data + o + 20 > data_end)
		return NULL;
	*off = o;
	return data + o;
}

#endif /* MESHWARP_SOCK_H */
