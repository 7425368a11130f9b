// SPDX-License-Identifier: Apache-2.0

package accel

// Objects and Go bindings are committed; `go generate ./internal/...` refreshes
// them and scripts/generate-check.sh (part of scripts/test.sh) fails when they are stale.
//go:generate go tool bpf2go -tags linux -cc clang -cflags "-mcpu=v3 -O2 -g -Wall -Werror -I../../bpf/third_party -I../../bpf/include" -target bpfel -type mw_conn_id -type mw_conn -type mw_conn_state -type mw_role -type mw_sk_state -type mw_counters -type mw_policy_cfg -type mw_cidr_key -type mw_endpoint -type mw_unfit_key -type mw_unfit_proc -type mw_reason -type mw_hop -type mw_flow_key -type mw_pair_flow_key -type mw_pair_flow_slot -type mw_slot_state -type mw_pair_points_key -type mw_flow -type mw_point -type mw_proto -type mw_method -type mw_tcp_outcome -type mw_tap_rec -type mw_tap_stats accel ../../bpf/accel/accel.bpf.c
