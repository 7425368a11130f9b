// SPDX-License-Identifier: Apache-2.0

package bench

import (
	"bytes"
	"context"
	"fmt"
	"net/netip"
	"os/exec"
	"strconv"
	"strings"
	"time"
)

// unpairedQperfPort is the control port of --qperf-unpaired's server.
const unpairedQperfPort = 19766

// startOutsideQperf starts the qperf server of --qperf-unpaired outside the
// lab cgroup and waits until it listens; stop kills it.
func (r *runner) startOutsideQperf(ctx context.Context) (stop func(), err error) {
	cmd := r.env.OutsideServerCommand(ctx, "qperf", "--listen_port", strconv.Itoa(unpairedQperfPort))
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("start qperf server outside the lab cgroup: %w", err)
	}
	stop = func() {
		cmd.Process.Kill()
		cmd.Wait()
	}
	probe := fmt.Sprintf("sport = :%d", unpairedQperfPort)
	for deadline := time.Now().Add(10 * time.Second); ; {
		out, _ := r.env.OutsideServerCommand(ctx, "ss", "-Hltn", probe).Output()
		if len(bytes.TrimSpace(out)) > 0 {
			return stop, nil
		}
		if time.Now().After(deadline) || ctx.Err() != nil {
			stop()
			return nil, fmt.Errorf("qperf server outside the lab cgroup did not listen on :%d within 10s", unpairedQperfPort)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// qperfListenPort is the qperf server's control port.
func (r *runner) qperfListenPort() (listen, data int) {
	listen, data = r.env.QperfPorts()
	if r.opts.QperfUnpaired {
		listen = unpairedQperfPort
	}
	return listen, data
}

func (r *runner) qperfArgs(test string, size int) []string {
	listen, data := r.qperfListenPort()
	args := []string{r.qperfHost().String(), "-lp", strconv.Itoa(listen)}
	if data != 0 {
		args = append(args, "-ip", strconv.Itoa(data))
	}
	if r.opts.QperfCPU != nil {
		args = append(args, "-ca", strconv.Itoa(*r.opts.QperfCPU))
	}
	return append(args, "-t", strconv.Itoa(int(r.opts.QperfDuration.Seconds())),
		"-m", strconv.Itoa(size), "-uu", "-v", test)
}

// qperfHost is the qperf server's address as the qperf client dials it.
func (r *runner) qperfHost() netip.Addr {
	if r.opts.QperfLoopback {
		return netip.MustParseAddr("127.0.0.1")
	}
	return r.env.ServerIP()
}

// qperfCommand starts the qperf client: in the client pod, or for
// --qperf-loopback in the server pod itself.
func (r *runner) qperfCommand(ctx context.Context, args ...string) *exec.Cmd {
	if r.opts.QperfLoopback {
		return r.env.ServerCommand(ctx, "qperf", args...)
	}
	return r.env.ClientCommand(ctx, "qperf", args...)
}

// runQperfTest runs one qperf test at one size and returns its result and
// the lab cgroup's CPU seconds over it.
func (r *runner) runQperfTest(ctx context.Context, test string, size int) (QperfResult, float64, error) {
	ctx, cancel := context.WithTimeout(ctx, r.opts.QperfDuration+30*time.Second)
	defer cancel()
	cmd := r.qperfCommand(ctx, r.qperfArgs(test, size)...)
	var stdout, stderr bytes.Buffer
	cmd.Stdout = &stdout
	cmd.Stderr = &tailWriter{buf: &stderr, max: 4096}
	cpu0, err := CgroupCPUSeconds(r.env.CgroupPath())
	if err != nil {
		return QperfResult{}, 0, err
	}
	err = cmd.Run()
	cpu1, cerr := CgroupCPUSeconds(r.env.CgroupPath())
	if err != nil {
		return QperfResult{}, 0, fmt.Errorf("qperf %s -m %d: %w: %s %s", test, size, err,
			strings.TrimSpace(stdout.String()), strings.TrimSpace(stderr.String()))
	}
	if cerr != nil {
		return QperfResult{}, 0, cerr
	}
	res, err := ParseQperf(stdout.String())
	if err != nil {
		return QperfResult{}, 0, err
	}
	if len(res) != 1 || res[0].Test != test {
		return QperfResult{}, 0, fmt.Errorf("qperf %s -m %d: unexpected output %q", test, size, truncate(stdout.String(), 300))
	}
	return res[0], cpu1 - cpu0, nil
}

func (r *runner) runQperf(ctx context.Context, rep int, mode string, agent Agent) error {
	for _, size := range r.opts.Sizes {
		before, err := r.agentSnapshot(agent)
		if err != nil {
			return err
		}
		lat, latCPU, err := r.runQperfTest(ctx, "tcp_lat", size)
		if err == nil {
			var bw QperfResult
			var bwCPU float64
			bw, bwCPU, err = r.runQperfTest(ctx, "tcp_bw", size)
			if err == nil {
				delta, derr := r.agentDelta(agent, before)
				if derr != nil {
					return derr
				}
				s := QperfSample(mode, rep, size, lat, latCPU, bw, bwCPU)
				s.Agent = delta
				r.samples = append(r.samples, s)
				continue
			}
		}
		if ModeCapture(mode) {
			return fmt.Errorf("%w: %w", ErrQperfThroughSidecar, err)
		}
		return err
	}
	return nil
}

// QperfSample combines tcp_lat and tcp_bw at one size. A request is a
// round trip (two qperf messages); latency is qperf's (one way).
func QperfSample(mode string, rep, size int, lat QperfResult, latCPU float64, bw QperfResult, bwCPU float64) Sample {
	s := Sample{Mode: mode, Workload: WorkloadQperf, SizeBytes: size, Repeat: rep,
		Metrics: map[string]float64{}, CPUSeconds: latCPU + bwCPU,
		DurationSeconds: lat.TimeSeconds + bw.TimeSeconds}
	if lat.LatencyUS > 0 {
		s.Metrics[MetricLatencyAvg] = lat.LatencyUS
		rate := lat.MsgRatePerSec
		if rate == 0 {
			rate = 1e6 / lat.LatencyUS
		}
		rtt := rate / 2
		s.Metrics[MetricQPS] = rtt
		s.Requests = int64(rtt * lat.TimeSeconds)
		if s.Requests > 0 && latCPU > 0 {
			s.Metrics[MetricCPUPer1kReqs] = latCPU / (float64(s.Requests) / 1000)
		}
	}
	if bw.BandwidthBytesPerSec > 0 {
		s.Metrics[MetricBandwidth] = bw.BandwidthBytesPerSec / 1e6
		if gb := bw.BandwidthBytesPerSec * bw.TimeSeconds / 1e9; gb > 0 && bwCPU > 0 {
			s.Metrics[MetricCPUPerGB] = bwCPU / gb
		}
	}
	return s
}

func (r *runner) runUnix(ctx context.Context, rep int) error {
	spec := WorkerSpec{
		Workload:        WorkloadUnix,
		DurationSeconds: r.opts.QperfDuration.Seconds(),
		SizesBytes:      r.opts.Sizes,
		CPU:             r.opts.QperfCPU,
	}
	timeout := time.Duration(2*len(r.opts.Sizes))*r.opts.QperfDuration + 60*time.Second
	res, _, err := r.runWorker(ctx, spec, timeout)
	if err != nil {
		return err
	}
	for _, u := range res.Unix {
		r.samples = append(r.samples, UnixSample(rep, u))
	}
	return nil
}

// UnixSample turns one size of the floor into a sample (same definitions as
// QperfSample; CPU is the worker process's own).
func UnixSample(rep int, u UnixResult) Sample {
	s := Sample{Mode: ModeFloor, Workload: WorkloadUnix, SizeBytes: int(u.MsgSizeBytes), Repeat: rep,
		Metrics: map[string]float64{}, CPUSeconds: u.LatCPUSeconds + u.BWCPUSeconds,
		DurationSeconds: u.LatSeconds + u.BWSeconds, Requests: u.RoundTrips}
	if u.LatencyUS > 0 {
		s.Metrics[MetricLatencyAvg] = u.LatencyUS
		s.Metrics[MetricQPS] = u.MsgRatePerSec / 2
		if u.RoundTrips > 0 && u.LatCPUSeconds > 0 {
			s.Metrics[MetricCPUPer1kReqs] = u.LatCPUSeconds / (float64(u.RoundTrips) / 1000)
		}
	}
	if u.BandwidthBytesPerSec > 0 {
		s.Metrics[MetricBandwidth] = u.BandwidthBytesPerSec / 1e6
		if u.StreamBytes > 0 && u.BWCPUSeconds > 0 {
			s.Metrics[MetricCPUPerGB] = u.BWCPUSeconds / (float64(u.StreamBytes) / 1e9)
		}
	}
	return s
}
