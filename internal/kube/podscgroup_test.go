// SPDX-License-Identifier: Apache-2.0

package kube

import (
	"strings"
	"testing"
)

func TestPodsCgroupOf(t *testing.T) {
	for in, want := range map[string]string{
		"/meshwarp-cluster/kubepods/burstable/pod1/c1":                        "/meshwarp-cluster/kubepods",
		"/kubepods/besteffort/pod1/c1":                                        "/kubepods",
		"/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-p.slice": "/kubepods.slice",
		"/":                     "",
		"/system.slice/x.scope": "",
		"/kubepodsX/besteffort": "",
	} {
		if got := podsCgroupOf(in); got != want {
			t.Errorf("podsCgroupOf(%q) = %q, want %q", in, got, want)
		}
	}
}

func TestOwnCgroup2(t *testing.T) {
	got, err := ownCgroup2(strings.NewReader("12:memory:/kubepods/x\n0::/kubepods/besteffort/pod1/c1\n"))
	if err != nil || got != "/kubepods/besteffort/pod1/c1" {
		t.Fatalf("ownCgroup2 = %q, %v", got, err)
	}
	if _, err := ownCgroup2(strings.NewReader("1:cpu:/\n")); err == nil {
		t.Fatal("no error without a v2 entry")
	}
}
