"""Resume on restart against the real API server and the operator as production runs it (KWOK
pods): a checkpoint report written with the log shipper's own token lands in status.checkpoint
only when it lies in the job's own folder; after a worker fails, the next attempt's pods are
told to resume from it and worker 0 fetches it first; the save's measured duration, slower than
Kubernetes' 30 s grace period, sizes the next attempt's grace period (issue 24 item 4)."""

from __future__ import annotations

import json

import kubernetes.client as k8s
import pytest

from tests.cluster.test_logs import launcher_pod, setup_job, token_kubeconfig
from tests.fixtures.waiting import wait_until
from trainop import kube
from trainop.cli.logs import job_folder

pytestmark = [pytest.mark.cluster, pytest.mark.azurite]


def env_of(container: dict) -> dict:
    return {e["name"]: e.get("value") for e in container.get("env", [])}


def test_reported_checkpoint_is_checked_shown_and_resumed_from(cluster, namespace, operator, azurite, tmp_path):
    name = "ck"
    _, container = setup_job(cluster, namespace, azurite, name, backoffLimit=2)
    launcher_pod(cluster, namespace, name)
    worker0 = cluster.get("pod", f"{name}-worker-0", "-n", namespace)
    assert env_of(worker0["spec"]["containers"][0])["TRAINOP_CHECKPOINT_DIR"] == "/output/checkpoints/attempt-0"
    kubeconfig = token_kubeconfig(cluster, namespace, worker0["spec"]["serviceAccountName"], tmp_path / "shipper")
    core = k8s.CoreV1Api(kube.connect(str(kubeconfig))[0])

    def status() -> dict:
        return cluster.get("dtj", name, "-n", namespace).get("status") or {}

    def report(step: int, path: str, **extra) -> None:
        core.patch_namespaced_config_map(f"{name}-progress", namespace, {"data": {"checkpoint": json.dumps(
            {"step": step, "time": "2026-11-26T10:00:00Z", "path": path, **extra})}})

    # another job's checkpoint: ignored, with a Warning naming it
    report(40, "runs/victim/0/output/checkpoints/attempt-0/step-40")
    refused = wait_until(lambda: next((c for c in status().get("conditions", [])
                                       if c["type"] == "CheckpointAccepted"), None), timeout=60,
                         what="the CheckpointAccepted condition")
    assert refused["status"] == "False" and refused["reason"] == "CheckpointRejected"
    assert "victim" in refused["message"] and "checkpoint" not in status()
    events = cluster.get("events", "-n", namespace, "--field-selector", f"involvedObject.name={name}")["items"]
    assert [e["type"] for e in events if e["reason"] == "CheckpointRejected"] == ["Warning"]

    # its own: shown
    folder = job_folder(cluster.get("dtj", name, "-n", namespace))  # runs/<namespace>/<name>-<uid8>
    own = f"{folder}/0/output/checkpoints/attempt-0/step-40"
    report(40, own, saveSeconds=45.2)  # a save slower than Kubernetes' 30 s grace period
    shown = wait_until(lambda: status().get("checkpoint"), timeout=60, what="status.checkpoint")
    assert shown == {"step": 40, "attempt": 0, "time": "2026-11-26T10:00:00Z", "path": own, "saveSeconds": 45.2,
                     "url": f"{azurite.http_url}/{container.container_name}/{own}/"}  # no SAS
    assert worker0["spec"]["terminationGracePeriodSeconds"] == 300 + 30  # made before the measure

    # a worker fails: the gang restarts, and attempt 1 resumes from step 40
    cluster.end_pod(namespace, f"{name}-worker-1", 137)
    wait_until(lambda: status().get("attempt") == 1, timeout=60, what="the gang restart")
    pod = wait_until(lambda: next((p for p in cluster.get("pods", "-n", namespace, "-l",
                                                          f"trainop.io/job-name={name},trainop.io/attempt=1")["items"]
                                   if p["metadata"]["name"] == f"{name}-worker-0"), None),
                     timeout=120, what="attempt 1's worker 0")
    env = env_of(pod["spec"]["containers"][0])
    assert env["TRAINOP_CHECKPOINT_DIR"] == "/output/checkpoints/attempt-1"
    assert env["TRAINOP_RESUME_FROM"] == "/var/trainop/resume/step-40"
    fetch = next(c for c in pod["spec"]["initContainers"] if c["name"] == "fetch-checkpoint")
    assert fetch["args"][-4:] == ["--fetch", own, "--fetch-to", "/var/trainop/resume/step-40"]
    # room for a 45.2 s save: ceil(45.2 x 1.5 + 15) = 83 s, plus the log shipper's drain (300 s) where it runs
    assert pod["spec"]["terminationGracePeriodSeconds"] == 300 + 83
    worker1 = wait_until(lambda: next((p for p in cluster.get("pods", "-n", namespace, "-l",
                                                              f"trainop.io/job-name={name},trainop.io/attempt=1")["items"]
                                       if p["metadata"]["name"] == f"{name}-worker-1"), None),
                         timeout=120, what="attempt 1's worker 1")
    assert worker1["spec"]["terminationGracePeriodSeconds"] == 83  # no shipper on it
    launcher = wait_until(lambda: next((p for p in cluster.get("pods", "-n", namespace, "-l",
                                                               f"trainop.io/job-name={name},trainop.io/role=launcher,"
                                                               "trainop.io/attempt=1")["items"]), None),
                          timeout=120, what="attempt 1's launcher")
    assert env_of(launcher["spec"]["containers"][0])["TRAINOP_RESUME_FROM"] == "/var/trainop/resume/step-40"
    assert launcher["spec"]["terminationGracePeriodSeconds"] == 300 + 83  # mpirun outlives the ranks' save
