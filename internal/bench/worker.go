// SPDX-License-Identifier: Apache-2.0

package bench

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"strconv"
	"sync"
	"syscall"
	"time"

	"fortio.org/fortio/fhttp"
	"fortio.org/fortio/periodic"
	"fortio.org/fortio/stats"
	"fortio.org/fortio/tcprunner"
	flog "fortio.org/log"

	"github.com/meshwarp/meshwarp/internal/lab"
)

// The worker is the load generator. The orchestrator re-executes the
// meshwarp binary as `meshwarp bench worker --spec JSON` inside the client
// pod's network namespace and the lab cgroup (lab.Command), because a Go
// process cannot move its goroutines into another netns reliably (setns is
// per thread and goroutines migrate between threads). The worker prints one
// WorkerResult as JSON on stdout.

// WorkerHelper is the re-exec helper name of the worker (lab.HandleReexec:
// any binary that links this package can be a worker, also a `go test` one).
const WorkerHelper = "bench-worker"

func init() {
	lab.HandleReexec(WorkerHelper, []string{"bench", "worker"}, func(args []string) int {
		return WorkerMain(args, os.Stdout, os.Stderr)
	})
}

// WorkerMain is the worker's entry point: args are "--spec JSON". It returns
// the process exit code.
func WorkerMain(args []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("bench worker", flag.ContinueOnError)
	fs.SetOutput(stderr)
	specJSON := fs.String("spec", "", "what to run (JSON WorkerSpec)")
	if err := fs.Parse(args); err != nil {
		return 2
	}
	spec, err := DecodeWorkerSpec(*specJSON)
	if err != nil {
		fmt.Fprintf(stderr, "meshwarp bench worker: %v\n", err)
		return 2
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	// fortio logs one line per failed connection attempt, thousands per
	// second against a dead target: keep the first lines and a count.
	logs := &logSummary{max: 1500}
	flog.SetOutput(logs)
	defer flog.SetOutput(os.Stderr)
	err = RunWorker(ctx, spec, stdout)
	if logs.lines > 0 {
		fmt.Fprintf(stderr, "fortio logged %d line(s), first: %s\n", logs.lines, bytes.TrimSpace(logs.first))
	}
	if err != nil {
		fmt.Fprintf(stderr, "meshwarp bench worker: %v\n", err)
		return 1
	}
	return 0
}

// logSummary keeps the first max bytes written and counts lines.
type logSummary struct {
	mu    sync.Mutex
	max   int
	first []byte
	lines int
}

func (l *logSummary) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.lines += bytes.Count(p, []byte("\n"))
	if room := l.max - len(l.first); room > 0 {
		l.first = append(l.first, p[:min(room, len(p))]...)
	}
	return len(p), nil
}

// WorkerSpec tells the worker what to run.
type WorkerSpec struct {
	Workload string `json:"workload"` // http, tcp or unix
	// Target is the URL (http) or host:port (tcp).
	Target          string  `json:"target,omitempty"`
	Connections     int     `json:"connections,omitempty"`
	DurationSeconds float64 `json:"duration_seconds"`
	PayloadBytes    int     `json:"payload_bytes,omitempty"`
	// ResolutionSeconds is the histogram bucket width unit (fortio -r).
	ResolutionSeconds float64 `json:"resolution_seconds,omitempty"`
	// DisableKeepAlive opens one connection per HTTP request (`Connection: close`).
	DisableKeepAlive bool `json:"disable_keepalive,omitempty"`
	// SizesBytes are the message sizes of the unix floor.
	SizesBytes []int `json:"sizes_bytes,omitempty"`
	// CPU, when set, runs both ends of the unix floor on this CPU (Options.QperfCPU).
	CPU *int `json:"cpu,omitempty"`
}

// WorkerResult is what the worker measured.
type WorkerResult struct {
	Workload string `json:"workload"`
	// Requests counts successful requests (HTTP 200 or echoed TCP payloads).
	Requests        int64    `json:"requests"`
	Errors          int64    `json:"errors"`
	ErrorCodes      []string `json:"error_codes,omitempty"`
	DurationSeconds float64  `json:"duration_seconds"`
	// QPS is fortio's actual rate of completed calls (successful or not).
	QPS       float64  `json:"qps"`
	AvgUS     float64  `json:"avg_us"`
	MinUS     float64  `json:"min_us"`
	MaxUS     float64  `json:"max_us"`
	Histogram []Bucket `json:"histogram_us,omitempty"`
	Sockets   int64    `json:"sockets"`
	// Unix holds one entry per size for the unix floor.
	Unix []UnixResult `json:"unix,omitempty"`
}

// DecodeWorkerSpec parses the --spec argument.
func DecodeWorkerSpec(s string) (WorkerSpec, error) {
	var spec WorkerSpec
	if err := json.Unmarshal([]byte(s), &spec); err != nil {
		return spec, fmt.Errorf("decode worker spec: %w", err)
	}
	if spec.DurationSeconds <= 0 {
		return spec, errors.New("worker spec: duration_seconds must be > 0")
	}
	return spec, nil
}

// RunWorker runs spec and writes its WorkerResult as JSON to out.
func RunWorker(ctx context.Context, spec WorkerSpec, out io.Writer) error {
	// fortio logs every connection at info level; keep its errors only (on stderr).
	flog.SetLogLevelQuiet(flog.Error)
	var (
		res WorkerResult
		err error
	)
	switch spec.Workload {
	case WorkloadHTTP:
		res, err = runFortioHTTP(ctx, spec)
	case WorkloadTCP:
		res, err = runFortioTCP(ctx, spec)
	case WorkloadUnix:
		res, err = runUnixFloor(ctx, spec)
	default:
		err = fmt.Errorf("worker: unknown workload %q", spec.Workload)
	}
	if err != nil {
		return err
	}
	res.Workload = spec.Workload
	enc := json.NewEncoder(out)
	if err := enc.Encode(res); err != nil {
		return fmt.Errorf("write worker result: %w", err)
	}
	return nil
}

func runnerOptions(ctx context.Context, spec WorkerSpec) periodic.RunnerOptions {
	aborter := periodic.NewAborter()
	// Abort the run (gracefully, fortio still returns what it measured) when
	// the worker is interrupted; results of an aborted run are then discarded
	// by the orchestrator.
	context.AfterFunc(ctx, func() { aborter.Abort(false) })
	res := spec.ResolutionSeconds
	if res <= 0 {
		res = DefaultResolutionSeconds
	}
	return periodic.RunnerOptions{
		QPS:         -1, // fortio's "-qps 0": no pacing, as fast as the server answers
		Duration:    time.Duration(spec.DurationSeconds * float64(time.Second)),
		NumThreads:  spec.Connections,
		Resolution:  res,
		Percentiles: []float64{50, 90, 99},
		Out:         io.Discard,
		Stop:        aborter,
	}
}

func runFortioHTTP(ctx context.Context, spec WorkerSpec) (WorkerResult, error) {
	o := fhttp.HTTPRunnerOptions{RunnerOptions: runnerOptions(ctx, spec)}
	o.URL = spec.Target
	o.DisableKeepAlive = spec.DisableKeepAlive
	o.HTTPOptions.Resolution = o.RunnerOptions.Resolution
	// the seeds ran fortio with -httpbufferkb=64
	fhttp.BufferSizeKb = 64
	r, err := fhttp.RunHTTPTest(&o)
	if err != nil {
		return WorkerResult{}, fmt.Errorf("fortio http load %s: %w", spec.Target, err)
	}
	if err := ctx.Err(); err != nil {
		return WorkerResult{}, err
	}
	res := fromHistogram(r.DurationHistogram, r.ActualQPS, r.ActualDuration)
	res.Requests = r.RetCodes[200]
	for code, n := range r.RetCodes {
		if code != 200 {
			res.Errors += n
			res.ErrorCodes = append(res.ErrorCodes, strconv.Itoa(code))
		}
	}
	res.Sockets = r.SocketCount
	return res, nil
}

func runFortioTCP(ctx context.Context, spec WorkerSpec) (WorkerResult, error) {
	o := tcprunner.RunnerOptions{RunnerOptions: runnerOptions(ctx, spec)}
	o.Destination = spec.Target
	o.Payload = make([]byte, spec.PayloadBytes)
	for i := range o.Payload {
		o.Payload[i] = byte('a' + i%26)
	}
	r, err := tcprunner.RunTCPTest(&o)
	if err != nil {
		return WorkerResult{}, fmt.Errorf("fortio tcp load %s: %w", spec.Target, err)
	}
	if err := ctx.Err(); err != nil {
		return WorkerResult{}, err
	}
	res := fromHistogram(r.DurationHistogram, r.ActualQPS, r.ActualDuration)
	res.Requests = r.RetCodes[tcprunner.TCPStatusOK]
	for code, n := range r.RetCodes {
		if code != tcprunner.TCPStatusOK {
			res.Errors += n
			res.ErrorCodes = append(res.ErrorCodes, code)
		}
	}
	res.Sockets = int64(r.SocketCount)
	return res, nil
}

// fromHistogram converts fortio's histogram (seconds) to microseconds.
func fromHistogram(h *stats.HistogramData, qps float64, d time.Duration) WorkerResult {
	res := WorkerResult{QPS: qps, DurationSeconds: d.Seconds()}
	if h == nil {
		return res
	}
	res.AvgUS = h.Avg * 1e6
	res.MinUS = h.Min * 1e6
	res.MaxUS = h.Max * 1e6
	for _, b := range h.Data {
		res.Histogram = append(res.Histogram, Bucket{StartUS: b.Start * 1e6, EndUS: b.End * 1e6, Count: b.Count})
	}
	return res
}

func runUnixFloor(ctx context.Context, spec WorkerSpec) (WorkerResult, error) {
	var res WorkerResult
	d := time.Duration(spec.DurationSeconds * float64(time.Second))
	start := time.Now()
	for _, size := range spec.SizesBytes {
		cpu0 := processCPUSeconds()
		lat, err := UnixPingPong(ctx, size, d, spec.CPU)
		if err != nil {
			return res, fmt.Errorf("unix ping-pong %d bytes: %w", size, err)
		}
		cpu1 := processCPUSeconds()
		bw, err := UnixStream(ctx, size, d, spec.CPU)
		if err != nil {
			return res, fmt.Errorf("unix stream %d bytes: %w", size, err)
		}
		lat.LatCPUSeconds = cpu1 - cpu0
		lat.BWCPUSeconds = processCPUSeconds() - cpu1
		lat.StreamBytes = bw.StreamBytes
		lat.BWSeconds = bw.BWSeconds
		lat.BandwidthBytesPerSec = bw.BandwidthBytesPerSec
		res.Unix = append(res.Unix, lat)
	}
	res.DurationSeconds = time.Since(start).Seconds()
	return res, nil
}
