"""The preflight fabric check in real pods (render/fabric.py, trainop_trainer/preflight.py,
jobsync.fabric._fabric): every worker's `preflight` init container runs the all-reduce under torchrun,
rendezvous on worker 0 through the job's Service before any worker is Ready, Gloo on the CPU
(no GPU, no HCA here), and worker 0's kubelet puts the result into the pod's status as the
container's termination message, which the operator reads from its pod watch.

What stays in tests/cluster/test_preflight.py: tainting a slow node. The check names a node only
when one worker is slow in both of its pairs while another pair passes, which needs 3 or more
workers on nodes of different speed. Here every worker shares the one real GPU node and its
bridge, so no worker can be slower than another by construction, and a tainted node would leave
the next attempt nowhere to run. That test writes the report the program would write and checks
the rest (taint, uncounted restart, the next attempt elsewhere) against the real API server and
scheduler; test_a_gang_below_the_threshold_... below shows the real program's failing report and
the operator's verdict on it in real pods."""

from __future__ import annotations

import json

import pytest

from tests.e2e.test_real_pods import RUN_TIMEOUT, reduced, wait_phase
from tests.fixtures.cluster import OperatorProcess, call_failed
from tests.fixtures.waiting import wait_until
from trainop.render.fabric import PREFLIGHT_EXIT_SLOW, UNHEALTHY_TAINT

pytestmark = [pytest.mark.real]


def preflight_state(cluster, namespace: str, pod: str) -> dict | None:
    """The preflight init container's terminated state, as the kubelet reported it."""
    status = cluster.get("pod", pod, "-n", namespace).get("status", {})
    for cs in status.get("initContainerStatuses") or []:
        if cs["name"] == "preflight":
            return (cs.get("state") or {}).get("terminated") or (cs.get("lastState") or {}).get("terminated")
    return None


def test_preflight_measures_the_gang_in_real_pods_then_training_starts(real_cluster, real_namespace, real_operator):
    ns = real_namespace
    manifest = reduced("pytorch-horovod-synthetic.yaml", "pf", steps=5,
                       preflight={"enabled": True, "minBusBandwidthGBps": 0.001})
    real_cluster.apply(manifest, ns)

    def measured():
        pre = real_cluster.get("dtj", "pf", "-n", ns).get("status", {}).get("preflight")
        return pre if pre and pre.get("attempt") == 0 else None
    pre = wait_until(measured, timeout=RUN_TIMEOUT, interval=1, what="status.preflight of attempt 0")
    assert pre["passed"] is True and pre["busBandwidthGBps"] > 0.001, pre
    assert (pre["backend"], pre["transport"], pre["worldSize"], pre["sizeBytes"]) == ("gloo", "Socket", 2, 64 * 2**20)
    assert "pairs" not in pre and "suspectNode" not in pre
    transport = next(c for c in real_cluster.get("dtj", "pf", "-n", ns)["status"]["conditions"]
                     if c["type"] == "Transport")
    assert (transport["status"], transport["reason"]) == ("True", "Socket"), transport  # not an IB job: as asked

    # Both workers' init containers really ran it, on a real node, and agreed on the result.
    # status.preflight comes from worker 0's report alone: worker 1's kubelet may post its own
    # terminated state a moment later (CI caught it PodInitializing), so wait for each.
    real_cluster.assert_ran_on_real_nodes(ns, "trainop.io/job-name=pf,trainop.io/role=worker")
    for i in (0, 1):
        term = wait_until(lambda: preflight_state(real_cluster, ns, f"pf-worker-{i}"), timeout=120,
                          interval=1, what=f"pf-worker-{i}'s preflight to end")
        assert term["exitCode"] == 0, term
        log = real_cluster.logs(ns, f"pf-worker-{i}", "-c", "preflight")
        line = next(x for x in log.splitlines() if x.startswith("trainop-preflight: "))
        assert json.loads(line.split(": ", 1)[1])["busBandwidthGBps"] == pre["busBandwidthGBps"], log[-2000:]
    assert json.loads(preflight_state(real_cluster, ns, "pf-worker-0")["message"])["passed"] is True

    # Training starts after it in the same pods: the launcher's mpirun reports a step.
    def training():
        pods = real_cluster.get("pods", "-n", ns, "-l", "trainop.io/job-name=pf,trainop.io/role=launcher")["items"]
        running = [p for p in pods if p["status"].get("phase") in ("Running", "Succeeded")]
        return running and '"step"' in real_cluster.logs(ns, running[0]["metadata"]["name"], "-c", "launcher")
    wait_until(training, timeout=RUN_TIMEOUT, interval=1, what="the launcher's first training step")
    status = wait_phase(real_cluster, ns, "pf", "Succeeded")
    assert not status.get("attempt") and status["preflight"]["attempt"] == 0


@pytest.fixture
def tainting_operator(real_cluster, real_namespace, tmp_path, request):
    op = OperatorProcess(real_cluster, [real_namespace], tmp_path / "operator.log",
                         config={"preflight": {"taintUnhealthyNodes": True, "sizeMB": 4, "iterations": 5}}).start()
    yield op
    op.stop()
    if call_failed(request):
        print(f"\n--- operator log ---\n{op.logs()[-8000:]}")


def test_a_gang_below_the_threshold_times_its_pair_and_fails_counted_without_a_taint(
        real_cluster, real_namespace, tainting_operator):
    """A threshold no CPU meets, with tainting allowed: every rank exits with the slow code, the
    report carries the pairwise test, and with 2 workers no single node is to blame, so no taint
    and the restart counts (backoffLimit 0: the job fails)."""
    ns = real_namespace
    manifest = reduced("pytorch-torchrun-synthetic.yaml", "slow", preflight={"enabled": True, "minBusBandwidthGBps": 1e6},
                       runPolicy={"backoffLimit": 0, "cleanPodPolicy": "None"})  # keep the pods to read
    real_cluster.apply(manifest, ns)
    status = wait_phase(real_cluster, ns, "slow", "Failed")
    pre = status["preflight"]
    assert pre["passed"] is False and pre["sizeBytes"] == 4 * 2**20 and pre["minBusBandwidthGBps"] == 1e6, pre
    assert [p["workers"] for p in pre["pairs"]] == [[0, 1]] and pre["pairs"][0]["busBandwidthGBps"] > 0
    assert "suspectNode" not in pre and "no single worker was slow in every pair" in pre["message"]
    failed = next(c for c in status["conditions"] if c["type"] == "Failed")
    assert failed["reason"] == "BackoffLimitExceeded" and "container preflight" in failed["message"], failed
    assert status["lastFailure"]["reason"] == "FabricCheckFailed"
    assert (status["lastFailure"]["container"], status["lastFailure"]["exitCode"]) == ("preflight", PREFLIGHT_EXIT_SLOW)
    assert not (status.get("restarts") or {}).get("unhealthyNodes")
    real_cluster.assert_ran_on_real_nodes(ns, "trainop.io/job-name=slow")
    for i in (0, 1):  # every rank knew and exited with the slow code, in a real container
        term = wait_until(lambda: preflight_state(real_cluster, ns, f"slow-worker-{i}"), timeout=120,
                          interval=1, what=f"slow-worker-{i}'s preflight to end")
        assert term["exitCode"] == PREFLIGHT_EXIT_SLOW, term
    for node in real_cluster.get("nodes")["items"]:
        assert not [t for t in node["spec"].get("taints") or [] if t["key"] == UNHEALTHY_TAINT], node["metadata"]["name"]
