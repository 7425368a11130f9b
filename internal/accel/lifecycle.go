// SPDX-License-Identifier: Apache-2.0

package accel

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"

	"github.com/meshwarp/meshwarp/internal/crossnode"
)

// Close releases this process's handles. Everything stays attached and
// pinned: a restarted agent adopts it, `meshwarp cleanup` removes it.
// Safe to call twice.
func (a *Agent) Close() error {
	if a == nil || a.closed {
		return nil
	}
	a.closed = true
	var errs []error
	for _, l := range a.watches {
		errs = append(errs, l.Close())
	}
	errs = append(errs, a.xn.Close())
	errs = append(errs, a.closeObservation())
	if a.sockops != nil {
		errs = append(errs, a.sockops.Close())
	}
	for _, l := range a.hooks {
		errs = append(errs, l.Close())
	}
	if a.skmsg != nil {
		errs = append(errs, a.skmsg.Close())
	}
	errs = append(errs, a.objs.Close())
	if a.lock != nil {
		errs = append(errs, a.lock.Close())
	}
	return errors.Join(errs...)
}

// Uninstall stops accelerating new connections and removes every pin.
// Open accelerated connections keep working until they close (the kernel
// keeps their maps and program alive); nothing is deleted from the SOCKMAP.
// It returns how many accelerated sockets were still open.
func (a *Agent) Uninstall() (openSockets uint64, err error) {
	if a == nil || a.closed {
		return 0, nil
	}
	if st, err := a.Stats(); err == nil {
		openSockets = st.AcceleratedSockets
	}
	var errs []error
	if a.xn != nil {
		errs = append(errs, a.xn.Uninstall())
	}
	if _, err := crossnode.Cleanup(a.cfg.PinDir); err != nil {
		errs = append(errs, err)
	}
	// New sockets first: no socket joins the hash after this.
	if a.sockops != nil {
		errs = append(errs, a.sockops.Unpin(), a.sockops.Close())
		a.sockops = nil
	}
	released, err := releaseUnpaired(a.objs.MwConns, a.objs.MwSockMap)
	errs = append(errs, err)
	for _, l := range a.hooks {
		errs = append(errs, l.Unpin(), l.Close())
	}
	a.hooks = nil
	if a.skmsg != nil {
		errs = append(errs, a.skmsg.Unpin(), a.skmsg.Close())
		a.skmsg = nil
	}
	for _, l := range a.obs {
		errs = append(errs, l.Unpin(), l.Close())
	}
	a.obs = nil
	// Links an earlier agent pinned that this one did not take over.
	for _, name := range linkPins {
		if err := os.Remove(filepath.Join(a.cfg.PinDir, name)); err != nil && !errors.Is(err, os.ErrNotExist) {
			errs = append(errs, fmt.Errorf("unpin %s: %w", name, err))
		}
	}
	errs = append(errs, unpinMaps(a.cfg.PinDir))
	// The directory goes while this agent still holds it (Close unlocks).
	errs = append(errs, removePinDir(a.cfg.PinDir))
	errs = append(errs, a.Close())
	a.logger.Info("acceleration uninstalled", "pin_dir", a.cfg.PinDir, "open_accelerated_sockets", openSockets,
		"released_unpaired_sockets", released)
	return openSockets, errors.Join(errs...)
}

// CleanupResult says what Cleanup removed.
type CleanupResult struct {
	Removed                []string `json:"removed"`
	OpenAcceleratedSockets uint64   `json:"open_accelerated_sockets"`
	// ReleasedUnpairedSockets: connecting sockets still waiting for a peer,
	// taken out of the SOCKMAP once sock_ops was detached (releaseUnpaired).
	ReleasedUnpairedSockets int `json:"released_unpaired_sockets"`
}

// Cleanup removes whatever an agent pinned at pinDir (detaching its
// programs); it refuses while an agent runs there. Open accelerated connections keep
// working until they close. Only names meshwarp pins are removed; a missing
// pin directory is not an error.
func Cleanup(pinDir string) (CleanupResult, error) {
	var res CleanupResult
	if pinDir == "" {
		pinDir = DefaultPinDir
	}
	if _, err := os.Stat(pinDir); errors.Is(err, os.ErrNotExist) {
		return res, nil
	}
	// A live agent's open links keep its programs attached whatever is
	// unpinned; stopping it is what detaches them.
	if busy, pid := pinDirLocked(pinDir); busy {
		if pid == "" {
			pid = "unknown"
		}
		return res, fmt.Errorf("%w: %s (pid %s): stop it instead (SIGTERM; it uninstalls on exit); cleanup removes what a killed agent or --keep-on-exit left", ErrPinDirBusy, pinDir, pid)
	}
	if st, err := ReadPinnedStats(pinDir); err == nil {
		res.OpenAcceleratedSockets = st.AcceleratedSockets
	}
	var errs []error
	removed, err := crossnode.Cleanup(pinDir)
	res.Removed = append(res.Removed, removed...)
	errs = append(errs, err)
	// Opened before the pins go; run once the links (sock_ops) are detached.
	release, relErr := openPinnedRelease(pinDir)
	// Links first (they detach when their last reference goes), then maps.
	names := append(append([]string(nil), linkPins...), mapNames()...)
	for _, name := range names {
		p := filepath.Join(pinDir, name)
		if _, err := os.Lstat(p); err != nil {
			continue
		}
		if err := os.Remove(p); err != nil {
			errs = append(errs, fmt.Errorf("unpin %s: %w", p, err))
			continue
		}
		res.Removed = append(res.Removed, p)
	}
	if relErr == nil {
		res.ReleasedUnpairedSockets, err = release()
		errs = append(errs, err)
	}
	if left := pinnedNames(pinDir); len(left) > 0 {
		errs = append(errs, fmt.Errorf("%s still holds objects meshwarp did not pin (%d); left it in place", pinDir, len(left)))
	} else if err := removePinDir(pinDir); err != nil {
		errs = append(errs, err)
	} else {
		res.Removed = append(res.Removed, pinDir)
	}
	return res, errors.Join(errs...)
}
