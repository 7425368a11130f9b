// SPDX-License-Identifier: Apache-2.0

package metrics

import (
	"encoding/json"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/meshwarp/meshwarp/internal/accel"
	"github.com/meshwarp/meshwarp/internal/testutil"
	"github.com/meshwarp/meshwarp/internal/testutil/agenttest"
)

const dashboardFile = "../../deploy/grafana/meshwarp.json"

// dashboard is the part of Grafana's dashboard model the test checks.
type dashboard struct {
	Title         string `json:"title"`
	UID           string `json:"uid"`
	SchemaVersion int    `json:"schemaVersion"`
	Templating    struct {
		List []struct {
			Name string `json:"name"`
			Type string `json:"type"`
		} `json:"list"`
	} `json:"templating"`
	Panels []struct {
		ID      int    `json:"id"`
		Type    string `json:"type"`
		Title   string `json:"title"`
		GridPos struct {
			H, W, X, Y int
		} `json:"gridPos"`
		Targets []struct {
			RefID string `json:"refId"`
			Expr  string `json:"expr"`
		} `json:"targets"`
	} `json:"panels"`
}

// readDashboard parses deploy/grafana/meshwarp.json.
func readDashboard(t *testing.T) dashboard {
	t.Helper()
	b, err := os.ReadFile(dashboardFile)
	if err != nil {
		t.Fatal(err)
	}
	var d dashboard
	if err := json.Unmarshal(b, &d); err != nil {
		t.Fatalf("dashboard JSON: %v", err)
	}
	return d
}

// metricName matches the selectors of the dashboard's queries (every one has {instance=~...}).
var metricName = regexp.MustCompile(`\b((?:meshwarp|http)_[a-z_]+)\{`)

// The dashboard is well formed for the schema version it declares, and every
// metric its queries use is served by a live agent's /metrics.
func TestPrivilegedDashboardMetricsExist(t *testing.T) {
	testutil.RequirePrivileged(t)
	d := readDashboard(t)
	if d.SchemaVersion < 36 || d.UID == "" || d.Title == "" || len(d.Panels) == 0 {
		t.Fatalf("dashboard header: schemaVersion %d (want >= 36, the version its panel model follows), uid %q, title %q, %d panels",
			d.SchemaVersion, d.UID, d.Title, len(d.Panels))
	}
	vars := map[string]bool{}
	for _, v := range d.Templating.List {
		vars[v.Name] = true
	}
	var used []string
	ids := map[int]bool{}
	for _, p := range d.Panels {
		if ids[p.ID] || p.Type == "" || p.Title == "" || p.GridPos.W == 0 || p.GridPos.H == 0 || p.GridPos.X+p.GridPos.W > 24 || len(p.Targets) == 0 {
			t.Errorf("panel %d %q: duplicate id, no type/title, no target or off the 24-column grid: %+v", p.ID, p.Title, p)
		}
		ids[p.ID] = true
		for _, tg := range p.Targets {
			if tg.RefID == "" || tg.Expr == "" {
				t.Errorf("panel %q: target without refId or expr", p.Title)
			}
			for _, v := range regexp.MustCompile(`\$(\w+)`).FindAllStringSubmatch(tg.Expr, -1) {
				if !vars[v[1]] && !strings.HasPrefix(v[1], "__") {
					t.Errorf("panel %q uses $%s, which the dashboard does not define", p.Title, v[1])
				}
			}
			for _, m := range metricName.FindAllStringSubmatch(tg.Expr, -1) {
				used = append(used, m[1])
			}
		}
	}
	slices.Sort(used)
	used = slices.Compact(used)

	a := agenttest.Start(t, accel.Config{Observe: true})
	url := metricsURL(t, a)
	// The RED series exist once there was a request, a reset and a failed connect.
	app := httptest.NewServer(http.HandlerFunc(func(http.ResponseWriter, *http.Request) {}))
	defer app.Close()
	if resp, err := (&http.Client{Transport: &http.Transport{DisableKeepAlives: true}}).Get(app.URL); err == nil {
		resp.Body.Close()
	}
	if c, err := net.Dial("tcp4", app.Listener.Addr().String()); err == nil {
		c.(*net.TCPConn).SetLinger(0)
		c.Close()
	}
	deadline := time.Now().Add(10 * time.Second)
	for {
		families := scrape(t, url)
		var missing []string
		for _, name := range used {
			name = strings.TrimSuffix(strings.TrimSuffix(strings.TrimSuffix(name, "_bucket"), "_count"), "_sum")
			if _, ok := families[name]; !ok {
				missing = append(missing, name)
			}
		}
		if len(missing) == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the dashboard queries %v, which the agent does not export", missing)
		}
		time.Sleep(50 * time.Millisecond)
	}
	t.Logf("%d panels, %d metrics, all exported", len(d.Panels), len(used))
}
