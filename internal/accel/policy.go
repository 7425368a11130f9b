// SPDX-License-Identifier: Apache-2.0

package accel

import "net/netip"

// Policy says which connections may be accelerated. Empty include lists mean
// "everything"; excludes win over includes.
type Policy struct {
	IncludePorts []uint16
	ExcludePorts []uint16
	IncludeCIDRs []netip.Prefix
	ExcludeCIDRs []netip.Prefix
}
