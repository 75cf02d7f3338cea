"""Kueue decides admission: the real Kueue controller (built from sigs.k8s.io/kueue, see
trainop/devcluster/kueue.py) runs against the local control plane; jobs that name a LocalQueue
wait, with no pod, until Kueue admits their Workload, in the ClusterQueue's order."""

from __future__ import annotations

import pytest

from tests.cluster.test_dtj import FAST, Api, manifest
from tests.cluster.test_quota import NOTHING, PodWatch, failed_because
from tests.fixtures.waiting import wait_until
from trainop.devcluster import kueue as kueue_dev

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(240)]

KUEUE = ("kueue.x-k8s.io", "v1beta2")


@pytest.fixture(scope="module")
def kueue(cluster, tmp_path_factory):
    proc = kueue_dev.Kueue(cluster.kubeconfig, tmp_path_factory.mktemp("kueue")).start()
    yield proc
    proc.stop()


@pytest.fixture
def api(cluster, namespace):
    return Api(cluster, namespace)


@pytest.fixture
def queues(cluster, namespace, api, kueue):
    """A ClusterQueue with 8 GPUs (StrictFIFO: priority, then creation) and a LocalQueue."""
    cq = f"cq-{namespace}"
    group, version = KUEUE
    custom = api.custom
    custom.create_cluster_custom_object(group, version, "resourceflavors", {
        "apiVersion": f"{group}/{version}", "kind": "ResourceFlavor",
        "metadata": {"name": cq}, "spec": {}})
    custom.create_cluster_custom_object(group, version, "clusterqueues", {
        "apiVersion": f"{group}/{version}", "kind": "ClusterQueue", "metadata": {"name": cq},
        "spec": {"namespaceSelector": {}, "queueingStrategy": "StrictFIFO",
                 "resourceGroups": [{"coveredResources": ["nvidia.com/gpu", "cpu", "memory"],
                                     "flavors": [{"name": cq, "resources": [
                                         {"name": "nvidia.com/gpu", "nominalQuota": 8},
                                         {"name": "cpu", "nominalQuota": 100},
                                         {"name": "memory", "nominalQuota": "1Ti"}]}]}]}})
    custom.create_namespaced_custom_object(group, version, namespace, "localqueues", {
        "apiVersion": f"{group}/{version}", "kind": "LocalQueue", "metadata": {"name": "team"},
        "spec": {"clusterQueue": cq}})
    yield cq
    custom.delete_cluster_custom_object(group, version, "clusterqueues", cq)
    custom.delete_cluster_custom_object(group, version, "resourceflavors", cq)


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
        wl = api.custom.get_namespaced_custom_object(*KUEUE, namespace, "workloads", "dtj-c")
        assert {c["type"]: c["status"] for c in wl["status"]["conditions"]}["QuotaReserved"] == "False"
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
