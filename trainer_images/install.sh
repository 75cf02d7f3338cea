#!/usr/bin/env bash
# Installs the trainer, its frameworks and a patched Horovod wheel into one Python environment.
# The Dockerfiles, CI (through scripts/bootstrap.sh) and the GPU benchmark all run this script, so
# what the images install is what the tests exercised. Idempotent: a warm run only checks.
#
#   install.sh [all | system frameworks horovod trainer ...]      (default: all)
#   install.sh pins     prints the pins `frameworks` installs (scripts/bootstrap.sh --plan)
#
# Environment:
#   TRAINOP_PYTHON      interpreter to install into (default: <repo>/.venv/bin/python, else python3)
#   TRAINOP_FRAMEWORKS  comma list of pytorch,tensorflow (default: both; keras uses tensorflow)
#   TRAINOP_GPU         1 = CUDA build: NCCL in Horovod, tensorflow[and-cuda] (default: 0)
#   TRAINOP_CACHE       pip downloads, the Horovod sdist and built wheels (default: <repo>/.cache)
#   TRAINOP_EDITABLE    1 = install the trainer editable (default: 1 inside the repo's .venv)
#   HOROVOD_CUDA_CC     CUDA compute capabilities for Horovod's kernels (default: 80,90)
#   TRAINOP_HOROVOD_WHEEL  a prebuilt Horovod wheel to install instead of building one (then no
#                       compiler is needed: `system` leaves them out); the local image build
#                       passes the one built for the host's .venv (same OS, Python, frameworks)
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/.." && pwd)"
CACHE="${TRAINOP_CACHE:-$REPO/.cache}"
FRAMEWORKS="${TRAINOP_FRAMEWORKS:-pytorch,tensorflow}"
GPU="${TRAINOP_GPU:-0}"
if [[ -n "${TRAINOP_PYTHON:-}" ]]; then PY="$TRAINOP_PYTHON"
elif [[ -x "$REPO/.venv/bin/python" ]]; then PY="$REPO/.venv/bin/python"
else PY="$(command -v python3)"; fi
EDITABLE="${TRAINOP_EDITABLE:-$([[ "$PY" == "$REPO/.venv/bin/python" ]] && echo 1 || echo 0)}"

# The frameworks' pinned versions are the trainer's extras `pytorch` and `tensorflow`
# (trainer/pyproject.toml): one list for pip users, this script and scripts/bootstrap.sh.
# Horovod 0.28.1 is the last release (sdist only).
HOROVOD_VERSION=0.28.1

export PIP_CACHE_DIR="$CACHE/pip" PIP_DISABLE_PIP_VERSION_CHECK=1
log() { echo "install.sh: $*" >&2; }
has() { [[ ",$FRAMEWORKS," == *",$1,"* ]]; }
pip_() { "$PY" -m pip "$@"; }

# The requirements of the trainer's extra $1, one per line (tomllib from Python 3.11; the GPU
# machines' older Pythons read the extra's list literally).
extra_requirements() {
  "$PY" - "$HERE/trainer/pyproject.toml" "$1" <<'EOF'
import ast, re, sys
text = open(sys.argv[1], encoding="utf-8").read()
try:
    import tomllib
    reqs = tomllib.loads(text)["project"]["optional-dependencies"][sys.argv[2]]
except ModuleNotFoundError:
    section = text.split("[project.optional-dependencies]", 1)[1].split("\n[", 1)[0]
    reqs = ast.literal_eval(re.search(rf"^{re.escape(sys.argv[2])}\s*=\s*(\[.*?\])", section, re.M | re.S)[1])
print("\n".join(reqs))
EOF
}

# True when every requirement given is installed: `name==version` exactly, any other form by
# name (cheap: reads metadata, imports nothing).
pinned_installed() {
  "$PY" - "$@" <<'EOF'
import re, sys
from importlib import metadata
for req in sys.argv[1:]:
    name = re.match(r"[A-Za-z0-9._-]+", req)[0]
    try:
        version = metadata.version(name)
    except metadata.PackageNotFoundError:
        sys.exit(1)
    if "==" in req and version != req.split("==")[1].split(";")[0].strip():
        sys.exit(1)
EOF
}

system() {
  # Open MPI (mpirun for Horovod and the launcher), sshd (workers), a compiler and CMake (Horovod).
  local pkgs=(openmpi-bin openssh-server openssh-client)
  [[ -n ${TRAINOP_HOROVOD_WHEEL:-} ]] || pkgs+=(libopenmpi-dev build-essential cmake)
  local missing=()
  for p in "${pkgs[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
  ((${#missing[@]} == 0)) && return 0
  [[ $(id -u) == 0 ]] || { log "need root to apt-get install ${missing[*]}"; return 1; }
  log "apt-get install ${missing[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}

framework_pins() {
  local pins=()
  # tf-keras depends on the full `tensorflow` distribution; `tensorflow-cpu` beside it would be a
  # second copy of the same files, so both CPU and GPU installs use `tensorflow`.
  if has pytorch; then mapfile -t -O "${#pins[@]}" pins < <(extra_requirements pytorch); fi
  if has tensorflow; then mapfile -t -O "${#pins[@]}" pins < <(extra_requirements tensorflow); fi
  echo "${pins[@]}"
}

frameworks() {
  local pins
  read -r -a pins <<<"$(framework_pins)"
  ((${#pins[@]} == 0)) && return 0
  pinned_installed "${pins[@]}" && return 0
  local args=("${pins[@]}")
  if [[ $GPU == 1 ]] && has tensorflow; then args=("${args[@]/tensorflow==/tensorflow[and-cuda]==}"); fi
  # setuptools/wheel/cffi: Horovod builds with --no-build-isolation against these frameworks.
  args+=("setuptools>=68" wheel cffi)
  # The registry's responses are not kept by pip's HTTP cache, so wheels are kept explicitly: a
  # download into the wheelhouse skips files already there, then the install reads only it.
  log "pip install ${args[*]} (wheels kept in $CACHE/wheelhouse)"
  pip_ download -q -d "$CACHE/wheelhouse" "${args[@]}"
  pip_ install -q --no-index --find-links "$CACHE/wheelhouse" "${args[@]}"
}

# Applies the fixes Horovod 0.28.1 needs with current toolchains (see ../shared/TOOLCHAIN.md).
patch_horovod() {
  local src=$1
  # PyTorch >= 2.1 headers need C++17.
  sed -i 's/set(CMAKE_CXX_STANDARD 14)/set(CMAKE_CXX_STANDARD 17)/' \
    "$src/CMakeLists.txt" "$src/horovod/torch/CMakeLists.txt"
  # TensorFlow >= 2.16 no longer builds xla_mpi_ops.cc; the XLA ops are opt-in at run time anyway.
  sed -i '/xla_mpi_ops.cc/d' "$src/horovod/tensorflow/CMakeLists.txt"
  # GCC 13 no longer pulls these headers in transitively.
  sed -i 's|#include <mutex>|#include <mutex>\n#include <string>\n#include <iterator>|' \
    "$src/horovod/common/group_table.h"
  sed -i 's|#include <functional>|#include <functional>\n#include <stdexcept>\n#include <cstdint>|' \
    "$src/horovod/common/common.h"
  # channels_last tensors are dense and laid out alike on every rank, so element-wise collectives
  # are correct on them; without this Horovod refuses any channels_last model.
  sed -i 's/    if not tensor.is_contiguous():/    if not (tensor.is_contiguous() or tensor.is_contiguous(memory_format=torch.channels_last)):/' \
    "$src/horovod/torch/mpi_ops.py"
  grep -q 'memory_format=torch.channels_last' "$src/horovod/torch/mpi_ops.py"
}

# Key of a Horovod build: its inputs (frameworks, CUDA, Python, this script's patches).
horovod_key() {
  local pins
  pins="$(framework_pins) gpu=$GPU cc=${HOROVOD_CUDA_CC:-80,90} $("$PY" -c 'import sys; print(sys.version_info[:2])')"
  printf '%s\n%s' "$pins" "$(declare -f patch_horovod horovod_build_env)" | sha256sum | cut -c1-16
}

horovod_build_env() {
  export CMAKE_POLICY_VERSION_MINIMUM=3.5 HOROVOD_WITH_MPI=1 HOROVOD_WITH_GLOO=1 \
    HOROVOD_WITHOUT_MXNET=1 MAKEFLAGS="-j$(nproc)"
  if has pytorch; then export HOROVOD_WITH_PYTORCH=1; else export HOROVOD_WITHOUT_PYTORCH=1; fi
  if has tensorflow; then export HOROVOD_WITH_TENSORFLOW=1; else export HOROVOD_WITHOUT_TENSORFLOW=1; fi
  if [[ $GPU == 1 ]]; then
    # NCCL comes with the frameworks' nvidia wheels; Horovod wants a plain libnccl.so beside it.
    local nccl
    nccl="$("$PY" -c 'import nvidia.nccl, os; print(os.path.dirname(nvidia.nccl.__file__) if nvidia.nccl.__file__ else list(nvidia.nccl.__path__)[0])')"
    mkdir -p "$CACHE/nccl-lib"
    ln -sf "$nccl/lib/libnccl.so.2" "$CACHE/nccl-lib/libnccl.so"
    export HOROVOD_GPU_OPERATIONS=NCCL HOROVOD_NCCL_INCLUDE="$nccl/include" \
      HOROVOD_NCCL_LIB="$CACHE/nccl-lib" HOROVOD_BUILD_CUDA_CC_LIST="${HOROVOD_CUDA_CC:-80,90}"
  else
    export HOROVOD_CPU_OPERATIONS=GLOO
  fi
}

horovod() {
  local key wheel_dir marker wheel=${TRAINOP_HOROVOD_WHEEL:-}
  key="$(horovod_key)"
  wheel_dir="$CACHE/horovod/wheels/$key"
  marker="$("$PY" -c 'import sys; print(sys.prefix)')/.trainop-horovod-$key"
  if [[ -f $marker ]] && pinned_installed "horovod==$HOROVOD_VERSION"; then return 0; fi
  if [[ -n $wheel ]]; then
    [[ -f $wheel ]] || { log "TRAINOP_HOROVOD_WHEEL=$wheel: no such file"; return 1; }
  elif ! compgen -G "$wheel_dir/horovod-*.whl" >/dev/null; then
    local sdist="$CACHE/horovod/horovod-$HOROVOD_VERSION.tar.gz"
    [[ -f $sdist ]] || pip_ download -q --no-deps --no-binary :all: "horovod==$HOROVOD_VERSION" -d "$CACHE/horovod"
    local tmp
    tmp="$(mktemp -d)"
    # Removed also when the build fails (set -e ends the script): a half-built tree is large.
    trap "rm -rf '$tmp'" EXIT
    tar xzf "$sdist" -C "$tmp"
    patch_horovod "$tmp/horovod-$HOROVOD_VERSION"
    log "building Horovod $HOROVOD_VERSION ($FRAMEWORKS, gpu=$GPU); minutes on 2 cores"
    # -v: CMake's and the compilers' output (warnings included) go to the caller's output;
    # scripts/bootstrap.sh puts it in its log file and shows one line for the whole build.
    (horovod_build_env && cd "$tmp/horovod-$HOROVOD_VERSION" &&
      "$PY" -m pip wheel -v --no-deps --no-build-isolation . -w "$tmp/dist")
    mkdir -p "$wheel_dir"
    mv "$tmp"/dist/horovod-*.whl "$wheel_dir/"
    rm -rf "$tmp"
  fi
  [[ -n $wheel ]] || wheel="$(compgen -G "$wheel_dir/horovod-*.whl" | head -n 1)"
  pip_ install -q --no-deps --force-reinstall "$wheel"
  # Horovod's own run-time needs (horovodrun is not used: mpirun launches).
  pip_ install -q cloudpickle psutil pyyaml packaging
  rm -f "$(dirname "$marker")"/.trainop-horovod-*
  touch "$marker"
}

trainer() {
  # PyTorch writes TensorBoard event files through the `tensorboard` package (the trainer's
  # extra of that name); TensorFlow has its own writer and needs nothing more.
  local spec="$HERE/trainer"
  has pytorch && spec="$spec[tensorboard]"
  if [[ $EDITABLE == 1 ]]; then
    "$PY" -c 'import trainop_trainer' 2>/dev/null && { ! has pytorch || "$PY" -c 'import tensorboard' 2>/dev/null; } \
      && return 0
    pip_ install -q -e "$spec"
  else
    pip_ install -q "$spec"
  fi
}

(($#)) || set -- all
for step in "$@"; do
  case "$step" in
    all) system; frameworks; horovod; trainer ;;
    system | frameworks | horovod | trainer) "$step" ;;
    pins) framework_pins ;;
    *) log "unknown step '$step': use all, system, frameworks, horovod, trainer or pins"; exit 2 ;;
  esac
done
