/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * Learning what a redirect cannot honour, from the calls of the cgroup's
 * processes (included after redirect.h, whose helpers it uses).
 *
 * mw_sock_create, mw_post_bind4/6 (cgroup/sock_create, post_bind4/6 on
 *   the agent's cgroup, always attached): name the program that creates
 *   each TCP socket, in the creating task's context (sock_ops runs in
 *   softirq, where the current task is anyone). bind(2) names it again for
 *   the TCP socket an MPTCP listener (Go's default since 1.24) binds and
 *   accepts from: the kernel creates that subflow socket itself, past
 *   sock_create. Learning names the program in mw_unfit_progs, and pairing
 *   leaves every later connection of it to TCP, on any port.
 *
 * mw_setsockopt (cgroup/setsockopt on the agent's cgroup, always attached):
 *   an option the redirect ignores, set on a socket in mw_sock_map. If
 *   nothing was redirected on its connection yet, the connection continues
 *   on TCP before its first byte, invisibly; else the bytes already
 *   redirected were read without it (kernel-limited), the connection goes
 *   to TCP at its next switch point, and the ports are learned. It runs only
 *   for the cgroup's processes: nothing on the rest of the node pays.
 *
 * The syscall watches (tracepoints syscalls/sys_enter_*, attached only with
 * `run --learn-from-syscalls`): per-call flags no cgroup hook sees. A
 * sys_enter tracepoint puts every task of the node on the kernel's syscall
 * tracing path, so they are off by default:
 *   splice(2) reads only the TCP queue; recv(MSG_WAITALL) returns what the
 *   redirect queue holds; MSG_OOB has no urgent mark on redirected bytes;
 *   close() with unread redirected bytes sends FIN where TCP sends RST;
 *   connect(AF_UNSPEC) leaves unread redirected bytes for the next
 *   connection; on kernels whose tcp_bpf has no ioctl (6.1), ioctl(FIONREAD)
 *   counts only TCP's queue (that watch is attached only there). The
 *   connection that reveals it already runs; later
 *   connections on that socket's ports are left to TCP (mw_unfit_lport,
 *   mw_unfit_rport), and so are those of the program (mw_unfit_progs: the
 *   calling thread's name here, where the socket's record cannot be read);
 *   `meshwarp status` names the processes (mw_unfit_procs) and programs.
 */
#ifndef MESHWARP_LEARNING_H
#define MESHWARP_LEARNING_H

#define MW_S_IFMT 00170000
#define MW_S_IFSOCK 0140000
#define MW_MSG_OOB 0x1
#define MW_MSG_WAITALL 0x100

/* The socket behind fd in the current process, or NULL. */
static __always_inline struct sock *fd_socket(long fd)
{
	struct task_struct *task = (struct task_struct *)bpf_get_current_task();
	struct file **fds;
	struct file *file = NULL;
	struct socket *sock;
	__u32 max_fds;
	__u16 mode;

	max_fds = BPF_CORE_READ(task, files, fdt, max_fds);
	if (fd < 0 || fd >= max_fds)
		return NULL;
	fds = BPF_CORE_READ(task, files, fdt, fd);
	if (bpf_probe_read_kernel(&file, sizeof(file), &fds[fd]) || !file)
		return NULL;
	mode = BPF_CORE_READ(file, f_inode, i_mode);
	if ((mode & MW_S_IFMT) != MW_S_IFSOCK)
		return NULL;
	sock = BPF_CORE_READ(file, private_data);
	return BPF_CORE_READ(sock, sk);
}

/* Whether sk is in a sockmap (has a psock): only then does a redirect apply. */
static __always_inline bool in_sockmap(struct sock *sk)
{
	return psock_of(sk) != NULL;
}

/*
 * Learn that prog did `reason`: none of its later connections is paired.
 * prog NULL: the calling thread's name. The first reason stays, so the
 * connections kept off count under one reason however many it shows.
 */
static __always_inline void learn_unfit_prog(const struct mw_prog *prog, __u32 reason)
{
	struct mw_unfit_prog init = { .reason = reason };
	struct mw_prog cur = {};
	__u32 zero = 0, *any;

	if (!prog) {
		bpf_get_current_comm(cur.comm, sizeof(cur.comm));
		prog = &cur;
	}
	bpf_map_update_elem(&mw_unfit_progs, prog, &init, BPF_NOEXIST);
	any = bpf_map_lookup_elem(&mw_learned_any, &zero);
	if (any && !*any)
		*any = 1;
}

/*
 * Learn that the process did `reason` on sk: later connections on sk's
 * ports, and of prog (NULL: the calling thread's), are left to TCP, and the
 * process is named in mw_unfit_procs.
 */
static __always_inline void learn_unfit_ports(__u32 lport, __u32 rport, const struct mw_prog *prog, __u32 reason)
{
	struct mw_unfit_key key = { .tgid = bpf_get_current_pid_tgid() >> 32, .reason = reason };
	struct mw_unfit_proc *p, init = {};
	struct mw_counters *cnt = counters();

	if (reason >= MW_REASON_MAX)
		return;
	if (cnt)
		cnt->unfit_calls[reason]++;
	if (lport)
		bpf_map_update_elem(&mw_unfit_lport, &lport, &reason, BPF_ANY);
	if (rport)
		bpf_map_update_elem(&mw_unfit_rport, &rport, &reason, BPF_ANY);
	learn_unfit_prog(prog, reason);
	p = bpf_map_lookup_elem(&mw_unfit_procs, &key);
	if (!p) {
		bpf_get_current_comm(init.comm, sizeof(init.comm));
		bpf_map_update_elem(&mw_unfit_procs, &key, &init, BPF_NOEXIST);
		p = bpf_map_lookup_elem(&mw_unfit_procs, &key);
		if (!p)
			return;
	}
	__sync_fetch_and_add(&p->calls, 1);
}

static __always_inline void learn_unfit(struct sock *sk, __u32 reason)
{
	__u32 lport = BPF_CORE_READ(sk, __sk_common.skc_num);               /* host order */
	__u32 rport = bpf_ntohs(BPF_CORE_READ(sk, __sk_common.skc_dport)); /* network order */

	learn_unfit_ports(lport, rport, NULL, reason);
}

/* A syscall with flags on socket fd: learn when a flag needs what a redirect lacks. */
static __always_inline void watch_flags(long fd, long flags, bool receiving)
{
	struct sock *sk;
	__u32 reason;

	if (flags & MW_MSG_OOB)
		reason = MW_REASON_OOB;
	else if (receiving && (flags & MW_MSG_WAITALL))
		reason = MW_REASON_WAITALL_READER;
	else
		return;
	if (bpf_current_task_under_cgroup(&mw_cgroup, 0) != 1)
		return;
	sk = fd_socket(fd);
	if (sk && in_sockmap(sk))
		learn_unfit(sk, reason);
}

/*
 * splice(2) reads only the TCP queue: learned for every socket read (the
 * reader may splice a socket before it is paired), and counted.
 */
SEC("tracepoint/syscalls/sys_enter_splice")
int mw_sys_splice(struct trace_event_raw_sys_enter *ctx)
{
	struct mw_counters *cnt;
	struct sock *sk;

	if (bpf_current_task_under_cgroup(&mw_cgroup, 0) != 1)
		return 0;
	sk = fd_socket(ctx->args[0]);
	if (!sk)
		return 0;
	cnt = counters();
	if (cnt)
		cnt->splice_socket_reads++;
	learn_unfit(sk, MW_REASON_SPLICE_READER);
	return 0;
}

/* recvfrom(fd, buf, len, flags, ...), recvmsg(fd, msg, flags), recvmmsg(fd, vec, vlen, flags, ...) */
SEC("tracepoint/syscalls/sys_enter_recvfrom")
int mw_sys_recvfrom(struct trace_event_raw_sys_enter *ctx)
{
	watch_flags(ctx->args[0], ctx->args[3], true);
	return 0;
}

SEC("tracepoint/syscalls/sys_enter_recvmsg")
int mw_sys_recvmsg(struct trace_event_raw_sys_enter *ctx)
{
	watch_flags(ctx->args[0], ctx->args[2], true);
	return 0;
}

SEC("tracepoint/syscalls/sys_enter_recvmmsg")
int mw_sys_recvmmsg(struct trace_event_raw_sys_enter *ctx)
{
	watch_flags(ctx->args[0], ctx->args[3], true);
	return 0;
}

/* sendto(fd, buf, len, flags, ...), sendmsg(fd, msg, flags), sendmmsg(fd, vec, vlen, flags) */
SEC("tracepoint/syscalls/sys_enter_sendto")
int mw_sys_sendto(struct trace_event_raw_sys_enter *ctx)
{
	watch_flags(ctx->args[0], ctx->args[3], false);
	return 0;
}

SEC("tracepoint/syscalls/sys_enter_sendmsg")
int mw_sys_sendmsg(struct trace_event_raw_sys_enter *ctx)
{
	watch_flags(ctx->args[0], ctx->args[2], false);
	return 0;
}

SEC("tracepoint/syscalls/sys_enter_sendmmsg")
int mw_sys_sendmmsg(struct trace_event_raw_sys_enter *ctx)
{
	watch_flags(ctx->args[0], ctx->args[3], false);
	return 0;
}

/*
 * connect(fd, {AF_UNSPEC}) on a socket with a psock: TCP drops the unread
 * bytes of the connection it dissolves, but the redirect queue survives and
 * the next connection on the socket would read them first.
 */
SEC("tracepoint/syscalls/sys_enter_connect")
int mw_sys_connect(struct trace_event_raw_sys_enter *ctx)
{
	struct sock *sk;
	__u16 family = 0xffff;

	if (bpf_probe_read_user(&family, sizeof(family), (void *)ctx->args[1]) || family != 0 /* AF_UNSPEC */)
		return 0;
	if (bpf_current_task_under_cgroup(&mw_cgroup, 0) != 1)
		return 0;
	sk = fd_socket(ctx->args[0]);
	if (sk && in_sockmap(sk))
		learn_unfit(sk, MW_REASON_DISCONNECT);
	return 0;
}

/*
 * close(fd) of a paired socket whose redirect queue holds unread bytes: TCP
 * would reset the connection; the sockmap close path sends FIN. Only the
 * last reference closes the socket, but a dup'ed fd is rare enough not to
 * matter (at worst a port is learned without need).
 */
SEC("tracepoint/syscalls/sys_enter_close")
int mw_sys_close(struct trace_event_raw_sys_enter *ctx)
{
	struct sock *sk;

	if (bpf_current_task_under_cgroup(&mw_cgroup, 0) != 1)
		return 0;
	sk = fd_socket(ctx->args[0]);
	if (sk && redirect_backlog(sk) > 0)
		learn_unfit(sk, MW_REASON_UNREAD_CLOSE);
	return 0;
}

#define MW_FIONREAD 0x541B /* SIOCINQ too */

/*
 * ioctl(fd, FIONREAD) on a socket with a psock, on a kernel whose tcp_bpf
 * has no ioctl (before commit 929e30f93125): the answer leaves out the
 * redirect queue. The agent attaches this watch only on such kernels.
 */
SEC("tracepoint/syscalls/sys_enter_ioctl")
int mw_sys_ioctl(struct trace_event_raw_sys_enter *ctx)
{
	struct sock *sk;

	if (ctx->args[1] != MW_FIONREAD || bpf_current_task_under_cgroup(&mw_cgroup, 0) != 1)
		return 0;
	sk = fd_socket(ctx->args[0]);
	if (sk && in_sockmap(sk))
		learn_unfit(sk, MW_REASON_FIONREAD_READER);
	return 0;
}

#define MW_SOL_SOCKET 1
#define MW_SO_OOBINLINE 10
#define MW_IPPROTO_TCP 6
#define MW_SO_RCVLOWAT 18
#define MW_SO_TIMESTAMP_OLD 29
#define MW_SO_TIMESTAMPNS_OLD 35
#define MW_SO_TIMESTAMPING_OLD 37
#define MW_SO_PEEK_OFF 42
#define MW_SO_ZEROCOPY 60
#define MW_SO_TIMESTAMP_NEW 63
#define MW_SO_TIMESTAMPNS_NEW 64
#define MW_SO_TIMESTAMPING_NEW 65
#define MW_TCP_INQ 36
#define MW_PAGE_SIZE 4096

/* The reason an option (level, name, int value) keeps a connection off the redirect, or 0. */
static __always_inline __u32 option_unfit(int level, int name, int val)
{
	if (level == MW_IPPROTO_TCP)
		return name == MW_TCP_INQ && val ? MW_REASON_TCP_INQ : 0;
	if (level != MW_SOL_SOCKET)
		return 0;
	switch (name) {
	case MW_SO_OOBINLINE:
		return val ? MW_REASON_OOB : 0;
	case MW_SO_RCVLOWAT:
		return val > 1 ? MW_REASON_RCVLOWAT : 0;
	case MW_SO_PEEK_OFF:
		return val >= 0 ? MW_REASON_PEEK_OFF : 0;
	case MW_SO_ZEROCOPY:
		return val ? MW_REASON_ZEROCOPY : 0;
	case MW_SO_TIMESTAMP_OLD:
	case MW_SO_TIMESTAMPNS_OLD:
	case MW_SO_TIMESTAMPING_OLD:
	case MW_SO_TIMESTAMP_NEW:
	case MW_SO_TIMESTAMPNS_NEW:
	case MW_SO_TIMESTAMPING_NEW:
		return val ? MW_REASON_TIMESTAMP : 0;
	}
	return 0;
}

/*
 * setsockopt by a process of the cgroup, before the kernel applies it. The
 * option itself is never changed or refused.
 */
SEC("cgroup/setsockopt")
int mw_setsockopt(struct bpf_sockopt *ctx)
{
	struct bpf_sock *sk = ctx->sk;
	void *val_p = ctx->optval, *end = ctx->optval_end;
	struct mw_sk_state *st;
	struct mw_prog *prog;
	struct mw_conn *c;
	__u32 reason;
	int val = 0;
	bool untouched;

	/* Above a page the kernel passes no copy: let it use the caller's buffer. */
	if (ctx->optlen > MW_PAGE_SIZE)
		ctx->optlen = 0;
	if (!sk || !accelerate)
		return 1;
	if (val_p + sizeof(val) <= end)
		val = *(int *)val_p;
	reason = option_unfit(ctx->level, ctx->optname, val);
	if (!reason)
		return 1;
	st = pair_state(sk, false);
	if (!st || !st->role || st->left)
		return 1; /* not in mw_sock_map: TCP honours it */
	c = conn_of(st);
	if (!c)
		return 1;
	if (c->state == MW_CONN_PENDING) {
		/* The passive side finds the decision made and releases the active socket. */
		conn_passthrough(c, reason);
		return 1;
	}
	if (c->state != MW_CONN_PAIRED)
		return 1;
	/*
	 * Nothing redirected either way yet (both directions still undecided):
	 * both stay on TCP from the first byte, and each socket leaves the
	 * hash at its first TCP packet, before any byte is queued on it.
	 */
	request_tcp(c, reason);
	__sync_val_compare_and_swap(&c->dir[0], MW_DIR_UNDECIDED, MW_DIR_NEVER);
	__sync_val_compare_and_swap(&c->dir[1], MW_DIR_UNDECIDED, MW_DIR_NEVER);
	untouched = c->dir[0] == MW_DIR_NEVER && c->dir[1] == MW_DIR_NEVER;
	if (untouched)
		return 1;
	/*
	 * Learn the server's port only: the accepting side's own port, the
	 * connecting side's remote one (an ephemeral port says nothing about
	 * later connections). src_port: host order; dst_port: network order.
	 */
	prog = prog_state(sk, false);
	if (st->role == MW_ROLE_PASSIVE)
		learn_unfit_ports(sk->src_port, 0, prog, reason);
	else
		learn_unfit_ports(0, bpf_ntohs(sk->dst_port), prog, reason);
	return 1;
}

/* Record the calling program on a TCP socket (see the header). Never refuses. */
static __always_inline int record_prog(struct bpf_sock *ctx)
{
	struct mw_prog *prog;

	if (!accelerate || ctx->protocol != IPPROTO_TCP)
		return 1;
	prog = prog_state(ctx, true);
	if (prog)
		bpf_get_current_comm(prog->comm, sizeof(prog->comm));
	return 1;
}

SEC("cgroup/sock_create")
int mw_sock_create(struct bpf_sock *ctx)
{
	return record_prog(ctx);
}

SEC("cgroup/post_bind4")
int mw_post_bind4(struct bpf_sock *ctx)
{
	return record_prog(ctx);
}

SEC("cgroup/post_bind6")
int mw_post_bind6(struct bpf_sock *ctx)
{
	return record_prog(ctx);
}

#endif /* MESHWARP_LEARNING_H */
