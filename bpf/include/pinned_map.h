/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * The type of a map pinned by name, so that a restarted agent adopts it and
 * what it holds (accel and crossnode):
 *
 *   MW_PINNED_MAP(BPF_MAP_TYPE_HASH, 64, __u64, struct mw_xn_node) mw_xn_nodes SEC(".maps");
 *
 * A map with map_flags, or one not pinned, is written out in full.
 */
#ifndef MESHWARP_PINNED_MAP_H
#define MESHWARP_PINNED_MAP_H

#define MW_PINNED_MAP(map_type, entries, key_type, value_type) \
	struct {                                               \
		__uint(type, map_type);                        \
		__uint(max_entries, entries);                  \
		__type(key, key_type);                         \
		__type(value, value_type);                     \
		__uint(pinning, LIBBPF_PIN_BY_NAME);           \
	}

#endif /* MESHWARP_PINNED_MAP_H */
