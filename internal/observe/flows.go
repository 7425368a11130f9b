// SPDX-License-Identifier: Apache-2.0

package observe

import (
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/meshwarp/meshwarp/internal/accel"
)

// Row is one flow of the node as `meshwarp top` shows it: an application of
// the cgroup (by its pod, i.e. network namespace) talking to one server, or,
// when the client is outside the cgroup, what the server application saw
// (Client UnobservedClient). Rates are per second over the sampled interval.
type Row struct {
	Client string `json:"client"` // the client's pod (named network namespace) or process
	Server string `json:"server"` // the address:port the client dialled
	// Protocol is "http" when HTTP/1.x exchanges were seen, else "tcp".
	Protocol string `json:"protocol"`
	// RequestsPerSecond: HTTP exchanges; for tcp, connections that ended.
	RequestsPerSecond float64 `json:"requests_per_second"`
	// ErrorsPerSecond: HTTP 5xx; for tcp, resets and failed connects.
	ErrorsPerSecond float64 `json:"errors_per_second"`
	// P50Seconds and P99Seconds: HTTP request durations at the client's
	// socket; for tcp, connection lifetimes.
	P50Seconds     float64 `json:"p50_seconds"`
	P99Seconds     float64 `json:"p99_seconds"`
	BytesPerSecond float64 `json:"bytes_per_second"`
	// AcceleratedShare is the share of requests (tcp: bytes) on accelerated connections.
	AcceleratedShare float64 `json:"accelerated_share"`
	// Hop is "sidecar" when the client's pod has a sidecar capturing its
	// outbound connections (seen by the observation), else "direct".
	Hop string `json:"hop"`
}

// Sort orders for Rows.
const (
	SortRequests = "requests"
	SortErrors   = "errors"
	SortLatency  = "p99"
	SortBytes    = "bytes"
)

// SortOrders lists them.
var SortOrders = []string{SortRequests, SortErrors, SortLatency, SortBytes}

// rowAgg accumulates one row.
type rowAgg struct {
	http, tcp               hist
	errors, bytes, accBytes uint64
}

// Rows turns the flows of an interval of seconds into rows (only flows with
// activity), named by names (network namespace inode -> name).
func Rows(delta []accel.Flow, seconds float64, names map[uint64]string) []Row {
	type key struct {
		netns  uint64
		server string
	}
	clients := map[key]*rowAgg{}    // applications of the cgroup as clients
	servers := map[string]*rowAgg{} // applications as servers, for clients outside the cgroup
	sidecar := map[uint64]bool{}
	for _, f := range delta {
		var a *rowAgg
		switch f.Point {
		case accel.PointOutboundIn:
			sidecar[f.Netns] = true
			continue
		case accel.PointClient:
			k := key{f.Netns, f.Server.String()}
			if a = clients[k]; a == nil {
				a = &rowAgg{}
				clients[k] = a
			}
		case accel.PointServer:
			if a = servers[f.Server.String()]; a == nil {
				a = &rowAgg{}
				servers[f.Server.String()] = a
			}
		default:
			continue
		}
		a.add(f)
	}
	var rows []Row
	seen := map[string]bool{}
	for k, a := range clients {
		r := Row{Client: name(names, k.netns), Server: k.server, Hop: "direct"}
		if sidecar[k.netns] {
			r.Hop = "sidecar"
		}
		if a.fill(&r, seconds) {
			rows = append(rows, r)
			seen[k.server] = true
		}
	}
	// Servers whose clients the observation does not see (outside the cgroup).
	for server, a := range servers {
		r := Row{Client: UnobservedClient, Server: server, Hop: "-"}
		if !seen[server] && a.fill(&r, seconds) {
			rows = append(rows, r)
		}
	}
	SortRows(rows, SortRequests)
	return rows
}

// UnobservedClient names the client of a row seen only at its server (a
// client outside the agent's cgroup).
const UnobservedClient = "(outside the cgroup)"

func (a *rowAgg) add(f accel.Flow) {
	if f.Error() {
		a.errors += f.Count
	}
	switch {
	case f.Proto == "http":
		a.http.add(f)
		return
	case f.Outcome != "open" && f.Count > 0:
		a.tcp.add(f)
	}
	a.bytes += f.Bytes
	if f.Accelerated {
		a.accBytes += f.Bytes
	}
}

// fill sets r's values from a; false when there was no activity.
func (a *rowAgg) fill(r *Row, seconds float64) bool {
	h := &a.tcp
	r.Protocol = "tcp"
	if a.http.count > 0 {
		h, r.Protocol = &a.http, "http"
	}
	r.RequestsPerSecond = float64(h.count) / seconds
	r.ErrorsPerSecond = float64(a.errors) / seconds
	r.BytesPerSecond = float64(a.bytes) / seconds
	r.P50Seconds, r.P99Seconds = Quantile(h.buckets, 0.5), Quantile(h.buckets, 0.99)
	switch {
	case r.Protocol == "http":
		r.AcceleratedShare = float64(h.accelerated) / float64(h.count)
	case a.bytes > 0:
		r.AcceleratedShare = float64(a.accBytes) / float64(a.bytes)
	}
	return r.RequestsPerSecond > 0 || r.BytesPerSecond > 0
}

// SortRows orders rows by one of SortOrders, largest first.
func SortRows(rows []Row, by string) {
	val := func(r Row) float64 {
		switch by {
		case SortErrors:
			return r.ErrorsPerSecond
		case SortLatency:
			return r.P99Seconds
		case SortBytes:
			return r.BytesPerSecond
		}
		return r.RequestsPerSecond
	}
	slices.SortStableFunc(rows, func(a, b Row) int {
		if c := -cmpFloat(val(a), val(b)); c != 0 {
			return c
		}
		return strings.Compare(a.Client+a.Server, b.Client+b.Server)
	})
}

func cmpFloat(a, b float64) int {
	switch {
	case a < b:
		return -1
	case a > b:
		return 1
	}
	return 0
}

// Filter keeps the rows whose client, server or protocol contains s.
func Filter(rows []Row, s string) []Row {
	if s == "" {
		return rows
	}
	var out []Row
	for _, r := range rows {
		if strings.Contains(r.Client, s) || strings.Contains(r.Server, s) || strings.Contains(r.Protocol, s) {
			out = append(out, r)
		}
	}
	return out
}

func name(names map[uint64]string, ino uint64) string {
	if n, ok := names[ino]; ok {
		return n
	}
	return "netns:" + strconv.FormatUint(ino, 10)
}

// NetnsNames names network namespaces by inode: "host" for the initial one, the
// names of `ip netns` (/run/netns), else the command of a process inside
// ("pid 123 (nginx)").
func NetnsNames() map[uint64]string {
	names := map[uint64]string{}
	// kthreadd (PID 2) lives in the initial namespace: the node's own.
	if ino, err := nsInode("/proc/2/ns/net"); err == nil {
		names[ino] = "host"
	}
	if entries, err := os.ReadDir("/run/netns"); err == nil {
		for _, e := range entries {
			if ino, err := nsInode(filepath.Join("/run/netns", e.Name())); err == nil {
				names[ino] = e.Name()
			}
		}
	}
	procs, _ := os.ReadDir("/proc")
	for _, p := range procs {
		pid, err := strconv.Atoi(p.Name())
		if err != nil {
			continue
		}
		ino, err := nsInode(fmt.Sprintf("/proc/%d/ns/net", pid))
		if err != nil {
			continue
		}
		if _, ok := names[ino]; ok {
			continue
		}
		if cmdline, _ := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", pid)); len(cmdline) == 0 {
			continue // a kernel thread
		}
		comm, _ := os.ReadFile(fmt.Sprintf("/proc/%d/comm", pid))
		names[ino] = fmt.Sprintf("pid %d (%s)", pid, strings.TrimSpace(string(comm)))
	}
	return names
}

func nsInode(path string) (uint64, error) {
	var st unix.Stat_t
	if err := unix.Stat(path, &st); err != nil {
		return 0, err
	}
	return st.Ino, nil
}
