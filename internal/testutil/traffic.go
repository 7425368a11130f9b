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
	"testing"
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

// ServeConns runs handle on each connection ln accepts, each in a goroutine
// of its own and closed when handle returns, until ln is closed (on the
// test's cleanup).
func ServeConns(t testing.TB, ln net.Listener, handle func(c net.Conn)) {
	t.Cleanup(func() { ln.Close() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				handle(c)
			}()
		}
	}()
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
	Conns    int           // concurrent connections
	Messages int           // writes per connection (the minimum when Stop is set)
	MaxSize  int           // each write is 1..MaxSize bytes
	Seed     uint64        // payloads are reproducible
	Timeout  time.Duration // how long a connection may make no progress: a hang is a failure
	// Stop, when set, keeps every connection writing until it is closed
	// (streams under load while something else happens).
	Stop <-chan struct{}
	// Started, when set, receives one value per connection once it has
	// written its first message (a condition to wait for, not a sleep).
	Started chan<- struct{}
}

// StopStreams returns a channel for IntegrityOptions.Stop and a function
// that closes it, once however often it is called. Defer the function after
// the echo server's Close (so that it runs first): a test that fails midway
// must stop its streams, or Close waits on them until the binary's timeout.
func StopStreams() (<-chan struct{}, func()) {
	ch := make(chan struct{})
	var once sync.Once
	return ch, func() { once.Do(func() { close(ch) }) }
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
			}
			if !same {
				res.Mismatches++
			}
		}(i)
	}
	wg.Wait()
	return res
}

// payloadGen produces a connection's byte stream: message sizes and bytes
// from one seeded generator, so the reader can regenerate what it expects.
type payloadGen struct {
	rng     *rand.Rand
	maxSize int
}

func newPayloadGen(seed uint64, idx, maxSize int) *payloadGen {
	return &payloadGen{rng: rand.New(rand.NewPCG(seed, uint64(idx))), maxSize: maxSize}
}

func (g *payloadGen) next() []byte {
	b := make([]byte, 1+g.rng.IntN(g.maxSize))
	for j := range b {
		b[j] = byte(g.rng.Uint32())
	}
	return b
}

func oneConn(dial func() (net.Conn, error), opts IntegrityOptions, idx int) (sent, echoed int64, same bool, err error) {
	c, err := dial()
	if err != nil {
		return 0, 0, true, fmt.Errorf("dial: %w", err)
	}
	defer c.Close()

	type readResult struct {
		n    int64
		same bool
		err  error
	}
	readDone := make(chan readResult, 1)
	go func() {
		// Compare as bytes arrive against the regenerated stream.
		want := newPayloadGen(opts.Seed, idx, opts.MaxSize)
		var pending []byte
		buf := make([]byte, 64<<10)
		var r readResult
		r.same = true
		for {
			c.SetReadDeadline(time.Now().Add(opts.Timeout))
			n, err := c.Read(buf)
			got := buf[:n]
			r.n += int64(n)
			for len(got) > 0 && r.same {
				if len(pending) == 0 {
					pending = want.next()
				}
				k := min(len(got), len(pending))
				if !bytes.Equal(got[:k], pending[:k]) {
					r.same = false
				}
				got, pending = got[k:], pending[k:]
			}
			if err == io.EOF {
				break
			}
			if err != nil {
				r.err = err
				break
			}
		}
		readDone <- r
	}()

	// Write message by message so each write is one sendmsg (one sk_msg run).
	gen := newPayloadGen(opts.Seed, idx, opts.MaxSize)
	var werr error
	finished := func(m int) bool {
		if m < opts.Messages {
			return false
		}
		if opts.Stop == nil {
			return true
		}
		select {
		case <-opts.Stop:
			return true
		default:
			return false
		}
	}
	for m := 0; werr == nil && !finished(m); m++ {
		b := gen.next()
		c.SetWriteDeadline(time.Now().Add(opts.Timeout))
		var n int
		n, werr = c.Write(b)
		sent += int64(n)
		if m == 0 && opts.Started != nil {
			opts.Started <- struct{}{}
		}
	}
	if werr == nil {
		werr = c.(interface{ CloseWrite() error }).CloseWrite()
	}
	r := <-readDone
	// On an error, say also whether what did come back was right: a stall
	// that lost or changed bytes is a different bug from one that did not.
	echo := func() string {
		state := "intact"
		if !r.same {
			state = "CORRUPTED"
		}
		return fmt.Sprintf("wrote %d bytes, %d echoed, echo so far %s", sent, r.n, state)
	}
	if werr != nil {
		return sent, r.n, r.same, fmt.Errorf("write: %w (%s)", werr, echo())
	}
	if r.err != nil {
		return sent, r.n, r.same, fmt.Errorf("read: %w (%s)", r.err, echo())
	}
	return sent, r.n, r.same && r.n == sent, nil
}

// copyNoSplice copies through a user-space buffer (io.Copy between TCP
// connections would use splice(2)).
func copyNoSplice(dst io.Writer, src io.Reader) (int64, error) {
	return io.CopyBuffer(struct{ io.Writer }{dst}, struct{ io.Reader }{src}, make([]byte, 64<<10))
}
