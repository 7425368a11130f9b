// SPDX-License-Identifier: Apache-2.0

package accel

import (
	"errors"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strings"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/btf"
)

// ErrLayoutMismatch: the pinned maps were created by a build whose map
// layout differs from this build's. Adopting them would make old and new
// programs misread each other's entries, so Start refuses before it changes
// anything.
var ErrLayoutMismatch = errors.New("pinned maps have another layout than this build")

// checkPinnedLayout compares, for every map of spec that is pinned under
// pinDir already, the key and value types this build uses with the types
// the pinned map was created with (its BTF, kept by the kernel). Sizes
// alone are not enough: a field renamed, moved or retyped at the same size
// changes what the bytes mean. Types are compared by name, offset, size and
// kind down to the last member, and enums by their values.
func checkPinnedLayout(spec *ebpf.CollectionSpec, pinDir string) error {
	var errs []error
	var typed []*btf.Spec
	var untyped []string
	for _, name := range slices.Sorted(maps.Keys(spec.Maps)) {
		ms := spec.Maps[name]
		path := filepath.Join(pinDir, name)
		if ms.Pinning != ebpf.PinByName {
			continue
		}
		if _, err := os.Stat(path); err != nil {
			continue // not pinned yet: created fresh
		}
		pinned, err := pinnedMapBTF(path)
		if err != nil {
			errs = append(errs, fmt.Errorf("%s: %w", name, err))
			continue
		}
		if pinned == nil {
			untyped = append(untyped, name)
			continue
		}
		typed = append(typed, pinned)
		if err := compareTypes([]*btf.Spec{pinned}, ms); err != nil {
			errs = append(errs, fmt.Errorf("%s: %w", name, err))
		}
	}
	// The kernel keeps no BTF for some map types (SOCKMAP). Their types are
	// checked against the BTF of the maps pinned with them: one agent's maps
	// come from one object, or were adopted after this same check.
	for _, name := range untyped {
		if len(typed) == 0 {
			errs = append(errs, fmt.Errorf("%s: no pinned map carries type information, so the layout cannot be verified", name))
			continue
		}
		if err := compareTypes(typed, spec.Maps[name]); err != nil {
			errs = append(errs, fmt.Errorf("%s: %w", name, err))
		}
	}
	if len(errs) > 0 {
		return fmt.Errorf("%w (%w): the agent pinned at %s comes from another meshwarp build. Nothing was changed; "+
			"to switch builds run `meshwarp cleanup --pin-dir %s` (open accelerated connections keep working "+
			"until they close), then start this build", ErrLayoutMismatch, errors.Join(errs...), pinDir, pinDir)
	}
	return nil
}

// pinnedMapBTF returns the types a pinned map was created with (nil if the
// kernel keeps none for it).
func pinnedMapBTF(path string) (*btf.Spec, error) {
	m, err := ebpf.LoadPinnedMap(path, &ebpf.LoadPinOptions{ReadOnly: true})
	if err != nil {
		return nil, fmt.Errorf("open pinned map: %w", err)
	}
	defer m.Close()
	info, err := m.Info()
	if err != nil {
		return nil, fmt.Errorf("map info: %w", err)
	}
	id, ok := info.BTFID()
	if !ok {
		return nil, nil
	}
	h, err := btf.NewHandleFromID(id)
	if err != nil {
		return nil, fmt.Errorf("load the pinned map's BTF: %w", err)
	}
	defer h.Close()
	s, err := h.Spec(nil)
	if err != nil {
		return nil, fmt.Errorf("parse the pinned map's BTF: %w", err)
	}
	return s, nil
}

// compareTypes checks that the map's named key and value types mean the
// same in the pinned maps' types as in this build.
func compareTypes(pinned []*btf.Spec, ms *ebpf.MapSpec) error {
	for _, t := range []btf.Type{ms.Key, ms.Value} {
		if t == nil || t.TypeName() == "" {
			continue // anonymous or scalar: its size is checked on load
		}
		var candidates []btf.Type // a struct and a typedef may share a name
		for _, p := range pinned {
			c, _ := p.AnyTypesByName(t.TypeName())
			candidates = append(candidates, c...)
		}
		if len(candidates) == 0 {
			return fmt.Errorf("type %s is not in the pinned maps' type information", t.TypeName())
		}
		if !slices.ContainsFunc(candidates, func(c btf.Type) bool { return layoutOf(c) == layoutOf(t) }) {
			return fmt.Errorf("type %s differs: %s", t.TypeName(), layoutDiff(layoutOf(candidates[0]), layoutOf(t)))
		}
	}
	return nil
}

// layoutDiff names the members only one of two layouts has.
func layoutDiff(pinned, here string) string {
	split := func(s string) []string {
		return strings.FieldsFunc(s, func(r rune) bool { return r == ';' || r == '{' })
	}
	a, b := split(pinned), split(here)
	var out []string
	for _, x := range a {
		if !slices.Contains(b, x) {
			out = append(out, "pinned has "+x)
		}
	}
	for _, x := range b {
		if !slices.Contains(a, x) {
			out = append(out, "this build has "+x)
		}
	}
	return strings.Join(out, "; ")
}

// layoutOf renders what a type's bytes mean: kinds, names, sizes and
// offsets, recursively. Qualifiers and typedef names do not change bytes.
func layoutOf(t btf.Type) string {
	var b strings.Builder
	writeLayout(&b, t, 0)
	return b.String()
}

func writeLayout(b *strings.Builder, t btf.Type, depth int) {
	if depth > 16 {
		b.WriteString("...")
		return
	}
	switch v := t.(type) {
	case *btf.Typedef:
		writeLayout(b, v.Type, depth+1)
	case *btf.Volatile:
		writeLayout(b, v.Type, depth+1)
	case *btf.Const:
		writeLayout(b, v.Type, depth+1)
	case *btf.Restrict:
		writeLayout(b, v.Type, depth+1)
	case *btf.Int:
		fmt.Fprintf(b, "int%d", v.Size*8)
		if v.Encoding&btf.Signed != 0 {
			b.WriteString("s")
		}
	case *btf.Enum:
		fmt.Fprintf(b, "enum %s:%d{", v.Name, v.Size)
		for _, val := range v.Values {
			fmt.Fprintf(b, "%s=%d,", val.Name, val.Value)
		}
		b.WriteString("}")
	case *btf.Array:
		fmt.Fprintf(b, "[%d]", v.Nelems)
		writeLayout(b, v.Type, depth+1)
	case *btf.Pointer:
		b.WriteString("ptr")
	case *btf.Struct:
		writeMembers(b, "struct "+v.Name, v.Size, v.Members, depth)
	case *btf.Union:
		writeMembers(b, "union "+v.Name, v.Size, v.Members, depth)
	default:
		fmt.Fprintf(b, "%T", t)
	}
}

func writeMembers(b *strings.Builder, head string, size uint32, members []btf.Member, depth int) {
	fmt.Fprintf(b, "%s:%d{", head, size)
	for _, m := range members {
		fmt.Fprintf(b, "%s@%d", m.Name, m.Offset)
		if m.BitfieldSize > 0 {
			fmt.Fprintf(b, ":%d", m.BitfieldSize)
		}
		b.WriteString(" ")
		writeLayout(b, m.Type, depth+1)
		b.WriteString(";")
	}
	b.WriteString("}")
}
