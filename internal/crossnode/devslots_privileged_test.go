// SPDX-License-Identifier: Apache-2.0

package crossnode

import (
	"testing"

	"github.com/meshwarp/meshwarp/internal/testutil"
)

// TestPrivilegedDevSlots: the devices the programs look up by ifindex first
// (mw_xn_dev_slots) are the node's devices of mw_xn_devs, each in its slot
// with its key and value; a device gone empties its slot; a slot another
// node's device holds stays that node's (this node's device is then found in
// mw_xn_devs); a device that changes kind is rewritten.
func TestPrivilegedDevSlots(t *testing.T) {
	testutil.RequirePrivileged(t)
	a := loadUnpinned(t)
	count := a.objs.MwXnDevSlots.MaxEntries()
	me := &nodeLoop{a: a, cookie: 1001}
	other := &nodeLoop{a: a, cookie: 2002}
	key := func(n *nodeLoop, ifindex uint32) crossnodeMwXnDevKey {
		return crossnodeMwXnDevKey{NetnsCookie: n.cookie, Ifindex: ifindex}
	}
	pod := crossnodeMwXnDev{Kind: uint32(crossnodeMwXnKindMW_XN_KIND_POD), L3Ifindex: 3, Mac: [6]uint8{2, 0, 0, 0, 0, 3}}
	uplink := crossnodeMwXnDev{Kind: uint32(crossnodeMwXnKindMW_XN_KIND_UPLINK), Mac: [6]uint8{2, 0, 0, 0, 0, 4}}
	slot := func(ifindex uint32) crossnodeMwXnDevSlot {
		t.Helper()
		var s crossnodeMwXnDevSlot
		if err := a.objs.MwXnDevSlots.Lookup(ifindex%count, &s); err != nil {
			t.Fatal(err)
		}
		return s
	}
	expect := func(what string, ifindex uint32, want crossnodeMwXnDevSlot) {
		t.Helper()
		if got := slot(ifindex); got != want {
			t.Errorf("%s: slot of ifindex %d holds %+v, want %+v", what, ifindex, got, want)
		}
	}

	// The other node's device 7+count shares ifindex 7's slot and was there first.
	if err := other.syncDevSlots(map[crossnodeMwXnDevKey]crossnodeMwXnDev{key(other, 7+count): pod}, nil); err != nil {
		t.Fatal(err)
	}
	mine := map[crossnodeMwXnDevKey]crossnodeMwXnDev{key(me, 5): pod, key(me, 6): uplink, key(me, 7): pod}
	if err := me.syncDevSlots(mine, nil); err != nil {
		t.Fatal(err)
	}
	expect("new pod port", 5, crossnodeMwXnDevSlot{Key: key(me, 5), Dev: pod})
	expect("new uplink", 6, crossnodeMwXnDevSlot{Key: key(me, 6), Dev: uplink})
	expect("another node's device first", 7, crossnodeMwXnDevSlot{Key: key(other, 7+count), Dev: pod})

	// 5 becomes an uplink, 6 is gone.
	mine = map[crossnodeMwXnDevKey]crossnodeMwXnDev{key(me, 5): uplink, key(me, 7): pod}
	if err := me.syncDevSlots(mine, []crossnodeMwXnDevKey{key(me, 6)}); err != nil {
		t.Fatal(err)
	}
	expect("changed kind", 5, crossnodeMwXnDevSlot{Key: key(me, 5), Dev: uplink})
	expect("gone", 6, crossnodeMwXnDevSlot{})

	// The other node's device goes: the slot is free for ours at the next sync.
	if err := other.syncDevSlots(nil, []crossnodeMwXnDevKey{key(other, 7+count)}); err != nil {
		t.Fatal(err)
	}
	if err := me.syncDevSlots(mine, nil); err != nil {
		t.Fatal(err)
	}
	expect("freed by the other node", 7, crossnodeMwXnDevSlot{Key: key(me, 7), Dev: pod})
}
