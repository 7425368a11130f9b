// SPDX-License-Identifier: Apache-2.0

package accel

import (
	"bytes"
	"fmt"
	"io"
	"net"
	"strconv"
	"testing"

	"github.com/meshwarp/meshwarp/internal/testutil"
)

// Under Istio's capture every outbound connection of a pod goes to one
// port (15001), so the NATed reply tuple of a new connection collides with
// the conntrack entry of an earlier one from the same source port (live, or
// lingering after close), and conntrack remaps the source port: the accepted
// side sees another port than the connecting side has. Such connections are
// pairs all the same and must be paired, intact, and counted as remapped.

// remapCase forces source-port remaps: one client endpoint dials several
// destinations that the namespace's iptables redirect to one listener.
type remapCase struct {
	name    string
	setup   func(t *testing.T) (listenNS, dialNS *testutil.Netns, listenAddr, dstIP, localIP string)
	wantHop string
}

func TestPrivilegedPairAcrossSourcePortRemap(t *testing.T) {
	testutil.RequirePrivileged(t)
	cases := []remapCase{
		{
			// The app -> sidecar hop: REDIRECT in OUTPUT, one namespace.
			name: "outbound-capture-same-netns",
			setup: func(t *testing.T) (*testutil.Netns, *testutil.Netns, string, string, string) {
				ns := testutil.NewNetns(t, "remap-out")
				testutil.Run(t, "ip", "netns", "exec", ns.Name, "iptables", "-w", "-t", "nat", "-A", "OUTPUT",
					"-p", "tcp", "-d", "127.0.0.2", "-j", "REDIRECT", "--to-ports", strconv.Itoa(DefaultOutboundPort))
				return ns, ns, net.JoinHostPort("127.0.0.1", strconv.Itoa(DefaultOutboundPort)), "127.0.0.2", "127.0.0.1"
			},
			wantHop: "app_to_sidecar",
		},
		{
			// The sidecar -> sidecar hop: REDIRECT in PREROUTING of the
			// server's namespace, the client in another namespace.
			name: "inbound-capture-across-netns",
			setup: func(t *testing.T) (*testutil.Netns, *testutil.Netns, string, string, string) {
				client, server := testutil.NewNetns(t, "remap-cl"), testutil.NewNetns(t, "remap-sv")
				clientIP, serverIP := vethPair(t, client, server)
				testutil.Run(t, "ip", "netns", "exec", server.Name, "iptables", "-w", "-t", "nat", "-A", "PREROUTING",
					"-p", "tcp", "-d", serverIP, "-j", "REDIRECT", "--to-ports", strconv.Itoa(DefaultInboundPort))
				return server, client, net.JoinHostPort(serverIP, strconv.Itoa(DefaultInboundPort)), serverIP, clientIP
			},
			wantHop: "sidecar_to_sidecar",
		},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			forEachAgent(t, func(t *testing.T, a *Agent) {
				runRemapCase(t, a, tc)
			})
		})
	}
}

func runRemapCase(t *testing.T, a *Agent, tc remapCase) {
	listenNS, dialNS, listenAddr, dstIP, localIP := tc.setup(t)
	ln := listenIn(t, listenNS, listenAddr)
	defer ln.Close()
	var before Stats
	if a != nil {
		before = stats(t, a)
	}
	conns, remapped := 0, 0
	// Round 1 keeps the connections open (live conntrack entries); round 2
	// closes each before the next dial (entries linger in TIME_WAIT).
	for round, closeEach := range []bool{false, true} {
		localAddr := net.JoinHostPort(localIP, strconv.Itoa(47100+round))
		for i, port := range []int{81, 82, 83, 84} {
			dst := net.JoinHostPort(dstIP, strconv.Itoa(port))
			client, server := pairedConn(t, a, ln, dialIn(dialNS, dst, localAddr))
			conns++
			if client.LocalAddr().(*net.TCPAddr).Port != server.RemoteAddr().(*net.TCPAddr).Port {
				remapped++
			}
			if err := exchangeBothWays(client, server, fmt.Sprintf("round %d conn %d", round, i)); err != nil {
				t.Fatal(err)
			}
			if closeEach {
				client.Close()
				server.Close()
			}
		}
	}
	t.Logf("%d connections, %d with a remapped source port", conns, remapped)
	// The same assertion with and without the agent: the kernel did remap,
	// so the test exercises what it claims to.
	if remapped < 3 {
		t.Fatalf("only %d of %d connections had their source port remapped: the test does not force the remap", remapped, conns)
	}
	if a == nil {
		return
	}
	d := stats(t, a).Sub(before)
	t.Logf("paired %v, port remaps %d, left to TCP %v", d.Hops[tc.wantHop], d.NATPortRemaps, d.PassthroughConnections)
	if got := d.Hops[tc.wantHop].PairedConnections; got != uint64(conns) {
		t.Errorf("hop %s: %d of %d connections paired", tc.wantHop, got, conns)
	}
	if d.NATPortRemaps != uint64(remapped) {
		t.Errorf("nat_port_remapped_connections: %d, want %d", d.NATPortRemaps, remapped)
	}
	for reason, n := range d.PassthroughConnections {
		if n != 0 {
			t.Errorf("%d connections left to TCP (%s)", n, reason)
		}
	}
}

// exchangeBothWays sends distinct payloads each way and checks them.
func exchangeBothWays(client, server net.Conn, what string) error {
	for _, dir := range []struct {
		name     string
		from, to net.Conn
	}{{"client->server", client, server}, {"server->client", server, client}} {
		msg := bytes.Repeat([]byte(what+" "+dir.name+"|"), 300)
		errc := make(chan error, 1)
		go func() { _, err := dir.from.Write(msg); errc <- err }()
		got := make([]byte, len(msg))
		if _, err := io.ReadFull(dir.to, got); err != nil {
			return fmt.Errorf("%s %s: read: %w", what, dir.name, err)
		}
		if err := <-errc; err != nil {
			return fmt.Errorf("%s %s: write: %w", what, dir.name, err)
		}
		if !bytes.Equal(got, msg) {
			return fmt.Errorf("%s %s: bytes differ", what, dir.name)
		}
	}
	return nil
}
