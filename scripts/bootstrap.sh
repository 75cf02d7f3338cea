#!/usr/bin/env bash
# Installs everything trainop needs on a fresh Debian/Ubuntu machine, idempotently: a second run
# only checks. Usage: scripts/bootstrap.sh demo   (run jobs locally: Python env, trainer, Open MPI)
#                     scripts/bootstrap.sh test   (also: Azurite, sshd, the local control plane)
set -euo pipefail
cd "$(dirname "$0")/.."
what=${1:-test}
export TRAINOP_CACHE=${TRAINOP_CACHE:-$PWD/.cache}
mkdir -p "$TRAINOP_CACHE"
export PIP_CACHE_DIR=${PIP_CACHE_DIR:-$TRAINOP_CACHE/pip}
export npm_config_cache=${npm_config_cache:-$TRAINOP_CACHE/npm}
say() { printf '[bootstrap %s] %s\n' "$(date +%T)" "$*" >&2; }
# Each step's seconds go to $TRAINOP_TIMINGS (when set), which .ci/run prints in its summary.
step_name="" step_start=$SECONDS
step() {
  [ -n "$step_name" ] && [ -n "${TRAINOP_TIMINGS:-}" ] && \
    printf '  %-22s %5ds\n' "$step_name" $((SECONDS - step_start)) >> "$TRAINOP_TIMINGS"
  step_name=$1 step_start=$SECONDS
}
trap 'step ""' EXIT

step apt
# --- Debian packages -------------------------------------------------------------------------
apt_packages=(openmpi-bin libopenmpi-dev openssh-server openssh-client openssl python3-venv)
# Real nodes and images: containerd + runc run pods; ipset for kube-router's NetworkPolicy
# controller; mmdebstrap, buildah and podman build images.
[ "$what" = test ] && apt_packages+=(containerd runc iptables ipset conntrack buildah podman mmdebstrap uidmap)
[ "$what" = test ] && ! command -v npm >/dev/null && apt_packages+=(nodejs npm)  # Azurite
missing=()
for pkg in "${apt_packages[@]}"; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
if ((${#missing[@]})); then
  say "apt: installing ${missing[*]}"
  sudo_=""; [ "$(id -u)" = 0 ] || sudo_="sudo"
  $sudo_ apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo_ apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

step python
# --- Python: one virtualenv for the operator, the trainer and the test tools -----------------
if [ ! -x .venv/bin/python ]; then
  say "creating .venv"
  python3 -m venv .venv
  .venv/bin/pip install -q --upgrade pip
fi
stamp=.venv/.trainop-installed
want=$(cat pyproject.toml trainer_images/trainer/pyproject.toml 2>/dev/null | sha256sum | cut -c1-16)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  say "pip: installing trainop (editable) with test tools and TensorBoard"
  .venv/bin/pip install -q -e '.[test,tensorboard]'
  echo "$want" > "$stamp"
fi
step trainer
say "trainer: frameworks and the patched Horovod wheel (cached under $TRAINOP_CACHE)"
TRAINOP_PYTHON="$PWD/.venv/bin/python" bash trainer_images/install.sh all
[ "$what" = demo ] && exit 0

step azurite
# --- Node: Azurite, the real Blob Storage emulator ----------------------------------------------
if [ ! -x node_modules/.bin/azurite-blob ]; then
  say "npm: installing Azurite"
  npm install --no-audit --no-fund --loglevel=error
fi

# --- Go: the real Kubernetes control plane, etcd and KWOK (cached by version) -----------------
command -v go >/dev/null || { echo "bootstrap: Go >= 1.26 is needed to build the local control plane" >&2; exit 1; }
step kubernetes
.venv/bin/trainop devcluster build >/dev/null
step kueue
.venv/bin/python -m trainop.devcluster.kueue >/dev/null  # the real Kueue controller, for the quota tests
step helm
scripts/install-helm.sh >/dev/null
step images
# The project's images, built from its Dockerfiles on a Debian base (cached by content hash).
.venv/bin/trainop devcluster images >/dev/null
say "ready"
