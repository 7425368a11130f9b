// SPDX-License-Identifier: Apache-2.0

package accel

import (
	"strconv"
	"strings"
)

func itoa(i int) string { return strconv.Itoa(i) }

// cutNet splits "tcp4:127.0.0.1:0" into network and address.
func cutNet(s string) (network, addr string, ok bool) { return strings.Cut(s, ":") }
