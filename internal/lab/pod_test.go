// SPDX-License-Identifier: Apache-2.0

package lab

import (
	"strings"
	"testing"
)

// A pod's capture is the lab's chains plus the two jumps, in one
// iptables-restore transaction.
func TestCaptureRules(t *testing.T) {
	got := CaptureRules(1337)
	if !strings.HasPrefix(got, strings.TrimSuffix(captureChains(1337), "COMMIT\n")) {
		t.Fatalf("CaptureRules does not start with the lab's chains:\n%s", got)
	}
	for _, want := range []string{
		"-A OUTPUT -p tcp -j " + chainOutput + "\n",
		"-A PREROUTING -p tcp -j " + chainInbound + "\n",
	} {
		if !strings.Contains(got, want) {
			t.Errorf("CaptureRules has no %q:\n%s", want, got)
		}
	}
	if strings.Count(got, "COMMIT\n") != 1 || !strings.HasSuffix(got, "COMMIT\n") {
		t.Errorf("CaptureRules is not one transaction:\n%s", got)
	}
}

func TestSidecarConfigIsTheLabs(t *testing.T) {
	got, err := SidecarConfig(1337, 1337, "/run/s.sock", []int{HTTPPort})
	if err != nil {
		t.Fatal(err)
	}
	want, err := sidecarConfig{UID: 1337, GID: 1337, StatsSocket: "/run/s.sock", HTTPPorts: []int{HTTPPort}, MaxConn: podMaxConn()}.render()
	if err != nil {
		t.Fatal(err)
	}
	if got != want {
		t.Fatalf("pod sidecar config differs from the lab's")
	}
}
