"""Kueue on the local control plane: build the real controller once, install its CRDs, run it
as a local process.

    binary, crds = kueue.ensure_built()          # cached under $TRAINOP_CACHE/kueue/<version>
    # (bootstrap: python -m trainop.devcluster.kueue)
    kueue.install_crds(kubeconfig)               # Kueue's own CRDs, from its module source
    proc = kueue.Kueue(kubeconfig, state_dir).start()   # ... proc.stop()

Build: `go install sigs.k8s.io/kueue/cmd/kueue@VERSION` (its go.mod has no replace directives)
into the cache, never rebuilt while present; the CRDs are copied from the module's
config/components/crd/bases next to the binary.

Webhooks: the local control plane has no Service network, so the API server could reach a
webhook only by a URL on 127.0.0.1 with a certificate for that address. Kueue 0.17 serves its
metrics only with certificates from a fixed system path unless its internal certificate
management is on, and that management issues certificates for the in-cluster Service name (into
a Secret, which the harness copies to Kueue's certificate folder as a kubelet would). So
Kueue runs with internal certificates (for its own listeners) and NO webhook registered with the
API server. What that loses: defaulting and validation of Kueue's own objects (tests write them
complete and valid) and Kueue's Job/Pod integrations' webhooks (trainop does not use them: it
creates Workloads itself). The CRDs' conversion webhook is registered (the rotator insists) on
127.0.0.1, but its certificate names the Service, so v1beta1 reads fail: only the storage
version v1beta2 works. Admission, quota accounting, ordering and preemption are the
controller's and run unchanged.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import yaml

from trainop.devcluster import kubectl
from trainop.paths import cache_dir

MODULE, VERSION = "sigs.k8s.io/kueue", "v0.17.0"
NAMESPACE = "kueue-system"


def build_dir() -> Path:
    return cache_dir() / "kueue" / VERSION


def is_built() -> bool:
    return (build_dir() / "kueue").is_file() and any((build_dir() / "crds").glob("*.yaml"))


def ensure_built() -> tuple[Path, Path]:
    """(binary, CRD folder); builds once (minutes on 2 cores), then reuses the cache."""
    target = build_dir()
    target.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, CGO_ENABLED="0")
    if not (target / "kueue").is_file():
        tmp = target / "bin.partial"
        shutil.rmtree(tmp, ignore_errors=True)
        subprocess.run(["go", "install", "-trimpath", "-ldflags=-s -w",
                        f"{MODULE}/cmd/kueue@{VERSION}"], env=dict(env, GOBIN=str(tmp)),
                       check=True)
        (tmp / "kueue").rename(target / "kueue")  # complete binaries only under the final name
        shutil.rmtree(tmp, ignore_errors=True)
    crds = target / "crds"
    if not any(crds.glob("*.yaml")):
        info = json.loads(subprocess.run(["go", "mod", "download", "-json", f"{MODULE}@{VERSION}"],
                                         env=env, check=True, capture_output=True,
                                         text=True).stdout)
        tmp = target / "crds.partial"
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(Path(info["Dir"]) / "config/components/crd/bases", tmp)
        for path in [tmp, *tmp.rglob("*")]:  # the module cache is read-only; the copy need not be
            path.chmod(0o755 if path.is_dir() else 0o644)
        tmp.rename(crds)
    return target / "kueue", crds


# CRDs whose conversion webhook Kueue's certificate rotator fills in (and waits for).
CONVERTED = ("localqueues", "clusterqueues", "workloads", "cohorts", "multikueueclusters")


def install_crds(kubeconfig: Path, webhook_port: int) -> None:
    """Apply Kueue's CRDs. Those Kueue injects a CA into get a conversion webhook pointing at
    the local process (as Kueue's kustomization patches them): without that field the rotator
    never reports ready."""
    _, crds = ensure_built()
    docs = [yaml.safe_load(p.read_text()) for p in sorted(crds.glob("*.yaml"))]
    for doc in docs:
        if doc["spec"]["names"]["plural"] in CONVERTED:
            doc["spec"]["conversion"] = {"strategy": "Webhook", "webhook": {
                "clientConfig": {"url": f"https://127.0.0.1:{webhook_port}/convert"},
                "conversionReviewVersions": ["v1"]}}
    kubectl.run(kubeconfig, "apply", "--server-side", "--force-conflicts", "-f", "-",
                input=yaml.safe_dump_all(docs), check=True)
    kubectl.run(kubeconfig, "wait", "--for=condition=Established", "--timeout=180s",
                *[f"crd/{d['metadata']['name']}" for d in docs], check=True)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Kueue:
    """The Kueue controller manager as a local process against `kubeconfig`."""

    def __init__(self, kubeconfig: Path, state_dir: Path, settings: dict | None = None):
        """`settings`: more keys of Kueue's Configuration (e.g. `waitForPodsReady`)."""
        self.kubeconfig, self.state_dir = Path(kubeconfig), Path(state_dir)
        self.settings = dict(settings or {})
        self.proc: subprocess.Popen | None = None
        self.health_port = self.webhook_port = 0

    @property
    def log_file(self) -> Path:
        return self.state_dir / "kueue.log"

    def config(self) -> dict:
        return {
            "apiVersion": "config.kueue.x-k8s.io/v1beta2", "kind": "Configuration",
            "namespace": NAMESPACE,
            "health": {"healthProbeBindAddress": f"127.0.0.1:{self.health_port}"},
            "metrics": {"bindAddress": "0"},
            "webhook": {"port": self.webhook_port, "host": "127.0.0.1",
                        "certDir": str(self.state_dir / "certs")},
            "leaderElection": {"leaderElect": False},
            "internalCertManagement": {"enable": True,
                                       "webhookServiceName": "kueue-webhook-service",
                                       "webhookSecretName": "kueue-webhook-server-cert"},
            "integrations": {"frameworks": ["batch/job"]},
            "manageJobsWithoutQueueName": False,
            "featureGates": {"VisibilityOnDemand": False},
            **self.settings,
        }

    def start(self, timeout: float = 120) -> Kueue:
        binary, _ = ensure_built()
        self.health_port, self.webhook_port = _free_port(), _free_port()
        install_crds(self.kubeconfig, self.webhook_port)
        kubectl.run(self.kubeconfig, "create", "namespace", NAMESPACE, check=False)
        # The rotator fills this Secret in but does not create it (Kueue's manifests do).
        kubectl.run(self.kubeconfig, "create", "secret", "generic", "-n", NAMESPACE,
                    "kueue-webhook-server-cert", check=False)
        self.state_dir.mkdir(parents=True, exist_ok=True)
        config = self.state_dir / "kueue-config.yaml"
        config.write_text(yaml.safe_dump(self.config()))
        self.proc = subprocess.Popen(
            [str(binary), f"--config={config}", "--zap-log-level=2"],
            env=dict(os.environ, KUBECONFIG=str(self.kubeconfig)),
            stdout=self.log_file.open("ab"), stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True, cwd=self.state_dir)
        deadline = time.monotonic() + timeout
        while not self._ready():
            self._mount_certs()
            if self.proc.poll() is not None or time.monotonic() > deadline:
                tail = self.log_file.read_text(errors="replace")[-3000:]
                self.stop()
                raise RuntimeError(f"Kueue did not become ready; its log ends:\n{tail}")
            time.sleep(0.3)
        return self

    def _mount_certs(self) -> None:
        """Do what the kubelet does for Kueue's pod: copy the Secret its certificate rotator
        writes into the folder it reads (it waits for those files before it starts)."""
        certs = self.state_dir / "certs"
        if (certs / "tls.key").exists():
            return
        got = kubectl.run(self.kubeconfig, "get", "secret", "-n", NAMESPACE,
                          "kueue-webhook-server-cert", "-o", "json")
        data = json.loads(got.stdout).get("data") or {} if got.returncode == 0 else {}
        if not {"tls.crt", "tls.key"} <= set(data):
            return
        certs.mkdir(mode=0o700, exist_ok=True)
        for name in ("ca.crt", "tls.crt", "tls.key"):  # the key last: it marks completion
            if name in data:
                (certs / name).write_bytes(base64.b64decode(data[name]))

    def _ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.health_port}/readyz",
                                        timeout=2) as resp:
                return resp.status == 200
        except OSError:
            return False

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


if __name__ == "__main__":  # scripts/bootstrap.sh: build (or find) Kueue in the cache
    started = time.monotonic()
    binary, crds = ensure_built()
    print(f"kueue {VERSION}: {binary} and {crds} ({time.monotonic() - started:.1f}s)")
