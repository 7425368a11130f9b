// SPDX-License-Identifier: Apache-2.0

package bench

import (
	"encoding/json"
	"os"
	"reflect"
	"slices"
	"strings"
	"testing"

	"github.com/meshwarp/meshwarp/internal/accel"
)

// jsonKeys lists the JSON keys of struct type t, with those of embedded
// structs.
func jsonKeys(t reflect.Type) []string {
	var keys []string
	for f := range t.Fields() {
		if f.Anonymous {
			keys = append(keys, jsonKeys(f.Type)...)
			continue
		}
		if k := strings.Split(f.Tag.Get("json"), ",")[0]; k != "" && k != "-" {
			keys = append(keys, k)
		}
	}
	return keys
}

// schemaProps lists the property names of the schema object at path (keys
// of nested objects).
func schemaProps(t *testing.T, schema map[string]any, path ...string) []string {
	t.Helper()
	var node any = schema
	for _, p := range path {
		m, ok := node.(map[string]any)
		if !ok {
			t.Fatalf("bench-schema.json has no %s", strings.Join(path, "/"))
		}
		node = m[p]
	}
	m, _ := node.(map[string]any)["properties"].(map[string]any)
	var keys []string
	for k := range m {
		keys = append(keys, k)
	}
	return keys
}

// The bench reports the agent's counters under the counter model's keys (as
// `meshwarp status --json`), and its schema describes exactly the keys the
// report's types write.
func TestAgentCountersUseModelKeys(t *testing.T) {
	b, err := os.ReadFile("../../docs/bench-schema.json")
	if err != nil {
		t.Fatal(err)
	}
	var schema map[string]any
	if err := json.Unmarshal(b, &schema); err != nil {
		t.Fatal(err)
	}
	model := map[string]bool{}
	for _, k := range accel.CounterModel() {
		model[k.Key] = true
	}
	// Keys that are not counters of the agent's data path: the bench's own
	// measures of its cost, and the summary's derived figures.
	own := []string{"bpf_run_seconds", "bpf_programs", "bpf_programs_profiling_only", "wall_seconds", "process_cpu_seconds", "process_rss_bytes", "bpf_memory_bytes",
		"crossnode_redirected_packets", "crossnode_passed_packets_by_reason",
		"accelerated", "bpf_us_per_request", "bpf_ns_per_redirected_message", "agent_cost"}
	for _, c := range []struct {
		name   string
		typ    reflect.Type
		schema []string
	}{
		{"runs[].agent", reflect.TypeFor[AgentDelta](), schemaProps(t, schema, "$defs", "run", "properties", "agent")},
		{"results[].hops", reflect.TypeFor[HopsSummary](), schemaProps(t, schema, "$defs", "hops")},
	} {
		keys := jsonKeys(c.typ)
		for _, k := range keys {
			if !model[k] && !slices.Contains(own, k) {
				t.Errorf("%s: key %s is neither a key of accel.CounterModel nor one of the bench's own", c.name, k)
			}
		}
		slices.Sort(keys)
		slices.Sort(c.schema)
		if !slices.Equal(keys, c.schema) {
			t.Errorf("%s: the report writes %v, bench-schema.json describes %v", c.name, keys, c.schema)
		}
	}
	for k := range model {
		if !slices.Contains(jsonKeys(reflect.TypeFor[AgentDelta]()), k) {
			t.Errorf("runs[].agent lacks the counter %s", k)
		}
	}
}
