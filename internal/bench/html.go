// SPDX-License-Identifier: Apache-2.0

package bench

import (
	_ "embed"
	"fmt"
	"html/template"
	"io"
	"os"
	"strings"
)

// The HTML report is one self-contained page: inline CSS, the report JSON
// inline, and inline JavaScript that draws the charts as SVG. It fetches
// nothing (no fonts, scripts or images from the network) so it opens
// offline and can be attached to an issue as is.

//go:embed report.html.tmpl
var reportHTML string

var reportTemplate = template.Must(template.New("report").Parse(reportHTML))

type htmlView struct {
	Data        *Report
	Facts       [][2]string
	ConfigFacts [][2]string
	Tables      []Table
}

// WriteHTML renders the report page.
func (r *Report) WriteHTML(w io.Writer) error {
	m := r.Machine
	c := r.Config
	v := htmlView{
		Data:   r,
		Tables: r.Tables(),
		Facts: [][2]string{
			{"kernel", m.Kernel},
			{"CPUs", fmt.Sprint(m.CPUs)},
			{"CPU model", m.Model},
			{"Go", m.Go},
			{"meshwarp", m.MeshwarpVersion},
			{"date", m.Date},
			{"host", m.Hostname},
		},
		ConfigFacts: [][2]string{
			{"modes", strings.Join(c.Modes, ", ")},
			{"workloads", strings.Join(c.Workloads, ", ")},
			{"repeats", fmt.Sprint(c.Repeat)},
			{"fortio run", fmt.Sprintf("%gs, %d connections, qps max, %d B", c.DurationSeconds, c.Connections, c.PayloadBytes)},
			{"histogram resolution", fmt.Sprintf("%g us", c.HistogramResolutionUS)},
			{"qperf / unix", fmt.Sprintf("%gs per test and size", c.QperfDurationSeconds)},
			{"sizes", sizesLabel(c.SizesBytes)},
			{"qperf modes", strings.Join(c.QperfModes, ", ")},
			{"interleaving", c.Interleaving},
			{"CPU", c.CPUAccounting},
			{"latency", c.LatencyDefinitionQperf},
			{"agent pins", c.PinDir},
			{"command", c.Command},
			{"wall time", fmt.Sprintf("%.0f s", c.TotalWallSeconds)},
		},
	}
	return reportTemplate.Execute(w, v)
}

// WriteHTMLFile writes the report page to path.
func (r *Report) WriteHTMLFile(path string) error {
	f, err := os.Create(path)
	if err != nil {
		return fmt.Errorf("create html report: %w", err)
	}
	if err := r.WriteHTML(f); err != nil {
		f.Close()
		return fmt.Errorf("write html report %s: %w", path, err)
	}
	return f.Close()
}

func sizesLabel(sizes []int) string {
	var s []string
	for _, n := range sizes {
		s = append(s, sizeLabel(n))
	}
	return strings.Join(s, ", ")
}
