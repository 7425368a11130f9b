// SPDX-License-Identifier: Apache-2.0

package lab

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"net"
	"net/netip"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/meshwarp/meshwarp/internal/crossnode"
	"github.com/meshwarp/meshwarp/internal/testutil"
)

// What the redirect leaves to the kernel must behave as the kernel makes it
// behave, with the agents as without: an expiring TTL gets ICMP time
// exceeded from the first node, a datagram too big for the wire with DF set
// gets ICMP "fragmentation needed" / "packet too big" with the wire's MTU,
// fragments arrive reassembled, and TCP across a wire with a smaller MTU
// than the pods' finds the path MTU and delivers every byte. With the
// agents, each case is counted under its reason.
func TestPrivilegedCrossNodeKernelCases(t *testing.T) {
	testutil.RequirePrivileged(t)
	l, clientNs, _ := crossNodeEcho(t, nil)
	client, server := l.Client(), l.Server()
	serverNs := testutil.OpenNetns(t, server.Netns)
	clientNode := l.Nodes()[client.Node]

	const udpPort = 8079
	var udp4, udp6 net.PacketConn
	if err := serverNs.Do(func() (err error) {
		if udp4, err = net.ListenPacket("udp4", fmt.Sprintf(":%d", udpPort)); err != nil {
			return err
		}
		udp6, err = net.ListenPacket("udp6", fmt.Sprintf(":%d", udpPort))
		return err
	}); err != nil {
		t.Fatal(err)
	}
	defer udp4.Close()
	defer udp6.Close()

	type family struct {
		name      string
		af        int
		server    netip.Addr
		node      netip.Addr // the client's node: where TTLs expire and the wire's MTU is met
		udp       net.PacketConn
		ttlType   uint8 // ICMP type of "time exceeded"
		bigType   uint8 // ICMP type of "fragmentation needed" / "packet too big"
		eeOrigin  uint8
		level     int      // IPPROTO_IP or IPPROTO_IPV6: where the options below live
		ttlOpt    int      // IP_TTL, IPV6_UNICAST_HOPS
		pmtuOpt   int      // IP_MTU_DISCOVER, IPV6_MTU_DISCOVER
		pmtuDo    int      // path MTU discovery on: the DF bit set
		pmtuDont  int      // off: the kernel may fragment
		fragments []string // reasons fragments are passed for
	}
	families := []family{
		{name: "ipv4", af: unix.AF_INET, server: server.IP, node: clientNode.Bridge, udp: udp4, ttlType: 11, bigType: 3,
			eeOrigin: unix.SO_EE_ORIGIN_ICMP, level: unix.IPPROTO_IP, ttlOpt: unix.IP_TTL,
			pmtuOpt: unix.IP_MTU_DISCOVER, pmtuDo: unix.IP_PMTUDISC_DO, pmtuDont: unix.IP_PMTUDISC_DONT,
			fragments: []string{"fragment"}},
		{name: "ipv6", af: unix.AF_INET6, server: server.IP6, node: clientNode.Bridge6, udp: udp6, ttlType: 3, bigType: 2,
			eeOrigin: unix.SO_EE_ORIGIN_ICMP6, level: unix.IPPROTO_IPV6, ttlOpt: unix.IPV6_UNICAST_HOPS,
			pmtuOpt: unix.IPV6_MTU_DISCOVER, pmtuDo: unix.IPV6_PMTUDISC_DO, pmtuDont: unix.IPV6_PMTUDISC_DONT,
			fragments: []string{"fragment", "ip_options"}},
	}

	const wireMTU = 1280
	var defaultMTU int
	if _, err := fmt.Sscanf(strings.SplitAfter(testutil.Run(t, "ip", "-n", clientNode.Netns, "-o", "link", "show", "dev", WireName), " mtu ")[1],
		"%d", &defaultMTU); err != nil {
		t.Fatalf("the wire's MTU: %v", err)
	}
	setWireMTU := func(t *testing.T, mtu int) {
		for _, n := range l.Nodes() {
			testutil.Run(t, "ip", "-n", n.Netns, "link", "set", WireName, "mtu", fmt.Sprint(mtu))
		}
	}
	// Path MTUs the pods learnt are forgotten between cases (a server that
	// remembers one also advertises a smaller MSS to the client).
	flushPMTU := func(t *testing.T) {
		for _, ns := range []string{client.Netns, server.Netns} {
			testutil.Run(t, "ip", "-n", ns, "route", "flush", "cache")
			testutil.Run(t, "ip", "-n", ns, "-6", "route", "flush", "cache")
		}
	}

	testutil.WithAndWithout(t, func(t *testing.T, withAgent bool) {
		var pinDirs []string
		if withAgent {
			pinDirs = nodePinDirs(t, l)
			startNodeAgents(t, l, pinDirs, 100*time.Millisecond)
		}
		passed := func(reasons ...string) uint64 {
			if !withAgent {
				return 0
			}
			s := crossNodeStats(t, pinDirs...)
			var n uint64
			for _, r := range reasons {
				n += s.PassedPackets[r]
			}
			return n
		}
		for _, f := range families {
			t.Run(f.name, func(t *testing.T) {
				to := netip.AddrPortFrom(f.server, udpPort)

				t.Run("an expiring TTL gets time exceeded from the first node", func(t *testing.T) {
					before := passed("ttl")
					ee, from, err := icmpError(clientNs, f.af, to, 100, func(fd int) error { return unix.SetsockoptInt(fd, f.level, f.ttlOpt, 1) })
					if err != nil {
						t.Fatal(err)
					}
					if ee.Origin != f.eeOrigin || ee.Type != f.ttlType || from != f.node {
						t.Errorf("ICMP origin %d type %d from %s, want origin %d type %d from %s", ee.Origin, ee.Type, from, f.eeOrigin, f.ttlType, f.node)
					}
					if withAgent && passed("ttl") == before {
						t.Error("no packet counted as passed for ttl")
					}
				})

				t.Run("fragments arrive reassembled", func(t *testing.T) {
					before := passed(f.fragments...)
					payload := bytes.Repeat([]byte{0x5a}, 3000)
					if err := sendUDP(clientNs, f.af, to, payload, func(fd int) error { return unix.SetsockoptInt(fd, f.level, f.pmtuOpt, f.pmtuDont) }); err != nil {
						t.Fatal(err)
					}
					f.udp.SetReadDeadline(time.Now().Add(10 * time.Second))
					buf := make([]byte, 65536)
					n, _, err := f.udp.ReadFrom(buf)
					if err != nil || !bytes.Equal(buf[:n], payload) {
						t.Fatalf("server read %d bytes (%v), want the %d sent", n, err, len(payload))
					}
					if withAgent && passed(f.fragments...) == before {
						t.Errorf("no packet counted as passed for %v", f.fragments)
					}
				})

				t.Run("a datagram over the wire's MTU with DF set gets too big", func(t *testing.T) {
					setWireMTU(t, wireMTU)
					defer setWireMTU(t, defaultMTU)
					flushPMTU(t)
					before := passed("mtu")
					ee, from, err := icmpError(clientNs, f.af, to, 1400, func(fd int) error { return unix.SetsockoptInt(fd, f.level, f.pmtuOpt, f.pmtuDo) })
					if err != nil {
						t.Fatal(err)
					}
					if ee.Origin != f.eeOrigin || ee.Type != f.bigType || ee.Info != wireMTU || from != f.node {
						t.Errorf("ICMP origin %d type %d mtu %d from %s, want origin %d type %d mtu %d from %s",
							ee.Origin, ee.Type, ee.Info, from, f.eeOrigin, f.bigType, wireMTU, f.node)
					}
					if withAgent && passed("mtu") == before {
						t.Error("no packet counted as passed for mtu")
					}
				})

				t.Run("TCP across a wire with a smaller MTU finds the path MTU", func(t *testing.T) {
					setWireMTU(t, wireMTU)
					defer setWireMTU(t, defaultMTU)
					flushPMTU(t)
					network := map[int]string{unix.AF_INET: "tcp4", unix.AF_INET6: "tcp6"}[f.af]
					addr := netip.AddrPortFrom(f.server, crossNodePort).String()
					var before crossnode.Stats
					if withAgent {
						before = crossNodeStats(t, pinDirs...)
					}
					res := testutil.CheckIntegrity(func() (c net.Conn, err error) {
						err = clientNs.Do(func() error { c, err = net.DialTimeout(network, addr, 30*time.Second); return err })
						return c, err
					}, testutil.IntegrityOptions{Conns: 4, Messages: 8, MaxSize: 64 << 10, Seed: 21})
					if err := res.Err(); err != nil {
						t.Fatal(err)
					}
					// The client learnt the wire's MTU from the node's ICMP.
					if out := testutil.Run(t, "ip", "-n", client.Netns, "route", "get", f.server.String()); !strings.Contains(out, fmt.Sprintf("mtu %d", wireMTU)) {
						t.Errorf("the client did not learn the path MTU %d:\n%s", wireMTU, out)
					}
					if withAgent {
						after := crossNodeStats(t, pinDirs...)
						if after.PassedPackets["mtu"] == before.PassedPackets["mtu"] {
							t.Error("no packet counted as passed for mtu: the case did not meet the smaller MTU")
						}
						if after.RedirectedPackets["to_wire"] == before.RedirectedPackets["to_wire"] {
							t.Error("nothing redirected once the path MTU was found")
						}
					}
				})
			})
		}
	})
	waitIdle(t, l)
}

// udpSocket opens a UDP socket in ns, applies setup and connects it to to.
func udpSocket(ns *testutil.Netns, af int, to netip.AddrPort, setup func(fd int) error) (int, error) {
	fd := -1
	err := ns.Do(func() error {
		var err error
		if fd, err = unix.Socket(af, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0); err != nil {
			return err
		}
		return nil
	})
	if err != nil {
		return -1, err
	}
	var sa unix.Sockaddr
	if af == unix.AF_INET {
		sa = &unix.SockaddrInet4{Port: int(to.Port()), Addr: to.Addr().As4()}
		err = unix.SetsockoptInt(fd, unix.IPPROTO_IP, unix.IP_RECVERR, 1)
	} else {
		sa = &unix.SockaddrInet6{Port: int(to.Port()), Addr: to.Addr().As16()}
		err = unix.SetsockoptInt(fd, unix.IPPROTO_IPV6, unix.IPV6_RECVERR, 1)
	}
	if err == nil && setup != nil {
		err = setup(fd)
	}
	if err == nil {
		err = unix.Connect(fd, sa)
	}
	if err != nil {
		unix.Close(fd)
		return -1, err
	}
	return fd, nil
}

func sendUDP(ns *testutil.Netns, af int, to netip.AddrPort, payload []byte, setup func(fd int) error) error {
	fd, err := udpSocket(ns, af, to, setup)
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	_, err = unix.Write(fd, payload)
	return err
}

// icmpError sends one datagram of size bytes and returns the ICMP error the
// kernel queues for it (IP_RECVERR) and the address it came from.
func icmpError(ns *testutil.Netns, af int, to netip.AddrPort, size int, setup func(fd int) error) (unix.SockExtendedErr, netip.Addr, error) {
	var ee unix.SockExtendedErr
	fd, err := udpSocket(ns, af, to, setup)
	if err != nil {
		return ee, netip.Addr{}, err
	}
	defer unix.Close(fd)
	if _, err := unix.Write(fd, make([]byte, size)); err != nil {
		return ee, netip.Addr{}, fmt.Errorf("send: %w", err)
	}
	deadline := time.Now().Add(10 * time.Second)
	buf, oob := make([]byte, 2048), make([]byte, 1024)
	for time.Now().Before(deadline) {
		pfd := []unix.PollFd{{Fd: int32(fd), Events: unix.POLLERR}}
		if _, err := unix.Poll(pfd, 100); err != nil && err != unix.EINTR {
			return ee, netip.Addr{}, err
		}
		_, oobn, _, _, err := unix.Recvmsg(fd, buf, oob, unix.MSG_ERRQUEUE|unix.MSG_DONTWAIT)
		if err == unix.EAGAIN {
			continue
		}
		if err != nil {
			return ee, netip.Addr{}, fmt.Errorf("read the error queue: %w", err)
		}
		msgs, err := unix.ParseSocketControlMessage(oob[:oobn])
		if err != nil {
			return ee, netip.Addr{}, err
		}
		for _, m := range msgs {
			if !(m.Header.Level == unix.IPPROTO_IP && m.Header.Type == unix.IP_RECVERR) &&
				!(m.Header.Level == unix.IPPROTO_IPV6 && m.Header.Type == unix.IPV6_RECVERR) {
				continue
			}
			if err := binary.Read(bytes.NewReader(m.Data), binary.NativeEndian, &ee); err != nil {
				return ee, netip.Addr{}, err
			}
			// The offender's address follows the extended error.
			off := m.Data[binary.Size(ee):]
			var from netip.Addr
			if af == unix.AF_INET && len(off) >= 8 {
				from = netip.AddrFrom4([4]byte(off[4:8]))
			} else if len(off) >= 24 {
				from = netip.AddrFrom16([16]byte(off[8:24]))
			}
			return ee, from, nil
		}
	}
	return ee, netip.Addr{}, fmt.Errorf("no ICMP error within 10s")
}
