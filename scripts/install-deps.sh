#!/usr/bin/env bash
# Installs the Debian packages meshwarp builds, tests and benchmarks with.
# Idempotent: installs only what is missing, and runs apt-get update only then.
# Usage: scripts/install-deps.sh [--test | --vm]   (--test adds what only the tests need;
#        --vm only what scripts/vmtest.sh boots its kernels with)
set -euo pipefail

pkgs=(clang llvm libbpf-dev bpftool iproute2 iptables procps haproxy qperf redis-server redis-tools nginx curl python3)
case "${1:-}" in
# The one-node Kubernetes cluster of scripts/cluster.sh (test/cluster) adds
# the node's runtime, CNI plugins and etcd; gcc and libc6-dev build the static
# pause binary; nftables lists and removes kube-proxy's tables.
--test) pkgs+=(chromium podman runc tshark tmux
	containerd containernetworking-plugins etcd-server nftables openssl gcc libc6-dev) ;;
--vm) pkgs=(qemu-system-x86 udev kmod busybox-static python3-venv) ;;
esac

missing=()
for p in "${pkgs[@]}"; do
	dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done

if ((${#missing[@]} == 0)); then
	exit 0
fi
if [[ $EUID -ne 0 ]]; then
	echo "install-deps: missing packages ${missing[*]}; run as root: sudo $0 $*" >&2
	exit 1
fi
echo "install-deps: installing ${missing[*]}" >&2
export DEBIAN_FRONTEND=noninteractive
apt-get -o DPkg::Lock::Timeout=600 update -qq
apt-get -o DPkg::Lock::Timeout=600 install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
