// SPDX-License-Identifier: Apache-2.0

package accel

import (
	"fmt"
	"io"
	"net"
	"net/netip"
	"runtime"
	"testing"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"

	"github.com/meshwarp/meshwarp/internal/testutil"
)

// BenchmarkPrivilegedSkmsgPerMessage: the BPF run time of mw_skmsg per
// redirected message (the kernel's run-time statistics), for a loopback
// ping-pong on one paired connection, by message size and for HTTP/1.1
// exchanges, with and without observation; on one connection, and going
// round 256 (each message finds its state cold, as in a proxy); with both
// ends on one CPU, and with the server's end on another (cpus=2: each CPU
// sleeps between its messages and finds the program's memory cold, as
// between an application and its sidecar). Reported as
// bpf-ns/msg; ns/op is the round trip.
//
//	go test -run '^$' -bench SkmsgPerMessage -benchtime 100000x ./internal/accel
func BenchmarkPrivilegedSkmsgPerMessage(b *testing.B) {
	testutil.RequirePrivileged(b)
	enableBPFStats(b)
	for _, observe := range []bool{false, true} {
		b.Run(fmt.Sprintf("observe=%v", observe), func(b *testing.B) {
			// One agent at a time: the next one takes the same pin directory.
			benchSkmsgSizes(b, startAgent(b, Config{Observe: observe}))
		})
	}
}

func benchSkmsgSizes(b *testing.B, a *Agent) {
	type exchange struct {
		name      string
		req, resp []byte // the client's message and the server's answer
	}
	var cases []exchange
	for _, size := range []int{64, 1024, 16384} {
		cases = append(cases, exchange{fmt.Sprintf("size=%d", size), make([]byte, size), make([]byte, size)})
	}
	// HTTP/1.1 both ways: with observation, each request and response is
	// timed with the precise clock and each response adds to a flow.
	pad := func(s string, n int) []byte { return append([]byte(s), make([]byte, n-len(s))...) }
	cases = append(cases, exchange{"http=64",
		pad("GET /echo HTTP/1.1\r\nHost: x\r\n\r\n", 64), pad("HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n", 64)})
	for _, ex := range cases {
		b.Run(ex.name, func(b *testing.B) {
			// conns > 1: the messages go round the connections, so that each
			// finds its sockets' state as cold as a proxy with many
			// connections does (one connection keeps it in the CPU's caches).
			for _, conns := range []int{1, 256} {
				b.Run(fmt.Sprintf("conns=%d", conns), func(b *testing.B) { benchSkmsgExchange(b, a, conns, ex.req, ex.resp, false) })
			}
			if runtime.NumCPU() > 1 {
				b.Run("conns=1/cpus=2", func(b *testing.B) { benchSkmsgExchange(b, a, 1, ex.req, ex.resp, true) })
			}
		})
	}
}

func benchSkmsgExchange(b *testing.B, a *Agent, conns int, req, resp []byte, twoCPUs bool) {
	ln := mustListen(b, "127.0.0.1:0")
	defer ln.Close()
	type pair struct{ c, s net.Conn }
	pairs := make([]pair, conns)
	for i := range pairs {
		c, s := acceptedPair(b, ln, dialer(ln.Addr().String()))
		defer c.Close()
		defer s.Close()
		if !inSockMap(b, a, c) || !inSockMap(b, a, s) {
			b.Fatalf("connection %d is not paired: the benchmark would not exercise the redirect", i)
		}
		pairs[i] = pair{c, s}
	}
	buf := make([]byte, max(len(req), len(resp)))
	echo := func(w, r net.Conn, msg []byte) {
		if _, err := w.Write(msg); err != nil {
			b.Fatal(err)
		}
		if _, err := io.ReadFull(r, buf[:len(msg)]); err != nil {
			b.Fatal(err)
		}
	}
	before, _ := a.objs.MwSkmsg.Stats()
	if !twoCPUs {
		b.ResetTimer()
		for i := range b.N {
			p := pairs[i%conns]
			echo(p.c, p.s, req)
			echo(p.s, p.c, resp)
		}
		b.StopTimer()
	} else {
		// The server's end answers from CPU 1, the client's end asks from CPU 0.
		served := make(chan error, 1)
		go func() {
			err := onCPU(1, func() error {
				sbuf := make([]byte, len(req))
				for i := range b.N {
					p := pairs[i%conns]
					if _, err := io.ReadFull(p.s, sbuf); err != nil {
						return err
					}
					if _, err := p.s.Write(resp); err != nil {
						return err
					}
				}
				return nil
			})
			if err != nil {
				for _, p := range pairs {
					p.s.Close() // the client's read ends instead of waiting for an answer
				}
			}
			served <- err
		}()
		err := onCPU(0, func() error {
			b.ResetTimer()
			for i := range b.N {
				p := pairs[i%conns]
				if _, err := p.c.Write(req); err != nil {
					return err
				}
				if _, err := io.ReadFull(p.c, buf[:len(resp)]); err != nil {
					return err
				}
			}
			b.StopTimer()
			return nil
		})
		if err != nil {
			for _, p := range pairs {
				p.c.Close() // the server's read ends instead of waiting for a question
			}
		}
		if serr := <-served; err == nil {
			err = serr
		}
		if err != nil {
			b.Fatal(err)
		}
	}
	after, _ := a.objs.MwSkmsg.Stats()
	if runs := after.RunCount - before.RunCount; runs > 0 {
		b.ReportMetric(float64((after.Runtime-before.Runtime).Nanoseconds())/float64(runs), "bpf-ns/msg")
	}
}

// onCPU runs f with the calling goroutine locked to its thread and the
// thread bound to cpu, and gives the thread back its CPUs after.
func onCPU(cpu int, f func() error) error {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	var was, on unix.CPUSet
	if err := unix.SchedGetaffinity(0, &was); err != nil {
		return err
	}
	on.Set(cpu)
	if err := unix.SchedSetaffinity(0, &on); err != nil {
		return err
	}
	defer unix.SchedSetaffinity(0, &was)
	return f()
}

// BenchmarkPrivilegedSegmentHooks: what the agent's cgroup_skb programs
// cost each segment of a connection it does not pair (its address
// excluded): a loopback ping-pong of 64-byte messages between two sockets
// of the agent's cgroup, with and without observation. Reported as
// bpf-ns/segment (the kernel's run-time statistics of the agent's
// cgroup_skb programs: a segment runs the egress programs at its sender
// and the ingress ones at its receiver) and segments/rt; ns/op is the
// round trip (noisy: the program dispatch, which the statistics do not
// count, shows there only).
//
//	go test -run '^$' -bench SegmentHooks -benchtime 200000x ./internal/accel
func BenchmarkPrivilegedSegmentHooks(b *testing.B) {
	testutil.RequirePrivileged(b)
	enableBPFStats(b)
	for _, observe := range []bool{false, true} {
		b.Run(fmt.Sprintf("observe=%v", observe), func(b *testing.B) {
			// Both sockets of the test's cgroup (it joins it at the start),
			// on an address the policy leaves to TCP.
			a := startAgent(b, Config{Observe: observe, Policy: Policy{ExcludeCIDRs: []netip.Prefix{netip.MustParsePrefix("127.0.0.2/32")}}})
			ln := mustListen(b, "127.0.0.2:0")
			defer ln.Close()
			c, s := acceptedPair(b, ln, dialer(ln.Addr().String()))
			defer c.Close()
			defer s.Close()
			hooks := []*ebpf.Program{a.objs.MwEgress, a.objs.MwEgressObs, a.objs.MwIngress, a.objs.MwIngressObs}
			egress := []*ebpf.Program{a.objs.MwEgress, a.objs.MwEgressObs}
			sum := func(progs []*ebpf.Program) (runs uint64, ns int64) {
				for _, p := range progs {
					if st, err := p.Stats(); err == nil {
						runs += st.RunCount
						ns += st.Runtime.Nanoseconds()
					}
				}
				return runs, ns
			}
			buf := make([]byte, 64)
			echo := func(w, r net.Conn) {
				if _, err := w.Write(buf); err != nil {
					b.Fatal(err)
				}
				if _, err := io.ReadFull(r, buf); err != nil {
					b.Fatal(err)
				}
			}
			_, ns0 := sum(hooks)
			seg0, _ := sum(egress)
			b.ResetTimer()
			for range b.N {
				echo(c, s)
				echo(s, c)
			}
			b.StopTimer()
			_, ns1 := sum(hooks)
			seg1, _ := sum(egress)
			if segs := seg1 - seg0; segs > 0 {
				b.ReportMetric(float64(ns1-ns0)/float64(segs), "bpf-ns/segment")
				b.ReportMetric(float64(segs)/float64(b.N), "segments/rt")

			}
		})
	}
}

// enableBPFStats turns the kernel's BPF run-time statistics on until b ends.
func enableBPFStats(b *testing.B) {
	stats, err := ebpf.EnableStats(uint32(unix.BPF_STATS_RUN_TIME))
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { stats.Close() })
}

// BenchmarkPrivilegedConnection: what the agent's programs cost one short
// connection on loopback, paired (127.0.0.1) and not paired (127.0.0.2,
// excluded by policy), with and without observation, and without an agent
// (agent=none): connect, one 100-byte request and its response, close.
// Reported as bpf-ns/conn (every program of the agent, from the kernel's
// run-time statistics), sockops-ns/conn and sockops-runs/conn; cpu-ns/conn
// is the test process's CPU time (client and server, with the softirq work
// they run), which also counts what the statistics do not: socket records
// and psocks allocated and freed, hooks called (a psock's release runs later
// in a kworker, in neither figure); ns/op is the connection's time (noisy).
// Compare each case with agent=none of the same run.
//
//	go test -run '^$' -bench Connection -benchtime 20000x ./internal/accel
func BenchmarkPrivilegedConnection(b *testing.B) {
	testutil.RequirePrivileged(b)
	enableBPFStats(b)
	b.Run("agent=none", func(b *testing.B) {
		testutil.EnterCgroup(b) // as the agents' cases: a cgroup's sockets cost more than the root's
		benchConnections(b, nil, "127.0.0.1:0")
	})
	for _, observe := range []bool{false, true} {
		b.Run(fmt.Sprintf("observe=%v", observe), func(b *testing.B) {
			a := startAgent(b, Config{Observe: observe, Policy: Policy{ExcludeCIDRs: []netip.Prefix{netip.MustParsePrefix("127.0.0.2/32")}}})
			for _, tc := range []struct{ name, addr string }{{"paired", "127.0.0.1:0"}, {"unpaired", "127.0.0.2:0"}} {
				b.Run(tc.name, func(b *testing.B) { benchConnections(b, a, tc.addr) })
			}
		})
	}
}

func benchConnections(b *testing.B, a *Agent, addr string) {
	ln := mustListen(b, addr)
	defer ln.Close()
	served := make(chan error, 1)
	go func() {
		buf := make([]byte, 100)
		for {
			s, err := ln.Accept()
			if err != nil {
				served <- nil
				return
			}
			_, err = io.ReadFull(s, buf)
			if err == nil {
				_, err = s.Write(buf)
			}
			if err == nil {
				_, err = io.Copy(io.Discard, s) // until the client's FIN
			}
			s.Close()
			if err != nil {
				served <- err
				return
			}
		}
	}()
	finish := func() {
		ln.Close()
		if err := <-served; err != nil {
			b.Fatal(err)
		}
	}
	if a == nil {
		cpu0 := processCPUNanos(b)
		dialRequests(b, ln.Addr().String())
		b.ReportMetric(float64(processCPUNanos(b)-cpu0)/float64(b.N), "cpu-ns/conn")
		finish()
		return
	}
	sockops := func() (uint64, int64) {
		st, err := a.objs.MwSockops.Stats()
		if err != nil {
			b.Fatal(err)
		}
		return st.RunCount, st.Runtime.Nanoseconds()
	}
	// The other programs a connection runs, each reported on its own.
	others := map[string]*ebpf.Program{
		"skmsg": a.objs.MwSkmsg, "setsockopt": a.objs.MwSetsockopt, "sock_create": a.objs.MwSockCreate,
		"egress": a.objs.MwEgress, "egress_obs": a.objs.MwEgressObs, "ingress": a.objs.MwIngress, "ingress_obs": a.objs.MwIngressObs,
	}
	runtimes := func() map[string]int64 {
		m := map[string]int64{}
		for name, p := range others {
			if st, err := p.Stats(); err == nil {
				m[name] = st.Runtime.Nanoseconds()
			}
		}
		return m
	}
	s0 := stats(b, a)
	r0, ns0 := sockops()
	p0 := runtimes()
	cpu0 := processCPUNanos(b)
	dialRequests(b, ln.Addr().String())
	cpu1 := processCPUNanos(b)
	s1 := stats(b, a)
	r1, ns1 := sockops()
	p1 := runtimes()
	finish()
	n := float64(b.N)
	b.ReportMetric(float64(cpu1-cpu0)/n, "cpu-ns/conn")
	b.ReportMetric((s1.BPFRunSeconds-s0.BPFRunSeconds)*1e9/n, "bpf-ns/conn")
	b.ReportMetric(float64(ns1-ns0)/n, "sockops-ns/conn")
	b.ReportMetric(float64(r1-r0)/n, "sockops-runs/conn")
	for name, v := range p1 {
		if d := float64(v-p0[name]) / n; d > 0 {
			b.ReportMetric(d, name+"-ns/conn")
		}
	}
}

// dialRequests times b.N connections to addr: connect, a 100-byte request,
// its response, close.
func dialRequests(b *testing.B, addr string) {
	buf := make([]byte, 100)
	b.ResetTimer()
	for range b.N {
		c, err := net.Dial("tcp", addr)
		if err != nil {
			b.Fatal(err)
		}
		if _, err := c.Write(buf); err != nil {
			b.Fatal(err)
		}
		if _, err := io.ReadFull(c, buf); err != nil {
			b.Fatal(err)
		}
		c.Close()
	}
	b.StopTimer()
}

// processCPUNanos is the CPU time (user and system) of this process so far.
func processCPUNanos(b *testing.B) int64 {
	var ru unix.Rusage
	if err := unix.Getrusage(unix.RUSAGE_SELF, &ru); err != nil {
		b.Fatal(err)
	}
	return ru.Utime.Nano() + ru.Stime.Nano()
}

// BenchmarkPrivilegedSetsockopt: what one setsockopt (TCP_NODELAY, as
// every Go dial and most proxies set it) costs a process of the agent's
// cgroup, without the agent and with it. The cgroup setsockopt hook
// (mw_setsockopt) locks the socket and copies the option around the
// program's run, which the kernel's run-time statistics do not count:
// ns/op is the whole call (noisy; compare the two in one run).
//
//	go test -run '^$' -bench Setsockopt -benchtime 1000000x ./internal/accel
func BenchmarkPrivilegedSetsockopt(b *testing.B) {
	testutil.RequirePrivileged(b)
	for _, agent := range []bool{false, true} {
		b.Run(fmt.Sprintf("agent=%v", agent), func(b *testing.B) {
			if agent {
				startAgent(b, Config{Observe: true})
			}
			ln := mustListen(b, "127.0.0.2:0")
			defer ln.Close()
			c, s := acceptedPair(b, ln, dialer(ln.Addr().String()))
			defer c.Close()
			defer s.Close()
			rc, err := c.(*net.TCPConn).SyscallConn()
			if err != nil {
				b.Fatal(err)
			}
			var serr error
			b.ResetTimer()
			if err := rc.Control(func(fd uintptr) {
				for i := 0; i < b.N && serr == nil; i++ {
					serr = unix.SetsockoptInt(int(fd), unix.IPPROTO_TCP, unix.TCP_NODELAY, 1)
				}
			}); err != nil {
				b.Fatal(err)
			}
			b.StopTimer()
			if serr != nil {
				b.Fatal(serr)
			}
		})
	}
}
