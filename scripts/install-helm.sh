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
  echo "install-helm: building helm $version (minutes on 2 cores)" >&2
  # The link-time variables helm's own Makefile sets: without them `helm version` is blank and
  # `helm template`/`helm lint` assume Kubernetes v1.20 (and refuse kubeVersion: >=1.29).
  gomod=$(GOFLAGS= go mod download -json "helm.sh/helm/v3@$version" | sed -n 's/.*"GoMod": "\(.*\)".*/\1/p')
  k8s_minor=$(sed -n 's|^[[:space:]]*k8s.io/client-go v0\.\([0-9]*\)\..*|\1|p' "$gomod" | head -1)
  [ -n "$k8s_minor" ] || { echo "install-helm: no k8s.io/client-go version in $gomod" >&2; exit 1; }
  ldflags="-s -w -X helm.sh/helm/v3/internal/version.version=$version"
  for pkg in helm.sh/helm/v3/pkg/chartutil helm.sh/helm/v3/pkg/lint/rules; do
    ldflags+=" -X $pkg.k8sVersionMajor=1 -X $pkg.k8sVersionMinor=$k8s_minor"
  done
  # GOFLAGS from the environment (e.g. -mod=vendor) must not leak into a module-mode install.
  GOBIN=$tmp GOFLAGS= CGO_ENABLED=0 go install -trimpath -ldflags="$ldflags" "helm.sh/helm/v3/cmd/helm@$version"
  mv "$tmp/helm" "$target"
fi
ln -sfn "helm-$version" "$bin_dir/helm"
echo "$target"
