"""A GPU node dies under training (issue 24), on real pods: the node running the gang falls silent
(its pods' network cut), then its kubelet, containerd, device plugin and every container process
are SIGKILLed, as a VM that loses power (`DevCluster.kill_node`). Its Node and pods stay in the API
as they were last reported. Once the node lifecycle controller marks the node Ready Unknown
(--node-monitor-grace-period: 20 s on the dev cluster, nodes.NODE_GRACE_SECONDS), the operator
restarts the gang as a disruption (NodeLost, not counted against backoffLimit), force-deletes the
old attempt's pods that a dead kubelet will never confirm, and the new attempt resumes from the
last checkpoint once the node is back (the dev cluster has one GPU node: the gang has nowhere else
to go) and Succeeds with the step count continuing.

`lose_a_node` is the scenario; bench/chaos_node.py runs it for bench/chaos.py's table row.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field

import pytest

from tests.e2e.test_real_pods import RUN_TIMEOUT, reduced, wait_phase, with_blob_output
from tests.fixtures.waiting import wait_until
from trainop import conditions

pytestmark = [pytest.mark.real, pytest.mark.azurite]

# the checkpoint is reported within a shipping pass (2 s) of its save: the kill comes well
# before the first attempt could finish
STEPS, EVERY = 40, 10


@dataclass
class NodeLoss:
    """What happened, for the test's assertions and the bench's row."""
    name: str
    node: str
    checkpoint: dict            # status.checkpoint when the node died
    restarted: dict             # the status once the restart was decided
    status: dict                # the final status
    fault_to_restart: float     # seconds: the node killed -> status.attempt 1
    fault_to_running: float     # seconds: the node killed -> condition Running True again
    old_pods_gone_while_dead: bool
    pods: list[dict] = field(default_factory=list)  # the job's pods at the end


def lose_a_node(cluster, ns: str, azurite, name: str = "nodelost", backoff_limit: int = 0) -> NodeLoss:
    """Run a checkpointing 2-worker Horovod job, kill the node of worker 1 once a checkpoint is
    reported, bring the node back once the old attempt's pods are gone, and wait for the end.
    backoffLimit 0 by default: a node's death must not use up a restart, even with none to spare."""
    manifest = reduced("pytorch-horovod-synthetic.yaml", name, steps=STEPS)
    manifest["spec"]["runPolicy"] = {"backoffLimit": backoff_limit, "cleanPodPolicy": "None"}
    manifest["spec"]["checkpoint"] = {"everySteps": EVERY}
    with_blob_output(manifest, cluster, ns, azurite)
    cluster.apply(manifest, ns)

    def status() -> dict:
        return cluster.get("dtj", name, "-n", ns).get("status") or {}

    def pods() -> list[dict]:
        return cluster.get("pods", "-n", ns, "-l", f"trainop.io/job-name={name}")["items"]

    checkpoint = wait_until(lambda: status().get("checkpoint"), timeout=RUN_TIMEOUT, interval=0.5,
                            what="status.checkpoint of the first attempt")
    node = cluster.get("pod", f"{name}-worker-1", "-n", ns)["spec"]["nodeName"]
    killed = time.monotonic()
    cluster.dev.kill_node(node)
    try:
        restarted = wait_until(lambda: (s := status()).get("attempt") == 1 and s, timeout=120, interval=0.5,
                               what="the gang's restart after the node was lost")
        fault_to_restart = time.monotonic() - killed
        # the old attempt's pods go while the node is still dead: nobody there confirms
        gone = wait_until(lambda: not [p for p in pods() if p["metadata"]["labels"].get("trainop.io/attempt") == "0"],
                          timeout=30, interval=0.5, what="the old attempt's pods gone while their node is dead")
    finally:
        cluster.dev.revive_node(node)

    def running_again() -> bool:
        s = status()
        return s.get("attempt") == 1 and conditions.is_true(s.get("conditions"), "Running")
    wait_until(running_again, timeout=RUN_TIMEOUT, interval=0.5, what="attempt 1 Running")
    fault_to_running = time.monotonic() - killed
    final = wait_phase(cluster, ns, name, "Succeeded")
    return NodeLoss(name, node, checkpoint, restarted, final, fault_to_restart, fault_to_running,
                    bool(gone), pods())


def duplicates(loss: NodeLoss) -> int:
    """Pods beyond one per (attempt, role, index): the launcher Job's pods count per attempt."""
    seen: dict[tuple, int] = {}
    for pod in loss.pods:
        labels = pod["metadata"]["labels"]
        key = (labels.get("trainop.io/attempt"), labels.get("trainop.io/role"), labels.get("trainop.io/replica-index"))
        seen[key] = seen.get(key, 0) + 1
    return sum(n - 1 for n in seen.values())


def test_a_node_lost_under_training_restarts_the_gang_from_the_last_checkpoint(real_cluster, real_namespace,
                                                                               real_operator, pod_azurite):
    ns = real_namespace
    loss = lose_a_node(real_cluster, ns, pod_azurite)
    name, st = loss.name, loss.status

    # a disruption named after the node, not a failure of the job (backoffLimit 0 would have failed it)
    assert st["attempt"] == 1
    assert st["restarts"]["failures"] == 0 and st["restarts"]["disruptions"] == 1, st["restarts"]
    entry = st["restarts"]["history"][-1]
    assert (entry["attempt"], entry["cause"], entry["counted"], entry["node"]) == (1, "NodeLost", False, loss.node)
    assert f"on node {loss.node}" in entry["message"] and "the node is lost (Ready Unknown" in entry["message"]
    assert loss.old_pods_gone_while_dead

    # exactly one pod per worker and one launcher pod, all of attempt 1; they ran on real nodes
    assert duplicates(loss) == 0
    assert {p["metadata"]["labels"]["trainop.io/attempt"] for p in loss.pods} == {"1"}
    real_cluster.assert_ran_on_real_nodes(ns, f"trainop.io/job-name={name}")

    # attempt 1 fetched the checkpoint and its ranks went on from its step, to STEPS in all
    fetch = real_cluster.logs(ns, f"{name}-worker-0", "-c", "fetch-checkpoint")
    resumed_at = re.search(r"fetched \d+ file\(s\) of \S+/0/output/checkpoints/attempt-0/step-(\d+)", fetch)
    assert resumed_at, fetch
    step = int(resumed_at[1])
    assert loss.checkpoint["step"] <= step < STEPS
    launcher = real_cluster.logs(ns, f"job/{name}-launcher", "-c", "launcher")
    assert f"resuming from /var/trainop/resume/step-{step} at step {step}" in launcher, launcher[-3000:]
    final = wait_until(lambda: ((real_cluster.get("dtj", name, "-n", ns).get("status") or {}).get("metrics") or {})
                       .get("final") and real_cluster.get("dtj", name, "-n", ns)["status"]["metrics"],
                       timeout=120, what="the final metrics")
    assert final["step"] == STEPS

    # a state that healed itself is no ERROR
    assert not [line for line in real_operator.logs().splitlines() if "ERROR" in line]
