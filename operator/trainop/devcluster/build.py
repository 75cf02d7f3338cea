"""Builds the local control plane's binaries from the Go module proxy, once, into the cache.

kube-apiserver, kube-controller-manager and kube-scheduler come from the k8s.io/kubernetes module
and etcd from go.etcd.io/etcd/server/v3, pinned by gomod/go.mod. KWOK is built by `go install` at
KWOK_VERSION in its own module graph: it needs newer k8s.io libraries than the control plane's
(v0.8.0 does not compile against the v0.35 staging modules). The cache key is the Kubernetes
version plus a hash of go.mod/go.sum and KWOK's version, so a second start never rebuilds and a
version bump never reuses stale binaries.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

from trainop.paths import cache_dir

GOMOD_DIR = Path(__file__).resolve().parent / "gomod"

KWOK_MODULE, KWOK_VERSION = "sigs.k8s.io/kwok", "v0.8.0"
# binary name -> Go main package built in gomod/ (`go build -o` names them after the package)
PACKAGES = {
    "kube-apiserver": "k8s.io/kubernetes/cmd/kube-apiserver",
    "kube-controller-manager": "k8s.io/kubernetes/cmd/kube-controller-manager",
    "kube-scheduler": "k8s.io/kubernetes/cmd/kube-scheduler",
    # Real nodes (`devcluster up --real-nodes`): the kubelet and kube-proxy of the same release,
    # and the stand-in GPU/RDMA device plugin (gomod/gpu-device-plugin).
    "kubelet": "k8s.io/kubernetes/cmd/kubelet",
    "kube-proxy": "k8s.io/kubernetes/cmd/kube-proxy",
    "gpu-device-plugin": "./gpu-device-plugin",
    "server": "go.etcd.io/etcd/server/v3",  # renamed to etcd below
}
BINARIES = ["kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubelet", "kube-proxy",
            "gpu-device-plugin", "etcd", "kwok"]
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
    digest = hashlib.sha256((KWOK_VERSION + _version_ldflags() + " ".join(BINARIES)).encode())
    for path in sorted(GOMOD_DIR.rglob("*")):
        if path.is_file():
            digest.update(path.read_bytes())
    return cache_dir() / "devcluster" / f"kubernetes-{kubernetes_version()}-{digest.hexdigest()[:12]}"


def is_built() -> bool:
    target = bin_dir()
    return all((target / name).is_file() for name in BINARIES) and (target / "stages").is_dir()


def _version_ldflags() -> str:
    """Stamp the version as Kubernetes' own build does, so /version and clients' skew checks see
    the real release instead of v0.0.0-master."""
    version = kubernetes_version()
    major, minor = version.lstrip("v").split(".")[:2]
    values = {"gitVersion": version, "gitMajor": major, "gitMinor": minor, "gitTreeState": "clean",
              "buildDate": "1970-01-01T00:00:00Z"}
    return " ".join(f"-X {pkg}.{key}={value}" for pkg in ("k8s.io/component-base/version",
                                                         "k8s.io/client-go/pkg/version")
                    for key, value in values.items())


def _go_env() -> dict[str, str]:
    env = dict(os.environ, CGO_ENABLED="0", GOFLAGS="-mod=mod")
    # A machine starts on its own Go; never let the go command fetch another toolchain silently.
    env.setdefault("GOTOOLCHAIN", "local")
    return env


@contextlib.contextmanager
def build_lock(name: str):
    """One builder at a time per cache (bootstrap, a test session and a developer may race)."""
    lock = cache_dir() / "devcluster" / f".{name}.lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    with lock.open("w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield


def ensure_binaries(log=lambda msg: print(msg, file=sys.stderr)) -> Path:
    """Return the folder with every binary, building what is missing (minutes, cold)."""
    target = bin_dir()
    if is_built():
        return target
    with build_lock("kubernetes"):
        if is_built():  # another process built it while we waited
            return target
        return _build(target, log)


def _build(target: Path, log) -> Path:
    if shutil.which("go") is None:
        raise RuntimeError("the Go toolchain is needed to build the local control plane: install Go >= 1.26")
    staging = target.with_name(target.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    (staging / "stages").mkdir(parents=True)
    log(f"building Kubernetes {kubernetes_version()} control plane, node binaries, etcd and kwok into {target} (cold: minutes)")
    started = time.monotonic()
    subprocess.run(
        ["go", "build", "-trimpath", f"-ldflags=-s -w {_version_ldflags()}", "-o", str(staging) + "/",
         *PACKAGES.values()],
        cwd=GOMOD_DIR, env=_go_env(), check=True,
    )
    (staging / "server").rename(staging / "etcd")
    kwok = f"{KWOK_MODULE}@{KWOK_VERSION}"
    subprocess.run(["go", "install", "-trimpath", "-ldflags=-s -w", f"{KWOK_MODULE}/cmd/kwok@{KWOK_VERSION}"],
                   env=dict(_go_env(), GOBIN=str(staging), GOFLAGS=""), check=True, cwd=staging)
    kwok_dir = json.loads(subprocess.run(["go", "mod", "download", "-json", kwok], env=_go_env(), cwd=staging,
                                         check=True, capture_output=True, text=True).stdout)["Dir"]
    for rel in KWOK_STAGES:
        shutil.copy(Path(kwok_dir) / rel, staging / "stages" / Path(rel).name)
    shutil.rmtree(target, ignore_errors=True)
    staging.rename(target)
    log(f"built in {time.monotonic() - started:.0f}s")
    return target


# ---- add-ons for real nodes: each its own wrapper module (their dependency graphs differ from
# Kubernetes' own), built with `go build` and cached by the hash of that module's files. -------
ADDONS_DIR = Path(__file__).resolve().parent / "addons"
ADDONS = {
    # CNI: the pod network of every real node (bridge + host-local IPAM + loopback; portmap for hostPort).
    "cni": ["github.com/containernetworking/plugins/plugins/main/bridge",
            "github.com/containernetworking/plugins/plugins/main/loopback",
            "github.com/containernetworking/plugins/plugins/ipam/host-local",
            "github.com/containernetworking/plugins/plugins/meta/portmap"],
    # Cluster DNS: `<pod>.<service>.<ns>.svc` names, served from the API.
    "coredns": ["github.com/coredns/coredns"],
    # NetworkPolicy enforcement: kube-router, of which only the network policy controller runs
    # (iptables + ipset). Chosen over kube-network-policies (sigs.k8s.io, nftables): that one sends
    # each new connection to user space with nftables' `queue` statement, and this kernel is built
    # without CONFIG_NFT_QUEUE, while ip_set, xt_set, physdev and NFLOG are all built in.
    "kube-router": ["github.com/cloudnativelabs/kube-router/v2/cmd/kube-router"],
}


# Version variables an add-on's own release build stamps (kube-router logs and checks its version).
ADDON_VERSION_VARS = {"kube-router": ("github.com/cloudnativelabs/kube-router/v2", "pkg/version.Version")}


def _addon_ldflags(name: str) -> str:
    if name not in ADDON_VERSION_VARS:
        return "-s -w"
    module, var = ADDON_VERSION_VARS[name]
    match = re.search(rf"^\s*(?:require\s+)?{re.escape(module)} (v\S+)", (ADDONS_DIR / name / "go.mod").read_text(), re.M)
    assert match, f"addons/{name}/go.mod must require {module}"
    return f"-s -w -X {module}/{var}={match.group(1)}"


def addon_dir(name: str) -> Path:
    module = ADDONS_DIR / name
    # Stamped add-ons hash their flags too (the others' keys stay as they were: no needless rebuild).
    stamp = _addon_ldflags(name) if name in ADDON_VERSION_VARS else ""
    digest = hashlib.sha256((" ".join(ADDONS[name]) + stamp).encode())
    for path in sorted(module.iterdir()):
        digest.update(path.name.encode() + path.read_bytes())
    return cache_dir() / "devcluster" / f"{name}-{digest.hexdigest()[:12]}"


def ensure_addon(name: str, log=lambda msg: print(msg, file=sys.stderr)) -> Path:
    """Return the folder with the add-on's binaries (named after their packages), building once."""
    target = addon_dir(name)
    if target.is_dir():
        return target
    with build_lock(name):
        if target.is_dir():
            return target
        staging = target.with_name(target.name + ".partial")
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        log(f"building {name} into {target} (cold: minutes)")
        started = time.monotonic()
        subprocess.run(["go", "build", "-trimpath", f"-ldflags={_addon_ldflags(name)}", "-o", str(staging) + "/",
                        *ADDONS[name]],
                       cwd=ADDONS_DIR / name, env=_go_env(), check=True)
        staging.rename(target)
        log(f"built {name} in {time.monotonic() - started:.0f}s")
        return target


def ensure_all(log=lambda msg: print(msg, file=sys.stderr)) -> dict[str, Path]:
    """Everything `devcluster up` may start, control plane and real-node add-ons (bootstrap's step)."""
    return {"kubernetes": ensure_binaries(log), **{name: ensure_addon(name, log) for name in ADDONS}}
