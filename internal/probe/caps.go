// SPDX-License-Identifier: Apache-2.0

package probe

import (
	"bufio"
	"fmt"
	"io"
	"os"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// CapSet is a capability bit mask as in /proc/<pid>/status.
type CapSet uint64

// Has reports whether capability c (unix.CAP_*) is in the set.
func (s CapSet) Has(c int) bool { return c >= 0 && c < 64 && s&(1<<uint(c)) != 0 }

// capability names the capabilities the probe reports on.
var capNames = map[int]string{
	unix.CAP_NET_ADMIN:    "CAP_NET_ADMIN",
	unix.CAP_SYS_ADMIN:    "CAP_SYS_ADMIN",
	unix.CAP_SYS_RESOURCE: "CAP_SYS_RESOURCE",
	unix.CAP_PERFMON:      "CAP_PERFMON",
	unix.CAP_BPF:          "CAP_BPF",
}

// procSelfStatus is read for the effective capabilities; a variable for tests.
var procSelfStatus = "/proc/self/status"

// effectiveCaps reads CapEff of the calling process.
func effectiveCaps() (CapSet, error) {
	f, err := os.Open(procSelfStatus)
	if err != nil {
		return 0, fmt.Errorf("read %s: %w", procSelfStatus, err)
	}
	defer f.Close()
	s, err := parseCapEff(f)
	if err != nil {
		return 0, fmt.Errorf("read %s: %w", procSelfStatus, err)
	}
	return s, nil
}

// parseCapEff finds the "CapEff:" line of a /proc/<pid>/status file and
// decodes its hexadecimal mask.
func parseCapEff(r io.Reader) (CapSet, error) {
	sc := bufio.NewScanner(r)
	for sc.Scan() {
		key, val, ok := strings.Cut(sc.Text(), ":")
		if !ok || key != "CapEff" {
			continue
		}
		val = strings.TrimSpace(val)
		if val == "" {
			return 0, fmt.Errorf("empty CapEff")
		}
		mask, err := strconv.ParseUint(val, 16, 64)
		if err != nil {
			return 0, fmt.Errorf("parse CapEff %q: %w", val, err)
		}
		return CapSet(mask), nil
	}
	if err := sc.Err(); err != nil {
		return 0, err
	}
	return 0, fmt.Errorf("no CapEff line")
}
