#!/usr/bin/env bash
# Installs what a Makefile target needs on a fresh Debian/Ubuntu machine, idempotently: a second
# run only checks, and `test` after `demo` adds only what `demo` left out.
#
#   scripts/bootstrap.sh demo    `make demo`: `trainop run --local` of the PyTorch + Horovod example.
#                                Open MPI, OpenSSH, a compiler; .venv with trainop and the trainer;
#                                PyTorch; Horovod built for PyTorch. No TensorFlow, no test tools.
#   scripts/bootstrap.sh test    `make test` (CI): also the test tools, TensorFlow (Horovod rebuilt
#                                with it), Azurite, the local control plane, Kueue, Helm, the images.
#   scripts/bootstrap.sh --plan demo|test   prints what the target installs, phase by phase, and
#                                installs nothing.
#
# Stdout gets one line per phase with its time; all the phases print (apt, pip, the compilers'
# warnings, npm, go) goes to a log file, $TRAINOP_BOOTSTRAP_LOG (default
# .cache/logs/bootstrap-<target>.log), whose path is printed first, and again with its last lines
# when a phase fails. Python dependencies live in the pyproject files (this package's extra `test`,
# the trainer's `pytorch` and `tensorflow`): add new ones there, not here.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/progress.sh
plan=0
if [[ ${1:-} == --plan ]]; then plan=1; shift; fi
target=${1:-test}
case $target in
  demo | test) ;;
  *) echo "usage: scripts/bootstrap.sh [--plan] demo|test" >&2; exit 2 ;;
esac
export TRAINOP_CACHE=${TRAINOP_CACHE:-$PWD/.cache}
export PIP_CACHE_DIR=${PIP_CACHE_DIR:-$TRAINOP_CACHE/pip}
export npm_config_cache=${npm_config_cache:-$TRAINOP_CACHE/npm}
export PIP_DISABLE_PIP_VERSION_CHECK=1
PY=$PWD/.venv/bin/python

# --- What each target installs: the one place (--plan prints it) ---------------------------
# Debian packages. demo: mpirun and sshd (the launcher reaches the workers over ssh), a compiler,
# CMake and the MPI and Python headers to build Horovod.
apt_packages=(openmpi-bin libopenmpi-dev openssh-server openssh-client openssl python3-venv python3-dev
  build-essential cmake)
if [[ $target == test ]]; then
  # Real nodes and images: containerd + runc run pods; ipset for kube-router's NetworkPolicy
  # controller; mmdebstrap, buildah and podman build images.
  apt_packages+=(containerd runc iptables ipset conntrack buildah podman mmdebstrap uidmap)
  command -v npm >/dev/null || apt_packages+=(nodejs npm)  # Azurite
fi
# pip, into .venv: trainop (with pyproject.toml's extras `test` and `tensorboard` for `test`) and the trainer, editable.
pip_specs=(-e "$([[ $target == test ]] && echo '.[test,tensorboard]' || echo .)" -e trainer_images/trainer)
frameworks=pytorch
[[ $target == test ]] && frameworks=pytorch,tensorflow
kept=""
# Never fewer frameworks than .venv has: `make demo` after `make test` must not rebuild Horovod
# without TensorFlow.
if [[ $frameworks != *tensorflow* ]] && [[ -x $PY ]] &&
  "$PY" -c 'from importlib.metadata import version; version("tensorflow")' 2>/dev/null; then
  frameworks+=,tensorflow kept="; tensorflow kept: .venv has it"
fi
install_sh() { TRAINOP_PYTHON=$PY TRAINOP_FRAMEWORKS=$frameworks bash trainer_images/install.sh "$@"; }
# The pins, read before .venv exists too (--plan on a fresh clone).
pins() {
  TRAINOP_PYTHON=$([[ -x $PY ]] && echo "$PY" || command -v python3) TRAINOP_FRAMEWORKS=$frameworks \
    bash trainer_images/install.sh pins
}

# --- The phases -------------------------------------------------------------------------------
install_apt() {
  local missing=() pkg
  for pkg in "${apt_packages[@]}"; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
  done
  if ((${#missing[@]} == 0)); then echo "apt: all installed"; return 0; fi
  echo "apt: installing ${missing[*]}"
  local sudo_=""
  [[ $(id -u) == 0 ]] || sudo_=sudo
  $sudo_ apt-get update
  DEBIAN_FRONTEND=noninteractive $sudo_ apt-get install -y --no-install-recommends "${missing[@]}"
}

install_python() {
  if [[ ! -x $PY ]]; then
    python3 -m venv .venv
    "$PY" -m pip install --upgrade pip
  fi
  # The stamp names the pyproject files' hash and the target they were installed for (`test`
  # covers `demo`), so an edited dependency list or a wider target installs again.
  local stamp=.venv/.trainop-installed want have
  want=$(cat pyproject.toml trainer_images/trainer/pyproject.toml | sha256sum | cut -c1-16)
  have=$(cat "$stamp" 2>/dev/null || true)
  if [[ $have == "$want test" || $have == "$want $target" ]]; then echo "pip: up to date ($have)"; return 0; fi
  "$PY" -m pip install "${pip_specs[@]}"
  echo "$want $target" >"$stamp"
}

install_frameworks() { install_sh frameworks; }
install_horovod() { install_sh horovod; }

install_azurite() {
  if [[ -x node_modules/.bin/azurite-blob ]]; then echo "azurite: installed"; return 0; fi
  npm install --no-audit --no-fund
}

install_control_plane() { .venv/bin/trainop devcluster build; }
install_kueue() { "$PY" -m trainop.devcluster.kueue; }  # the real Kueue controller, for the quota tests
install_helm() { scripts/install-helm.sh; }
# The project's images, built from its Dockerfiles on a Debian base (cached by content hash), and
# the MPI Operator's pi images that tests/e2e/test_peer_images.py runs (EXAMPLES there): built here,
# beside the Go builds, their cold build (mostly Debian's packages fetched and unpacked) no longer
# holds up the tests (166 + 129 s inside them in a cold run, 2026-12-07).
peer_images=(mpi-operator-pi-openmpi mpi-operator-pi-mpich)
install_images() { .venv/bin/trainop devcluster images && .venv/bin/trainop devcluster images --only "${peer_images[@]}"; }

phases=()  # name <tab> what it installs <tab> function <tab> "beside" or nothing
add_phase() { phases+=("$1"$'\t'"$2"$'\t'"$3"$'\t'"${4:-}"); }
add_phase apt "${apt_packages[*]} (those missing)" install_apt
add_phase "pip: trainop" "into .venv: pip install ${pip_specs[*]}" install_python
add_phase "frameworks: $frameworks" "$(pins) (wheels kept in \$TRAINOP_CACHE/wheelhouse)$kept" \
  install_frameworks
add_phase "horovod build" "Horovod from source for $frameworks (wheel kept in \$TRAINOP_CACHE/horovod)" \
  install_horovod
if [[ $target == test ]]; then
  # The images need the Horovod wheel and nothing after it; their build keeps 2 cores only 56 %
  # busy (a cold install, 2026-12-07), so it runs beside the next phases.
  add_phase images "the project's images from its Dockerfiles and the MPI Operator's ${peer_images[*]} (cached by content hash)" install_images beside
  add_phase "npm: azurite" "node_modules: Azurite (package.json)" install_azurite
  add_phase "go: control plane" "the local control plane (kube-apiserver, controller-manager, scheduler, etcd, KWOK) and the real-node add-ons, built from source (cached by version)" \
    install_control_plane
  add_phase "go: kueue" "the Kueue controller built from source (cached by version)" install_kueue
  add_phase helm "the Helm binary (cached by version)" install_helm
fi

if ((plan)); then
  echo "scripts/bootstrap.sh $target installs, phase by phase:"
  for p in "${phases[@]}"; do
    IFS=$'\t' read -r name what _ mode <<<"$p"
    printf '  %-32s %s%s\n' "$name" "$what" "${mode:+ (beside the next phases)}"
  done
  exit 0
fi

# Fail now, not after half an hour of downloads and builds.
if [[ $target == test ]] && ! command -v go >/dev/null; then
  echo "scripts/bootstrap.sh test: Go >= 1.26 is needed to build the local control plane; install it first" >&2
  exit 1
fi
mkdir -p "$TRAINOP_CACHE"
echo "scripts/bootstrap.sh $target: $((${#phases[@]})) phases (later runs only check)"
progress_log "${TRAINOP_BOOTSTRAP_LOG:-$PWD/.cache/logs/bootstrap-$target.log}"
for p in "${phases[@]}"; do
  IFS=$'\t' read -r name _ fn mode <<<"$p"
  if [[ $mode == beside ]]; then phase_beside "$name" "$fn"; else phase "$name" "$fn"; fi
done
phases_joined
echo "scripts/bootstrap.sh $target: ready in $(_duration $SECONDS)"
