"""A user's own image onto the real nodes (issue 25 item 6): `trainop devcluster images build DIR`
(the project's builder: buildah, FROM an image built here, nothing pulled) and `trainop
devcluster images load ARCHIVE` (a `docker save` archive), each run as the CLI runs, into the
real nodes of the running dev cluster, which the CLI finds itself. Then pods of those images
run. The built image is the MPI Operator's base with an sshd that carries one file capability
more than NET_BIND_SERVICE: its job must fail naming the cause (issue 25 item 1).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.e2e.test_real_pods import wait_phase
from tests.fixtures.waiting import wait_until
from trainop.devcluster import images

pytestmark = pytest.mark.real

IMAGE_DIR = Path(__file__).resolve().parent / "images" / "sshd-net-raw"
BUILT, LOADED = "example/sshd-net-raw:1", "example/loaded:2"


def trainop(*args: str, state: Path) -> subprocess.CompletedProcess:
    """The CLI, with the test's dev cluster as the one it finds ($TRAINOP_STATE/devcluster)."""
    return subprocess.run([sys.executable, "-m", "trainop", *args], capture_output=True, text=True,
                          timeout=1200, env=dict(os.environ, TRAINOP_STATE=str(state)))


@pytest.fixture
def state(real_cluster, tmp_path) -> Path:
    (tmp_path / "devcluster").symlink_to(real_cluster.dev.state_dir)
    return tmp_path


def pod_of(image: str, name: str) -> dict:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
            "spec": {"restartPolicy": "Never", "containers": [{
                "name": "main", "image": image, "imagePullPolicy": "Never", "command": ["hello"],
                "securityContext": {"runAsUser": 1000, "runAsNonRoot": True, "allowPrivilegeEscalation": False,
                                    "capabilities": {"drop": ["ALL"]}}}]}}


def test_build_a_users_dockerfile_then_its_job_fails_naming_the_sshd_capability(
        real_cluster, real_namespace, real_operator, state):
    """`images build` builds the folder FROM mpioperator/base:v0.8.2 (built here first if
    missing) and imports it into both real nodes; a pod of it runs. A DistributedTrainingJob
    with it fails at once: its workers' sshd cannot be exec'd (CAP_NET_RAW is not in their
    bounding set), and the failure, the Failed condition and its Event name SshdNotExecutable
    and the fix."""
    ns = real_namespace
    started = time.monotonic()
    done = trainop("devcluster", "images", "build", str(IMAGE_DIR), "--tag", BUILT, state=state)
    print(f"\nimages build: {time.monotonic() - started:.0f}s")
    assert done.returncode == 0, done.stderr[-3000:]
    sockets = {os.path.realpath(node.containerd_socket) for node in real_cluster.dev.real_nodes}
    assert {os.path.realpath(line.split()[2].rstrip(":")) for line in done.stdout.splitlines()
            if line.startswith("imported into")} == sockets, done.stdout
    for socket in sockets:
        assert images.cri_name(BUILT) in images.containerd_images(socket)

    real_cluster.apply(pod_of(BUILT, "hello"), ns)
    wait_until(lambda: real_cluster.get("pod", "hello", "-n", ns)["status"].get("phase") == "Succeeded",
               timeout=120, what="the built image's pod to succeed")
    assert real_cluster.logs(ns, "hello") == "hello from hello as uid 1000 on Debian trixie\n"

    real_cluster.apply({
        "apiVersion": "trainop.io/v1alpha1", "kind": "DistributedTrainingJob", "metadata": {"name": "caps"},
        "spec": {"workers": 2, "image": BUILT, "command": ["hello"],
                 "securityContext": {"runAsUser": 1000, "runAsGroup": 1000},
                 "resources": {"requests": {"cpu": "50m", "memory": "32Mi"}},
                 "runPolicy": {"backoffLimit": 0, "cleanPodPolicy": "None"}}}, ns)
    status = wait_phase(real_cluster, ns, "caps", "Failed", timeout=180)
    failure = status["lastFailure"]
    assert (failure["cause"], failure["exitCode"], failure["container"]) == ("SshdNotExecutable", 126, "worker"), failure
    assert "/usr/sbin/sshd could not be executed: the kernel refused it" in failure["message"], failure
    assert "setcap -r /usr/sbin/sshd" in failure["message"], failure
    failed = next(c for c in status["conditions"] if c["type"] == "Failed")
    assert failed["reason"] == "BackoffLimitExceeded" and "SshdNotExecutable" in failed["message"], failed
    events = real_cluster.get("events", "-n", ns, "--field-selector", "involvedObject.name=caps")["items"]
    assert any("SshdNotExecutable" in e.get("message", "") for e in events), [e.get("message") for e in events]


def podman(*args: str) -> str:
    return subprocess.run(["podman", *args], capture_output=True, text=True, check=True).stdout


def test_load_a_docker_save_archive_under_a_name_of_ones_own(real_cluster, real_namespace, state, tmp_path):
    """`images load` imports an archive in `docker save`'s format (written here by podman: the
    image built above, committed afresh, since a docker archive cannot carry the builder's zstd
    layers) into every real node, under its own name and the one --tag gives; a pod runs it."""
    ns = real_namespace
    built = images.ensure_image(images.user_image(IMAGE_DIR, BUILT))
    archive = tmp_path / "saved.tar"
    pulled = podman("pull", "--quiet", f"oci-archive:{built.archive}").split()[-1]
    saved = f"localhost/example/saved:{built.meta['hash']}"
    try:
        work = subprocess.run(["buildah", "from", "--pull=never", pulled], capture_output=True, text=True,
                              check=True).stdout.strip()
        subprocess.run(["buildah", "commit", "--quiet", "--rm", work, saved], capture_output=True, check=True)
        podman("save", "--format", "docker-archive", "-o", str(archive), saved)
    finally:
        subprocess.run(["podman", "rmi", saved, pulled], capture_output=True)
    done = trainop("devcluster", "images", "load", str(archive), "--tag", LOADED, state=state)
    assert done.returncode == 0, done.stderr[-3000:]
    for node in real_cluster.dev.real_nodes:
        present = images.containerd_images(str(node.containerd_socket))
        assert saved in present and present[saved] == present[images.cri_name(LOADED)], present
    real_cluster.apply(pod_of(LOADED, "loaded"), ns)
    wait_until(lambda: real_cluster.get("pod", "loaded", "-n", ns)["status"].get("phase") == "Succeeded",
               timeout=120, what="the loaded image's pod to succeed")
    assert real_cluster.logs(ns, "loaded") == "hello from loaded as uid 1000 on Debian trixie\n"
