// SPDX-License-Identifier: Apache-2.0

package bench

import (
	"context"
	"net/netip"
	"os/exec"
)

// fakeEnv is a lab that is not there: for building configs in unit tests.
type fakeEnv struct{}

func (fakeEnv) ServerIP() netip.Addr                  { return netip.MustParseAddr("10.0.0.3") }
func (fakeEnv) HTTPPort() int                         { return 8080 }
func (fakeEnv) TCPEchoPort() int                      { return 8078 }
func (fakeEnv) QperfPorts() (int, int)                { return 19765, 0 }
func (fakeEnv) SetCapture(bool) error                 { return nil }
func (fakeEnv) CgroupPath() string                    { return "/nonexistent" }
func (fakeEnv) AgentTargets() []AgentTarget           { return []AgentTarget{{Cgroup: "/nonexistent"}} }
func (fakeEnv) RestartSidecars(context.Context) error { return nil }
func (fakeEnv) ClientCommand(ctx context.Context, name string, args ...string) *exec.Cmd {
	return exec.CommandContext(ctx, name, args...)
}
func (fakeEnv) ServerCommand(ctx context.Context, name string, args ...string) *exec.Cmd {
	return exec.CommandContext(ctx, name, args...)
}
func (fakeEnv) OutsideServerCommand(ctx context.Context, name string, args ...string) *exec.Cmd {
	return exec.CommandContext(ctx, name, args...)
}
