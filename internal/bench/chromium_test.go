// SPDX-License-Identifier: Apache-2.0

package bench

import (
	"bytes"
	"context"
	"image"
	"image/png"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/meshwarp/meshwarp/internal/testutil"
)

// ChromiumPath is Debian's chromium, installed by `scripts/install-deps.sh --test`.
const ChromiumPath = "/usr/bin/chromium"

// chromiumFlags keep headless Chromium off the network and away from any
// profile: the page itself must need nothing from outside.
func chromiumFlags(profile string) []string {
	return []string{
		"--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
		"--disable-background-networking", "--disable-component-update", "--disable-sync",
		"--disable-default-apps", "--disable-extensions", "--mute-audio",
		"--user-data-dir=" + profile,
	}
}

// RequireChromium fails the test when chromium is missing (the test setup
// installs it); it is a test dependency, not an optional one.
func RequireChromium(t testing.TB) {
	t.Helper()
	if _, err := os.Stat(ChromiumPath); err != nil {
		t.Fatalf("%s not found: run scripts/install-deps.sh --test", ChromiumPath)
	}
}

func runChromium(t testing.TB, args ...string) []byte {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	profile := t.TempDir()
	cmd := exec.CommandContext(ctx, ChromiumPath, append(chromiumFlags(profile), args...)...)
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Run(); err != nil {
		t.Fatalf("chromium %v: %v\n%s", args, err, stderr.String())
	}
	return stdout.Bytes()
}

// CheckHTMLInChromium opens page in headless Chromium, checks the DOM after
// the scripts ran, takes a screenshot and checks it is not blank. It returns
// the screenshot's path (kept when keepDir is not empty).
func CheckHTMLInChromium(t testing.TB, page, keepDir string) string {
	t.Helper()
	abs, err := filepath.Abs(page)
	if err != nil {
		t.Fatal(err)
	}
	dom := string(runChromium(t, "--dump-dom", "file://"+abs))
	if !regexp.MustCompile(`<body[^>]*data-rendered="ok"`).MatchString(dom) {
		t.Fatalf("scripts did not finish (no data-rendered=ok on body):\n%s", truncate(dom, 3000))
	}
	m := regexp.MustCompile(`data-charts="(\d+)"`).FindStringSubmatch(dom)
	if m == nil {
		t.Fatal("no data-charts count")
	}
	charts, _ := strconv.Atoi(m[1])
	if charts < 3 {
		t.Errorf("only %d charts drawn", charts)
	}
	for _, want := range []string{
		`data-chart="histogram-http"`, `data-chart="histogram-tcp"`, `data-chart="ratios-sidecar"`,
		"<svg", "<path", "<rect", `data-mode="sidecar+meshwarp"`,
	} {
		if !strings.Contains(dom, want) {
			t.Errorf("DOM after scripts lacks %s", want)
		}
	}
	if i := strings.Index(dom, ">chart error:"); i >= 0 {
		t.Errorf("a chart failed: %s", truncate(dom[i:], 200))
	}
	// the static tables are there too
	if n := strings.Count(dom, "<table"); n < 2 {
		t.Errorf("%d tables", n)
	}

	dir := keepDir
	if dir == "" {
		dir = t.TempDir()
	}
	shot := filepath.Join(dir, "bench-report.png")
	runChromium(t, "--screenshot="+shot, "--window-size=1200,900", "--hide-scrollbars", "file://"+abs)
	f, err := os.Open(shot)
	if err != nil {
		t.Fatalf("no screenshot: %v", err)
	}
	defer f.Close()
	img, err := png.Decode(f)
	if err != nil {
		t.Fatalf("decode screenshot: %v", err)
	}
	checkNotBlank(t, img)
	return shot
}

// checkNotBlank asserts the picture has content: luminance varies and more
// than a handful of colours are used (text, lines and the modes' colours).
func checkNotBlank(t testing.TB, img image.Image) {
	t.Helper()
	b := img.Bounds()
	if b.Dx() < 1000 || b.Dy() < 800 {
		t.Errorf("screenshot is %dx%d", b.Dx(), b.Dy())
	}
	var n, sum, sumSq float64
	colours := map[uint32]bool{}
	for y := b.Min.Y; y < b.Max.Y; y += 2 {
		for x := b.Min.X; x < b.Max.X; x += 2 {
			r, g, bl, _ := img.At(x, y).RGBA()
			l := (0.299*float64(r) + 0.587*float64(g) + 0.114*float64(bl)) / 65535
			n++
			sum += l
			sumSq += l * l
			if len(colours) < 1000 {
				colours[(r>>12)<<8|(g>>12)<<4|bl>>12] = true
			}
		}
	}
	mean := sum / n
	variance := sumSq/n - mean*mean
	if variance < 1e-3 {
		t.Errorf("screenshot looks blank: luminance variance %.5f (mean %.3f)", variance, mean)
	}
	if len(colours) < 20 {
		t.Errorf("screenshot has %d distinct colours", len(colours))
	}
}

// TestPrivilegedHTMLReport renders the fixture report (every mode, workload
// and 3 repeats, so every chart has data) and opens it in headless Chromium.
// Set MESHWARP_KEEP_SCREENSHOT=DIR to keep the page and its screenshot.
func TestPrivilegedHTMLReport(t *testing.T) {
	testutil.RequirePrivileged(t)
	RequireChromium(t)
	keep := os.Getenv("MESHWARP_KEEP_SCREENSHOT")
	dir := keep
	if dir == "" {
		dir = t.TempDir()
	} else if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	page := filepath.Join(dir, "bench-report.html")
	if err := fixtureReport(t).WriteHTMLFile(page); err != nil {
		t.Fatal(err)
	}
	shot := CheckHTMLInChromium(t, page, keep)
	t.Logf("screenshot %s", shot)
}
