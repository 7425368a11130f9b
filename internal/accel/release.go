// SPDX-License-Identifier: Apache-2.0

package accel

import (
	"errors"
	"fmt"
	"path/filepath"
	"time"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"
)

// releaseGrace is how long the sweep waits after sock_ops is detached: a
// sock_ops run that began before the detach takes microseconds, and one
// still pairing a connection must be over before its client is removed.
const releaseGrace = 10 * time.Millisecond

// releaseUnpaired takes the connecting socket of every connection that is
// not paired out of mw_sock_map, once sock_ops is detached (Uninstall,
// Cleanup). While the agent runs, such a socket leaves at its next packet
// (bpf/accel/pairing.h); without sock_ops nothing would take it out, and
// tcp_bpf would answer FIONREAD from its empty redirect queue for the rest
// of its life. It never had a redirected byte (only a PAIRED connection
// redirects), so removing it loses none. Paired connections stay: their
// leave poll still runs (bpf/accel/leave.h). It returns how many it removed.
func releaseUnpaired(conns, socks *ebpf.Map) (int, error) {
	time.Sleep(releaseGrace)
	var (
		removed int
		errs    []error
	)
	err := eachConn(conns, func(slot uint32, c *accelMwConn) {
		// A free slot (state 0), or a paired connection.
		if c.State == 0 || c.State == accelMwConnStateMW_CONN_PAIRED {
			return
		}
		index := sockIndex(slot, accelMwRoleMW_ROLE_ACTIVE)
		switch err := socks.Delete(&index); {
		case err == nil:
			removed++
		// An index without a socket: the client left already (no peer,
		// unpaired timeout) or closed since the read. The kernel's SOCKMAP
		// delete says EINVAL for that (net/core/sock_map.c,
		// __sock_map_delete), not ENOENT; every index here is in range.
		case errors.Is(err, ebpf.ErrKeyNotExist), errors.Is(err, unix.EINVAL):
		default:
			errs = append(errs, fmt.Errorf("release an unpaired socket: %w", err))
		}
	})
	errs = append(errs, err)
	return removed, errors.Join(errs...)
}

// eachConn calls fn with every slot of mw_conns, read in batches (the map
// is an array of 65536 slots by default: one lookup each would be 65536
// system calls).
func eachConn(conns *ebpf.Map, fn func(slot uint32, c *accelMwConn)) error {
	const batch = 1024
	keys := make([]uint32, batch)
	vals := make([]accelMwConn, batch)
	var cursor ebpf.MapBatchCursor
	for {
		n, err := conns.BatchLookup(&cursor, keys, vals, nil)
		for i := range n {
			fn(keys[i], &vals[i])
		}
		if errors.Is(err, ebpf.ErrKeyNotExist) {
			return nil // the end
		}
		if err != nil {
			return fmt.Errorf("read mw_conns: %w", err)
		}
	}
}

// sockIndex is where a socket of the connection in slot is in mw_sock_map
// (bpf/accel/maps.h, sock_index).
func sockIndex(slot uint32, role accelMwRole) uint32 {
	if role == accelMwRoleMW_ROLE_ACTIVE {
		return 2 * slot
	}
	return 2*slot + 1
}

// openPinnedRelease opens the maps pinned in pinDir for releaseUnpaired
// (Cleanup: the agent that pinned them is gone). Open them before unpinning,
// call release after the sock_ops link is unpinned (it closes them).
// Maps of another build's layout are left alone: their entries may mean
// something else, and that build's own programs take care of its sockets.
func openPinnedRelease(pinDir string) (release func() (int, error), err error) {
	spec, err := loadAccel()
	if err != nil {
		return nil, err
	}
	if err := checkPinnedLayout(spec, pinDir); err != nil {
		return nil, err
	}
	conns, err := ebpf.LoadPinnedMap(filepath.Join(pinDir, accelMapMwConns), nil)
	if err != nil {
		return nil, err
	}
	socks, err := ebpf.LoadPinnedMap(filepath.Join(pinDir, accelMapMwSockMap), nil)
	if err != nil {
		conns.Close()
		return nil, err
	}
	return func() (int, error) {
		defer conns.Close()
		defer socks.Close()
		return releaseUnpaired(conns, socks)
	}, nil
}
