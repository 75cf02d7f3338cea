"""Builds the local control plane's binaries from the Go module proxy, once, into the cache.

kube-apiserver, kube-controller-manager and kube-scheduler come from the k8s.io/kubernetes module,
etcd from go.etcd.io/etcd/server/v3 and kwok from sigs.k8s.io/kwok, all pinned by gomod/go.mod.
The cache key is the Kubernetes version plus a hash of go.mod/go.sum, so a second start never
rebuilds and a version bump never reuses stale binaries.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

from trainop.paths import cache_dir

GOMOD_DIR = Path(__file__).resolve().parent / "gomod"

# binary name -> Go package (main) that builds it
PACKAGES = {
    "kube-apiserver": "k8s.io/kubernetes/cmd/kube-apiserver",
    "kube-controller-manager": "k8s.io/kubernetes/cmd/kube-controller-manager",
    "kube-scheduler": "k8s.io/kubernetes/cmd/kube-scheduler",
    "etcd": "go.etcd.io/etcd/server/v3",
    "kwok": "sigs.k8s.io/kwok/cmd/kwok",
}
# KWOK's own stage definitions we reuse unchanged (nodes become Ready and keep their lease,
# pods become Running/Ready, deleted pods go away); trainop adds its own exit stage (stages.py).
KWOK_STAGES = [
    "kustomize/stage/node/fast/node-initialize.yaml",
    "kustomize/stage/node/heartbeat-with-lease/node-heartbeat-with-lease.yaml",
    "kustomize/stage/pod/fast/pod-ready.yaml",
    "kustomize/stage/pod/fast/pod-delete.yaml",
]


def kubernetes_version() -> str:
    match = re.search(r"^\s*k8s\.io/kubernetes (v\S+)", (GOMOD_DIR / "go.mod").read_text(), re.M)
    assert match, "gomod/go.mod must require k8s.io/kubernetes"
    return match.group(1)


def bin_dir() -> Path:
    digest = hashlib.sha256()
    for name in ("go.mod", "go.sum"):
        digest.update((GOMOD_DIR / name).read_bytes())
    return cache_dir() / "devcluster" / f"kubernetes-{kubernetes_version()}-{digest.hexdigest()[:12]}"


def is_built() -> bool:
    target = bin_dir()
    return all((target / name).is_file() for name in PACKAGES) and (target / "stages").is_dir()


def _go_env() -> dict[str, str]:
    env = dict(os.environ, CGO_ENABLED="0", GOFLAGS="-mod=mod")
    # A machine starts on its own Go; never let the go command fetch another toolchain silently.
    env.setdefault("GOTOOLCHAIN", "local")
    return env


def ensure_binaries(log=lambda msg: print(msg, file=sys.stderr)) -> Path:
    """Return the folder with every binary, building what is missing (minutes, cold)."""
    target = bin_dir()
    if is_built():
        return target
    if shutil.which("go") is None:
        raise RuntimeError("the Go toolchain is needed to build the local control plane: install Go >= 1.26")
    staging = target.with_name(target.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    (staging / "stages").mkdir(parents=True)
    log(f"building Kubernetes {kubernetes_version()} control plane, etcd and kwok into {target} (cold: minutes)")
    started = time.monotonic()
    subprocess.run(
        ["go", "build", "-trimpath", "-ldflags=-s -w", "-o", str(staging) + "/", *PACKAGES.values()],
        cwd=GOMOD_DIR, env=_go_env(), check=True,
    )
    # `go build -o dir/` names binaries after the package's last element: rename to ours.
    for name, package in PACKAGES.items():
        built = staging / package.rstrip("/").split("/")[-1]
        if built.name == "v3":  # go.etcd.io/etcd/server/v3 -> "server"
            built = staging / "server"
        if built != staging / name:
            built.rename(staging / name)
    kwok_dir = subprocess.run(
        ["go", "list", "-m", "-f", "{{.Dir}}", "sigs.k8s.io/kwok"],
        cwd=GOMOD_DIR, env=_go_env(), check=True, capture_output=True, text=True,
    ).stdout.strip()
    for rel in KWOK_STAGES:
        shutil.copy(Path(kwok_dir) / rel, staging / "stages" / Path(rel).name)
    shutil.rmtree(target, ignore_errors=True)
    staging.rename(target)
    log(f"built in {time.monotonic() - started:.0f}s")
    return target
