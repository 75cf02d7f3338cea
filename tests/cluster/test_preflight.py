"""The preflight's operator half and InfiniBand's Pod Security need, against the real API server,
scheduler and operator, on KWOK nodes. What cannot run here is the measurement inside the pods
(no GPU, no HCA; tests/trainer/test_preflight.py runs the real program on CPU with Gloo): the test
writes worker 0's preflight result into the pod's status the way the kubelet would (the
container's termination message). Everything after that is real: the operator's watch, its
decision, the taint on a real Node object, the status the CRD's schema accepts, and the
scheduler keeping the next attempt off the tainted node."""

from __future__ import annotations

import json

import pytest
from kubernetes.client.rest import ApiException

from tests.cluster.test_dtj import Api, manifest
from tests.fixtures.waiting import wait_until
from trainop.render.fabric import UNHEALTHY_TAINT

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(240)]


@pytest.fixture
def api(cluster, namespace):
    return Api(cluster, namespace)


def placed(api: Api, name: str, workers: int, attempt: int) -> dict[int, str]:
    """worker index -> node, once every worker of `attempt` is Running on a node."""
    def ready():
        pods = [p for p in api.pods(name, "worker")
                if p.metadata.labels.get("trainop.io/attempt") == str(attempt)
                and p.status.phase == "Running" and p.spec.node_name and not p.metadata.deletion_timestamp]
        return {int(p.metadata.labels["trainop.io/replica-index"]): p.spec.node_name for p in pods} \
            if len(pods) == workers else None
    return wait_until(ready, timeout=90, what=f"{workers} workers of attempt {attempt} running")


def report_preflight(api: Api, pod: str, result: dict, exit_code: int) -> None:
    """What the kubelet writes when worker 0's preflight container ends (render/fabric.py)."""
    term = {"exitCode": exit_code, "reason": "Completed" if exit_code == 0 else "Error",
            "message": json.dumps(result), "startedAt": "2026-11-26T12:00:00Z",
            "finishedAt": "2026-11-26T12:00:30Z"}
    status = {"initContainerStatuses": [{"name": "preflight", "image": "trainop/trainer-pytorch:0.1.0",
                                         "imageID": "", "ready": exit_code == 0, "restartCount": 0,
                                         "state": {"terminated": term}}]}
    if exit_code:
        status["phase"] = "Failed"
    api.core.patch_namespaced_pod_status(pod, api.ns, {"status": status})


def taints(api: Api, node: str) -> list[dict]:
    return [t.to_dict() for t in api.core.read_node(node).spec.taints or []]


def untaint(api: Api, node: str) -> None:
    """The session's nodes are shared by the tests after this one."""
    for _ in range(5):
        n = api.core.read_node(node)
        keep = [t for t in n.spec.taints or [] if t.key != UNHEALTHY_TAINT]
        try:
            api.core.patch_node(node, {"metadata": {"resourceVersion": n.metadata.resource_version},
                                       "spec": {"taints": keep or None}})
            return
        except ApiException as exc:
            if exc.status != 409:
                raise


def test_a_slow_node_is_tainted_and_the_gang_restarts_elsewhere_without_using_backoff(
        cluster, namespace, api, operator_factory):
    operator_factory({"preflight": {"taintUnhealthyNodes": True}})
    cluster.apply(manifest("pf", workers=3, gpusPerWorker=8, infiniband=True, launcher="torchrun",
                           preflight={"enabled": True, "minBusBandwidthGBps": 100},
                           runPolicy={"backoffLimit": 0}), namespace)
    nodes = placed(api, "pf", 3, attempt=0)
    assert len(set(nodes.values())) == 3  # 8 GPUs a worker: one worker a node
    slow = nodes[1]
    try:
        report_preflight(api, "pf-worker-0", {
            "busBandwidthGBps": 11.0, "minBusBandwidthGBps": 100, "passed": False, "sizeBytes": 67108864,
            "worldSize": 24, "workers": 3, "backend": "nccl", "transport": "IB",
            "pairs": [{"workers": [0, 1], "busBandwidthGBps": 10.5}, {"workers": [1, 2], "busBandwidthGBps": 9.8},
                      {"workers": [0, 2], "busBandwidthGBps": 181.0}]}, exit_code=1)
        status = wait_until(
            lambda: ((s := api.status("pf")).get("restarts") or {}).get("unhealthyNodes") == 1 and s,
            timeout=60, what="an uncounted restart")
        assert status["attempt"] == 1 and status["restarts"]["failures"] == 0  # backoffLimit 0 is untouched
        assert status["phase"] != "Failed"
        pre = status["preflight"]
        assert (pre["suspectWorker"], pre["suspectNode"], pre["tainted"], pre["passed"]) == (1, slow, True, False)
        assert {"key": UNHEALTHY_TAINT, "value": "preflight", "effect": "NoSchedule"} in \
            [{k: t[k] for k in ("key", "value", "effect")} for t in taints(api, slow)]
        assert "Warning/GangRestart" in api.event_reasons("pf")
        # the next attempt's workers keep off the tainted node, all on the one fabric
        again = placed(api, "pf", 3, attempt=1)
        assert slow not in again.values()
        labels = {api.core.read_node(n).metadata.labels["kubernetes.azure.com/agentpool"] for n in again.values()}
        assert labels == {"ibgpu"}

        # attempt 1 passes: shown in the status, with the transport NCCL chose
        report_preflight(api, "pf-worker-0", {
            "busBandwidthGBps": 183.2, "minBusBandwidthGBps": 100, "passed": True, "sizeBytes": 67108864,
            "worldSize": 24, "workers": 3, "backend": "nccl", "transport": "IB"}, exit_code=0)
        status = wait_until(lambda: (s := api.status("pf")).get("preflight", {}).get("attempt") == 1 and s,
                            timeout=60, what="attempt 1's preflight in the status")
        assert status["preflight"]["passed"] is True and status["preflight"]["busBandwidthGBps"] == 183.2
        transport = api.condition("pf", "Transport")
        assert (transport["status"], transport["reason"]) == ("True", "IB")
        assert status["phase"] == "Running" and status["attempt"] == 1
    finally:
        untaint(api, slow)


def test_without_the_admins_consent_no_node_is_tainted(cluster, namespace, api, operator_factory):
    operator_factory()  # preflight.taintUnhealthyNodes: false (the default)
    cluster.apply(manifest("pf", workers=3, gpusPerWorker=8, infiniband=True, launcher="torchrun",
                           preflight={"enabled": True, "minBusBandwidthGBps": 100},
                           runPolicy={"backoffLimit": 0}), namespace)
    nodes = placed(api, "pf", 3, attempt=0)
    report_preflight(api, "pf-worker-0", {
        "busBandwidthGBps": 11.0, "passed": False, "sizeBytes": 67108864, "worldSize": 24,
        "backend": "nccl", "transport": "IB",
        "pairs": [{"workers": [0, 1], "busBandwidthGBps": 10.5}, {"workers": [1, 2], "busBandwidthGBps": 9.8},
                  {"workers": [0, 2], "busBandwidthGBps": 181.0}]}, exit_code=1)
    status = api.wait_phase("pf", "Failed")
    assert "preflight.taintUnhealthyNodes is false" in api.condition("pf", "Failed")["message"]
    assert status["preflight"]["suspectNode"] == nodes[1] and status["preflight"]["tainted"] is False
    assert not [t for t in taints(api, nodes[1]) if t["key"] == UNHEALTHY_TAINT]


SLOW_1 = {"busBandwidthGBps": 11.0, "minBusBandwidthGBps": 100, "passed": False, "sizeBytes": 67108864,
          "worldSize": 24, "workers": 3, "backend": "nccl", "transport": "IB",
          "pairs": [{"workers": [0, 1], "busBandwidthGBps": 10.5}, {"workers": [1, 2], "busBandwidthGBps": 9.8},
                    {"workers": [0, 2], "busBandwidthGBps": 181.0}]}


def test_recreating_the_job_cannot_taint_past_the_clusters_cap(cluster, namespace, api, operator_factory):
    """Issue 22 M5: the attack is a job that blames a node, deleted and made again to blame the
    next one. preflight.maxTaintedNodes=1 is counted from the nodes' own taints: the first node
    is tainted; the re-created job's suspect is not, its restart is the job's own (counted:
    backoffLimit 0 fails it) and status.preflight.tainted says false, naming the cap."""
    operator_factory({"preflight": {"taintUnhealthyNodes": True, "maxTaintedNodes": 1}})
    tainted = []
    try:
        for round_ in range(2):
            cluster.apply(manifest("pf", workers=3, gpusPerWorker=8, infiniband=True, launcher="torchrun",
                                   preflight={"enabled": True, "minBusBandwidthGBps": 100},
                                   runPolicy={"backoffLimit": 0}), namespace)
            nodes = placed(api, "pf", 3, attempt=0)
            slow = nodes[1]
            assert slow not in tainted
            report_preflight(api, "pf-worker-0", SLOW_1, exit_code=1)
            if round_ == 0:  # within the cap: tainted, the restart uncounted
                wait_until(lambda: ((api.status("pf").get("restarts") or {}).get("unhealthyNodes") == 1),
                           timeout=60, what="the preflight judged")
                wait_until(lambda: any(t["key"] == UNHEALTHY_TAINT for t in taints(api, slow)),
                           timeout=30, what=f"{slow} tainted")
                tainted.append(slow)
                cluster.kubectl("delete", "dtj", "pf", "-n", namespace, "--wait=true")
                wait_until(lambda: not api.pods("pf", "worker"), timeout=60, what="the job's pods gone")
        # the re-created job's suspect: refused, and its status says so
        api.wait_phase("pf", "Failed")
        status = api.status("pf")
        assert status["preflight"]["tainted"] is False and status["preflight"]["suspectNode"] == slow
        assert (status.get("restarts") or {}).get("unhealthyNodes", 0) == 0
        assert f"node not tainted (1 node(s) already carry {UNHEALTHY_TAINT} ({tainted[0]}), the cluster's cap " \
               "preflight.maxTaintedNodes=1" in api.condition("pf", "Failed")["message"]
        assert not [t for t in taints(api, slow) if t["key"] == UNHEALTHY_TAINT]
        assert [n.metadata.name for n in api.core.list_node().items
                if any(t.key == UNHEALTHY_TAINT for t in n.spec.taints or [])] == tainted
    finally:
        for node in tainted:
            untaint(api, node)


def test_ipc_lock_needs_a_privileged_namespace_and_the_condition_says_which_label(
        cluster, namespace, api, operator_factory):
    cluster.kubectl("label", "--overwrite", "ns", namespace, "pod-security.kubernetes.io/enforce=baseline")
    operator_factory({"infiniband": {"ipcLock": True}})
    cluster.apply(manifest("ib", workers=2, gpusPerWorker=8, infiniband=True, launcher="torchrun"), namespace)
    cond = wait_until(lambda: (c := api.condition("ib", "Created")) and c["reason"] == "PodSecurityForbidden" and c,
                      timeout=60, what=f"Created=False PodSecurityForbidden (status: {api.status('ib')})")
    assert cond["status"] == "False"
    assert "IPC_LOCK" in cond["message"]
    assert f"pod-security.kubernetes.io/enforce=privileged on namespace {namespace}" in cond["message"]
    assert api.status("ib")["phase"] == "Pending" and not api.pods("ib")
    # the admin relabels; the next reconcile (a touch of the job here) creates the gang
    cluster.kubectl("label", "--overwrite", "ns", namespace, "pod-security.kubernetes.io/enforce=privileged")
    cluster.kubectl("annotate", "-n", namespace, "--overwrite", "dtj/ib", "touched=1")
    wait_until(lambda: len(api.pods("ib", "worker")) == 2, timeout=60, what="the gang's pods")
    caps = api.pods("ib", "worker")[0].spec.containers[0].security_context.capabilities
    assert caps.add == ["IPC_LOCK"] and caps.drop == ["ALL"]
