// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
/*
 * Cross-node forwarding: pod packets between nodes skip the node's bridge,
 * netfilter and routing code, with the node's own routing decision.
 *
 * Attach points (tcx ingress, appended after other programs; "pass" is
 * TCX_NEXT so programs after ours still run):
 *   mw_xn_from_pod  on every pod-facing device (a veth that is a port of a
 *                   bridge in the node namespace).
 *   mw_xn_from_wire on every uplink (the device towards other nodes).
 * From a pod: a frame addressed to the node (the bridge's MAC) whose FIB
 * lookup (from the bridge, as the kernel would route it) leaves by an uplink
 * goes straight to that uplink: bpf_redirect with the resolved neighbour, or
 * bpf_redirect_neigh when the kernel has not resolved it yet.
 * From the wire: a frame addressed to the uplink whose FIB lookup leaves by a
 * pod bridge, to a neighbour the kernel resolved, goes straight into the pod
 * with bpf_redirect_peer, to the port the bridge would have chosen: the
 * port this program saw that MAC send from (mw_xn_macs, learned like the
 * bridge's forwarding database).
 * Both decrement the TTL / hop limit as forwarding does. Everything else
 * passes to the normal path, counted by reason (enum mw_xn_reason).
 *
 * Netfilter: the agent checks the node namespace's rulesets and turns a
 * family off (mw_xn_nodes) while any rule or policy sits where forwarded
 * packets would meet it; the pods' own rules (Istio's capture) run as before,
 * the programs never touch the pods' namespaces.
 *
 * Maps (pinned by name next to the agent's):
 *   mw_xn_devs   HASH      mw_xn_dev_key  -> mw_xn_dev   the devices the agent manages
 *   mw_xn_nodes  HASH      netns cookie   -> mw_xn_node  per node: families on
 *   mw_xn_macs   LRU_HASH  mw_xn_mac_key  -> port ifindex learned from pods
 *   mw_xn_stats  PERCPU_ARRAY            mw_xn_counters
 */
#include "vmlinux.h"
#include "bpf_helpers.h"
#include "bpf_endian.h"
#include "bpf_core_read.h"

char LICENSE[] SEC("license") = "Dual BSD/GPL";

#define ETH_HLEN 14
#define ETH_P_IP 0x0800
#define ETH_P_IPV6 0x86DD
#define AF_INET 2
#define AF_INET6 10
#define IP_MF 0x2000
#define IP_OFFSET 0x1FFF
#define TCX_NEXT -1
#define IPPROTO_ICMPV6 58

enum mw_xn_kind {
	MW_XN_KIND_POD = 1,    /* a bridge port towards a pod */
	MW_XN_KIND_UPLINK = 2, /* towards other nodes */
	MW_XN_KIND_BRIDGE = 3, /* the bridge pods hang off */
};

/* Why a packet was left to the normal path. Go reads the names from BTF. */
enum mw_xn_reason {
	MW_XN_REASON_NONE = 0,
	MW_XN_REASON_NOT_IP,         /* ARP, LLDP, ... */
	MW_XN_REASON_NOT_ROUTED,     /* not addressed to the node's MAC: switched, not routed */
	MW_XN_REASON_FRAGMENT,       /* IP fragments are reassembled or forwarded by the kernel */
	MW_XN_REASON_IP_OPTIONS,     /* IPv4 options, IPv6 extension headers */
	MW_XN_REASON_TTL,            /* TTL / hop limit would expire: the kernel answers ICMP */
	MW_XN_REASON_NETFILTER,      /* the node has rules forwarded packets would meet */
	MW_XN_REASON_UNVERIFIED,     /* no agent checked the node lately (stopped or killed) */
	MW_XN_REASON_NOT_CROSS_NODE, /* to the node itself, or not between a pod and an uplink */
	MW_XN_REASON_UNROUTABLE,     /* no route, blackhole, prohibit: the kernel answers */
	MW_XN_REASON_MTU,            /* larger than the egress MTU: the kernel fragments or answers */
	MW_XN_REASON_NO_NEIGHBOUR,   /* towards a pod the kernel has not resolved yet */
	MW_XN_REASON_UNKNOWN_POD,    /* the pod's MAC has not been seen on a port yet */
	MW_XN_REASON_FIB_OTHER,      /* any other FIB answer (forwarding off, ...) */
	MW_XN_REASON_MALFORMED,      /* headers shorter than they claim */
	MW_XN_REASON_MAX,
};

enum mw_xn_dir {
	MW_XN_DIR_TO_WIRE = 0, /* from a local pod to another node */
	MW_XN_DIR_TO_POD = 1,  /* from another node into a local pod */
	MW_XN_DIR_MAX,
};

struct mw_xn_dev_key {
	__u64 netns_cookie;
	__u32 ifindex;
	__u32 pad;
};

struct mw_xn_dev {
	__u32 kind;       /* enum mw_xn_kind */
	__u32 l3_ifindex; /* pod port: its bridge, where the kernel routes from */
	__u8 mac[6];      /* pod port: its bridge's MAC; uplink, bridge: its own */
	__u8 pad[2];
};

/*
 * Families redirection is on for in a node (netfilter allows it), as the
 * agent last checked. Its word is good until valid_until_ns (monotonic
 * clock): an agent that stops checking stops the redirect.
 */
#define MW_XN_NODE_V4 1
#define MW_XN_NODE_V6 2
struct mw_xn_node {
	__u32 flags;
	__u32 pad;
	__u64 valid_until_ns;
	/*
	 * The netfilter hook lists the agent's check was made against
	 * (nf_hooks_ident, [0] IPv4, [1] IPv6): a packet that meets others
	 * takes the normal path.
	 */
	__u32 hooks[2];
};

/*
 * What a netfilter hook function does with its priv, for the hook functions
 * the agent found in /proc/kallsyms (mw_xn_hookfns): which memory changes
 * when the rules behind the hook change.
 */
enum mw_xn_hookfn {
	MW_XN_HOOKFN_UNKNOWN = 0,
	MW_XN_HOOKFN_NFT_CHAIN = 1, /* nf_tables: priv is a base chain; its rule blobs and policy */
	MW_XN_HOOKFN_XT_TABLE = 2,  /* x_tables: priv is the table; its rules (private) */
	MW_XN_HOOKFN_NAT = 3,       /* nf_nat: priv holds a nested hook list of NAT chains or tables */
};

struct mw_xn_mac_key {
	__u64 netns_cookie;
	__u8 mac[6];
	__u8 pad[2];
};

struct mw_xn_counters {
	__u64 redirected_packets[MW_XN_DIR_MAX];
	__u64 redirected_bytes[MW_XN_DIR_MAX];
	__u64 neigh_redirects; /* of the to_wire packets: neighbour resolved by bpf_redirect_neigh */
	__u64 passed[MW_XN_REASON_MAX];
};

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 4096);
	__type(key, struct mw_xn_dev_key);
	__type(value, struct mw_xn_dev);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} mw_xn_devs SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 64);
	__type(key, __u64);
	__type(value, struct mw_xn_node);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} mw_xn_nodes SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 16384);
	__type(key, struct mw_xn_mac_key);
	__type(value, __u32);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} mw_xn_macs SEC(".maps");

/* Hook function address -> enum mw_xn_hookfn, filled by the agent at start. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 64);
	__type(key, __u64);
	__type(value, __u32);
} mw_xn_hookfns SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct mw_xn_counters);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} mw_xn_stats SEC(".maps");

/*
 * skb->data and skb->data_end, loaded straight from the context: clang may
 * otherwise compute &skb->data_end once and dereference it later, which the
 * verifier refuses ("dereference of modified ctx ptr").
 */
#define SKB_PTR(skb, field)                                                              \
	({                                                                                 \
		__u64 _v;                                                                  \
		asm volatile("%0 = *(u32 *)(%1 + %2)"                                      \
			     : "=r"(_v)                                                    \
			     : "r"(skb), "i"(__builtin_offsetof(struct __sk_buff, field))); \
		(void *)(long)_v;                                                          \
	})

/* Keep the enums in BTF for bpf2go and for the names Go reads. */
const enum mw_xn_reason mw_xn_reason_unused __attribute__((unused));
const enum mw_xn_dir mw_xn_dir_unused __attribute__((unused));
const enum mw_xn_kind mw_xn_kind_unused __attribute__((unused));
const enum mw_xn_hookfn mw_xn_hookfn_unused __attribute__((unused));

extern void *bpf_cast_to_kern_ctx(void *obj) __ksym;

/*
 * The cookie of the namespace the packet's device lives in: the node. (The
 * helper bpf_get_netns_cookie reads the packet's socket, which a packet
 * coming out of a pod no longer has.)
 */
static __always_inline __u64 dev_netns_cookie(struct __sk_buff *ctx)
{
	struct sk_buff *skb = bpf_cast_to_kern_ctx(ctx);
	return skb->dev->nd_net.net->net_cookie;
}

static __always_inline struct mw_xn_counters *counters(void)
{
	__u32 zero = 0;
	return bpf_map_lookup_elem(&mw_xn_stats, &zero);
}

static __always_inline int pass(enum mw_xn_reason r)
{
	struct mw_xn_counters *c = counters();
	if (c && r < MW_XN_REASON_MAX)
		c->passed[r]++;
	return TCX_NEXT;
}

static __always_inline void count_redirect(enum mw_xn_dir d, __u32 len, int neigh)
{
	struct mw_xn_counters *c = counters();
	if (!c || d >= MW_XN_DIR_MAX)
		return;
	c->redirected_packets[d]++;
	c->redirected_bytes[d] += len;
	if (neigh)
		c->neigh_redirects++;
}

static __always_inline int mac_eq(const __u8 *a, const __u8 *b)
{
	return *(const __u32 *)a == *(const __u32 *)b && *(const __u16 *)(a + 4) == *(const __u16 *)(b + 4);
}

/* The L3 view of a packet both directions need. */
struct pkt {
	__u16 proto; /* ETH_P_IP or ETH_P_IPV6, host order */
	__u32 len;
};

/*
 * check_ip: the packet is IP without options, fragments or an expiring TTL,
 * and its headers are in the linear area. Fills the FIB query's L3 fields.
 * Returns MW_XN_REASON_NONE or why not.
 */
static __always_inline enum mw_xn_reason check_ip(struct __sk_buff *skb, struct pkt *p, struct bpf_fib_lookup *fib)
{
	void *data = SKB_PTR(skb, data), *end = SKB_PTR(skb, data_end);
	struct ethhdr *eth = data;

	if ((void *)(eth + 1) > end)
		return MW_XN_REASON_MALFORMED;
	p->proto = bpf_ntohs(eth->h_proto);
	p->len = skb->len;
	if (p->proto == ETH_P_IP) {
		struct iphdr *ip = (void *)(eth + 1);
		if ((void *)(ip + 1) > end)
			return MW_XN_REASON_MALFORMED;
		if (ip->ihl != 5 || ip->version != 4)
			return MW_XN_REASON_IP_OPTIONS;
		if (ip->frag_off & bpf_htons(IP_MF | IP_OFFSET))
			return MW_XN_REASON_FRAGMENT;
		if (ip->ttl <= 1)
			return MW_XN_REASON_TTL;
		fib->family = AF_INET;
		fib->tos = ip->tos;
		fib->l4_protocol = ip->protocol;
		fib->ipv4_src = ip->saddr;
		fib->ipv4_dst = ip->daddr;
		return MW_XN_REASON_NONE;
	}
	if (p->proto == ETH_P_IPV6) {
		struct ipv6hdr *ip6 = (void *)(eth + 1);
		if ((void *)(ip6 + 1) > end)
			return MW_XN_REASON_MALFORMED;
		switch (ip6->nexthdr) {
		case IPPROTO_TCP:
		case IPPROTO_UDP:
		case IPPROTO_ICMPV6:
		case IPPROTO_SCTP:
			break;
		case 44: /* NEXTHDR_FRAGMENT */
			return MW_XN_REASON_FRAGMENT;
		default: /* hop-by-hop (the kernel must read it), routing, ... */
			return MW_XN_REASON_IP_OPTIONS;
		}
		if (ip6->hop_limit <= 1)
			return MW_XN_REASON_TTL;
		/* Link-local and multicast destinations are never forwarded. */
		if (ip6->daddr.in6_u.u6_addr8[0] == 0xff ||
		    (ip6->daddr.in6_u.u6_addr8[0] == 0xfe && (ip6->daddr.in6_u.u6_addr8[1] & 0xc0) == 0x80))
			return MW_XN_REASON_NOT_CROSS_NODE;
		fib->family = AF_INET6;
		fib->flowinfo = *(__be32 *)ip6 & bpf_htonl(0x0FFFFFFF);
		fib->l4_protocol = ip6->nexthdr;
		__builtin_memcpy(fib->ipv6_src, &ip6->saddr, 16);
		__builtin_memcpy(fib->ipv6_dst, &ip6->daddr, 16);
		return MW_XN_REASON_NONE;
	}
	return MW_XN_REASON_NOT_IP;
}

static __always_inline __u64 mix(__u64 h, __u64 v)
{
	return (h ^ v) * 0x9E3779B97F4A7C15ULL;
}

#define MW_XN_HOOK_ENTRIES 8
/* struct nf_hook_entries, as read: its count and first entries. */
struct mw_xn_hook_list {
	__u16 num;
	__u16 pad[3];
	struct {
		__u64 hook;
		__u64 priv;
	} e[MW_XN_HOOK_ENTRIES];
};
_Static_assert(__builtin_offsetof(struct nf_hook_entries, hooks) == 8, "nf_hook_entries layout");

/* Room to read hook lists in, per CPU: [0] a node's list, [1] a nested NAT list. */
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 2);
	__type(key, __u32);
	__type(value, struct mw_xn_hook_list);
} mw_xn_scratch SEC(".maps");

/* read_list: list's count and first entries into scratch slot, or NULL. */
static __always_inline struct mw_xn_hook_list *read_list(__u64 list, __u32 slot)
{
	struct mw_xn_hook_list *b = bpf_map_lookup_elem(&mw_xn_scratch, &slot);
	if (!b || !list || bpf_probe_read_kernel(b, sizeof(*b), (void *)list))
		return 0;
	if (b->num > MW_XN_HOOK_ENTRIES)
		b->num = MW_XN_HOOK_ENTRIES + 1; /* more than read: known by address and count */
	return b;
}

static __always_inline __u64 read_u64(const void *p)
{
	__u64 v = 0;
	bpf_probe_read_kernel(&v, sizeof(v), p);
	return v;
}

/*
 * mix_rules: the memory that changes when the rules behind one hook entry
 * change (committed nf_tables rules get a new blob; an x_tables replace, a
 * new private), for the hook functions the agent recognised.
 */
static __always_inline __u64 mix_rules(__u64 h, __u32 kind, __u64 priv, __u32 gen)
{
	/*
	 * The type checks keep the program loadable where nf_tables or
	 * x_tables are modules whose types the kernel's BTF lacks: the digest
	 * then covers the hook lists only.
	 */
	if (kind == MW_XN_HOOKFN_NFT_CHAIN && bpf_core_type_exists(struct nft_chain) &&
	    bpf_core_type_exists(struct nft_base_chain)) {
		/*
		 * The rules packets run now: the blob of the current generation
		 * (nft_do_chain). The other one changes at every later commit
		 * of any table, to catch up.
		 */
		struct nft_chain *c = (void *)priv;
		if (gen != 1)
			h = mix(h, read_u64(&c->blob_gen_0));
		if (gen != 0)
			h = mix(h, read_u64(&c->blob_gen_1));
		/* The policy lives in the nft_base_chain around the chain. */
		__u64 base = priv - bpf_core_field_offset(struct nft_base_chain, chain);
		__u8 policy = 0;
		bpf_probe_read_kernel(&policy, 1, (void *)(base + bpf_core_field_offset(struct nft_base_chain, policy)));
		h = mix(h, policy);
	} else if (kind == MW_XN_HOOKFN_XT_TABLE && bpf_core_type_exists(struct xt_table)) {
		struct xt_table *t = (void *)priv;
		h = mix(h, read_u64(&t->private));
	}
	return h;
}

static __always_inline __u32 hookfn_kind(__u64 fn)
{
	__u32 *k = bpf_map_lookup_elem(&mw_xn_hookfns, &fn);
	return k ? *k : MW_XN_HOOKFN_UNKNOWN;
}

static __noinline __u64 mix_nested(__u64 h, __u64 priv, __u32 gen);

/*
 * mix_entries: one hook list: which entries it has and, for the entries
 * whose function the agent recognised, the rules behind them (for nf_nat's
 * entries, its nested list, one level down: nested is then 1). A list with
 * more entries than read is known by its address, count and first entries.
 */
static __always_inline __u64 mix_entries(__u64 h, __u64 list, __u32 gen, const int nested)
{
	struct mw_xn_hook_list *b = read_list(list, nested);

	h = mix(h, list);
	if (!b)
		return h;
	h = mix(h, b->num);
	for (int i = 0; i < MW_XN_HOOK_ENTRIES; i++) {
		if (i >= b->num)
			break;
		__u64 fn = b->e[i].hook, priv = b->e[i].priv;
		h = mix(h, fn);
		h = mix(h, priv);
		__u32 kind = hookfn_kind(fn);
		if (!nested && kind == MW_XN_HOOKFN_NAT)
			h = mix_nested(h, priv, gen);
		else
			h = mix_rules(h, kind, priv, gen);
	}
	return h;
}

/* mix_nested: the NAT chains or tables nf_nat runs from one of its hooks. */
static __noinline __u64 mix_nested(__u64 h, __u64 priv, __u32 gen)
{
	if (!bpf_core_type_exists(struct nf_nat_lookup_hook_priv))
		return h;
	struct nf_nat_lookup_hook_priv *np = (void *)priv;
	return mix_entries(h, read_u64(&np->entries), gen, 1);
}

static __noinline __u64 mix_list(__u64 h, __u64 list, __u32 gen)
{
	return mix_entries(h, list, gen, 0);
}

/*
 * nf_hooks_ident: the netfilter a forwarded packet of the family meets in
 * the device's namespace (the node): the family's PRE_ROUTING, FORWARD and
 * POST_ROUTING hook lists with the rules behind their nf_tables chains and
 * x_tables tables (NAT ones too), and the bridge family's hook lists. The
 * kernel publishes a new list, blob or table when a table, chain, rule or
 * policy changes, before the command that changed it returns. So another
 * identity than the agent checked means the node's netfilter changed since:
 * the packet takes the normal path at once, not at the next check. What it
 * does not see (rules in existing bridge chains, netdev chains, hook
 * functions it does not know) the next check sees, a scan interval later.
 */
static __always_inline __u32 nf_hooks_ident(struct __sk_buff *ctx, __u16 proto)
{
	struct sk_buff *skb = bpf_cast_to_kern_ctx(ctx);
	struct net *net = skb->dev->nd_net.net;
	__u64 l3[5] = {}, br[5] = {};
	__u64 h = 0;

	if (proto == ETH_P_IP)
		bpf_probe_read_kernel(l3, sizeof(l3), &net->nf.hooks_ipv4);
	else
		bpf_probe_read_kernel(l3, sizeof(l3), &net->nf.hooks_ipv6);
	/* nf_tables' current generation; 2: unknown, both blobs count. */
	__u32 gen = 2;
	if (bpf_core_field_exists(net->nft.gencursor)) {
		__u8 g = 0;
		bpf_probe_read_kernel(&g, 1, &net->nft.gencursor);
		gen = g & 1;
	}
	h = mix_list(h, l3[NF_INET_PRE_ROUTING], gen);
	h = mix_list(h, l3[NF_INET_FORWARD], gen);
	h = mix_list(h, l3[NF_INET_POST_ROUTING], gen);
	if (bpf_core_field_exists(net->nf.hooks_bridge)) {
		bpf_probe_read_kernel(br, sizeof(br), &net->nf.hooks_bridge);
		for (int i = 0; i < 5; i++)
			h = mix(h, br[i]);
	}
	return (__u32)(h ^ (h >> 32));
}

/*
 * node_check: netfilter leaves this family to us in this node, as checked
 * lately, and its hook lists are the ones checked.
 */
static __always_inline enum mw_xn_reason node_check(struct __sk_buff *skb, __u64 cookie, __u16 proto)
{
	struct mw_xn_node *n = bpf_map_lookup_elem(&mw_xn_nodes, &cookie);
	if (!n || bpf_ktime_get_ns() > n->valid_until_ns)
		return MW_XN_REASON_UNVERIFIED;
	__u32 bit = MW_XN_NODE_V4, checked = n->hooks[0];
	if (proto != ETH_P_IP) {
		bit = MW_XN_NODE_V6;
		checked = n->hooks[1];
	}
	if (!(n->flags & bit) || nf_hooks_ident(skb, proto) != checked)
		return MW_XN_REASON_NETFILTER;
	return MW_XN_REASON_NONE;
}

/*
 * fits: the packet fits the egress device's MTU as forwarding checks it
 * (ip_exceeds_mtu): a GSO packet by its segments, which bpf_fib_lookup
 * does not check (is_skb_forwardable lets any GSO packet through). One that
 * does not fit takes the normal path, where the kernel answers with
 * "fragmentation needed" / "packet too big" and path MTU discovery works.
 */
static __always_inline int fits(struct __sk_buff *skb, __u32 ifindex)
{
	__u32 mtu = 0;
	return bpf_check_mtu(skb, ifindex, &mtu, 0, BPF_MTU_CHK_SEGS) == BPF_MTU_CHK_RET_SUCCESS;
}

static __always_inline enum mw_xn_reason fib_reason(long rc)
{
	switch (rc) {
	case BPF_FIB_LKUP_RET_NOT_FWDED:
		return MW_XN_REASON_NOT_CROSS_NODE;
	case BPF_FIB_LKUP_RET_BLACKHOLE:
	case BPF_FIB_LKUP_RET_UNREACHABLE:
	case BPF_FIB_LKUP_RET_PROHIBIT:
		return MW_XN_REASON_UNROUTABLE;
	case BPF_FIB_LKUP_RET_FRAG_NEEDED:
		return MW_XN_REASON_MTU;
	default:
		return MW_XN_REASON_FIB_OTHER;
	}
}

/*
 * forward_headers: what the kernel's forwarding does to the headers: TTL or
 * hop limit down by one and, with dmac set, the new Ethernet addresses.
 * IPv4: the checksum moves by as much as the TTL (ip_decrease_ttl), so the
 * packet's one's complement sum, and a CHECKSUM_COMPLETE skb->csum, stay
 * right. IPv6 has no header checksum: the hop limit is stored with
 * BPF_F_RECOMPUTE_CSUM so that a CHECKSUM_COMPLETE skb->csum (a NIC's)
 * follows it (the kernel's forwarding drops COMPLETE instead; the receiver
 * would otherwise reject the TCP checksum). The Ethernet header is outside
 * skb->csum. Called after the last helper that may move packet data.
 */
static __always_inline int forward_headers(struct __sk_buff *skb, __u16 proto, const __u8 *dmac, const __u8 *smac)
{
	void *data = SKB_PTR(skb, data), *end = SKB_PTR(skb, data_end);
	struct ethhdr *eth = data;

	if ((void *)(eth + 1) > end)
		return -1;
	if (proto == ETH_P_IP) {
		struct iphdr *ip = (void *)(eth + 1);
		if ((void *)(ip + 1) > end)
			return -1;
		__u32 check = ip->check;
		check += bpf_htons(0x0100);
		ip->check = (__sum16)(check + (check >= 0xFFFF));
		ip->ttl--;
	} else {
		struct ipv6hdr *ip6 = (void *)(eth + 1);
		if ((void *)(ip6 + 1) > end)
			return -1;
		__u8 hl = ip6->hop_limit - 1;
		if (bpf_skb_store_bytes(skb, ETH_HLEN + __builtin_offsetof(struct ipv6hdr, hop_limit), &hl, 1, BPF_F_RECOMPUTE_CSUM))
			return -1;
		data = SKB_PTR(skb, data);
		end = SKB_PTR(skb, data_end);
		eth = data;
		if ((void *)(eth + 1) > end)
			return -1;
	}
	if (dmac) {
		__builtin_memcpy(eth->h_dest, dmac, 6);
		__builtin_memcpy(eth->h_source, smac, 6);
	}
	return 0;
}

/* The headers must be linear for direct access: at most Ethernet + IPv6. */
static __always_inline void pull_headers(struct __sk_buff *skb)
{
	const __u32 need = ETH_HLEN + sizeof(struct ipv6hdr);
	if (SKB_PTR(skb, data) + need > SKB_PTR(skb, data_end))
		bpf_skb_pull_data(skb, need);
}

/*
 * admit: what both directions check before routing. The device is ours and
 * of the kind this program serves; the frame is addressed to the node (its
 * MAC on that device); the packet is plain IP the kernel would forward; the
 * node's check allows its family. A pod port also learns which port the
 * frame's source MAC sends from, as the bridge does.
 */
static __always_inline enum mw_xn_reason admit(struct __sk_buff *skb, __u32 kind, __u64 *cookie,
					       struct mw_xn_dev **dev, struct pkt *p, struct bpf_fib_lookup *fib)
{
	*cookie = dev_netns_cookie(skb);
	struct mw_xn_dev_key dk = { .netns_cookie = *cookie, .ifindex = skb->ifindex };
	*dev = bpf_map_lookup_elem(&mw_xn_devs, &dk);
	if (!*dev || (*dev)->kind != kind)
		return MW_XN_REASON_NOT_CROSS_NODE;
	pull_headers(skb);
	void *data = SKB_PTR(skb, data), *end = SKB_PTR(skb, data_end);
	struct ethhdr *eth = data;
	if ((void *)(eth + 1) > end)
		return MW_XN_REASON_MALFORMED;
	if (kind == MW_XN_KIND_POD && !(eth->h_source[0] & 1)) {
		struct mw_xn_mac_key mk = { .netns_cookie = *cookie };
		__builtin_memcpy(mk.mac, eth->h_source, 6);
		__u32 *port = bpf_map_lookup_elem(&mw_xn_macs, &mk);
		__u32 ifindex = skb->ifindex;
		if (!port || *port != ifindex)
			bpf_map_update_elem(&mw_xn_macs, &mk, &ifindex, BPF_ANY);
	}
	if (!mac_eq(eth->h_dest, (*dev)->mac))
		return MW_XN_REASON_NOT_ROUTED;
	enum mw_xn_reason r = check_ip(skb, p, fib);
	if (r != MW_XN_REASON_NONE)
		return r;
	return node_check(skb, *cookie, p->proto);
}

SEC("tcx/ingress")
int mw_xn_from_pod(struct __sk_buff *skb)
{
	struct bpf_fib_lookup fib = {};
	struct mw_xn_dev *dev;
	struct pkt p = {};
	__u64 cookie;

	enum mw_xn_reason r = admit(skb, MW_XN_KIND_POD, &cookie, &dev, &p, &fib);
	if (r != MW_XN_REASON_NONE)
		return pass(r);

	/* Routed as the kernel would: from the bridge, the packet's L3 input. */
	fib.ifindex = dev->l3_ifindex;
	long rc = bpf_fib_lookup(skb, &fib, sizeof(fib), 0);
	if (rc != BPF_FIB_LKUP_RET_SUCCESS && rc != BPF_FIB_LKUP_RET_NO_NEIGH)
		return pass(fib_reason(rc));
	struct mw_xn_dev_key ek = { .netns_cookie = cookie, .ifindex = fib.ifindex };
	struct mw_xn_dev *out = bpf_map_lookup_elem(&mw_xn_devs, &ek);
	if (!out || out->kind != MW_XN_KIND_UPLINK)
		return pass(MW_XN_REASON_NOT_CROSS_NODE);
	if (!fits(skb, fib.ifindex))
		return pass(MW_XN_REASON_MTU);

	if (rc == BPF_FIB_LKUP_RET_NO_NEIGH) {
		struct bpf_redir_neigh nh = { .nh_family = fib.family };
		__builtin_memcpy(nh.ipv6_nh, fib.ipv6_dst, 16); /* ipv4_nh shares the union */
		if (forward_headers(skb, p.proto, 0, 0))
			return pass(MW_XN_REASON_MALFORMED);
		count_redirect(MW_XN_DIR_TO_WIRE, p.len, 1);
		return bpf_redirect_neigh(fib.ifindex, &nh, sizeof(nh), 0);
	}
	if (forward_headers(skb, p.proto, fib.dmac, fib.smac))
		return pass(MW_XN_REASON_MALFORMED);
	count_redirect(MW_XN_DIR_TO_WIRE, p.len, 0);
	return bpf_redirect(fib.ifindex, 0);
}

SEC("tcx/ingress")
int mw_xn_from_wire(struct __sk_buff *skb)
{
	struct bpf_fib_lookup fib = {};
	struct mw_xn_dev *dev;
	struct pkt p = {};
	__u64 cookie;

	enum mw_xn_reason r = admit(skb, MW_XN_KIND_UPLINK, &cookie, &dev, &p, &fib);
	if (r != MW_XN_REASON_NONE)
		return pass(r);

	fib.ifindex = skb->ifindex;
	long rc = bpf_fib_lookup(skb, &fib, sizeof(fib), 0);
	if (rc == BPF_FIB_LKUP_RET_NO_NEIGH)
		return pass(MW_XN_REASON_NO_NEIGHBOUR);
	if (rc != BPF_FIB_LKUP_RET_SUCCESS)
		return pass(fib_reason(rc));
	struct mw_xn_dev_key bk = { .netns_cookie = cookie, .ifindex = fib.ifindex };
	struct mw_xn_dev *br = bpf_map_lookup_elem(&mw_xn_devs, &bk);
	if (!br || br->kind != MW_XN_KIND_BRIDGE)
		return pass(MW_XN_REASON_NOT_CROSS_NODE);
	if (!fits(skb, fib.ifindex))
		return pass(MW_XN_REASON_MTU);

	/* The port the bridge would pick for the neighbour's MAC. */
	struct mw_xn_mac_key mk = { .netns_cookie = cookie };
	__builtin_memcpy(mk.mac, fib.dmac, 6);
	__u32 *port = bpf_map_lookup_elem(&mw_xn_macs, &mk);
	if (!port)
		return pass(MW_XN_REASON_UNKNOWN_POD);
	struct mw_xn_dev_key pk = { .netns_cookie = cookie, .ifindex = *port };
	struct mw_xn_dev *pod = bpf_map_lookup_elem(&mw_xn_devs, &pk);
	if (!pod || pod->kind != MW_XN_KIND_POD || pod->l3_ifindex != fib.ifindex)
		return pass(MW_XN_REASON_UNKNOWN_POD);
	__u32 target = pk.ifindex;
	if (forward_headers(skb, p.proto, fib.dmac, fib.smac))
		return pass(MW_XN_REASON_MALFORMED);
	count_redirect(MW_XN_DIR_TO_POD, p.len, 0);
	return bpf_redirect_peer(target, 0);
}

/*
 * mw_xn_hooks: the agent runs this (BPF_PROG_TEST_RUN, from a thread in the
 * node's namespace, whose loopback device the test packet gets) to read
 * nf_hooks_ident before it reads the node's rulesets. The test frame's
 * EtherType picks the family. Never attached.
 */
SEC("tc")
int mw_xn_hooks(struct __sk_buff *skb)
{
	void *data = SKB_PTR(skb, data), *end = SKB_PTR(skb, data_end);
	struct ethhdr *eth = data;
	if ((void *)(eth + 1) > end)
		return 0;
	return nf_hooks_ident(skb, bpf_ntohs(eth->h_proto));
}
