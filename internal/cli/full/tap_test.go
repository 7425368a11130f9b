// SPDX-License-Identifier: Apache-2.0

package full

import (
	"bytes"
	"context"
	"path/filepath"
	"strings"
	"testing"

	"github.com/meshwarp/meshwarp/internal/cli"
)

// Bad input to tap fails before anything is attached, naming the problem.
func TestTapRefusesBadInput(t *testing.T) {
	noAgent := filepath.Join(t.TempDir(), "no-agent")
	out := filepath.Join(t.TempDir(), "x.pcapng")
	for _, tc := range []struct {
		args []string
		code int
		want string
	}{
		{[]string{"tap", "-w", out, "--pod", "meshwarp-no-such-pod"}, cli.ExitUsage, "no network namespace /run/netns/meshwarp-no-such-pod"},
		{[]string{"tap", "-w", out, "--pin-dir", noAgent}, cli.ExitNotReady, "no meshwarp agent is attached"},
		{[]string{"tap", "-w", "/nonexistent-dir/x.pcapng", "--pin-dir", noAgent}, cli.ExitUsage, "cannot write /nonexistent-dir/x.pcapng"},
		{[]string{"tap", "-w", out, "--snaplen", "0"}, cli.ExitUsage, "--snaplen 0"},
		{[]string{"tap", "-w", out, "--pod", "a", "--netns", "/proc/1/ns/net"}, cli.ExitUsage, "give one"},
	} {
		root := NewRootCommand()
		root.SetArgs(tc.args)
		var stdout bytes.Buffer
		root.SetOut(&stdout)
		root.SetErr(&stdout)
		err := root.ExecuteContext(context.Background())
		if err == nil || cli.ExitCode(err) != tc.code || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("meshwarp %s: exit %d, %v; want exit %d and %q", strings.Join(tc.args, " "), cli.ExitCode(err), err, tc.code, tc.want)
		}
	}
}
