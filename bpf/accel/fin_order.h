/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * The FIN order: the first part of mw_egress (cgroup_skb/egress on the
 * agent's cgroup, attached with the data path: accel.bpf.c). It keeps a
 * FIN behind its socket's own redirected bytes.
 *
 * tcp_bpf_send_verdict drops the writer's socket lock before it enqueues a
 * redirected message into the peer (bpf_tcp_ingress). A shutdown(SHUT_WR)
 * by another thread takes the lock in between and sends the FIN by TCP: the
 * peer would read EOF, then the message (docs/kernel/06-shutdown-race.md).
 * Such a FIN is dropped here; TCP keeps it queued and sends it again from
 * its probe timer (TCP_RTO_MIN, 200 ms, or later), by when the redirect has
 * landed. A FIN is held only while a redirect may be on its way: the socket
 * redirected within MW_FIN_HOLD_NS and its psock has a user besides
 * mw_sock_map (every tcp_bpf sendmsg holds a reference from start to end).
 * A close() is not held: sock_map_close has dropped the psock by then, and
 * closing a socket another thread writes to is the application's race.
 *
 * Every other packet leaves after a look at the TCP flags.
 */
#ifndef MESHWARP_FIN_ORDER_H
#define MESHWARP_FIN_ORDER_H

#define MW_FIN_HOLD_NS (20 * 1000 * 1000ULL) /* coarse clock: a few ticks */
#define MW_TCP_FIN 0x01

/* The TCP flags byte of an egress TCP segment, or 0. */
static __always_inline __u8 tcp_flags_of(struct __sk_buff *skb)
{
	__u32 off;
	__u8 *tcp = skb_tcp_header(skb, &off);

	return tcp ? tcp[13] : 0;
}

/* 0: hold this FIN back (drop it; TCP sends it again). */
static __always_inline int fin_order(struct __sk_buff *skb)
{
	struct bpf_sock *sk = skb->sk;
	struct mw_sk_state *st;
	struct tcp_sock *tp;

	if (!sk || !(tcp_flags_of(skb) & MW_TCP_FIN))
		return 1;
	sk = bpf_sk_fullsock(sk);
	if (!sk || sk->protocol != IPPROTO_TCP)
		return 1;
	st = pair_state(sk, false);
	if (!st || !st->redir_ns || coarse_ns() - st->redir_ns > MW_FIN_HOLD_NS)
		return 1;
	tp = bpf_skc_to_tcp_sock(sk);
	if (!tp || psock_refs((struct sock *)tp) <= 1)
		return 1;
	return 0;
}

#endif /* MESHWARP_FIN_ORDER_H */
