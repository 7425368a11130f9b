// SPDX-License-Identifier: Apache-2.0

package crossnode

import (
	"testing"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/btf"

	"github.com/meshwarp/meshwarp/internal/testutil"
)

// TestPrivilegedLoadsWithoutNetfilterTypes: on kernels where nf_tables,
// x_tables and nf_nat are modules, the kernel's BTF may lack their types.
// The programs must still load (the netfilter digest then covers the hook
// lists only), so the object is loaded against this kernel's BTF with those
// types renamed away.
func TestPrivilegedLoadsWithoutNetfilterTypes(t *testing.T) {
	testutil.RequirePrivileged(t)
	kernel, err := btf.LoadKernelSpec()
	if err != nil {
		t.Fatal(err)
	}
	kernel = kernel.Copy()
	hidden := map[string]bool{"nft_chain": true, "nft_base_chain": true, "xt_table": true, "nf_nat_lookup_hook_priv": true}
	found := 0
	for typ, err := range kernel.All() {
		if err != nil {
			t.Fatal(err)
		}
		if s, ok := typ.(*btf.Struct); ok && hidden[s.Name] {
			s.Name = "meshwarp_hidden_" + s.Name
			found++
		}
	}
	// Where netfilter is built as modules (Debian's kernels), vmlinux's BTF
	// lacks the types already: the copy is the case as it is.
	t.Logf("renamed %d of the %d types in vmlinux's BTF (the rest are in modules or absent)", found, len(hidden))
	for name := range hidden {
		if _, err := kernel.AnyTypeByName(name); err == nil {
			t.Fatalf("the types given to the loader still name %s: the case proves nothing", name)
		}
	}
	for _, types := range []*btf.Spec{nil, kernel} {
		spec, err := loadCrossnode()
		if err != nil {
			t.Fatal(err)
		}
		for _, m := range spec.Maps {
			m.Pinning = ebpf.PinNone
		}
		var objs crossnodeObjects
		if err := spec.LoadAndAssign(&objs, &ebpf.CollectionOptions{Programs: ebpf.ProgramOptions{KernelTypes: types}}); err != nil {
			t.Fatalf("load with the netfilter types %s: %v", map[bool]string{true: "hidden", false: "present"}[types != nil], err)
		}
		objs.Close()
	}
}
