// SPDX-License-Identifier: Apache-2.0

// Package version holds build information, set with -ldflags at release time.
package version

import "runtime"

// Version is overridden with -ldflags "-X .../internal/version.Version=v1.2.3".
var Version = "dev"

// String is the one-line version shown by `meshwarp version` and build_info.
func String() string { return "meshwarp " + Version + " " + runtime.Version() }
