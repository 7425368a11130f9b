// SPDX-License-Identifier: Apache-2.0

package crossnode

import (
	"context"
	"os/exec"
	"strings"
	"testing"

	"github.com/meshwarp/meshwarp/internal/testutil"
)

// The node check reads real rulesets of a namespace: iptables with its
// nf_tables back end (read over netlink) and the legacy one (tables loaded
// in the namespace, read with iptables-legacy-save).
func TestPrivilegedReadNetfilter(t *testing.T) {
	testutil.RequirePrivileged(t)
	for _, tool := range []string{"iptables-nft", "iptables-legacy", "ip6tables-nft", "ip6tables-legacy"} {
		if _, err := exec.LookPath(tool); err != nil {
			t.Fatalf("%s not installed: run scripts/install-deps.sh --test", tool)
		}
	}
	ns := testutil.NewNetns(t, "xn-nf")
	read := func() netfilterState {
		t.Helper()
		var st netfilterState
		if err := ns.Do(func() error { st = readNetfilter(context.Background()); return nil }); err != nil {
			t.Fatal(err)
		}
		return st
	}
	run := func(args ...string) {
		t.Helper()
		testutil.Run(t, "ip", append([]string{"netns", "exec", ns.Name}, args...)...)
	}
	if st := read(); len(st.v4) > 0 || len(st.v6) > 0 {
		t.Fatalf("a fresh namespace blocks: %+v", st)
	}
	// Listing creates empty tables with accept policies: still nothing.
	run("iptables-nft", "-w", "-L", "-n")
	run("iptables-legacy", "-w", "-t", "nat", "-L", "-n")
	if st := read(); len(st.v4) > 0 || len(st.v6) > 0 {
		t.Fatalf("empty tables block: %+v", st)
	}
	for _, c := range []struct {
		add, del []string
		v4, v6   string // what must block the family ("" = nothing)
	}{
		{[]string{"iptables-nft", "-w", "-A", "FORWARD", "-p", "tcp", "--dport", "80", "-j", "DROP"},
			[]string{"iptables-nft", "-w", "-D", "FORWARD", "-p", "tcp", "--dport", "80", "-j", "DROP"}, "FORWARD", ""},
		{[]string{"iptables-nft", "-w", "-P", "FORWARD", "DROP"}, []string{"iptables-nft", "-w", "-P", "FORWARD", "ACCEPT"}, "policy drop", ""},
		{[]string{"ip6tables-nft", "-w", "-t", "mangle", "-A", "POSTROUTING", "-j", "ACCEPT"},
			[]string{"ip6tables-nft", "-w", "-t", "mangle", "-D", "POSTROUTING", "-j", "ACCEPT"}, "", "POSTROUTING"},
		{[]string{"iptables-legacy", "-w", "-t", "nat", "-A", "PREROUTING", "-p", "tcp", "--dport", "81", "-j", "DNAT", "--to-destination", "10.0.0.1"},
			[]string{"iptables-legacy", "-w", "-t", "nat", "-D", "PREROUTING", "-p", "tcp", "--dport", "81", "-j", "DNAT", "--to-destination", "10.0.0.1"}, "legacy nat PREROUTING", ""},
		// INPUT and OUTPUT rules never meet forwarded packets.
		{[]string{"iptables-nft", "-w", "-A", "INPUT", "-j", "DROP"}, []string{"iptables-nft", "-w", "-D", "INPUT", "-j", "DROP"}, "", ""},
	} {
		run(c.add...)
		st := read()
		run(c.del...)
		for _, fam := range []struct {
			got  []string
			want string
		}{{st.v4, c.v4}, {st.v6, c.v6}} {
			got := strings.Join(fam.got, "; ")
			if (fam.want == "") != (got == "") || !strings.Contains(got, fam.want) {
				t.Errorf("%v: blockers %q, want one naming %q", c.add, got, fam.want)
			}
		}
		if st := read(); len(st.v4) > 0 || len(st.v6) > 0 {
			t.Errorf("after %v: still blocked: %+v", c.del, st)
		}
	}
}
