// SPDX-License-Identifier: Apache-2.0

// Package helm tests the chart in deploy/helm/meshwarp with Helm's own
// packages: it renders, lints, validates its values, every object decodes
// strictly into its typed API struct, and the agent's flags parse with the
// real `meshwarp-agent run` command (what the image runs).
package helm

import (
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	monitoringv1 "github.com/prometheus-operator/prometheus-operator/pkg/apis/monitoring/v1"
	"helm.sh/helm/v3/pkg/chart"
	"helm.sh/helm/v3/pkg/chart/loader"
	"helm.sh/helm/v3/pkg/chartutil"
	"helm.sh/helm/v3/pkg/engine"
	"helm.sh/helm/v3/pkg/lint"
	"helm.sh/helm/v3/pkg/lint/support"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	"sigs.k8s.io/yaml"

	"github.com/meshwarp/meshwarp/internal/cli"
	"github.com/meshwarp/meshwarp/internal/config"
)

const (
	chartDir  = "meshwarp"
	namespace = "meshwarp-system"
)

func loadChart(t *testing.T) *chart.Chart {
	t.Helper()
	c, err := loader.Load(chartDir)
	if err != nil {
		t.Fatal(err)
	}
	return c
}

func userValues(t *testing.T, file string) map[string]any {
	t.Helper()
	if file == "" {
		return map[string]any{}
	}
	v, err := chartutil.ReadValuesFile(file)
	if err != nil {
		t.Fatal(err)
	}
	return v
}

// render returns the rendered manifests by template name (empty ones dropped).
func render(t *testing.T, c *chart.Chart, vals map[string]any) map[string]string {
	t.Helper()
	rv, err := chartutil.ToRenderValues(c, vals, chartutil.ReleaseOptions{Name: "meshwarp", Namespace: namespace, IsInstall: true}, chartutil.DefaultCapabilities)
	if err != nil {
		t.Fatalf("values: %v", err)
	}
	out, err := engine.Render(c, rv)
	if err != nil {
		t.Fatalf("render: %v", err)
	}
	for name, s := range out {
		if strings.TrimSpace(s) == "" || strings.HasSuffix(name, "NOTES.txt") {
			delete(out, name)
		}
	}
	return out
}

// objects decodes every document strictly into its typed struct.
func objects(t *testing.T, manifests map[string]string) map[string]any {
	t.Helper()
	typed := map[string]func() any{
		"DaemonSet":      func() any { return &appsv1.DaemonSet{} },
		"ServiceAccount": func() any { return &corev1.ServiceAccount{} },
		"ConfigMap":      func() any { return &corev1.ConfigMap{} },
		"Service":        func() any { return &corev1.Service{} },
		"Role":           func() any { return &rbacv1.Role{} },
		"RoleBinding":    func() any { return &rbacv1.RoleBinding{} },
		"ServiceMonitor": func() any { return &monitoringv1.ServiceMonitor{} },
	}
	out := map[string]any{}
	for _, name := range slices.Sorted(maps.Keys(manifests)) {
		for _, doc := range strings.Split(manifests[name], "\n---") {
			if strings.TrimSpace(strings.ReplaceAll(doc, "---", "")) == "" {
				continue
			}
			var head struct{ Kind string }
			if err := yaml.Unmarshal([]byte(doc), &head); err != nil {
				t.Fatalf("%s: %v", name, err)
			}
			newObj, ok := typed[head.Kind]
			if !ok {
				t.Fatalf("%s: kind %q has no typed decoder in this test", name, head.Kind)
			}
			obj := newObj()
			if err := yaml.UnmarshalStrict([]byte(doc), obj); err != nil {
				t.Fatalf("%s (%s) does not decode strictly: %v\n%s", name, head.Kind, err, doc)
			}
			out[head.Kind] = obj
		}
	}
	return out
}

func TestChartRendersAndDecodes(t *testing.T) {
	c := loadChart(t)
	for _, file := range []string{"", "testdata/every-option.yaml"} {
		t.Run("values="+filepath.Base(file), func(t *testing.T) {
			objs := objects(t, render(t, c, userValues(t, file)))
			ds := objs["DaemonSet"].(*appsv1.DaemonSet)
			agent := ds.Spec.Template.Spec.Containers[0]
			caps := agent.SecurityContext.Capabilities
			if agent.SecurityContext.Privileged == nil || *agent.SecurityContext.Privileged || len(caps.Drop) != 1 || caps.Drop[0] != "ALL" {
				t.Errorf("the agent must drop ALL and not be privileged: %+v", agent.SecurityContext)
			}
			// Only cross-node forwarding (every-option.yaml) needs the node's network namespace.
			if hostNet := ds.Spec.Template.Spec.HostNetwork; hostNet != (file != "") {
				t.Errorf("hostNetwork %v with values %q: want it only with crossNode.enabled", hostNet, file)
			}
			policy := objs["ConfigMap"].(*corev1.ConfigMap).Data["policy.yaml"]
			f := filepath.Join(t.TempDir(), "policy.yaml")
			os.WriteFile(f, []byte(policy), 0o644)
			pf, err := config.Load(f)
			if err != nil {
				t.Fatalf("the rendered policy file does not load: %v\n%s", err, policy)
			}
			if _, err := pf.Policy(); err != nil {
				t.Fatalf("the rendered policy is invalid: %v\n%s", err, policy)
			}
			if file != "" {
				if _, ok := objs["ServiceMonitor"]; !ok {
					t.Error("serviceMonitor.enabled rendered no ServiceMonitor")
				}
				if _, ok := objs["Service"]; ok {
					t.Error("metrics.service.enabled=false still rendered a Service")
				}
				if !strings.Contains(policy, `"9000-9010"`) || !strings.Contains(policy, "fd00::/8") {
					t.Errorf("policy values lost:\n%s", policy)
				}
			}
		})
	}
}

// The rendered container args are parsed by the real `meshwarp-agent run`,
// the command the image runs.
func TestChartArgsParseWithTheAgent(t *testing.T) {
	c := loadChart(t)
	for _, file := range []string{"", "testdata/every-option.yaml"} {
		objs := objects(t, render(t, c, userValues(t, file)))
		agent := objs["DaemonSet"].(*appsv1.DaemonSet).Spec.Template.Spec.Containers[0]
		args := slices.Clone(agent.Args)
		for i, a := range args { // what the kubelet substitutes
			args[i] = strings.ReplaceAll(a, "$(POD_NAMESPACE)", namespace)
		}
		root := cli.NewAgentCommand()
		cmd, rest, err := root.Find(args)
		if err != nil || cmd.Name() != "run" {
			t.Fatalf("%s: args %q do not name the run command: %v", file, args, err)
		}
		if err := cmd.ParseFlags(rest); err != nil {
			t.Fatalf("%s: `meshwarp-agent run` rejects the chart's args %q: %v", file, args, err)
		}
		if err := cmd.ValidateArgs(cmd.Flags().Args()); err != nil {
			t.Fatalf("%s: %v", file, err)
		}
		d, _ := cmd.Flags().GetDuration("unpaired-timeout")
		if d < time.Millisecond || d > time.Minute {
			t.Errorf("%s: unpaired timeout %v outside what run accepts", file, d)
		}
		keep, _ := cmd.Flags().GetString("keep-on-exit-while-daemonset")
		if file == "" && keep != namespace+"/meshwarp" {
			t.Errorf("default values: keep-on-exit-while-daemonset = %q, want the release's DaemonSet", keep)
		}
		if file != "" && keep != "" {
			t.Errorf("keepDataPathOnUpdate=false still keeps: %q", keep)
		}
		crossNode, _ := cmd.Flags().GetBool("cross-node")
		uplinks, _ := cmd.Flags().GetStringSlice("uplinks")
		if crossNode != (file != "") || (file != "" && !slices.Equal(uplinks, []string{"eth0", "eth1"})) {
			t.Errorf("%s: --cross-node %v --uplinks %v, want them from crossNode values", file, crossNode, uplinks)
		}
		cfg, _ := cmd.Flags().GetString("config")
		if mounted := agent.VolumeMounts; !slices.ContainsFunc(mounted, func(m corev1.VolumeMount) bool { return strings.HasPrefix(cfg, m.MountPath+"/") }) {
			t.Errorf("%s: --config %s is not under a mounted volume", file, cfg)
		}
	}
}

func TestChartLints(t *testing.T) {
	for _, file := range []string{"", "testdata/every-option.yaml"} {
		res := lint.All(chartDir, userValues(t, file), namespace, false)
		for _, m := range res.Messages {
			if m.Severity >= support.WarningSev {
				t.Errorf("%s: helm lint: %s", file, m)
			}
		}
	}
}

// values.schema.json rejects bad values, naming the value.
func TestChartSchemaRejectsBadValues(t *testing.T) {
	c := loadChart(t)
	for _, tc := range []struct {
		yaml, want string
	}{
		{"capacity: 0", "capacity"},
		{"capcity: 10", "capcity"},
		{"cgroupPath: kubepods", "cgroupPath"},
		{"pinDir: /tmp/pins", "pinDir"},
		{"unpairedTimeout: 10", "unpairedTimeout"},
		{"policy: {excludePorts: [70000]}", "excludePorts"},
		{"policy: {includeCIDRs: [\"not a cidr\"]}", "includeCIDRs"},
		{"metrics: {port: 0}", "port"},
		{"keepDataPathOnUpdate: \"yes\"", "keepDataPathOnUpdate"},
		{"crossNode: {enabled: \"yes\"}", "enabled"},
		{"crossNode: {uplinks: [\"eth0,eth1\"]}", "uplinks"},
	} {
		var vals map[string]any
		if err := yaml.Unmarshal([]byte(tc.yaml), &vals); err != nil {
			t.Fatal(err)
		}
		merged, err := chartutil.CoalesceValues(c, vals)
		if err != nil {
			t.Fatal(err)
		}
		err = chartutil.ValidateAgainstSchema(c, merged)
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: schema error %v, want one naming %q", tc.yaml, err, tc.want)
		}
	}
}
