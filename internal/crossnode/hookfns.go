// SPDX-License-Identifier: Apache-2.0

package crossnode

import (
	"bufio"
	"fmt"
	"io"
	"os"
	"strconv"
	"strings"
)

// hookFunctions are the netfilter hook functions whose priv the programs
// know how to read (enum mw_xn_hookfn): for these, a rule or policy change
// in an existing chain or table is seen by the very next packet. Names
// differ between kernels; a missing one only means the changes behind it
// are seen at the next check.
var hookFunctions = map[string]crossnodeMwXnHookfn{
	"nft_do_chain_ipv4":       crossnodeMwXnHookfnMW_XN_HOOKFN_NFT_CHAIN,
	"nft_do_chain_ipv6":       crossnodeMwXnHookfnMW_XN_HOOKFN_NFT_CHAIN,
	"nft_do_chain_inet":       crossnodeMwXnHookfnMW_XN_HOOKFN_NFT_CHAIN,
	"nft_nat_do_chain":        crossnodeMwXnHookfnMW_XN_HOOKFN_NFT_CHAIN,
	"ipt_do_table":            crossnodeMwXnHookfnMW_XN_HOOKFN_XT_TABLE,
	"ip6t_do_table":           crossnodeMwXnHookfnMW_XN_HOOKFN_XT_TABLE,
	"iptable_mangle_hook":     crossnodeMwXnHookfnMW_XN_HOOKFN_XT_TABLE,
	"ip6table_mangle_hook":    crossnodeMwXnHookfnMW_XN_HOOKFN_XT_TABLE,
	"iptable_nat_do_chain":    crossnodeMwXnHookfnMW_XN_HOOKFN_XT_TABLE,
	"ip6table_nat_do_chain":   crossnodeMwXnHookfnMW_XN_HOOKFN_XT_TABLE,
	"nf_nat_ipv4_pre_routing": crossnodeMwXnHookfnMW_XN_HOOKFN_NAT,
	"nf_nat_ipv4_local_in":    crossnodeMwXnHookfnMW_XN_HOOKFN_NAT,
	"nf_nat_ipv4_out":         crossnodeMwXnHookfnMW_XN_HOOKFN_NAT,
	"nf_nat_ipv4_local_fn":    crossnodeMwXnHookfnMW_XN_HOOKFN_NAT,
	"nf_nat_ipv4_fn":          crossnodeMwXnHookfnMW_XN_HOOKFN_NAT,
	"nf_nat_ipv6_in":          crossnodeMwXnHookfnMW_XN_HOOKFN_NAT,
	"nf_nat_ipv6_out":         crossnodeMwXnHookfnMW_XN_HOOKFN_NAT,
	"nf_nat_ipv6_local_fn":    crossnodeMwXnHookfnMW_XN_HOOKFN_NAT,
	"nf_nat_ipv6_fn":          crossnodeMwXnHookfnMW_XN_HOOKFN_NAT,
}

// loadHookFunctions tells the programs where the known hook functions are,
// from /proc/kallsyms. It returns how many it found: none (kallsyms hidden,
// kptr_restrict) leaves every hook list known by its entries only.
func (a *Agent) loadHookFunctions() (int, error) {
	f, err := os.Open("/proc/kallsyms")
	if err != nil {
		return 0, nil
	}
	defer f.Close()
	found, err := readHookFunctions(f)
	if err != nil {
		return 0, err
	}
	for addr, kind := range found {
		if err := a.objs.MwXnHookfns.Put(addr, uint32(kind)); err != nil {
			return 0, fmt.Errorf("store hook function %#x: %w", addr, err)
		}
	}
	return len(found), nil
}

// readHookFunctions finds hookFunctions in kallsyms text ("addr type name
// [module]"); zero addresses (hidden) are skipped.
func readHookFunctions(r io.Reader) (map[uint64]crossnodeMwXnHookfn, error) {
	found := map[uint64]crossnodeMwXnHookfn{}
	sc := bufio.NewScanner(r)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) < 3 {
			continue
		}
		kind, ok := hookFunctions[fields[2]]
		if !ok {
			continue
		}
		addr, err := strconv.ParseUint(fields[0], 16, 64)
		if err != nil || addr == 0 {
			continue
		}
		found[addr] = kind
	}
	return found, sc.Err()
}
