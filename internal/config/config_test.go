// SPDX-License-Identifier: Apache-2.0

package config

import (
	"net/netip"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
)

func TestParsePorts(t *testing.T) {
	got, err := ParsePorts([]string{"80,443", " 9000-9002 "})
	if err != nil {
		t.Fatal(err)
	}
	if want := []uint16{80, 443, 9000, 9001, 9002}; !reflect.DeepEqual(got, want) {
		t.Fatalf("got %v, want %v", got, want)
	}
	for _, bad := range []string{"0", "65536", "http", "10-5", "1-5000", "1-"} {
		if _, err := ParsePorts([]string{bad}); err == nil {
			t.Errorf("ParsePorts(%q) accepted", bad)
		}
	}
}

func TestParseCIDRs(t *testing.T) {
	got, err := ParseCIDRs([]string{"10.0.0.0/8,fd00::/8", "127.0.0.6"})
	if err != nil {
		t.Fatal(err)
	}
	want := []netip.Prefix{netip.MustParsePrefix("10.0.0.0/8"), netip.MustParsePrefix("fd00::/8"), netip.MustParsePrefix("127.0.0.6/32")}
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("got %v, want %v", got, want)
	}
	_, err = ParseCIDRs([]string{"10.0.0.1/8"})
	if err == nil || !strings.Contains(err.Error(), "10.0.0.0/8") {
		t.Fatalf("host bits: want a hint naming 10.0.0.0/8, got %v", err)
	}
}

func TestPolicyReportsEveryError(t *testing.T) {
	_, err := File{IncludePorts: []string{"x"}, ExcludeCIDRs: []string{"nope"}}.Policy()
	if err == nil || !strings.Contains(err.Error(), `"x"`) || !strings.Contains(err.Error(), `"nope"`) {
		t.Fatalf("want both problems named, got %v", err)
	}
}

func TestLoadRejectsUnknownKeys(t *testing.T) {
	dir := t.TempDir()
	good := filepath.Join(dir, "good.yaml")
	os.WriteFile(good, []byte("exclude_ports: [\"3306\"]\ninclude_cidrs: [10.0.0.0/8]\n"), 0o644)
	f, err := Load(good)
	if err != nil {
		t.Fatal(err)
	}
	p, err := f.Policy()
	if err != nil || len(p.ExcludePorts) != 1 || p.ExcludePorts[0] != 3306 || len(p.IncludeCIDRs) != 1 {
		t.Fatalf("policy %+v, err %v", p, err)
	}
	typo := filepath.Join(dir, "typo.yaml")
	os.WriteFile(typo, []byte("exclude_port: [3306]\n"), 0o644)
	if _, err := Load(typo); err == nil {
		t.Fatal("a misspelt key was accepted")
	}
	empty := filepath.Join(dir, "empty.yaml")
	os.WriteFile(empty, nil, 0o644)
	if _, err := Load(empty); err != nil {
		t.Fatalf("empty file: %v", err)
	}
}
