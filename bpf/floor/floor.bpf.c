// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
/*
 * The floor of the agent's per-connection cost (scripts/bench-floor.sh, not
 * loaded by the agent): programs on the hooks the agent attaches to its
 * cgroup that do no work, so that a benchmark can tell what the hooks cost by
 * being there from what the agent's programs do in them.
 *   floor_sockops     sock_ops; asks for STATE_CB as the agent does for every
 *                     observed socket, so the kernel makes the same callbacks
 *   floor_setsockopt  cgroup/setsockopt
 *   floor_sock_create cgroup/sock_create; floor_sock_create_rec also creates
 *                     a socket record of the agent's size (struct mw_sock),
 *                     cloned to accepted sockets, as mw_sock_create does
 *   floor_egress, floor_ingress  cgroup_skb
 *   floor_bypass_sockops, floor_bypass_msg  the textbook design of the
 *                     peers that the issue names as the bar: every
 *                     established IPv4 connection's socket (an IPv6
 *                     socket's too, with a v4-mapped peer, as Go's
 *                     servers accept) joins a SOCKHASH by its 4-tuple,
 *                     and sk_msg redirects to the socket whose tuple
 *                     mirrors the sender's. No pairing, no switch to TCP,
 *                     no FIN order, no observation: what such a design
 *                     costs a connection and a message, not a correct
 *                     accelerator (a NATed hop, as the sidecar capture
 *                     makes, never mirrors, and its sockets stay in the
 *                     map anyway). scripts/bench-floor.sh, floor-bypass.
 */
#include "vmlinux.h"
#include "bpf_helpers.h"
#include "bpf_endian.h"
#include "../accel/accel.h"

char LICENSE[] SEC("license") = "Dual BSD/GPL";

struct {
	__uint(type, BPF_MAP_TYPE_SK_STORAGE);
	__uint(map_flags, BPF_F_NO_PREALLOC | BPF_F_CLONE);
	__type(key, int);
	__type(value, struct mw_sock);
} floor_sk_store SEC(".maps");

SEC("sockops")
int floor_sockops(struct bpf_sock_ops *skops)
{
	__u32 op = skops->op;

	if (op == BPF_SOCK_OPS_TCP_CONNECT_CB || op == BPF_SOCK_OPS_PASSIVE_ESTABLISHED_CB)
		bpf_sock_ops_cb_flags_set(skops, skops->bpf_sock_ops_cb_flags | BPF_SOCK_OPS_STATE_CB_FLAG);
	return 1;
}

SEC("cgroup/setsockopt")
int floor_setsockopt(struct bpf_sockopt *ctx)
{
	if (ctx->optlen > 4096)
		ctx->optlen = 0; /* as mw_setsockopt: the kernel passes no copy above a page */
	return 1;
}

SEC("cgroup/sock_create")
int floor_sock_create(struct bpf_sock *ctx)
{
	return 1;
}

SEC("cgroup/sock_create")
int floor_sock_create_rec(struct bpf_sock *ctx)
{
	if (ctx->protocol == IPPROTO_TCP)
		bpf_sk_storage_get(&floor_sk_store, ctx, 0, BPF_SK_STORAGE_GET_F_CREATE);
	return 1;
}

SEC("cgroup_skb/egress")
int floor_egress(struct __sk_buff *skb)
{
	return 1;
}

SEC("cgroup_skb/ingress")
int floor_ingress(struct __sk_buff *skb)
{
	return 1;
}

/* A socket's IPv4 4-tuple, ports in host order: the peer's key is the sender's mirrored. */
struct floor_tuple {
	__u32 local_ip4;
	__u32 remote_ip4;
	__u32 local_port;
	__u32 remote_port;
};

struct {
	__uint(type, BPF_MAP_TYPE_SOCKHASH);
	__uint(max_entries, 65536);
	__type(key, struct floor_tuple);
	__type(value, __u64);
} floor_bypass_map SEC(".maps");

SEC("sockops")
int floor_bypass_sockops(struct bpf_sock_ops *skops)
{
	struct floor_tuple t;

	if (skops->op != BPF_SOCK_OPS_ACTIVE_ESTABLISHED_CB && skops->op != BPF_SOCK_OPS_PASSIVE_ESTABLISHED_CB)
		return 1;
	/* The IPv4 addresses, also of a dual-stack socket's IPv4 connection (0 on IPv6 ones). */
	if (!skops->local_ip4 || !skops->remote_ip4)
		return 1;
	/* local_port: host order; remote_port: network order in the upper 16 bits. */
	t.local_ip4 = skops->local_ip4;
	t.remote_ip4 = skops->remote_ip4;
	t.local_port = skops->local_port;
	t.remote_port = bpf_ntohl(skops->remote_port) & 0xffff;
	bpf_sock_hash_update(skops, &floor_bypass_map, &t, BPF_ANY);
	return 1;
}

SEC("sk_msg")
int floor_bypass_msg(struct sk_msg_md *msg)
{
	struct floor_tuple peer;

	if (!msg->local_ip4 || !msg->remote_ip4)
		return SK_PASS;
	peer.local_ip4 = msg->remote_ip4;
	peer.remote_ip4 = msg->local_ip4;
	peer.local_port = bpf_ntohl(msg->remote_port) & 0xffff;
	peer.remote_port = msg->local_port;
	/* No mirrored socket: the message goes by TCP (sk_redir stays unset). */
	bpf_msg_redirect_hash(msg, &floor_bypass_map, &peer, BPF_F_INGRESS);
	return SK_PASS;
}
