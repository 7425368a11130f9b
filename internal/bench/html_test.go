// SPDX-License-Identifier: Apache-2.0

package bench

import (
	"bytes"
	"regexp"
	"strings"
	"testing"
)

func TestHTMLReportSelfContained(t *testing.T) {
	rep := fixtureReport(t)
	rep.Notes = []string{"a note with <b>markup</b> & an ampersand"}
	var buf bytes.Buffer
	if err := rep.WriteHTML(&buf); err != nil {
		t.Fatal(err)
	}
	page := buf.String()
	for _, want := range []string{
		"<!DOCTYPE html>", `id="histograms"`, `id="ratios"`, `id="qperf"`,
		"6.18.0-test", "Test CPU", // machine facts
		"sidecar+meshwarp", "af_unix floor", "p99 us", // percentile tables
		`data-rendered`, "const DATA = {",
		"a note with &lt;b&gt;markup&lt;/b&gt; &amp; an ampersand",
	} {
		if !strings.Contains(page, want) {
			t.Errorf("page lacks %q", want)
		}
	}
	// nothing is fetched: no external scripts, styles, images, fonts or XHR
	for _, re := range []string{
		`<script[^>]+src=`, `<link\b`, `<img\b`, `@import`, `url\(`, `\bfetch\(`, `XMLHttpRequest`, `<iframe`,
	} {
		if m := regexp.MustCompile(re).FindString(page); m != "" {
			t.Errorf("page would fetch something: %q", m)
		}
	}
	// the data is embedded as JSON, with </script> escaped
	if strings.Count(page, "</script>") != 1 {
		t.Errorf("want exactly one script block, got %d", strings.Count(page, "</script>"))
	}
}
