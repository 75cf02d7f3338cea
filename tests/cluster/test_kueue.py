"""Kueue decides admission: the real Kueue controller (built from sigs.k8s.io/kueue, see
trainop/devcluster/kueue.py) runs against the local control plane; jobs that name a LocalQueue
wait, with no pod, until Kueue admits their Workload, in the ClusterQueue's order."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from kubernetes.client.exceptions import ApiException

from tests.cluster.test_dtj import FAST, Api, manifest
from tests.cluster.test_quota import NOTHING, PodWatch, failed_because
from tests.fixtures.waiting import wait_until
from trainop.devcluster import kueue as kueue_dev

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(240)]

KUEUE = ("kueue.x-k8s.io", "v1beta2")
GROUP, VERSION, PLURAL = "trainop.io", "v1alpha1", "distributedtrainingjobs"


@pytest.fixture(scope="module")
def kueue(cluster, tmp_path_factory):
    proc = kueue_dev.Kueue(cluster.kubeconfig, tmp_path_factory.mktemp("kueue")).start()
    yield proc
    proc.stop()


@pytest.fixture
def api(cluster, namespace):
    return Api(cluster, namespace)


def flavor_queue(custom, namespace: str, name: str, gpus: int, node_labels: dict | None = None,
                 strict_fifo: bool = False):
    """A ResourceFlavor and ClusterQueue `name` with `gpus` GPUs of quota on that flavor, and the
    LocalQueue `team` of `namespace` on it; a generator for a fixture (deleted after)."""
    group, version = KUEUE
    custom.create_cluster_custom_object(group, version, "resourceflavors", {
        "apiVersion": f"{group}/{version}", "kind": "ResourceFlavor", "metadata": {"name": name},
        "spec": {"nodeLabels": node_labels} if node_labels else {}})
    custom.create_cluster_custom_object(group, version, "clusterqueues", {
        "apiVersion": f"{group}/{version}", "kind": "ClusterQueue", "metadata": {"name": name},
        "spec": {"namespaceSelector": {}, **({"queueingStrategy": "StrictFIFO"} if strict_fifo else {}),
                 "resourceGroups": [{"coveredResources": ["nvidia.com/gpu", "cpu", "memory"],
                                     "flavors": [{"name": name, "resources": [
                                         {"name": "nvidia.com/gpu", "nominalQuota": gpus},
                                         {"name": "cpu", "nominalQuota": 100},
                                         {"name": "memory", "nominalQuota": "1Ti"}]}]}]}})
    custom.create_namespaced_custom_object(group, version, namespace, "localqueues", {
        "apiVersion": f"{group}/{version}", "kind": "LocalQueue", "metadata": {"name": "team"},
        "spec": {"clusterQueue": name}})
    yield name
    custom.delete_cluster_custom_object(group, version, "clusterqueues", name)
    custom.delete_cluster_custom_object(group, version, "resourceflavors", name)


@pytest.fixture
def queues(cluster, namespace, api, kueue):
    """A ClusterQueue with 8 GPUs (StrictFIFO: priority, then creation) and a LocalQueue."""
    yield from flavor_queue(api.custom, namespace, f"cq-{namespace}", 8, strict_fifo=True)


@pytest.fixture
def workload_priority_classes(api, namespace, kueue):
    """make(name, value): the WorkloadPriorityClass `<namespace>-<name>` (cluster-scoped),
    deleted after the test."""
    made = []

    def make(name: str, value: int) -> str:
        full = f"{namespace}-{name}"
        api.custom.create_cluster_custom_object(*KUEUE, "workloadpriorityclasses", {
            "apiVersion": "/".join(KUEUE), "kind": "WorkloadPriorityClass",
            "metadata": {"name": full}, "value": value})
        made.append(full)
        return full

    yield make
    for name in made:
        api.custom.delete_cluster_custom_object(*KUEUE, "workloadpriorityclasses", name)


def workload(api: Api, job: str) -> dict:
    return wait_until(lambda: next((w for w in api.custom.list_namespaced_custom_object(
        *KUEUE, api.ns, "workloads")["items"] if w["metadata"]["name"] == f"dtj-{job}"), None),
        timeout=30, what=f"Workload dtj-{job}")


def test_cluster_queue_admits_jobs_in_its_order_and_unadmitted_jobs_have_no_pods(
        cluster, namespace, api, queues, operator_factory, workload_priority_classes):
    operator_factory(config=FAST)
    urgent = workload_priority_classes("urgent", 10)
    watch = PodWatch(api)
    try:
        cluster.apply(manifest("a", queue="team"), namespace)           # 8 GPUs: the whole queue
        api.wait_running("a")
        assert api.condition("a", "Admitted")["reason"] == "KueueAdmitted"
        cluster.apply(manifest("b", queue="team"), namespace)
        api.wait_phase("b", "Queued")
        cluster.apply(manifest("c", queue="team", priorityClassName=urgent), namespace)  # later
        api.wait_phase("c", "Queued")
        cond = api.condition("b", "Admitted")
        assert (cond["status"], cond["reason"]) == ("False", "WaitingForKueue")
        assert cond["message"].startswith("Workload dtj-b waits in LocalQueue team")

        assert not watch.pods_of("b") and not watch.pods_of("c")
        # (c is Queued once trainop made its Workload; Kueue writes its status after that)
        wl = wait_until(lambda: (lambda w: w if "QuotaReserved" in conditions_of(w) else None)(
            api.custom.get_namespaced_custom_object(*KUEUE, namespace, "workloads", "dtj-c")),
            what="Kueue's QuotaReserved condition on dtj-c")
        assert conditions_of(wl)["QuotaReserved"]["status"] == "False"
        assert (wl["spec"]["priorityClassRef"], wl["spec"]["priority"]) == (
            {"group": "kueue.x-k8s.io", "kind": "WorkloadPriorityClass", "name": urgent}, 10)

        cluster.end_pod(namespace, api.wait_running("a").metadata.name, 0)
        api.wait_phase("a", "Succeeded")
        api.wait_running("c")  # the ClusterQueue's order: priority before arrival
        wl = api.custom.get_namespaced_custom_object(*KUEUE, namespace, "workloads", "dtj-a")
        assert {c["type"]: c["status"] for c in wl["status"]["conditions"]}["Finished"] == "True"
        assert api.status("b")["phase"] == "Queued" and not watch.pods_of("b")
        # Suspending c gives its Workload (and quota) back: b runs.
        api.custom.patch_namespaced_custom_object("trainop.io", "v1alpha1", namespace,
                                                  "distributedtrainingjobs", "c",
                                                  {"spec": {"runPolicy": {"suspend": True}}})
        api.wait_running("b")
        assert api.status("c")["phase"] == "Suspended" and not api.pods("c")
    finally:
        watch.stop()


def test_the_workload_priority_is_the_named_class_and_unknown_classes_fail(
        cluster, namespace, api, queues, operator_factory, workload_priority_classes,
        priority_classes):
    """Under Kueue a job names a WorkloadPriorityClass (queue order only: the pods keep the
    cluster's default) or a PriorityClass (the pods carry it too); the Workload references the
    class with its value, as Kueue's jobframework writes it. A name nobody created fails the job
    before any Workload exists."""
    operator_factory(config=FAST)
    batch, high = workload_priority_classes("batch", 50), priority_classes("high", 500)
    cluster.apply(manifest("w", queue="team", workers=1, priorityClassName=batch), namespace)
    cluster.apply(manifest("p", queue="team", workers=1, priorityClassName=high), namespace)
    cluster.apply(manifest("typo", queue="team", workers=1, priorityClassName="nope"), namespace)
    assert (workload(api, "w")["spec"]["priorityClassRef"], workload(api, "w")["spec"]["priority"]) \
        == ({"group": "kueue.x-k8s.io", "kind": "WorkloadPriorityClass", "name": batch}, 50)
    assert (workload(api, "p")["spec"]["priorityClassRef"], workload(api, "p")["spec"]["priority"]) \
        == ({"group": "scheduling.k8s.io", "kind": "PriorityClass", "name": high}, 500)
    api.wait_running("w")
    api.wait_running("p")
    assert {(p.spec.priority_class_name, p.spec.priority) for p in api.pods("w")} == {(None, 0)}
    assert {(p.spec.priority_class_name, p.spec.priority) for p in api.pods("p")} == {(high, 500)}
    assert failed_because(api, "typo").startswith(
        "spec.priorityClassName: no WorkloadPriorityClass or PriorityClass 'nope' exists; use one of")
    assert api.children("typo") == NOTHING
    assert "dtj-typo" not in [w["metadata"]["name"] for w in api.custom.list_namespaced_custom_object(
        *KUEUE, namespace, "workloads")["items"]]


EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "kueue"


def example(name: str) -> list[dict]:
    return list(yaml.safe_load_all((EXAMPLE / name).read_text()))


@pytest.fixture
def example_queues(cluster, namespace, api, kueue):
    """examples/kueue/: the admin's ResourceFlavor `a100` (a node label the GPU nodes have and
    a toleration), ClusterQueue `gpu-research` (8 GPUs, preemption.withinClusterQueue:
    LowerPriority), WorkloadPriorityClasses research-batch/-urgent; the LocalQueue `research`."""
    cluster_scoped = example("cluster-queue.yaml")
    cluster.apply(cluster_scoped)
    cluster.apply(example("local-queue.yaml"), namespace)
    yield {obj["kind"]: obj for obj in cluster_scoped}
    for obj in reversed(cluster_scoped):
        plural = {"ResourceFlavor": "resourceflavors", "ClusterQueue": "clusterqueues",
                  "WorkloadPriorityClass": "workloadpriorityclasses"}[obj["kind"]]
        api.custom.delete_cluster_custom_object(*KUEUE, plural, obj["metadata"]["name"])


def conditions_of(obj: dict) -> dict[str, dict]:
    return {c["type"]: c for c in (obj.get("status") or {}).get("conditions") or []}


def test_a_preempted_gang_stops_requeues_and_runs_again_on_its_flavor(
        cluster, namespace, api, example_queues, operator_factory):
    """examples/kueue/ with the real Kueue: it preempts the running batch gang for the urgent
    job that needs its quota. The batch job's pods go, it is Queued (Evicted: Preempted, with
    Kueue's message), no restart is counted, its Workload's quota is released so the urgent job
    runs; when that one finishes the batch job is admitted again and starts anew. Every pod
    carries the admitted ResourceFlavor's node label and toleration, and the Workload reports
    PodsReady."""
    operator_factory(config=FAST)
    batch, urgent = example("jobs.yaml")
    low, high = batch["metadata"]["name"], urgent["metadata"]["name"]
    cluster.apply(batch, namespace)  # 8 GPUs: the whole ClusterQueue
    first = api.wait_running(low)
    wl = wait_until(lambda: (lambda w: w if conditions_of(w).get("PodsReady", {}).get("status")
                             == "True" else None)(workload(api, low)), what="PodsReady")
    assert conditions_of(wl)["PodsReady"]["reason"] == "Started"
    assert wl["status"]["admission"]["clusterQueue"] == "gpu-research"
    for pod in api.pods(low):
        assert pod.spec.node_selector == {"kubernetes.azure.com/agentpool": "gpu",  # the pool
                                          "kubernetes.azure.com/accelerator": "nvidia"}  # flavor
        assert {(t.key, t.value, t.effect) for t in pod.spec.tolerations} >= {
            ("sku", "gpu", "NoSchedule")}

    cluster.apply(urgent, namespace)
    api.wait_phase(low, "Queued")
    evicted = api.condition(low, "Evicted")
    assert (evicted["status"], evicted["reason"]) == ("True", "Preempted")
    assert evicted["message"].startswith(f"Kueue evicted Workload dtj-{low} (Preempted): ")
    assert "the job waits in LocalQueue research" in evicted["message"]
    api.wait_running(high)
    wait_until(lambda: not api.pods(low), what="the preempted gang's pods gone")
    status = api.status(low)
    assert status.get("attempt", 0) == 0 and status["evictions"] == 1
    api.wait_event(low, "Warning/Preempted")
    wl = workload(api, low)
    assert "admission" not in wl["status"]
    assert conditions_of(wl)["Requeued"]["status"] == "True"
    assert conditions_of(wl)["QuotaReserved"]["status"] == "False"

    cluster.end_pod(namespace, api.wait_running(high).metadata.name, 0)
    api.wait_phase(high, "Succeeded")
    again = api.wait_running(low)  # the same attempt: an eviction is not a restart
    assert again.metadata.uid != first.metadata.uid
    assert api.status(low).get("attempt", 0) == 0
    assert api.condition(low, "Evicted")["status"] == "False"
    cluster.end_pod(namespace, again.metadata.name, 0)
    api.wait_phase(low, "Succeeded")


def test_a_job_managed_by_another_controller_is_left_alone_and_managed_by_is_immutable(
        cluster, namespace, api, operator_factory):
    """runPolicy.managedBy, as in the MPI Operator: any value but trainop.io/operator (here
    MultiKueue's) means trainop creates nothing and writes no status; the field cannot change."""
    operator_factory(config=FAST)
    cluster.apply(manifest("elsewhere", workers=1, runPolicy={
        "managedBy": "kueue.x-k8s.io/multikueue"}), namespace)
    cluster.apply(manifest("here", workers=1), namespace)
    api.wait_running("here")  # the operator has seen both by now (one watch, in order)
    assert api.job("here")["spec"]["runPolicy"]["managedBy"] == "trainop.io/operator"
    assert "status" not in api.job("elsewhere") and api.children("elsewhere") == NOTHING
    for job in ("elsewhere", "here"):
        with pytest.raises(ApiException) as err:
            api.custom.patch_namespaced_custom_object(
                "trainop.io", "v1alpha1", namespace, "distributedtrainingjobs", job,
                {"spec": {"runPolicy": {"managedBy": "kubeflow.org/mpi-operator"}}})
        assert err.value.status == 422 and "runPolicy.managedBy is immutable" in err.value.body


@pytest.fixture
def ibgpu_flavor_queue(cluster, namespace, api, kueue):
    """LocalQueue `team` on a ClusterQueue whose only flavor says agentpool=ibgpu."""
    yield from flavor_queue(api.custom, namespace, f"ib-{namespace}"[:63], 8,
                            {"kubernetes.azure.com/agentpool": "ibgpu"})


def test_a_flavor_that_contradicts_the_node_pool_is_never_admitted(
        cluster, namespace, api, ibgpu_flavor_queue, operator_factory):
    """Kueue itself does not admit a pod set on a flavor whose nodeLabels contradict the pods'
    nodeSelector (its flavor assigner: "doesn't match node affinity"): the job waits in Queued
    with Kueue's words and no pod. (trainop's own FlavorConflict check, like Kueue's
    podset.Merge, only guards a flavor edited between admission and start: unit-tested.)"""
    operator_factory(config=FAST)
    cluster.apply(manifest("wrong-pool", queue="team"), namespace)
    wait_until(lambda: "doesn't match node affinity" in (
        api.condition("wrong-pool", "Admitted") or {}).get("message", ""),
        what="Kueue's reason in the Admitted condition")
    cond = api.condition("wrong-pool", "Admitted")
    assert (cond["status"], cond["reason"]) == ("False", "WaitingForKueue")
    assert f"flavor {ibgpu_flavor_queue} doesn't match node affinity" in cond["message"]
    assert api.status("wrong-pool")["phase"] == "Queued" and not api.pods("wrong-pool")


# ---- the gang's shape is what was admitted (issue 22 H1, M10) -------------------------------
# A queued job that grows after its Workload was made never gets pods for the new shape on the
# old reservation; an admitted job cannot be grown at all (the CRD's rule, enforced by the API
# server); a finished job's quota goes back to Kueue only when no pod of it holds GPUs.

@pytest.fixture
def held_queue(cluster, namespace, api, kueue):
    """A ClusterQueue with 4 GPUs that admits nothing until `release()` (stopPolicy Hold)."""
    gen = flavor_queue(api.custom, namespace, f"cq-{namespace}", 4)
    name = next(gen)
    api.custom.patch_cluster_custom_object(*KUEUE, "clusterqueues", name,
                                           {"spec": {"stopPolicy": "Hold"}})

    def release():
        api.custom.patch_cluster_custom_object(*KUEUE, "clusterqueues", name,
                                               {"spec": {"stopPolicy": "None"}})
    yield release
    next(gen, None)


def grow(api: Api, name: str, **spec) -> None:
    api.custom.patch_namespaced_custom_object(GROUP, VERSION, api.ns, PLURAL, name, {"spec": spec})


def pod_sets(wl: dict) -> list[tuple[str, int]]:
    return [(p["name"], p["count"]) for p in wl["spec"]["podSets"]]


def test_a_queued_job_grown_after_its_workload_was_made_never_runs_on_the_old_reservation(
        cluster, namespace, api, held_queue, operator_factory):
    """The attack of H1: a Workload for 1 worker × 4 GPUs exists, the job is edited to 4 × 4,
    then the queue admits. No worker pod may exist for the new shape: the Workload is replaced
    by one of 4 workers, which 4 GPUs of quota cannot admit, and the job stays Queued."""
    operator_factory(config=FAST)
    watch = PodWatch(api)
    try:
        cluster.apply(manifest("g", queue="team", workers=1), namespace)
        first = workload(api, "g")
        assert pod_sets(first) == [("workers", 1), ("launcher", 1)]
        api.wait_phase("g", "Queued")
        grow(api, "g", workers=4)  # allowed: nothing is admitted yet
        replaced = wait_until(lambda: next((w for w in api.custom.list_namespaced_custom_object(
            *KUEUE, namespace, "workloads")["items"] if w["metadata"]["uid"] != first["metadata"]["uid"]
            and not w["metadata"].get("deletionTimestamp")), None), timeout=60,
            what="a new Workload for the grown job")
        assert pod_sets(replaced) == [("workers", 4), ("launcher", 1)]
        held_queue()  # the queue admits what fits: 16 GPUs do not fit 4
        cond = wait_until(lambda: (api.condition("g", "Admitted") or {}).get("message", "").find(
            "couldn't assign flavors") >= 0 and api.condition("g", "Admitted"), timeout=60,
            what="Kueue's reason for not admitting the grown job")
        assert cond["status"] == "False" and api.status("g")["phase"] == "Queued"
        assert not watch.pods_of("g")
    finally:
        watch.stop()


def test_an_admitted_job_cannot_be_grown(cluster, namespace, api, held_queue, operator_factory):
    """From admission on, the API server itself refuses a change of the gang's shape (the CRD's
    rule): workers, GPUs, pool. A podTemplate edit (too costly for the rule to compare) stops
    the gang and queues it again: a sidecar asking for 200 CPUs never runs on the reservation
    made for the job without it."""
    operator_factory(config=FAST)
    held_queue()
    watch = PodWatch(api)
    try:
        cluster.apply(manifest("a", queue="team", workers=1), namespace)
        api.wait_running("a")
        first = workload(api, "a")
        for change in ({"workers": 4}, {"gpusPerWorker": 1}, {"nodePool": {"name": "ibgpu"}}):
            with pytest.raises(ApiException) as refused:
                grow(api, "a", **change)
            assert refused.value.status == 422, change
            assert "cannot change once the job is admitted" in refused.value.body, change
        assert api.job("a")["spec"]["workers"] == 1
        grow(api, "a", runPolicy={"activeDeadlineSeconds": 3600})  # not the shape: allowed
        grow(api, "a", podTemplate={"worker": {"spec": {"containers": [
            {"name": "extra", "image": "trainop/trainer-pytorch:0.1.0",
             "resources": {"requests": {"cpu": "200"}}}]}}})
        cond = wait_until(lambda: (api.condition("a", "Admitted") or {}).get("status") == "False"
                          and api.condition("a", "Admitted"), timeout=60, what="a queued again")
        assert cond["reason"] in ("ShapeChanged", "WorkloadMismatch", "WaitingForKueue")
        wait_until(lambda: not api.pods("a"), timeout=60, what="a's old gang gone")
        replaced = wait_until(lambda: next((w for w in api.custom.list_namespaced_custom_object(
            *KUEUE, namespace, "workloads")["items"] if w["metadata"]["uid"] != first["metadata"]["uid"]
            and not w["metadata"].get("deletionTimestamp")), None), timeout=60,
            what="a Workload of the new shape")
        workers = replaced["spec"]["podSets"][0]["template"]["spec"]["containers"]
        assert "extra" in [c["name"] for c in workers]
        api.wait_phase("a", "Queued")
        assert not api.pods("a")  # and none came back: 200 CPUs do not fit the queue
        assert len(watch.pods_of("a")) == 2  # the first gang's worker and launcher pod only
    finally:
        watch.stop()


def test_a_native_admitted_job_cannot_be_grown(cluster, namespace, api, operator_factory):
    operator_factory(config=FAST)
    cluster.apply(manifest("native", workers=1), namespace)
    wait_until(lambda: (api.condition("native", "Admitted") or {}).get("status") == "True", timeout=60,
               what="job native admitted")
    with pytest.raises(ApiException) as refused:
        grow(api, "native", workers=16, gpusPerWorker=8)
    assert refused.value.status == 422 and "cannot change once the job is admitted" in \
        refused.value.body


def test_a_finished_jobs_quota_goes_back_only_when_its_pods_let_go_of_the_gpus(
        cluster, namespace, api, held_queue, operator_factory):
    """Issue 22 M10: with cleanPodPolicy None the workers outlive the job; while they run they
    hold 4 GPUs, so the Workload stays unfinished and the next job waits for them."""
    operator_factory(config=FAST)
    held_queue()
    cluster.apply(manifest("a", queue="team", workers=1,
                           runPolicy={"cleanPodPolicy": "None"}), namespace)
    cluster.end_pod(namespace, api.wait_running("a").metadata.name, 0)
    api.wait_phase("a", "Succeeded")
    cluster.apply(manifest("b", queue="team", workers=1), namespace)
    api.wait_phase("b", "Queued")
    [worker] = [p for p in api.pods("a", role="worker") if p.status.phase == "Running"]
    wl = api.custom.get_namespaced_custom_object(*KUEUE, namespace, "workloads", "dtj-a")
    assert "Finished" not in {c["type"] for c in wl["status"]["conditions"]
                              if c["status"] == "True"}
    assert not api.pods("b")
    cluster.end_pod(namespace, worker.metadata.name, 0)  # the last pod lets go of its GPUs
    api.wait_running("b")
    wl = api.custom.get_namespaced_custom_object(*KUEUE, namespace, "workloads", "dtj-a")
    assert {c["type"]: c["status"] for c in wl["status"]["conditions"]}["Finished"] == "True"
    assert "kueue.x-k8s.io/resource-in-use" not in (wl["metadata"].get("finalizers") or [])
