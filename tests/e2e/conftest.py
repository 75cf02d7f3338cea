"""Fixtures for end-to-end tests on REAL pods (see docs/DEVELOPING.md, "Real nodes").

- `real_cluster` (session): a second dev cluster whose `system` and `gpu` pools are real kubelets
  on containerd + runc (no KWOK node at all, so every pod here really runs, on the CPU), with
  CNI networking, kube-proxy and CoreDNS, and the project's images loaded.
- `real_namespace`: a fresh namespace on it per test.
- `pod_azurite` (session): Azurite on the real nodes' host address, where pods can reach it; the
  containers a passing test made there are deleted after it.
- `real_operator`: `python -m trainop operator` as a host process watching the test namespace
  (the in-cluster Deployment from the chart has its own test, test_operator_in_cluster).
"""

from __future__ import annotations

import json

import pytest

from tests.fixtures import azurite as azurite_fixture
from tests.fixtures.cluster import ClusterHandle, OperatorProcess, call_failed, call_passed, fresh_namespace
from trainop.devcluster import nodes
from trainop.devcluster.cluster import DevCluster
from trainop.devcluster.pools import parse_pools

pytestmark = pytest.mark.real

TRAINER_IMAGE = "trainop/trainer-pytorch:0.1.0"
OPERATOR_IMAGE = "trainop/operator:0.1.0"


def pytest_collection_modifyitems(items):
    """The session's first test also starts the real nodes, which import the images into their
    containerd: minutes on a cold machine, beyond the suite's default per-test timeout."""
    for item in items:
        if "tests/e2e/" in str(item.fspath):
            item.add_marker(pytest.mark.timeout(1500))


class RealCluster(ClusterHandle):
    def real_node_names(self) -> set[str]:
        return {node.name for node in self.dev.real_nodes}

    def assert_ran_on_real_nodes(self, namespace: str, selector: str) -> list[dict]:
        """Every pod matching selector was bound to a real node (never a KWOK one)."""
        pods = self.get("pods", "-n", namespace, "-l", selector)["items"]
        assert pods, f"no pod matches {selector}"
        nodes_ = {n["metadata"]["name"]: n for n in self.get("nodes")["items"]}
        for pod in pods:
            node = nodes_[pod["spec"]["nodeName"]]
            assert pod["spec"]["nodeName"] in self.real_node_names()
            assert "kwok.x-k8s.io/node" not in node["metadata"].get("annotations", {})
        return pods

    def logs(self, namespace: str, *target: str) -> str:
        """`kubectl logs`: the API server fetches it from the real kubelet."""
        return self.kubectl("logs", "-n", namespace, *target).stdout

    def shared_claim(self, namespace: str, claim: str, folder) -> None:
        """A ReadWriteMany claim on a hostPath PersistentVolume at `folder`, which both real nodes
        reach because they share this machine's filesystem: what an Azure Files share is on AKS."""
        self.apply([
            {"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": f"{namespace}-{claim}"},
             "spec": {"capacity": {"storage": "1Gi"}, "accessModes": ["ReadWriteMany"], "storageClassName": "",
                      "persistentVolumeReclaimPolicy": "Retain", "hostPath": {"path": str(folder)},
                      "claimRef": {"namespace": namespace, "name": claim}}},
            {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": claim, "namespace": namespace},
             "spec": {"accessModes": ["ReadWriteMany"], "storageClassName": "", "volumeName": f"{namespace}-{claim}",
                      "resources": {"requests": {"storage": "1Gi"}}}},
        ])


@pytest.fixture(scope="session")
def real_cluster(tmp_path_factory) -> RealCluster:
    pools = parse_pools("system=0,gpu=0,ibgpu=0", real="system=1,gpu=1")
    dev = DevCluster(tmp_path_factory.mktemp("realcluster"), pools=pools, die_with_parent=True)
    try:
        # Cold: images are imported into each node's containerd (minutes); warm: seconds.
        dev.up(timeout=900, crds=True)
        yield RealCluster(dev)
    finally:
        dev.down()
    # `down` removes everything real nodes made: a leftover fails the session's last test.
    assert nodes.leftovers(dev.state_dir) == []


@pytest.fixture
def real_namespace(real_cluster, request) -> str:
    yield from fresh_namespace(real_cluster, request)


# Pod Security "restricted", enforced (and warned) on a namespace: what a careful admin sets.
RESTRICTED = {"pod-security.kubernetes.io/enforce": "restricted", "pod-security.kubernetes.io/warn": "restricted"}


@pytest.fixture
def restricted_namespace(real_cluster, request):
    yield from fresh_namespace(real_cluster, request, labels=RESTRICTED)


@pytest.fixture
def restricted_operator(real_cluster, restricted_namespace, tmp_path):
    op = OperatorProcess(real_cluster, [restricted_namespace], tmp_path / "operator.log").start()
    yield op
    op.stop()


@pytest.fixture(scope="session")
def pod_azurite(real_cluster, tmp_path_factory):
    with azurite_fixture.running(tmp_path_factory.mktemp("pod-azurite"), https=False,
                                 host=nodes.HOST_IP) as server:
        yield server


@pytest.fixture(autouse=True)
def _blob_containers_dropped(request):
    """A passing test's new containers on `pod_azurite` are deleted after it (a failing test's stay,
    to be read): the jobs here upload checkpoints, 4.5 GB of the 13 GB one CI run held in /tmp
    before a full disk stopped it. Azurite frees the deleted blobs' files at its next GC (10 min)."""
    if "pod_azurite" not in request.fixturenames:
        yield
        return
    service = request.getfixturevalue("pod_azurite").service()
    before = {c.name for c in service.list_containers()}
    yield
    if call_passed(request):
        for container in service.list_containers():
            if container.name not in before:
                service.delete_container(container.name)


@pytest.fixture
def real_operator(real_cluster, real_namespace, tmp_path, request):
    op = OperatorProcess(real_cluster, [real_namespace], tmp_path / "operator.log").start()
    yield op
    op.stop()
    if call_failed(request):
        print(f"\n--- operator log ---\n{op.logs()[-8000:]}")
        events = real_cluster.kubectl("get", "events", "-n", real_namespace, "-o", "json", check=False).stdout
        print("\n--- events ---\n" + "\n".join(
            f"{e['involvedObject']['name']}: {e['reason']}: {e.get('message', '')}"
            for e in json.loads(events or '{"items": []}')["items"]))
