/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * Types shared by crossnode.bpf.c and internal/crossnode (Go structs are
 * generated from these by bpf2go -type; the enums' names Go reads from BTF).
 * Attaches to nothing. Go names one set of values by hand: the node flags
 * (nodeV4, nodeV6 in internal/crossnode/stats.go; keep in sync).
 */
#ifndef MESHWARP_CROSSNODE_H
#define MESHWARP_CROSSNODE_H

#define TCX_NEXT -1 /* tcx: pass to the next program, then the normal path */

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
 * mw_xn_dev_slots value: a device of mw_xn_devs again, by its ifindex alone
 * (slot: ifindex modulo MW_XN_DEV_SLOTS), with its key to compare. Empty:
 * ifindex 0.
 */
#define MW_XN_DEV_SLOTS 1024
struct mw_xn_dev_slot {
	struct mw_xn_dev_key key;
	struct mw_xn_dev dev;
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

/*
 * mw_xn_hookfns value: the hook functions the agent found, by address. A
 * function's slot is (address * mult) >> (64 - MW_XN_HOOKFN_SLOT_BITS), and
 * the agent picks mult so that no two of them share one (hookfns.go): a
 * packet tells a hook entry's kind with one compare instead of a hash
 * lookup per entry, nested NAT entries included (docs/BENCHMARKS.md
 * section 47). mult 0: none known.
 */
#define MW_XN_HOOKFN_SLOT_BITS 7
struct mw_xn_hookfn_table {
	__u64 mult;
	__u64 addr[1 << MW_XN_HOOKFN_SLOT_BITS];
	__u32 kind[1 << MW_XN_HOOKFN_SLOT_BITS]; /* enum mw_xn_hookfn */
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

/* Keep the enums in BTF for bpf2go and for the names Go reads. */
const enum mw_xn_reason mw_xn_reason_unused __attribute__((unused));
const enum mw_xn_dir mw_xn_dir_unused __attribute__((unused));
const enum mw_xn_kind mw_xn_kind_unused __attribute__((unused));
const enum mw_xn_hookfn mw_xn_hookfn_unused __attribute__((unused));

#endif /* MESHWARP_CROSSNODE_H */
