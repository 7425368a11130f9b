// SPDX-License-Identifier: Apache-2.0

// Package btfenum reads the names of a C enum from a BPF object's BTF, so
// that reason and direction names are defined once, in the C header.
package btfenum

import (
	"bytes"
	"fmt"
	"strings"
	"sync"

	"github.com/cilium/ebpf/btf"
)

// Lazy returns a constructor of name tables for the enums of the BPF object
// elf (the bytes bpf2go embeds; object names it in a panic). The object's BTF
// is parsed once, when the first table is read, and only its enums are kept:
// parsing costs megabytes, which no command should pay at package init, and
// a long-running agent should not keep.
//
// A table panics on first use when the enum is missing: the object is
// embedded, so that is a build error, which the package's tests catch.
func Lazy(object string, elf []byte) func(enum, prefix string) func() []string {
	enums := sync.OnceValues(func() (map[string]*btf.Enum, error) {
		spec, err := btf.LoadSpecFromReader(bytes.NewReader(elf))
		if err != nil {
			return nil, err
		}
		out := map[string]*btf.Enum{}
		for typ, err := range spec.All() {
			if err != nil {
				return nil, err
			}
			if e, ok := typ.(*btf.Enum); ok && e.Name != "" {
				out[e.Name] = e
			}
		}
		return out, nil
	})
	return func(enum, prefix string) func() []string {
		return sync.OnceValue(func() []string {
			all, err := enums()
			if err == nil {
				e, ok := all[enum]
				if ok {
					return names(e, prefix)
				}
				err = fmt.Errorf("enum %s not in the object's BTF", enum)
			}
			panic(fmt.Sprintf("embedded %s object: %v", object, err))
		})
	}
}

// names lists the values of e by value, lower-cased and without prefix
// (MW_REASON_NO_PEER -> "no_peer"); "MAX" is left out.
func names(e *btf.Enum, prefix string) []string {
	var names []string
	for _, v := range e.Values {
		name := strings.TrimPrefix(v.Name, prefix)
		if name == "MAX" {
			continue
		}
		for uint64(len(names)) <= v.Value {
			names = append(names, "")
		}
		names[v.Value] = strings.ToLower(name)
	}
	return names
}
