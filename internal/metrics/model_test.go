// SPDX-License-Identifier: Apache-2.0

package metrics

import (
	"strings"
	"testing"

	"github.com/meshwarp/meshwarp/internal/accel"
	"github.com/meshwarp/meshwarp/internal/crossnode"
)

// served names the metric families the registry serves from s.
func served(t *testing.T, s accel.Stats) map[string]bool {
	t.Helper()
	fams, err := NewRegistry(func() (accel.Stats, error) { return s, nil }, nil).Gather()
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]bool{}
	for _, f := range fams {
		out[f.GetName()] = true
	}
	return out
}

// Every metric of the counter model is served, with its label, one series
// per label value, even when the maps read hold nothing.
func TestEveryModelMetricServed(t *testing.T) {
	fams, err := NewRegistry(func() (accel.Stats, error) { return accel.Stats{}, nil }, nil).Gather()
	if err != nil {
		t.Fatal(err)
	}
	byName := map[string]int{}
	labels := map[string]string{}
	for _, f := range fams {
		byName[f.GetName()] = len(f.GetMetric())
		if ls := f.GetMetric()[0].GetLabel(); len(ls) > 0 {
			labels[f.GetName()] = ls[0].GetName()
		}
	}
	for _, k := range accel.CounterModel() {
		if k.Metric == "" {
			continue
		}
		want := max(1, len(k.LabelValues()))
		if byName[k.Metric] != want || labels[k.Metric] != k.Label {
			t.Errorf("%s: %d series labelled %q served, want %d labelled %q", k.Metric, byName[k.Metric], labels[k.Metric], want, k.Label)
		}
	}
}

// The dashboard queries only metrics that exist: the counter model's, and
// the few served beside it (scrape error, cross-node, RED, process, build).
// TestPrivilegedDashboardMetricsExist checks them against a live agent.
func TestDashboardQueriesKnownMetrics(t *testing.T) {
	d := readDashboard(t)
	known := served(t, accel.Stats{CrossNode: &crossnode.Stats{Nodes: []crossnode.NodeState{{NetnsCookie: 1}}}})
	model := map[string]bool{}
	for _, k := range accel.CounterModel() {
		model[k.Metric] = true
	}
	red := []string{"meshwarp_http_", "meshwarp_tcp_", "http_"} // redCollector, built from flows
	for _, p := range d.Panels {
		for _, tg := range p.Targets {
			for _, m := range metricName.FindAllStringSubmatch(tg.Expr, -1) {
				name := m[1]
				for _, suffix := range []string{"_bucket", "_count", "_sum"} {
					name = strings.TrimSuffix(name, suffix)
				}
				isRED := false
				for _, prefix := range red {
					isRED = isRED || strings.HasPrefix(name, prefix)
				}
				if !known[name] && !isRED {
					t.Errorf("panel %q queries %s, which is not served", p.Title, name)
				}
				if strings.HasPrefix(name, "meshwarp_accel_") && name != "meshwarp_accel_scrape_error" && !model[name] {
					t.Errorf("panel %q queries %s, which is not in accel.CounterModel", p.Title, name)
				}
			}
		}
	}
}
