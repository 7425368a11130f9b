#!/usr/bin/env bash
# Fails when regenerating the BPF objects and Go bindings (bpf2go) changes
# anything: the committed .o/.go must match bpf/ sources.
set -euo pipefail
cd "$(dirname "$0")/.."
go generate ./internal/...
generated=(':(glob)internal/**/*_bpfel.o' ':(glob)internal/**/*_bpfel.go')
if ! git diff --quiet -- "${generated[@]}" || [[ -n "$(git ls-files --others --exclude-standard -- "${generated[@]}")" ]]; then
	echo "generated BPF files are stale: run 'go generate ./internal/...' and commit the result" >&2
	git --no-pager diff --stat -- "${generated[@]}" >&2
	exit 1
fi
echo "generated BPF files are up to date"

# bpf/floor (scripts/bench-floor.sh) is compiled when the bench runs, not
# committed: check here that it still compiles against the shared headers.
floor_obj=$(mktemp /tmp/meshwarp-floor-check.XXXXXX.o)
trap 'rm -f "$floor_obj"' EXIT
clang -target bpf -mcpu=v3 -O2 -g -Wall -Werror -Ibpf/third_party -Ibpf/include -c bpf/floor/floor.bpf.c -o "$floor_obj"
echo "bpf/floor compiles"
