// SPDX-License-Identifier: Apache-2.0

package bench

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"
)

// The floor: an AF_UNIX stream socketpair inside one process, the cheapest
// way two local processes can exchange bytes. Both ends use blocking
// read(2)/write(2) on goroutines locked to their own OS threads, like qperf's
// client and server, so the comparison with qperf is about the path, not the
// I/O model. With a CPU given, both threads run on it, as qperf -ca does.

// UnixResult is one size of the AF_UNIX floor, in qperf's terms.
type UnixResult struct {
	MsgSizeBytes int64 `json:"msg_size_bytes"`
	// LatencyUS is one way (half a round trip), as qperf's tcp_lat reports.
	LatencyUS float64 `json:"latency_us"`
	// MsgRatePerSec counts ping-pong messages one way per second (qperf's msg_rate).
	MsgRatePerSec        float64 `json:"msg_rate_per_sec"`
	RoundTrips           int64   `json:"round_trips"`
	BandwidthBytesPerSec float64 `json:"bandwidth_bytes_per_sec"`
	StreamBytes          int64   `json:"stream_bytes"`
	LatSeconds           float64 `json:"lat_seconds"`
	BWSeconds            float64 `json:"bw_seconds"`
	// CPU seconds of the process (both ends) during each test.
	LatCPUSeconds float64 `json:"lat_cpu_seconds"`
	BWCPUSeconds  float64 `json:"bw_cpu_seconds"`
}

// UnixPingPong sends size-byte messages back and forth over a socketpair for
// d and returns the one-way latency and message rate; cpu, when set, is the
// CPU both ends run on.
func UnixPingPong(ctx context.Context, size int, d time.Duration, cpu *int) (UnixResult, error) {
	r := UnixResult{MsgSizeBytes: int64(size)}
	fds, err := socketpair()
	if err != nil {
		return r, err
	}
	var closeOnce sync.Once
	closeAll := func() {
		closeOnce.Do(func() {
			// shutdown wakes a peer blocked in read before the fds go away
			_ = unix.Shutdown(fds[0], unix.SHUT_RDWR)
			_ = unix.Shutdown(fds[1], unix.SHUT_RDWR)
		})
	}
	defer func() {
		closeAll()
		unix.Close(fds[0])
		unix.Close(fds[1])
	}()

	echoErr := make(chan error, 1)
	if err := goOnThread(cpu, func() {
		buf := make([]byte, size)
		for {
			if err := readFull(fds[1], buf); err != nil {
				echoErr <- err
				return
			}
			if err := writeFull(fds[1], buf); err != nil {
				echoErr <- err
				return
			}
		}
	}); err != nil {
		return r, err
	}

	stop, release, err := onThreadUntil(ctx, d, cpu)
	if err != nil {
		return r, err
	}
	defer release()
	buf := make([]byte, size)
	start := time.Now()
	var n int64
	// At least one round trip, however late this thread runs: a busy
	// machine may not schedule it before d has passed.
	for n == 0 || !stop.Load() {
		if err := writeFull(fds[0], buf); err != nil {
			return r, fmt.Errorf("ping write: %w", err)
		}
		if err := readFull(fds[0], buf); err != nil {
			return r, fmt.Errorf("ping read: %w", err)
		}
		n++
	}
	elapsed := time.Since(start).Seconds()
	closeAll()
	if err := <-echoErr; err != nil && !errors.Is(err, errPeerClosed) {
		return r, fmt.Errorf("echo: %w", err)
	}
	if err := ctx.Err(); err != nil {
		return r, err
	}
	r.RoundTrips = n
	r.LatSeconds = elapsed
	r.LatencyUS = elapsed / float64(2*n) * 1e6
	r.MsgRatePerSec = float64(2*n) / elapsed
	return r, nil
}

// UnixStream writes size-byte messages one way over a socketpair for d and
// returns the bandwidth seen by the reader (which reads size bytes at a
// time, as qperf's tcp_bw receiver does); cpu as in UnixPingPong.
func UnixStream(ctx context.Context, size int, d time.Duration, cpu *int) (UnixResult, error) {
	r := UnixResult{MsgSizeBytes: int64(size)}
	fds, err := socketpair()
	if err != nil {
		return r, err
	}
	defer func() {
		unix.Close(fds[0])
		unix.Close(fds[1])
	}()

	type readRes struct {
		bytes   int64
		seconds float64
		err     error
	}
	done := make(chan readRes, 1)
	if err := goOnThread(cpu, func() {
		buf := make([]byte, size)
		var total int64
		start := time.Now()
		for {
			n, err := unix.Read(fds[1], buf)
			if n > 0 {
				total += int64(n)
			}
			if n == 0 && err == nil { // EOF: writer shut down
				done <- readRes{total, time.Since(start).Seconds(), nil}
				return
			}
			if err != nil && !errors.Is(err, unix.EINTR) {
				done <- readRes{total, time.Since(start).Seconds(), err}
				return
			}
		}
	}); err != nil {
		return r, err
	}

	stop, release, err := onThreadUntil(ctx, d, cpu)
	if err != nil {
		_ = unix.Shutdown(fds[0], unix.SHUT_WR)
		<-done
		return r, err
	}
	defer release()
	buf := make([]byte, size)
	var werr error
	// At least one message, however late this thread runs (see UnixPingPong).
	for first := true; first || !stop.Load(); first = false {
		if werr = writeFull(fds[0], buf); werr != nil {
			break
		}
	}
	_ = unix.Shutdown(fds[0], unix.SHUT_WR)
	rr := <-done
	if werr != nil {
		return r, fmt.Errorf("stream write: %w", werr)
	}
	if rr.err != nil {
		return r, fmt.Errorf("stream read: %w", rr.err)
	}
	if err := ctx.Err(); err != nil {
		return r, err
	}
	if rr.bytes == 0 || rr.seconds <= 0 {
		return r, errors.New("unix stream: no byte transferred")
	}
	r.StreamBytes = rr.bytes
	r.BWSeconds = rr.seconds
	r.BandwidthBytesPerSec = float64(rr.bytes) / rr.seconds
	return r, nil
}

func socketpair() ([2]int, error) {
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return fds, fmt.Errorf("socketpair: %w", err)
	}
	return fds, nil
}

// goOnThread runs one end on a goroutine locked to its own OS thread (on
// cpu, when set); an error means end did not start.
func goOnThread(cpu *int, end func()) error {
	pinned := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		defer runtime.UnlockOSThread()
		unpin, err := pinThread(cpu)
		pinned <- err
		if err != nil {
			return
		}
		defer unpin()
		end()
	}()
	return <-pinned
}

// onThreadUntil locks the calling goroutine (the other end) to its OS thread
// (on cpu, when set) and returns a flag that turns true after d or when ctx
// ends: the hot loops poll it instead of calling time.Now per message.
// release stops the timers and unpins and unlocks the thread.
func onThreadUntil(ctx context.Context, d time.Duration, cpu *int) (*atomic.Bool, func(), error) {
	runtime.LockOSThread()
	unpin, err := pinThread(cpu)
	if err != nil {
		runtime.UnlockOSThread()
		return nil, nil, err
	}
	var f atomic.Bool
	t := time.AfterFunc(d, func() { f.Store(true) })
	unregister := context.AfterFunc(ctx, func() { f.Store(true) })
	return &f, func() { t.Stop(); unregister(); unpin(); runtime.UnlockOSThread() }, nil
}

// pinThread runs the calling (locked) thread on cpu, if set, until unpin
// gives it back the CPUs it had.
func pinThread(cpu *int) (unpin func(), err error) {
	if cpu == nil {
		return func() {}, nil
	}
	var was, on unix.CPUSet
	if err := unix.SchedGetaffinity(0, &was); err != nil {
		return nil, fmt.Errorf("read this thread's CPUs: %w", err)
	}
	on.Set(*cpu)
	if err := unix.SchedSetaffinity(0, &on); err != nil {
		return nil, fmt.Errorf("run on CPU %d: %w (is it in this process's cpuset?)", *cpu, err)
	}
	return func() { _ = unix.SchedSetaffinity(0, &was) }, nil
}

var errPeerClosed = errors.New("peer closed")

func readFull(fd int, buf []byte) error {
	for off := 0; off < len(buf); {
		n, err := unix.Read(fd, buf[off:])
		if err != nil {
			if errors.Is(err, unix.EINTR) {
				continue
			}
			return err
		}
		if n == 0 {
			return errPeerClosed
		}
		off += n
	}
	return nil
}

func writeFull(fd int, buf []byte) error {
	for off := 0; off < len(buf); {
		n, err := unix.Write(fd, buf[off:])
		if err != nil {
			if errors.Is(err, unix.EINTR) {
				continue
			}
			if errors.Is(err, unix.EPIPE) {
				return errPeerClosed
			}
			return err
		}
		off += n
	}
	return nil
}
