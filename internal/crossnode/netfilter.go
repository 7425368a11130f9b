// SPDX-License-Identifier: Apache-2.0

package crossnode

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"time"

	"github.com/google/nftables"
	"golang.org/x/sys/unix"
)

// Netfilter: a redirected packet never meets the node namespace's
// PREROUTING, FORWARD or POSTROUTING hooks (nor the bridge's, nor a netdev
// chain). So a family is redirected only while none of those hooks holds a
// rule or a drop policy: then no rule exists that could have changed a
// forwarded packet's fate. The pods' own rules (Istio's capture) are in the
// pods' namespaces and see every packet as before.
//
// The rulesets are read over netlink (nf_tables: nft and iptables-nft alike,
// no tool needed) and, for the legacy x_tables back end, from the names of
// the tables loaded in the namespace and iptables-legacy-save.

// nftChain is what the check needs of an nf_tables chain.
type nftChain struct {
	family nftables.TableFamily
	table  string
	name   string
	hook   *nftables.ChainHook // nil: a regular chain (reached only by a rule of a base chain)
	drop   bool                // base chain policy drop
	rules  int
}

// nftBlockers names, per family, every base chain on a hook forwarded
// packets traverse that has a rule or a drop policy. inet, bridge and netdev
// chains count for both families.
func nftBlockers(chains []nftChain) (v4, v6 []string) {
	for _, c := range chains {
		if c.hook == nil {
			continue
		}
		forwarding := false
		switch c.family {
		case nftables.TableFamilyNetdev:
			forwarding = true // ingress/egress of a device: before or after our programs
		default:
			switch *c.hook {
			case *nftables.ChainHookPrerouting, *nftables.ChainHookForward, *nftables.ChainHookPostrouting:
				forwarding = true
			}
		}
		if !forwarding || (c.rules == 0 && !c.drop) {
			continue
		}
		why := fmt.Sprintf("nft %s %s %s: %d rule(s)", familyName(c.family), c.table, c.name, c.rules)
		if c.drop {
			why += ", policy drop"
		}
		switch c.family {
		case nftables.TableFamilyIPv4:
			v4 = append(v4, why)
		case nftables.TableFamilyIPv6:
			v6 = append(v6, why)
		case nftables.TableFamilyINet, nftables.TableFamilyNetdev, nftables.TableFamilyBridge:
			v4, v6 = append(v4, why), append(v6, why)
		}
	}
	return v4, v6
}

func familyName(f nftables.TableFamily) string {
	switch f {
	case nftables.TableFamilyIPv4:
		return "ip"
	case nftables.TableFamilyIPv6:
		return "ip6"
	case nftables.TableFamilyINet:
		return "inet"
	case nftables.TableFamilyNetdev:
		return "netdev"
	case nftables.TableFamilyBridge:
		return "bridge"
	case nftables.TableFamilyARP:
		return "arp"
	}
	return fmt.Sprintf("family %d", f)
}

// readNftChains lists the nf_tables chains of the calling thread's
// namespace with their rule counts.
func readNftChains() ([]nftChain, error) {
	fd, err := unix.Open("/proc/thread-self/ns/net", unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, err
	}
	defer unix.Close(fd)
	c, err := nftables.New(nftables.WithNetNSFd(fd))
	if err != nil {
		return nil, err
	}
	chains, err := c.ListChains()
	if err != nil {
		return nil, fmt.Errorf("list nf_tables chains: %w", err)
	}
	var out []nftChain
	for _, ch := range chains {
		nc := nftChain{family: ch.Table.Family, table: ch.Table.Name, name: ch.Name, hook: ch.Hooknum}
		if ch.Policy != nil && *ch.Policy == nftables.ChainPolicyDrop {
			nc.drop = true
		}
		if nc.hook != nil {
			rules, err := c.GetRules(ch.Table, ch)
			if err != nil {
				return nil, fmt.Errorf("list rules of %s %s %s: %w", familyName(nc.family), nc.table, nc.name, err)
			}
			nc.rules = len(rules)
		}
		out = append(out, nc)
	}
	return out, nil
}

// forwardChains are the built-in iptables chains forwarded packets traverse.
var forwardChains = map[string]bool{"PREROUTING": true, "FORWARD": true, "POSTROUTING": true}

// iptablesBlockers reads iptables-save output and names every built-in
// forwarding chain that has a rule or a policy other than ACCEPT (a rule
// jumping to a user chain is a rule of the built-in chain).
func iptablesBlockers(save string) []string {
	var out []string
	table := ""
	rules := map[string]int{}
	flush := func() {
		for _, c := range []string{"PREROUTING", "FORWARD", "POSTROUTING"} {
			if n := rules[c]; n > 0 {
				out = append(out, fmt.Sprintf("legacy %s %s: %d rule(s)", table, c, n))
			}
		}
		rules = map[string]int{}
	}
	sc := bufio.NewScanner(strings.NewReader(save))
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		switch {
		case len(f) == 0 || strings.HasPrefix(f[0], "#"):
		case strings.HasPrefix(f[0], "*"):
			table = strings.TrimPrefix(f[0], "*")
		case f[0] == "COMMIT":
			flush()
		case strings.HasPrefix(f[0], ":") && len(f) >= 2:
			chain := strings.TrimPrefix(f[0], ":")
			if forwardChains[chain] && f[1] != "ACCEPT" && f[1] != "-" {
				out = append(out, fmt.Sprintf("legacy %s %s: policy %s", table, chain, f[1]))
			}
		case f[0] == "-A" && len(f) >= 2 && forwardChains[f[1]]:
			rules[f[1]]++
		}
	}
	flush()
	return out
}

// legacyBlockers checks the x_tables (legacy) tables of the calling
// thread's namespace: none loaded means no rule; loaded ones are read with
// the -legacy-save tool, and block the family when it is not installed.
func legacyBlockers(ctx context.Context, names, tool string) []string {
	b, err := os.ReadFile("/proc/thread-self/net/" + names)
	if err != nil || strings.TrimSpace(string(b)) == "" {
		return nil // module not loaded, or no table in this namespace
	}
	tables := strings.Fields(string(b))
	path, err := exec.LookPath(tool)
	if err != nil {
		return []string{fmt.Sprintf("legacy tables %v are loaded and %s is not installed to read them", tables, tool)}
	}
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	out, err := exec.CommandContext(ctx, path).Output()
	if err != nil {
		var ee *exec.ExitError
		if errors.As(err, &ee) && len(ee.Stderr) > 0 {
			err = fmt.Errorf("%w: %s", err, strings.TrimSpace(string(ee.Stderr)))
		}
		return []string{fmt.Sprintf("cannot read legacy tables %v: %s: %v", tables, tool, err)}
	}
	return iptablesBlockers(string(out))
}

// netfilterState is what the node's rulesets allow.
type netfilterState struct {
	v4, v6 []string // what blocks each family (empty: redirect allowed)
}

// readNetfilter inspects the rulesets of the calling thread's network
// namespace. Rules that cannot be read block their family, so a node is
// never redirected past rules nobody could check.
func readNetfilter(ctx context.Context) netfilterState {
	var st netfilterState
	chains, err := readNftChains()
	if err != nil {
		why := "cannot read nf_tables rules: " + err.Error()
		st.v4, st.v6 = []string{why}, []string{why}
	} else {
		st.v4, st.v6 = nftBlockers(chains)
	}
	st.v4 = append(st.v4, legacyBlockers(ctx, "ip_tables_names", "iptables-legacy-save")...)
	st.v6 = append(st.v6, legacyBlockers(ctx, "ip6_tables_names", "ip6tables-legacy-save")...)
	return st
}
