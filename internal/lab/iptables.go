// SPDX-License-Identifier: Apache-2.0

package lab

import (
	"bufio"
	"context"
	"fmt"
	"strconv"
	"strings"
)

// Istio-style capture, in the nat table of each pod namespace. The chains
// always exist once the pod is built; capture on/off only adds or removes the
// two jumps from the built-in chains, so switching is two rules per pod.
const (
	chainOutput     = chainPrefix + "OUTPUT"      // from OUTPUT: pick what the app sends
	chainRedirect   = chainPrefix + "REDIRECT"    // -> outbound sidecar :15001
	chainInbound    = chainPrefix + "INBOUND"     // from PREROUTING: everything arriving
	chainInRedirect = chainPrefix + "IN_REDIRECT" // -> inbound sidecar :15006
)

// captureChains returns iptables-restore input (for --noflush) that (re)defines
// the lab's chains. Declaring a chain flushes it, so applying it twice gives
// the same rules: this is how `up` repairs a pod.
func captureChains(sidecarUID uint32) string {
	uid := strconv.FormatUint(uint64(sidecarUID), 10)
	var b strings.Builder
	b.WriteString("*nat\n")
	for _, c := range []string{chainOutput, chainRedirect, chainInbound, chainInRedirect} {
		fmt.Fprintf(&b, ":%s - [0:0]\n", c)
	}
	// Outbound: TCP not sent by the sidecar itself (else it would loop) and not
	// to loopback (the inbound sidecar's hop to the app, local admin traffic).
	fmt.Fprintf(&b, "-A %s -p tcp ! -d 127.0.0.0/8 -m owner ! --uid-owner %s -j %s\n", chainOutput, uid, chainRedirect)
	fmt.Fprintf(&b, "-A %s -p tcp -j REDIRECT --to-ports %d\n", chainRedirect, OutboundPort)
	// Inbound: every TCP connection arriving from outside the pod; nothing excluded.
	fmt.Fprintf(&b, "-A %s -p tcp -j %s\n", chainInbound, chainInRedirect)
	fmt.Fprintf(&b, "-A %s -p tcp -j REDIRECT --to-ports %d\n", chainInRedirect, InboundPort)
	b.WriteString("COMMIT\n")
	return b.String()
}

// jumpRules are the rules in built-in nat chains that switch capture on, as
// iptables arguments after "-t nat -A|-C|-D".
func jumpRules() [][]string {
	return [][]string{
		{"OUTPUT", "-p", "tcp", "-j", chainOutput},
		{"PREROUTING", "-p", "tcp", "-j", chainInbound},
	}
}

// iptablesCleanup turns `iptables -t nat -S` output into the argument lists
// that remove every rule jumping to a MESHWARP_ chain from a built-in chain,
// then flush and delete every MESHWARP_ chain. It works from what is there,
// not from what the lab meant to create, so it also cleans after a crash.
func iptablesCleanup(natRules string) [][]string {
	var jumps, chains [][]string
	sc := bufio.NewScanner(strings.NewReader(natRules))
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		switch {
		case len(f) == 2 && f[0] == "-N" && strings.HasPrefix(f[1], chainPrefix):
			chains = append(chains, []string{"-F", f[1]}, []string{"-X", f[1]})
		case len(f) > 2 && f[0] == "-A" && !strings.HasPrefix(f[1], chainPrefix) && jumpsToLab(f):
			jumps = append(jumps, append([]string{"-D"}, f[1:]...))
		}
	}
	// Deleting a chain needs it empty and unreferenced: jumps first, then all
	// flushes, then all deletes (lab chains reference each other).
	var flushes, deletes [][]string
	for _, c := range chains {
		if c[0] == "-F" {
			flushes = append(flushes, c)
		} else {
			deletes = append(deletes, c)
		}
	}
	return append(append(jumps, flushes...), deletes...)
}

func jumpsToLab(fields []string) bool {
	for i := 0; i+1 < len(fields); i++ {
		if (fields[i] == "-j" || fields[i] == "-g") && strings.HasPrefix(fields[i+1], chainPrefix) {
			return true
		}
	}
	return false
}

// installCapture (re)defines the lab chains in a pod.
func (r *runner) installCapture(ctx context.Context, netns string, uid uint32) error {
	if _, err := r.inNetnsStdin(ctx, netns, captureChains(uid), "iptables-restore", "--noflush"); err != nil {
		return fmt.Errorf("install capture chains in %s: %w", netns, err)
	}
	return nil
}

// setJumps adds (on) or removes (off) the capture jumps in a pod, idempotently.
func (r *runner) setJumps(ctx context.Context, netns string, on bool) error {
	for _, rule := range jumpRules() {
		present, err := r.jumpPresent(ctx, netns, rule)
		if err != nil {
			return err
		}
		switch {
		case on && !present:
			if _, err := r.inNetns(ctx, netns, "iptables", append([]string{"-w", "-t", "nat", "-A"}, rule...)...); err != nil {
				return fmt.Errorf("add capture jump in %s: %w", netns, err)
			}
		case !on && present:
			// Delete until absent: a crash between check and add can leave duplicates.
			for range 8 {
				if _, err := r.inNetns(ctx, netns, "iptables", append([]string{"-w", "-t", "nat", "-D"}, rule...)...); err != nil {
					break
				}
			}
			if still, err := r.jumpPresent(ctx, netns, rule); err != nil || still {
				return fmt.Errorf("remove capture jump %v in %s: still present", rule, netns)
			}
		}
	}
	return nil
}

func (r *runner) jumpPresent(ctx context.Context, netns string, rule []string) (bool, error) {
	_, err := r.inNetns(ctx, netns, "iptables", append([]string{"-w", "-t", "nat", "-C"}, rule...)...)
	if err == nil {
		return true, nil
	}
	if isExit(err, 1) { // iptables -C: 1 = rule absent
		return false, nil
	}
	return false, fmt.Errorf("check capture jump in %s: %w", netns, err)
}

// captureState reports whether both jumps are present in a pod.
func (r *runner) captureState(ctx context.Context, netns string) (bool, error) {
	for _, rule := range jumpRules() {
		ok, err := r.jumpPresent(ctx, netns, rule)
		if err != nil || !ok {
			return false, err
		}
	}
	return true, nil
}

// removeCapture deletes every lab rule and chain in a pod, from what is there.
func (r *runner) removeCapture(ctx context.Context, netns string) error {
	out, err := r.inNetns(ctx, netns, "iptables", "-w", "-t", "nat", "-S")
	if err != nil {
		return fmt.Errorf("list nat rules in %s: %w", netns, err)
	}
	var errs []error
	for _, args := range iptablesCleanup(out) {
		if _, err := r.inNetns(ctx, netns, "iptables", append([]string{"-w", "-t", "nat"}, args...)...); err != nil {
			errs = append(errs, err)
		}
	}
	if len(errs) > 0 {
		return fmt.Errorf("remove capture in %s: %w", netns, errs[0])
	}
	return nil
}
