// SPDX-License-Identifier: Apache-2.0

package bench

import (
	"fmt"
	"io"
	"os"
	"strings"
	"sync"
	"time"

	"golang.org/x/sys/unix"
)

// progress draws a bar on a terminal (redrawn in place twice a second) or
// prints one line per step when its writer is not a terminal (CI logs).
type progress struct {
	mu      sync.Mutex
	w       io.Writer
	tty     bool
	total   time.Duration // estimated
	done    time.Duration // estimate of finished steps
	start   time.Time
	step    int
	steps   int
	label   string
	stepEst time.Duration
	stepT0  time.Time
	stop    chan struct{}
	stopped chan struct{}
}

func newProgress(w io.Writer, steps int, total time.Duration) *progress {
	p := &progress{w: w, steps: steps, total: total, start: time.Now()}
	if w == nil {
		p.w = io.Discard
		return p
	}
	if f, ok := w.(*os.File); ok {
		if _, err := unix.IoctlGetTermios(int(f.Fd()), unix.TCGETS); err == nil {
			p.tty = true
		}
	}
	if p.tty {
		p.stop = make(chan struct{})
		p.stopped = make(chan struct{})
		go p.loop()
	}
	return p
}

func (p *progress) loop() {
	defer close(p.stopped)
	t := time.NewTicker(500 * time.Millisecond)
	defer t.Stop()
	for {
		select {
		case <-p.stop:
			return
		case <-t.C:
			p.mu.Lock()
			p.draw()
			p.mu.Unlock()
		}
	}
}

// begin starts step label, estimated to take est.
func (p *progress) begin(label string, est time.Duration) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.step++
	p.label = label
	p.stepEst = est
	p.stepT0 = time.Now()
	if p.tty {
		p.draw()
		return
	}
	fmt.Fprintf(p.w, "bench: [%d/%d] %s (elapsed %s of ~%s)\n", p.step, p.steps, label,
		fmtDur(time.Since(p.start)), fmtDur(p.total))
}

// end finishes the current step.
func (p *progress) end() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.done += p.stepEst
}

// note prints a message above the bar.
func (p *progress) note(format string, args ...any) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.tty {
		fmt.Fprint(p.w, "\r\033[K")
	}
	fmt.Fprintf(p.w, "bench: "+format+"\n", args...)
	if p.tty {
		p.draw()
	}
}

func (p *progress) draw() {
	elapsed := time.Since(p.start)
	inStep := min(time.Since(p.stepT0), p.stepEst)
	frac := 0.0
	if p.total > 0 {
		frac = float64(p.done+inStep) / float64(p.total)
	}
	frac = min(max(frac, 0), 1)
	// estimate the remaining time from the plan, corrected by how far off
	// the finished part was
	remaining := p.total - p.done - inStep
	if p.done+inStep > 0 {
		scale := float64(elapsed) / float64(p.done+inStep)
		remaining = time.Duration(float64(remaining) * scale)
	}
	const width = 24
	n := int(frac * width)
	bar := strings.Repeat("#", n) + strings.Repeat(".", width-n)
	fmt.Fprintf(p.w, "\r\033[K[%s] %3.0f%% %d/%d %s  %s elapsed, ~%s left",
		bar, frac*100, p.step, p.steps, p.label, fmtDur(elapsed), fmtDur(max(remaining, 0)))
}

// close removes the bar.
func (p *progress) close() {
	if p.stop != nil {
		close(p.stop)
		<-p.stopped
		p.stop = nil
		p.mu.Lock()
		fmt.Fprint(p.w, "\r\033[K")
		p.mu.Unlock()
	}
}

func fmtDur(d time.Duration) string {
	d = d.Round(time.Second)
	if d < time.Minute {
		return fmt.Sprintf("%ds", int(d.Seconds()))
	}
	return fmt.Sprintf("%dm%02ds", int(d.Minutes()), int(d.Seconds())%60)
}
