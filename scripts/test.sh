#!/usr/bin/env bash
# Runs every test of meshwarp: the README's test command, and what CI runs.
#   - installs the Debian packages the tests use (idempotent)
#   - checks formatting, vet, and that the committed BPF objects match their C sources
#   - unit tests, then the privileged integration tests (real kernel, real
#     namespaces and cgroups; they skip with a reason when not run as root)
#   - the end-to-end test on a one-node Kubernetes cluster (test/cluster)
set -euo pipefail
cd "$(dirname "$0")/.."

step() { printf '\n== %s\n' "$*"; }

step "packages"
scripts/install-deps.sh --test

step "gofmt"
unformatted=$(gofmt -l cmd internal)
if [[ -n "$unformatted" ]]; then
	echo "not gofmt-ed:"; echo "$unformatted"; exit 1
fi

step "go vet"
go vet ./...
go vet -tags vmtest ./internal/accel

step "build both binaries (meshwarp, meshwarp-agent)"
go build -o /dev/null ./cmd/meshwarp
go build -o /dev/null ./cmd/meshwarp-agent

step "generate-check (committed BPF objects match bpf/ sources)"
scripts/generate-check.sh

if [[ $EUID -ne 0 ]]; then
	echo "note: not root: privileged tests will be skipped (run as root for the full suite)" >&2
fi

# -p 1: privileged tests of different packages attach programs, create
# namespaces and move the test process between cgroups; run packages one at
# a time so they never share the 2 cores' worth of timing or names.
step "tests"
go test -p 1 -count=1 -timeout 40m ./... 2>&1 | tee /tmp/meshwarp-test.log

# The end-to-end test on a real one-node Kubernetes cluster (test/cluster):
# scripts/cluster.sh up builds Kubernetes and helm from Go modules (cold: about
# 15 minutes on 2 cores, cached after), installs the chart and the demo pods,
# the test checks, and down removes everything. Build tag `cluster` keeps it
# out of the run above; as root it always runs (RequirePrivileged).
# MESHWARP_CLUSTER=0 skips it for a quick local run; CI never sets it.
step "cluster end-to-end test (test/cluster)"
go vet -tags cluster ./test/cluster
if [[ "${MESHWARP_CLUSTER:-1}" == 0 ]]; then
	echo "note: MESHWARP_CLUSTER=0: cluster end-to-end test skipped" >&2
else
	log=/tmp/meshwarp-cluster-test.log
	if ! go test -tags cluster -count=1 -timeout 60m -v ./test/cluster >"$log" 2>&1; then
		cat "$log"
		exit 1
	fi
	grep -E '^(--- |    --- |ok|PASS)|cluster: (up|down|built)|took' "$log"
fi

# The kernel matrix: the data path's privileged tests and `meshwarp probe` in
# VMs on the 6.1 and 6.12 LTS kernels (software emulation, about 15 minutes;
# scripts/vmtest.sh prints the time per kernel). MESHWARP_VM=0 skips it for a
# quick local run; CI never sets it.
step "kernel matrix (VMs: 6.1, 6.12)"
if [[ "${MESHWARP_VM:-1}" == 0 ]]; then
	echo "note: MESHWARP_VM=0: kernel matrix skipped" >&2
elif [[ $EUID -ne 0 ]]; then
	if [[ -n "${MESHWARP_REQUIRE_PRIVILEGED:-}" ]]; then
		echo "kernel matrix needs root (apt, bpf in the guest) and MESHWARP_REQUIRE_PRIVILEGED is set" >&2
		exit 1
	fi
	echo "note: not root: kernel matrix skipped" >&2
else
	scripts/vmtest.sh
fi
