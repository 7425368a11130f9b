// SPDX-License-Identifier: Apache-2.0

package tap

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"io"
	"net"
	"path/filepath"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"

	"github.com/meshwarp/meshwarp/internal/accel"
	"github.com/meshwarp/meshwarp/internal/testutil"
	"github.com/meshwarp/meshwarp/internal/testutil/agenttest"
)

// An agent's settings hold through a tap: the tap's program runs with the
// agent's constants, and afterwards the agent's own program (the same
// program ID) is back in the link. Shown by behaviour: a stream of small
// one-way messages is left to TCP (small_stream) under the defaults and
// stays redirected with KeepSmallStreams, before, during and after the tap.
// A second tap while one runs is refused and changes nothing.
func TestPrivilegedTapKeepsAgentSettings(t *testing.T) {
	testutil.RequirePrivileged(t)
	for _, tc := range []struct {
		name        string
		cfg         accel.Config
		smallStream bool // the stream goes to TCP as small_stream
		want        map[string]uint64
	}{
		{"defaults", accel.Config{}, true, map[string]uint64{
			"stream_run_msgs":           accel.SmallStreamRun,
			"redirect_budget_bytes":     accel.DefaultRedirectBudget,
			"redirect_budget_max_bytes": accel.DefaultRedirectBudget * accel.RedirectBudgetGrowth,
			"sidecar_uid":               accel.DefaultSidecarUID,
			"observe":                   0,
		}},
		{"non-default", accel.Config{
			KeepSmallStreams: true,
			RedirectBudget:   3 << 20,
			SidecarUID:       4242,
			OutboundPort:     16001,
			InboundPort:      16006,
			UnpairedTimeout:  25 * time.Millisecond,
			Observe:          true,
		}, false, map[string]uint64{
			"stream_run_msgs":           0,
			"redirect_budget_bytes":     3 << 20,
			"redirect_budget_max_bytes": (3 << 20) * accel.RedirectBudgetGrowth,
			"sidecar_uid":               4242,
			"outbound_capture_port":     16001,
			"inbound_capture_port":      16006,
			"unpaired_timeout_ns":       uint64(25 * time.Millisecond),
			"observe":                   1,
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			pinDir := testutil.PinDir(t)
			cfg := tc.cfg
			cfg.PinDir = pinDir
			a := agenttest.Start(t, cfg)
			ln, err := net.Listen("tcp4", "127.0.0.1:0")
			if err != nil {
				t.Fatal(err)
			}
			defer ln.Close()

			agentID, agentConsts := linkState(t, pinDir)
			checkConstants(t, "the agent's program", agentConsts, tc.want)
			checkSmallStream(t, a, ln, "before the tap", tc.smallStream)

			stop := startTap(t, Options{PinDir: pinDir, Port: uint16(ln.Addr().(*net.TCPAddr).Port), Snaplen: DefaultSnaplen, Out: io.Discard})
			tapID, tapConsts := linkState(t, pinDir)
			if tapID == agentID {
				t.Fatalf("the tap runs the agent's program %d", agentID)
			}
			for name, v := range agentConsts {
				if !bytes.Equal(tapConsts[name], v) {
					t.Errorf("the tap's program has %s = %x, the agent's %x", name, tapConsts[name], v)
				}
			}
			checkSmallStream(t, a, ln, "during the tap", tc.smallStream)
			// One tap at a time: a second would take the first's program for the agent's.
			if _, err := Run(context.Background(), Options{PinDir: pinDir, Snaplen: DefaultSnaplen, Out: io.Discard}); !errors.Is(err, ErrBusy) {
				t.Fatalf("a second tap: %v, want %v", err, ErrBusy)
			}
			if id, _ := linkState(t, pinDir); id != tapID {
				t.Fatalf("a refused second tap changed the link's program from %d to %d", tapID, id)
			}
			stop()

			if id, _ := linkState(t, pinDir); id != agentID {
				t.Fatalf("after the tap the link runs program %d, want the agent's %d", id, agentID)
			}
			checkSmallStream(t, a, ln, "after the tap", tc.smallStream)
		})
	}
}

// linkState returns the ID and the constants of the program the agent's
// sk_msg link runs.
func linkState(t *testing.T, pinDir string) (ebpf.ProgramID, map[string][]byte) {
	t.Helper()
	l, err := link.LoadPinnedLink(filepath.Join(pinDir, accel.SkmsgLinkPin), nil)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	p, err := linkedProgram(l)
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	info, err := p.Info()
	if err != nil {
		t.Fatal(err)
	}
	id, ok := info.ID()
	if !ok {
		t.Fatal("the kernel does not give program IDs")
	}
	consts, err := loadedConstants(p)
	if err != nil {
		t.Fatal(err)
	}
	return id, consts
}

// checkConstants compares the unsigned integer constants named in want.
func checkConstants(t *testing.T, what string, consts map[string][]byte, want map[string]uint64) {
	t.Helper()
	for name, w := range want {
		var got uint64
		switch b := consts[name]; len(b) {
		case 4:
			got = uint64(binary.NativeEndian.Uint32(b))
		case 8:
			got = binary.NativeEndian.Uint64(b)
		default:
			t.Fatalf("%s: %s is %d bytes", what, name, len(b))
		}
		if got != w {
			t.Errorf("%s: %s = %d, want %d", what, name, got, w)
		}
	}
}

// checkSmallStream sends a stream of small messages one way over a new
// paired connection to ln and checks whether the agent left it to TCP as a
// small stream.
func checkSmallStream(t *testing.T, a *accel.Agent, ln net.Listener, when string, wantTCP bool) {
	t.Helper()
	before, err := a.Stats()
	if err != nil {
		t.Fatal(err)
	}
	client, err := net.Dial("tcp4", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer client.Close()
	server, err := ln.Accept()
	if err != nil {
		t.Fatal(err)
	}
	defer server.Close()
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(time.Millisecond) {
		s, err := a.Stats()
		if err != nil {
			t.Fatal(err)
		}
		if s.Sub(before).PairedSockets == 2 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: the connection was not paired: %+v", when, s.Sub(before))
		}
	}
	// Four times the run the defaults allow, each message read before the next is sent.
	msg, got := bytes.Repeat([]byte("s"), 100), make([]byte, 100)
	for range 4 * accel.SmallStreamRun {
		if _, err := client.Write(msg); err != nil {
			t.Fatal(err)
		}
		if _, err := io.ReadFull(server, got); err != nil {
			t.Fatal(err)
		}
	}
	after, err := a.Stats()
	if err != nil {
		t.Fatal(err)
	}
	d := after.Sub(before)
	if onTCP := d.PassthroughConnections["small_stream"] > 0; onTCP != wantTCP {
		t.Fatalf("%s: the small stream went to TCP: %v, want %v (passthrough connections %v, messages %v, redirected %d)",
			when, onTCP, wantTCP, d.PassthroughConnections, d.PassthroughByReason, d.RedirectedMessages)
	}
	if !wantTCP && d.PassthroughMessages != 0 {
		t.Fatalf("%s: %d messages through TCP (%v), want all redirected", when, d.PassthroughMessages, d.PassthroughByReason)
	}
}
