// SPDX-License-Identifier: Apache-2.0

package lab

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"sync"
	"syscall"
	"time"
)

// ClientOptions is what `meshwarp lab pod client` sends from a client pod.
type ClientOptions struct {
	Server   string        // the server pod's address (IP or name)
	Requests int           // HTTP echo requests (keep-alive, one connection) to :HTTPPort
	Echoes   int           // TCP echo round trips on one connection to :TCPEchoPort
	Streams  int           // concurrent streaming connections to :TCPEchoPort
	Duration time.Duration // how long each stream writes
	Size     int           // bytes per write
}

// ClientResult says what came back, byte for byte.
type ClientResult struct {
	Requests       int      `json:"requests"`
	RequestsOK     int      `json:"requests_ok"`
	Echoes         int      `json:"echoes"`
	EchoesOK       int      `json:"echoes_ok"`
	Streams        int      `json:"streams"`
	StreamsOK      int      `json:"streams_ok"`
	StreamBytes    uint64   `json:"stream_bytes_sent"`
	StreamBytesBck uint64   `json:"stream_bytes_received"`
	Mismatches     int      `json:"mismatches"`
	Resets         int      `json:"resets"`
	Errors         []string `json:"errors,omitempty"`
}

// pattern fills b with bytes that depend on the stream and the offset, so a
// byte from another stream or another place in this one does not match.
func pattern(b []byte, stream int, off uint64) {
	for i := range b {
		b[i] = byte(uint64(stream)*131 + (off+uint64(i))*7 + (off+uint64(i))>>8)
	}
}

// RunClient sends the requests, echoes and streams of o and checks every byte.
func RunClient(ctx context.Context, o ClientOptions) ClientResult {
	var (
		mu  sync.Mutex
		res ClientResult
	)
	fail := func(err error) {
		mu.Lock()
		defer mu.Unlock()
		if errors.Is(err, syscall.ECONNRESET) {
			res.Resets++
		}
		if len(res.Errors) < 20 {
			res.Errors = append(res.Errors, err.Error())
		}
	}
	res.Requests, res.Echoes, res.Streams = o.Requests, o.Echoes, o.Streams
	if o.Size <= 0 {
		o.Size = 1024
	}
	var wg sync.WaitGroup
	for s := range o.Streams {
		wg.Add(1)
		go func() {
			defer wg.Done()
			sent, got, err := stream(ctx, net.JoinHostPort(o.Server, fmt.Sprint(TCPEchoPort)), s, o.Size, o.Duration)
			mu.Lock()
			res.StreamBytes += sent
			res.StreamBytesBck += got
			if err == nil {
				res.StreamsOK++
			} else if errors.Is(err, errMismatch) {
				res.Mismatches++
			}
			mu.Unlock()
			if err != nil {
				fail(fmt.Errorf("stream %d: %w", s, err))
			}
		}()
	}
	if o.Echoes > 0 {
		n, err := echoes(ctx, net.JoinHostPort(o.Server, fmt.Sprint(TCPEchoPort)), o.Echoes, o.Size)
		res.EchoesOK = n
		if err != nil {
			fail(fmt.Errorf("tcp echo: %w", err))
		}
	}
	if o.Requests > 0 {
		n, err := requests(ctx, fmt.Sprintf("http://%s/echo", net.JoinHostPort(o.Server, fmt.Sprint(HTTPPort))), o.Requests, o.Size)
		res.RequestsOK = n
		if err != nil {
			fail(fmt.Errorf("http echo: %w", err))
		}
	}
	wg.Wait()
	return res
}

var errMismatch = errors.New("echoed bytes differ from the bytes sent")

func dial(ctx context.Context, addr string) (net.Conn, error) {
	var d net.Dialer
	dctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	return d.DialContext(dctx, "tcp4", addr)
}

// stream writes and reads back in lockstep of one write for d, then half-closes
// and expects EOF after the last echoed byte.
func stream(ctx context.Context, addr string, id, size int, d time.Duration) (sent, got uint64, err error) {
	c, err := dial(ctx, addr)
	if err != nil {
		return 0, 0, err
	}
	defer c.Close()
	out, in, want := make([]byte, size), make([]byte, size), make([]byte, size)
	end := time.Now().Add(d)
	for time.Now().Before(end) && ctx.Err() == nil {
		pattern(out, id, sent)
		_ = c.SetDeadline(time.Now().Add(30 * time.Second))
		if _, err := c.Write(out); err != nil {
			return sent, got, fmt.Errorf("write: %w", err)
		}
		sent += uint64(size)
		if _, err := io.ReadFull(c, in); err != nil {
			return sent, got, fmt.Errorf("read after %d bytes: %w", got, err)
		}
		pattern(want, id, got)
		got += uint64(size)
		if !bytes.Equal(in, want) {
			return sent, got, fmt.Errorf("at byte %d: %w", got-uint64(size), errMismatch)
		}
		time.Sleep(5 * time.Millisecond)
	}
	if err := c.(*net.TCPConn).CloseWrite(); err != nil {
		return sent, got, fmt.Errorf("shutdown: %w", err)
	}
	rest, err := io.ReadAll(c)
	if err != nil {
		return sent, got, fmt.Errorf("read to EOF: %w", err)
	}
	if len(rest) > 0 {
		return sent, got, fmt.Errorf("%d bytes after the last echo: %w", len(rest), errMismatch)
	}
	return sent, got, nil
}

func echoes(ctx context.Context, addr string, n, size int) (int, error) {
	c, err := dial(ctx, addr)
	if err != nil {
		return 0, err
	}
	defer c.Close()
	out, in := make([]byte, size), make([]byte, size)
	for i := range n {
		pattern(out, -1-i, uint64(i))
		_ = c.SetDeadline(time.Now().Add(30 * time.Second))
		if _, err := c.Write(out); err != nil {
			return i, err
		}
		if _, err := io.ReadFull(c, in); err != nil {
			return i, err
		}
		if !bytes.Equal(in, out) {
			return i, errMismatch
		}
	}
	return n, nil
}

// requests POSTs n bodies to fortio's echo handler on one keep-alive connection.
func requests(ctx context.Context, url string, n, size int) (int, error) {
	hc := &http.Client{Timeout: 30 * time.Second, Transport: &http.Transport{MaxIdleConnsPerHost: 1, DisableCompression: true}}
	defer hc.CloseIdleConnections()
	body := make([]byte, size)
	for i := range n {
		pattern(body, 1000+i, 0)
		req, err := http.NewRequestWithContext(ctx, http.MethodPost, url, bytes.NewReader(body))
		if err != nil {
			return i, err
		}
		resp, err := hc.Do(req)
		if err != nil {
			return i, err
		}
		got, err := io.ReadAll(resp.Body)
		resp.Body.Close()
		if err != nil {
			return i, err
		}
		if resp.StatusCode != http.StatusOK || !bytes.Equal(got, body) {
			return i, fmt.Errorf("request %d: status %d, %d bytes: %w", i, resp.StatusCode, len(got), errMismatch)
		}
	}
	return n, nil
}
