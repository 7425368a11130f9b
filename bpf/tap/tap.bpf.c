// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
/*
 * `meshwarp tap`: the agent's object plus mw_skmsg_tap, which redirects
 * exactly as mw_skmsg does and also copies each redirected message (up to
 * tap_snaplen bytes) to mw_tap_ring. Loaded against the agent's pinned maps
 * and swapped into its sk_msg link only while a tap runs.
 */
#define MW_TAP 1
#include "../accel/accel.bpf.c"
