// SPDX-License-Identifier: Apache-2.0

package cli

import (
	"fmt"
	"io"
	"strings"
	"text/tabwriter"

	"github.com/spf13/cobra"

	"github.com/meshwarp/meshwarp/internal/probe"
)

func newProbeCommand(g *Global) *cobra.Command {
	var (
		asJSON  bool
		noMount bool
		bpffs   string
	)
	cmd := &cobra.Command{
		Use:   "probe",
		Short: "Check that this kernel and process can accelerate; name what is missing and the fix",
		Long: `probe checks, for real, everything the acceleration data path needs and prints one
row per check (ok / missing / warn), the fix for anything not ok, and a verdict.

Checked:
  privileges     running as root; effective CAP_BPF, CAP_NET_ADMIN, CAP_PERFMON
                 (CAP_SYS_ADMIN covers the first and last; itself optional: mounting bpffs)
  memlock        RLIMIT_MEMLOCK removed where the kernel still applies it (< 5.11);
                 newer kernels charge BPF memory to the memory cgroup
  bpf syscall    creates and closes a map
  mounts         cgroup v2 (found in /proc/mounts; not always /sys/fs/cgroup),
                 bpffs at /sys/fs/bpf (mounted by the probe if missing) and writable
                 (creates and removes /sys/fs/bpf/meshwarp-probe-<pid>)
  BTF            /sys/kernel/btf/vmlinux
  program types  sock_ops, sk_msg; tracepoint (optional, observability)
  map types      SOCKMAP, HASH, PERCPU_ARRAY, ARRAY, LPM_TRIE, RINGBUF
  helpers        sock_ops: bpf_sock_map_update, bpf_get_netns_cookie, bpf_get_socket_cookie,
                 bpf_sock_ops_cb_flags_set, bpf_skc_to_tcp_sock;
                 sk_msg: bpf_msg_redirect_map, bpf_get_netns_cookie
  atomics        loads a program doing an atomic cmpxchg on a map value (Linux 5.12)
  links          sock_ops bpf_link on a throwaway child cgroup; sk_msg bpf_link on a
                 SOCKMAP (Linux 6.10, optional)

Then the features that differ between kernels (supported: Linux >= 6.1), each on
(and how) or off (and why):
  sk_msg attach     a pinned sockmap link (>= 6.10), else BPF_PROG_ATTACH to the pinned
                    SOCKMAP (6.1 .. 6.9)
  meshwarp tap      off before 6.10 (it swaps its program inside the sockmap link)
  cross-node        off without tcx links (< 6.6): --cross-node is ignored with a warning
  client read time  off without tracepoint sock:sock_recv_length (< 6.3): trace and
                    bench lack the client_app point
  receiver backlog  exact with sk_psock msg_tot_len (6.6.128+, 6.12.75+, 6.18.14+), else
                    counted from the first 64 queued messages

Everything the probe loads, attaches or creates is removed before it exits; the
only lasting change is the bpffs mount (skip it with --no-mount).

Exit status: 0 ready, 3 a required check is not ok (the verdict names it and
its fix), 2 bad flags.`,
		Example: `  meshwarp probe
  meshwarp probe --json | jq '.checks[] | select(.status != "ok")'`,
		Args: func(_ *cobra.Command, args []string) error {
			if len(args) > 0 {
				return UsageError("probe takes no arguments, got %q", args)
			}
			return nil
		},
		SilenceUsage: true,
		RunE: func(cmd *cobra.Command, _ []string) error {
			report := probe.Run(probe.Options{MountBPFFS: !noMount, BPFFSPath: bpffs})
			logger := g.Logger(cmd.ErrOrStderr()).With("subsys", "probe")
			for _, c := range report.Checks {
				logger.Debug("probe check", "name", c.Name, "status", c.Status, "required", c.Required, "detail", c.Detail)
			}
			out := cmd.OutOrStdout()
			if asJSON {
				if err := WriteJSON(out, report); err != nil {
					return fmt.Errorf("write report: %w", err)
				}
			} else if err := writeProbeTable(out, report); err != nil {
				return fmt.Errorf("write report: %w", err)
			}
			if !report.Ready {
				return WithExit(ExitNotReady, fmt.Errorf("probe: not ready (%d required checks not ok)", len(report.Missing())))
			}
			return nil
		},
	}
	cmd.Flags().BoolVar(&asJSON, "json", false, "print the report as JSON (keys: kernel, checks[name,status,detail,fix,required], ready, verdict, features[name,on,how,reason])")
	cmd.Flags().BoolVar(&noMount, "no-mount", false, "do not mount bpffs when it is missing (report it instead)")
	cmd.Flags().StringVar(&bpffs, "bpffs", probe.DefaultBPFFSPath, "bpffs directory meshwarp pins under")
	return cmd
}

// writeProbeTable prints one aligned row per check, then the verdict line.
func writeProbeTable(w io.Writer, r probe.Report) error {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "CHECK\tSTATUS\tNEED\tDETAIL")
	lastFix := ""
	for _, c := range r.Checks {
		need := "optional"
		switch {
		case c.Name == probe.CheckKernel:
			need = "info"
		case c.Required:
			need = "required"
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\n", c.Name, c.Status, need, oneLine(c.Detail))
		// A fix shared by consecutive rows (one cause, several symptoms) is
		// printed once, under the first of them.
		if c.Status != probe.StatusOK && c.Fix != "" && c.Fix != lastFix {
			fmt.Fprintf(tw, "\t\t\tfix: %s\n", oneLine(c.Fix))
		}
		if c.Status != probe.StatusOK {
			lastFix = c.Fix
		} else {
			lastFix = ""
		}
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	if err := writeFeatures(w, r.Features); err != nil {
		return err
	}
	_, err := fmt.Fprintf(w, "\n%s\n", r.Verdict)
	return err
}

// writeFeatures prints what differs on this kernel: each kernel-dependent
// feature, on (and how) or off (and why). `probe` and `status` share it.
func writeFeatures(w io.Writer, features []probe.Feature) error {
	if len(features) == 0 {
		return nil
	}
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "\nFEATURE (this kernel)\tSTATE\tHOW / WHY")
	for _, f := range features {
		state, text := "on", f.How
		if !f.On {
			state, text = "off", f.Reason
		} else if f.Reason != "" {
			text += "; " + f.Reason
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\n", f.Name, state, oneLine(text))
	}
	return tw.Flush()
}

func oneLine(s string) string { return strings.Join(strings.Fields(s), " ") }
