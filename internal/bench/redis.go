// SPDX-License-Identifier: Apache-2.0

package bench

import (
	"bytes"
	"context"
	"encoding/csv"
	"fmt"
	"net/netip"
	"strconv"
	"strings"
	"time"
)

// The redis workload: redis-server (Debian's) in the server pod and the lab
// cgroup, behind the sidecar like the fortio servers, and redis-benchmark in
// the client pod: a real server and client that nobody here wrote. SET and
// GET with redis-benchmark's defaults (3 B values), plain and pipelined.
const (
	// RedisPort is where the bench's redis-server listens in the server pod.
	RedisPort = 6379
	// redisClients is redis-benchmark -c (its default, the c50).
	redisClients = 50
	// redisPipeline is -P of the pipelined row.
	redisPipeline = 16
	redisTests    = "set,get"
	// redisFirstRate are the first guesses of the request rate (per second
	// and command) that size -n before a rate was measured in this bench.
	redisFirstRatePlain     = 15000
	redisFirstRatePipelined = 100000
)

func (r *runner) redisTarget() string {
	return netip.AddrPortFrom(r.env.ServerIP(), RedisPort).String()
}

// startRedis starts redis-server in the server pod (no persistence, no
// protected mode: it answers the client pod) and waits until it listens.
func (r *runner) startRedis(ctx context.Context) (stop func(), err error) {
	args := []string{"--port", strconv.Itoa(RedisPort), "--bind"}
	for _, a := range r.serverAppAddrs() {
		args = append(args, a.String())
	}
	args = append(args, "--protected-mode", "no", "--save", "", "--appendonly", "no", "--daemonize", "no", "--loglevel", "warning")
	return r.startServerApp(ctx, RedisPort, "redis-server", args...)
}

// RedisResult is one redis-benchmark line (--csv).
type RedisResult struct {
	Test  string
	RPS   float64
	AvgMS float64
	P50MS float64
	P99MS float64
	MaxMS float64
}

// ParseRedisBenchmarkCSV reads redis-benchmark --csv output (redis 7:
// "test","rps","avg_latency_ms","min_latency_ms","p50_latency_ms",
// "p95_latency_ms","p99_latency_ms","max_latency_ms").
func ParseRedisBenchmarkCSV(out string) ([]RedisResult, error) {
	recs, err := csv.NewReader(strings.NewReader(out)).ReadAll()
	if err != nil {
		return nil, fmt.Errorf("parse redis-benchmark csv: %w", err)
	}
	if len(recs) < 2 {
		return nil, fmt.Errorf("redis-benchmark printed no result: %q", truncate(out, 300))
	}
	col := map[string]int{}
	for i, h := range recs[0] {
		col[h] = i
	}
	for _, need := range []string{"test", "rps", "avg_latency_ms", "p50_latency_ms", "p99_latency_ms", "max_latency_ms"} {
		if _, ok := col[need]; !ok {
			return nil, fmt.Errorf("redis-benchmark csv has no %q column: %q", need, truncate(out, 300))
		}
	}
	var res []RedisResult
	for _, rec := range recs[1:] {
		if len(rec) != len(recs[0]) {
			return nil, fmt.Errorf("redis-benchmark csv line %q: %d fields, want %d", rec, len(rec), len(recs[0]))
		}
		f := func(name string) (float64, error) { return strconv.ParseFloat(rec[col[name]], 64) }
		x := RedisResult{Test: rec[col["test"]]}
		for _, p := range []struct {
			name string
			dst  *float64
		}{{"rps", &x.RPS}, {"avg_latency_ms", &x.AvgMS}, {"p50_latency_ms", &x.P50MS}, {"p99_latency_ms", &x.P99MS}, {"max_latency_ms", &x.MaxMS}} {
			v, err := f(p.name)
			if err != nil {
				return nil, fmt.Errorf("redis-benchmark csv %s %s: %w", x.Test, p.name, err)
			}
			*p.dst = v
		}
		res = append(res, x)
	}
	return res, nil
}

// runRedis runs redis-benchmark plain and pipelined (two samples).
func (r *runner) runRedis(ctx context.Context, rep int, mode string, agent Agent) error {
	for _, v := range []struct {
		workload string
		pipeline int
		first    float64
	}{{WorkloadRedis, 1, redisFirstRatePlain}, {WorkloadRedisPipelined, redisPipeline, redisFirstRatePipelined}} {
		rate := r.redisRate[v.workload]
		if rate == 0 {
			rate = v.first
		}
		n := max(int64(rate*r.opts.Duration.Seconds()), 1000)
		args := []string{"-h", r.env.ServerIP().String(), "-p", strconv.Itoa(RedisPort), "-c", strconv.Itoa(redisClients),
			"-n", strconv.FormatInt(n, 10), "-t", redisTests, "--csv"}
		if v.pipeline > 1 {
			args = append(args, "-P", strconv.Itoa(v.pipeline))
		}
		before, err := r.agentSnapshot(agent)
		if err != nil {
			return err
		}
		rctx, cancel := context.WithTimeout(ctx, 4*r.opts.Duration+60*time.Second)
		cmd := r.env.ClientCommand(rctx, "redis-benchmark", args...)
		var stdout, stderr bytes.Buffer
		cmd.Stdout = &stdout
		cmd.Stderr = &tailWriter{buf: &stderr, max: 4096}
		cpu0, err := CgroupCPUSeconds(r.env.CgroupPath())
		if err != nil {
			cancel()
			return err
		}
		start := time.Now()
		err = cmd.Run()
		wall := time.Since(start).Seconds()
		cancel()
		cpu1, cerr := CgroupCPUSeconds(r.env.CgroupPath())
		if err != nil {
			return fmt.Errorf("redis-benchmark %s: %w: %s", strings.Join(args, " "), err, strings.TrimSpace(stderr.String()))
		}
		if cerr != nil {
			return cerr
		}
		res, err := ParseRedisBenchmarkCSV(stdout.String())
		if err != nil {
			return err
		}
		delta, err := r.agentDelta(agent, before)
		if err != nil {
			return err
		}
		s := RedisSample(mode, v.workload, rep, n, res, cpu1-cpu0)
		if s.DurationSeconds == 0 {
			s.DurationSeconds = wall
		}
		s.Agent = delta
		r.samples = append(r.samples, s)
		if q := s.Metrics[MetricQPS]; q > 0 {
			r.redisRate[v.workload] = q
		}
		if s.Requests == 0 {
			return fmt.Errorf("redis-benchmark %s: no request completed", v.workload)
		}
	}
	return nil
}

// RedisSample combines the commands of one redis-benchmark run (each ran n
// requests): qps is all requests over the commands' summed time; latency is
// the mean of the commands' figures (redis-benchmark gives no histogram).
func RedisSample(mode, workload string, rep int, n int64, res []RedisResult, cpuSeconds float64) Sample {
	s := Sample{Mode: mode, Workload: workload, Repeat: rep, CPUSeconds: cpuSeconds, Metrics: map[string]float64{}}
	var secs, avg, p50, p99 float64
	k := 0
	for _, x := range res {
		if x.RPS <= 0 {
			continue
		}
		k++
		secs += float64(n) / x.RPS
		s.Requests += n
		avg += x.AvgMS * 1000
		p50 += x.P50MS * 1000
		p99 += x.P99MS * 1000
	}
	if k == 0 {
		return s
	}
	s.DurationSeconds = secs
	s.Metrics[MetricQPS] = float64(s.Requests) / secs
	s.Metrics[MetricLatencyAvg] = avg / float64(k)
	s.Metrics[MetricLatencyP50] = p50 / float64(k)
	s.Metrics[MetricLatencyP99] = p99 / float64(k)
	if cpuSeconds > 0 {
		s.Metrics[MetricCPUPer1kReqs] = cpuSeconds / (float64(s.Requests) / 1000)
	}
	return s
}
