// SPDX-License-Identifier: Apache-2.0

package tap

//go:generate go tool bpf2go -tags linux -cc clang -cflags "-mcpu=v3 -O2 -g -Wall -Werror -I../../bpf/include -I../../bpf/accel" -target bpfel -type mw_tap_rec -type mw_tap_stats tap ../../bpf/tap/tap.bpf.c
