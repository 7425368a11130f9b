// SPDX-License-Identifier: Apache-2.0

package lab

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"strconv"
	"syscall"

	"fortio.org/fortio/fhttp"
	"fortio.org/fortio/fnet"
	flog "fortio.org/log"
)

// serveAppsHelper is the helper the lab re-executes in every server pod
// (`<exe> lab serve-apps ...`, see reexec.go).
const serveAppsHelper = "serve-apps"

func init() {
	HandleReexec(serveAppsHelper, []string{"lab", "serve-apps"}, func(args []string) int {
		return serveAppsMain(args, os.Stderr)
	})
}

// AppsOptions are the ports of the apps a server pod runs.
type AppsOptions struct {
	HTTPPort    int // fortio HTTP echo server (fhttp: echo on /, debug page on /debug)
	TCPEchoPort int // fortio TCP echo server (fnet)
}

// ServeApps runs fortio's HTTP echo and TCP echo servers (fortio as a library)
// in the current network namespace until ctx is done. It is what
// `meshwarp lab serve-apps` runs inside each server pod. Both listen on the
// wildcard address ([::], dual stack), so IPv4 peers appear v4-mapped.
func ServeApps(ctx context.Context, opts AppsOptions) error {
	if opts.HTTPPort == 0 {
		opts.HTTPPort = HTTPPort
	}
	if opts.TCPEchoPort == 0 {
		opts.TCPEchoPort = TCPEchoPort
	}
	// fortio logs per request at Info on its debug page; keep the log to what matters.
	flog.SetLogLevelQuiet(flog.Warning)
	if _, addr := fhttp.Serve(strconv.Itoa(opts.HTTPPort), "/debug"); addr == nil {
		return fmt.Errorf("fortio http echo: cannot listen on :%d (see log above)", opts.HTTPPort)
	}
	if addr := fnet.TCPEchoServer("tcp-echo", strconv.Itoa(opts.TCPEchoPort)); addr == nil {
		return fmt.Errorf("fortio tcp echo: cannot listen on :%d (see log above)", opts.TCPEchoPort)
	}
	fmt.Fprintf(os.Stderr, "meshwarp lab apps: http echo :%d, tcp echo :%d\n", opts.HTTPPort, opts.TCPEchoPort)
	<-ctx.Done()
	return nil
}

// serveAppsMain is the helper's entry point: args are "--http-port N --tcp-port M".
func serveAppsMain(args []string, stderr io.Writer) int {
	fs := flag.NewFlagSet("serve-apps", flag.ContinueOnError)
	fs.SetOutput(stderr)
	var o AppsOptions
	fs.IntVar(&o.HTTPPort, "http-port", HTTPPort, "fortio HTTP echo port")
	fs.IntVar(&o.TCPEchoPort, "tcp-port", TCPEchoPort, "fortio TCP echo port")
	if err := fs.Parse(args); err != nil {
		return 2
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, os.Interrupt)
	defer stop()
	if err := ServeApps(ctx, o); err != nil && !errors.Is(err, context.Canceled) {
		fmt.Fprintf(stderr, "meshwarp lab serve-apps: %v\n", err)
		return 1
	}
	return 0
}
