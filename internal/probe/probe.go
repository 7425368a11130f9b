// SPDX-License-Identifier: Apache-2.0

// Package probe detects whether this kernel and process can run meshwarp's
// acceleration (sock_ops + sk_msg + SOCKMAP attached to cgroup v2, state
// pinned on bpffs) and says what is missing and how to fix it.
//
// Every check that touches the kernel does so for real - it loads a tiny
// program, creates a map, attaches a link to a throwaway cgroup - and
// releases what it created before returning. The only lasting change Run can
// make is mounting bpffs when Options.MountBPFFS asks for it.
package probe

import (
	"errors"
	"fmt"
	"strings"
)

// Status is the outcome of one check.
type Status string

const (
	// StatusOK: present and usable.
	StatusOK Status = "ok"
	// StatusMissing: the kernel or machine lacks it.
	StatusMissing Status = "missing"
	// StatusWarn: could not be determined, or usable with a caveat.
	StatusWarn Status = "warn"
)

// Check is one row of the report.
type Check struct {
	Name   string `json:"name"`
	Status Status `json:"status"`
	Detail string `json:"detail,omitempty"`
	// Fix says what to do; set whenever Status is not ok.
	Fix string `json:"fix,omitempty"`
	// Required checks must be ok for acceleration to work; the others are
	// informational or needed by optional features (observability).
	Required bool `json:"required"`
}

// Report is the result of Run.
type Report struct {
	// Kernel is the running kernel's release (uname -r).
	Kernel string  `json:"kernel"`
	Checks []Check `json:"checks"`
	// Ready is true when every required check is ok.
	Ready bool `json:"ready"`
	// Verdict is a one-line human summary: "ready: ..." or "not ready: ...".
	Verdict string `json:"verdict"`
	// Features are the kernel-dependent parts: on (how) or off (why).
	Features []Feature `json:"features,omitempty"`
}

// Names of the checks other packages may look up with Report.Check.
const (
	CheckKernel        = "kernel"
	CheckRoot          = "root"
	CheckMemlock       = "memlock"
	CheckBPFSyscall    = "bpf syscall"
	CheckCgroup2       = "cgroup v2"
	CheckBPFFS         = "bpffs"
	CheckBPFFSWritable = "bpffs writable"
	CheckBTF           = "BTF"
	CheckAtomicCmpXchg = "atomic cmpxchg"
	CheckCgroupLink    = "link cgroup sock_ops"
	CheckSockmapLink   = "link sk_msg sockhash"
	CheckSpliceLimit   = "splice of accelerated sockets"
	CheckReceiveLimit  = "TCP receive semantics of accelerated sockets"
)

const verdictReady = "ready: this kernel can accelerate"

// maxNamesPerFix bounds how many check names the verdict lists before a fix.
const maxNamesPerFix = 4

// NewReport computes Ready and Verdict for checks.
func NewReport(kernel string, checks []Check) Report {
	r := Report{Kernel: kernel, Checks: checks}
	r.Ready = len(r.Missing()) == 0
	if r.Ready {
		r.Verdict = verdictReady
	} else {
		r.Verdict = notReadyText(r.Missing())
	}
	return r
}

// Missing returns the required checks that are not ok (missing, or not
// determinable), in report order.
func (r Report) Missing() []Check {
	var out []Check
	for _, c := range r.Checks {
		if c.Required && c.Status != StatusOK {
			out = append(out, c)
		}
	}
	return out
}

// Check returns the check called name.
func (r Report) Check(name string) (Check, bool) {
	for _, c := range r.Checks {
		if c.Name == name {
			return c, true
		}
	}
	return Check{}, false
}

// Err is nil when every required check is ok; otherwise a *NotReadyError
// whose message names every missing piece and its fix.
func (r Report) Err() error {
	missing := r.Missing()
	if len(missing) == 0 {
		return nil
	}
	return &NotReadyError{Missing: missing}
}

// NotReadyError says why this machine cannot accelerate.
type NotReadyError struct {
	Missing []Check
}

func (e *NotReadyError) Error() string { return notReadyText(e.Missing) }

// ErrNotReady is the one kind of "this machine cannot do it" refusal (a
// failed probe, a read-only bpffs, a missing package for the lab): wrap it,
// and the CLI exits with its "not ready" code. Any *NotReadyError matches it.
var ErrNotReady = errors.New("not ready")

// Is makes errors.Is(err, ErrNotReady) true.
func (e *NotReadyError) Is(target error) bool { return target == ErrNotReady }

// notReadyText groups the missing checks by fix, in order of first
// appearance, so one cause (say, not running as root) reads as one clause:
// "not ready: CAP_BPF, CAP_NET_ADMIN -- run as root; BTF -- ...".
func notReadyText(missing []Check) string {
	type group struct {
		fix   string
		names []string
	}
	var groups []*group
	byFix := map[string]*group{}
	for _, c := range missing {
		g, ok := byFix[c.Fix]
		if !ok {
			g = &group{fix: c.Fix}
			byFix[c.Fix] = g
			groups = append(groups, g)
		}
		g.names = append(g.names, c.Name)
	}
	clauses := make([]string, 0, len(groups))
	for _, g := range groups {
		names := g.names
		var more string
		if len(names) > maxNamesPerFix {
			more = fmt.Sprintf(" and %d more", len(names)-maxNamesPerFix)
			names = names[:maxNamesPerFix]
		}
		clause := strings.Join(names, ", ") + more
		if g.fix != "" {
			clause += " -- " + g.fix
		}
		clauses = append(clauses, clause)
	}
	return "not ready: " + strings.Join(clauses, "; ")
}
