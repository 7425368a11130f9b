// SPDX-License-Identifier: Apache-2.0

package crossnode

// Objects and Go bindings are committed; `go generate ./internal/...` refreshes
// them and scripts/generate-check.sh (part of scripts/test.sh) fails when they are stale.
//go:generate go tool bpf2go -tags linux -cc clang -cflags "-mcpu=v3 -O2 -g -Wall -Werror -I../../bpf/third_party -I../../bpf/include" -target bpfel -type mw_xn_dev_key -type mw_xn_dev -type mw_xn_node -type mw_xn_mac_key -type mw_xn_counters -type mw_xn_hookfn_table -type mw_xn_dev_slot crossnode ../../bpf/crossnode/crossnode.bpf.c
