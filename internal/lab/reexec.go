// SPDX-License-Identifier: Apache-2.0

package lab

import "os"

// The lab and the bench run helpers inside pods (the apps, the load
// generator) by re-executing the current binary with ReexecEnv naming the
// helper. Dispatch happens in the helper's package init (HandleReexec), so
// it works for meshwarp itself and for a `go test` binary, which has no
// command tree. The helper's argv starts with words for `ps` to show
// ("meshwarp lab serve-apps ..."); HandleReexec skips them.

// ReexecEnv names the helper a re-executed binary runs instead of main.
const ReexecEnv = "MESHWARP_REEXEC"

// ReexecEnvFor is the environment entry that selects helper name.
func ReexecEnvFor(name string) string { return ReexecEnv + "=" + name }

// HandleReexec runs main(args) and exits when this process was started as
// helper name; words are the leading argv words naming it ("lab",
// "serve-apps"), dropped from args. Call it from an init function.
func HandleReexec(name string, words []string, main func(args []string) int) {
	if os.Getenv(ReexecEnv) != name {
		return
	}
	args := os.Args[1:]
	for _, w := range words {
		if len(args) > 0 && args[0] == w {
			args = args[1:]
		}
	}
	os.Exit(main(args))
}
