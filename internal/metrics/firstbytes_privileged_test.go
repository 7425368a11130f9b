// SPDX-License-Identifier: Apache-2.0

package metrics

import (
	"fmt"
	"io"
	"net"
	"strconv"
	"testing"

	dto "github.com/prometheus/client_model/go"

	"github.com/meshwarp/meshwarp/internal/accel"
	"github.com/meshwarp/meshwarp/internal/testutil"
	"github.com/meshwarp/meshwarp/internal/testutil/agenttest"
)

// HTTP/1.x is recognized from a connection's first bytes: a connection that
// opens with another protocol's bytes (here a TLS record header) is not
// parsed afterwards, so payload that happens to look like a request line is
// not counted as requests, and its bytes are still counted exactly. One that
// opens with a token and a space or CR LF (a PROXY protocol header, v1 or
// v2) is parsed on.
// Accelerated (sk_msg) and on TCP (cgroup_skb).
func TestPrivilegedHTTPRecognizedFromTheFirstBytes(t *testing.T) {
	testutil.RequirePrivileged(t)
	const exchanges = 5
	request := []byte("GET /x HTTP/1.1\r\nHost: a\r\n\r\n")
	response := []byte("HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
	cases := []struct {
		name     string
		first    []byte // the client's first write, before the exchanges
		second   []byte // its second write (nil: none)
		reply    []byte // the server's answer to them (nil: none)
		wantHTTP int
	}{
		{"tls-record-first", []byte("\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03\x5a\x5b\x5c\x5d\x5e"), nil, []byte("\x16\x03\x03\x00\x5a\x02\x00\x00\x56\x03\x03\x01\x02\x03\x04\x05"), 0},
		{"proxy-line-first", []byte("PROXY TCP4 10.0.0.1 10.0.0.2 40000 80\r\n"), nil, nil, exchanges},
		// PROXY v2: the signature, version 2 PROXY over TCP4, 12 bytes of addresses and ports.
		{"proxy-v2-first", []byte("\r\n\r\n\x00\r\nQUIT\n\x21\x11\x00\x0c\x0a\x00\x00\x01\x0a\x00\x00\x02\x9c\x40\x00\x50"), nil, nil, exchanges},
		// A request whose binary body is a write of its own: only the stream's first bytes decide.
		{"binary-body-second", []byte("POST /u HTTP/1.1\r\nHost: a\r\nContent-Length: 16\r\n\r\n"), []byte("\x00\x01\x02\x03\x04\x05\x06\x07\x08\x09\x0a\x0b\x0c\x0d\x0e\x0f"), response, exchanges + 1},
	}
	for _, accelerate := range []bool{true, false} {
		for _, tc := range cases {
			t.Run(fmt.Sprintf("accelerate=%v/%s", accelerate, tc.name), func(t *testing.T) {
				cgroup := testutil.EnterCgroup(t)
				a := agenttest.Start(t, accel.Config{CgroupPath: cgroup, Observe: true, ObserveOnly: !accelerate})
				ln, err := net.Listen("tcp4", "127.0.0.1:0")
				if err != nil {
					t.Fatal(err)
				}
				defer ln.Close()
				done := make(chan error, 1)
				go func() {
					c, err := ln.Accept()
					if err != nil {
						done <- err
						return
					}
					defer c.Close()
					if _, err := io.ReadFull(c, make([]byte, len(tc.first)+len(tc.second))); err != nil {
						done <- err
						return
					}
					if tc.reply != nil {
						if _, err := c.Write(tc.reply); err != nil {
							done <- err
							return
						}
					}
					for range exchanges {
						if _, err := io.ReadFull(c, make([]byte, len(request))); err != nil {
							done <- err
							return
						}
						if _, err := c.Write(response); err != nil {
							done <- err
							return
						}
					}
					_, err = io.Copy(io.Discard, c) // until the client's FIN
					done <- err
				}()
				c, err := net.Dial("tcp4", ln.Addr().String())
				if err != nil {
					t.Fatal(err)
				}
				for _, w := range [][]byte{tc.first, tc.second} {
					if len(w) == 0 {
						continue
					}
					if _, err := c.Write(w); err != nil {
						t.Fatal(err)
					}
				}
				if _, err := io.ReadFull(c, make([]byte, len(tc.reply))); err != nil {
					t.Fatal(err)
				}
				for range exchanges {
					if _, err := c.Write(request); err != nil {
						t.Fatal(err)
					}
					if _, err := io.ReadFull(c, make([]byte, len(response))); err != nil {
						t.Fatal(err)
					}
				}
				c.Close()
				if err := <-done; err != nil {
					t.Fatal(err)
				}

				url := metricsURL(t, a)
				port := strconv.Itoa(ln.Addr().(*net.TCPAddr).Port)
				wantBytes := float64(len(tc.first) + len(tc.second) + len(tc.reply) + exchanges*(len(request)+len(response)))
				eventually(t, url, func(fams map[string]*dto.MetricFamily) []error {
					errs := tcpBytesErrors(fams, port, accelerate, wantBytes)
					for _, side := range []string{"http_server_request_duration_seconds", "http_client_request_duration_seconds"} {
						if n := histCount(fams[side], map[string]string{"server_port": port}); n != uint64(tc.wantHTTP) {
							errs = append(errs, fmt.Errorf("%s: %d requests, want %d", side, n, tc.wantHTTP))
						}
					}
					return errs
				})
			})
		}
	}
}
