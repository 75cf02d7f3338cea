#!/usr/bin/env bash
# Installs helm (built from source through the Go module proxy) into the cache, keyed by version,
# and prints its path. Idempotent: a cached binary of the wanted version is reused.
#   scripts/install-helm.sh            -> $TRAINOP_CACHE/bin/helm-v3.22.0 (+ a `helm` link)
#   HELM_VERSION=v3.x.y scripts/install-helm.sh
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
version=${HELM_VERSION:-v3.22.0}
bin_dir=${TRAINOP_CACHE:-$repo/.cache}/bin
target=$bin_dir/helm-$version
if [ ! -x "$target" ]; then
  command -v go >/dev/null || { echo "install-helm: Go is needed to build helm $version" >&2; exit 1; }
  mkdir -p "$bin_dir"
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  echo "install-helm: building helm $version (a few minutes on 2 cores)" >&2
  # GOFLAGS from the environment (e.g. -mod=vendor) must not leak into a module-mode install.
  GOBIN=$tmp GOFLAGS= CGO_ENABLED=0 go install -trimpath -ldflags='-s -w' \
    "helm.sh/helm/v3/cmd/helm@$version"
  mv "$tmp/helm" "$target"
fi
ln -sfn "helm-$version" "$bin_dir/helm"
echo "$target"
