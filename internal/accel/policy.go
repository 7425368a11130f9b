// SPDX-License-Identifier: Apache-2.0

package accel

import (
	"encoding/binary"
	"errors"
	"fmt"
	"net/netip"

	"github.com/cilium/ebpf"
)

// Policy says which connections may be accelerated, by the destination the
// application asked for. Empty include lists mean "everything"; excludes win
// over includes. Exclusions also apply to the accepting side's own port and
// address (a server behind DNAT or a port redirect is excluded by its real
// port, whatever port the client dialled). Applied through maps: changing
// it needs no reload.
type Policy struct {
	IncludePorts []uint16       `json:"include_ports,omitempty"`
	ExcludePorts []uint16       `json:"exclude_ports,omitempty"`
	IncludeCIDRs []netip.Prefix `json:"include_cidrs,omitempty"`
	ExcludeCIDRs []netip.Prefix `json:"exclude_cidrs,omitempty"`
}

// maxPolicyEntries matches max_entries of the policy maps in bpf/accel/maps.h.
const maxPolicyEntries = 1024

// Port actions, enum mw_port_action (bpf/accel/accel.h; keep in sync).
const (
	portInclude uint32 = 1
	portExclude uint32 = 2
)

// Validate reports every problem at once.
func (p Policy) Validate() error {
	var errs []error
	if n := len(p.IncludePorts) + len(p.ExcludePorts); n > maxPolicyEntries {
		errs = append(errs, fmt.Errorf("policy has %d ports, at most %d fit: use fewer or wider rules", n, maxPolicyEntries))
	}
	for _, l := range [][]netip.Prefix{p.IncludeCIDRs, p.ExcludeCIDRs} {
		if len(l) > maxPolicyEntries {
			errs = append(errs, fmt.Errorf("policy has %d CIDRs in one list, at most %d fit", len(l), maxPolicyEntries))
		}
		for _, c := range l {
			if !c.IsValid() {
				errs = append(errs, fmt.Errorf("invalid CIDR %v", c))
			}
		}
	}
	for _, port := range p.IncludePorts {
		if port == 0 {
			errs = append(errs, errors.New("port 0 in include list: ports are 1-65535"))
		}
	}
	return errors.Join(errs...)
}

// portActions is the content of mw_port_policy (exclude wins over include).
func (p Policy) portActions() map[uint32]uint32 {
	m := map[uint32]uint32{}
	for _, port := range p.IncludePorts {
		m[uint32(port)] = portInclude
	}
	for _, port := range p.ExcludePorts {
		m[uint32(port)] = portExclude
	}
	return m
}

// cidrKey encodes a prefix as the LPM key the BPF side looks up: addresses in
// network order, IPv4 as v4-mapped IPv6 with the prefix length moved by 96.
func cidrKey(p netip.Prefix) accelMwCidrKey {
	p = p.Masked()
	addr := p.Addr()
	bits := p.Bits()
	if addr.Is4() {
		bits += 96
	}
	a16 := addr.As16() // v4 becomes ::ffff:a.b.c.d
	var k accelMwCidrKey
	k.Prefixlen = uint32(bits)
	for i := range k.Addr {
		// The BPF side stores the address bytes as they are on the wire; a
		// native-endian read of those bytes is what the map key holds.
		k.Addr[i] = binary.NativeEndian.Uint32(a16[i*4 : i*4+4])
	}
	return k
}

// ApplyPolicy replaces the policy in the maps. New entries are added before
// stale ones are removed, and the include switches are flipped last, so a
// connection established meanwhile sees either policy, never an empty one.
func (a *Agent) ApplyPolicy(p Policy) error {
	if err := p.Validate(); err != nil {
		return fmt.Errorf("invalid policy: %w", err)
	}
	if err := syncMap(a.objs.MwPortPolicy, p.portActions()); err != nil {
		return fmt.Errorf("apply port policy: %w", err)
	}
	if err := syncMap(a.objs.MwCidrIncl, cidrSet(p.IncludeCIDRs)); err != nil {
		return fmt.Errorf("apply include CIDRs: %w", err)
	}
	if err := syncMap(a.objs.MwCidrExcl, cidrSet(p.ExcludeCIDRs)); err != nil {
		return fmt.Errorf("apply exclude CIDRs: %w", err)
	}
	cfg := accelMwPolicyCfg{IncludePortsSet: b2u(len(p.IncludePorts) > 0), IncludeCidrsSet: b2u(len(p.IncludeCIDRs) > 0)}
	if err := a.objs.MwPolicy.Put(uint32(0), cfg); err != nil {
		return fmt.Errorf("apply policy switches: %w", err)
	}
	a.cfg.Policy = p
	return nil
}

func cidrSet(l []netip.Prefix) map[accelMwCidrKey]uint32 {
	m := map[accelMwCidrKey]uint32{}
	for _, c := range l {
		m[cidrKey(c)] = 1
	}
	return m
}

func b2u(b bool) uint32 {
	if b {
		return 1
	}
	return 0
}

// syncMap makes m hold exactly want.
func syncMap[K comparable](m *ebpf.Map, want map[K]uint32) error {
	for k, v := range want {
		if err := m.Put(k, v); err != nil {
			return err
		}
	}
	var stale []K
	var k K
	var v uint32
	it := m.Iterate()
	for it.Next(&k, &v) {
		if _, ok := want[k]; !ok {
			stale = append(stale, k)
		}
	}
	if err := it.Err(); err != nil {
		return err
	}
	for _, k := range stale {
		if err := m.Delete(k); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
			return err
		}
	}
	return nil
}
