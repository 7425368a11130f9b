/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * The netfilter check: may this node's packets skip netfilter, right now?
 * Attaches to nothing itself: node_check runs in both tc programs on every
 * packet they would redirect, and mw_xn_hooks (crossnode.bpf.c, never
 * attached) lets the agent read the same identity by BPF_PROG_TEST_RUN
 * before it reads the node's rulesets. The agent's word (mw_xn_nodes) holds
 * only for the hook lists and rules it checked: nf_hooks_ident digests them,
 * so a rule added since sends packets the normal path at once.
 * Maps owned (not pinned: the agent fills mw_xn_hookfns, again as modules load):
 *   mw_xn_hookfns  ARRAY          hook function address -> enum mw_xn_hookfn, placed by address
 *   mw_xn_scratch  PERCPU_ARRAY   room to read hook lists in
 */
#ifndef MESHWARP_CROSSNODE_NETFILTER_H
#define MESHWARP_CROSSNODE_NETFILTER_H

/* The hook functions the agent knows, placed by address (struct mw_xn_hookfn_table; hookfns.go). */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct mw_xn_hookfn_table);
} mw_xn_hookfns SEC(".maps");

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

/* What one probe read of an nf_tables base chain covers at most: its policy to its rule blobs. */
#define MW_XN_CHAIN_SPAN 64

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
		/* The policy lives in the nft_base_chain around the chain. */
		__u64 base = priv - bpf_core_field_offset(struct nft_base_chain, chain);
		__u32 pol = bpf_core_field_offset(struct nft_base_chain, policy);
		__u32 b0 = bpf_core_field_offset(struct nft_base_chain, chain) + bpf_core_field_offset(struct nft_chain, blob_gen_0);
		__u32 b1 = bpf_core_field_offset(struct nft_base_chain, chain) + bpf_core_field_offset(struct nft_chain, blob_gen_1);
		__u64 blob0 = 0, blob1 = 0;
		__u8 policy = 0;
		/*
		 * One probe read from the policy to the second blob where the
		 * layout keeps them close in that order (40 bytes on 6.18), from
		 * an 8-byte boundary (the stack's loads are aligned); else three.
		 * The offsets are constants once relocated: the verifier keeps
		 * one branch.
		 */
		__u32 start = pol & ~7u;
		__u64 span[MW_XN_CHAIN_SPAN / 8] = {};
		if (pol < b0 && b0 < b1 && !(b0 & 7) && !(b1 & 7) && b1 + 8 - start <= MW_XN_CHAIN_SPAN) {
			bpf_probe_read_kernel(span, b1 + 8 - start, (void *)(base + start));
			/* By shifts: indexing the bytes lets the compiler OR into the stack pointer. */
			policy = (__u8)(span[0] >> ((pol - start) * 8));
			blob0 = span[(b0 - start) / 8];
			blob1 = span[(b1 - start) / 8];
		} else {
			blob0 = read_u64((void *)(base + b0));
			blob1 = read_u64((void *)(base + b1));
			bpf_probe_read_kernel(&policy, 1, (void *)(base + pol));
		}
		if (gen != 1)
			h = mix(h, blob0);
		if (gen != 0)
			h = mix(h, blob1);
		h = mix(h, policy);
	} else if (kind == MW_XN_HOOKFN_XT_TABLE && bpf_core_type_exists(struct xt_table)) {
		struct xt_table *t = (void *)priv;
		h = mix(h, read_u64(&t->private));
	}
	return h;
}

static __always_inline __u32 hookfn_kind(__u64 fn)
{
	__u32 zero = 0, slot;
	/* An array's lookup is inlined: no call per entry. */
	struct mw_xn_hookfn_table *t = bpf_map_lookup_elem(&mw_xn_hookfns, &zero);

	if (!t || !t->mult)
		return MW_XN_HOOKFN_UNKNOWN;
	slot = (fn * t->mult) >> (64 - MW_XN_HOOKFN_SLOT_BITS);
	slot &= (1 << MW_XN_HOOKFN_SLOT_BITS) - 1;
	return t->addr[slot] == fn ? t->kind[slot] : MW_XN_HOOKFN_UNKNOWN;
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
	if (bpf_core_field_exists(net->nft.gencursor))
		gen = net->nft.gencursor & 1; /* a BTF load: net came through the skb */
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

#endif /* MESHWARP_CROSSNODE_NETFILTER_H */
