// SPDX-License-Identifier: Apache-2.0

//go:build vmtest

// This file lowers the node-wide tcp_mem: it is built only for the kernel
// matrix's VMs (scripts/vmtest.sh builds the test binary with -tags vmtest),
// never on a shared host.

package accel

import (
	"errors"
	"fmt"
	"net"
	"os"
	"strconv"
	"strings"
	"testing"

	"github.com/meshwarp/meshwarp/internal/testutil"
)

// tcpMemPages is what /proc/net/sockstat says TCP holds, in pages.
func tcpMemPages(t *testing.T) int64 {
	t.Helper()
	b, err := os.ReadFile("/proc/net/sockstat")
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(string(b), "\n") {
		if !strings.HasPrefix(line, "TCP:") {
			continue
		}
		f := strings.Fields(line)
		for i := 0; i+1 < len(f); i++ {
			if f[i] == "mem" {
				n, err := strconv.ParseInt(f[i+1], 10, 64)
				if err != nil {
					t.Fatal(err)
				}
				return n
			}
		}
	}
	t.Fatalf("no TCP mem in /proc/net/sockstat:\n%s", b)
	return 0
}

// lowTCPMem puts the node's TCP memory limits a few MB above what TCP holds
// now (pressure at +8 MB, hard limit at +16 MB), and back at the test's end.
func lowTCPMem(t *testing.T) {
	t.Helper()
	const file = "/proc/sys/net/ipv4/tcp_mem"
	old, err := os.ReadFile(file)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := os.WriteFile(file, old, 0o644); err != nil {
			t.Errorf("restore tcp_mem: %v", err)
		}
	})
	cur := tcpMemPages(t)
	limits := fmt.Sprintf("%d %d %d", cur+1024, cur+2048, cur+4096)
	if err := os.WriteFile(file, []byte(limits), 0o644); err != nil {
		t.Fatal(err)
	}
	t.Logf("tcp_mem %s (TCP holds %d pages)", limits, cur)
}

// At the node's TCP memory limit a writer waits, as on TCP; it never gets
// ENOMEM, and every byte arrives once the readers read. (The redirect's
// receive charge fails there: a redirect past the limit would return ENOMEM
// to the writer.)
func TestPrivilegedNodeMemoryPressureBlocksWriter(t *testing.T) {
	testutil.RequirePrivileged(t)
	const conns = 16
	const bound = 64 << 20
	forEachAgent(t, func(t *testing.T, a *Agent) {
		ln := mustListen(t, "127.0.0.1:0")
		defer ln.Close()
		var dirs []*streamDir
		for range conns {
			client, server := pairedConn(t, a, ln, dialer(ln.Addr().String()))
			defer client.Close()
			defer server.Close()
			dirs = append(dirs, &streamDir{w: client, r: server})
		}
		lowTCPMem(t)
		// Non-blocking writes on every connection until the kernel says
		// EAGAIN: nobody reads, so the node's TCP memory fills up.
		for i, d := range dirs {
			var err error
			if d.written, err = writeUntilBlocked(d.w, 0, bound); err != nil {
				t.Fatalf("connection %d: %v, node TCP memory %d pages (TCP waits here)", i, err, tcpMemPages(t))
			}
			if d.written >= bound {
				t.Fatalf("connection %d: a writer to a reader that never reads got rid of %d bytes without blocking", i, d.written)
			}
		}
		t.Logf("writers blocked; node TCP memory %d pages", tcpMemPages(t))
		// Each reader reads what its writer wrote, then EOF.
		errs := make(chan error, conns)
		for i, d := range dirs {
			go func() {
				err := d.w.(*net.TCPConn).CloseWrite()
				if err == nil {
					err = d.recv(d.written, false, true)
				}
				if err != nil {
					err = fmt.Errorf("connection %d: %w", i, err)
				}
				errs <- err
			}()
		}
		var all []error
		for range conns {
			all = append(all, <-errs)
		}
		if err := errors.Join(all...); err != nil {
			t.Fatal(err)
		}
		if a != nil {
			if s := stats(t, a); s.PassthroughConnections["backpressure"] == 0 {
				t.Errorf("no connection went to TCP for backpressure: %+v", nonZero(s.PassthroughConnections))
			}
		}
	})
}
