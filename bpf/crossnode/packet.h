/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * Reading and rewriting the packet as the kernel's forwarding would, for both
 * tc programs (tcx ingress of a pod port or an uplink). Attaches to nothing.
 * A packet that is not plain IP the kernel would forward (options,
 * fragments, an expiring TTL, link-local) is left to the kernel, which knows
 * what to answer; one that is gets its TTL decremented and new Ethernet
 * addresses from the FIB lookup.
 */
#ifndef MESHWARP_CROSSNODE_PACKET_H
#define MESHWARP_CROSSNODE_PACKET_H

#define ETH_HLEN 14
#define ETH_P_IP 0x0800
#define ETH_P_IPV6 0x86DD
#define AF_INET 2
#define AF_INET6 10
#define IP_MF 0x2000
#define IP_OFFSET 0x1FFF
#define IPPROTO_ICMPV6 58

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

#endif /* MESHWARP_CROSSNODE_PACKET_H */
