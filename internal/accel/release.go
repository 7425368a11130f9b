// SPDX-License-Identifier: Apache-2.0

package accel

import (
	"errors"
	"fmt"
	"path/filepath"
	"time"

	"github.com/cilium/ebpf"
)

// releaseGrace is how long the sweep waits after sock_ops is detached: a
// sock_ops run that began before the detach takes microseconds, and one
// still pairing a connection must be over before its client is removed.
const releaseGrace = 10 * time.Millisecond

// releaseUnpaired takes the connecting socket of every connection that is
// not paired out of the SOCKHASH, once sock_ops is detached (Uninstall,
// Cleanup). While the agent runs, such a socket leaves at its next packet
// (bpf/accel/pairing.h); without sock_ops nothing would take it out, and
// tcp_bpf would answer FIONREAD from its empty redirect queue for the rest
// of its life. It never had a redirected byte (only a PAIRED connection
// redirects), so removing it loses none. Paired connections stay: their
// leave poll still runs (bpf/accel/leave.h). It returns how many it removed.
func releaseUnpaired(conns, sockhash *ebpf.Map) (int, error) {
	time.Sleep(releaseGrace)
	var (
		slot    uint32
		c       accelMwConn
		removed int
		errs    []error
	)
	it := conns.Iterate()
	for it.Next(&slot, &c) {
		// A free slot (state 0), or a paired connection.
		if c.State == 0 || c.State == accelMwConnStateMW_CONN_PAIRED {
			continue
		}
		key := accelMwSockKey{Conn: c.Id, ActiveCookie: c.ActiveCookie, Role: accelMwRoleMW_ROLE_ACTIVE}
		switch err := sockhash.Delete(&key); {
		case err == nil:
			removed++
		case !errors.Is(err, ebpf.ErrKeyNotExist):
			errs = append(errs, fmt.Errorf("release an unpaired socket: %w", err))
		}
	}
	errs = append(errs, it.Err())
	return removed, errors.Join(errs...)
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
	hash, err := ebpf.LoadPinnedMap(filepath.Join(pinDir, accelMapMwSockHash), nil)
	if err != nil {
		conns.Close()
		return nil, err
	}
	return func() (int, error) {
		defer conns.Close()
		defer hash.Close()
		return releaseUnpaired(conns, hash)
	}, nil
}
