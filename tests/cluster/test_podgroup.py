"""Gang placement at the scheduler (runPolicy.schedulingPolicy), against the real API server with
scheduler-plugins' PodGroup CRD installed (tests/cluster/crds/, the upstream file). The
coscheduling plugin itself does not run here: the test operator names the default scheduler as
the gang scheduler, so the pods still run on KWOK nodes while carrying the group's label."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.cluster.test_dtj import FAST, Api, manifest
from tests.fixtures.waiting import wait_until

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(240)]

CRD = Path(__file__).parent / "crds" / "scheduling.x-k8s.io_podgroups.yaml"
PLUGINS = FAST | {"gangScheduling": {"scheduler": "scheduler-plugins", "schedulerName": "default-scheduler"}}


@pytest.fixture
def podgroup_crd(cluster):
    cluster.kubectl("apply", "--server-side", "-f", str(CRD))
    cluster.kubectl("wait", "--for=condition=Established", "--timeout=60s", "crd/podgroups.scheduling.x-k8s.io")
    yield
    cluster.kubectl("delete", "-f", str(CRD), "--wait=false", check=False)


@pytest.fixture
def api(cluster, namespace):
    return Api(cluster, namespace)


def test_a_job_gets_its_pod_group_before_its_pods(cluster, namespace, api, podgroup_crd, operator_factory):
    operator_factory(config=PLUGINS)
    cluster.apply(manifest("gang", runPolicy={"schedulingPolicy": {"scheduleTimeoutSeconds": 60}}), namespace)
    launcher = api.wait_running("gang")
    pg = cluster.get("podgroups.scheduling.x-k8s.io", "gang", "-n", namespace)
    assert pg["spec"] == {"minMember": 2, "scheduleTimeoutSeconds": 60,
                          "minResources": {"nvidia.com/gpu": "8"}}
    (owner,) = pg["metadata"]["ownerReferences"]
    assert (owner["kind"], owner["name"], owner["controller"]) == ("DistributedTrainingJob", "gang", True)
    workers = api.pods("gang", "worker")
    for pod in workers + [launcher]:
        assert pod.metadata.labels["scheduling.x-k8s.io/pod-group"] == "gang"
        assert pod.spec.scheduler_name == "default-scheduler"
        created = pod.metadata.creation_timestamp.strftime("%Y-%m-%dT%H:%M:%SZ")
        assert created >= pg["metadata"]["creationTimestamp"]
    # Watched: a PodGroup deleted while the gang runs (placed, it needs none) is made again
    # before the pods of the next attempt, which could not be scheduled without it.
    cluster.kubectl("delete", "podgroups.scheduling.x-k8s.io", "gang", "-n", namespace)
    cluster.kubectl("delete", "pod", "gang-worker-0", "-n", namespace, "--wait=false")
    def next_attempt():
        return [p for p in api.pods("gang", "worker") if p.metadata.labels["trainop.io/attempt"] == "1"]
    new_workers = wait_until(next_attempt, timeout=60, what="the gang's next attempt's workers")
    back = cluster.get("podgroups.scheduling.x-k8s.io", "gang", "-n", namespace)
    assert back["metadata"]["uid"] != pg["metadata"]["uid"] and back["spec"] == pg["spec"]
    for pod in new_workers:
        assert pod.metadata.creation_timestamp.strftime("%Y-%m-%dT%H:%M:%SZ") >= back["metadata"]["creationTimestamp"]


def test_without_the_schedulers_api_nothing_changes(cluster, namespace, api, operator_factory):
    """Volcano named, its PodGroup API not served: no PodGroup, the default scheduler (a
    schedulerName nothing serves would leave the pods Pending forever)."""
    operator_factory(config=FAST | {"gangScheduling": {"scheduler": "volcano"}})
    cluster.apply(manifest("plain"), namespace)
    api.wait_running("plain")
    for pod in api.pods("plain"):
        assert pod.spec.scheduler_name == "default-scheduler"
        assert "scheduling.k8s.io/group-name" not in (pod.metadata.annotations or {})
