// SPDX-License-Identifier: Apache-2.0

package kube

import (
	"context"
	"errors"
	"testing"

	appsv1 "k8s.io/api/apps/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"
)

func TestDaemonSetStays(t *testing.T) {
	ref := DaemonSetRef{Namespace: "mesh", Name: "meshwarp"}
	now := metav1.Now()
	live := &appsv1.DaemonSet{ObjectMeta: metav1.ObjectMeta{Namespace: "mesh", Name: "meshwarp"}}
	deleting := live.DeepCopy()
	deleting.DeletionTimestamp = &now
	deleting.Finalizers = []string{"foregroundDeletion"}
	forbidden := fake.NewClientset()
	forbidden.PrependReactor("get", "daemonsets", func(k8stesting.Action) (bool, runtime.Object, error) {
		return true, nil, errors.New("forbidden: rolebinding removed")
	})
	for _, tc := range []struct {
		name   string
		client *fake.Clientset
		want   bool
	}{
		{"rolling update: the daemonset stays", fake.NewClientset(live), true},
		{"helm uninstall: the daemonset is gone", fake.NewClientset(), false},
		{"foreground deletion in progress", fake.NewClientset(deleting), false},
		{"unreadable (RBAC gone first)", forbidden, false},
		{"another daemonset of the same name elsewhere", fake.NewClientset(&appsv1.DaemonSet{ObjectMeta: metav1.ObjectMeta{Namespace: "other", Name: "meshwarp"}}), false},
	} {
		got, why := DaemonSetStays(context.Background(), tc.client, ref)
		if got != tc.want {
			t.Errorf("%s: stays = %v (%s), want %v", tc.name, got, why, tc.want)
		}
	}
}

func TestParseDaemonSetRef(t *testing.T) {
	if r, err := ParseDaemonSetRef("mesh/meshwarp"); err != nil || r.Namespace != "mesh" || r.Name != "meshwarp" {
		t.Fatalf("parse: %+v %v", r, err)
	}
	for _, bad := range []string{"", "meshwarp", "/meshwarp", "mesh/", "a/b/c"} {
		if _, err := ParseDaemonSetRef(bad); err == nil {
			t.Errorf("%q accepted", bad)
		}
	}
}
