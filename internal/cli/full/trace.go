// SPDX-License-Identifier: Apache-2.0

package full

import (
	"fmt"
	"io"
	"slices"
	"strconv"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	"github.com/meshwarp/meshwarp/internal/accel"
	"github.com/meshwarp/meshwarp/internal/cli"
	"github.com/meshwarp/meshwarp/internal/observe"
)

func newTraceCommand(_ *cli.Global) *cobra.Command {
	var (
		pinDir   string
		duration time.Duration
		port     uint16
		asJSON   bool
	)
	cmd := &cobra.Command{
		Use:   "trace",
		Short: "Show where HTTP request time goes, hop by hop (reads the agent's observation)",
		Long: `trace samples the HTTP/1.x exchanges the running agent observes for --duration
and prints where the time of a request goes, from the client application inwards:

  socket -> client app          the response waits in the client's socket until the
                                client reads it (wakeup, read); observed while trace runs
  app -> sidecar (kernel)       client app's socket to the client sidecar and back
  client sidecar (proxy)        the client-side sidecar, receive to forward, both ways
  sidecar -> sidecar (kernel)   between the pods
  server sidecar (proxy)        the server-side sidecar
  sidecar -> app (kernel)       server sidecar to the server app and back
  server app                    the server application, request in to response out

Without sidecars the hop is "app -> app (kernel)". Each segment is the
difference between the mean durations at two observation points (the sockets
on either side of it), so the segments' means add up to client_mean_seconds,
the exchange as the client application saw it (request sent to its first read
of the response). p50/p99 of a segment are the
differences of the points' quantiles. On an accelerated hop the redirect
delivers a message when it is sent, so its kernel segment is ~0.

The sidecars' listening sockets see the capture port, not the port the client
dialled, so --port filters every other point and keeps those.`,
		Example: `  meshwarp trace
  meshwarp trace --duration 10s --port 8080
  meshwarp trace --json | jq '.segments[] | {name, mean_seconds}'`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if duration <= 0 || duration > time.Hour {
				return cli.UsageError("--duration %v: give 1s..1h (default 5s)", duration)
			}
			if _, err := accel.ReadPinnedFlows(pinDir); err != nil {
				return cli.WithExit(cli.ExitNotReady, err)
			}
			// The client application's reads, observed while trace samples.
			reads, err := accel.TraceReads(pinDir)
			if err != nil {
				fmt.Fprintf(cmd.ErrOrStderr(), "meshwarp trace: without the client application's read time: %v\n", err)
			} else {
				defer reads.Close()
			}
			before, err := accel.ReadPinnedFlows(pinDir)
			if err != nil {
				return cli.WithExit(cli.ExitNotReady, err)
			}
			if duration >= 2*time.Second {
				fmt.Fprintf(cmd.ErrOrStderr(), "meshwarp trace: sampling for %v ...\n", duration)
			}
			select {
			case <-time.After(duration):
			case <-cmd.Context().Done():
				return cmd.Context().Err()
			}
			after, err := accel.ReadPinnedFlows(pinDir)
			if err != nil {
				return cli.WithExit(cli.ExitNotReady, err)
			}
			flows := observe.Sub(after, before)
			b, err := observe.NewBreakdown(observe.ByPort(flows, port))
			if err != nil {
				return fmt.Errorf("%w in %v%s", err, duration, portHint(flows, port))
			}
			if asJSON {
				return cli.WriteJSON(cmd.OutOrStdout(), b)
			}
			printBreakdown(cmd.OutOrStdout(), b)
			return nil
		},
	}
	f := cmd.Flags()
	cli.AddPinDirFlag(cmd, &pinDir)
	f.DurationVar(&duration, "duration", 5*time.Second, "how long to sample")
	f.Uint16Var(&port, "port", 0, "only requests to this server port (default: all)")
	f.BoolVar(&asJSON, "json", false, "print JSON: segments (name, kind kernel|proxy|app, mean_seconds, p50_seconds, p99_seconds, count), client_mean_seconds, points")
	return cmd
}

// portHint names the ports that did see HTTP exchanges when --port saw none.
func portHint(flows []accel.Flow, port uint16) string {
	var seen []int
	for _, f := range flows {
		if f.Proto == "http" && f.Point == accel.PointClient && !slices.Contains(seen, int(f.Server.Port())) {
			seen = append(seen, int(f.Server.Port()))
		}
	}
	slices.Sort(seen)
	switch {
	case port != 0 && len(seen) > 0:
		return fmt.Sprintf(": no request to port %d; requests went to ports %v (pass one of them to --port)", port, seen)
	case port != 0:
		return fmt.Sprintf(": no request to port %d (is HTTP/1.x traffic running through the agent's cgroup?)", port)
	default:
		return " (is HTTP/1.x traffic running through the agent's cgroup?)"
	}
}

func printBreakdown(w io.Writer, b observe.Breakdown) {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "segment\tkind\tmean\tp50\tp99\tshare\trequests\t")
	var sum float64
	for _, s := range b.Segments {
		sum += s.MeanSeconds
		share := 0.0
		if b.ClientMeanSeconds > 0 {
			share = 100 * s.MeanSeconds / b.ClientMeanSeconds
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%.0f%%\t%d\t\n", s.Name, s.Kind, us(s.MeanSeconds), us(s.P50Seconds), us(s.P99Seconds), share, s.Count)
	}
	tw.Flush()
	fmt.Fprintf(w, "\nsum of segments %s = client mean %s over %d requests\n", us(sum), us(b.ClientMeanSeconds), b.ClientCount)
	var accelerated []string
	for _, p := range b.Points {
		if p.Accelerated > 0 {
			accelerated = append(accelerated, p.Name+" "+strconv.Itoa(int(100*p.Accelerated+0.5))+"%")
		}
	}
	if len(accelerated) > 0 {
		fmt.Fprintf(w, "accelerated (share of requests by point): %v\n", accelerated)
	}
}

// us renders seconds as microseconds.
func us(s float64) string { return fmt.Sprintf("%.1fus", s*1e6) }
