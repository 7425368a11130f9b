#!/usr/bin/env bash
# What the agent costs a process outside its cgroup (issue 22, goal 1):
# qperf over loopback in this shell's cgroup, with an agent attached to an
# empty cgroup (defaults) and without one, interleaved, repeated; prints the
# median bandwidth of each and their ratio per message size.
#
#   scripts/bench-outside.sh [REPEATS] [SECONDS]      (default 5 x 3 s)
#
# Needs root, qperf (scripts/install-deps.sh) and a built meshwarp-agent
# (go build -o bin/meshwarp-agent ./cmd/meshwarp-agent). Everything it
# creates carries a meshwarp prefix and is removed on exit.
set -euo pipefail
cd "$(dirname "$0")/.."
repeats=${1:-5}
secs=${2:-3}
agent=${MESHWARP_AGENT:-bin/meshwarp-agent}
[ -x "$agent" ] || { echo "no $agent: go build -o $agent ./cmd/meshwarp-agent" >&2; exit 2; }
command -v qperf >/dev/null || { echo "qperf missing: scripts/install-deps.sh" >&2; exit 2; }
root=$(awk '$3 == "cgroup2" {print $2; exit}' /proc/mounts)
cg="$root/meshwarp-bench-empty"
pin=/sys/fs/bpf/meshwarp-bench-outside
port=19799
agent_pid="" qperf_pid=""
cleanup() {
	[ -n "$agent_pid" ] && kill "$agent_pid" 2>/dev/null && wait "$agent_pid" 2>/dev/null || true
	[ -n "$qperf_pid" ] && kill "$qperf_pid" 2>/dev/null || true
	rmdir "$cg" 2>/dev/null || true
	rm -rf "$pin" 2>/dev/null || true
}
trap cleanup EXIT INT TERM
mkdir -p "$cg"
qperf -lp "$port" >/dev/null 2>&1 &
qperf_pid=$!
sleep 0.5 # qperf has no readiness signal; the first run below retries anyway

bw() { # size -> MB/s of one qperf tcp_bw run
	qperf -lp "$port" -t "$secs" -m "$1" 127.0.0.1 tcp_bw 2>/dev/null |
		awk '$1 == "bw" {v=$3; u=$4; if (u=="GB/sec") v*=1000; if (u=="KB/sec") v/=1000; print v}'
}
start_agent() {
	"$agent" run --cgroup "$cg" --pin-dir "$pin" --metrics-addr 127.0.0.1:0 >/dev/null 2>&1 &
	agent_pid=$!
	for _ in $(seq 100); do [ -e "$pin/mw_sockops_link" ] && return; sleep 0.1; done
	echo "agent did not attach" >&2; exit 1
}
stop_agent() { kill "$agent_pid"; wait "$agent_pid" 2>/dev/null || true; agent_pid=""; }

declare -A off on
for size in 64 1024; do
	off[$size]="" on[$size]=""
done
for r in $(seq "$repeats"); do
	for size in 64 1024; do
		off[$size]+="$(bw "$size") "
		start_agent
		on[$size]+="$(bw "$size") "
		stop_agent
	done
	echo "repeat $r/$repeats done" >&2
done
median() { tr ' ' '\n' | grep . | sort -g | awk '{a[NR]=$1} END {print (NR%2 ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2)}'; }
printf '| size | without agent MB/s (median) | agent on an empty cgroup MB/s (median) | ratio | runs without | runs with |\n|---|---|---|---|---|---|\n'
for size in 64 1024; do
	a=$(echo "${off[$size]}" | median)
	b=$(echo "${on[$size]}" | median)
	printf '| %s B | %s | %s | x%s | %s| %s|\n' "$size" "$a" "$b" "$(awk -v a="$a" -v b="$b" 'BEGIN {printf "%.2f", b / a}')" "${off[$size]}" "${on[$size]}"
done
