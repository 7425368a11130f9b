// SPDX-License-Identifier: Apache-2.0

package bench

import (
	"bufio"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"

	"github.com/meshwarp/meshwarp/internal/accel"
)

// What the agent itself costs: the run time of each of its BPF programs
// (the kernel's statistics, on during the profiling pass), the CPU time and
// resident memory of the process that hosts it (the bench process: the
// agent runs in it, next to an orchestrator that waits for the worker), and
// the kernel memory of its maps and programs.

// BPFProgramDelta is one BPF program's runs and run time over a run.
type BPFProgramDelta struct {
	Runs       uint64  `json:"runs"`
	RunSeconds float64 `json:"run_seconds"`
}

// pinnedAgent is an Agent whose maps are pinned in known directories: its
// programs are the loaded programs that use those maps.
type pinnedAgent interface {
	PinDirs() []string
}

func (x accelAgent) PinDirs() []string { return []string{x.pinDir} }

func (as nodeAgents) PinDirs() []string {
	var out []string
	for _, a := range as {
		if p, ok := a.(pinnedAgent); ok {
			out = append(out, p.PinDirs()...)
		}
	}
	return out
}

// agentSnap is what agentDelta subtracts: the agent's counters, its
// programs' statistics, and the hosting process's CPU time.
type agentSnap struct {
	stats    accel.Stats
	progs    map[string]BPFProgramDelta
	memBytes uint64
	cpu      float64
	at       time.Time
}

// AgentPrograms reads the run-time statistics of the programs of the
// agents pinned in pinDirs, by program name (summed over agents), and the
// kernel memory (memlock) of their maps and programs. A program is the
// agent's when it uses one of the maps pinned there: another agent's
// programs (another pin directory) are not counted.
func AgentPrograms(pinDirs []string) (map[string]BPFProgramDelta, uint64, error) {
	mapIDs := map[ebpf.MapID]bool{}
	var mem uint64
	for _, dir := range pinDirs {
		entries, err := os.ReadDir(dir)
		if err != nil {
			return nil, 0, fmt.Errorf("read agent pins: %w", err)
		}
		for _, e := range entries {
			m, err := ebpf.LoadPinnedMap(filepath.Join(dir, e.Name()), &ebpf.LoadPinOptions{ReadOnly: true})
			if err != nil {
				continue // a pinned link
			}
			info, err := m.Info()
			m.Close()
			if err != nil {
				continue
			}
			if id, ok := info.ID(); ok && !mapIDs[id] {
				mapIDs[id] = true
				if b, ok := info.Memlock(); ok {
					mem += b
				}
			}
		}
	}
	out := map[string]BPFProgramDelta{}
	if len(mapIDs) == 0 {
		return out, mem, nil
	}
	accel.EachProgram(func(_ ebpf.ProgramID, p *ebpf.Program) {
		info, ierr := p.Info()
		st, serr := p.Stats()
		if ierr != nil {
			return
		}
		ids, _ := info.MapIDs()
		ours := false
		for _, m := range ids {
			ours = ours || mapIDs[m]
		}
		if !ours {
			return
		}
		if b, ok := info.Memlock(); ok {
			mem += b
		}
		if serr != nil {
			return
		}
		d := out[info.Name]
		d.Runs += st.RunCount
		d.RunSeconds += st.Runtime.Seconds()
		out[info.Name] = d
	})
	return out, mem, nil
}

// processCPU is this process's CPU time (user + system, all threads; not
// its children: the workers).
func processCPU() float64 {
	var ru unix.Rusage
	if err := unix.Getrusage(unix.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	tv := func(t unix.Timeval) float64 { return float64(t.Sec) + float64(t.Usec)/1e6 }
	return tv(ru.Utime) + tv(ru.Stime)
}

// processRSS is this process's resident memory in bytes (VmRSS).
func processRSS() (uint64, error) {
	f, err := os.Open("/proc/self/status")
	if err != nil {
		return 0, err
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if rest, ok := strings.CutPrefix(sc.Text(), "VmRSS:"); ok {
			kb, err := strconv.ParseUint(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(rest), "kB")), 10, 64)
			if err != nil {
				return 0, fmt.Errorf("parse VmRSS %q: %w", rest, err)
			}
			return kb * 1024, nil
		}
	}
	return 0, errors.Join(sc.Err(), errors.New("no VmRSS in /proc/self/status"))
}

// agentSnapshot reads the counters (nil agent: nothing) and then the
// process's CPU time: a window that starts here does not count its own reads
// (maps, program statistics: milliseconds, as much as an idle agent's whole
// second), nor does one that ends in agentDelta, which reads the CPU time first.
func (r *runner) agentSnapshot(a Agent) (agentSnap, error) {
	snap, err := r.readAgent(a)
	snap.cpu, snap.at = processCPU(), time.Now()
	return snap, err
}

// readAgent reads the agent's counters and its programs' statistics.
func (r *runner) readAgent(a Agent) (agentSnap, error) {
	var snap agentSnap
	if a == nil {
		return snap, nil
	}
	c, err := a.Stats()
	if err != nil {
		return snap, fmt.Errorf("read agent counters: %w", err)
	}
	snap.stats = c
	if p, ok := a.(pinnedAgent); ok {
		snap.progs, snap.memBytes, err = AgentPrograms(p.PinDirs())
		if err != nil {
			return snap, err
		}
	}
	return snap, nil
}

func (r *runner) agentDelta(a Agent, before agentSnap) (*AgentDelta, error) {
	if a == nil {
		return nil, nil
	}
	cpu, at := processCPU(), time.Now()
	after, err := r.readAgent(a)
	if err != nil {
		return nil, err
	}
	after.cpu, after.at = cpu, at
	d := deltaOf(after.stats.Sub(before.stats))
	d.WallSeconds = after.at.Sub(before.at).Seconds()
	d.ProcessCPUSeconds = max(after.cpu-before.cpu, 0)
	d.BPFMemoryBytes = after.memBytes
	if rss, err := processRSS(); err == nil {
		d.ProcessRSSBytes = rss
	}
	for name, x := range after.progs {
		b := before.progs[name]
		if x.Runs < b.Runs {
			continue // reloaded meanwhile
		}
		if d.BPFPrograms == nil {
			d.BPFPrograms = map[string]BPFProgramDelta{}
		}
		d.BPFPrograms[name] = BPFProgramDelta{Runs: x.Runs - b.Runs, RunSeconds: max(x.RunSeconds-b.RunSeconds, 0)}
	}
	if r.profiling && !r.opts.ObserveReads {
		d.setProfilingOnly(accel.ReadObserverProgram)
	}
	return d, nil
}

// setProfilingOnly takes program name out of d's totals: a profiling run
// attached it for the breakdown, the measured runs and `meshwarp run` do not.
func (d *AgentDelta) setProfilingOnly(name string) {
	p, ok := d.BPFPrograms[name]
	if !ok {
		return
	}
	delete(d.BPFPrograms, name)
	d.BPFRunSeconds = max(d.BPFRunSeconds-p.RunSeconds, 0)
	if d.BPFProgramsProfilingOnly == nil {
		d.BPFProgramsProfilingOnly = map[string]BPFProgramDelta{}
	}
	d.BPFProgramsProfilingOnly[name] = p
}

// IdleWindow is how long the agent is watched with no traffic after it
// attached, in every mode with an agent.
const IdleWindow = time.Second

// measureIdle records the agent's cost over IdleWindow without traffic.
func (r *runner) measureIdle(rep int, mode string, agent Agent) error {
	before, err := r.agentSnapshot(agent)
	if err != nil {
		return err
	}
	time.Sleep(IdleWindow)
	d, err := r.agentDelta(agent, before)
	if err != nil {
		return err
	}
	r.samples = append(r.samples, Sample{Mode: mode, Workload: WorkloadIdle, Repeat: rep,
		DurationSeconds: d.WallSeconds, Metrics: map[string]float64{}, Agent: d})
	return nil
}

// bpfStatsSysctl is kernel.bpf_stats_enabled as read now.
func bpfStatsSysctl() string {
	b, err := os.ReadFile("/proc/sys/kernel/bpf_stats_enabled")
	if err != nil {
		return "unreadable"
	}
	return strings.TrimSpace(string(b))
}
