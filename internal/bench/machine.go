// SPDX-License-Identifier: Apache-2.0

package bench

import (
	"bufio"
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/meshwarp/meshwarp/internal/version"
)

// MachineFacts describes this machine for the report.
func MachineFacts(now time.Time) Machine {
	m := Machine{
		CPUs:            runtime.NumCPU(),
		Go:              runtime.Version(),
		MeshwarpVersion: version.Version,
		Date:            now.UTC().Format(time.RFC3339),
		Model:           cpuModel(),
	}
	var u unix.Utsname
	if err := unix.Uname(&u); err == nil {
		m.Kernel = unix.ByteSliceToString(u.Release[:])
	}
	m.Hostname, _ = os.Hostname()
	return m
}

func cpuModel() string {
	f, err := os.Open("/proc/cpuinfo")
	if err != nil {
		return "unknown"
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		k, v, ok := strings.Cut(sc.Text(), ":")
		if ok && strings.TrimSpace(k) == "model name" {
			return strings.TrimSpace(v)
		}
	}
	return "unknown"
}

// CgroupCPUSeconds reads usage_usec from the cgroup v2 cpu.stat of dir: the
// CPU time of every task in the cgroup and its descendants (present even
// when the cpu controller is not enabled).
func CgroupCPUSeconds(dir string) (float64, error) {
	b, err := os.ReadFile(filepath.Join(dir, "cpu.stat"))
	if err != nil {
		return 0, fmt.Errorf("read cgroup cpu usage: %w", err)
	}
	return parseCPUStat(b)
}

func parseCPUStat(b []byte) (float64, error) {
	for line := range bytes.Lines(b) {
		k, v, ok := strings.Cut(strings.TrimSpace(string(line)), " ")
		if ok && k == "usage_usec" {
			us, err := strconv.ParseUint(v, 10, 64)
			if err != nil {
				return 0, fmt.Errorf("parse cpu.stat usage_usec %q: %w", v, err)
			}
			return float64(us) / 1e6, nil
		}
	}
	return 0, fmt.Errorf("no usage_usec in cpu.stat")
}

// processCPUSeconds is this process's user+system CPU time.
func processCPUSeconds() float64 {
	var ru unix.Rusage
	if err := unix.Getrusage(unix.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return tv(ru.Utime) + tv(ru.Stime)
}

func tv(t unix.Timeval) float64 { return float64(t.Sec) + float64(t.Usec)/1e6 }
