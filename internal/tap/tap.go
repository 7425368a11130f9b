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
	"maps"
	"os"
	"path/filepath"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"github.com/cilium/ebpf/ringbuf"

	"github.com/meshwarp/meshwarp/internal/accel"
	"github.com/meshwarp/meshwarp/internal/netns"
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
)

const skmsgLinkPin = "mw_skmsg_link"

// Run taps until ctx ends, Count messages were seen or Duration passed. On
// return (also on error) the agent's own program is back in its link.
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
	linkPin := filepath.Join(o.PinDir, skmsgLinkPin)
	if _, err := os.Stat(linkPin); err != nil {
		return res, fmt.Errorf("%w at %s (%v): start `meshwarp run`, or pass its --pin-dir", ErrNoAgent, o.PinDir, err)
	}
	var netnsCookie uint64
	if o.Netns != "" {
		if netnsCookie, err = netns.Cookie(o.Netns); err != nil {
			return res, err
		}
	}

	spec, err := loadTap()
	if err != nil {
		return res, fmt.Errorf("load tap spec: %w", err)
	}
	consts := accel.DataPathConstants(accel.Config{})
	// The agent's observation goes on while the tap's program stands in.
	obs, err := accel.ObservationConstants(o.PinDir)
	if err != nil {
		return res, err
	}
	maps.Copy(consts, obs)
	consts["tap_snaplen"] = uint32(o.Snaplen)
	consts["tap_port"] = uint32(o.Port)
	consts["tap_netns"] = netnsCookie
	for name, v := range consts {
		if err := spec.Variables[name].Set(v); err != nil {
			return res, fmt.Errorf("set %s: %w", name, err)
		}
	}
	cpus, err := ebpf.PossibleCPU()
	if err != nil {
		return res, err
	}
	spec.Maps["mw_tap_scratch"].MaxEntries = uint32(cpus)
	// Only the pinned maps are used: a tap never creates agent state.
	var objs struct {
		Tap      *ebpf.Program `ebpf:"mw_skmsg_tap"`
		Plain    *ebpf.Program `ebpf:"mw_skmsg"`
		Ring     *ebpf.Map     `ebpf:"mw_tap_ring"`
		Counters *ebpf.Map     `ebpf:"mw_tap_counters"`
	}
	replace := map[string]*ebpf.Map{}
	for name, m := range spec.Maps {
		if m.Pinning != ebpf.PinByName {
			continue
		}
		pinned, err := ebpf.LoadPinnedMap(filepath.Join(o.PinDir, name), nil)
		if err != nil {
			continue // a map neither program uses may be missing
		}
		defer pinned.Close()
		replace[name] = pinned
	}
	if err := spec.LoadAndAssign(&objs, &ebpf.CollectionOptions{MapReplacements: replace}); err != nil {
		return res, fmt.Errorf("load the tap program against the agent's maps at %s (same meshwarp build?): %w", o.PinDir, err)
	}
	defer objs.Tap.Close()
	defer objs.Plain.Close()
	defer objs.Ring.Close()
	defer objs.Counters.Close()

	rd, err := ringbuf.NewReader(objs.Ring)
	if err != nil {
		return res, fmt.Errorf("open the tap ring: %w", err)
	}
	defer rd.Close()
	w, err := newPcapWriter(o.Out, o.Snaplen)
	if err != nil {
		return res, err
	}

	l, err := link.LoadPinnedLink(linkPin, nil)
	if err != nil {
		return res, fmt.Errorf("open the agent's sk_msg link %s: %w", linkPin, err)
	}
	defer l.Close()
	if err := l.Update(objs.Tap); err != nil {
		return res, fmt.Errorf("swap the tap program into %s: %w", linkPin, err)
	}
	restored := false
	restore := func() error {
		if restored {
			return nil
		}
		restored = true
		if err := l.Update(objs.Plain); err != nil {
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
	stats, err := readStats(objs.Counters)
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

func readStats(m *ebpf.Map) (tapMwTapStats, error) {
	var perCPU []tapMwTapStats
	var sum tapMwTapStats
	if err := m.Lookup(uint32(0), &perCPU); err != nil {
		return sum, fmt.Errorf("read tap counters: %w", err)
	}
	for _, c := range perCPU {
		sum.Records += c.Records
		sum.RingFull += c.RingFull
		sum.Cut += c.Cut
	}
	return sum, nil
}

// LinkProgram names the program the agent's sk_msg link runs now:
// mw_skmsg normally, mw_skmsg_tap while a tap runs.
func LinkProgram(pinDir string) (string, error) {
	l, err := link.LoadPinnedLink(filepath.Join(pinDir, skmsgLinkPin), nil)
	if err != nil {
		return "", err
	}
	defer l.Close()
	info, err := l.Info()
	if err != nil {
		return "", err
	}
	p, err := ebpf.NewProgramFromID(info.Program)
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

// Spec is the tap object as built (bpf/tap/tap.bpf.c): what it needs from the kernel.
func Spec() (*ebpf.CollectionSpec, error) { return loadTap() }
