// SPDX-License-Identifier: Apache-2.0

package crossnode

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os/exec"
	"strings"
	"time"
)

// Netfilter: a redirected packet never meets the node namespace's
// PREROUTING, FORWARD or POSTROUTING hooks (nor a netdev chain). So a family
// is redirected only while none of those hooks holds a rule or a policy
// other than accept: then no rule exists that could have changed a
// forwarded packet's fate. The pods' own rules (Istio's capture) are in the
// pods' namespaces and see every packet as before.

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
				out = append(out, fmt.Sprintf("%s %s: %d rule(s)", table, c, n))
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
				out = append(out, fmt.Sprintf("%s %s: policy %s", table, chain, f[1]))
			}
		case f[0] == "-A" && len(f) >= 2 && forwardChains[f[1]]:
			rules[f[1]]++
		}
	}
	flush()
	return out
}

// nftBlockers reads `nft -j list ruleset` and names, per family, every base
// chain on a forwarding hook (or any netdev chain) that has a rule or a drop
// policy. inet chains count for both families.
func nftBlockers(js []byte) (v4, v6 []string, err error) {
	var doc struct {
		Nftables []map[string]json.RawMessage `json:"nftables"`
	}
	if err := json.Unmarshal(js, &doc); err != nil {
		return nil, nil, fmt.Errorf("parse nft -j output: %w", err)
	}
	type chainKey struct{ family, table, name string }
	type chain struct {
		Family string `json:"family"`
		Table  string `json:"table"`
		Name   string `json:"name"`
		Hook   string `json:"hook"`
		Policy string `json:"policy"`
	}
	base := map[chainKey]chain{}
	rules := map[chainKey]int{}
	for _, obj := range doc.Nftables {
		if raw, ok := obj["chain"]; ok {
			var c chain
			if json.Unmarshal(raw, &c) == nil && c.Hook != "" {
				base[chainKey{c.Family, c.Table, c.Name}] = c
			}
		}
		if raw, ok := obj["rule"]; ok {
			var r struct {
				Family string `json:"family"`
				Table  string `json:"table"`
				Chain  string `json:"chain"`
			}
			if json.Unmarshal(raw, &r) == nil {
				rules[chainKey{r.Family, r.Table, r.Chain}]++
			}
		}
	}
	for k, c := range base {
		if c.Family != "netdev" && !forwardChains[strings.ToUpper(c.Hook)] {
			continue
		}
		var why string
		switch {
		case rules[k] > 0:
			why = fmt.Sprintf("nft %s %s %s (hook %s): %d rule(s)", c.Family, c.Table, c.Name, c.Hook, rules[k])
		case c.Policy == "drop":
			why = fmt.Sprintf("nft %s %s %s (hook %s): policy drop", c.Family, c.Table, c.Name, c.Hook)
		default:
			continue
		}
		switch c.Family {
		case "ip":
			v4 = append(v4, why)
		case "ip6":
			v6 = append(v6, why)
		case "inet", "netdev", "bridge":
			v4, v6 = append(v4, why), append(v6, why)
		}
	}
	return v4, v6, nil
}

// netfilterState is what the node's rulesets allow.
type netfilterState struct {
	v4, v6 []string // what blocks each family (empty: redirect allowed)
}

// readNetfilter inspects the rulesets of the calling thread's network
// namespace with every tool present: iptables (nft and legacy back ends)
// and nft. A family whose rules cannot be read is blocked, so a node is
// never redirected past rules nobody could check.
func readNetfilter(ctx context.Context) netfilterState {
	var st netfilterState
	run := func(name string, args ...string) ([]byte, bool, error) {
		path, err := exec.LookPath(name)
		if err != nil {
			return nil, false, nil
		}
		ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		defer cancel()
		out, err := exec.CommandContext(ctx, path, args...).Output()
		if err != nil {
			var ee *exec.ExitError
			if errors.As(err, &ee) && len(ee.Stderr) > 0 {
				err = fmt.Errorf("%w: %s", err, strings.TrimSpace(string(ee.Stderr)))
			}
			return nil, true, fmt.Errorf("%s: %w", name, err)
		}
		return out, true, nil
	}
	for _, fam := range []struct {
		list  *[]string
		tools []string
	}{
		{&st.v4, []string{"iptables-save", "iptables-legacy-save"}},
		{&st.v6, []string{"ip6tables-save", "ip6tables-legacy-save"}},
	} {
		found := false
		for _, tool := range fam.tools {
			out, ok, err := run(tool)
			if !ok {
				continue
			}
			found = true
			if err != nil {
				*fam.list = append(*fam.list, "cannot read rules: "+err.Error())
				continue
			}
			*fam.list = append(*fam.list, iptablesBlockers(string(out))...)
		}
		if !found {
			if _, err := exec.LookPath("nft"); err != nil {
				*fam.list = append(*fam.list, "cannot check the node's netfilter rules: neither iptables-save nor nft is installed")
			}
		}
	}
	out, ok, err := run("nft", "-j", "list", "ruleset")
	switch {
	case !ok:
	case err != nil:
		st.v4 = append(st.v4, "cannot read rules: "+err.Error())
		st.v6 = append(st.v6, "cannot read rules: "+err.Error())
	default:
		v4, v6, perr := nftBlockers(out)
		if perr != nil {
			v4, v6 = []string{perr.Error()}, []string{perr.Error()}
		}
		st.v4 = append(st.v4, v4...)
		st.v6 = append(st.v6, v6...)
	}
	return st
}
