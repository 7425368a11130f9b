/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * The maps both tc programs share, and the counters' helpers. Attaches to
 * nothing: mw_xn_from_pod and mw_xn_from_wire read the agent's word from
 * these (which devices are ours, which nodes' netfilter allows us) and count
 * every packet they redirect or pass. All are pinned by name next to the
 * agent's, so a restarted agent adopts them; the netfilter check keeps its
 * own (netfilter.h).
 */
#ifndef MESHWARP_CROSSNODE_MAPS_H
#define MESHWARP_CROSSNODE_MAPS_H

MW_PINNED_MAP(BPF_MAP_TYPE_HASH, 4096, struct mw_xn_dev_key, struct mw_xn_dev) mw_xn_devs SEC(".maps");

MW_PINNED_MAP(BPF_MAP_TYPE_HASH, 64, __u64, struct mw_xn_node) mw_xn_nodes SEC(".maps");

MW_PINNED_MAP(BPF_MAP_TYPE_LRU_HASH, 16384, struct mw_xn_mac_key, __u32) mw_xn_macs SEC(".maps");

MW_PINNED_MAP(BPF_MAP_TYPE_PERCPU_ARRAY, 1, __u32, struct mw_xn_counters) mw_xn_stats SEC(".maps");

/*
 * The devices of mw_xn_devs by ifindex (struct mw_xn_dev_slot), which a
 * packet looks up two or three times: an array's lookup is inlined, a
 * hash's is a call and a hash of the key. Written by the agent with
 * mw_xn_devs (syncDevices), not pinned: a restarted agent fills its own
 * before its programs attach. A device whose slot holds another node's
 * (the same ifindex modulo the count) is found in mw_xn_devs.
 */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, MW_XN_DEV_SLOTS);
	__type(key, __u32);
	__type(value, struct mw_xn_dev_slot);
} mw_xn_dev_slots SEC(".maps");

/* The device the agent manages at ifindex in the node, when it is of kind; else NULL. */
static __always_inline struct mw_xn_dev *dev_of(__u64 cookie, __u32 ifindex, __u32 kind)
{
	struct mw_xn_dev_key k = { .netns_cookie = cookie, .ifindex = ifindex };
	__u32 slot = ifindex % MW_XN_DEV_SLOTS;
	struct mw_xn_dev_slot *s = bpf_map_lookup_elem(&mw_xn_dev_slots, &slot);
	struct mw_xn_dev *d;

	if (s && s->key.ifindex == ifindex && s->key.netns_cookie == cookie)
		d = &s->dev;
	else
		d = bpf_map_lookup_elem(&mw_xn_devs, &k);
	return d && d->kind == kind ? d : NULL;
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

#endif /* MESHWARP_CROSSNODE_MAPS_H */
