// SPDX-License-Identifier: Apache-2.0

// Package tap makes redirected traffic visible again: while it runs, the
// agent's sk_msg link runs a variant of its program that also copies each
// redirected message to a ring buffer, and the messages are written as
// pcapng with synthesised Ethernet/IP/TCP headers carrying the connection's
// real addresses, ports and sequence numbers, so tcpdump, tshark and
// Wireshark read them like a capture.
package tap

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"time"

	"github.com/cilium/ebpf/link"
	"github.com/cilium/ebpf/ringbuf"
	"golang.org/x/sys/unix"

	"github.com/meshwarp/meshwarp/internal/accel"
	"github.com/meshwarp/meshwarp/internal/netns"
	"github.com/meshwarp/meshwarp/internal/probe"
)

// Options say what to tap and where to write.
type Options struct {
	PinDir   string        // the agent's pin directory ("" = accel.DefaultPinDir)
	Port     uint16        // 0: every port; else connections with this port at either end
	Netns    string        // "": every namespace; else a network namespace file (/run/netns/NAME)
	Count    int           // stop after this many messages (0: no limit)
	Duration time.Duration // stop after this long (0: until ctx ends)
	Snaplen  int           // payload bytes kept per message
	Out      io.Writer     // pcapng goes here
	// Progress, if set, receives a line every few seconds and a summary.
	Progress io.Writer
}

// DefaultSnaplen keeps whole messages up to 64 KiB.
const DefaultSnaplen = 65536

// Result counts what the tap saw. Drops are never silent.
type Result struct {
	Messages uint64 `json:"messages"`          // redirected messages written
	Packets  uint64 `json:"packets"`           // pcapng packets (handshakes and segments)
	RingFull uint64 `json:"dropped_ring_full"` // messages lost: the reader fell behind
	Cut      uint64 `json:"cut_by_snaplen"`    // messages written shorter than they were
}

var (
	// ErrNoAgent: nothing to tap.
	ErrNoAgent = errors.New("no meshwarp agent is attached")
	// ErrBadOptions: the options cannot work; nothing was attached.
	ErrBadOptions = errors.New("bad tap options")
	// ErrBusy: another tap holds the agent's link; nothing was attached.
	ErrBusy = errors.New("another tap is running")
	// ErrUnsupported: this kernel cannot tap (probe.FeatureTap is off).
	ErrUnsupported = errors.New("not supported by this kernel")
)

// Run taps until ctx ends, Count messages were seen or Duration passed.
// While it runs, the tap's program runs with the settings the agent's
// program was loaded with (read from the kernel); on return (also on error)
// the agent's own program, the one that was in the link, is back in it.
func Run(ctx context.Context, o Options) (res Result, err error) {
	if o.PinDir == "" {
		o.PinDir = accel.DefaultPinDir
	}
	if o.Snaplen <= 0 || o.Snaplen > DefaultSnaplen {
		return res, fmt.Errorf("%w: --snaplen %d: give 1..%d bytes", ErrBadOptions, o.Snaplen, DefaultSnaplen)
	}
	if o.Count < 0 || o.Duration < 0 {
		return res, fmt.Errorf("%w: --count and --duration must not be negative", ErrBadOptions)
	}
	linkPin := filepath.Join(o.PinDir, accel.SkmsgLinkPin)
	if lerr := probe.HaveSockmapLink(); lerr != nil {
		// The agent attached its sk_msg program to the map itself; the tap
		// could only replace it there without a way to hand it back atomically.
		return res, fmt.Errorf("%w: %s is off on this kernel: it swaps its program into the agent's sk_msg link, "+
			"and sockmap links came in Linux 6.10 (%v)", ErrUnsupported, probe.FeatureTap, lerr)
	}
	if _, err := os.Stat(linkPin); err != nil {
		return res, fmt.Errorf("%w at %s (%v): start `meshwarp run`, or pass its --pin-dir", ErrNoAgent, o.PinDir, err)
	}
	var netnsCookie uint64
	if o.Netns != "" {
		if netnsCookie, err = netns.Cookie(o.Netns); err != nil {
			return res, err
		}
	}

	l, err := link.LoadPinnedLink(linkPin, nil)
	if err != nil {
		return res, fmt.Errorf("open the agent's sk_msg link %s: %w", linkPin, err)
	}
	defer l.Close()
	raw, ok := l.(*link.RawLink)
	if !ok {
		return res, fmt.Errorf("the agent's sk_msg link %s is a %T, not a sockmap link (same meshwarp build?)", linkPin, l)
	}
	// The agent's program: its constants are the tap's, and it goes back
	// into the link when the tap ends (this very program, not a copy).
	agentProg, err := linkedProgram(l)
	if err != nil {
		return res, fmt.Errorf("find the agent's sk_msg program in %s: %w", linkPin, err)
	}
	defer agentProg.Close()
	if info, err := agentProg.Info(); err != nil {
		return res, fmt.Errorf("read the agent's sk_msg program: %w", err)
	} else if info.Name == accel.TapProgram {
		return res, fmt.Errorf("%w: the agent's sk_msg link %s runs %s; wait for that tap to end "+
			"(if it was killed, restart `meshwarp run`, which puts the agent's program back)", ErrBusy, linkPin, accel.TapProgram)
	}
	agentConsts, err := loadedConstants(agentProg)
	if err != nil {
		return res, fmt.Errorf("read the agent's settings from its sk_msg program: %w", err)
	}

	// The tap's program from the agent's object (bpf/accel/tap.h), with
	// the agent's constants and the tap's own.
	tp, err := accel.LoadTap(o.PinDir, agentConsts, accel.TapSettings{
		Snaplen: uint32(o.Snaplen), Port: uint32(o.Port), Netns: netnsCookie,
	})
	if err != nil {
		return res, err
	}
	defer tp.Close()

	rd, err := ringbuf.NewReader(tp.Ring)
	if err != nil {
		return res, fmt.Errorf("open the tap ring: %w", err)
	}
	defer rd.Close()
	w, err := newPcapWriter(o.Out, o.Snaplen)
	if err != nil {
		return res, err
	}

	// Both swaps name the program they replace, so neither undoes a change
	// made meanwhile by someone else (an agent restarting, another tap).
	if err := raw.UpdateArgs(link.RawLinkUpdateOptions{New: tp.Program, Old: agentProg, Flags: unix.BPF_F_REPLACE}); err != nil {
		if errors.Is(err, unix.EPERM) {
			return res, fmt.Errorf("%w: the program in %s changed while the tap started (an agent restart or another tap): run tap again", ErrBusy, linkPin)
		}
		return res, fmt.Errorf("swap the tap program into %s: %w", linkPin, err)
	}
	restored := false
	restore := func() error {
		if restored {
			return nil
		}
		restored = true
		err := raw.UpdateArgs(link.RawLinkUpdateOptions{New: agentProg, Old: tp.Program, Flags: unix.BPF_F_REPLACE})
		if errors.Is(err, unix.EPERM) {
			return nil // the tap's program is no longer there: an agent (re)start replaced it
		}
		if err != nil {
			return fmt.Errorf("restore the agent's sk_msg program (restart `meshwarp run` to be sure): %w", err)
		}
		return nil
	}
	defer func() { err = errors.Join(err, restore()) }()

	deadline := time.Time{}
	if o.Duration > 0 {
		deadline = time.Now().Add(o.Duration)
	}
	lastProgress := time.Now()
	full := func() bool { return o.Count > 0 && res.Messages >= uint64(o.Count) }
	// Read until told to stop; then put the agent's program back and drain
	// what the ring still holds, so no recorded message is left out.
	draining := false
	for !full() {
		if !draining && (ctx.Err() != nil || (!deadline.IsZero() && time.Now().After(deadline))) {
			if err := restore(); err != nil {
				return res, err
			}
			draining = true
		}
		wait := 200 * time.Millisecond
		if draining {
			wait = 20 * time.Millisecond
		}
		rd.SetDeadline(time.Now().Add(wait))
		rec, err := rd.Read()
		if errors.Is(err, os.ErrDeadlineExceeded) {
			if draining {
				break
			}
			// Idle: hand what was written to a reader on a pipe (tshark -r -).
			if err := w.ng.Flush(); err != nil {
				return res, fmt.Errorf("write pcapng: %w", err)
			}
			if o.Progress != nil && time.Since(lastProgress) > 5*time.Second {
				fmt.Fprintf(o.Progress, "tap: %d messages, %d packets so far\n", res.Messages, res.Packets)
				lastProgress = time.Now()
			}
			continue
		}
		if err != nil {
			return res, fmt.Errorf("read the tap ring: %w", err)
		}
		n, err := w.message(rec.RawSample)
		if err != nil {
			return res, fmt.Errorf("write pcapng: %w", err)
		}
		res.Messages++
		res.Packets += uint64(n)
	}
	if err := restore(); err != nil {
		return res, err
	}
	stats, err := tp.Stats()
	if err != nil {
		return res, err
	}
	res.RingFull, res.Cut = stats.RingFull, stats.Cut
	if err := w.finish(res); err != nil {
		return res, fmt.Errorf("write pcapng: %w", err)
	}
	if o.Progress != nil {
		fmt.Fprintf(o.Progress, "tap: %d messages as %d packets; %d dropped (ring full), %d cut by the snaplen\n",
			res.Messages, res.Packets, res.RingFull, res.Cut)
	}
	return res, nil
}

// LinkProgram names the program the agent's sk_msg link runs now:
// mw_skmsg normally, mw_skmsg_tap while a tap runs.
func LinkProgram(pinDir string) (string, error) {
	l, err := link.LoadPinnedLink(filepath.Join(pinDir, accel.SkmsgLinkPin), nil)
	if err != nil {
		return "", err
	}
	defer l.Close()
	p, err := linkedProgram(l)
	if err != nil {
		return "", err
	}
	defer p.Close()
	pi, err := p.Info()
	if err != nil {
		return "", err
	}
	return pi.Name, nil
}
