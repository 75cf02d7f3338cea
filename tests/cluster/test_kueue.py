"""Kueue decides admission: the real Kueue controller (built from sigs.k8s.io/kueue, see
trainop/devcluster/kueue.py) runs against the local control plane; jobs that name a LocalQueue
wait, with no pod, until Kueue admits their Workload, in the ClusterQueue's order."""

from __future__ import annotations

import pytest

from tests.cluster.test_dtj import FAST, Api, manifest
from tests.cluster.test_quota import PodWatch
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


def test_cluster_queue_admits_jobs_in_its_order_and_unadmitted_jobs_have_no_pods(
        cluster, namespace, api, queues, operator_factory):
    operator_factory(config=FAST)
    watch = PodWatch(api)
    try:
        cluster.apply(manifest("a", queue="team"), namespace)           # 8 GPUs: the whole queue
        api.wait_running("a")
        assert api.condition("a", "Admitted")["reason"] == "KueueAdmitted"
        cluster.apply(manifest("b", queue="team"), namespace)
        api.wait_phase("b", "Queued")
        cluster.apply(manifest("c", queue="team", priority=10), namespace)  # later, higher
        api.wait_phase("c", "Queued")
        cond = api.condition("b", "Admitted")
        assert (cond["status"], cond["reason"]) == ("False", "WaitingForKueue")
        assert cond["message"].startswith("Workload dtj-b waits in LocalQueue team")

        assert not watch.pods_of("b") and not watch.pods_of("c")
        wl = api.custom.get_namespaced_custom_object(*KUEUE, namespace, "workloads", "dtj-c")
        assert {c["type"]: c["status"] for c in wl["status"]["conditions"]}["QuotaReserved"] == "False"

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
