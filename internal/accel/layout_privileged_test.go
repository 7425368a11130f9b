// SPDX-License-Identifier: Apache-2.0

package accel

import (
	"errors"
	"maps"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/btf"
	"github.com/cilium/ebpf/link"

	"github.com/meshwarp/meshwarp/internal/testutil"
)

// otherBuild returns this build's object with one field renamed, as a
// later build that changed what those bytes mean at the same size would be.
func otherBuild(t *testing.T, mapName, field string) *ebpf.CollectionSpec {
	t.Helper()
	spec, err := loadAccel()
	if err != nil {
		t.Fatal(err)
	}
	var st *btf.Struct
	for _, typ := range []btf.Type{spec.Maps[mapName].Key, spec.Maps[mapName].Value} {
		if s, ok := btf.UnderlyingType(typ).(*btf.Struct); ok && slices.ContainsFunc(s.Members, func(m btf.Member) bool { return m.Name == field }) {
			st = s
		}
	}
	if st == nil {
		t.Fatalf("no field %s in the types of %s", field, mapName)
	}
	for i := range st.Members {
		if st.Members[i].Name == field {
			st.Members[i].Name = field + "_v2"
		}
	}
	return spec
}

// pinState is what an upgrade must leave untouched when it refuses.
type pinState struct {
	maps  map[string]ebpf.MapID
	progs map[string]ebpf.ProgramID // per pinned link: the program it runs
}

func readPinState(t *testing.T, pinDir string) pinState {
	t.Helper()
	s := pinState{maps: map[string]ebpf.MapID{}, progs: map[string]ebpf.ProgramID{}}
	entries, err := os.ReadDir(pinDir)
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range entries {
		p := filepath.Join(pinDir, e.Name())
		if strings.HasSuffix(e.Name(), "_link") {
			l, err := link.LoadPinnedLink(p, nil)
			if err != nil {
				t.Fatalf("load %s: %v", p, err)
			}
			info, err := l.Info()
			l.Close()
			if err != nil {
				t.Fatal(err)
			}
			s.progs[e.Name()] = info.Program
			continue
		}
		m, err := ebpf.LoadPinnedMap(p, &ebpf.LoadPinOptions{ReadOnly: true})
		if err != nil {
			t.Fatalf("load %s: %v", p, err)
		}
		info, err := m.Info()
		m.Close()
		if err != nil {
			t.Fatal(err)
		}
		s.maps[e.Name()], _ = info.ID()
	}
	return s
}

// Upgrading to a build whose map layout differs, while connections stream:
// the new build refuses clearly before it changes anything (same pins, same
// maps, same programs), and the running data path loses nothing. The
// connections' slots (mw_conns) and the per-socket records (mw_sk_store)
// are covered; mw_sock_map's index and value are integers whose meaning
// comes with mw_conns'.
func TestPrivilegedUpgradeToOtherLayoutRefused(t *testing.T) {
	testutil.RequirePrivileged(t)
	a := startAgent(t, Config{})
	srv := testutil.ServeEcho(mustListen(t, "127.0.0.1:0"))
	defer srv.Close()
	target := srv.Addr().String()
	dial := func() (net.Conn, error) { return net.Dial("tcp", target) }

	stop, stopStreams := testutil.StopStreams()
	defer stopStreams()
	started := make(chan struct{}, 20)
	streams := make(chan testutil.IntegrityResult, 1)
	go func() {
		streams <- testutil.CheckIntegrity(dial, testutil.IntegrityOptions{
			Conns: 20, Messages: 30, MaxSize: 16 << 10, Seed: 5, Stop: stop, Started: started,
		})
	}()
	for range 20 {
		<-started
	}
	before := readPinState(t, a.cfg.PinDir)
	statsBefore := stats(t, a)

	for _, c := range []struct{ mapName, field string }{{accelMapMwConns, "state"}, {accelMapMwSkStore, "obs"}} {
		_, err := start(a.cfg, nil, otherBuild(t, c.mapName, c.field))
		if !errors.Is(err, ErrLayoutMismatch) {
			stopStreams()
			t.Fatalf("start with another layout of %s: err = %v, want ErrLayoutMismatch", c.mapName, err)
		}
		for _, want := range []string{c.mapName + ":", c.field, "meshwarp cleanup", "Nothing was changed"} {
			if !strings.Contains(err.Error(), want) {
				t.Errorf("refusal does not say %q: %v", want, err)
			}
		}
		t.Logf("refused: %v", err)
		after := readPinState(t, a.cfg.PinDir)
		if !maps.Equal(before.maps, after.maps) || !maps.Equal(before.progs, after.progs) {
			t.Fatalf("the refused upgrade changed the pinned state:\nbefore %+v\nafter  %+v", before, after)
		}
	}

	stopStreams()
	if err := (<-streams).Err(); err != nil {
		t.Fatalf("streams across the refused upgrade: %v", err)
	}
	checkNewConnections(t, dial, "after the refused upgrade")
	d := stats(t, a).Sub(statsBefore)
	if d.RedirectedBytes == 0 {
		t.Fatalf("the running agent stopped redirecting: %+v", d)
	}
}
