/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * Types shared by accel.bpf.c and internal/accel (Go structs are generated
 * from these by bpf2go -type; keep field order and padding explicit).
 */
#ifndef MESHWARP_ACCEL_H
#define MESHWARP_ACCEL_H

/*
 * A TCP connection's identity on both of its ends. NAT (iptables REDIRECT,
 * DNAT) rewrites addresses but never sequence numbers, and both initial
 * sequence numbers are random, so the pair names the connection on the active
 * (connecting) and on the passive (accepted) side, across namespaces.
 * Values are the snd_nxt/rcv_nxt seen at ESTABLISHED, i.e. ISN + 1.
 */
struct mw_conn_id {
	__u32 active_isn1;  /* active side's snd_nxt == passive side's rcv_nxt */
	__u32 passive_isn1; /* passive side's snd_nxt == active side's rcv_nxt */
};

enum mw_role {
	MW_ROLE_ACTIVE = 1,
	MW_ROLE_PASSIVE = 2,
};

/*
 * The per-connection decision, made once: a connection is either paired
 * (both directions redirected from the first byte) or left to TCP for its
 * whole life. state moves only PENDING -> PAIRED or PENDING -> PASSTHROUGH,
 * by compare-and-swap, so the two ends can never disagree.
 */
enum mw_conn_state {
	MW_CONN_PENDING = 1,
	MW_CONN_PAIRED = 2,
	MW_CONN_PASSTHROUGH = 3,
};

/* Why a connection or message took the normal TCP path. */
enum mw_reason {
	MW_REASON_NONE = 0,
	MW_REASON_NO_PEER = 1,        /* first byte sent before (or without) a local peer socket */
	MW_REASON_PEER_CLOSED = 2,    /* peer socket already closed: TCP answers like without meshwarp */
	MW_REASON_SOCKHASH_FULL = 3,  /* mw_sock_map or mw_conns at capacity */
	MW_REASON_KEY_COLLISION = 4,  /* two live connections drew the same identity */
	MW_REASON_ADDR_MISMATCH = 5,  /* the peer saw another source address (SNAT, masquerade): cannot prove the pair */
	MW_REASON_POLICY = 6,         /* excluded by port/CIDR policy */
	MW_REASON_SPLICE_READER = 7,  /* learned: a socket on this port was read with splice(2) */
	MW_REASON_NO_LOCAL_PEER = 8,  /* no listener of the attached cgroup saw this connection's SYN */
	MW_REASON_UNPAIRED_TIMEOUT = 9, /* the peer did not join within unpaired_timeout_ns */
	MW_REASON_SOCKMAP_BUSY = 10,  /* another program's sockmap already owns the socket's sk_msg */
	MW_REASON_SEND_SHUTDOWN = 11, /* write after shutdown(SHUT_WR): TCP answers EPIPE (messages only) */
	MW_REASON_BACKPRESSURE = 12,  /* receiver fell behind by redirect_budget_bytes: direction on TCP */
	MW_REASON_TCP_REPAIR = 13,    /* socket in TCP_REPAIR mode: its sequence numbers prove nothing */
	MW_REASON_RCVLOWAT = 14,      /* SO_RCVLOWAT set (before the connection, or learned after): redirect ignores it */
	MW_REASON_HINT_MISSED = 15,   /* both ends in the cgroup, but the SYN's note did not reach the connecting socket */
	/* Learned: a process did this on a paired socket; later connections on its ports stay on TCP. */
	MW_REASON_WAITALL_READER = 16, /* recv(MSG_WAITALL): the redirect queue returns what it holds */
	MW_REASON_OOB = 17,            /* MSG_OOB sent or read: redirected bytes carry no urgent mark */
	MW_REASON_UNREAD_CLOSE = 18,   /* close() with unread redirected bytes: TCP would send RST, not FIN */
	MW_REASON_EARLY_DATA = 19,     /* bytes written before ESTABLISHED (TCP Fast Open, a write racing connect) went to TCP */
	MW_REASON_DISCONNECT = 20,     /* learned: connect(AF_UNSPEC) keeps unread redirected bytes for the next connection */
	MW_REASON_SMALL_STREAM = 21,   /* a run of small writes one way: the connection continues on TCP, which coalesces them */
	/*
	 * Socket options the redirect's receive and send paths do not honour,
	 * seen on the socket when it is established (set before connect(), or
	 * inherited from the listener) or set later (cgroup setsockopt): the
	 * connection stays on TCP from its first byte.
	 */
	MW_REASON_PEEK_OFF = 22,       /* SO_PEEK_OFF: tcp_bpf's MSG_PEEK ignores the peek offset */
	MW_REASON_TCP_INQ = 23,        /* TCP_INQ: no TCP_CM_INQ control message on redirected bytes */
	MW_REASON_TIMESTAMP = 24,      /* SO_TIMESTAMP(NS), SO_TIMESTAMPING: no timestamps on redirected bytes */
	MW_REASON_ZEROCOPY = 25,       /* SO_ZEROCOPY: MSG_ZEROCOPY completions are never queued for redirected bytes */
	/* Learned, on kernels whose tcp_bpf has no ioctl: FIONREAD/SIOCINQ counts only TCP's queue there. */
	MW_REASON_FIONREAD_READER = 26,
	MW_REASON_MAX = 27,
};

/*
 * One direction of a paired connection (mw_conn.dir[role - 1]). It moves
 * UNDECIDED -> REDIRECT (its first message) -> DRAINED or TCP, or UNDECIDED -> NEVER
 * when the connection went to TCP before this side sent: a NEVER side never
 * had a message in flight to its peer. REDIRECT -> TCP by its own sk_msg (a
 * switch), its own sock_ops callback at a packet it sends, or the leave
 * poll; -> DRAINED only by its own sock_ops callback, under its socket lock
 * with no psock call of it running (leave.h); UNDECIDED -> NEVER by the
 * peer. Its sk_msg redirects only while REDIRECT (still_redirecting).
 */
enum mw_dir {
	MW_DIR_UNDECIDED = 0,
	MW_DIR_REDIRECT = 1,
	MW_DIR_TCP = 2,
	MW_DIR_NEVER = 3,
	/*
	 * On TCP since a moment when nothing it redirected was unread by the
	 * peer or still on its way (the peer's psock queue empty, no other
	 * sendmsg of this socket running): the peer reads one queue at a time.
	 */
	MW_DIR_DRAINED = 4,
};

/* Which mesh hop a paired connection is. */
enum mw_hop {
	MW_HOP_DIRECT = 0,             /* any other local pair (pod <-> pod, loopback) */
	MW_HOP_APP_TO_SIDECAR = 1,     /* app -> outbound capture port (15001) */
	MW_HOP_SIDECAR_TO_SIDECAR = 2, /* sidecar -> inbound capture port (15006) */
	MW_HOP_SIDECAR_TO_APP = 3,     /* sidecar (by uid) -> local app */
	MW_HOP_MAX = 4,
};

/* An endpoint in one form for both families: IPv4 as v4-mapped IPv6. */
struct mw_endpoint {
	__u32 addr[4]; /* network order, ::ffff:a.b.c.d for IPv4 */
	__u32 port_host;
};

/*
 * A note of mw_syn_notes: a socket of the cgroup connects with this SYN,
 * named by its source address (IPv4 as v4-mapped IPv6) and its initial
 * sequence number plus one (the first byte's sequence number: the id's
 * active_isn1). NAT rewrites ports and destinations, never the sequence
 * number, and a pairable connection keeps its source address. Times in
 * mw_now_us units (pairing.h). 32 bytes: two notes to a cache line.
 */
struct mw_syn_note {
	__u32 addr[4];
	__u32 isn1;        /* 0: the slot is free */
	__u32 connect_us;  /* when it sent its SYN (TCP_CONNECT_CB) */
	__u32 received_us; /* when a listener of the cgroup received this SYN */
	__u32 received;    /* 1: received_us is set */
};

/*
 * A note of mw_unhinted_notes: a connection whose connecting socket found
 * no SYN note (no_local_peer), with that socket's source address, for the
 * accepted side's precise reason. 32 bytes, as mw_syn_note.
 */
struct mw_unhinted_note {
	struct mw_conn_id id; /* both 0: the slot is free */
	__u32 addr[4];
	__u32 noted_us; /* mw_now_us units */
	__u32 pad;
};

/*
 * Where a request/response exchange (or a connection) was observed, from the
 * client inwards: a request through two sidecars meets these points in this
 * order, so the differences of their mean durations are the hops and
 * proxies between them (`meshwarp trace`).
 */
enum mw_point {
	MW_POINT_CLIENT_APP = 0,   /* the application's first read of the response (tp_btf sock_recv_length) */
	MW_POINT_CLIENT = 1,       /* an application's connecting socket */
	MW_POINT_OUTBOUND_IN = 2,  /* the sidecar's accepted socket on the outbound capture port */
	MW_POINT_OUTBOUND_OUT = 3, /* the sidecar's connection to another pod */
	MW_POINT_INBOUND_IN = 4,   /* the sidecar's accepted socket on the inbound capture port */
	MW_POINT_INBOUND_OUT = 5,  /* the sidecar's connection to its own pod's application */
	MW_POINT_SERVER = 6,       /* an application's accepted socket */
	MW_POINT_MAX = 7,
};

enum mw_proto {
	MW_PROTO_TCP = 0,
	MW_PROTO_HTTP = 1, /* HTTP/1.x, by its request and status lines */
};

enum mw_method {
	MW_METHOD_OTHER = 0,
	MW_METHOD_GET = 1,
	MW_METHOD_HEAD = 2,
	MW_METHOD_POST = 3,
	MW_METHOD_PUT = 4,
	MW_METHOD_DELETE = 5,
	MW_METHOD_CONNECT = 6,
	MW_METHOD_OPTIONS = 7,
	MW_METHOD_TRACE = 8,
	MW_METHOD_PATCH = 9,
	MW_METHOD_MAX = 10,
};

/* mw_flow_key.outcome of a TCP flow: how its connections ended. */
enum mw_tcp_outcome {
	MW_TCP_OPEN = 0,           /* bytes of connections still open (no duration) */
	MW_TCP_CLOSED = 1,         /* closed with FIN */
	MW_TCP_RESET = 2,          /* reset or aborted while established */
	MW_TCP_CONNECT_FAILED = 3, /* the connect never succeeded */
	MW_TCP_OUTCOME_MAX = 4,
};

/* Duration histogram buckets: the loader sets the bounds (obs_bounds_ns); the last bucket is +Inf. */
#define MW_OBS_BUCKETS 24

/* mw_flows key: one flow is what one point saw of one server, by outcome. */
struct mw_flow_key {
	__u64 netns;               /* network namespace inode of the observing socket (its pod) */
	struct mw_endpoint server; /* the endpoint the client dialled (the accepting side: its local endpoint) */
	__u32 status;              /* HTTP only: the status code */
	enum mw_point point;
	enum mw_proto proto;
	enum mw_method method;     /* HTTP only */
	enum mw_tcp_outcome outcome; /* TCP only */
	__u32 accelerated;         /* seen by sk_msg on a redirected connection */
	__u32 _pad;
};

/*
 * mw_pair_points key: the two points (each side's netns, server and point)
 * of paired connections' HTTP exchanges, interned once per connection
 * (obs.points) so that an exchange hashes a short key. Value: its id
 * (never 0, never reused: ids come from mw_pair_ids, pinned with it).
 */
struct mw_pair_points_key {
	__u64 active_netns;
	__u64 passive_netns;
	struct mw_endpoint active_server;
	struct mw_endpoint passive_server;
	enum mw_point active_point;
	enum mw_point passive_point;
};

/*
 * mw_pair_flows key: HTTP exchanges of a paired connection, one record for
 * the points of both its sockets (Go reads it as one flow at each point,
 * like an mw_flows record with accelerated set). Value: struct mw_flow.
 */
struct mw_pair_flow_key {
	__u32 points; /* the id mw_pair_points gives the two points */
	__u32 status;
	enum mw_method method;
};

/* mw_flows and mw_pair_flows value, one copy per CPU (summed by Go). */
struct mw_flow {
	__u64 count;  /* HTTP: exchanges; TCP: connections ended */
	__u64 sum_ns; /* of their durations (request to response; TCP: connection lifetime) */
	__u64 bytes;  /* TCP MW_TCP_OPEN only: payload bytes both ways */
	__u64 buckets[MW_OBS_BUCKETS]; /* count of durations <= obs_bounds_ns[i] (not cumulative) */
};

/* mw_pair_flow_slot.state */
enum mw_slot_state {
	MW_SLOT_FREE = 0,
	MW_SLOT_CLAIMING = 1, /* its key is being written: neither compared nor read */
	MW_SLOT_HELD = 2,
};

/* mw_pair_flow_slots value: one CPU's record of a pair flow (key), in the slot its key hashes to. */
struct mw_pair_flow_slot {
	enum mw_slot_state state;
	struct mw_pair_flow_key key;
	struct mw_flow flow;
};

/*
 * mw_sock.obs: what the observation knows of one socket, set when it
 * connects or is established (sock_ops), used by the TCP path (cgroup_skb)
 * and at close.
 */
struct mw_obs_sock {
	/* What every redirected message reads or writes (obs_msg) first: see struct mw_sock. */
	__u32 started;     /* observed since its connect or establishment (else unknown) */
	__u32 accelerated; /* its connection was paired (sk_msg saw it) */
	__u32 seq_set;     /* MW_SEQ_* bits (observe.h) */
	__u32 point;       /* enum mw_point */
	__u64 bytes;      /* payload bytes not yet added to mw_flows */
	__u64 flushed_ns; /* when they were last added */
	__u64 netns;
	struct mw_endpoint server;
	__u64 start_ns;   /* connect (failures) or established; 0 once its end was recorded */
	__u64 req_ns;     /* TCP path: a request in flight since (0: none) */
	__u64 app_req_ns; /* a client application's request not yet answered by a read */
	__u32 req_method; /* enum mw_method of the request in flight */
	__u32 req_egress; /* the request left through this socket (1) or arrived (0) */
	__u32 snd_next;   /* end of the highest segment sent / received: retransmitted */
	__u32 rcv_next;   /* segments are not parsed twice */
};

/* One socket's observation point as its connection keeps it (struct mw_obs_conn). */
struct mw_obs_side {
	__u64 netns;
	struct mw_endpoint server;
	enum mw_point point;
};

/*
 * What sk_msg observes of a paired connection (mw_conn.obs): a request in
 * flight and the bytes each side redirected. What a message reads or
 * writes comes first (see struct mw_conn).
 */
struct mw_obs_conn {
	__u64 sent[2];    /* bytes each side redirected, by role - 1 (each written by its own side only) */
	__u64 req_ns;
	__u32 req_role;   /* enum mw_role of the requesting side */
	__u32 req_method;
	__u32 points;     /* the two points' mw_pair_points id; 0: not interned yet */
	__u32 observed;   /* bit role - 1: that side's socket is observed (else its side is unset) */
	/*
	 * Each side's point, by role - 1 (obs_joins: the active side's when it
	 * creates the entry, the passive side's before PAIRED). An exchange is
	 * recorded for both in one mw_pair_flows record, and the active side's
	 * close gives a passive side that outlives it its last bytes at the
	 * passive point.
	 */
	struct mw_obs_side side[2];
	/*
	 * Of the other side's sent, what each side's flow has been given (by
	 * role - 1; claimed by cmpxchg: the side itself at a flush or its close,
	 * or the closing active side for a passive side that outlives it).
	 */
	__u64 seen[2];
};

/*
 * A slot of mw_conns, claimed by the active side at ESTABLISHED (pending_us):
 * a passive side established more than unpaired_timeout_ns later is not
 * paired. No timer of its own: a switch to TCP puts it on the leave poll's
 * list (mw_leave_polls, leave.h).
 */
struct mw_conn {
	/*
	 * The connection the slot holds (maps.h, conn_claim), written when
	 * claimed; state is set last and cleared first (when the connecting
	 * side closes), so a slot with state 0 holds no live connection. A
	 * lookup compares it with its own identity.
	 */
	struct mw_conn_id id;
	enum mw_conn_state state; /* changed only by cmpxchg, but when the slot is claimed or released */
	/*
	 * What every message reads or writes (redirect.h, observe.h), with the
	 * identity that the lookup has just compared, on one cache line
	 * (mw_conns is page-aligned and a slot a whole number of lines).
	 */
	__u32 to_tcp;
	__u32 last_sender;      /* role of the side that sent the last redirected message */
	__u32 same_netns;       /* both sockets in one network namespace (loopback) */
	struct mw_obs_conn obs;
	/*
	 * Kernel addresses of the two sockets (struct sock), for reading the
	 * peer's redirect queue depth with bpf_probe_read_kernel. Read only while
	 * the connection is PAIRED; a read after the peer was freed is harmless
	 * (probe reads do not fault, and a closed peer sends its writer to TCP
	 * whatever the value).
	 */
	__u64 active_sk;
	__u64 passive_sk;
	__u64 active_netns; /* netns cookie of the connecting socket */
	struct mw_endpoint active_local; /* what the passive side must see as its remote */
	struct mw_endpoint active_remote; /* the destination the application dialled (the tap's tuple) */
	/*
	 * A paired connection that continues on TCP as a whole (to_tcp set once,
	 * by cmpxchg, with to_tcp_reason): each side switches its direction on
	 * its next message, and both sockets leave mw_sock_map once nothing
	 * redirected can be in flight or unread (see on_leave_check).
	 */
	__u32 dir[2];           /* enum mw_dir, by role - 1 */
	enum mw_reason to_tcp_reason;
	/* Typed as the enums (4 bytes each) so they reach BTF: Go reads their names there. */
	enum mw_reason reason;           /* when PASSTHROUGH */
	enum mw_hop hop;                 /* written before state becomes PAIRED */
	__u32 active_is_sidecar;         /* the connecting socket belongs to the sidecar uid */
	__u32 pending_us;                /* when it became PENDING: mw_now_us(), wraps in 73 min */
	__u32 released_us;               /* when a socket last let go of it (MW_HOLD_RESERVED, MW_HOLD_LINGER lapse) */
	__u32 counted_out;               /* bit role - 1: that socket is counted out of accelerated_sockets (leave.h) */
	/*
	 * Of the slot, not of its connection (a claim clears everything from
	 * to_tcp up to here). probed: of this slot as a home (maps.h,
	 * conn_home): bit i set when a connection homed here took the slot i
	 * further (never cleared), so a lookup reads only those.
	 */
	__u32 probed;
	/*
	 * Who may still use the slot: MW_HOLD_* bits of its sockets, and the
	 * leave poll's listings (polls). It is claimed again only when both
	 * are 0, so a socket's index in mw_sock_map (maps.h, sock_index) names
	 * this connection's socket or none while either end may send.
	 */
	__u32 holders;
	__u32 polls;
};
_Static_assert(__builtin_offsetof(struct mw_conn, obs.observed) + sizeof(__u32) <= 64,
	       "what a message reads of mw_conn must fit its first cache line");
_Static_assert(sizeof(struct mw_conn) % 64 == 0, "an mw_conns slot must be a whole number of cache lines");

/*
 * mw_leave_clock's one value: the node's one leave poll timer (leave.h),
 * created by sock_ops at a pairing, started by a switch to TCP, re-armed by
 * itself while mw_leave_polls lists a connection.
 */
struct mw_leave_clock {
	struct bpf_timer timer;
	__u64 owner;  /* leave_clock_owner of the programs whose callback it runs */
	__u32 armed;  /* started and not fired yet (set by cmpxchg) */
	__u32 polls;  /* entries in mw_leave_polls */
};

/*
 * One redirected message as `meshwarp tap` sees it (mw_tap_ring), followed
 * by caplen payload bytes. Addresses are the connecting socket's view of the
 * connection for both directions, so both form one stream.
 */
struct mw_tap_rec {
	__u64 ts_ns;       /* bpf_ktime_get_ns */
	__u64 offset;      /* the sender's stream offset of the first byte */
	__u32 sender_isn1; /* the sender's initial sequence number + 1 */
	__u32 peer_isn1;   /* the receiver's */
	__u32 size;        /* bytes in the message */
	__u32 caplen;      /* bytes copied (snaplen) */
	__u32 hop;         /* enum mw_hop */
	__u32 from_active; /* sent by the connecting side */
	struct mw_endpoint src;
	struct mw_endpoint dst;
};

/* Tap counters (per CPU, the tap's own map). */
struct mw_tap_stats {
	__u64 records;
	__u64 ring_full; /* messages not recorded: the reader fell behind */
	__u64 cut;       /* messages longer than the snaplen (recorded cut) */
};

/*
 * Per-socket state (sk_storage), freed by the kernel with the socket. What
 * every redirected message reads or writes (redirect.h) comes first, then
 * what pairing, a switch to TCP and the close use: see struct mw_sock.
 */
struct mw_sk_state {
	__u32 decision; /* 0 = undecided, else enum mw_conn_state PAIRED/PASSTHROUGH */
	__u32 role;
	struct mw_conn_id conn; /* its connection (with conn_slot: conn_of) */
	__u32 conn_slot;        /* its connection's slot in mw_conns */
	enum mw_role peer_role; /* the peer's role: with conn_slot, its index in mw_sock_map (sock_index) */
	__u32 credit;    /* bytes it may still redirect before reading its peer's backlog again (redirect.h) */
	__u32 hop;
	__u64 sent;      /* bytes this socket redirected: its stream offset (the tap's sequence numbers) */
	__u64 redir_ns;  /* coarse clock at its last redirect (fin_order.h) */
	__u64 run_bytes; /* bytes of this socket's messages since its peer last sent */
	__u32 run_msgs;  /* and their count */
	/* The rest: at pairing, at a look at the peer's backlog, a switch to TCP and the close. */
	__u32 reason;
	__u64 peer_sk;   /* the peer's struct sock address (see struct mw_conn) */
	/*
	 * The redirect budget (redirect.h, over_budget): this direction's own,
	 * 0 until its first look at the peer's backlog (made by decide: empty
	 * before the first redirect); and that look's backlog and sent (low 32
	 * bits), to tell what the reader took since.
	 */
	__u32 budget;
	__u32 seen_backlog;
	__u32 seen_sent;
	__u8 holds;      /* the MW_HOLD_* bit this socket holds in its connection's slot, dropped at its close */
	__u8 paired;     /* counted in sockets_paired; sticks when decision later changes */
	__u8 left;       /* left mw_sock_map after its connection went to TCP (plain TCP since) */
	__u8 _pad;
};

/*
 * A program, named as the kernel names its task (comm) when it created the
 * socket; an accepted socket carries its listener's (mw_sock.prog, cloned).
 * Programs with the same name are one program here. mw_unfit_progs key.
 */
struct mw_prog {
	char comm[16];
};

/*
 * mw_sk_store value: all meshwarp keeps of one socket, in one allocation
 * (a socket-storage record costs an allocation and a memory-cgroup charge
 * per socket: short connections pay it per request). Created when the
 * socket is (mw_sock_create), or by pairing and observation for sockets
 * older than the agent; a listener's is copied to the sockets it accepts
 * (BPF_F_CLONE), whose pairing and observation parts start again at
 * establishment.
 */
struct mw_sock {
	struct mw_sk_state pair; /* pairing and the redirect (zero: never paired) */
	struct mw_obs_sock obs;  /* observation (obs.started 0: not observed) */
	struct mw_prog prog;     /* the program that created the socket (learning.h) */
};
/* pair_state returns &rec->pair as the record itself (and obs_msg the reverse). */
_Static_assert(__builtin_offsetof(struct mw_sock, pair) == 0, "mw_sock.pair must come first");
/*
 * A message reads a record's first two cache lines only, as the kernel
 * places it: sk_storage keeps the record at a line's start plus its 8-byte
 * map pointer (struct bpf_local_storage_elem.sdata, ____cacheline_aligned),
 * which the lookup reads anyway. Each further line is a cache miss per
 * message in a proxy with many connections (docs/BENCHMARKS.md section 38).
 * The pairing part's own first fields come before these.
 */
_Static_assert(__builtin_offsetof(struct mw_sock, obs.flushed_ns) + sizeof(__u64) <= 2 * 64 - 8,
	       "what a message reads of mw_sock must fit its first two cache lines");

/* Counters, one copy per CPU (summed by Go). Cumulative. */
struct mw_counters {
	/* What every redirected message adds to (redirect.h) first, together. */
	__u64 redirected_msgs;
	__u64 redirected_bytes;
	__u64 hop_msgs[MW_HOP_MAX];
	__u64 hop_bytes[MW_HOP_MAX];
	__u64 sockets_paired; /* sockets that joined a paired connection */
	__u64 sockets_closed; /* paired sockets that closed since */
	__u64 sockets_left;   /* paired sockets that left mw_sock_map when their connection went to TCP */
	__u64 sockhash_full;
	__u64 passthrough_msgs[MW_REASON_MAX];
	__u64 passthrough_bytes[MW_REASON_MAX];
	__u64 passthrough_conns[MW_REASON_MAX];
	__u64 hop_conns[MW_HOP_MAX];
	__u64 splice_socket_reads; /* splice(2) from a socket by a process in the cgroup */
	__u64 nat_port_remaps;     /* paired connections whose source port NAT rewrote on the way */
	__u64 unfit_calls[MW_REASON_MAX]; /* calls that taught a learned reason (see mw_unfit_procs) */
	/*
	 * Connecting sockets kept off mw_sock_map from the start (policy,
	 * splice_reader, no_local_peer) or taken out of it again, by the reason
	 * of their connection: from then on they are plain TCP sockets.
	 */
	__u64 sockets_removed[MW_REASON_MAX];
	__u64 flows_full; /* observations lost: mw_flows was full */
};

/*
 * mw_unfit_procs key and value: a process of the cgroup that did, on a
 * paired socket, what a redirect cannot honour (a learned reason).
 */
struct mw_unfit_key {
	__u32 tgid;
	__u32 reason; /* enum mw_reason */
};

struct mw_unfit_proc {
	char comm[16];
	__u64 calls;
};

/* mw_unfit_progs value: what the program did that a redirect cannot honour. */
struct mw_unfit_prog {
	__u32 reason;   /* enum mw_reason, the first one learned */
	__u32 pad;
	__u64 kept_off; /* its connections left to TCP for it since */
};

/* mw_port_policy values. */
enum mw_port_action {
	MW_PORT_INCLUDE = 1,
	MW_PORT_EXCLUDE = 2,
};

/* mw_policy_cfg value: whether include lists are in force ("only these"). */
struct mw_policy_cfg {
	__u32 include_ports_set;
	__u32 include_cidrs_set;
};

/* LPM trie key for CIDR policy (IPv4 as v4-mapped, prefix length + 96). */
struct mw_cidr_key {
	__u32 prefixlen;
	__u32 addr[4];
};

#endif /* MESHWARP_ACCEL_H */
