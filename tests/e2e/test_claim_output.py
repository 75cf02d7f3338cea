"""A job whose output is a claim, on real pods: logs, metrics and checkpoints go straight onto the
claim (here a hostPath PersistentVolume both real nodes reach, as an Azure Files share would be),
and worker 0's sidecar, which has nothing to ship, reports the trainer's metrics and each
completed checkpoint: status.progress and status.checkpoint (a pvc:// URL) as for Blob output."""

from __future__ import annotations

import re

import pytest

from tests.e2e.test_real_pods import RUN_TIMEOUT, reduced, wait_phase
from tests.fixtures.waiting import wait_until
from trainop.render import logship

pytestmark = pytest.mark.real


def test_claim_output_reports_progress_and_checkpoints(real_cluster, real_namespace, real_operator, tmp_path):
    ns, name = real_namespace, "claimed"
    share = tmp_path / "results"
    share.mkdir()
    share.chmod(0o777)  # a hostPath volume keeps the host's ownership: any pod user may write
    real_cluster.shared_claim(ns, "results", share)
    manifest = reduced("pytorch-horovod-synthetic.yaml", name, steps=60, output={"pvc": {"claimName": "results"}},
                       checkpoint={"everySteps": 10}, runPolicy={"cleanPodPolicy": "None"})
    real_cluster.apply(manifest, ns)

    def dtj_status() -> dict:
        return real_cluster.get("dtj", name, "-n", ns).get("status") or {}

    # While it trains: a checkpoint reported by worker 0's sidecar, checked and shown by the operator.
    shown = wait_until(lambda: dtj_status().get("checkpoint"), timeout=RUN_TIMEOUT, interval=1,
                       what="status.checkpoint from the claim")
    step = shown["step"]
    assert shown["attempt"] == 0 and step % 10 == 0 and 0 < step <= 60, shown
    # the job's own folder on the claim: its name and a piece of its uid (a new job of the same
    # name does not resume from the old one's checkpoints)
    where = re.fullmatch(rf"/output/(checkpoints/{name}-[0-9a-f]+/attempt-0/step-{step})", shown["path"])
    assert where, shown
    assert shown["url"] == f"pvc://results/{where[1]}"
    assert (share / where[1] / "COMPLETE").is_file()

    status = wait_phase(real_cluster, ns, name, "Succeeded")
    real_cluster.assert_ran_on_real_nodes(ns, f"trainop.io/job-name={name}")
    final = wait_until(lambda: (dtj_status().get("metrics") or {}).get("final") and dtj_status(),
                       timeout=120, what="the final report in the status")
    assert final["metrics"]["step"] == 60 and final["progress"]["percent"] == 100
    assert status["phase"] == "Succeeded"
    # The logs went onto the claim by the tee; the sidecar holds no storage credential.
    assert (share / "logs" / name / "0" / f"{name}-worker-0.log").stat().st_size > 0
    worker0 = real_cluster.get("pod", f"{name}-worker-0", "-n", ns)
    sidecar = next(c for c in worker0["spec"]["initContainers"] if c["name"] == logship.SIDECAR)
    # (its only plain value: no GPU for a container without one, issue 22 M6)
    assert all("fieldRef" in (e.get("valueFrom") or {}) for e in sidecar["env"]
               if e["name"] != "NVIDIA_VISIBLE_DEVICES"), sidecar["env"]
    assert {"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"} in sidecar["env"]
    assert "--container" not in sidecar["args"]
