// SPDX-License-Identifier: Apache-2.0

// Package config parses and validates the agent's policy, from flags and
// from a YAML file, into accel.Policy.
package config

import (
	"errors"
	"fmt"
	"io"
	"net/netip"
	"os"
	"strconv"
	"strings"

	"go.yaml.in/yaml/v3"

	"github.com/meshwarp/meshwarp/internal/accel"
)

// maxRange bounds one port range so a typo like 1-65535 is not silently huge.
const maxRange = 1024

// File is the policy file format:
//
//	include_ports: ["8080", "9000-9010"]   # only these destination ports (default: all)
//	exclude_ports: ["3306"]
//	include_cidrs: ["10.0.0.0/8"]          # only these destinations (default: all)
//	exclude_cidrs: ["192.168.7.0/24"]
type File struct {
	IncludePorts []string `yaml:"include_ports"`
	ExcludePorts []string `yaml:"exclude_ports"`
	IncludeCIDRs []string `yaml:"include_cidrs"`
	ExcludeCIDRs []string `yaml:"exclude_cidrs"`
}

// Load reads a policy file. Unknown keys are errors (a typo must not
// silently accelerate what the user meant to exclude).
func Load(path string) (File, error) {
	var f File
	b, err := os.ReadFile(path)
	if err != nil {
		return f, fmt.Errorf("read policy file: %w", err)
	}
	dec := yaml.NewDecoder(strings.NewReader(string(b)))
	dec.KnownFields(true)
	if err := dec.Decode(&f); err != nil && !errors.Is(err, io.EOF) {
		return f, fmt.Errorf("parse policy file %s: %w", path, err)
	}
	return f, nil
}

// Merge appends the lists of o to f (flags add to the file).
func (f File) Merge(o File) File {
	return File{
		IncludePorts: append(append([]string(nil), f.IncludePorts...), o.IncludePorts...),
		ExcludePorts: append(append([]string(nil), f.ExcludePorts...), o.ExcludePorts...),
		IncludeCIDRs: append(append([]string(nil), f.IncludeCIDRs...), o.IncludeCIDRs...),
		ExcludeCIDRs: append(append([]string(nil), f.ExcludeCIDRs...), o.ExcludeCIDRs...),
	}
}

// Policy validates f and returns the accel policy, reporting every problem at once.
func (f File) Policy() (accel.Policy, error) {
	var p accel.Policy
	var errs []error
	var err error
	if p.IncludePorts, err = ParsePorts(f.IncludePorts); err != nil {
		errs = append(errs, fmt.Errorf("include ports: %w", err))
	}
	if p.ExcludePorts, err = ParsePorts(f.ExcludePorts); err != nil {
		errs = append(errs, fmt.Errorf("exclude ports: %w", err))
	}
	if p.IncludeCIDRs, err = ParseCIDRs(f.IncludeCIDRs); err != nil {
		errs = append(errs, fmt.Errorf("include CIDRs: %w", err))
	}
	if p.ExcludeCIDRs, err = ParseCIDRs(f.ExcludeCIDRs); err != nil {
		errs = append(errs, fmt.Errorf("exclude CIDRs: %w", err))
	}
	if len(errs) == 0 {
		if err := p.Validate(); err != nil {
			errs = append(errs, err)
		}
	}
	return p, errors.Join(errs...)
}

// ParsePorts parses items like "8080", "9000-9010" or "80,443" into ports.
func ParsePorts(items []string) ([]uint16, error) {
	var out []uint16
	var errs []error
	for _, item := range splitAll(items) {
		lo, hi, isRange := strings.Cut(item, "-")
		a, err := parsePort(lo)
		if err != nil {
			errs = append(errs, err)
			continue
		}
		b := a
		if isRange {
			if b, err = parsePort(hi); err != nil {
				errs = append(errs, err)
				continue
			}
		}
		if b < a {
			errs = append(errs, fmt.Errorf("port range %q runs backwards: write %d-%d", item, b, a))
			continue
		}
		if int(b)-int(a) >= maxRange {
			errs = append(errs, fmt.Errorf("port range %q is wider than %d ports: list the ports you mean", item, maxRange))
			continue
		}
		for p := int(a); p <= int(b); p++ {
			out = append(out, uint16(p))
		}
	}
	return out, errors.Join(errs...)
}

func parsePort(s string) (uint16, error) {
	n, err := strconv.ParseUint(strings.TrimSpace(s), 10, 16)
	if err != nil || n == 0 {
		return 0, fmt.Errorf("%q is not a port: use a number from 1 to 65535", s)
	}
	return uint16(n), nil
}

// ParseCIDRs parses "10.0.0.0/8", "fd00::/8" or a bare address (a /32 or /128).
func ParseCIDRs(items []string) ([]netip.Prefix, error) {
	var out []netip.Prefix
	var errs []error
	for _, item := range splitAll(items) {
		if !strings.Contains(item, "/") {
			a, err := netip.ParseAddr(item)
			if err != nil {
				errs = append(errs, fmt.Errorf("%q is not an address or CIDR (e.g. 10.0.0.0/8)", item))
				continue
			}
			out = append(out, netip.PrefixFrom(a.Unmap(), a.Unmap().BitLen()))
			continue
		}
		p, err := netip.ParsePrefix(item)
		if err != nil {
			errs = append(errs, fmt.Errorf("%q is not a CIDR (e.g. 10.0.0.0/8)", item))
			continue
		}
		if p.Masked() != p {
			errs = append(errs, fmt.Errorf("CIDR %q has host bits set: did you mean %s?", item, p.Masked()))
			continue
		}
		out = append(out, p)
	}
	return out, errors.Join(errs...)
}

// splitAll splits comma-separated items and drops empty ones.
func splitAll(items []string) []string {
	var out []string
	for _, it := range items {
		for _, s := range strings.Split(it, ",") {
			if s = strings.TrimSpace(s); s != "" {
				out = append(out, s)
			}
		}
	}
	return out
}
