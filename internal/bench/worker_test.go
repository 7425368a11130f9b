// SPDX-License-Identifier: Apache-2.0

package bench

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"net"
	"os"
	"runtime"
	"strings"
	"testing"
	"time"

	"fortio.org/fortio/fhttp"
	"fortio.org/fortio/fnet"
	flog "fortio.org/log"
	"golang.org/x/sys/unix"
)

// The worker against fortio servers on loopback (no lab, no root): the
// same library calls the bench makes in the client pod.
func TestWorkerFortioLoopback(t *testing.T) {
	// what the lab's server pod runs: fortio's echo handler on every path
	_, addr := fhttp.Serve("127.0.0.1:0", "/debug")
	if addr == nil {
		t.Fatal("cannot start fortio http server on loopback")
	}
	tcpAddr := fnet.TCPEchoServer("bench-test-tcp", "127.0.0.1:0")
	if tcpAddr == nil {
		t.Fatal("cannot start fortio tcp echo server on loopback")
	}
	for _, tc := range []struct{ workload, target string }{
		{WorkloadHTTP, "http://" + addr.String() + "/echo?size=1024"},
		{WorkloadTCP, tcpAddr.String()},
	} {
		t.Run(tc.workload, func(t *testing.T) {
			spec := WorkerSpec{Workload: tc.workload, Target: tc.target, Connections: 4, DurationSeconds: 0.3, PayloadBytes: 1024}
			var out bytes.Buffer
			if err := RunWorker(context.Background(), spec, &out); err != nil {
				t.Fatal(err)
			}
			var res WorkerResult
			if err := json.Unmarshal(out.Bytes(), &res); err != nil {
				t.Fatalf("worker output %q: %v", out.String(), err)
			}
			if res.Requests == 0 || res.Errors != 0 || len(res.Histogram) == 0 || res.DurationSeconds <= 0 {
				t.Fatalf("result %+v", res)
			}
			if n := BucketsCount(res.Histogram); n < res.Requests {
				t.Errorf("histogram holds %d samples for %d requests", n, res.Requests)
			}
			// microsecond resolution: loopback requests do not all fall in one bucket
			if len(res.Histogram) < 2 {
				t.Errorf("histogram has %d bucket(s): resolution too coarse", len(res.Histogram))
			}
			s := FortioSample(ModeDirect, tc.workload, 0, res, 0.1)
			for _, k := range []string{MetricQPS, MetricLatencyAvg, MetricLatencyP50, MetricLatencyP99, MetricCPUPer1kReqs} {
				if s.Metrics[k] <= 0 {
					t.Errorf("metric %s = %v", k, s.Metrics[k])
				}
			}
		})
	}
}

func TestWorkerUnixFloor(t *testing.T) {
	var out bytes.Buffer
	err := RunWorker(context.Background(), WorkerSpec{Workload: WorkloadUnix, DurationSeconds: 0.1, SizesBytes: []int{1, 16384}}, &out)
	if err != nil {
		t.Fatal(err)
	}
	var res WorkerResult
	if err := json.Unmarshal(out.Bytes(), &res); err != nil {
		t.Fatal(err)
	}
	if len(res.Unix) != 2 {
		t.Fatalf("unix results %+v", res.Unix)
	}
	for _, u := range res.Unix {
		if u.RoundTrips == 0 || u.LatencyUS <= 0 || u.StreamBytes == 0 || u.BandwidthBytesPerSec <= 0 {
			t.Errorf("size %d: %+v", u.MsgSizeBytes, u)
		}
		if u.StreamBytes%u.MsgSizeBytes != 0 {
			t.Errorf("size %d: stream of %d bytes is not whole messages", u.MsgSizeBytes, u.StreamBytes)
		}
	}
}

func TestUnixFloorStopsOnCancel(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if _, err := UnixPingPong(ctx, 64, 1e12, nil); err == nil {
		t.Error("ping-pong with a done context succeeded")
	}
	if _, err := UnixStream(ctx, 64, 1e12, nil); err == nil {
		t.Error("stream with a done context succeeded")
	}
}

// --qperf-cpu's floor: both ends on one CPU, and the calling thread gets
// its CPUs back afterwards; a CPU it may not use is an error, not a hang.
func TestUnixFloorOnOneCPU(t *testing.T) {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	var before unix.CPUSet
	if err := unix.SchedGetaffinity(0, &before); err != nil {
		t.Fatal(err)
	}
	cpu := runtime.NumCPU() - 1
	unpin, err := pinThread(&cpu)
	if err != nil {
		t.Fatal(err)
	}
	var on unix.CPUSet
	if err := unix.SchedGetaffinity(0, &on); err != nil || on.Count() != 1 || !on.IsSet(cpu) {
		t.Fatalf("pinned to CPU %d: set %v (%d CPUs), %v", cpu, on, on.Count(), err)
	}
	unpin()
	for _, run := range []func() (UnixResult, error){
		func() (UnixResult, error) { return UnixPingPong(context.Background(), 64, 100*time.Millisecond, &cpu) },
		func() (UnixResult, error) { return UnixStream(context.Background(), 64, 100*time.Millisecond, &cpu) },
	} {
		res, err := run()
		if err != nil || (res.RoundTrips == 0 && res.StreamBytes == 0) {
			t.Fatalf("pinned floor: %+v, %v", res, err)
		}
		var after unix.CPUSet
		if err := unix.SchedGetaffinity(0, &after); err != nil || after != before {
			t.Fatalf("the caller's CPUs after a pinned run: %v, want %v (%v)", after, before, err)
		}
	}
	bad := 1 << 20
	if _, err := UnixPingPong(context.Background(), 64, time.Second, &bad); err == nil {
		t.Error("ping-pong on a CPU that does not exist succeeded")
	}
	if _, err := UnixStream(context.Background(), 64, time.Second, &bad); err == nil {
		t.Error("stream on a CPU that does not exist succeeded")
	}
}

func TestWorkerMainErrors(t *testing.T) {
	var stdout, stderr bytes.Buffer
	if code := WorkerMain([]string{"--spec", "{"}, &stdout, &stderr); code != 2 {
		t.Errorf("bad spec: exit %d", code)
	}
	stderr.Reset()
	if code := WorkerMain([]string{"--spec", `{"workload":"grpc","duration_seconds":1}`}, &stdout, &stderr); code != 1 ||
		!strings.Contains(stderr.String(), "unknown workload") {
		t.Errorf("unknown workload: exit %d, %q", code, stderr.String())
	}
	// a refused connection is an error of the run, not a hang (fortio
	// logs every failed connect: keep the test output readable)
	flog.SetOutput(io.Discard)
	defer flog.SetOutput(os.Stderr)
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	dead := l.Addr().String()
	l.Close()
	spec := `{"workload":"tcp","target":"` + dead + `","connections":1,"duration_seconds":0.2,"payload_bytes":10}`
	stdout.Reset()
	code := WorkerMain([]string{"--spec", spec}, &stdout, &stderr)
	if code == 0 {
		var res WorkerResult
		_ = json.Unmarshal(stdout.Bytes(), &res)
		if res.Requests != 0 {
			t.Errorf("requests to a closed port succeeded: %+v", res)
		}
	}
}
