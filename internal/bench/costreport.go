// SPDX-License-Identifier: Apache-2.0

package bench

import (
	"cmp"
	"fmt"
	"maps"
	"slices"
	"strings"

	"github.com/meshwarp/meshwarp/internal/accel"
)

// AgentCost is the agent's own CPU and memory over a run.
type AgentCost struct {
	// ProcessCPUPercent is the CPU time of the process hosting the agent
	// (the bench process: the agent's goroutines and an orchestrator that
	// waits for the worker) in percent of one CPU over the run.
	ProcessCPUPercent float64 `json:"process_cpu_percent"`
	// BPFCPUPercent is the agent's BPF programs' run time in percent of one
	// CPU (charged to the applications whose calls run them).
	BPFCPUPercent float64 `json:"bpf_cpu_percent"`
	// ProcessRSSBytes is the hosting process's resident memory at the end.
	ProcessRSSBytes float64 `json:"process_rss_bytes"`
	// BPFMemoryBytes is the kernel memory of the agent's maps and programs.
	BPFMemoryBytes float64 `json:"bpf_memory_bytes"`
}

// summarizeCost fills the agent's cost into h: per BPF program and per
// redirected message (medians over the runs bpf), and the hosting process
// (over the runs ss).
func summarizeCost(h *HopsSummary, ss, bpf []Sample) {
	medOf := func(ss []Sample, f func(s Sample) (float64, bool)) float64 {
		var v []float64
		for _, s := range ss {
			if s.Agent == nil {
				continue
			}
			if x, ok := f(s); ok {
				v = append(v, x)
			}
		}
		m, _ := Median(v)
		return m
	}
	med := func(f func(s Sample) (float64, bool)) float64 { return medOf(bpf, f) }
	h.BPFNSPerRedirectedMessage = med(func(s Sample) (float64, bool) {
		a := s.Agent
		return a.BPFRunSeconds * 1e9 / float64(a.RedirectedMessages), a.RedirectedMessages > 0 && a.BPFRunSeconds > 0
	})
	h.BPFPrograms = summarizePrograms(bpf, func(a *AgentDelta) map[string]BPFProgramDelta { return a.BPFPrograms }, med)
	h.BPFProgramsProfilingOnly = summarizePrograms(bpf, func(a *AgentDelta) map[string]BPFProgramDelta { return a.BPFProgramsProfilingOnly }, med)
	c := &AgentCost{
		ProcessCPUPercent: medOf(ss, func(s Sample) (float64, bool) {
			return 100 * s.Agent.ProcessCPUSeconds / s.Agent.WallSeconds, s.Agent.WallSeconds > 0
		}),
		BPFCPUPercent: med(func(s Sample) (float64, bool) {
			return 100 * s.Agent.BPFRunSeconds / s.Agent.WallSeconds, s.Agent.WallSeconds > 0
		}),
		ProcessRSSBytes: medOf(ss, func(s Sample) (float64, bool) { return float64(s.Agent.ProcessRSSBytes), s.Agent.ProcessRSSBytes > 0 }),
		BPFMemoryBytes:  medOf(ss, func(s Sample) (float64, bool) { return float64(s.Agent.BPFMemoryBytes), s.Agent.BPFMemoryBytes > 0 }),
	}
	if c.ProcessRSSBytes > 0 || c.BPFCPUPercent > 0 || c.ProcessCPUPercent > 0 {
		h.Cost = c
	}
}

// summarizePrograms is the per-program summary of the programs progs picks
// from each sample's agent (nil when there are none), by the median med.
func summarizePrograms(ss []Sample, progs func(*AgentDelta) map[string]BPFProgramDelta,
	med func(func(Sample) (float64, bool)) float64) map[string]BPFProgramSummary {
	names := map[string]bool{}
	for _, s := range ss {
		if s.Agent != nil {
			for n := range progs(s.Agent) {
				names[n] = true
			}
		}
	}
	var out map[string]BPFProgramSummary
	for n := range names {
		prog := func(s Sample) BPFProgramDelta { return progs(s.Agent)[n] }
		p := BPFProgramSummary{
			Runs: med(func(s Sample) (float64, bool) { return float64(prog(s).Runs), true }),
			NSPerRun: med(func(s Sample) (float64, bool) {
				x := prog(s)
				return x.RunSeconds * 1e9 / float64(x.Runs), x.Runs > 0 && x.RunSeconds > 0
			}),
			RunsPerRequest: med(func(s Sample) (float64, bool) {
				return float64(prog(s).Runs) / float64(s.Requests), s.Requests > 0
			}),
			NSPerRequest: med(func(s Sample) (float64, bool) {
				return prog(s).RunSeconds * 1e9 / float64(s.Requests), s.Requests > 0
			}),
			NSPerRedirectedMessage: med(func(s Sample) (float64, bool) {
				m := s.Agent.RedirectedMessages
				return prog(s).RunSeconds * 1e9 / float64(m), m > 0
			}),
		}
		if p.Runs == 0 {
			continue
		}
		if out == nil {
			out = map[string]BPFProgramSummary{}
		}
		out[n] = p
	}
	return out
}

// costTable is the agent's own cost per mode with an agent: at idle and
// under each workload (goal: what it costs per message, per connection,
// and as a process).
func (r *Report) costTable() (Table, bool) {
	t := Table{
		Title: fmt.Sprintf("What the agent costs: idle = %v after attaching, no traffic; BPF = its programs' run time (kernel bpf stats, from the profiling pass; - where not profiled: idle, qperf); "+
			"process = the bench process hosting the agent (CPU in %% of one CPU, RSS at the end of the run)", IdleWindow),
		LeftColumns: 2,
		Head: []string{"mode", "workload", "process cpu %", "BPF cpu %", "BPF us/req", "BPF ns/redirected msg", "sock_ops runs/req",
			"RSS MB", "BPF mem MB"},
	}
	for _, m := range r.Config.Modes {
		if !ModeAgent(m) {
			continue
		}
		for _, res := range r.Results {
			if res.Mode != m || res.Hops == nil || res.Hops.Cost == nil {
				continue
			}
			h := res.Hops
			wl := res.Workload
			if res.SizeBytes > 0 {
				wl += " " + sizeLabel(res.SizeBytes)
			}
			perReq, sockops := "-", "-"
			if h.BPFUSPerRequest > 0 {
				perReq = fnum(h.BPFUSPerRequest, 2)
			}
			if p, ok := h.BPFPrograms[accel.SockOpsProgram]; ok && p.RunsPerRequest > 0 {
				sockops = fnum(p.RunsPerRequest, 2)
			}
			perMsg := "-"
			if h.BPFNSPerRedirectedMessage > 0 {
				perMsg = fnum(h.BPFNSPerRedirectedMessage, 0)
			}
			// Only profiled runs (BPF statistics on) know the BPF time: idle and qperf are not profiled.
			bpfCPU := "-"
			if len(h.BPFPrograms) > 0 {
				bpfCPU = fnum(h.Cost.BPFCPUPercent, 2)
			}
			t.Rows = append(t.Rows, []string{m, wl, fnum(h.Cost.ProcessCPUPercent, 2), bpfCPU, perReq, perMsg, sockops,
				fnum(h.Cost.ProcessRSSBytes/1e6, 1), fnum(h.Cost.BPFMemoryBytes/1e6, 1)})
		}
	}
	return t, len(t.Rows) > 0
}

// programLines lists the BPF programs of one result, most expensive first,
// then those only a profiling run attached (in none of the totals).
func programLines(mode string, h *HopsSummary) []string {
	if h == nil || len(h.BPFPrograms) == 0 {
		return nil
	}
	line := fmt.Sprintf("%s BPF per program: %s", mode, programList(h.BPFPrograms))
	if h.BPFNSPerRedirectedMessage > 0 {
		line += fmt.Sprintf(" (all programs: %.0f ns per redirected message)", h.BPFNSPerRedirectedMessage)
	}
	lines := []string{line}
	if len(h.BPFProgramsProfilingOnly) > 0 {
		lines = append(lines, fmt.Sprintf("%s profiling run only, in no total (`meshwarp run` does not attach it; --observe-reads puts it in the measured runs): %s",
			mode, programList(h.BPFProgramsProfilingOnly)))
	}
	return lines
}

// programList formats programs, most expensive first.
func programList(progs map[string]BPFProgramSummary) string {
	names := slices.SortedFunc(maps.Keys(progs), func(a, b string) int {
		pa, pb := progs[a], progs[b]
		return cmp.Compare(pb.Runs*pb.NSPerRun, pa.Runs*pa.NSPerRun)
	})
	var parts []string
	for _, n := range names {
		p := progs[n]
		part := fmt.Sprintf("%s %.0f ns/run", n, p.NSPerRun)
		if p.RunsPerRequest > 0 {
			part += fmt.Sprintf(" x %.2f/req", p.RunsPerRequest)
		}
		if p.NSPerRedirectedMessage > 0 {
			part += fmt.Sprintf(" = %.0f ns/redirected msg", p.NSPerRedirectedMessage)
		}
		parts = append(parts, part)
	}
	return strings.Join(parts, "; ")
}
