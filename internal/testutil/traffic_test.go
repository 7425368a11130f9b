// SPDX-License-Identifier: Apache-2.0

package testutil

import (
	"io"
	"net"
	"strings"
	"testing"
	"time"
)

// badEcho serves each connection with serve, on loopback, and keeps it
// open (without echoing more) until the test ends: a stalled peer.
func badEcho(t *testing.T, serve func(c net.Conn)) func() (net.Conn, error) {
	t.Helper()
	done := make(chan struct{})
	t.Cleanup(func() { close(done) })
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ServeConns(t, ln, func(c net.Conn) {
		serve(c)
		io.Copy(io.Discard, c)
		<-done
	})
	return func() (net.Conn, error) { return net.Dial("tcp", ln.Addr().String()) }
}

// TestCheckIntegrityTellsStallFromLoss: a connection that stops making
// progress is reported with how much came back and whether it was right,
// so that a stall is not mistaken for a loss or the other way round.
func TestCheckIntegrityTellsStallFromLoss(t *testing.T) {
	opts := IntegrityOptions{Conns: 1, Messages: 4, MaxSize: 64, Seed: 1, Timeout: 2 * time.Second} // the stall detector: generous for a loaded machine

	t.Run("intact-then-stall", func(t *testing.T) {
		// Echo the first bytes faithfully, then read without echoing.
		dial := badEcho(t, func(c net.Conn) {
			buf := make([]byte, 10)
			n, _ := c.Read(buf)
			c.Write(buf[:n])
		})
		res := CheckIntegrity(dial, opts)
		if res.Mismatches != 0 || len(res.Errors) != 1 {
			t.Fatalf("want one error and no mismatch, got %+v", res)
		}
		if msg := res.Errors[0].Error(); !strings.Contains(msg, "echo so far intact") || !strings.Contains(msg, "read:") {
			t.Fatalf("error does not say the echo so far was intact: %v", msg)
		}
		if res.Err() == nil {
			t.Fatal("Err() is nil for a stalled connection")
		}
	})

	t.Run("corrupted-then-stall", func(t *testing.T) {
		dial := badEcho(t, func(c net.Conn) {
			buf := make([]byte, 10)
			n, _ := c.Read(buf)
			for i := range buf[:n] {
				buf[i] ^= 0xff
			}
			c.Write(buf[:n])
		})
		res := CheckIntegrity(dial, opts)
		if res.Mismatches != 1 || len(res.Errors) != 1 {
			t.Fatalf("want one error and one mismatch, got %+v", res)
		}
		if msg := res.Errors[0].Error(); !strings.Contains(msg, "CORRUPTED") {
			t.Fatalf("error does not say the echo was corrupted: %v", msg)
		}
	})

	t.Run("faithful", func(t *testing.T) {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		srv := ServeEcho(ln)
		defer srv.Close()
		res := CheckIntegrity(func() (net.Conn, error) { return net.Dial("tcp", ln.Addr().String()) }, opts)
		if err := res.Err(); err != nil {
			t.Fatal(err)
		}
	})
}
