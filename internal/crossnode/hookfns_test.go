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

// TestPlaceHookFunctions: every function found gets a slot of its own that
// holds its address and kind where the programs look (hookSlot), for a
// kernel's worth of neighbouring addresses as kallsyms gives them; none
// found leaves the table empty (mult 0: nothing known).
func TestPlaceHookFunctions(t *testing.T) {
	kinds := []crossnodeMwXnHookfn{
		crossnodeMwXnHookfnMW_XN_HOOKFN_NFT_CHAIN,
		crossnodeMwXnHookfnMW_XN_HOOKFN_XT_TABLE,
		crossnodeMwXnHookfnMW_XN_HOOKFN_NAT,
	}
	found := map[uint64]crossnodeMwXnHookfn{}
	// As many as hookFunctions names, 16 bytes apart (functions in one object file) and in a module.
	for i := range len(hookFunctions) {
		addr := uint64(0xffffffff81f5d800) + uint64(i)*16
		if i%4 == 3 {
			addr = 0xffffffffc0a01000 + uint64(i)*0x40
		}
		found[addr] = kinds[i%len(kinds)]
	}
	table, err := placeHookFunctions(found)
	if err != nil {
		t.Fatal(err)
	}
	if table.Mult == 0 {
		t.Fatal("mult 0: the programs would know no function")
	}
	for addr, kind := range found {
		s := hookSlot(addr, table.Mult)
		if table.Addr[s] != addr || crossnodeMwXnHookfn(table.Kind[s]) != kind {
			t.Errorf("%#x: slot %d holds %#x kind %d, want kind %d", addr, s, table.Addr[s], table.Kind[s], kind)
		}
	}
	used := 0
	for _, a := range table.Addr {
		if a != 0 {
			used++
		}
	}
	if used != len(found) {
		t.Errorf("%d slots used for %d functions", used, len(found))
	}
	if empty, err := placeHookFunctions(nil); err != nil || empty.Mult != 0 {
		t.Errorf("none found: mult %#x, err %v; want 0, nil", empty.Mult, err)
	}
}

// TestLoadedModules: a module loaded, unloaded or loaded again elsewhere
// changes what refreshHookFunctions compares; a use count does not.
func TestLoadedModules(t *testing.T) {
	before := "nf_tables 356352 1 nft_chain_nat, Live 0xffffffffc0a00000\nnf_nat 61440 2 nft_chain_nat, Live 0xffffffffc09e0000\n"
	used := "nf_tables 356352 7 nft_chain_nat, Live 0xffffffffc0a00000\nnf_nat 61440 3 nft_chain_nat, Live 0xffffffffc09e0000\n"
	added := before + "nft_chain_nat 12288 1 - Live 0xffffffffc0c10000\n"
	moved := "nf_tables 356352 1 nft_chain_nat, Live 0xffffffffc0b00000\nnf_nat 61440 2 nft_chain_nat, Live 0xffffffffc09e0000\n"
	base := loadedModules([]byte(before))
	if loadedModules([]byte(used)) != base {
		t.Error("a use count changed the module list")
	}
	if loadedModules([]byte(added)) == base {
		t.Error("a module loaded since did not change the module list")
	}
	if loadedModules([]byte(moved)) == base {
		t.Error("a module loaded again at another address did not change the module list")
	}
	if loadedModules(nil) == "" {
		t.Error("no modules (or /proc/modules unreadable) reads as \"not read yet\": every scan would read kallsyms")
	}
}
