// SPDX-License-Identifier: Apache-2.0

package testutil

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"sync"
	"sync/atomic"
	"time"
)

// EchoServer echoes every byte back on each accepted connection and
// half-closes after the client's EOF.
type EchoServer struct {
	ln       net.Listener
	wg       sync.WaitGroup
	Accepted atomic.Int64
	Resets   atomic.Int64 // connections that ended in an error rather than EOF
}

// ServeEcho starts echoing on ln until Close.
func ServeEcho(ln net.Listener) *EchoServer {
	s := &EchoServer{ln: ln}
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			s.Accepted.Add(1)
			s.wg.Add(1)
			go func() {
				defer s.wg.Done()
				defer c.Close()
				if _, err := copyNoSplice(c, c); err != nil {
					s.Resets.Add(1)
					return
				}
				if tc, ok := c.(*net.TCPConn); ok {
					tc.CloseWrite()
				}
			}()
		}
	}()
	return s
}

// Addr is the listening address.
func (s *EchoServer) Addr() net.Addr { return s.ln.Addr() }

// Close stops accepting and waits for open connections to finish.
func (s *EchoServer) Close() {
	s.ln.Close()
	s.wg.Wait()
}

// IntegrityOptions shapes the load of CheckIntegrity.
type IntegrityOptions struct {
	Conns       int           // concurrent connections
	Messages    int           // writes per connection
	MaxSize     int           // each write is 1..MaxSize bytes
	Seed        uint64        // payloads are reproducible
	Timeout     time.Duration // per connection; a hang is a failure
	BetweenMsgs func(conn, msg int)
}

// IntegrityResult summarises CheckIntegrity.
type IntegrityResult struct {
	Conns      int
	BytesSent  int64
	BytesEcho  int64
	Mismatches int     // connections whose echo differed from what was sent
	Errors     []error // dial/read/write errors, resets, timeouts
}

// Err is nil when every byte came back intact on every connection.
func (r IntegrityResult) Err() error {
	if r.Mismatches == 0 && len(r.Errors) == 0 && r.BytesSent == r.BytesEcho {
		return nil
	}
	errs := r.Errors
	if len(errs) > 5 {
		errs = append(errs[:5:5], fmt.Errorf("... and %d more errors", len(r.Errors)-5))
	}
	return fmt.Errorf("integrity: %d/%d connections corrupted, %d errors, sent %d bytes, echoed %d: %w",
		r.Mismatches, r.Conns, len(r.Errors), r.BytesSent, r.BytesEcho, errors.Join(errs...))
}

// CheckIntegrity opens opts.Conns connections with dial at once, writes
// random payloads of random sizes on each while reading the echo
// concurrently, half-closes, and compares every echoed byte.
func CheckIntegrity(dial func() (net.Conn, error), opts IntegrityOptions) IntegrityResult {
	if opts.Timeout == 0 {
		opts.Timeout = 2 * time.Minute
	}
	res := IntegrityResult{Conns: opts.Conns}
	var mu sync.Mutex
	var wg sync.WaitGroup
	for i := 0; i < opts.Conns; i++ {
		wg.Add(1)
		go func(i int) {
			defer wg.Done()
			sent, echoed, same, err := oneConn(dial, opts, i)
			mu.Lock()
			defer mu.Unlock()
			res.BytesSent += sent
			res.BytesEcho += echoed
			if err != nil {
				res.Errors = append(res.Errors, fmt.Errorf("conn %d: %w", i, err))
			} else if !same {
				res.Mismatches++
			}
		}(i)
	}
	wg.Wait()
	return res
}

func oneConn(dial func() (net.Conn, error), opts IntegrityOptions, idx int) (sent, echoed int64, same bool, err error) {
	c, err := dial()
	if err != nil {
		return 0, 0, false, fmt.Errorf("dial: %w", err)
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(opts.Timeout))
	rng := rand.New(rand.NewPCG(opts.Seed, uint64(idx)))
	var payload bytes.Buffer
	for m := 0; m < opts.Messages; m++ {
		n := 1 + rng.IntN(opts.MaxSize)
		b := make([]byte, n)
		for j := range b {
			b[j] = byte(rng.Uint32())
		}
		payload.Write(b)
	}
	want := payload.Bytes()

	readDone := make(chan error, 1)
	var got bytes.Buffer
	go func() {
		_, err := io.Copy(&got, c)
		readDone <- err
	}()
	// Write message by message so each write is one sendmsg (one sk_msg run).
	rng2 := rand.New(rand.NewPCG(opts.Seed, uint64(idx)))
	off := 0
	var werr error
	for m := 0; m < opts.Messages && werr == nil; m++ {
		n := 1 + rng2.IntN(opts.MaxSize)
		for j := 0; j < n; j++ {
			rng2.Uint32()
		}
		_, werr = c.Write(want[off : off+n])
		off += n
		sent += int64(n)
		if opts.BetweenMsgs != nil {
			opts.BetweenMsgs(idx, m)
		}
	}
	if werr == nil {
		werr = c.(interface{ CloseWrite() error }).CloseWrite()
	}
	rerr := <-readDone
	echoed = int64(got.Len())
	if werr != nil {
		return sent, echoed, false, fmt.Errorf("write: %w", werr)
	}
	if rerr != nil {
		return sent, echoed, false, fmt.Errorf("read: %w", rerr)
	}
	return sent, echoed, bytes.Equal(got.Bytes(), want), nil
}

// copyNoSplice copies through a user-space buffer (io.Copy between TCP
// connections would use splice(2)).
func copyNoSplice(dst io.Writer, src io.Reader) (int64, error) {
	return io.CopyBuffer(struct{ io.Writer }{dst}, struct{ io.Reader }{src}, make([]byte, 64<<10))
}
