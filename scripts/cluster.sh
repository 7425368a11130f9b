#!/usr/bin/env bash
# A one-node Kubernetes cluster on this machine, with meshwarp installed by its
# Helm chart and a demo workload of lab pods (test/cluster/README.md).
#
#   scripts/cluster.sh up        build (cached), start, install, deploy; prints the kubeconfig
#   scripts/cluster.sh status [--json]
#   scripts/cluster.sh down      remove everything up created (also after a failed up)
#
# Everything comes from Go modules and Debian packages: Kubernetes v1.37.2 is
# built from the Go module proxy (test/cluster/kubebuild), helm from Helm's
# module, etcd, containerd, runc and the CNI plugins are Debian's. Images are
# built with podman and imported into the cluster's own containerd: no
# registry. This is a test cluster: one static token in system:masters and
# authorization AlwaysAllow.
#
# What up creates, and down removes (names carry "meshwarp" where they can):
#   processes   etcd, kube-apiserver, kube-controller-manager, kube-scheduler,
#               containerd (+ its shims), kubelet, kube-proxy (pid files in $RUN)
#   files       $STATE (certs, configs, etcd, containerd root, kubelet root, logs), $RUN
#   interfaces  meshwarp-k8s (the node address, a bridge without ports), bridge meshwarp-cni0, pod veths
#   netns       the pods' cni-* namespaces (containerd's names)
#   cgroups     /meshwarp-cluster in every hierarchy (the kubelet's cgroupRoot)
#   netfilter   kube-proxy's nftables tables, the kubelet's KUBE-* iptables chains
#   sysctls     the kubelet and the CNI bridge change some; down restores them
# down keeps the build cache ($CACHE, about 0.7 GB of binaries): rm -rf it to reclaim.
#   mounts      under $STATE and $RUN, and the pods' namespaces
#   bpffs       the agent's pins in /sys/fs/bpf/meshwarp-cluster (helm uninstall removes
#               them; down runs meshwarp-agent cleanup if an agent was killed)
set -Eeuo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD

STATE=/var/lib/meshwarp-cluster
RUN=/run/meshwarp-cluster
CACHE=${MESHWARP_CLUSTER_CACHE:-/var/cache/meshwarp-cluster}
KUBE_VERSION=v1.37.2
NODE_NAME=meshwarp-node
NODE_IF=meshwarp-k8s
NODE_IP=10.241.0.1
POD_CIDR=10.242.0.0/24
BRIDGE=meshwarp-cni0
SVC_CIDR=10.243.0.0/24
SVC_API_IP=10.243.0.1
ETCD_PORT=23790
CGROUP_ROOT=meshwarp-cluster
# The cluster's agent pins here, not in the node default /sys/fs/bpf/meshwarp
# that an agent run on the host uses.
PIN_DIR=/sys/fs/bpf/meshwarp-cluster
CONTAINERD_SOCK=$RUN/containerd.sock
KUBECONFIG_PATH=$STATE/kubeconfig
# The Helm release and the demo namespace (the test uses the same).
RELEASE=meshwarp
AGENT_NS=meshwarp-system
DEMO_NS=meshwarp-demo
# Kernel settings the kubelet (setupKernelTunables), the bridge plugin and
# kube-proxy may change; saved by up, restored by down.
SYSCTLS=(vm.overcommit_memory vm.panic_on_oom kernel.panic kernel.panic_on_oops
	kernel.keys.root_maxkeys kernel.keys.root_maxbytes net.ipv4.ip_forward
	net.ipv6.conf.all.forwarding net.netfilter.nf_conntrack_max
	net.netfilter.nf_conntrack_tcp_timeout_established
	net.netfilter.nf_conntrack_tcp_timeout_close_wait)
# Host paths Kubernetes or containerd create whatever they are told; up records
# which ones did not exist, down removes those. The kubelet's are its own.
HOST_PATHS=(/var/lib/kubelet /var/log/pods /var/log/containers /var/lib/containerd /run/containerd /etc/kubernetes)
# Shared with other CNI users (podman): down removes only our entries there
# (named after our network), then the directories if up created them and
# they are empty.
CNI_PATHS=(/var/lib/cni /etc/cni/net.d /opt/cni)

log() { printf 'cluster: %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }
now() { date +%s; }

kubectl() { "$BIN/kubectl" --kubeconfig "$KUBECONFIG_PATH" "$@"; }
helm() { HELM_CACHE_HOME=$STATE/helm/cache HELM_CONFIG_HOME=$STATE/helm/config HELM_DATA_HOME=$STATE/helm/data \
	"$BIN/helm" --kubeconfig "$KUBECONFIG_PATH" "$@"; }
ctr() { /usr/bin/ctr --address "$CONTAINERD_SOCK" --namespace k8s.io "$@"; }

# ---------------------------------------------------------------- binaries

# The binaries are kept in $CACHE/bin-<key>, the key being the inputs that
# decide them: the wrapper module (Kubernetes and helm) and Go.
bin_key() { cat test/cluster/kubebuild/go.mod test/cluster/kubebuild/go.sum <(go version) | sha256sum | cut -c1-16; }
BIN=$CACHE/bin-$(bin_key)

binaries() {
	if [[ -x $BIN/kube-apiserver && -x $BIN/helm ]]; then
		return
	fi
	local t0 tmp
	t0=$(now)
	log "building Kubernetes $KUBE_VERSION and helm from Go modules (cold: about 15 minutes on 2 cores; cached after)"
	tmp=$CACHE/tmp-$$
	rm -rf "$CACHE"/tmp-* && mkdir -p "$tmp" # tmp-*: builds an interrupted up left
	local ld="-s -w -X k8s.io/component-base/version.gitVersion=$KUBE_VERSION -X k8s.io/component-base/version.gitMajor=1"
	ld+=" -X k8s.io/component-base/version.gitMinor=37 -X k8s.io/component-base/version.gitTreeState=clean"
	(cd test/cluster/kubebuild && CGO_ENABLED=0 go build -trimpath -ldflags "$ld" -o "$tmp/" \
		k8s.io/kubernetes/cmd/kube-apiserver k8s.io/kubernetes/cmd/kube-controller-manager \
		k8s.io/kubernetes/cmd/kube-scheduler k8s.io/kubernetes/cmd/kubelet \
		k8s.io/kubernetes/cmd/kube-proxy k8s.io/kubernetes/cmd/kubectl helm.sh/helm/v3/cmd/helm)
	rm -rf "$BIN" && mv "$tmp" "$BIN"
	log "built in $(($(now) - t0)) s: $BIN"
}

# ---------------------------------------------------------------- images

# Images: the pause image (Kubernetes' pause.c, static), the agent image
# (deploy/image/build.sh) under two tags (the test upgrades from one to the
# other), and the demo image: the meshwarp binary (its `lab pod` commands run
# the lab's capture rules, HAProxy sidecar config and apps) with Debian's
# haproxy and iptables and the libraries they load.
build_images() {
	local t0 ctx src
	t0=$(now)
	ctx=$STATE/images
	rm -rf "$ctx" && mkdir -p "$ctx/pause" "$ctx/demo"
	src=$(cd test/cluster/kubebuild && go list -m -f '{{.Dir}}' k8s.io/kubernetes)
	gcc -static -Os -DVERSION=meshwarp-$KUBE_VERSION -o "$ctx/pause/pause" "$src/build/pause/linux/pause.c"
	printf 'FROM scratch\nCOPY pause /pause\nUSER 65535:65535\nENTRYPOINT ["/pause"]\n' >"$ctx/pause/Containerfile"
	podman build -q --network none -t localhost/meshwarp-pause:3.10 "$ctx/pause" >/dev/null

	deploy/image/build.sh localhost/meshwarp:cluster-a >/dev/null
	podman tag localhost/meshwarp:cluster-a localhost/meshwarp:cluster-b

	local root=$ctx/demo/root f
	mkdir -p "$root/usr/sbin" "$root/tmp" "$root/run" "$root/etc"
	CGO_ENABLED=0 go build -trimpath -ldflags "-s -w" -o "$root/meshwarp" ./cmd/meshwarp
	local multi
	multi=$(readlink -f "$(command -v iptables-restore)")
	cp -L "$(command -v haproxy)" "$root/usr/sbin/haproxy"
	cp -L "$multi" "$root/usr/sbin/"
	for f in iptables iptables-restore iptables-save; do ln -sf "$(basename "$multi")" "$root/usr/sbin/$f"; done
	for f in "$(command -v haproxy)" "$multi" /usr/lib/x86_64-linux-gnu/xtables/*.so; do
		ldd "$f" 2>/dev/null | awk '/=> \// {print $3} /^\t\/lib/ {print $1}'
	done | sort -u | while read -r lib; do cp -L --parents "$lib" "$root/"; done
	mkdir -p "$root/usr/lib/x86_64-linux-gnu/xtables"
	cp -a /usr/lib/x86_64-linux-gnu/xtables/. "$root/usr/lib/x86_64-linux-gnu/xtables/"
	printf 'root:x:0:0:root:/:/sbin/nologin\nproxy:x:1337:1337:sidecar:/:/sbin/nologin\n' >"$root/etc/passwd"
	printf 'root:x:0:\nproxy:x:1337:\n' >"$root/etc/group"
	chmod 1777 "$root/tmp"
	printf 'FROM scratch\nCOPY root/ /\nENV PATH=/usr/sbin:/usr/bin:/sbin:/bin\nENTRYPOINT ["/meshwarp"]\n' >"$ctx/demo/Containerfile"
	podman build -q --network none -t localhost/meshwarp-demo:cluster "$ctx/demo" >/dev/null
	log "images built in $(($(now) - t0)) s"
}

import_images() {
	local img tar=$STATE/images/import.tar
	for img in localhost/meshwarp-pause:3.10 localhost/meshwarp:cluster-a localhost/meshwarp:cluster-b localhost/meshwarp-demo:cluster; do
		rm -f "$tar"
		podman save -q --format docker-archive -o "$tar" "$img"
		ctr images import --no-unpack=false "$tar" >/dev/null
	done
	rm -f "$tar"
}

# ---------------------------------------------------------------- host state

save_host_state() {
	mkdir -p "$STATE/saved"
	[[ -f $STATE/saved/sysctl ]] || for k in "${SYSCTLS[@]}"; do
		v=$(sysctl -n "$k" 2>/dev/null) && printf '%s=%s\n' "$k" "$v"
	done >"$STATE/saved/sysctl"
	[[ -f $STATE/saved/paths ]] || for p in "${HOST_PATHS[@]}" "${CNI_PATHS[@]}"; do
		[[ -e $p ]] || echo "$p"
	done >"$STATE/saved/paths"
	[[ -f $STATE/saved/netns ]] || { ls /run/netns 2>/dev/null || true; } >"$STATE/saved/netns"
	[[ -f $STATE/saved/kube-chains ]] || for t in iptables ip6tables; do
		"$t-save" 2>/dev/null | grep -c '^:KUBE-' || true
	done >"$STATE/saved/kube-chains"
}

# restore_sysctls [KEY...]: the values saved by up (all of them without keys).
restore_sysctls() {
	[[ -f $STATE/saved/sysctl ]] || return 0
	local kv
	while IFS= read -r kv; do
		if (($# > 0)) && [[ " $* " != *" ${kv%%=*} "* ]]; then
			continue
		fi
		sysctl -q -w "$kv" >/dev/null 2>&1 || log "could not restore $kv"
	done <"$STATE/saved/sysctl"
}

pid_alive() { [[ -f $RUN/$1.pid ]] && kill -0 "$(cat "$RUN/$1.pid")" 2>/dev/null; }

# start NAME CMD...: a daemon in its own session, output to $STATE/logs/NAME.log.
start() {
	local name=$1
	shift
	pid_alive "$name" && return
	setsid "$@" >>"$STATE/logs/$name.log" 2>&1 </dev/null &
	echo $! >"$RUN/$name.pid"
}

wait_for() { # wait_for SECONDS WHAT CMD...
	local deadline=$(($(now) + $1)) what=$2
	shift 2
	until "$@" >/dev/null 2>&1; do
		if (($(now) > deadline)); then
			die "$what not ready after the wait (logs: $STATE/logs)"
		fi
		sleep 1
	done
}

certs() {
	local d=$STATE/pki
	[[ -f $d/admin.token ]] && return
	mkdir -p "$d"
	openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -days 30 \
		-subj /CN=meshwarp-cluster-ca -keyout "$d/ca.key" -out "$d/ca.crt" 2>/dev/null
	openssl req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -subj /CN=kube-apiserver \
		-keyout "$d/apiserver.key" -out "$d/apiserver.csr" 2>/dev/null
	openssl x509 -req -in "$d/apiserver.csr" -CA "$d/ca.crt" -CAkey "$d/ca.key" -CAcreateserial -days 30 \
		-out "$d/apiserver.crt" -extfile <(printf 'subjectAltName=IP:%s,IP:%s,IP:127.0.0.1,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local\n' "$NODE_IP" "$SVC_API_IP") 2>/dev/null
	openssl ecparam -name prime256v1 -genkey -noout -out "$d/sa.key"
	openssl ec -in "$d/sa.key" -pubout -out "$d/sa.pub" 2>/dev/null
	head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$d/admin.token"
	printf '%s,meshwarp-admin,meshwarp-admin,system:masters\n' "$(cat "$d/admin.token")" >"$d/tokens.csv"
	cat >"$KUBECONFIG_PATH" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: meshwarp
  cluster:
    server: https://$NODE_IP:6443
    certificate-authority: $d/ca.crt
users:
- name: meshwarp-admin
  user:
    token: $(cat "$d/admin.token")
contexts:
- name: meshwarp
  context: {cluster: meshwarp, user: meshwarp-admin}
current-context: meshwarp
EOF
}

configs() {
	mkdir -p "$STATE/cni/net.d" "$STATE/containerd" "$RUN/containerd" "$STATE/kubelet" "$STATE/pod-logs"
	cat >"$STATE/cni/net.d/10-meshwarp.conflist" <<EOF
{
  "cniVersion": "0.4.0",
  "name": "meshwarp-k8s",
  "plugins": [
    {"type": "bridge", "bridge": "$BRIDGE", "isGateway": true, "ipMasq": false, "hairpinMode": true,
     "ipam": {"type": "host-local", "ranges": [[{"subnet": "$POD_CIDR"}]], "routes": [{"dst": "0.0.0.0/0"}],
              "dataDir": "$STATE/cni/ipam"}},
    {"type": "loopback"}
  ]
}
EOF
	cat >"$STATE/containerd/config.toml" <<EOF
version = 2
root = "$STATE/containerd/root"
state = "$RUN/containerd"
# No CAP_SYS_RESOURCE here: containerd must not lower its own oom score.
oom_score = 0
disabled_plugins = ["io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.btrfs",
  "io.containerd.snapshotter.v1.zfs", "io.containerd.snapshotter.v1.devmapper", "io.containerd.tracing.processor.v1.otlp"]
[grpc]
  address = "$CONTAINERD_SOCK"
[ttrpc]
  address = "$RUN/containerd-ttrpc.sock"
[plugins."io.containerd.internal.v1.opt"]
  path = "$STATE/containerd/opt"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "localhost/meshwarp-pause:3.10"
  # Containers may not set an oom_score_adj lower than containerd's (no CAP_SYS_RESOURCE).
  restrict_oom_score_adj = true
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        BinaryName = "/usr/sbin/runc"
        SystemdCgroup = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "$STATE/cni/net.d"
EOF
	cat >"$STATE/kubelet/config.yaml" <<EOF
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
# PID 1 is not systemd here.
cgroupDriver: cgroupfs
# Every pod under /meshwarp-cluster/kubepods (in each hierarchy, and in the v2
# tree at /sys/fs/cgroup/unified/meshwarp-cluster/kubepods on a hybrid layout).
cgroupRoot: /$CGROUP_ROOT
# A hybrid cgroup layout counts as v1 to the kubelet.
failCgroupV1: false
# No CAP_SYS_RESOURCE: the kubelet cannot lower its own oom score.
oomScoreAdj: 0
address: $NODE_IP
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: 10248
authentication:
  anonymous: {enabled: true}
  webhook: {enabled: false}
authorization: {mode: AlwaysAllow}
containerRuntimeEndpoint: unix://$CONTAINERD_SOCK
podLogsDir: $STATE/pod-logs
failSwapOn: false
# Imported images cannot be pulled again: never collect them, never evict for disk.
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
evictionHard: {memory.available: "1Mi", nodefs.available: "1%", imagefs.available: "1%"}
resolvConf: /etc/resolv.conf
# ConfigMap volumes (the agent's policy) are refreshed at each pod sync: every
# 10 s instead of every minute.
syncFrequency: 10s
clusterDomain: cluster.local
EOF
	cat >"$STATE/kube-proxy.yaml" <<EOF
apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
# nftables: kube-proxy's rules live in its own tables (ip/ip6 kube-proxy).
mode: nftables
clientConnection: {kubeconfig: $KUBECONFIG_PATH}
hostnameOverride: $NODE_NAME
bindAddress: $NODE_IP
healthzBindAddress: 127.0.0.1:10256
metricsBindAddress: 127.0.0.1:10249
clusterCIDR: $POD_CIDR
nodePortAddresses: ["$NODE_IP/32"]
# 0: leave the node's conntrack settings as they are.
conntrack: {maxPerCore: 0, min: 0, tcpEstablishedTimeout: 0s, tcpCloseWaitTimeout: 0s}
EOF
}

# ---------------------------------------------------------------- up

cmd_up() {
	[[ $EUID -eq 0 ]] || die "needs root"
	local t0
	t0=$(now)
	for tool in etcd containerd containerd-shim-runc-v2 runc podman gcc openssl ctr nft; do
		command -v "$tool" >/dev/null || die "$tool not found: run scripts/install-deps.sh --test"
	done
	[[ -x /usr/lib/cni/bridge ]] || die "CNI plugins not in /usr/lib/cni: apt-get install containernetworking-plugins"
	mkdir -p "$STATE/logs" "$RUN"
	date +%s >"$STATE/up-started"
	# Anything up made is undone by down, also when up fails half-way.
	trap 'log "up failed; logs in $STATE/logs; run scripts/cluster.sh down to remove what it made"' ERR
	save_host_state
	binaries
	certs
	configs

	# The node's address: the API server must advertise a non-loopback address.
	# A bridge without ports: this kernel has no dummy interfaces.
	ip link show "$NODE_IF" >/dev/null 2>&1 || ip link add "$NODE_IF" type bridge
	ip addr replace "$NODE_IP/32" dev "$NODE_IF"
	ip link set "$NODE_IF" up

	local h
	# The kubelet's cgroupRoot must exist in every hierarchy.
	for h in $(cgroup_mounts); do
		mkdir -p "$h/$CGROUP_ROOT"
	done

	start etcd etcd --name meshwarp --data-dir "$STATE/etcd" \
		--listen-client-urls "http://127.0.0.1:$ETCD_PORT" --advertise-client-urls "http://127.0.0.1:$ETCD_PORT" \
		--listen-peer-urls http://127.0.0.1:23800 --initial-advertise-peer-urls http://127.0.0.1:23800 \
		--initial-cluster meshwarp=http://127.0.0.1:23800 --listen-metrics-urls ''
	start containerd containerd --config "$STATE/containerd/config.toml"
	wait_for 30 containerd test -S "$CONTAINERD_SOCK"

	local pki=$STATE/pki
	start kube-apiserver "$BIN/kube-apiserver" --etcd-servers "http://127.0.0.1:$ETCD_PORT" \
		--advertise-address "$NODE_IP" --bind-address "$NODE_IP" --secure-port 6443 \
		--service-cluster-ip-range "$SVC_CIDR" --tls-cert-file "$pki/apiserver.crt" \
		--tls-private-key-file "$pki/apiserver.key" --client-ca-file "$pki/ca.crt" \
		--token-auth-file "$pki/tokens.csv" --authorization-mode AlwaysAllow --allow-privileged=true \
		--service-account-issuer https://kubernetes.default.svc --service-account-key-file "$pki/sa.pub" \
		--service-account-signing-key-file "$pki/sa.key" --kubelet-preferred-address-types InternalIP \
		--profiling=false --enable-priority-and-fairness=false
	wait_for 120 "the API server" kubectl get --raw /readyz

	start kube-controller-manager "$BIN/kube-controller-manager" --kubeconfig "$KUBECONFIG_PATH" \
		--service-account-private-key-file "$pki/sa.key" --root-ca-file "$pki/ca.crt" \
		--leader-elect=false --bind-address 127.0.0.1 --allocate-node-cidrs=false \
		--cluster-name meshwarp --controllers '*,-nodeipam' --profiling=false
	start kube-scheduler "$BIN/kube-scheduler" --kubeconfig "$KUBECONFIG_PATH" --leader-elect=false \
		--bind-address 127.0.0.1 --profiling=false

	build_images
	import_images

	start kubelet "$BIN/kubelet" --config "$STATE/kubelet/config.yaml" --kubeconfig "$KUBECONFIG_PATH" \
		--root-dir "$STATE/kubelet" --cert-dir "$STATE/kubelet/pki" --hostname-override "$NODE_NAME" \
		--node-ip "$NODE_IP"
	start kube-proxy "$BIN/kube-proxy" --config "$STATE/kube-proxy.yaml"
	wait_for 120 "node $NODE_NAME Ready" kubectl wait --for=condition=Ready "node/$NODE_NAME" --timeout=5s
	# The kubelet set kernel.panic=10 and kernel.panic_on_oops=1 once, at start:
	# a machine where BPF programs are developed must not reboot on an oops
	# while the cluster runs. Put the node's values back now (down restores the rest).
	restore_sysctls kernel.panic kernel.panic_on_oops vm.panic_on_oom

	install_meshwarp localhost/meshwarp cluster-a
	kubectl -n "$AGENT_NS" rollout status "ds/$RELEASE" --timeout=180s >&2
	deploy_demo
	trap - ERR
	log "up in $(($(now) - t0)) s"
	cat <<EOF
cluster up: node $NODE_NAME ($NODE_IP), meshwarp installed (helm release $RELEASE in $AGENT_NS), demo pods in $DEMO_NS
  export KUBECONFIG=$KUBECONFIG_PATH
  $BIN/kubectl get pods -A
  $BIN/kubectl -n $AGENT_NS exec ds/$RELEASE -- /meshwarp-agent status
  $BIN/kubectl -n $DEMO_NS exec client -c app -- /meshwarp lab pod client --server \$(kubectl -n $DEMO_NS get pod server -o jsonpath='{.status.podIP}') --requests 10
  scripts/cluster.sh status [--json]; scripts/cluster.sh down
EOF
}

# The cgroup v2 directory the kubelet's pods land in. runc puts a container in
# the same path in every hierarchy, the v2 one included, so it is
# <cgroup2 mount>/<cgroupRoot>/kubepods with the cgroupfs driver.
# Every cgroup hierarchy's mount point (v1 controllers and v2).
cgroup_mounts() { awk '$3 == "cgroup" || $3 == "cgroup2" {print $2}' /proc/self/mounts; }
cgroup2_mount() { awk '$3 == "cgroup2" {print $2; exit}' /proc/self/mounts; }
pods_cgroup2() { echo "$(cgroup2_mount)/$CGROUP_ROOT/kubepods"; }

# install_meshwarp REPOSITORY TAG [helm args]: helm upgrade --install with the
# chart and its defaults (cgroupPath empty: the agent finds the pods cgroup).
install_meshwarp() {
	local repo=$1 tag=$2
	shift 2
	helm upgrade --install "$RELEASE" deploy/helm/meshwarp -n "$AGENT_NS" --create-namespace \
		--set image.repository="$repo" --set image.tag="$tag" --set image.pullPolicy=Never \
		--set pinDir="$PIN_DIR" "$@" >&2
}

deploy_demo() {
	kubectl apply -f test/cluster/demo.yaml >&2
	kubectl -n "$DEMO_NS" wait --for=condition=Ready pod/server pod/client --timeout=180s >&2
}

# ---------------------------------------------------------------- status

cmd_status() {
	local json=false
	[[ ${1:-} == --json ]] && json=true
	local up=false node=false ds=false agent=null procs=()
	for p in etcd containerd kube-apiserver kube-controller-manager kube-scheduler kubelet kube-proxy; do
		pid_alive "$p" && procs+=("\"$p\"")
	done
	if [[ -x $BIN/kubectl && -f $KUBECONFIG_PATH ]] && kubectl get --raw /readyz >/dev/null 2>&1; then
		up=true
		[[ $(kubectl get node "$NODE_NAME" -o jsonpath='{.status.conditions[?(@.type=="Ready")].status}' 2>/dev/null) == True ]] && node=true
		local want have
		want=$(kubectl -n "$AGENT_NS" get ds "$RELEASE" -o jsonpath='{.status.desiredNumberScheduled}' 2>/dev/null || true)
		have=$(kubectl -n "$AGENT_NS" get ds "$RELEASE" -o jsonpath='{.status.numberReady}' 2>/dev/null || true)
		[[ -n $want && $want == "$have" && $want != 0 ]] && ds=true
		if $ds; then
			agent=$(kubectl -n "$AGENT_NS" exec "ds/$RELEASE" -- /meshwarp-agent status --json 2>/dev/null) || agent=null
		fi
	fi
	if $json; then
		local IFS=,
		printf '{"api_server_ready":%s,"node_ready":%s,"daemonset_ready":%s,"processes":[%s],"kubeconfig":"%s","bin":"%s","containerd":"%s","cgroup2_mount":"%s","pods_cgroup":"%s","pin_dir":"%s","agent_status":%s}\n' \
			"$up" "$node" "$ds" "${procs[*]}" "$KUBECONFIG_PATH" "$BIN" "$CONTAINERD_SOCK" "$(cgroup2_mount)" "$(pods_cgroup2)" "$PIN_DIR" "${agent:-null}"
	else
		echo "processes:       ${procs[*]:-none}"
		echo "API server:      $($up && echo ready || echo down)"
		echo "node Ready:      $node"
		echo "DaemonSet ready: $ds"
		echo "kubeconfig:      $KUBECONFIG_PATH"
		if $ds; then
			kubectl -n "$AGENT_NS" exec "ds/$RELEASE" -- /meshwarp-agent status 2>/dev/null || true
		fi
	fi
	$up
}

# ---------------------------------------------------------------- down

stop() { # stop NAME [SECONDS]
	local name=$1 wait=${2:-20} pid
	[[ -f $RUN/$name.pid ]] || return 0
	pid=$(cat "$RUN/$name.pid")
	if kill -0 "$pid" 2>/dev/null; then
		kill -TERM "$pid" 2>/dev/null || true
		for ((i = 0; i < wait * 10; i++)); do
			kill -0 "$pid" 2>/dev/null || break
			sleep 0.1
		done
		kill -KILL "$pid" 2>/dev/null || true
	fi
	rm -f "$RUN/$name.pid"
}

# Processes whose command line names one of our paths: containerd's shims
# (started with -address $RUN/containerd.sock) and what runs in our containers
# (children of those shims).
our_shims() {
	local p
	for p in /proc/[0-9]*; do
		{ tr '\0' ' ' <"$p/cmdline"; } 2>/dev/null | grep -q -- "-address $CONTAINERD_SOCK" && echo "${p#/proc/}"
	done
}

cmd_down() {
	[[ $EUID -eq 0 ]] || die "needs root"
	local t0
	t0=$(now)
	# 1. While the API server and kubelet run: uninstall meshwarp (the agent
	#    detaches and unpins) and delete the pods (the kubelet tears down
	#    their sandboxes, CNI included).
	if [[ -x $BIN/kubectl && -f $KUBECONFIG_PATH ]] && pid_alive kubelet && kubectl get --raw /readyz >/dev/null 2>&1; then
		helm uninstall "$RELEASE" -n "$AGENT_NS" --wait --timeout 60s >/dev/null 2>&1 || true
		kubectl delete namespace "$DEMO_NS" "$AGENT_NS" --wait=true --timeout=90s >/dev/null 2>&1 || true
	fi
	# 2. Processes, in reverse order of start.
	for p in kube-proxy kubelet kube-scheduler kube-controller-manager kube-apiserver; do stop "$p"; done
	if pid_alive containerd; then
		# Whatever containers are left: stop them through containerd.
		local c
		for c in $(ctr tasks ls -q 2>/dev/null); do ctr tasks kill -s KILL "$c" >/dev/null 2>&1 || true; done
		sleep 1
		for c in $(ctr tasks ls -q 2>/dev/null); do ctr tasks delete -f "$c" >/dev/null 2>&1 || true; done
		for c in $(ctr containers ls -q 2>/dev/null); do ctr containers delete "$c" >/dev/null 2>&1 || true; done
	fi
	stop containerd
	local s
	for s in $(our_shims); do
		pkill -KILL -P "$s" 2>/dev/null || true
		kill -KILL "$s" 2>/dev/null || true
	done
	stop etcd
	# 3. An agent killed with its node may leave the data path pinned.
	if [[ -d $PIN_DIR ]]; then
		go run ./cmd/meshwarp-agent cleanup --pin-dir "$PIN_DIR" >/dev/null 2>&1 || true
		rmdir "$PIN_DIR" 2>/dev/null || true
	fi
	# 4. kube-proxy's and the kubelet's netfilter state.
	if [[ -n $BIN && -x $BIN/kube-proxy ]]; then
		nft delete table ip kube-proxy 2>/dev/null || true
		nft delete table ip6 kube-proxy 2>/dev/null || true
	fi
	if [[ -f $STATE/saved/kube-chains && $(sort -u "$STATE/saved/kube-chains") == 0 ]]; then
		remove_kube_chains
	fi
	# 5. Pods' network namespaces, interfaces.
	local ns
	for ns in $(ls /run/netns 2>/dev/null | grep '^cni-' || true); do
		grep -qx "$ns" "$STATE/saved/netns" 2>/dev/null && continue
		umount "/run/netns/$ns" 2>/dev/null || true
		rm -f "/run/netns/$ns"
	done
	ip link del "$BRIDGE" 2>/dev/null || true
	ip link del "$NODE_IF" 2>/dev/null || true
	# 6. Mounts under our directories (overlays, shm, volumes), deepest first.
	local m
	for m in $(awk -v a="$STATE/" -v b="$RUN/" 'index($5, a) == 1 || index($5, b) == 1 || $5 == substr(a, 1, length(a)-1) || $5 == substr(b, 1, length(b)-1) {print $5}' /proc/self/mountinfo | sort -r); do
		umount -l "$m" 2>/dev/null || true
	done
	# 7. cgroups: /meshwarp-cluster in every hierarchy, deepest first.
	local h
	for h in $(cgroup_mounts); do
		[[ -d $h/$CGROUP_ROOT ]] && find "$h/$CGROUP_ROOT" -depth -type d -exec rmdir {} \; 2>/dev/null || true
	done
	# 8. Kernel settings.
	restore_sysctls
	# 9. Host paths that did not exist before up.
	# CNI results of our pods: our network's, and containerd's loopback ones
	# of the same sandboxes (left when the kubelet could not tear pods down).
	local r id
	for r in /var/lib/cni/results/meshwarp-k8s-*; do
		[[ -e $r ]] || continue
		id=${r#/var/lib/cni/results/meshwarp-k8s-}
		rm -f "$r" "/var/lib/cni/results/cni-loopback-${id%-eth0}-lo"
	done
	if [[ -f $STATE/saved/paths ]]; then
		while IFS= read -r p; do
			[[ -n $p && -e $p ]] || continue
			if [[ " ${CNI_PATHS[*]} " == *" $p "* ]]; then
				find "$p" -depth -type d -empty -delete 2>/dev/null || true
			else
				rm -rf "$p"
			fi
		done <"$STATE/saved/paths"
	fi
	podman rmi -f localhost/meshwarp-pause:3.10 localhost/meshwarp:cluster-a localhost/meshwarp:cluster-b localhost/meshwarp-demo:cluster >/dev/null 2>&1 || true
	rm -rf "$STATE" "$RUN"
	log "down in $(($(now) - t0)) s"
	leftovers
}

# The KUBE-* chains (kubelet's canary and hint chains, kube-proxy's if any),
# when there were none before up: jumps first, then flush, then delete.
remove_kube_chains() {
	local t table rules
	for t in iptables ip6tables; do
		for table in filter nat mangle; do
			rules=$("$t" -w -t "$table" -S 2>/dev/null) || continue
			echo "$rules" | awk '$1 == "-A" && $2 !~ /^KUBE-/ && /-j KUBE-/ {$1 = "-D"; print}' | while read -r r; do
				eval "$t -w -t $table $r" 2>/dev/null || true
			done
			echo "$rules" | awk '$1 == "-N" && $2 ~ /^KUBE-/ {print $2}' | while read -r c; do
				"$t" -w -t "$table" -F "$c" 2>/dev/null || true
			done
			echo "$rules" | awk '$1 == "-N" && $2 ~ /^KUBE-/ {print $2}' | while read -r c; do
				"$t" -w -t "$table" -X "$c" 2>/dev/null || true
			done
		done
	done
}

# leftovers prints anything of ours still on the machine and fails if so.
leftovers() {
	local left=()
	[[ -e $STATE || -e $RUN ]] && left+=("files $STATE $RUN")
	ip link show "$NODE_IF" >/dev/null 2>&1 && left+=("interface $NODE_IF")
	ip link show "$BRIDGE" >/dev/null 2>&1 && left+=("interface $BRIDGE")
	[[ -n $(our_shims) ]] && left+=("containerd shims")
	for h in $(cgroup_mounts); do [[ -d $h/$CGROUP_ROOT ]] && left+=("cgroup $h/$CGROUP_ROOT"); done
	grep -q -e "$STATE" -e "$RUN" /proc/self/mountinfo && left+=("mounts")
	nft list table ip kube-proxy >/dev/null 2>&1 && left+=("nftables table ip kube-proxy")
	[[ -e $PIN_DIR ]] && left+=("pins $PIN_DIR")
	[[ $(sysctl -n kernel.panic_on_oops) == 1 ]] && left+=("kernel.panic_on_oops=1")
	if ((${#left[@]} > 0)); then
		log "left behind: ${left[*]}"
		return 1
	fi
}

main() {
	case ${1:-} in
	up) cmd_up ;;
	down) cmd_down ;;
	status) shift; cmd_status "$@" ;;
	images) build_images ;; # for debugging the image build alone
	*) echo "usage: $0 up|down|status [--json]" >&2; exit 2 ;;
	esac
}

# One line: bash has read all of it before running, so editing this file while
# it runs cannot make it execute anything else.
main "$@"; exit $?
