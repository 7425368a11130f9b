// SPDX-License-Identifier: Apache-2.0

package tap

import (
	"encoding/binary"
	"fmt"
	"io"
	"net/netip"
	"time"

	"github.com/gopacket/gopacket"
	"github.com/gopacket/gopacket/layers"
	"github.com/gopacket/gopacket/pcapgo"
	"golang.org/x/sys/unix"

	"github.com/meshwarp/meshwarp/internal/accel"
)

// maxSegment is the most payload one synthesised IPv4 packet can carry.
const maxSegment = 65535 - 20 - 20

// pcapWriter turns tap records into pcapng packets.
type pcapWriter struct {
	ng        *pcapgo.NgWriter
	hdrLen    int
	clockBase time.Time // wall time of monotonic 0
	conns     map[[2]uint32]*connState
	hops      []string
}

// connState is what the writer knows of one connection: how far each
// direction's stream got (for the acknowledgement numbers).
type connState struct {
	next map[uint32]uint32 // sender ISN+1 -> next sequence number
}

func newPcapWriter(out io.Writer, snaplen int) (*pcapWriter, error) {
	ng, err := pcapgo.NewNgWriterInterface(out, pcapgo.NgInterface{
		Name:        "meshwarp-redirect",
		Description: "bytes redirected socket-to-socket by meshwarp; Ethernet/IP/TCP headers are synthesised from the connection's addresses and sequence numbers",
		LinkType:    layers.LinkTypeEthernet,
		SnapLength:  uint32(snaplen + 14 + 40 + 20),
	}, pcapgo.NgWriterOptions{SectionInfo: pcapgo.NgSectionInfo{Application: "meshwarp tap"}})
	if err != nil {
		return nil, err
	}
	var ts unix.Timespec
	unix.ClockGettime(unix.CLOCK_MONOTONIC, &ts)
	return &pcapWriter{
		ng:        ng,
		hdrLen:    binary.Size(accel.TapRecord{}),
		clockBase: time.Now().Add(-time.Duration(ts.Nano())),
		conns:     map[[2]uint32]*connState{},
		hops:      accel.HopNames(),
	}, nil
}

// endpoint decodes an mw_endpoint: addresses are network-order words that
// Go read in native (little-endian) order.
func endpoint(e accel.TapEndpoint) netip.AddrPort {
	var b [16]byte
	for i, w := range e.Addr {
		binary.NativeEndian.PutUint32(b[4*i:], w)
	}
	return netip.AddrPortFrom(netip.AddrFrom16(b).Unmap(), uint16(e.PortHost))
}

// message writes one tap record: the handshake first if the connection's
// first byte is in it, then one or more segments. It returns the packets written.
func (w *pcapWriter) message(raw []byte) (int, error) {
	if len(raw) < w.hdrLen {
		return 0, fmt.Errorf("short tap record (%d bytes)", len(raw))
	}
	var r accel.TapRecord
	if _, err := binary.Decode(raw[:w.hdrLen], binary.NativeEndian, &r); err != nil {
		return 0, err
	}
	payload := raw[w.hdrLen:]
	if int(r.Caplen) < len(payload) {
		payload = payload[:r.Caplen]
	}
	src, dst := endpoint(r.Src), endpoint(r.Dst)
	ts := w.clockBase.Add(time.Duration(r.TsNs))
	key := [2]uint32{min(r.SenderIsn1, r.PeerIsn1), max(r.SenderIsn1, r.PeerIsn1)}
	c := w.conns[key]
	packets := 0
	if c == nil {
		c = &connState{next: map[uint32]uint32{}}
		w.conns[key] = c
		if r.Offset == 0 {
			// Seen from its first byte: write the handshake it had.
			active, passive := src, dst
			aISN, pISN := r.SenderIsn1-1, r.PeerIsn1-1
			if r.FromActive == 0 {
				active, passive = dst, src
				aISN, pISN = r.PeerIsn1-1, r.SenderIsn1-1
			}
			for _, p := range []struct {
				from, to     netip.AddrPort
				seq, ack     uint32
				syn, ackFlag bool
			}{
				{active, passive, aISN, 0, true, false},
				{passive, active, pISN, aISN + 1, true, true},
				{active, passive, aISN + 1, pISN + 1, false, true},
			} {
				if err := w.packet(ts, p.from, p.to, p.seq, p.ack, p.syn, p.ackFlag, nil, 0, ""); err != nil {
					return packets, err
				}
				packets++
			}
			c.next[aISN+1], c.next[pISN+1] = aISN+1, pISN+1
		}
	}
	seq := r.SenderIsn1 + uint32(r.Offset)
	ack, ok := c.next[r.PeerIsn1]
	if !ok {
		ack = r.PeerIsn1 // its earlier bytes were not seen
	}
	hop := ""
	if int(r.Hop) < len(w.hops) {
		hop = w.hops[r.Hop]
	}
	comment := "redirected by meshwarp, hop " + hop
	for off := 0; off < int(r.Size) || off == 0; off += maxSegment {
		size := min(int(r.Size)-off, maxSegment)
		var data []byte
		if off < len(payload) {
			data = payload[off:min(len(payload), off+size)]
		}
		if err := w.packet(ts, src, dst, seq+uint32(off), ack, false, true, data, size, comment); err != nil {
			return packets, err
		}
		packets++
		if size == 0 {
			break
		}
	}
	c.next[r.SenderIsn1] = seq + r.Size
	return packets, nil
}

// packet writes one synthesised segment with size payload bytes, of which
// data were captured.
func (w *pcapWriter) packet(ts time.Time, from, to netip.AddrPort, seq, ack uint32, syn, ackFlag bool, data []byte, size int, comment string) error {
	eth := &layers.Ethernet{SrcMAC: []byte{2, 0, 0, 0, 0, 1}, DstMAC: []byte{2, 0, 0, 0, 0, 2}}
	tcp := &layers.TCP{SrcPort: layers.TCPPort(from.Port()), DstPort: layers.TCPPort(to.Port()),
		Seq: seq, Ack: ack, SYN: syn, ACK: ackFlag, PSH: size > 0, Window: 65535, DataOffset: 5}
	var ip gopacket.SerializableLayer
	ipHdr := 20
	if from.Addr().Is4() && to.Addr().Is4() {
		eth.EthernetType = layers.EthernetTypeIPv4
		v4 := &layers.IPv4{Version: 4, IHL: 5, TTL: 64, Protocol: layers.IPProtocolTCP, Flags: layers.IPv4DontFragment,
			SrcIP: from.Addr().AsSlice(), DstIP: to.Addr().AsSlice(), Length: uint16(20 + 20 + size)}
		tcp.SetNetworkLayerForChecksum(v4)
		ip = v4
	} else {
		eth.EthernetType = layers.EthernetTypeIPv6
		src, dst := from.Addr().As16(), to.Addr().As16()
		v6 := &layers.IPv6{Version: 6, HopLimit: 64, NextHeader: layers.IPProtocolTCP,
			SrcIP: src[:], DstIP: dst[:], Length: uint16(20 + size)}
		tcp.SetNetworkLayerForChecksum(v6)
		ip = v6
		ipHdr = 40
	}
	buf := gopacket.NewSerializeBuffer()
	// Lengths are set above to the message's size: a snaplen cut shows as
	// a short capture of a full-size segment, not as a gap in the stream.
	opts := gopacket.SerializeOptions{ComputeChecksums: len(data) == size}
	if err := gopacket.SerializeLayers(buf, opts, eth, ip, tcp, gopacket.Payload(data)); err != nil {
		return err
	}
	b := buf.Bytes()
	// Ethernet pads short frames: the wire length is never below what is captured.
	ci := gopacket.CaptureInfo{Timestamp: ts, CaptureLength: len(b), Length: max(14+ipHdr+20+size, len(b))}
	var po pcapgo.NgPacketOptions
	if comment != "" {
		po.Comments = []string{comment}
	}
	return w.ng.WritePacketWithOptions(ci, b, po)
}

// finish records the drops in the interface statistics and flushes.
func (w *pcapWriter) finish(r Result) error {
	if err := w.ng.WriteInterfaceStats(0, pcapgo.NgInterfaceStatistics{
		LastUpdate:      time.Now(),
		PacketsReceived: r.Messages + r.RingFull,
		PacketsDropped:  r.RingFull,
		Comment:         fmt.Sprintf("meshwarp tap: %d messages dropped (ring full), %d cut by the snaplen", r.RingFull, r.Cut),
	}); err != nil {
		return err
	}
	return w.ng.Flush()
}
