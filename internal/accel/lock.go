// SPDX-License-Identifier: Apache-2.0

package accel

import (
	"bufio"
	"errors"
	"fmt"
	"os"
	"strings"

	"golang.org/x/sys/unix"
)

// ErrPinDirBusy: another live agent holds the pin directory. Two agents on
// one directory would adopt each other's links and one's exit would
// uninstall under the other.
var ErrPinDirBusy = errors.New("another meshwarp agent is running with this pin directory")

// lockPinDir takes an exclusive flock on the pin directory for as long as
// the returned file stays open (the kernel drops it when the process dies,
// so a killed agent never blocks the next one).
func lockPinDir(dir string) (*os.File, error) {
	f, err := os.Open(dir)
	if err != nil {
		return nil, fmt.Errorf("open pin directory %s: %w", dir, err)
	}
	if err := unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB); err != nil {
		f.Close()
		if errors.Is(err, unix.EWOULDBLOCK) {
			holder := "another process"
			if pid := lockHolder(dir); pid != "" {
				holder = "pid " + pid
			}
			return nil, fmt.Errorf("%w: %s (%s): stop that agent first (it uninstalls on exit), or pass another --pin-dir", ErrPinDirBusy, dir, holder)
		}
		return nil, fmt.Errorf("lock pin directory %s: %w", dir, err)
	}
	return f, nil
}

// pinDirLocked reports whether a live agent holds dir, and which pid.
func pinDirLocked(dir string) (bool, string) {
	f, err := lockPinDir(dir)
	if err == nil {
		f.Close()
		return false, ""
	}
	if errors.Is(err, ErrPinDirBusy) {
		return true, lockHolder(dir)
	}
	return false, ""
}

// lockHolder finds the pid holding a flock on dir in /proc/locks ("" when
// it cannot tell, e.g. from another pid namespace).
func lockHolder(dir string) string {
	var st unix.Stat_t
	if err := unix.Stat(dir, &st); err != nil {
		return ""
	}
	dev := fmt.Sprintf("%02x:%02x:%d", unix.Major(st.Dev), unix.Minor(st.Dev), st.Ino)
	f, err := os.Open("/proc/locks")
	if err != nil {
		return ""
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		// "1: FLOCK  ADVISORY  WRITE 10143 00:27:1191551 0 EOF"
		fields := strings.Fields(sc.Text())
		if len(fields) >= 6 && fields[1] == "FLOCK" && fields[5] == dev && fields[4] != fmt.Sprint(os.Getpid()) {
			return fields[4]
		}
	}
	return ""
}
