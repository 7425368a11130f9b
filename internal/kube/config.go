// SPDX-License-Identifier: Apache-2.0

package kube

import (
	"crypto/tls"
	"encoding/base64"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"

	"go.yaml.in/yaml/v3"
)

// serviceAccountDir is where the kubelet mounts the pod's service account
// (token, ca.crt), as client-go's rest.InClusterConfig reads it.
const serviceAccountDir = "/var/run/secrets/kubernetes.io/serviceaccount"

// inCluster is the pod's service account: the API server from the
// KUBERNETES_SERVICE_* variables, its CA and a token read per request (the
// kubelet rotates projected tokens; an agent runs for days).
func inCluster(dir string) (*Client, error) {
	host, port := os.Getenv("KUBERNETES_SERVICE_HOST"), os.Getenv("KUBERNETES_SERVICE_PORT")
	if host == "" || port == "" {
		return nil, errors.New("not in a pod: KUBERNETES_SERVICE_HOST and KUBERNETES_SERVICE_PORT are not set")
	}
	tokenFile := filepath.Join(dir, "token")
	if _, err := readToken(tokenFile); err != nil {
		return nil, err
	}
	caFile := filepath.Join(dir, "ca.crt")
	pem, err := os.ReadFile(caFile)
	if err != nil {
		return nil, fmt.Errorf("service account CA: %w", err)
	}
	pool, err := caPool(pem, caFile)
	if err != nil {
		return nil, err
	}
	return newClient("https://"+net.JoinHostPort(host, port), &tls.Config{RootCAs: pool, MinVersion: tls.VersionTLS12},
		func(r *http.Request) error {
			token, err := readToken(tokenFile)
			if err != nil {
				return err
			}
			return bearer(token)(r)
		})
}

func readToken(path string) (string, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return "", fmt.Errorf("token: %w", err)
	}
	token := strings.TrimSpace(string(b))
	if token == "" {
		return "", fmt.Errorf("token file %s is empty", path)
	}
	return token, nil
}

// kubeconfigFile is the part of a kubeconfig the client understands: a
// server with its CA, and a token, a token file, a client certificate or a
// user name and password. Exec and auth-provider plugins are refused.
type kubeconfigFile struct {
	CurrentContext string `yaml:"current-context"`
	Clusters       []struct {
		Name    string `yaml:"name"`
		Cluster struct {
			Server                   string `yaml:"server"`
			CertificateAuthority     string `yaml:"certificate-authority"`
			CertificateAuthorityData string `yaml:"certificate-authority-data"`
			InsecureSkipTLSVerify    bool   `yaml:"insecure-skip-tls-verify"`
			TLSServerName            string `yaml:"tls-server-name"`
		} `yaml:"cluster"`
	} `yaml:"clusters"`
	Users []struct {
		Name string `yaml:"name"`
		User struct {
			Token                 string    `yaml:"token"`
			TokenFile             string    `yaml:"tokenFile"`
			ClientCertificate     string    `yaml:"client-certificate"`
			ClientCertificateData string    `yaml:"client-certificate-data"`
			ClientKey             string    `yaml:"client-key"`
			ClientKeyData         string    `yaml:"client-key-data"`
			Username              string    `yaml:"username"`
			Password              string    `yaml:"password"`
			Exec                  yaml.Node `yaml:"exec"`
			AuthProvider          yaml.Node `yaml:"auth-provider"`
		} `yaml:"user"`
	} `yaml:"users"`
	Contexts []struct {
		Name    string `yaml:"name"`
		Context struct {
			Cluster string `yaml:"cluster"`
			User    string `yaml:"user"`
		} `yaml:"context"`
	} `yaml:"contexts"`
}

// fromKubeconfig builds a client for the current context of the file.
func fromKubeconfig(path string) (*Client, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	var kc kubeconfigFile
	if err := yaml.Unmarshal(b, &kc); err != nil {
		return nil, fmt.Errorf("kubeconfig %s: %w", path, err)
	}
	// Relative file names in a kubeconfig are relative to its directory.
	dir := filepath.Dir(path)
	rel := func(p string) string {
		if p == "" || filepath.IsAbs(p) {
			return p
		}
		return filepath.Join(dir, p)
	}
	bad := func(format string, args ...any) error {
		return fmt.Errorf("kubeconfig %s: %s", path, fmt.Sprintf(format, args...))
	}

	var clusterName, userName string
	found := false
	for _, c := range kc.Contexts {
		if c.Name == kc.CurrentContext {
			clusterName, userName, found = c.Context.Cluster, c.Context.User, true
		}
	}
	if !found {
		return nil, bad("current-context %q not among its contexts", kc.CurrentContext)
	}
	tlsConfig := &tls.Config{MinVersion: tls.VersionTLS12}
	server := ""
	for _, c := range kc.Clusters {
		if c.Name != clusterName {
			continue
		}
		server = c.Cluster.Server
		tlsConfig.ServerName = c.Cluster.TLSServerName
		tlsConfig.InsecureSkipVerify = c.Cluster.InsecureSkipTLSVerify
		pem, from, err := fileOrData(rel(c.Cluster.CertificateAuthority), c.Cluster.CertificateAuthorityData, "certificate-authority")
		if err != nil {
			return nil, bad("cluster %s: %v", clusterName, err)
		}
		if pem != nil {
			if tlsConfig.RootCAs, err = caPool(pem, from); err != nil {
				return nil, bad("cluster %s: %v", clusterName, err)
			}
		}
	}
	if server == "" {
		return nil, bad("no server for cluster %q", clusterName)
	}

	var auth func(*http.Request) error
	for _, u := range kc.Users {
		if u.Name != userName {
			continue
		}
		user := u.User
		if !user.Exec.IsZero() || !user.AuthProvider.IsZero() {
			return nil, bad("user %s: exec and auth-provider plugins are not supported: give a token, tokenFile or client certificate", userName)
		}
		cert, _, err := fileOrData(rel(user.ClientCertificate), user.ClientCertificateData, "client-certificate")
		if err != nil {
			return nil, bad("user %s: %v", userName, err)
		}
		key, _, err := fileOrData(rel(user.ClientKey), user.ClientKeyData, "client-key")
		if err != nil {
			return nil, bad("user %s: %v", userName, err)
		}
		if cert != nil || key != nil {
			pair, err := tls.X509KeyPair(cert, key)
			if err != nil {
				return nil, bad("user %s: client certificate: %v", userName, err)
			}
			tlsConfig.Certificates = []tls.Certificate{pair}
		}
		switch {
		case user.Token != "":
			auth = bearer(user.Token)
		case user.TokenFile != "":
			tokenFile := rel(user.TokenFile)
			if _, err := readToken(tokenFile); err != nil {
				return nil, bad("user %s: %v", userName, err)
			}
			auth = func(r *http.Request) error {
				token, err := readToken(tokenFile)
				if err != nil {
					return err
				}
				return bearer(token)(r)
			}
		case user.Username != "":
			name, password := user.Username, user.Password
			auth = func(r *http.Request) error { r.SetBasicAuth(name, password); return nil }
		}
	}
	c, err := newClient(server, tlsConfig, auth)
	if err != nil {
		return nil, bad("cluster %s: %v", clusterName, err)
	}
	return c, nil
}

// fileOrData returns the content of file, else the base64-decoded data
// (nil when both are empty), and where it came from.
func fileOrData(file, data, field string) ([]byte, string, error) {
	if file != "" {
		b, err := os.ReadFile(file)
		return b, file, err
	}
	if data == "" {
		return nil, "", nil
	}
	b, err := base64.StdEncoding.DecodeString(data)
	if err != nil {
		return nil, "", fmt.Errorf("%s-data: %w", field, err)
	}
	return b, field + "-data", nil
}
