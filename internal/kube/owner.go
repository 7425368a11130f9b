// SPDX-License-Identifier: Apache-2.0

// Package kube answers the one question the agent asks Kubernetes: when its
// pod stops, is this a rolling update (keep the data path pinned for the
// next pod) or an uninstall (detach and unpin)?
//
// It is one GET of the agent's DaemonSet, so it is made with net/http, the
// pod's service account (or a kubeconfig) and a JSON decode of the two
// fields it needs, not with client-go: the clientset alone was 339 packages
// and most of the agent's binary.
package kube

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"strings"
	"time"
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

// requestTimeout bounds the GET: it runs while the pod is stopping.
const requestTimeout = 5 * time.Second

// Client reads objects from one API server.
type Client struct {
	server string // https://host:port, no trailing slash
	http   *http.Client
	// auth sets the request's credentials; it runs per request because a
	// service account token is rotated by the kubelet while the agent runs.
	auth func(*http.Request) error
}

// NewClient returns a client for kubeconfig's current context, or for the
// pod's service account when kubeconfig is empty.
func NewClient(kubeconfig string) (*Client, error) {
	var c *Client
	var err error
	if kubeconfig == "" {
		c, err = inCluster(serviceAccountDir)
	} else {
		c, err = fromKubeconfig(kubeconfig)
	}
	if err != nil {
		return nil, fmt.Errorf("kubernetes client: %w", err)
	}
	return c, nil
}

// newClient builds a Client for server with tlsConfig (nil: the system's roots).
func newClient(server string, tlsConfig *tls.Config, auth func(*http.Request) error) (*Client, error) {
	u, err := url.Parse(server)
	if err != nil || u.Host == "" || (u.Scheme != "https" && u.Scheme != "http") {
		return nil, fmt.Errorf("server %q: want https://host[:port]", server)
	}
	transport := http.DefaultTransport.(*http.Transport).Clone()
	transport.Proxy = nil // an in-cluster call; client-go's proxy env handling is not worth copying
	transport.TLSClientConfig = tlsConfig
	if auth == nil {
		auth = func(*http.Request) error { return nil }
	}
	return &Client{
		server: strings.TrimSuffix(server, "/"),
		http:   &http.Client{Transport: transport, Timeout: requestTimeout},
		auth:   auth,
	}, nil
}

// daemonSet holds the fields of an apps/v1 DaemonSet the check reads.
type daemonSet struct {
	Metadata struct {
		Name              string  `json:"name"`
		DeletionTimestamp *string `json:"deletionTimestamp"` // set: being deleted
	} `json:"metadata"`
}

// status is the API's error body (meta/v1 Status).
type status struct {
	Reason  string `json:"reason"`
	Message string `json:"message"`
}

// errNotFound: the API answered 404 for the object.
var errNotFound = errors.New("not found")

// getDaemonSet GETs /apis/apps/v1/namespaces/NS/daemonsets/NAME.
func (c *Client) getDaemonSet(ctx context.Context, ref DaemonSetRef) (*daemonSet, error) {
	u := c.server + "/apis/apps/v1/namespaces/" + url.PathEscape(ref.Namespace) + "/daemonsets/" + url.PathEscape(ref.Name)
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, u, nil)
	if err != nil {
		return nil, err
	}
	req.Header.Set("Accept", "application/json")
	if err := c.auth(req); err != nil {
		return nil, err
	}
	resp, err := c.http.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(io.LimitReader(resp.Body, 4<<20))
	if err != nil {
		return nil, fmt.Errorf("read response: %w", err)
	}
	switch {
	case resp.StatusCode == http.StatusNotFound:
		return nil, errNotFound
	case resp.StatusCode != http.StatusOK:
		var s status
		if json.Unmarshal(body, &s) == nil && s.Message != "" {
			return nil, fmt.Errorf("%s (%s): %s", resp.Status, s.Reason, s.Message)
		}
		return nil, fmt.Errorf("%s: %.200s", resp.Status, body)
	}
	var ds daemonSet
	if err := json.Unmarshal(body, &ds); err != nil {
		return nil, fmt.Errorf("decode daemonset: %w", err)
	}
	return &ds, nil
}

// DaemonSetStays reports whether the DaemonSet exists and is not being
// deleted: then the pod stops for a rolling update or a drain and the next
// pod will adopt the pinned data path. Anything else (gone, being deleted,
// or unreadable, e.g. its RBAC already removed by `helm uninstall`) means
// uninstall: that is lossless too (open accelerated connections keep
// working), and it never leaves programs attached to a node nobody manages.
func (c *Client) DaemonSetStays(ctx context.Context, ref DaemonSetRef) (bool, string) {
	ds, err := c.getDaemonSet(ctx, ref)
	switch {
	case errors.Is(err, errNotFound):
		return false, "daemonset " + ref.String() + " is gone"
	case err != nil:
		return false, fmt.Sprintf("daemonset %s unreadable: %v", ref, err)
	case ds.Metadata.DeletionTimestamp != nil:
		return false, "daemonset " + ref.String() + " is being deleted"
	}
	return true, "daemonset " + ref.String() + " stays (rolling update or drain)"
}

// bearer authenticates with a fixed token.
func bearer(token string) func(*http.Request) error {
	return func(r *http.Request) error {
		r.Header.Set("Authorization", "Bearer "+token)
		return nil
	}
}

// caPool parses PEM certificates.
func caPool(pem []byte, from string) (*x509.CertPool, error) {
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(pem) {
		return nil, fmt.Errorf("%s: no PEM certificate", from)
	}
	return pool, nil
}
