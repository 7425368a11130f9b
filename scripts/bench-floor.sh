#!/usr/bin/env bash
# The floor of what the agent costs a connection (issue 22, goal 3): the
# same workload in the lab with nothing attached (sidecar), with programs
# that do no work on every hook the agent attaches (floor-hooks), with those
# and a socket record of the agent's size created per TCP socket
# (floor-record; bpf/floor/floor.bpf.c), and with the agent observing only
# (sidecar+observe) and whole (sidecar+meshwarp). Modes interleaved, one
# `meshwarp bench` run per mode and round, the order rotated each round; prints qps per round, the median
# per mode and its ratio to sidecar.
#
#   scripts/bench-floor.sh [ROUNDS] [DURATION] [WORKLOAD]   (default 5 10s http-close)
#
# MESHWARP_FLOOR_BASE is the bench mode the floor programs run under and the
# ratios' base (default sidecar; direct: app to app, no proxies, where no hop
# is NATed). MESHWARP_FLOOR_MODES picks the modes (default: BASE floor-hooks
# floor-record BASE+observe BASE+meshwarp); one hook at a time:
# floor-sockops, floor-setsockopt, floor-create, floor-skb (both ways).
# floor-bypass: the textbook design of the peers the issue compares us with
# (every established socket in a SOCKHASH by its 4-tuple, sk_msg redirects
# to the mirrored tuple; bpf/floor/floor.bpf.c), loaded afresh each round
# and freed after it, so that no socket stays in its map into the next run.
#
# Needs root, clang, bpftool (scripts/install-deps.sh) and a built meshwarp
# (go build -o bin/meshwarp ./cmd/meshwarp). Uses the lab that is up, or
# brings one up and takes it down at the end. Its pins carry a meshwarp
# prefix; its programs are detached and unpinned on exit.
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-5}
duration=${2:-10s}
workload=${3:-http-close}
mw=${MESHWARP_BIN:-bin/meshwarp}
[ -x "$mw" ] || { echo "no $mw: go build -o $mw ./cmd/meshwarp" >&2; exit 2; }
for tool in clang bpftool python3; do
	command -v "$tool" >/dev/null || { echo "$tool missing: scripts/install-deps.sh" >&2; exit 2; }
done
pin=/sys/fs/bpf/meshwarp-floor
work=$(mktemp -d /tmp/meshwarp-floor.XXXXXX)
lab_mine=0 attached=()
detach() {
	local a
	for a in "${attached[@]}"; do
		# shellcheck disable=SC2086 # "type prog" pairs
		bpftool cgroup detach "$cg" $a 2>/dev/null || true
	done
	attached=()
}
bypass_down() {
	bpftool cgroup detach "$cg" sock_ops pinned "$pin-bypass/floor_bypass_sockops" 2>/dev/null || true
	# Unpinned, the map goes with its last reference, and its sockets leave it.
	rm -rf "$pin-bypass"
}
cleanup() {
	detach
	if [ -n "${cg:-}" ]; then bypass_down; fi
	rm -rf "$pin" "$work"
	if [ "$lab_mine" = 1 ]; then "$mw" lab down >/dev/null 2>&1 || true; fi
}
trap cleanup EXIT INT TERM

# hook name -> "attach type and pinned program" (bpftool cgroup attach)
declare -A hook=(
	[sockops]="sock_ops pinned $pin/floor_sockops"
	[setsockopt]="setsockopt pinned $pin/floor_setsockopt"
	[create]="sock_create pinned $pin/floor_sock_create"
	[record]="sock_create pinned $pin/floor_sock_create_rec"
	[egress]="egress pinned $pin/floor_egress"
	[ingress]="ingress pinned $pin/floor_ingress"
)
# floor mode -> its hooks
declare -A floor=(
	[floor-hooks]="sockops setsockopt create egress ingress"
	[floor-record]="sockops setsockopt record egress ingress"
	[floor-sockops]="sockops"
	[floor-setsockopt]="setsockopt"
	[floor-create]="create"
	[floor-skb]="egress ingress"
)
base=${MESHWARP_FLOOR_BASE:-sidecar}
modes=${MESHWARP_FLOOR_MODES:-$base floor-hooks floor-record $base+observe $base+meshwarp}
case " $modes " in *" $base "*) ;; *) echo "bench-floor: the modes must include $base (the base, MESHWARP_FLOOR_BASE)" >&2; exit 2 ;; esac
for m in $modes; do
	case $m in floor-bypass) ;; floor-*) [ -n "${floor[$m]:-}" ] || { echo "bench-floor: unknown mode $m (floor modes: ${!floor[*]} floor-bypass)" >&2; exit 2; } ;; esac
done

clang -target bpf -mcpu=v3 -O2 -g -Wall -Werror -Ibpf/third_party -Ibpf/include \
	-c bpf/floor/floor.bpf.c -o "$work/floor.o"
rm -rf "$pin" "$pin-bypass"
bpftool prog loadall "$work/floor.o" "$pin"

if ! "$mw" lab status >/dev/null 2>&1; then
	echo "bench-floor: bringing the lab up (taken down at the end)" >&2
	"$mw" lab up >/dev/null
	lab_mine=1
fi
cg=$("$mw" lab status | awk '$1 == "cgroup:" {print $2}')
[ -d "$cg" ] || { echo "bench-floor: no lab cgroup ($cg)" >&2; exit 1; }

attach() { # hook names
	local h
	for h in "$@"; do
		# shellcheck disable=SC2086 # "type pinned path"
		bpftool cgroup attach "$cg" ${hook[$h]}
		attached+=("${hook[$h]}")
	done
}

run() { # bench mode, output json
	if ! "$mw" bench --modes "$1" --workloads "$workload" --repeat 1 --duration "$duration" \
		--bpf-stats=false --json "$2" >"$2.log" 2>&1; then
		echo "bench-floor: meshwarp bench --modes $1 failed:" >&2
		cat "$2.log" >&2
		exit 1
	fi
}

read -ra order <<<"$modes"
for r in $(seq "$rounds"); do
	# Each round starts one mode later: what a run leaves behind (TIME_WAIT
	# sockets, conntrack entries) is not always before the same mode.
	for i in "${!order[@]}"; do
		m=${order[$(((i + r - 1) % ${#order[@]}))]}
		case $m in
		floor-bypass)
			bpftool prog loadall "$work/floor.o" "$pin-bypass" pinmaps "$pin-bypass/maps"
			bpftool prog attach pinned "$pin-bypass/floor_bypass_msg" msg_verdict pinned "$pin-bypass/maps/floor_bypass_map"
			bpftool cgroup attach "$cg" sock_ops pinned "$pin-bypass/floor_bypass_sockops"
			run "$base" "$work/$m-$r.json"
			bypass_down
			;;
		floor-*) attach ${floor[$m]}; run "$base" "$work/$m-$r.json"; detach ;;
		*) run "$m" "$work/$m-$r.json" ;;
		esac
	done
	echo "bench-floor: round $r/$rounds done" >&2
done

python3 - "$work" "$rounds" "$workload" "$base" $modes <<'EOF'
import json, statistics, sys
work, rounds, workload, base, modes = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5:]
def result(m, r):
    d = json.load(open(f"{work}/{m}-{r}.json"))
    x = next(x for x in d["results"] if x["workload"] == workload)
    return x["qps"], x["cpu_seconds_per_1k_requests"]
res = {m: [result(m, r) for r in range(1, rounds + 1)] for m in modes}
med = statistics.median
print(f"{workload}, {rounds} rounds, modes interleaved: qps per round, their median, the median of")
print(f"the per-round ratios to {base}; the lab cgroup's CPU per request (median) and its excess over {base}'s")
base_cpu = med(c for _, c in res[base]) * 1000
for m in modes:
    q = [v for v, _ in res[m]]
    cpu = med(c for _, c in res[m]) * 1000
    ratio = med(a / b for a, (b, _) in zip(q, res[base]))
    print(f"  {m:17} {' '.join(f'{v:5.0f}' for v in q)}  median {med(q):5.0f}  x{ratio:.2f}  cpu {cpu:4.0f} us/req {cpu - base_cpu:+4.0f}")
EOF
