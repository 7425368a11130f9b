// SPDX-License-Identifier: Apache-2.0

package cli

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/signal"
	"runtime/debug"
	"syscall"
	"time"

	"github.com/spf13/cobra"

	"github.com/meshwarp/meshwarp/internal/accel"
	"github.com/meshwarp/meshwarp/internal/config"
	"github.com/meshwarp/meshwarp/internal/crossnode"
	"github.com/meshwarp/meshwarp/internal/kube"
	"github.com/meshwarp/meshwarp/internal/metrics"
	"github.com/meshwarp/meshwarp/internal/probe"
)

type runOptions struct {
	cgroup           string
	podsCgroupIn     string
	pinDir           string
	metricsAddr      string
	sidecarUID       uint32
	capacity         uint32
	unpaired         time.Duration
	configFile       string
	keepOnExit       bool
	keepSmallStreams bool
	learnSyscalls    bool
	observe          bool
	accelerate       bool
	crossNode        bool
	nodeNetns        []string
	uplinks          []string
	keepWhileDS      string // namespace/name: keep on exit only while this DaemonSet stays
	kubeconfig       string
	policy           config.File
}

// configPollInterval is how often --config is re-read: a mounted ConfigMap
// changes under the agent (the kubelet swaps the file), nobody sends SIGHUP.
const configPollInterval = 2 * time.Second

// DefaultMetricsPort is run's --metrics-addr port on 127.0.0.1.
const DefaultMetricsPort = 9464

func newRunCommand(g *Global) *cobra.Command {
	o := &runOptions{}
	cmd := &cobra.Command{
		Use:   "run",
		Short: "Attach the accelerator and serve /metrics until stopped (root)",
		Long: `run attaches sock_ops to a cgroup v2 directory (default: the cgroup v2 root,
i.e. every process of the node) and sk_msg to the SOCKMAP, pins both under
--pin-dir, and serves Prometheus metrics and /healthz.

Every TCP connection between two sockets of this host inside the cgroup
subtree is then paired at establishment and its bytes move socket-to-socket,
skipping the TCP/IP stack and iptables. Connections opened before run
started, to other hosts, excluded by policy, or that cannot be paired stay on
the normal stack (see ` + "`meshwarp status`" + ` for counts by reason).

Observation (--observe, on by default) records, for every connection of the
cgroup whether accelerated or not, HTTP/1.x request rate, status and duration
(from the request and status lines only) and TCP connections, resets and
failed connects: served at /metrics as http_server_request_duration_seconds,
http_client_request_duration_seconds and meshwarp_tcp_*, live in
` + "`meshwarp top`" + `, per hop in ` + "`meshwarp trace`" + `. --accelerate=false observes only.

Cross-node forwarding (--cross-node, off by default) attaches tcx programs to
the node's pod-facing bridge ports and its uplinks (devices carrying a route
through a gateway, or --uplinks): a pod's packet to a pod on another node goes
straight to the uplink, and one arriving for a local pod straight into the
pod (bpf_redirect_peer), past the node's bridge, netfilter and routing code,
with the kernel's FIB deciding where it goes and the TTL decremented as
forwarding does. ARP, fragments, IP options, packets larger than the MTU,
expiring TTLs and unknown destinations take the normal path (counted by
reason in ` + "`meshwarp status`" + `). A family is redirected only while the
node has no netfilter rule or policy where forwarded packets would meet one
(PREROUTING, FORWARD, POSTROUTING, bridge, netdev; nf_tables and legacy
iptables are read every second) and no IPv4 rp_filter: such a rule keeps every packet of
that family on the normal path. Between two reads, a packet that would meet
netfilter tables, chains, rules or policies other than those read takes the
normal path at once. The pods' own rules (Istio's capture) see
every packet as before. The agent's check expires 3s after it stops: then
packets take the normal path until an agent checks again.

Stopping:
  SIGINT/SIGTERM   detach and unpin (new connections use the normal stack;
                   open accelerated connections keep working until they close)
  --keep-on-exit   leave everything attached and pinned on exit, so a new
                   'meshwarp run' adopts it (upgrades with no gap)
  SIGKILL          leaves everything attached; the next run adopts it
  SIGHUP           reload --config and apply the policy without a reload of programs
                   (a changed --config file is also picked up within 2s)
  --keep-on-exit-while-daemonset NS/NAME
                   for a Kubernetes DaemonSet (the Helm chart sets it): on exit,
                   keep the data path pinned while that DaemonSet exists and is not
                   being deleted (rolling update, drain: the next pod adopts it);
                   uninstall when it is gone (helm uninstall) or unreadable

Policy (destination as the application asked for it, before NAT; exclusions
also match the accepting server's own port and address, after NAT):
  --include-ports 8080,9000-9010   only these ports (default: all)
  --exclude-ports 3306             never these ports
  --include-cidrs 10.0.0.0/8       only these destinations (default: all)
  --exclude-cidrs 192.168.7.0/24   never these destinations
Receivers that read with splice(2) (e.g. Go io.Copy between two TCP
connections, HAProxy with option splice-*), programs that use MSG_WAITALL,
MSG_OOB, SO_RCVLOWAT after connecting, or close with unread data cannot get
those from a redirect: the agent learns such ports after the first
connection; exclude them up front so that no connection is affected.`,
		Example: `  meshwarp run
  meshwarp run --cgroup /sys/fs/cgroup/unified/kubepods --exclude-ports 3306
  meshwarp run --config /etc/meshwarp/policy.yaml --metrics-addr 0.0.0.0:9464`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error { return runAgent(cmd, g, o) },
	}
	f := cmd.Flags()
	f.StringVar(&o.cgroup, "cgroup", "", "cgroup v2 directory to accelerate (default: the cgroup v2 root from /proc/mounts)")
	f.StringVar(&o.podsCgroupIn, "kube-pods-cgroup-in", "",
		"the node's /sys/fs/cgroup as mounted here: accelerate the kubelet's pods cgroup found in it (kubepods.slice or kubepods, in the v2 tree of a unified or hybrid layout, under the kubelet's cgroupRoot); excludes --cgroup")
	f.StringVar(&o.pinDir, "pin-dir", DefaultPinDir(), "bpffs directory for pinned maps and links; one running agent per directory; $"+PinDirEnv+" sets the default")
	f.StringVar(&o.metricsAddr, "metrics-addr", fmt.Sprintf("127.0.0.1:%d", DefaultMetricsPort), `address for /metrics and /healthz ("" disables)`)
	f.Uint32Var(&o.sidecarUID, "sidecar-uid", accel.DefaultSidecarUID, "uid of the sidecar proxy (names the sidecar -> app hop)")
	f.Uint32Var(&o.capacity, "capacity", accel.DefaultCapacity, "connections tracked at once (each up to two accelerated sockets); beyond it connections use the normal stack")
	f.DurationVar(&o.unpaired, "unpaired-timeout", accel.DefaultUnpairedTimeout,
		"how long a connecting socket whose listener is in the cgroup may wait for its peer to be established before it is left to TCP")
	f.BoolVar(&o.keepSmallStreams, "keep-small-streams", false,
		"keep streams on the redirect (default: a connection whose one side writes many small messages without a reply, or outruns a receiver that never replies, continues on TCP, which is faster for it; see `meshwarp status` small_stream, backpressure)")
	f.BoolVar(&o.learnSyscalls, "learn-from-syscalls", false,
		"also watch the cgroup's splice(2), recv(MSG_WAITALL), MSG_OOB, close() with unread bytes and connect(AF_UNSPEC) on accelerated sockets, and keep later connections on those ports, and every later connection of those programs, on TCP (see `meshwarp status` learned reasons and programs). Off by default: syscall tracepoints slow every process of the node (docs/BENCHMARKS.md); socket options (SO_RCVLOWAT, SO_PEEK_OFF, TCP_INQ, timestamps, SO_ZEROCOPY) are always seen, through a cgroup hook")
	f.BoolVar(&o.observe, "observe", true,
		"record RED data of every connection of the cgroup, accelerated or not: HTTP/1.x request rate, status and duration, TCP connections and resets (/metrics, `meshwarp top`, `meshwarp trace`); its cost is in docs/BENCHMARKS.md")
	f.BoolVar(&o.accelerate, "accelerate", true,
		"pair and redirect connections; --accelerate=false observes only (needs --observe)")
	f.BoolVar(&o.crossNode, "cross-node", false,
		"forward pod packets between nodes past the node's bridge, netfilter and routing (tcx programs on bridge ports and uplinks; see above)")
	f.StringSliceVar(&o.nodeNetns, "node-netns", nil,
		"with --cross-node: network namespace paths of the nodes to forward in (default: the agent's own), e.g. /run/netns/meshwarp-node")
	f.StringSliceVar(&o.uplinks, "uplinks", nil,
		"with --cross-node: devices towards other nodes (default: every device carrying a route through a gateway)")
	f.StringVar(&o.configFile, "config", "", "YAML policy file (include_ports, exclude_ports, include_cidrs, exclude_cidrs); SIGHUP reloads it")
	f.BoolVar(&o.keepOnExit, "keep-on-exit", false, "leave the data path attached and pinned on exit (for restarts and upgrades)")
	f.StringVar(&o.keepWhileDS, "keep-on-exit-while-daemonset", "", "namespace/name: keep the data path on exit only while this DaemonSet exists and is not being deleted")
	f.StringVar(&o.kubeconfig, "kubeconfig", "", "kubeconfig for --keep-on-exit-while-daemonset (default: the pod's service account)")
	f.StringSliceVar(&o.policy.IncludePorts, "include-ports", nil, "accelerate only these destination ports (e.g. 8080,9000-9010)")
	f.StringSliceVar(&o.policy.ExcludePorts, "exclude-ports", nil, "never accelerate these destination ports")
	f.StringSliceVar(&o.policy.IncludeCIDRs, "include-cidrs", nil, "accelerate only these destinations (CIDRs or addresses)")
	f.StringSliceVar(&o.policy.ExcludeCIDRs, "exclude-cidrs", nil, "never accelerate these destinations")
	return cmd
}

// loadPolicy merges the file (if any) with the flags.
func (o *runOptions) loadPolicy() (accel.Policy, error) {
	f := o.policy
	if o.configFile != "" {
		fromFile, err := config.Load(o.configFile)
		if err != nil {
			return accel.Policy{}, err
		}
		f = fromFile.Merge(o.policy)
	}
	return f.Policy()
}

func runAgent(cmd *cobra.Command, g *Global, o *runOptions) error {
	logger := g.Logger(cmd.ErrOrStderr())
	if o.capacity == 0 {
		return UsageError("--capacity must be at least 1")
	}
	if o.unpaired < time.Millisecond || o.unpaired > time.Minute {
		return UsageError("--unpaired-timeout %v: give 1ms..1m (default %v)", o.unpaired, accel.DefaultUnpairedTimeout)
	}
	if !o.accelerate && !o.observe {
		return UsageError("--accelerate=false with --observe=false leaves nothing to do: keep one of them")
	}
	if !o.crossNode && (len(o.nodeNetns) > 0 || len(o.uplinks) > 0) {
		return UsageError("--node-netns and --uplinks configure --cross-node: add --cross-node")
	}
	var nodes []crossnode.Node
	for _, ns := range o.nodeNetns {
		if _, err := os.Stat(ns); err != nil {
			return UsageError("--node-netns %s: %v (give a network namespace path such as /run/netns/NAME or /proc/PID/ns/net)", ns, err)
		}
		nodes = append(nodes, crossnode.Node{Netns: ns, Uplinks: o.uplinks})
	}
	if o.crossNode && len(nodes) == 0 {
		nodes = []crossnode.Node{{Uplinks: o.uplinks}}
	}
	policy, err := o.loadPolicy()
	if err != nil {
		return WithExit(ExitUsage, fmt.Errorf("invalid policy: %w", err))
	}
	var keepWhile func() (bool, string)
	if o.keepWhileDS != "" {
		if o.keepOnExit {
			return UsageError("--keep-on-exit and --keep-on-exit-while-daemonset exclude each other: give one")
		}
		if keepWhile, err = o.daemonSetCheck(); err != nil {
			return WithExit(ExitUsage, err)
		}
	}
	// Refuse before touching anything when the kernel cannot do it.
	report := probe.Run(probe.Options{MountBPFFS: true})
	if err := report.Err(); err != nil {
		return err
	}
	if o.podsCgroupIn != "" {
		if o.cgroup != "" {
			return UsageError("--cgroup and --kube-pods-cgroup-in exclude each other: give one")
		}
		if o.cgroup, err = kube.PodsCgroup(o.podsCgroupIn); err != nil {
			return WithExit(ExitNotReady, err)
		}
	}
	if o.cgroup == "" {
		if o.cgroup, err = probe.Cgroup2Root(); err != nil {
			return WithExit(ExitNotReady, err)
		}
	}
	agent, err := accel.Start(accel.Config{
		CgroupPath:        o.cgroup,
		PinDir:            o.pinDir,
		SidecarUID:        o.sidecarUID,
		Policy:            policy,
		SockhashCapacity:  o.capacity,
		UnpairedTimeout:   o.unpaired,
		KeepSmallStreams:  o.keepSmallStreams,
		LearnFromSyscalls: o.learnSyscalls,
		Observe:           o.observe,
		ObserveOnly:       !o.accelerate,
		CrossNode:         o.crossNode,
		CrossNodes:        nodes,
	}, logger)
	if err != nil {
		return err
	}
	// Loading parsed the object and the kernel's BTF (tens of MB, garbage
	// now): give it back, so the agent's resident memory is what it keeps.
	debug.FreeOSMemory()
	stop := func() error {
		keep := o.keepOnExit
		if keepWhile != nil {
			var why string
			keep, why = keepWhile()
			logger.Info("on exit", "keep", keep, "because", why)
		}
		if keep {
			logger.Info("leaving data path attached", "pin_dir", o.pinDir)
			return agent.Close()
		}
		_, err := agent.Uninstall()
		return err
	}

	ctx := cmd.Context()
	var served <-chan error
	if o.metricsAddr != "" {
		if served, err = metrics.Serve(ctx, o.metricsAddr, agent.Stats, o.flowsFunc(agent), logger); err != nil {
			return errors.Join(err, stop())
		}
	}
	observing := ""
	if o.observe {
		observing = ", observing it"
	}
	if o.accelerate {
		fmt.Fprintf(cmd.ErrOrStderr(), "meshwarp: accelerating TCP in cgroup %s%s (pins in %s); Ctrl-C to stop\n", o.cgroup, observing, o.pinDir)
	} else {
		fmt.Fprintf(cmd.ErrOrStderr(), "meshwarp: observing TCP (not accelerating) in cgroup %s (pins in %s); Ctrl-C to stop\n", o.cgroup, o.pinDir)
	}

	hup := make(chan os.Signal, 1)
	signal.Notify(hup, syscall.SIGHUP)
	defer signal.Stop(hup)
	reload := func() {
		p, err := o.loadPolicy()
		if err == nil {
			err = agent.ApplyPolicy(p)
		}
		if err != nil {
			logger.Error("policy reload failed; keeping the previous policy", "err", err)
			return
		}
		logger.Info("policy reloaded", "file", o.configFile)
	}
	var poll <-chan time.Time
	lastConfig := readConfig(o.configFile)
	if o.configFile != "" {
		t := time.NewTicker(configPollInterval)
		defer t.Stop()
		poll = t.C
	}
	for {
		select {
		case <-poll:
			if now := readConfig(o.configFile); now != lastConfig {
				lastConfig = now
				reload()
			}
		case <-ctx.Done():
			logger.Info("stopping", "keep_on_exit", o.keepOnExit)
			return stop()
		case err := <-served:
			return errors.Join(fmt.Errorf("metrics server: %w", err), stop())
		case <-hup:
			reload()
		}
	}
}

// readConfig returns the policy file's content ("" when unset or unreadable).
func readConfig(path string) string {
	if path == "" {
		return ""
	}
	b, _ := os.ReadFile(path)
	return string(b)
}

// daemonSetCheck validates --keep-on-exit-while-daemonset and returns the
// question asked on exit.
func (o *runOptions) daemonSetCheck() (func() (bool, string), error) {
	ref, err := kube.ParseDaemonSetRef(o.keepWhileDS)
	if err != nil {
		return nil, fmt.Errorf("--keep-on-exit-while-daemonset %w", err)
	}
	client, err := kube.NewClient(o.kubeconfig)
	if err != nil {
		return nil, fmt.Errorf("--keep-on-exit-while-daemonset needs the Kubernetes API (in a pod: a service account; else --kubeconfig): %w", err)
	}
	return func() (bool, string) {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		return client.DaemonSetStays(ctx, ref)
	}, nil
}

// flowsFunc serves the observation when it is on.
func (o *runOptions) flowsFunc(a *accel.Agent) metrics.FlowsFunc {
	if !o.observe {
		return nil
	}
	return a.Flows
}
