// SPDX-License-Identifier: Apache-2.0

package crossnode

import (
	"bufio"
	"fmt"
	"io"
	"math/bits"
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

// refreshHookFunctions reads the hook functions again when the kernel's
// modules changed since the last read. Where nf_tables, nf_nat or x_tables
// are modules, they may load after the agent started (a node's first rules:
// kube-proxy starting after meshwarp), and their functions are then unknown
// to the programs until read: the rules behind them would be checked a scan
// later instead of at the next packet. Every scan calls it before it reads
// the digest it checks; Start reads them first. Without /proc/modules no
// module loads later: the first read stands.
func (a *Agent) refreshHookFunctions() error {
	mods, _ := os.ReadFile("/proc/modules") // unreadable: as an empty list, read once
	loaded := loadedModules(mods)
	a.hookMu.Lock()
	defer a.hookMu.Unlock()
	if a.hookModules != "" && loaded == a.hookModules {
		return nil
	}
	if _, err := a.loadHookFunctions(); err != nil {
		return err
	}
	a.hookModules = loaded
	return nil
}

// loadedModules names the modules of /proc/modules text with their load
// addresses ("name size refs deps state address ..."): a module unloaded and
// loaded again comes back elsewhere. Use counts change all the time and are
// left out. Never empty, so that "" means "not read yet".
func loadedModules(text []byte) string {
	var b strings.Builder
	b.WriteString("modules:")
	for _, line := range strings.Split(string(text), "\n") {
		f := strings.Fields(line)
		if len(f) < 6 {
			continue
		}
		b.WriteString(f[0])
		b.WriteByte('@')
		b.WriteString(f[5])
		b.WriteByte(' ')
	}
	return b.String()
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
	table, err := placeHookFunctions(found)
	if err != nil {
		return 0, err
	}
	if err := a.objs.MwXnHookfns.Put(uint32(0), &table); err != nil {
		return 0, fmt.Errorf("store the hook functions: %w", err)
	}
	return len(found), nil
}

// hookSlot is the slot of a hook function's address under mult, as the
// programs compute it (hookfn_kind in bpf/crossnode/netfilter.h).
func hookSlot(addr, mult uint64) int {
	slots := len(crossnodeMwXnHookfnTable{}.Addr)
	return int(addr * mult >> (64 - bits.TrailingZeros(uint(slots))))
}

// placeHookFunctions lays found out for the programs (struct mw_xn_hookfn_table):
// it tries odd multipliers until no two addresses share a slot, so that a
// packet tells an entry's kind with one compare. A handful of functions in
// 128 slots takes a few tries; none found leaves mult 0 (nothing known).
func placeHookFunctions(found map[uint64]crossnodeMwXnHookfn) (crossnodeMwXnHookfnTable, error) {
	var t crossnodeMwXnHookfnTable
	if len(found) == 0 {
		return t, nil
	}
	seed := uint64(0x9E3779B97F4A7C15)
	for try := 0; try < 1<<16; try++ {
		// splitmix64: a fixed sequence, so that a node gets the same layout each start.
		seed += 0x9E3779B97F4A7C15
		z := (seed ^ seed>>30) * 0xBF58476D1CE4E5B9
		z = (z ^ z>>27) * 0x94D049BB133111EB
		mult := (z ^ z>>31) | 1
		t = crossnodeMwXnHookfnTable{Mult: mult}
		placed := true
		for addr, kind := range found {
			s := hookSlot(addr, mult)
			if t.Addr[s] != 0 {
				placed = false
				break
			}
			t.Addr[s], t.Kind[s] = addr, uint32(kind)
		}
		if placed {
			return t, nil
		}
	}
	return crossnodeMwXnHookfnTable{}, fmt.Errorf("no layout of %d netfilter hook functions in %d slots", len(found), len(t.Addr))
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
