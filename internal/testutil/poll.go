// SPDX-License-Identifier: Apache-2.0

package testutil

import (
	"errors"
	"time"

	"golang.org/x/sys/unix"
)

// Poll waits up to timeout for events on fd, as poll(2), and returns the
// events it reports (0 when the time ran out). A signal that interrupts
// the wait (the Go runtime preempts threads with one) restarts it for the
// time left, as an application's event loop does.
func Poll(fd int, events int16, timeout time.Duration) (int16, error) {
	deadline := time.Now().Add(timeout)
	for {
		pfd := []unix.PollFd{{Fd: int32(fd), Events: events}}
		ms := max(int(time.Until(deadline).Milliseconds()), 0)
		n, err := unix.Poll(pfd, ms)
		if errors.Is(err, unix.EINTR) {
			if ms == 0 {
				return 0, nil
			}
			continue
		}
		if err != nil || n == 0 {
			return 0, err
		}
		return pfd[0].Revents, nil
	}
}
