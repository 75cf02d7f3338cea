"""Autoscaled and spot pools, and failures classified, on the real control plane: the real
scheduler leaves pods Pending until nodes come, the test adds KWOK nodes while the job waits
(what the cluster autoscaler does on AKS), and disruptions are made by the real mechanisms: the
Eviction API (the API server marks the pod DisruptionTarget and deletes it) and a deleted node
(what a spot VM taken back by Azure leaves: the operator restarts the gang on the Node's
deletion, before the controller-manager's pod garbage collector would mark its pods
DisruptionTarget DeletionByPodGC after its 40 s quarantine).

Each test makes its own pools (unique agentpool labels) so its nodes serve no other test, and
deletes its nodes afterwards."""

from __future__ import annotations

import copy
import secrets

import pytest
from kubernetes import client as k8s

from tests.cluster.test_dtj import FAST, Api, manifest
from tests.fixtures.waiting import wait_until
from trainop import config

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]


class Pools:
    """KWOK nodes of pools this test owns, made and removed as an autoscaler would."""

    def __init__(self, cluster):
        self.cluster, self.tag, self.made = cluster, secrets.token_hex(3), []

    def label(self, pool: str) -> str:
        return f"{pool}{self.tag}"

    def config(self, **pools) -> dict:
        out = {**FAST, "nodePools": {**copy.deepcopy(config.DEFAULTS["nodePools"])}}
        for name, extra in pools.items():
            out["nodePools"][name] = {"nodeSelector": {config.POOL_LABEL: self.label(name)},
                                      "tolerations": [config.GPU_TOLERATION], "gpusPerNode": 4, **extra}
        return out

    def add(self, pool: str, index: int, spot: bool = False) -> str:
        self.made.append(self.cluster.add_node(self.label(pool), index, spot=spot))
        return self.made[-1]

    def remove(self, name: str) -> None:
        self.cluster.kubectl("delete", "node", name, "--wait=false")

    def cleanup(self) -> None:
        for name in self.made:
            self.cluster.kubectl("delete", "node", name, "--ignore-not-found", "--wait=false")


@pytest.fixture
def pools(cluster):
    made = Pools(cluster)
    yield made
    made.cleanup()


@pytest.fixture
def api(cluster, namespace):
    return Api(cluster, namespace)


def waiting_message(api, name):
    cond = api.condition(name, "WaitingForNodes")
    return cond["message"] if cond and cond["status"] == "True" else None


def test_autoscaled_spot_pool_at_zero_waits_for_nodes_then_runs(cluster, namespace, api, pools, operator_factory):
    op = operator_factory(config=pools.config(spot={"autoscale": {"minNodes": 0, "maxNodes": 2}, "spot": True}))
    # 3 workers x 4 GPUs need 3 nodes: more than maxNodes, the only Unsatisfiable job
    cluster.apply(manifest("toobig", workers=3, nodePool={"name": "spot"}), namespace)
    cluster.apply(manifest("grow", nodePool={"name": "spot"}), namespace)
    failed = wait_until(lambda: api.condition("toobig", "Failed"), timeout=30, what="toobig judged")
    assert failed["reason"] == "Unsatisfiable" and "grows to at most 2 (autoscale.maxNodes)" in failed["message"]

    # The pool has no node: the pods exist, Pending, and the job says how many nodes it misses.
    message = wait_until(lambda: waiting_message(api, "grow"), timeout=30, what="WaitingForNodes")
    assert message.startswith("2/2 workers wait for nodes of node pool 'spot': 2 more nodes needed "
                              "(the pool autoscales to at most 2); the job fails at ")
    assert api.status("grow")["phase"] == "Starting"
    workers = api.pods("grow", "worker")
    assert len(workers) == 2 and all(p.status.phase == "Pending" for p in workers)
    assert all(any(t.key == config.SPOT_LABEL and t.value == "spot" and t.effect == "NoSchedule"
                   for t in p.spec.tolerations) for p in workers)

    first = pools.add("spot", 0, spot=True)  # the autoscaler adds a node
    wait_until(lambda: (m := waiting_message(api, "grow")) and m.startswith(
        "1/2 workers wait for nodes of node pool 'spot': 1 more node needed"), timeout=30,
        what="one node missing")
    assert {p.spec.node_name for p in api.pods("grow", "worker")} == {first, None}

    pools.add("spot", 1, spot=True)
    api.wait_running("grow")
    assert api.condition("grow", "WaitingForNodes")["status"] == "False"
    assert api.status("grow")["phase"] == "Running"
    log = op.logs()
    ours = [line for line in log.splitlines() if "grow]" in line]
    assert not [line for line in ours if "[ERROR" in line or "[WARNING" in line], log[-3000:]
    assert sum("grow] DistributedTrainingJob Starting: 2/2 workers wait for nodes" in line for line in ours) == 1
    assert sum("grow] DistributedTrainingJob Starting: 1/2 workers wait for nodes" in line for line in ours) == 1
    api.wait_event("grow", "Normal/WaitingForNodes")


def test_nodes_that_never_come_fail_the_job_and_free_its_quota(cluster, namespace, api, pools, operator_factory):
    operator_factory(config=pools.config(empty={"autoscale": {"minNodes": 0, "maxNodes": 4}})
                     | {"limits": {"namespaceGpus": 8}})
    # next is applied once never holds the quota (admitted, its pods Pending), so the queue judges
    # next inside never's 20 s deadline however long the operator took to list and start (a CI
    # machine under load once left never without a status for 15 s after its apply)
    cluster.apply(manifest("never", nodePool={"name": "empty"}, runPolicy={"schedulingTimeoutSeconds": 20}), namespace)
    wait_until(lambda: len(api.pods("never", "worker")) == 2, timeout=60, what="never admitted, its pods Pending")
    cluster.apply(manifest("next", nodePool={"name": "empty"}), namespace)  # queued behind: 8 GPUs in all
    wait_until(lambda: (c := api.condition("next", "Admitted")) and c["status"] == "False", timeout=20,
               what=f"next queued behind never (never: {api.status('never')})")
    status = api.wait_phase("never", "Failed", timeout=60)
    failed = api.condition("never", "Failed")
    assert failed["reason"] == "SchedulingTimeout"
    assert "did not come within runPolicy.schedulingTimeoutSeconds=20" in failed["message"]
    assert status["completionTime"]
    wait_until(lambda: not api.pods("never"), timeout=30, what="the pending pods deleted")
    # its quota is free: the job behind it is admitted and creates its pods
    wait_until(lambda: (c := api.condition("next", "Admitted")) and c["status"] == "True", timeout=30,
               what="next admitted once never failed")


def test_eviction_restarts_the_gang_without_counting(cluster, namespace, api, pools, operator_factory):
    operator_factory(config=FAST)
    cluster.apply(manifest("ev", runPolicy={"backoffLimit": 0}), namespace)
    api.wait_running("ev")
    victim = next(p for p in api.pods("ev", "worker") if p.metadata.name == "ev-worker-1")
    api.core.create_namespaced_pod_eviction("ev-worker-1", namespace, k8s.V1Eviction(
        metadata=k8s.V1ObjectMeta(name="ev-worker-1", namespace=namespace)))
    api.wait_running("ev", attempt=1)  # backoffLimit 0, yet it runs again
    status = api.status("ev")
    assert status["restarts"]["failures"] == 0 and status["restarts"]["disruptions"] == 1
    entry = status["restarts"]["history"][-1]
    assert (entry["cause"], entry["counted"], entry["pod"], entry["node"]) == (
        "Evicted", False, "ev-worker-1", victim.spec.node_name)
    assert entry["message"] == (f"pod ev-worker-1 on node {victim.spec.node_name} container worker: "
                                f"Evicted (EvictionByEvictionAPI)")
    # an exit code still counts: backoffLimit 0 is used up by the first one
    cluster.end_pod(namespace, "ev-worker-0", 1)
    api.wait_phase("ev", "Failed")
    assert api.condition("ev", "Failed")["reason"] == "BackoffLimitExceeded"


def test_failure_policy_fails_at_once_on_a_listed_exit_code(cluster, namespace, api, operator_factory):
    operator_factory(config=FAST)
    cluster.apply(manifest("fp", runPolicy={"backoffLimit": 5, "failurePolicy": {"rules": [
        {"action": "FailJob", "onExitCodes": {"containerName": "worker", "operator": "In", "values": [42]}}]}}),
        namespace)
    api.wait_running("fp")
    cluster.end_pod(namespace, "fp-worker-0", 42)
    api.wait_phase("fp", "Failed")
    failed = api.condition("fp", "Failed")
    assert failed["reason"] == "FailurePolicy"
    assert failed["message"].endswith("exited with code 42 (Error); runPolicy.failurePolicy.rules[0] says FailJob")
    assert api.status("fp")["restarts"] == {"failures": 0, "disruptions": 0}


def test_spot_node_lost_falls_back_to_the_on_demand_pool(cluster, namespace, api, pools, operator_factory):
    operator_factory(config=pools.config(spot={"autoscale": {"minNodes": 0, "maxNodes": 2}, "spot": True},
                                         ondemand={"autoscale": {"minNodes": 0, "maxNodes": 2}}))
    spot = [pools.add("spot", i, spot=True) for i in range(2)]
    ondemand = [pools.add("ondemand", i) for i in range(2)]
    cluster.apply(manifest("sp", runPolicy={"backoffLimit": 0}, nodePool={
        "name": "spot", "fallback": {"name": "ondemand", "afterSpotEvictions": 1}}), namespace)
    api.wait_running("sp")
    assert api.status("sp")["nodePool"] == "spot"
    lost = next(p.spec.node_name for p in api.pods("sp", "worker") if p.metadata.name == "sp-worker-0")
    assert lost in spot
    pools.remove(lost)  # Azure takes the spot VM back: the Node goes
    # The Node's deletion restarts the gang at once. PodGC would delete the pods only after its
    # 40 s quarantine, checked every 20 s (kube-controller-manager's gc_controller.go, neither
    # configurable): the restart must come before that, so the gang's pods there are still
    # there when the operator's own force-delete is recorded.
    api.wait_running("sp", attempt=1, timeout=60)
    status = api.status("sp")
    assert status["nodePool"] == "ondemand"
    assert status["restarts"]["failures"] == 0 and status["restarts"]["spotEvictions"] == 1
    entry = status["restarts"]["history"][-1]
    assert (entry["cause"], entry["counted"], entry["node"]) == ("SpotEviction", False, lost)
    assert "NodeDeleted" in entry["message"] and "DeletionByPodGC" not in entry["message"]
    assert {p.spec.node_name for p in api.pods("sp", "worker")} <= set(ondemand)


def test_node_tainted_out_is_node_lost_not_counted(cluster, namespace, api, pools, operator_factory):
    """The controller-manager's taint eviction controller ends pods that do not tolerate a
    NoExecute taint (marking them DisruptionTarget DeletionByTaintManager), as it does for an
    unreachable node once its tolerationSeconds run out."""
    operator_factory(config=pools.config(fixed={}))
    nodes = [pools.add("fixed", i) for i in range(3)]
    cluster.apply(manifest("tm", runPolicy={"backoffLimit": 0}, nodePool={"name": "fixed"}), namespace)
    api.wait_running("tm")
    node = next(p.spec.node_name for p in api.pods("tm", "worker") if p.metadata.name == "tm-worker-1")
    cluster.kubectl("taint", "node", node, "trainop.io/test-out=gone:NoExecute")
    api.wait_running("tm", attempt=1)
    status = api.status("tm")
    entry = status["restarts"]["history"][-1]
    assert (entry["cause"], entry["counted"], entry["node"]) == ("NodeLost", False, node)
    assert "DeletionByTaintManager" in entry["message"]
    assert status["restarts"]["failures"] == 0
    placed = {p.spec.node_name for p in api.pods("tm", "worker")}
    assert node not in placed and placed <= set(nodes)
