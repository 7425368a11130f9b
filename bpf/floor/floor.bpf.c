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
 */
#include "vmlinux.h"
#include "bpf_helpers.h"
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
