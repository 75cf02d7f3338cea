"""Issue 24, pods that can never start, on real kubelets: an image that does not exist (the
real nodes reach no registry, so the pull fails as it would for a typo) and an env var from a
Secret that does not exist. Each job gets PodsNotStarting naming the pod, the kubelet's reason
and message within seconds, then fails with that reason at runPolicy.startTimeoutSeconds, its
pods deleted, no restart counted."""

from __future__ import annotations

import pytest

from tests.e2e.test_real_pods import wait_phase
from tests.fixtures.cluster import OperatorProcess
from tests.fixtures.waiting import wait_until

pytestmark = pytest.mark.real

BASE = {"framework": "pytorch", "launcher": "torchrun", "workers": 1, "gpusPerWorker": 1,
        "resources": {"requests": {"cpu": "50m", "memory": "64Mi"}}, "command": ["true"],
        "runPolicy": {"startTimeoutSeconds": 45}}
CASES = {
    "no-image": ({"image": "example.invalid/trainop/none:0.0.1"}, "ErrImagePull", "example.invalid/trainop/none"),
    "no-secret": ({"podTemplate": {"worker": {"spec": {"containers": [{"name": "worker", "env": [
        {"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "never-made", "key": "value"}}}]}]}}}},
        "CreateContainerConfigError", 'secret "never-made" not found'),
}


def test_pods_that_can_never_start_are_named_then_fail_the_job(real_cluster, real_namespace, tmp_path):
    ns = real_namespace
    op = OperatorProcess(real_cluster, [ns], tmp_path / "operator.log",
                         config={"podTemplate": {"allow": {"secrets": ["never-made"]}}}).start()
    try:
        for name, (extra, _, _) in CASES.items():
            real_cluster.apply({"apiVersion": "trainop.io/v1alpha1", "kind": "DistributedTrainingJob",
                                "metadata": {"name": name}, "spec": {**BASE, **extra}}, ns)
        for name, (_, reason, said) in CASES.items():
            def named():
                conds = real_cluster.get("dtj", name, "-n", ns).get("status", {}).get("conditions") or []
                return next((c for c in conds if c["type"] == "PodsNotStarting" and c["status"] == "True"), None)
            cond = wait_until(named, timeout=120, interval=1, what=f"{name}: PodsNotStarting")
            assert cond["reason"] == reason and cond["message"].startswith(
                f"pod {name}-worker-0: container worker: {reason}: "), cond
            assert said in cond["message"], cond
            real_cluster.assert_ran_on_real_nodes(ns, f"trainop.io/job-name={name}")
        for name, (_, reason, _) in CASES.items():
            status = wait_phase(real_cluster, ns, name, "Failed", timeout=120)
            failed = next(c for c in status["conditions"] if c["type"] == "Failed")
            assert failed["reason"] == reason and "startTimeoutSeconds=45" in failed["message"], failed
            assert status["restarts"] == {"failures": 0, "disruptions": 0}, status
            wait_until(lambda: not real_cluster.get("pods", "-n", ns, "-l", f"trainop.io/job-name={name}")["items"],
                       timeout=60, interval=1, what=f"{name}'s pods deleted")
        assert "[ERROR" not in (tmp_path / "operator.log").read_text()  # waiting is not an error
    finally:
        op.stop()
