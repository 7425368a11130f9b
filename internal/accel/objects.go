// SPDX-License-Identifier: Apache-2.0

package accel

import (
	"fmt"
	"reflect"
	"sync"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"
)

// The Go side of the accel object (bpf/accel/accel.bpf.c) goes through the
// names bpf2go generates: programs, maps and constants are fields of
// accelSpecs and accelObjects, and their BPF names (the pin names of the
// maps too) are the generated accelMap*, accelProg* and accelVar* constants,
// never written here.

// objectSpec is the object as built, parsed once on first use. It is only
// read; a load takes a fresh copy (loadAccel).
var objectSpec = sync.OnceValues(loadAccel)

// assignSpecs returns spec's programs, maps and constants by generated name.
func assignSpecs(spec *ebpf.CollectionSpec) (*accelSpecs, error) {
	var s accelSpecs
	if err := spec.Assign(&s); err != nil {
		return nil, fmt.Errorf("find the accel object's programs, maps and constants: %w", err)
	}
	return &s, nil
}

// tapOnly are the objects only `meshwarp tap` loads (bpf/accel/tap.h): the
// agent never loads them.
var tapOnly = []string{
	accelProgMwSkmsgTap, accelMapMwTapRing, accelMapMwTapScratch, accelMapMwTapCounters,
	accelVarTapSnaplen, accelVarTapPort, accelVarTapNetns,
}

// loadObjects loads the fields of objs whose BPF names want accepts (and
// the maps and constants they use); the other fields stay nil. It is
// spec.LoadAndAssign on a part of the generated accelObjects, so every
// caller uses the generated field names and loads only what it runs.
func loadObjects(spec *ebpf.CollectionSpec, objs *accelObjects, opts *ebpf.CollectionOptions, want func(name string) bool) error {
	dst := reflect.ValueOf(objs).Elem()
	var (
		fields []reflect.StructField
		index  [][]int
	)
	for _, f := range reflect.VisibleFields(dst.Type()) {
		name, ok := f.Tag.Lookup("ebpf")
		if !ok || f.Anonymous || !want(name) {
			continue
		}
		fields = append(fields, reflect.StructField{Name: f.Name, Type: f.Type, Tag: f.Tag})
		index = append(index, f.Index)
	}
	part := reflect.New(reflect.StructOf(fields))
	if err := spec.LoadAndAssign(part.Interface(), opts); err != nil {
		return err
	}
	for i, idx := range index {
		dst.FieldByIndex(idx).Set(part.Elem().Field(i))
	}
	return nil
}

// constant is one load-time setting, by its generated variable spec.
type constant struct {
	v   *ebpf.VariableSpec
	val any
}

// setConstants sets each constant before load.
func setConstants(cs ...constant) error {
	for _, c := range cs {
		if err := c.v.Set(c.val); err != nil {
			return fmt.Errorf("set %s: %w", c.v.Name, err)
		}
	}
	return nil
}

// standInProgram is a program every kernel loads, put in place of one whose
// attach target this kernel lacks so that the rest of the object loads; it
// is never attached.
func standInProgram(name string) *ebpf.ProgramSpec {
	return &ebpf.ProgramSpec{
		Name:         name,
		Type:         ebpf.SocketFilter,
		License:      "Dual BSD/GPL",
		Instructions: asm.Instructions{asm.Mov.Imm(asm.R0, 0), asm.Return()},
	}
}
