// SPDX-License-Identifier: Apache-2.0

package tap

import (
	"os"
	"testing"

	"github.com/meshwarp/meshwarp/internal/testutil"
)

// The binaries the tests build are removed when they end.
func TestMain(m *testing.M) { os.Exit(testutil.Main(m)) }
