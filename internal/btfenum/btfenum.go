// SPDX-License-Identifier: Apache-2.0

// Package btfenum reads the names of a C enum from a BPF object's BTF, so
// that reason and direction names are defined once, in the C header.
package btfenum

import (
	"fmt"
	"strings"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/btf"
)

// Names lists the values of enum in spec's BTF by value, lower-cased and
// without prefix (MW_REASON_NO_PEER -> "no_peer"); "MAX" is left out.
func Names(spec *ebpf.CollectionSpec, enum, prefix string) ([]string, error) {
	var e *btf.Enum
	if err := spec.Types.TypeByName(enum, &e); err != nil {
		return nil, fmt.Errorf("enum %s not in the object's BTF: %w", enum, err)
	}
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
	return names, nil
}
