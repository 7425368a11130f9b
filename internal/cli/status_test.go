// SPDX-License-Identifier: Apache-2.0

package cli

import (
	"bytes"
	"regexp"
	"strings"
	"testing"

	"github.com/meshwarp/meshwarp/internal/accel"
)

// `status --help` explains every JSON key of the counter model and every
// passthrough reason the object knows.
func TestStatusHelpCoversCountersAndReasons(t *testing.T) {
	root := NewAgentCommand()
	var out bytes.Buffer
	root.SetOut(&out)
	root.SetArgs([]string{"status", "--help"})
	if err := root.Execute(); err != nil {
		t.Fatal(err)
	}
	help := out.String()
	// A key is explained on a line of its own: "  key  text", or by a
	// "prefix_*" line.
	keys := map[string]bool{}
	for _, m := range regexp.MustCompile(`(?m)^ {2,4}([a-z0-9_]+\*?) `).FindAllStringSubmatch(help, -1) {
		keys[m[1]] = true
	}
	covered := func(key string) bool {
		if keys[key] {
			return true
		}
		for k := range keys {
			if p, ok := strings.CutSuffix(k, "*"); ok && strings.HasPrefix(key, p) {
				return true
			}
		}
		return false
	}
	for _, k := range accel.CounterModel() {
		if !covered(k.Key) {
			t.Errorf("status --help does not explain the JSON key %s", k.Key)
		}
	}
	for _, r := range accel.ReasonNames() {
		if !keys[r] {
			t.Errorf("status --help does not explain the passthrough reason %s", r)
		}
	}
}

// The text status names each learned program with its reason.
func TestStatusNamesLearnedPrograms(t *testing.T) {
	var out bytes.Buffer
	printStatus(&out, "/pins", accel.Stats{LearnedPrograms: []accel.LearnedProgram{
		{Comm: "nginx", Reason: "waitall_reader", KeptOffConnections: 7},
	}})
	if !strings.Contains(out.String(), "learned programs") || !strings.Contains(out.String(), "nginx: waitall_reader, 7 connections kept off since") {
		t.Fatalf("status does not name the learned program:\n%s", out.String())
	}
}
