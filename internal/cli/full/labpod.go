// SPDX-License-Identifier: Apache-2.0

package full

import (
	"context"
	"errors"
	"fmt"
	"os/signal"
	"syscall"
	"time"

	"github.com/spf13/cobra"

	"github.com/meshwarp/meshwarp/internal/accel"
	"github.com/meshwarp/meshwarp/internal/cli"
	"github.com/meshwarp/meshwarp/internal/lab"
)

// newLabPodCommand runs the parts of a lab pod inside a container, so a real
// cluster's pods get exactly the lab's capture, sidecar and apps
// (test/cluster/demo.yaml). Hidden: it is plumbing for images, not for people.
func newLabPodCommand() *cobra.Command {
	cmd := &cobra.Command{
		Use:    "pod",
		Short:  "Run one part of a lab pod in a container: capture, sidecar, apps, client",
		Hidden: true,
		Args:   cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			return cmd.Help()
		},
		SilenceUsage: true,
	}
	uid := uint32(accel.DefaultSidecarUID)
	capture := &cobra.Command{
		Use:          "capture",
		Short:        "Install the lab's Istio-style capture rules in this network namespace (an init container)",
		Args:         cobra.NoArgs,
		SilenceUsage: true,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if err := lab.ApplyCapture(cmd.Context(), uid); err != nil {
				return err
			}
			fmt.Fprint(cmd.OutOrStdout(), lab.CaptureRules(uid))
			return nil
		},
	}
	capture.Flags().Uint32Var(&uid, "sidecar-uid", uid, "uid of the sidecar, whose traffic is not captured")

	var dir string
	sidecar := &cobra.Command{
		Use:          "sidecar",
		Short:        "Write the lab's HAProxy sidecar config into --dir and exec HAProxy",
		Args:         cobra.NoArgs,
		SilenceUsage: true,
		RunE: func(_ *cobra.Command, _ []string) error {
			return lab.ExecSidecar(dir, uid, uid, []int{lab.HTTPPort})
		},
	}
	sidecar.Flags().Uint32Var(&uid, "uid", uid, "uid (and gid) HAProxy runs as")
	sidecar.Flags().StringVar(&dir, "dir", "/tmp", "writable directory for the config and the stats socket")

	apps := &cobra.Command{
		Use:          "apps",
		Short:        "Serve the lab's apps: fortio HTTP echo :8080 and TCP echo :8078",
		Args:         cobra.NoArgs,
		SilenceUsage: true,
		RunE: func(cmd *cobra.Command, _ []string) error {
			ctx, stop := signal.NotifyContext(cmd.Context(), syscall.SIGTERM, syscall.SIGINT)
			defer stop()
			if err := lab.ServeApps(ctx, lab.AppsOptions{}); err != nil && !errors.Is(err, context.Canceled) {
				return err
			}
			return nil
		},
	}

	var o lab.ClientOptions
	client := &cobra.Command{
		Use:          "client",
		Short:        "Send HTTP requests, TCP echoes and streams to a server pod; print what came back as JSON",
		Args:         cobra.NoArgs,
		SilenceUsage: true,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if o.Server == "" {
				return errors.New("--server is required")
			}
			res := lab.RunClient(cmd.Context(), o)
			return cli.WriteJSON(cmd.OutOrStdout(), res)
		},
	}
	f := client.Flags()
	f.StringVar(&o.Server, "server", "", "server pod address")
	f.IntVar(&o.Requests, "requests", 0, "HTTP echo requests on one keep-alive connection")
	f.IntVar(&o.Echoes, "echoes", 0, "TCP echo round trips on one connection")
	f.IntVar(&o.Streams, "streams", 0, "concurrent streaming connections to the TCP echo")
	f.DurationVar(&o.Duration, "duration", 10*time.Second, "how long each stream writes")
	f.IntVar(&o.Size, "size", 1024, "bytes per write or request body")

	sleep := &cobra.Command{
		Use:          "sleep",
		Short:        "Wait for SIGTERM (the client pod's main container)",
		Args:         cobra.NoArgs,
		SilenceUsage: true,
		RunE: func(cmd *cobra.Command, _ []string) error {
			ctx, stop := signal.NotifyContext(cmd.Context(), syscall.SIGTERM, syscall.SIGINT)
			defer stop()
			<-ctx.Done()
			return nil
		},
	}
	cmd.AddCommand(capture, sidecar, apps, client, sleep)
	return cmd
}
