"""spec.elastic on the real control plane (KWOK pods): spot nodes taken away while the gang
runs (the node deleted, as Azure's eviction of a spot VM leaves it: the operator restarts the
gang on the Node's deletion) and added back (as the cluster autoscaler does). The real scheduler decides
what fits; the test plays worker 0's log shipper only to report checkpoints into the job's
progress ConfigMap, as test_resume.py does. With Kueue (the real v0.17.0, its
ElasticJobsViaWorkloadSlices gate on): the Workload's count follows the size, in place when it
shrinks, through an admitted replacement slice when it grows, never past what Kueue admitted."""

from __future__ import annotations

import json

import pytest

from tests.cluster.test_dtj import manifest
from tests.cluster.test_kueue import KUEUE, flavor_queue
from tests.cluster.test_pools import Api, Pools
from tests.fixtures.waiting import wait_until
from trainop.devcluster import kueue as kueue_dev

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(420)]


@pytest.fixture
def pools(cluster):
    made = Pools(cluster)
    yield made
    made.cleanup()


@pytest.fixture
def api(cluster, namespace):
    return Api(cluster, namespace)


@pytest.fixture
def claim(cluster, namespace):
    """A bound claim `out` (a hostPath PV pre-bound to it: no provisioner here), which the
    scheduler needs before it places a pod that mounts it; KWOK mounts nothing."""
    pv = f"pv-{namespace}"
    cluster.apply({"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": pv},
                   "spec": {"capacity": {"storage": "1Gi"}, "accessModes": ["ReadWriteMany"],
                            "storageClassName": "", "hostPath": {"path": "/tmp/trainop-elastic"},
                            "claimRef": {"namespace": namespace, "name": "out"}}}, namespace)
    cluster.apply({"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": "out"},
                   "spec": {"accessModes": ["ReadWriteMany"], "storageClassName": "", "volumeName": pv,
                            "resources": {"requests": {"storage": "1Gi"}}}}, namespace)
    # Bound before any pod asks for it: the controller-manager's PV controller can meet the claim
    # before the volume and then binds them at its next 15 s resync, while the scheduler holds the
    # pods back ("unbound immediate PersistentVolumeClaims") and an elastic job's
    # shrinkAfterSeconds=5 runs out: the gang shrank with 4 nodes free (seen in CI, 2026-12-05).
    wait_until(lambda: cluster.get("pvc", "out", "-n", namespace).get("status", {}).get("phase") == "Bound",
               timeout=60, what="claim out Bound")
    yield "out"
    cluster.kubectl("delete", "pv", pv, "--ignore-not-found", "--wait=false")


def elastic_job(name: str, **more) -> dict:
    return manifest(name, workers=4, nodePool={"name": "spot"}, output={"pvc": {"claimName": "out"}},
                    elastic={"minWorkers": 2, "shrinkAfterSeconds": 5}, **more)


def report_checkpoint(api: Api, name: str, step: int, attempt: int) -> None:
    """What worker 0's shipper writes once a checkpoint is complete (render/logship.py)."""
    uid = api.job(name)["metadata"]["uid"]
    path = f"/output/checkpoints/{name}-{uid[:8]}/attempt-{attempt}/step-{step}"
    api.core.patch_namespaced_config_map(f"{name}-progress", api.ns, {"data": {"checkpoint": json.dumps(
        {"step": step, "time": "2026-11-27T10:00:00Z", "path": path})}})
    wait_until(lambda: (api.status(name).get("checkpoint") or {}).get("step") == step, timeout=30,
               what=f"checkpoint step {step} accepted")


def running_workers(api: Api, name: str, attempt: int) -> list:
    return [p for p in api.pods(name, "worker") if p.metadata.labels["trainop.io/attempt"] == str(attempt)
            and p.status.phase == "Running" and not p.metadata.deletion_timestamp]


def resized(api: Api, name: str, cause: str) -> dict | None:
    return next((h for h in reversed((api.status(name).get("restarts") or {}).get("history") or [])
                 if h["cause"] == cause), None)


def take_a_node_away(api: Api, pools: Pools, name: str, worker: str) -> str:
    node = next(p.spec.node_name for p in api.pods(name, "worker") if p.metadata.name == worker)
    pools.remove(node)  # Azure takes the spot VM back
    return node


def test_spot_nodes_taken_and_given_back_shrink_then_grow_the_gang(cluster, namespace, api, pools, claim,
                                                                   operator_factory):
    operator_factory(config=pools.config(spot={"autoscale": {"minNodes": 0, "maxNodes": 8}, "spot": True}))
    for i in range(4):
        pools.add("spot", i, spot=True)
    cluster.apply(elastic_job("el", runPolicy={"backoffLimit": 0}), namespace)
    api.wait_running("el")
    assert api.status("el")["elastic"]["workers"] == 4
    report_checkpoint(api, "el", 50, 0)

    lost = take_a_node_away(api, pools, "el", "el-worker-3")
    # the Node's deletion restarts the gang at 4 (SpotEviction), which waits shrinkAfterSeconds
    # for a 4th node, then runs at 2: 3 fit, but 3 workers of 4 cannot share the global batch
    # (the largest size dividing 4)
    api.wait_running("el", attempt=2, timeout=150)
    status = api.status("el")
    assert status["elastic"]["workers"] == 2 and status["workers"]["total"] == 2
    assert status["elastic"]["fits"] == 3
    spot, shrink = status["restarts"]["history"][-2:]
    assert (spot["cause"], spot["node"], spot["attempt"]) == ("SpotEviction", lost, 1)
    assert {k: shrink[k] for k in ("cause", "fromWorkers", "toWorkers", "attempt", "counted")} == \
        {"cause": "CapacityLost", "fromWorkers": 4, "toWorkers": 2, "attempt": 2, "counted": False}
    assert (status["restarts"]["failures"], status["restarts"]["resizes"]) == (0, 1)
    assert sorted(p.metadata.name for p in running_workers(api, "el", 2)) == [f"el-worker-{i}" for i in range(2)]
    hostfile = api.core.read_namespaced_config_map("el-mpi", namespace).data["hostfile"]
    assert len(hostfile.splitlines()) == 2
    env = {e.name: e.value for e in running_workers(api, "el", 2)[0].spec.containers[0].env}
    assert env["TRAINOP_ELASTIC_MAX_WORLD"] == "16"  # 4 workers x 4 ranks, at every size
    assert env["TRAINOP_RESUME_FROM"].endswith("/attempt-0/step-50")
    api.wait_event("el", "Normal/Resized")

    # the autoscaler brings a node back: the gang grows at the next checkpoint, not before
    pools.add("spot", 4, spot=True)
    wait_until(lambda: api.status("el")["elastic"].get("growTo") == 4, timeout=30, what="the grow decided")
    assert api.status("el")["attempt"] == 2 and len(running_workers(api, "el", 2)) == 2
    report_checkpoint(api, "el", 100, 2)
    api.wait_running("el", attempt=3, timeout=60)
    status = api.status("el")
    grow = resized(api, "el", "CapacityReturned")
    assert (grow["fromWorkers"], grow["toWorkers"], grow["attempt"]) == (2, 4, 3)
    assert "checkpoint step 100 saved" in grow["message"]
    assert status["elastic"] == {"workers": 4, "message": grow["message"]}
    assert len(running_workers(api, "el", 3)) == 4
    env = {e.name: e.value for e in running_workers(api, "el", 3)[0].spec.containers[0].env}
    assert env["TRAINOP_RESUME_FROM"].endswith("/attempt-2/step-100")
    assert status["restarts"]["failures"] == 0 and status["phase"] == "Running"


def test_fewer_nodes_than_min_workers_wait_rather_than_shrink(cluster, namespace, api, pools, claim,
                                                              operator_factory):
    operator_factory(config=pools.config(spot={"autoscale": {"minNodes": 0, "maxNodes": 8}, "spot": True}))
    pools.add("spot", 0, spot=True)
    cluster.apply(elastic_job("few"), namespace)  # minWorkers 2, one node
    message = wait_until(lambda: (api.status("few").get("elastic") or {}).get("message", "").startswith(
        "1/4 workers placed, fewer than minWorkers 2") and api.status("few")["elastic"]["message"],
        timeout=60, what="the wait for minWorkers")
    assert api.condition("few", "WaitingForNodes")["status"] == "True", message
    assert api.status("few")["attempt"] == 0
    pools.add("spot", 1, spot=True)  # two nodes: minWorkers fit, shrinkAfterSeconds later it runs at 2
    api.wait_running("few", attempt=1, timeout=60)
    assert api.status("few")["elastic"]["workers"] == 2


# ---- Kueue --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def kueue(cluster, tmp_path_factory):
    proc = kueue_dev.Kueue(cluster.kubeconfig, tmp_path_factory.mktemp("kueue"), settings={
        "featureGates": {"VisibilityOnDemand": False, "ElasticJobsViaWorkloadSlices": True}}).start()
    yield proc
    proc.stop()


def workloads(api: Api, job: str) -> dict[str, dict]:
    return {w["metadata"]["name"]: w for w in api.custom.list_namespaced_custom_object(
        *KUEUE, api.ns, "workloads", label_selector=f"trainop.io/job-name={job}")["items"]}


def _conds(wl: dict) -> dict[str, str]:
    return {c["type"]: c["status"] for c in (wl.get("status") or {}).get("conditions") or []}


def _count(wl: dict) -> int:
    return next(ps["count"] for ps in wl["spec"]["podSets"] if ps["name"] == "workers")


def reserved_gpus(api: Api, cq: str) -> int:
    cq_obj = api.custom.get_cluster_custom_object(*KUEUE, "clusterqueues", cq)
    return sum(int(r.get("total", 0)) for f in (cq_obj.get("status") or {}).get("flavorsReservation") or []
               for r in f.get("resources") or [] if r["name"] == "nvidia.com/gpu")


def test_kueue_workload_follows_the_size_and_a_grow_waits_for_admission(cluster, namespace, api, pools, claim,
                                                                        kueue, operator_factory):
    cfg = pools.config(spot={"autoscale": {"minNodes": 0, "maxNodes": 8}, "spot": True})
    operator_factory(config={**cfg, "kueue": {"workloadSlices": True}})
    queue = flavor_queue(api.custom, namespace, f"cq-{namespace}", 16)
    cq = next(queue)
    try:
        for i in range(4):
            pools.add("spot", i, spot=True)
        cluster.apply(elastic_job("ek", queue="team"), namespace)
        api.wait_running("ek")
        first = workloads(api, "ek")["dtj-ek"]
        assert first["metadata"]["annotations"]["kueue.x-k8s.io/elastic-job"] == "true"
        assert _count(first) == 4
        wait_until(lambda: reserved_gpus(api, cq) == 16, timeout=30, what="16 GPUs reserved")
        report_checkpoint(api, "ek", 50, 0)

        take_a_node_away(api, pools, "ek", "ek-worker-3")
        api.wait_running("ek", attempt=2, timeout=150)
        # shrunk in place (to 2: 3 fit, but only a size dividing 4 shares the global batch): the
        # same Workload, still admitted, for 2 workers; 8 GPUs back in the queue
        wl = wait_until(lambda: (w := workloads(api, "ek").get("dtj-ek")) and _count(w) == 2 and w, timeout=30,
                        what="the Workload's count lowered to 2")
        assert _conds(wl)["Admitted"] == "True" and wl["metadata"]["uid"] == first["metadata"]["uid"]
        wait_until(lambda: reserved_gpus(api, cq) == 8, timeout=30, what="8 GPUs reserved")

        # another job takes 4 of the 8 GPUs the shrink gave back
        cluster.apply(manifest("other", workers=1, queue="team", nodePool={"name": "spot"}), namespace)
        wait_until(lambda: reserved_gpus(api, cq) == 12, timeout=60, what="the other job admitted")
        # nodes come back: the grow needs 8 more GPUs of Kueue first, and the queue has 4
        pools.add("spot", 4, spot=True)
        pools.add("spot", 5, spot=True)
        pending = wait_until(lambda: next((w for n, w in workloads(api, "ek").items() if n.startswith("dtj-ek-a")), None),
                             timeout=30, what="the replacement slice")
        assert pending["metadata"]["annotations"]["kueue.x-k8s.io/workload-slice-replacement-for"] == \
            f"{namespace}/dtj-ek"
        assert _count(pending) == 4
        message = wait_until(lambda: "waiting for Kueue to admit Workload slice" in
                             (api.status("ek")["elastic"].get("message") or "") and api.status("ek")["elastic"]["message"],
                             timeout=30, what="the grow waiting for Kueue")
        report_checkpoint(api, "ek", 100, 2)  # a checkpoint does not grow it past what Kueue admitted
        assert _conds(workloads(api, "ek")[pending["metadata"]["name"]]).get("QuotaReserved") != "True"
        assert api.status("ek")["attempt"] == 2 and len(running_workers(api, "ek", 2)) == 2, message
        assert reserved_gpus(api, cq) == 12

        # the other job ends: Kueue admits the slice (replacing dtj-ek), the gang grows
        cluster.end_pod(namespace, api.wait_running("other").metadata.name, 0)
        api.wait_phase("other", "Succeeded")
        api.wait_running("ek", attempt=3, timeout=90)
        assert len(running_workers(api, "ek", 3)) == 4
        left = wait_until(lambda: (w := workloads(api, "ek")) and "dtj-ek" not in w and w, timeout=30,
                          what="the replaced Workload released")
        assert list(left) == [pending["metadata"]["name"]] and _conds(left[pending["metadata"]["name"]])["Admitted"] == "True"
        # (the ClusterQueue's status follows the released Workload and the admitted slice a
        # moment later)
        wait_until(lambda: reserved_gpus(api, cq) == 16, timeout=30, what="16 GPUs reserved by the grown gang")
        assert resized(api, "ek", "CapacityReturned")["toWorkers"] == 4
    finally:
        next(queue, None)  # the ClusterQueue and flavor deleted
