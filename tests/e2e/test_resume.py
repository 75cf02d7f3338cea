"""Resume on restart on real pods: PyTorch + Horovod with Blob output (Azurite in the pod network),
checkpointing on by default. Worker 0's log shipper uploads each checkpoint and reports it, the
operator shows it in status.checkpoint; a worker's container is SIGKILLed from the host mid-run;
the gang restarts, worker 0's init container fetches the checkpoint, and the second attempt's
ranks start at its step."""

from __future__ import annotations

import re

import pytest

from tests.e2e.test_real_pods import RUN_TIMEOUT, reduced, wait_phase, with_blob_output
from tests.fixtures.waiting import wait_until
from trainop.cli.logs import job_folder

pytestmark = [pytest.mark.real, pytest.mark.azurite]

STEPS = 60  # held to HOLD seconds each: the kill, after the first checkpoint is reported, lands mid-run


def test_killed_worker_restarts_the_gang_from_the_last_checkpoint(real_cluster, real_namespace, real_operator,
                                                                  pod_azurite):
    ns, name = real_namespace, "resume"
    manifest = reduced("pytorch-horovod-synthetic.yaml", name, steps=STEPS)
    manifest["spec"]["runPolicy"] = {"backoffLimit": 2, "cleanPodPolicy": "None"}
    manifest["spec"]["checkpoint"] = {"everySteps": 10}
    with_blob_output(manifest, real_cluster, ns, pod_azurite)
    real_cluster.apply(manifest, ns)

    def dtj_status() -> dict:
        return real_cluster.get("dtj", name, "-n", ns).get("status") or {}

    first = wait_until(lambda: dtj_status().get("checkpoint"), timeout=RUN_TIMEOUT, interval=1,
                       what="status.checkpoint of the first attempt")
    assert first["attempt"] == 0 and first["step"] % 10 == 0 and first["step"] < STEPS
    folder = job_folder(real_cluster.get("dtj", name, "-n", ns))
    assert folder.startswith(f"runs/{ns}/{name}-")  # <namespace>/<name>-<uid8> (issue 22 M3)
    assert first["path"] == f"{folder}/0/output/checkpoints/attempt-0/step-{first['step']}"
    assert first["url"].startswith(pod_azurite.http_url)
    worker = real_cluster.get("pod", f"{name}-worker-1", "-n", ns)
    container_id = next(c["containerID"] for c in worker["status"]["containerStatuses"] if c["name"] == "worker")
    real_cluster.dev.kill_container(worker["spec"]["nodeName"], container_id)

    status = wait_phase(real_cluster, ns, name, "Succeeded")
    real_cluster.assert_ran_on_real_nodes(ns, f"trainop.io/job-name={name}")
    assert status["attempt"] == 1
    assert status["lastFailure"]["pod"] == f"{name}-worker-1"
    # attempt 1 fetched the checkpoint and its ranks started at its step
    fetch = real_cluster.logs(ns, f"{name}-worker-0", "-c", "fetch-checkpoint")
    resumed_at = re.search(rf"fetched \d+ file\(s\) of {re.escape(folder)}/0/output/checkpoints/attempt-0/step-(\d+)",
                           fetch)
    assert resumed_at, fetch
    step = int(resumed_at[1])
    assert first["step"] <= step < STEPS
    launcher = real_cluster.logs(ns, f"job/{name}-launcher", "-c", "launcher")
    assert f"resuming from /var/trainop/resume/step-{step} at step {step}" in launcher, launcher[-3000:]
    # the step the final report counts from is the resumed one: STEPS in all, not STEPS more
    final = wait_until(lambda: (dtj_status().get("metrics") or {}).get("final") and dtj_status()["metrics"],
                       timeout=120, what="the final metrics")
    assert final["step"] == STEPS
    # attempt 1 saved into its own folder, and the operator followed
    assert wait_until(lambda: (dtj_status().get("checkpoint") or {}).get("attempt") == 1, timeout=120,
                      what="status.checkpoint of attempt 1")
