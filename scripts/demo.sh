#!/usr/bin/env bash
# The main job: install what is missing, build meshwarp, bring up the lab,
# run the side-by-side benchmark and print the comparison.
#   ./scripts/demo.sh          quick run (every mode and workload, 1 s runs,
#                              3 interleaved repeats: medians, not one noisy run)
#   ./scripts/demo.sh --full   3 interleaved repeats of 10 s runs (about 15 minutes)
# Reports go to ./out/ (bench.json, report.html).
set -euo pipefail
cd "$(dirname "$0")/.."

if [[ $EUID -ne 0 ]]; then
	echo "demo: needs root (BPF, network namespaces, iptables): sudo $0 $*" >&2
	exit 1
fi
scripts/install-deps.sh
mkdir -p out
echo "== building meshwarp" >&2
# no_tls_fallback: fortio's switch that leaves out a CA bundle parsed at
# every start (meshwarp makes no TLS calls; docs/BENCHMARKS.md section 11).
go build -tags no_tls_fallback -o out/meshwarp ./cmd/meshwarp
out/meshwarp probe

# One 1 s run per mode reads 20-30 % off on a small machine (BENCHMARKS
# section 51): the medians of three interleaved ones are what the demo shows.
mode=(--quick --repeat 3)
if [[ "${1:-}" == "--full" ]]; then
	mode=(--repeat 3 --duration 10s)
fi
# bench prints the table and says where the reports are.
out/meshwarp bench "${mode[@]}" --json out/bench.json --html out/report.html
