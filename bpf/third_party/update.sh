#!/usr/bin/env bash
# Refreshes the pinned BPF headers: libbpf's helper headers from the libbpf-dev
# package and vmlinux.h (CO-RE types) from the running kernel's BTF.
# The results are committed so that `go generate` gives the same objects everywhere.
# They are not meshwarp's code (third_party: linters and duplicate finders skip
# them); meshwarp's own BPF headers live beside their .bpf.c (bpf/accel, bpf/crossnode).
set -euo pipefail
cd "$(dirname "$0")"
for h in bpf_helpers.h bpf_helper_defs.h bpf_endian.h bpf_core_read.h bpf_tracing.h; do
	cp "/usr/include/bpf/$h" "$h"
done
bpftool btf dump file /sys/kernel/btf/vmlinux format c >vmlinux.h
