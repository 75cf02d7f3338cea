"""Kueue's waitForPodsReady with the real controller: trainop's PodsReady on the Workload is
what keeps a ready gang admitted, and a gang whose pods cannot all start in time is evicted
by Kueue (PodsReadyTimeout), stopped and requeued by trainop, and runs once room appears.

Its own Kueue process (waitForPodsReady is a controller setting), so its own module."""

from __future__ import annotations

import pytest

from tests.cluster.test_dtj import FAST, Api, manifest
from tests.cluster.test_kueue import conditions_of, flavor_queue, workload
from tests.fixtures.waiting import wait_until
from trainop.devcluster import kueue as kueue_dev

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]

TIMEOUT_S = 15  # Kueue's waitForPodsReady.timeout: room for a loaded machine to start a gang
ZONE = "eastus-1"  # 2 of the 4 dev-cluster GPU nodes (4 GPUs each): one 8-GPU gang at a time


@pytest.fixture(scope="module")
def kueue(cluster, tmp_path_factory):
    proc = kueue_dev.Kueue(cluster.kubeconfig, tmp_path_factory.mktemp("kueue"), settings={
        "waitForPodsReady": {"timeout": f"{TIMEOUT_S}s", "blockAdmission": False,
                             "requeuingStrategy": {"backoffBaseSeconds": 1,
                                                   "backoffMaxSeconds": 2}}}).start()
    yield proc
    proc.stop()


@pytest.fixture
def api(cluster, namespace):
    return Api(cluster, namespace)


@pytest.fixture
def zone_queue(cluster, namespace, api, kueue):
    """16 GPUs of quota on a ResourceFlavor whose nodeLabels pin the pods to one zone, which
    has room for only 8: quota admits two 8-GPU gangs, the nodes hold one."""
    yield from flavor_queue(api.custom, namespace, f"zone-{namespace}"[:63], 16,
                            {"topology.kubernetes.io/zone": ZONE})


def test_a_gang_that_cannot_start_in_time_is_evicted_requeued_and_runs_later(
        cluster, namespace, api, zone_queue, operator_factory):
    operator_factory(config=FAST)
    cluster.apply(manifest("first", queue="team"), namespace)  # 2 x 4 GPUs: the zone is full
    first = api.wait_running("first")
    ready = wait_until(lambda: (lambda c: c if c.get("status") == "True" else None)(
        conditions_of(workload(api, "first")).get("PodsReady") or {}), what="first's PodsReady")
    assert ready["reason"] == "Started"
    nodes = {p.spec.node_name for p in api.pods("first")}
    zones = {api.core.read_node(n).metadata.labels["topology.kubernetes.io/zone"] for n in nodes}
    assert zones == {ZONE}  # the flavor's nodeLabels placed the pods

    cluster.apply(manifest("second", queue="team"), namespace)  # admitted by quota; no room
    wait_until(lambda: (api.condition("second", "Evicted") or {}).get("status") == "True",
               timeout=TIMEOUT_S + 45, what="second evicted by Kueue's PodsReady timeout")
    evicted = api.condition("second", "Evicted")
    assert evicted["reason"] == "Evicted"
    assert evicted["message"].startswith("Kueue evicted Workload dtj-second (PodsReadyTimeout): ")
    assert api.status("second").get("attempt", 0) == 0
    # the ready gang was never touched: PodsReady kept it admitted past the timeout
    assert api.launcher_pod("first").metadata.uid == first.metadata.uid
    assert "evictions" not in api.status("first")

    cluster.end_pod(namespace, first.metadata.name, 0)
    api.wait_phase("first", "Succeeded")
    wait_until(lambda: api.launcher_pod("second"), timeout=TIMEOUT_S + 60,
               what=f"second running (status: {api.status('second')})")
    wait_until(lambda: conditions_of(workload(api, "second")).get("PodsReady", {}).get("status")
               == "True", what="second's PodsReady")
    status = api.status("second")
    assert status["evictions"] >= 1 and status.get("attempt", 0) == 0
