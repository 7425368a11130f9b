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
 * Kernel: >= 6.6 (tcx links).
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
 * and, not pinned, maps.h's mw_xn_dev_slots (mw_xn_devs by ifindex) and
 * netfilter.h's mw_xn_hookfns and mw_xn_scratch.
 *
 * Where each concern lives:
 *   crossnode.h   types shared with Go (bpf2go -type)
 *   maps.h        the shared maps and the counters' helpers
 *   packet.h      parsing, FIB answers, MTU, rewriting headers as forwarding does
 *   netfilter.h   the per-packet netfilter check (node_check, nf_hooks_ident)
 * This file declares the programs: mw_xn_from_pod, mw_xn_from_wire and
 * mw_xn_hooks, with admit, the checks both directions share.
 */
#include "vmlinux.h"
#include "bpf_helpers.h"
#include "bpf_endian.h"
#include "bpf_core_read.h"
#include "pinned_map.h"
#include "crossnode.h"
#include "maps.h"
#include "packet.h"
#include "netfilter.h"

char LICENSE[] SEC("license") = "Dual BSD/GPL";

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
	*dev = dev_of(*cookie, skb->ifindex, kind);
	if (!*dev)
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
	if (!dev_of(cookie, fib.ifindex, MW_XN_KIND_UPLINK))
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
	if (!dev_of(cookie, fib.ifindex, MW_XN_KIND_BRIDGE))
		return pass(MW_XN_REASON_NOT_CROSS_NODE);
	if (!fits(skb, fib.ifindex))
		return pass(MW_XN_REASON_MTU);

	/* The port the bridge would pick for the neighbour's MAC. */
	struct mw_xn_mac_key mk = { .netns_cookie = cookie };
	__builtin_memcpy(mk.mac, fib.dmac, 6);
	__u32 *port = bpf_map_lookup_elem(&mw_xn_macs, &mk);
	if (!port)
		return pass(MW_XN_REASON_UNKNOWN_POD);
	__u32 target = *port;
	struct mw_xn_dev *pod = dev_of(cookie, target, MW_XN_KIND_POD);
	if (!pod || pod->l3_ifindex != fib.ifindex)
		return pass(MW_XN_REASON_UNKNOWN_POD);
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
