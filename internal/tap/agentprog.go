// SPDX-License-Identifier: Apache-2.0

package tap

import (
	"fmt"
	"strings"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/btf"
	"github.com/cilium/ebpf/link"

	"github.com/meshwarp/meshwarp/internal/accel"
)

// The tap's program stands in for the agent's, so it must run with the
// agent's load-time settings (redirect budget, small streams, sidecar uid and
// ports, observation on or off, ...): the ones the agent's program was
// loaded with, read back from the kernel, never the defaults. The tap's
// program is a program of the agent's object (bpf/accel/tap.h), so its
// .rodata has the same variables; they are matched by name, and the agent's
// layout comes from the BTF the kernel keeps for the agent's .rodata map, so
// it is the layout as loaded (accel.LoadTap refuses another build's).

// linkedProgram returns the program l runs now; the caller closes it.
func linkedProgram(l link.Link) (*ebpf.Program, error) {
	info, err := l.Info()
	if err != nil {
		return nil, fmt.Errorf("read link info: %w", err)
	}
	p, err := ebpf.NewProgramFromID(info.Program)
	if err != nil {
		return nil, fmt.Errorf("open program %d: %w", info.Program, err)
	}
	return p, nil
}

// loadedConstants reads the values p's .rodata variables were loaded with,
// by variable name. A program without .rodata has none.
func loadedConstants(p *ebpf.Program) (map[string][]byte, error) {
	info, err := p.Info()
	if err != nil {
		return nil, fmt.Errorf("read program info: %w", err)
	}
	ids, ok := info.MapIDs()
	if !ok {
		return nil, fmt.Errorf("the kernel does not list the maps of program %s: %w", info.Name, ebpf.ErrNotSupported)
	}
	for _, id := range ids {
		m, err := ebpf.NewMapFromID(id)
		if err != nil {
			return nil, fmt.Errorf("open map %d of program %s: %w", id, info.Name, err)
		}
		consts, found, err := rodataValues(m)
		m.Close()
		if err != nil {
			return nil, fmt.Errorf("read the constants of program %s: %w", info.Name, err)
		}
		if found {
			return consts, nil
		}
	}
	return map[string][]byte{}, nil
}

// rodataValues splits m's value into its variables when m is a .rodata map
// (cilium/ebpf names it ".rodata", libbpf "<object>.rodata").
func rodataValues(m *ebpf.Map) (map[string][]byte, bool, error) {
	mi, err := m.Info()
	if err != nil {
		return nil, false, fmt.Errorf("read map info: %w", err)
	}
	if !strings.HasSuffix(mi.Name, accel.RodataSection) || mi.Type != ebpf.Array || mi.MaxEntries != 1 {
		return nil, false, nil
	}
	btfID, ok := mi.BTFID()
	if !ok {
		return nil, true, fmt.Errorf("map %s has no BTF: its variables cannot be told apart", mi.Name)
	}
	h, err := btf.NewHandleFromID(btfID)
	if err != nil {
		return nil, true, fmt.Errorf("open the BTF of map %s: %w", mi.Name, err)
	}
	defer h.Close()
	spec, err := h.Spec(nil)
	if err != nil {
		return nil, true, fmt.Errorf("read the BTF of map %s: %w", mi.Name, err)
	}
	var ds *btf.Datasec
	if err := spec.TypeByName(accel.RodataSection, &ds); err != nil {
		return nil, true, fmt.Errorf("find %s in the BTF of map %s: %w", accel.RodataSection, mi.Name, err)
	}
	value := make([]byte, mi.ValueSize)
	if err := m.Lookup(uint32(0), &value); err != nil {
		return nil, true, fmt.Errorf("read map %s: %w", mi.Name, err)
	}
	consts := make(map[string][]byte, len(ds.Vars))
	for _, vs := range ds.Vars {
		v, ok := vs.Type.(*btf.Var)
		if !ok || uint64(vs.Offset)+uint64(vs.Size) > uint64(len(value)) {
			return nil, true, fmt.Errorf("map %s: BTF does not match its %d-byte value", mi.Name, len(value))
		}
		consts[v.Name] = value[vs.Offset : vs.Offset+vs.Size]
	}
	return consts, true, nil
}
