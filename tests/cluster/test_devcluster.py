"""The local control plane itself: real binaries, AKS-shaped KWOK pools, and the Kubernetes
behaviour the operator relies on (scheduling, Job status, quota, garbage collection, CRDs)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import yaml

from tests.fixtures.waiting import wait_until
from trainop.devcluster import build
from trainop.devcluster.pools import GPU_RESOURCE, RDMA_RESOURCE
from trainop.paths import CRDS_DIR

pytestmark = pytest.mark.cluster

GPU_TOLERATION = {"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}


def pod(name: str, gpus: int = 0, rdma: int = 0, labels: dict | None = None) -> dict:
    limits = {"cpu": "1", "memory": "1Gi"}
    if gpus:
        limits[GPU_RESOURCE] = str(gpus)
    if rdma:
        limits[RDMA_RESOURCE] = str(rdma)
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "labels": labels or {}},
        "spec": {
            "containers": [{"name": "main", "image": "busybox", "resources": {"limits": limits}}],
            "tolerations": [GPU_TOLERATION] if gpus else [],
            "restartPolicy": "Never",
        },
    }


def test_binaries_are_cached_and_not_rebuilt(cluster):
    assert build.is_built()
    before = {p.name: p.stat().st_mtime_ns for p in build.bin_dir().iterdir()}
    assert build.ensure_binaries() == build.bin_dir()
    assert {p.name: p.stat().st_mtime_ns for p in build.bin_dir().iterdir()} == before
    version = subprocess.run([str(build.bin_dir() / "kube-apiserver"), "--version"], capture_output=True, text=True)
    assert version.stdout.strip() == f"Kubernetes {build.kubernetes_version()}"


def test_nodes_look_like_aks_pools(cluster):
    nodes = cluster.get("nodes")["items"]
    by_pool: dict[str, list] = {}
    for node in nodes:
        by_pool.setdefault(node["metadata"]["labels"]["kubernetes.azure.com/agentpool"], []).append(node)
    assert {pool: len(members) for pool, members in by_pool.items()} == {"system": 2, "gpu": 4, "ibgpu": 4}

    ib = by_pool["ibgpu"][0]
    assert ib["status"]["allocatable"][GPU_RESOURCE] == "8"
    assert ib["status"]["allocatable"][RDMA_RESOURCE] == "8"
    assert ib["metadata"]["labels"]["kubernetes.azure.com/accelerator"] == "nvidia"
    assert ib["metadata"]["labels"]["node.kubernetes.io/instance-type"] == "Standard_ND96isr_H100_v5"
    assert {"key": GPU_RESOURCE, "value": "present", "effect": "NoSchedule"} in ib["spec"]["taints"]

    nc = by_pool["gpu"][0]
    assert nc["status"]["allocatable"][GPU_RESOURCE] == "4"
    assert RDMA_RESOURCE not in nc["status"]["allocatable"]

    system = by_pool["system"][0]
    assert GPU_RESOURCE not in system["status"]["allocatable"]
    assert not system["spec"].get("taints")
    assert all(any(c["type"] == "Ready" and c["status"] == "True" for c in n["status"]["conditions"])
               for n in nodes)

    table = cluster.kubectl("get", "nodes", "-L", "kubernetes.azure.com/agentpool").stdout
    assert "aks-ibgpu-" in table and "Ready" in table


def test_scheduler_places_ib_pod_and_explains_unschedulable(cluster, namespace):
    cluster.apply([pod("ib", gpus=8, rdma=1), pod("too-big", gpus=16)], namespace)

    def phase(name):
        return cluster.get("pod", name, "-n", namespace)

    placed = wait_until(lambda: (p := phase("ib"))["status"].get("phase") == "Running" and p,
                        what="the 8-GPU InfiniBand pod to run")
    node = cluster.get("node", placed["spec"]["nodeName"])
    assert node["metadata"]["labels"]["kubernetes.azure.com/agentpool"] == "ibgpu"

    def unschedulable():
        conditions = phase("too-big")["status"].get("conditions", [])
        return next((c for c in conditions if c["type"] == "PodScheduled" and c["status"] == "False"), None)

    condition = wait_until(unschedulable, what="the scheduler to report too-big as unschedulable")
    assert condition["reason"] == "Unschedulable"
    assert f"Insufficient {GPU_RESOURCE}" in condition["message"]
    assert phase("too-big")["status"]["phase"] == "Pending"


@pytest.mark.parametrize("exit_code,job_condition", [(0, "Complete"), (3, "Failed")])
def test_job_pod_ends_on_demand_and_job_controller_reports(cluster, namespace, exit_code, job_condition):
    job = {
        "apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "j"},
        "spec": {"backoffLimit": 0, "template": {"spec": pod("x")["spec"]}},
    }
    cluster.apply(job, namespace)
    running = wait_until(lambda: [p for p in cluster.get("pods", "-n", namespace, "-l", "job-name=j")["items"]
                                  if p["status"].get("phase") == "Running"], what="the Job's pod to run")
    cluster.end_pod(namespace, running[0]["metadata"]["name"], exit_code=exit_code)

    def condition():
        status = cluster.get("job", "j", "-n", namespace).get("status", {})
        return next((c for c in status.get("conditions", []) if c["type"] == job_condition and c["status"] == "True"),
                    None)

    wait_until(condition, what=f"Job condition {job_condition}")
    ended = cluster.get("pod", running[0]["metadata"]["name"], "-n", namespace)
    terminated = ended["status"]["containerStatuses"][0]["state"]["terminated"]
    assert terminated["exitCode"] == exit_code
    assert ended["status"]["phase"] == ("Succeeded" if exit_code == 0 else "Failed")


def test_gpu_resource_quota_is_enforced_by_the_api_server(cluster, namespace):
    cluster.apply({"apiVersion": "v1", "kind": "ResourceQuota", "metadata": {"name": "gpu"},
                   "spec": {"hard": {f"requests.{GPU_RESOURCE}": "8"}}}, namespace)
    wait_until(lambda: cluster.get("resourcequota", "gpu", "-n", namespace).get("status", {}).get("hard"),
               what="the quota controller to count the quota")
    cluster.apply(pod("fits", gpus=8), namespace)
    refused = cluster.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(pod("over", gpus=4)),
                              check=False)
    assert refused.returncode != 0
    assert "forbidden" in refused.stderr and "exceeded quota: gpu" in refused.stderr
    assert f"requests.{GPU_RESOURCE}=4" in refused.stderr


def test_garbage_collector_deletes_children_of_a_deleted_owner(cluster, namespace):
    cluster.apply({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "owner"}}, namespace)
    owner_uid = cluster.get("configmap", "owner", "-n", namespace)["metadata"]["uid"]
    child = pod("child")
    child["metadata"]["ownerReferences"] = [{"apiVersion": "v1", "kind": "ConfigMap", "name": "owner",
                                             "uid": owner_uid}]
    cluster.apply(child, namespace)
    cluster.kubectl("delete", "configmap", "owner", "-n", namespace)
    wait_until(lambda: cluster.kubectl("get", "pod", "child", "-n", namespace, check=False).returncode != 0,
               what="the garbage collector to delete the child pod")


def test_crds_install_and_schema_rejects_malformed_objects(cluster, namespace):
    files = sorted(CRDS_DIR.glob("*.yaml"))
    assert files, "crds/ has no CustomResourceDefinition"
    assert cluster.crd_errors == {}
    for path in files:
        crd = yaml.safe_load(path.read_text())
        served = cluster.get("crd", crd["metadata"]["name"])
        assert any(c["type"] == "Established" and c["status"] == "True" for c in served["status"]["conditions"])
    dtj = {"apiVersion": "trainop.io/v1alpha1", "kind": "DistributedTrainingJob", "metadata": {"name": "bad"},
           "spec": {"framework": "pytorch", "workers": "two"}}
    refused = cluster.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(dtj), check=False)
    assert refused.returncode != 0
    assert "spec.workers" in refused.stderr
    assert cluster.kubectl("get", "dtj", "bad", "-n", namespace, check=False).returncode != 0


def test_devcluster_cli_up_status_down(cluster, tmp_path):
    """The user's command, on its own state folder, beside the session's cluster."""
    env = dict(os.environ, TRAINOP_STATE=str(tmp_path))
    trainop = [sys.executable, "-m", "trainop", "devcluster"]

    def run(*args):
        return subprocess.run([*trainop, *args], env=env, capture_output=True, text=True, timeout=300)

    try:
        up = run("up", "--pools", "system=1,gpu=0,ibgpu=1")
        assert up.returncode == 0, up.stderr
        kubeconfig = tmp_path / "devcluster" / "kubeconfig"
        assert f"export KUBECONFIG={kubeconfig}" in up.stdout
        status = run("status")
        assert status.returncode == 0 and "API server ready" in status.stdout
        nodes = cluster.kubectl("get", "nodes", "-o", "name").stdout  # the session cluster: untouched
        assert nodes.count("node/") == 10
        from trainop.devcluster import kubectl

        mine = kubectl.run(kubeconfig, "get", "nodes", "-o", "name", check=True).stdout.split()
        assert sorted(mine) == ["node/aks-ibgpu-12345678-vmss000000", "node/aks-system-12345678-vmss000000"]
    finally:
        down = run("down")
    assert down.returncode == 0
    assert run("status").returncode == 1
    bad = run("up", "--pools", "gpu=lots")
    assert bad.returncode == 2 and "--pools" in bad.stderr
