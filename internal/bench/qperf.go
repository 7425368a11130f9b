// SPDX-License-Identifier: Apache-2.0

package bench

import (
	"bufio"
	"fmt"
	"strconv"
	"strings"
)

// QperfResult is one test block of qperf's verbose output ("tcp_lat:" or
// "tcp_bw:" followed by "name = value unit" lines), in base units.
type QperfResult struct {
	Test string // tcp_lat, tcp_bw, ...
	// LatencyUS is qperf's latency: one way, half a round trip (tcp_lat).
	LatencyUS float64
	// BandwidthBytesPerSec is the receive bandwidth (tcp_bw).
	BandwidthBytesPerSec float64
	// MsgRatePerSec is qperf's msg_rate (messages one way per second), 0 if absent.
	MsgRatePerSec float64
	MsgSizeBytes  int64
	TimeSeconds   float64
	// CPU fractions reported with -v (1.0 = one CPU busy); 0 when absent.
	LocCPUs, RemCPUs float64
}

// ParseQperf parses the output of `qperf HOST [-v|-vu] [-uu] tests...`.
// It accepts both qperf's human units (us, ms, KB/sec, GB/sec, K/sec,
// "16 KiB (16,384)") and the unified base units of -uu (ns, bytes/sec).
func ParseQperf(out string) ([]QperfResult, error) {
	var (
		res []QperfResult
		cur *QperfResult
	)
	sc := bufio.NewScanner(strings.NewReader(out))
	for lineNo := 1; sc.Scan(); lineNo++ {
		line := strings.TrimSpace(sc.Text())
		if line == "" {
			continue
		}
		if strings.HasSuffix(line, ":") && !strings.Contains(line, "=") && !strings.Contains(line, " ") {
			res = append(res, QperfResult{Test: strings.TrimSuffix(line, ":")})
			cur = &res[len(res)-1]
			continue
		}
		name, rest, ok := strings.Cut(line, "=")
		if !ok {
			// qperf reports failures as free text ("failed to connect")
			return res, fmt.Errorf("qperf output line %d: %q", lineNo, line)
		}
		if cur == nil {
			return res, fmt.Errorf("qperf output line %d: value before any test name", lineNo)
		}
		name = strings.TrimSpace(name)
		num, unit, err := splitQperfValue(rest)
		if err != nil {
			return res, fmt.Errorf("qperf output line %d (%s): %w", lineNo, name, err)
		}
		switch name {
		case "latency":
			f, err := timeToMicros(num, unit)
			if err != nil {
				return res, fmt.Errorf("qperf latency: %w", err)
			}
			cur.LatencyUS = f
		case "bw":
			f, err := rateToBytesPerSec(num, unit)
			if err != nil {
				return res, fmt.Errorf("qperf bw: %w", err)
			}
			cur.BandwidthBytesPerSec = f
		case "msg_rate":
			f, err := countRate(num, unit)
			if err != nil {
				return res, fmt.Errorf("qperf msg_rate: %w", err)
			}
			cur.MsgRatePerSec = f
		case "msg_size":
			f, err := sizeToBytes(num, unit)
			if err != nil {
				return res, fmt.Errorf("qperf msg_size: %w", err)
			}
			cur.MsgSizeBytes = int64(f)
		case "time":
			f, err := timeToSeconds(num, unit)
			if err != nil {
				return res, fmt.Errorf("qperf time: %w", err)
			}
			cur.TimeSeconds = f
		case "loc_cpus_used", "send_cpus_used":
			cur.LocCPUs = num / 100
		case "rem_cpus_used", "recv_cpus_used":
			cur.RemCPUs = num / 100
		}
	}
	if err := sc.Err(); err != nil {
		return res, fmt.Errorf("read qperf output: %w", err)
	}
	if len(res) == 0 {
		return nil, fmt.Errorf("no qperf result in output %q", strings.TrimSpace(out))
	}
	return res, nil
}

// splitQperfValue splits " 1.22 MB/sec" into 1.22 and "MB/sec"; thousands
// separators are dropped ("19,800") and a parenthesised exact value that
// qperf appends ("16 KiB (16,384)") is ignored in favour of the scaled one.
func splitQperfValue(s string) (float64, string, error) {
	s = strings.TrimSpace(s)
	if i := strings.Index(s, "("); i >= 0 {
		s = strings.TrimSpace(s[:i])
	}
	numStr, unit, _ := strings.Cut(s, " ")
	numStr = strings.ReplaceAll(numStr, ",", "")
	f, err := strconv.ParseFloat(numStr, 64)
	if err != nil {
		return 0, "", fmt.Errorf("parse number %q: %w", numStr, err)
	}
	return f, strings.TrimSpace(unit), nil
}

var decimalPrefix = map[string]float64{"": 1, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}

func timeToMicros(v float64, unit string) (float64, error) {
	switch unit {
	case "ns":
		return v / 1e3, nil
	case "us":
		return v, nil
	case "ms":
		return v * 1e3, nil
	case "sec", "s":
		return v * 1e6, nil
	}
	return 0, fmt.Errorf("unknown time unit %q", unit)
}

func timeToSeconds(v float64, unit string) (float64, error) {
	switch unit {
	case "ns":
		return v * 1e-9, nil
	case "us":
		return v * 1e-6, nil
	case "ms":
		return v * 1e-3, nil
	case "sec", "s":
		return v, nil
	}
	return 0, fmt.Errorf("unknown time unit %q", unit)
}

// rateToBytesPerSec converts qperf's bandwidth units. qperf uses decimal
// prefixes for rates (KB/sec = 1000 bytes/sec) and "b" for bits with -ub.
func rateToBytesPerSec(v float64, unit string) (float64, error) {
	u, ok := strings.CutSuffix(unit, "/sec")
	if !ok {
		return 0, fmt.Errorf("unknown rate unit %q", unit)
	}
	if u == "bytes" {
		return v, nil
	}
	if u == "bits" {
		return v / 8, nil
	}
	if len(u) < 1 {
		return 0, fmt.Errorf("unknown rate unit %q", unit)
	}
	kind := u[len(u)-1:]
	mult, ok := decimalPrefix[u[:len(u)-1]]
	if !ok {
		return 0, fmt.Errorf("unknown rate prefix in %q", unit)
	}
	switch kind {
	case "B":
		return v * mult, nil
	case "b":
		return v * mult / 8, nil
	}
	return 0, fmt.Errorf("unknown rate unit %q", unit)
}

func countRate(v float64, unit string) (float64, error) {
	u, ok := strings.CutSuffix(unit, "/sec")
	if !ok {
		return 0, fmt.Errorf("unknown rate unit %q", unit)
	}
	mult, ok := decimalPrefix[u]
	if !ok {
		return 0, fmt.Errorf("unknown rate prefix in %q", unit)
	}
	return v * mult, nil
}

// sizeToBytes converts qperf's message sizes, which use binary prefixes
// (KiB, MiB).
func sizeToBytes(v float64, unit string) (float64, error) {
	switch unit {
	case "bytes", "byte", "":
		return v, nil
	case "KiB":
		return v * 1024, nil
	case "MiB":
		return v * 1024 * 1024, nil
	case "GiB":
		return v * 1024 * 1024 * 1024, nil
	}
	return 0, fmt.Errorf("unknown size unit %q", unit)
}
