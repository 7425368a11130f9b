// SPDX-License-Identifier: Apache-2.0

package accel

import (
	"fmt"
	"strings"
)

// reasonDoc says what one passthrough reason (enum mw_reason) means, for
// people: `meshwarp status --help` and docs/ARCHITECTURE.md are made from
// these (TestReasonDocs ties them to ReasonNames).
type reasonDoc struct {
	name, text string
	// learned: taught by a process's call on an accelerated socket
	// (run --learn-from-syscalls); later connections on its port, and of its
	// program, stay on TCP.
	learned bool
	// note follows the reason, about it and those before it.
	note string
}

// reasonDocs lists every reason once, in the order people read them.
var reasonDocs = []reasonDoc{
	{name: "no_local_peer", text: "no listener of the attached cgroup answered this connection's SYN from the client's address: a remote server, a server outside the cgroup, or source NAT. The socket never joined the data path."},
	{name: "no_peer", text: "the first byte was sent before (or without) a local peer socket"},
	{name: "unpaired_timeout", text: "the peer socket did not join within the unpaired timeout"},
	{name: "peer_closed", text: "the peer socket had closed; TCP answers as without meshwarp"},
	{name: "sockhash_full", text: "--capacity reached"},
	{name: "sockmap_busy", text: "another program's sockmap already runs an sk_msg program on the socket"},
	{name: "key_collision", text: "two live connections drew the same identity (both left to TCP)"},
	{name: "addr_mismatch", text: "the peer saw another source address (SNAT): not provably a pair"},
	{name: "backpressure", text: "the receiver left more than its redirect budget unread (1 MB, grown for a reader that keeps up), or the node's TCP memory reached its pressure threshold (tcp_mem): that direction continues on TCP, whose flow control blocks the writer, and so does the whole connection: its sockets leave like small_stream's (with --keep-small-streams: that direction only, the sockets stay)"},
	{name: "small_stream", text: "one side wrote 16 messages without a message back, averaging under 32 KB (loopback) or 256 B (across pods): TCP coalesces such writes, the redirect pays per write, so the connection continues on TCP (run --keep-small-streams turns this off)"},
	{name: "send_shutdown", text: "a write after shutdown(SHUT_WR): TCP answers EPIPE (messages only)"},
	{name: "tcp_repair", text: "a socket in TCP_REPAIR mode (its sequence numbers prove nothing)"},
	{name: "rcvlowat", text: "SO_RCVLOWAT was set; the redirect ignores it"},
	{name: "peek_off", text: "SO_PEEK_OFF was set; the redirect's MSG_PEEK ignores the offset"},
	{name: "tcp_inq", text: "TCP_INQ was set; redirected bytes carry no TCP_CM_INQ message"},
	{name: "timestamp", text: "SO_TIMESTAMP(NS) or SO_TIMESTAMPING was set; redirected bytes carry no timestamps"},
	{name: "zerocopy", text: "SO_ZEROCOPY was set; MSG_ZEROCOPY completions never come for redirected bytes",
		note: "rcvlowat, peek_off, tcp_inq, timestamp and zerocopy are seen on the socket when it is established (set before connect(), or inherited from the listener) and, later, by a cgroup setsockopt hook: before any byte was redirected the connection simply stays on TCP; after, it moves to TCP at its next switch point and the ports and the program are learned for later connections"},
	{name: "policy", text: "excluded by port/CIDR policy (connections only)"},
	{name: "hint_missed", text: "both ends are in the cgroup, but no listener of the cgroup received the connecting socket's own SYN (its note was overwritten by other connects in flight, or the SYN took a path past the cgroup)"},
	{name: "early_data", text: "bytes were written before the connection was established (TCP Fast Open, a write racing connect): they went by TCP, so that direction stays on TCP"},
	{name: "splice_reader", learned: true, text: "read it with splice(2) (sees only the TCP queue)"},
	{name: "waitall_reader", learned: true, text: "recv(MSG_WAITALL) (the redirect queue returns what it holds)"},
	{name: "oob", learned: true, text: "SO_OOBINLINE set, or (learned) sent or read MSG_OOB: redirected bytes carry no urgent mark"},
	{name: "unread_close", learned: true, text: "closed it with unread bytes (TCP would send RST; the redirect path FIN)"},
	{name: "disconnect", learned: true, text: "connect(AF_UNSPEC) on it (the redirect queue outlives the connection)"},
	{name: "fionread_reader", learned: true, text: "ioctl(FIONREAD) on it, on kernels whose FIONREAD leaves out redirected bytes (6.1; see meshwarp probe)"},
}

// learnedWhat introduces the learned reasons.
const learnedWhat = "a process did this on an accelerated socket of the same port or program, which the redirect cannot honour; later connections on that port stay on TCP, and so does every later connection of that program (the task name that created the socket, or its listener), on any port"

// ReasonHelp returns what a passthrough reason means ("" for an unknown one).
func ReasonHelp(name string) string {
	for _, r := range reasonDocs {
		if r.name == name {
			return r.text
		}
	}
	return ""
}

// ReasonsHelp is the list of passthrough reasons for `meshwarp status
// --help`, wrapped to width columns: each reason indented by indent spaces,
// its text in a column after it.
func ReasonsHelp(indent, width int) string {
	var b strings.Builder
	pad := strings.Repeat(" ", indent)
	col := strings.Repeat(" ", indent+16)
	learned := false
	for _, r := range reasonDocs {
		if r.learned && !learned {
			learned = true
			for _, l := range wrap("learned (only with run --learn-from-syscalls): "+learnedWhat+":", width-indent+1) {
				b.WriteString(pad[1:] + l + "\n")
			}
		}
		lines := wrap(r.text, width-len(col))
		head := fmt.Sprintf("%s%-15s ", pad, r.name)
		if len(head) > len(col) {
			head = pad + r.name + " "
		}
		b.WriteString(head + lines[0] + "\n")
		for _, l := range lines[1:] {
			b.WriteString(col + l + "\n")
		}
		for _, l := range wrap(r.note, width-len(col)) {
			b.WriteString(col + l + "\n")
		}
	}
	return strings.TrimSuffix(b.String(), "\n")
}

// ReasonsMarkdown is the table of passthrough reasons in docs/ARCHITECTURE.md.
func ReasonsMarkdown() string {
	var b strings.Builder
	b.WriteString("| reason | why the connection or message took TCP |\n|---|---|\n")
	var learned, notes []string
	for _, r := range reasonDocs {
		fmt.Fprintf(&b, "| `%s` | %s |\n", r.name, r.text)
		if r.learned {
			learned = append(learned, "`"+r.name+"`")
		}
		if r.note != "" {
			notes = append(notes, r.note+".")
		}
	}
	fmt.Fprintf(&b, "\nLearned, only with run --learn-from-syscalls (%s): %s.\n", strings.Join(learned, ", "), learnedWhat)
	for _, n := range notes {
		b.WriteString("\n" + n + "\n")
	}
	return strings.TrimSuffix(b.String(), "\n")
}

// wrap splits s into lines of at most width columns, at spaces.
func wrap(s string, width int) []string {
	var lines []string
	line := ""
	for _, w := range strings.Fields(s) {
		if line != "" && len(line)+1+len(w) > width {
			lines = append(lines, line)
			line = ""
		}
		if line != "" {
			line += " "
		}
		line += w
	}
	if line != "" {
		lines = append(lines, line)
	}
	return lines
}
