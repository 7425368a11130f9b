// SPDX-License-Identifier: Apache-2.0

package crossnode

import (
	"testing"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"

	"github.com/meshwarp/meshwarp/internal/testutil"
)

// loadUnpinned loads the cross-node object without pins, with the hook
// functions found in kallsyms (none yet where netfilter is modules that no
// rule loaded so far), for tests that run its programs.
func loadUnpinned(t testing.TB) *Agent {
	t.Helper()
	spec, err := loadCrossnode()
	if err != nil {
		t.Fatal(err)
	}
	for _, m := range spec.Maps {
		m.Pinning = ebpf.PinNone
	}
	a := &Agent{}
	if err := spec.LoadAndAssign(&a.objs, nil); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { a.objs.Close() })
	if err := a.refreshHookFunctions(); err != nil {
		t.Fatal(err)
	}
	return a
}

// TestPrivilegedNetfilterDigest: every kind of netfilter change a node can
// get changes the digest the programs compare (so the next packet takes
// the normal path), for nf_tables and legacy x_tables alike, in the family
// it concerns only; and nothing else does.
func TestPrivilegedNetfilterDigest(t *testing.T) {
	testutil.RequirePrivileged(t)
	a := loadUnpinned(t)
	ns := testutil.NewNetns(t, "xn-digest")
	digest := func() [2]uint32 {
		t.Helper()
		// As each scan does before it reads the digest: a command that
		// loaded a module (nf_tables, nft_chain_nat, iptable_nat where they
		// are modules) brought hook functions the programs learn now.
		if err := a.refreshHookFunctions(); err != nil {
			t.Fatal(err)
		}
		var d [2]uint32
		if err := ns.Do(func() (err error) { d, err = netfilterDigest(a.objs.MwXnHooks); return err }); err != nil {
			t.Fatal(err)
		}
		return d
	}
	last := digest()
	if again := digest(); again != last {
		t.Fatalf("the digest of an unchanged namespace moved: %x then %x", last, again)
	}
	steps := []struct {
		what   string
		family int // 0 IPv4, 1 IPv6
		cmd    []string
	}{
		{"nft: a new table and chain", 0, []string{"iptables-nft", "-A", "FORWARD", "-p", "udp", "-j", "ACCEPT"}},
		{"nft: a rule in an existing chain", 0, []string{"iptables-nft", "-A", "FORWARD", "-p", "tcp", "-j", "ACCEPT"}},
		{"nft: a rule deleted", 0, []string{"iptables-nft", "-D", "FORWARD", "-p", "tcp", "-j", "ACCEPT"}},
		{"nft: a chain's policy", 0, []string{"iptables-nft", "-P", "FORWARD", "DROP"}},
		{"nft: a NAT chain", 0, []string{"iptables-nft", "-t", "nat", "-A", "POSTROUTING", "-p", "udp", "-j", "ACCEPT"}},
		{"nft: a rule in an existing NAT chain", 0, []string{"iptables-nft", "-t", "nat", "-A", "POSTROUTING", "-p", "tcp", "-j", "RETURN"}},
		{"nft: IPv6 rule in a new table", 1, []string{"ip6tables-nft", "-A", "FORWARD", "-p", "udp", "-j", "ACCEPT"}},
		{"nft: IPv6 rule in an existing chain", 1, []string{"ip6tables-nft", "-A", "FORWARD", "-p", "tcp", "-j", "ACCEPT"}},
		{"legacy: a new table", 0, []string{"iptables-legacy", "-t", "mangle", "-A", "FORWARD", "-p", "udp", "-j", "ACCEPT"}},
		{"legacy: a rule in an existing table", 0, []string{"iptables-legacy", "-t", "mangle", "-A", "FORWARD", "-p", "tcp", "-j", "ACCEPT"}},
		{"legacy: a chain's policy", 0, []string{"iptables-legacy", "-t", "mangle", "-P", "FORWARD", "DROP"}},
		{"legacy: a NAT table", 0, []string{"iptables-legacy", "-t", "nat", "-A", "PREROUTING", "-p", "udp", "-j", "ACCEPT"}},
		{"legacy: a rule in an existing NAT table", 0, []string{"iptables-legacy", "-t", "nat", "-A", "PREROUTING", "-p", "tcp", "-j", "RETURN"}},
		{"legacy: IPv6 rule in a new table", 1, []string{"ip6tables-legacy", "-A", "FORWARD", "-p", "udp", "-j", "ACCEPT"}},
		{"legacy: IPv6 rule in an existing table", 1, []string{"ip6tables-legacy", "-A", "FORWARD", "-p", "tcp", "-j", "ACCEPT"}},
	}
	for _, s := range steps {
		testutil.Run(t, "ip", append([]string{"netns", "exec", ns.Name}, s.cmd...)...)
		now := digest()
		if now[s.family] == last[s.family] {
			t.Errorf("%s: the %s digest did not change (%x)", s.what, []string{"IPv4", "IPv6"}[s.family], now[s.family])
		}
		if other := 1 - s.family; now[other] != last[other] {
			t.Errorf("%s: the other family's digest changed too (%x -> %x): its packets would stop being redirected", s.what, last[other], now[other])
		}
		if again := digest(); again != now {
			t.Errorf("%s: the digest moved with no change: %x then %x", s.what, now, again)
		}
		last = now
	}
}

// BenchmarkNetfilterDigest: what the digest costs per packet, in a fresh
// namespace (br_netfilter's hooks only, where it is built in) and in one
// with filter, mangle and NAT tables of both iptables back ends.
//
//	go test ./internal/crossnode -run '^$' -bench NetfilterDigest
func BenchmarkNetfilterDigest(b *testing.B) {
	testutil.RequirePrivileged(b)
	a := loadUnpinned(b)
	ns := testutil.NewNetns(b, "xn-digest-bench")
	run := func(b *testing.B) {
		err := ns.Do(func() error {
			_, per, err := a.objs.MwXnHooks.Benchmark(digestFrame(unix.ETH_P_IP), b.N, nil)
			if err == nil {
				b.ReportMetric(float64(per.Nanoseconds()), "ns/packet")
			}
			return err
		})
		if err != nil {
			b.Fatal(err)
		}
	}
	b.Run("fresh", run)
	for _, cmd := range [][]string{
		{"iptables-nft", "-A", "FORWARD", "-p", "udp", "-j", "ACCEPT"},
		{"iptables-nft", "-t", "mangle", "-A", "PREROUTING", "-p", "udp", "-j", "ACCEPT"},
		{"iptables-nft", "-t", "nat", "-A", "POSTROUTING", "-p", "udp", "-j", "ACCEPT"},
		{"iptables-legacy", "-t", "raw", "-A", "PREROUTING", "-p", "udp", "-j", "ACCEPT"},
		{"iptables-legacy", "-t", "nat", "-A", "PREROUTING", "-p", "udp", "-j", "ACCEPT"},
	} {
		testutil.Run(b, "ip", append([]string{"netns", "exec", ns.Name}, cmd...)...)
	}
	b.Run("tables", run)
}
