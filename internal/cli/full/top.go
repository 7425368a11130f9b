// SPDX-License-Identifier: Apache-2.0

package full

import (
	"fmt"
	"io"
	"os"
	"slices"
	"strings"
	"text/tabwriter"
	"time"

	tea "charm.land/bubbletea/v2"
	"github.com/spf13/cobra"
	"golang.org/x/term"

	"github.com/meshwarp/meshwarp/internal/accel"
	"github.com/meshwarp/meshwarp/internal/cli"
	"github.com/meshwarp/meshwarp/internal/observe"
	"github.com/meshwarp/meshwarp/internal/top"
)

// topSnapshot is `meshwarp top --once --json`.
type topSnapshot struct {
	IntervalSeconds float64       `json:"interval_seconds"`
	Flows           []observe.Row `json:"flows"`
}

func newTopCommand(_ *cli.Global) *cobra.Command {
	var (
		pinDir   string
		interval time.Duration
		once     bool
		asJSON   bool
		sortBy   string
		filter   string
	)
	cmd := &cobra.Command{
		Use:   "top",
		Short: "Live view of the node's flows: requests/s, errors/s, latency, bytes/s, share accelerated",
		Long: `top shows what the applications of the agent's cgroup do, one row per client pod
and server address:port, from the running agent's observation:

  CLIENT    the client's pod (named network namespace), "host", or a process in
            an unnamed namespace; "(outside the cgroup)": a server application of
            the cgroup whose clients are not in it (the row is the server's view)
  SERVER    the address:port the client dialled (before the sidecar's capture)
  PROTO     http when HTTP/1.x exchanges were seen, else tcp
  REQ/S     HTTP requests per second; tcp: connections that ended per second
  ERR/S     HTTP 5xx; tcp: resets and failed connects
  P50, P99  HTTP request duration at the client's socket; tcp: connection lifetime
  BYTES/S   payload bytes, both directions
  ACCEL     share of requests (tcp: bytes) on accelerated connections
  HOP       sidecar when the client's pod sends through a sidecar, else direct

Keys: s cycles the sort (requests, errors, p99, bytes), / types a filter
(matches client, server or protocol; Enter ends it), c clears it, q quits.

--once samples one --interval and prints the rows (--json: {"flows": [...]} with
the keys client, server, protocol, requests_per_second, errors_per_second,
p50_seconds, p99_seconds, bytes_per_second, accelerated_share, hop).`,
		Example: `  meshwarp top
  meshwarp top --sort p99 --filter 8080
  meshwarp top --once --json | jq '.flows[] | select(.errors_per_second > 0)'`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if interval < 100*time.Millisecond || interval > time.Hour {
				return cli.UsageError("--interval %v: give 100ms..1h (default 1s)", interval)
			}
			if !slices.Contains(observe.SortOrders, sortBy) {
				return cli.UsageError("--sort %q: give one of %s", sortBy, strings.Join(observe.SortOrders, ", "))
			}
			if asJSON && !once {
				return cli.UsageError("--json prints one snapshot: add --once")
			}
			read := func() ([]accel.Flow, error) { return accel.ReadPinnedFlows(pinDir) }
			// Refuse at once when no agent observes (the live view would only show the error).
			first, err := read()
			if err != nil {
				return cli.WithExit(cli.ExitNotReady, err)
			}
			if !once {
				if f, ok := cmd.OutOrStdout().(*os.File); ok && !term.IsTerminal(int(f.Fd())) {
					return cli.UsageError("the live view needs a terminal: in scripts use --once (with --json for JSON)")
				}
				p := tea.NewProgram(top.New(read, interval, sortBy, filter),
					tea.WithContext(cmd.Context()), tea.WithInput(cmd.InOrStdin()), tea.WithOutput(cmd.OutOrStdout()))
				_, err := p.Run()
				return err
			}
			start := time.Now()
			select {
			case <-time.After(interval):
			case <-cmd.Context().Done():
				return cmd.Context().Err()
			}
			flows, err := read()
			if err != nil {
				return cli.WithExit(cli.ExitNotReady, err)
			}
			elapsed := time.Since(start).Seconds()
			rows := observe.Filter(observe.Rows(observe.Sub(flows, first), elapsed, observe.NetnsNames()), filter)
			observe.SortRows(rows, sortBy)
			if asJSON {
				if rows == nil {
					rows = []observe.Row{}
				}
				return cli.WriteJSON(cmd.OutOrStdout(), topSnapshot{IntervalSeconds: elapsed, Flows: rows})
			}
			printRows(cmd.OutOrStdout(), rows)
			return nil
		},
	}
	f := cmd.Flags()
	cli.AddPinDirFlag(cmd, &pinDir)
	f.DurationVar(&interval, "interval", time.Second, "refresh interval (--once: how long to sample)")
	f.BoolVar(&once, "once", false, "print one snapshot and exit")
	f.BoolVar(&asJSON, "json", false, `with --once: print JSON {"flows": [...]}`)
	f.StringVar(&sortBy, "sort", observe.SortRequests, "sort by "+strings.Join(observe.SortOrders, ", "))
	f.StringVar(&filter, "filter", "", "only rows whose client, server or protocol contains this")
	return cmd
}

func printRows(w io.Writer, rows []observe.Row) {
	if len(rows) == 0 {
		fmt.Fprintln(w, "no flow with activity in the interval (is traffic running in the agent's cgroup?)")
		return
	}
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "CLIENT\tSERVER\tPROTO\tREQ/S\tERR/S\tP50\tP99\tBYTES/S\tACCEL\tHOP")
	for _, r := range rows {
		fmt.Fprintf(tw, "%s\t%s\t%s\t%.1f\t%.1f\t%s\t%s\t%s\t%.0f%%\t%s\n", r.Client, r.Server, r.Protocol,
			r.RequestsPerSecond, r.ErrorsPerSecond, top.Duration(r.P50Seconds), top.Duration(r.P99Seconds),
			top.Bytes(r.BytesPerSecond), 100*r.AcceleratedShare, r.Hop)
	}
	tw.Flush()
}
