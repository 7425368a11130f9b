#!/usr/bin/env bash
# Builds the agent image: the static meshwarp-agent binary on scratch.
# Usage: deploy/image/build.sh [IMAGE]   (default: localhost/meshwarp:<version>)
set -euo pipefail
cd "$(dirname "$0")/../.."
version=$(git describe --tags --always --dirty 2>/dev/null || echo dev)
image=${1:-localhost/meshwarp:$version}
ctx=$(mktemp -d /tmp/meshwarp-image-XXXXXX)
trap 'rm -rf "$ctx"' EXIT
echo "build.sh: compiling the static meshwarp-agent binary" >&2
CGO_ENABLED=0 go build -trimpath -ldflags "-s -w" -o "$ctx/meshwarp-agent" ./cmd/meshwarp-agent
cp deploy/image/Containerfile "$ctx/"
echo "build.sh: building $image" >&2
podman build --network none -t "$image" "$ctx" >&2
echo "$image"
