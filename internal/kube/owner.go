// SPDX-License-Identifier: Apache-2.0

// Package kube answers the one question the agent asks Kubernetes: when its
// pod stops, is this a rolling update (keep the data path pinned for the
// next pod) or an uninstall (detach and unpin)?
package kube

import (
	"context"
	"fmt"
	"strings"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
)

// DaemonSetRef names the agent's DaemonSet.
type DaemonSetRef struct {
	Namespace, Name string
}

// ParseDaemonSetRef parses "namespace/name".
func ParseDaemonSetRef(s string) (DaemonSetRef, error) {
	ns, name, ok := strings.Cut(s, "/")
	if !ok || ns == "" || name == "" || strings.Contains(name, "/") {
		return DaemonSetRef{}, fmt.Errorf("%q: want namespace/name of the agent's DaemonSet (the chart passes $(POD_NAMESPACE)/<release>)", s)
	}
	return DaemonSetRef{Namespace: ns, Name: name}, nil
}

func (r DaemonSetRef) String() string { return r.Namespace + "/" + r.Name }

// Client builds a clientset from kubeconfig, or from the pod's service
// account when kubeconfig is empty.
func Client(kubeconfig string) (kubernetes.Interface, error) {
	var cfg *rest.Config
	var err error
	if kubeconfig == "" {
		cfg, err = rest.InClusterConfig()
	} else {
		cfg, err = clientcmd.BuildConfigFromFlags("", kubeconfig)
	}
	if err != nil {
		return nil, fmt.Errorf("kubernetes client: %w", err)
	}
	cfg.Timeout = 5 * time.Second
	return kubernetes.NewForConfig(cfg)
}

// DaemonSetStays reports whether the DaemonSet exists and is not being
// deleted: then the pod stops for a rolling update or a drain and the next
// pod will adopt the pinned data path. Anything else (gone, being deleted,
// or unreadable, e.g. its RBAC already removed by `helm uninstall`) means
// uninstall: that is lossless too (open accelerated connections keep
// working), and it never leaves programs attached to a node nobody manages.
func DaemonSetStays(ctx context.Context, c kubernetes.Interface, ref DaemonSetRef) (bool, string) {
	ds, err := c.AppsV1().DaemonSets(ref.Namespace).Get(ctx, ref.Name, metav1.GetOptions{})
	switch {
	case apierrors.IsNotFound(err):
		return false, "daemonset " + ref.String() + " is gone"
	case err != nil:
		return false, fmt.Sprintf("daemonset %s unreadable: %v", ref, err)
	case ds.DeletionTimestamp != nil:
		return false, "daemonset " + ref.String() + " is being deleted"
	}
	return true, "daemonset " + ref.String() + " stays (rolling update or drain)"
}
