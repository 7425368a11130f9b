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
