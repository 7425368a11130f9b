// SPDX-License-Identifier: Apache-2.0

package accel

import (
	"fmt"
	"testing"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"

	"github.com/meshwarp/meshwarp/internal/testutil"
)

// BenchmarkPrivilegedSkmsgPerMessage: the BPF run time of mw_skmsg per
// redirected message (the kernel's run-time statistics), for a loopback
// ping-pong on one paired connection, by message size, with and without
// observation. Reported as bpf-ns/msg; ns/op is the round trip.
//
//	go test -run '^$' -bench SkmsgPerMessage -benchtime 100000x ./internal/accel
func BenchmarkPrivilegedSkmsgPerMessage(b *testing.B) {
	testutil.RequirePrivileged(b)
	stats, err := ebpf.EnableStats(uint32(unix.BPF_STATS_RUN_TIME))
	if err != nil {
		b.Fatal(err)
	}
	defer stats.Close()
	for _, observe := range []bool{false, true} {
		b.Run(fmt.Sprintf("observe=%v", observe), func(b *testing.B) {
			// One agent at a time: the next one takes the same pin directory.
			benchSkmsgSizes(b, startAgent(b, Config{Observe: observe}))
		})
	}
}

func benchSkmsgSizes(b *testing.B, a *Agent) {
	for _, size := range []int{64, 1024, 16384} {
		b.Run(fmt.Sprintf("size=%d", size), func(b *testing.B) {
			ln := mustListen(b, "127.0.0.1:0")
			defer ln.Close()
			c, s := pairedConn(b, a, ln, dialer(ln.Addr().String()))
			defer c.Close()
			defer s.Close()
			buf := make([]byte, size)
			echo := func(w, r interface {
				Write([]byte) (int, error)
				Read([]byte) (int, error)
			}) {
				if _, err := w.Write(buf); err != nil {
					b.Fatal(err)
				}
				for got := 0; got < size; {
					n, err := r.Read(buf[got:])
					if err != nil {
						b.Fatal(err)
					}
					got += n
				}
			}
			before, _ := a.objs.MwSkmsg.Stats()
			b.ResetTimer()
			for range b.N {
				echo(c, s)
				echo(s, c)
			}
			b.StopTimer()
			after, _ := a.objs.MwSkmsg.Stats()
			if runs := after.RunCount - before.RunCount; runs > 0 {
				b.ReportMetric(float64((after.Runtime-before.Runtime).Nanoseconds())/float64(runs), "bpf-ns/msg")
			}
		})
	}
}
