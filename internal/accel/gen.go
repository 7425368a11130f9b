// SPDX-License-Identifier: Apache-2.0

package accel

// Objects and Go bindings are committed; `make generate` refreshes them and
// `make generate-check` (CI) fails when they are stale.
//go:generate go tool bpf2go -tags linux -cc clang -cflags "-mcpu=v3 -O2 -g -Wall -Werror -I../../bpf/include" -target bpfel -type mw_conn_id -type mw_sock_key -type mw_conn -type mw_sk_state -type mw_counters -type mw_policy_cfg -type mw_cidr_key -type mw_endpoint -type mw_splice_proc accel ../../bpf/accel/accel.bpf.c
