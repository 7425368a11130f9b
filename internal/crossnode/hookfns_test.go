// SPDX-License-Identifier: Apache-2.0

package crossnode

import (
	"strings"
	"testing"
)

func TestReadHookFunctions(t *testing.T) {
	kallsyms := `ffffffff81f5d800 t nf_nat_ipv4_pre_routing
ffffffff81f80b50 t nft_do_chain_ipv4
ffffffff820909d0 T ipt_do_table
ffffffff820909e0 T ipt_do_table_other
0000000000000000 t nft_do_chain_ipv6
ffffffffc0a01000 t ip6t_do_table	[ip6_tables]
garbage
`
	got, err := readHookFunctions(strings.NewReader(kallsyms))
	if err != nil {
		t.Fatal(err)
	}
	want := map[uint64]crossnodeMwXnHookfn{
		0xffffffff81f5d800: crossnodeMwXnHookfnMW_XN_HOOKFN_NAT,
		0xffffffff81f80b50: crossnodeMwXnHookfnMW_XN_HOOKFN_NFT_CHAIN,
		0xffffffff820909d0: crossnodeMwXnHookfnMW_XN_HOOKFN_XT_TABLE,
		0xffffffffc0a01000: crossnodeMwXnHookfnMW_XN_HOOKFN_XT_TABLE, // in a module
	}
	if len(got) != len(want) {
		t.Errorf("found %d functions, want %d (hidden addresses and other names skipped): %v", len(got), len(want), got)
	}
	for addr, kind := range want {
		if got[addr] != kind {
			t.Errorf("%#x: kind %d, want %d", addr, got[addr], kind)
		}
	}
}
