// SPDX-License-Identifier: Apache-2.0

package accel

import (
	"strconv"
	"strings"
	"time"
)

func itoa(i int) string { return strconv.Itoa(i) }

// cutNet splits "tcp4:127.0.0.1:0" into network and address.
func cutNet(s string) (network, addr string, ok bool) { return strings.Cut(s, ":") }

// hangGuard bounds a wait for one loopback operation that a correct
// program completes (bytes to arrive, an event, EOF): it only turns a hang
// into a failure, so it is far above what a loaded 2-core machine or
// software emulation takes. A wait that must time out (nothing to read yet)
// keeps a short bound of its own.
const hangGuard = 30 * time.Second
