"""Every example in examples/ (but the DataStage engineer's datastage*.yaml, tested in
tests/cluster/test_datastage.py) is applied to the local cluster as a user would
(`kubectl apply -f`) and driven to its expected end; every job example also trains for real with
`trainop run --local`, reduced (trainer marker: a few steps on CPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.fixtures.waiting import wait_until
from trainop import config

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = sorted(p for p in (REPO / "examples").glob("*.yaml") if not p.name.startswith("datastage"))
# the imagenet example uploads as `dataset-reader`, which its comment asks the admin to list;
# datastage-imagenet provisions its NFS server
FAST = {"resyncSeconds": 0.5, "blob": {"allowedServiceAccounts": ["dataset-reader"]},
        "datastage": {"allowProvisionedServers": True, "nfsClientCIDRs": ["10.224.0.0/16"]}}


def load(path: Path) -> dict:
    (doc,) = yaml.safe_load_all(path.read_text())
    return doc


def test_every_job_example_is_listed_here():
    """A new example gets both tests below; the Makefile's demo job exists."""
    assert {load(p)["kind"] for p in EXAMPLES} == {"DistributedTrainingJob"}
    assert {p.name for p in EXAMPLES} >= {
        "pytorch-horovod-synthetic.yaml", "pytorch-torchrun-synthetic.yaml", "tensorflow-horovod-synthetic.yaml",
        "keras-horovod-synthetic.yaml", "imagenet-pytorch-horovod.yaml", "infiniband-pytorch-horovod.yaml"}
    assert "trainop run examples/pytorch-horovod-synthetic.yaml --local" in (REPO / "Makefile").read_text()


# ---- on the cluster ---------------------------------------------------------------------------
def pods(cluster, namespace, selector: str, phase: str = "Running") -> list[str]:
    return sorted(p["metadata"]["name"] for p in cluster.get("pods", "-n", namespace, "-l", selector)["items"]
                  if p["status"].get("phase") == phase and not p["metadata"].get("deletionTimestamp"))


def provide_data_stage(cluster, namespace, name: str) -> list[tuple[str, str]]:
    """What examples/datastage-<name>.yaml's comments ask the user for (its ServiceAccount; the
    storage class and a disk an AKS cluster would provide), then the DataStage itself, copied
    (KWOK ends the copy pod) until Ready. Returns the cluster-scoped objects to remove."""
    path = REPO / "examples" / f"datastage-{name}.yaml"
    spec = load(path)["spec"]
    cluster.kubectl("create", "serviceaccount", spec["source"]["blob"]["auth"]["serviceAccountName"], "-n", namespace)
    cleanup = []
    provision = spec["destination"]["provision"]
    sc = provision["storageClassName"]
    if cluster.kubectl("get", "storageclass", sc, check=False).returncode != 0:
        cluster.apply({"apiVersion": "storage.k8s.io/v1", "kind": "StorageClass", "metadata": {"name": sc},
                       "provisioner": "kubernetes.io/no-provisioner", "volumeBindingMode": "Immediate"})
    disk = f"disk-{namespace}"[:60]
    cluster.apply({"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": disk},
                   "spec": {"capacity": {"storage": provision["size"]}, "accessModes": ["ReadWriteOnce"],
                            "storageClassName": sc, "hostPath": {"path": "/tmp/nfs-disk"}}})
    cleanup.append(("pv", disk))
    cluster.kubectl("apply", "-n", namespace, "-f", str(path))
    copy = wait_until(lambda: pods(cluster, namespace, f"trainop.io/datastage={name},trainop.io/role=copy"),
                      timeout=90, what=f"DataStage {name}'s copy pod")
    cluster.end_pod(namespace, copy[0], 0)
    wait_until(lambda: (cluster.get("dstage", name, "-n", namespace).get("status") or {}).get("phase") == "Ready",
               timeout=60, what=f"DataStage {name} Ready")
    return cleanup


@pytest.mark.cluster
@pytest.mark.timeout(300)
@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_example_succeeds_on_the_cluster(cluster, namespace, operator_factory, path):
    operator_factory(config=FAST)
    job = load(path)
    name, spec = job["metadata"]["name"], job["spec"]
    cleanup, nodes = [], []
    stage = (spec.get("data") or {}).get("dataStageRef")
    try:
        if stage:
            cleanup = provide_data_stage(cluster, namespace, stage["name"])
        cluster.kubectl("apply", "-n", namespace, "-f", str(path))
        pool_name = (spec.get("nodePool") or {}).get("name")
        pool_config = config.DEFAULTS["nodePools"].get(pool_name) or {}
        if pool_config.get("autoscale"):  # at zero nodes: the pods wait, the "autoscaler" adds nodes
            wait_until(lambda: any(c["type"] == "WaitingForNodes" and c["status"] == "True" for c in (
                cluster.get("dtj", name, "-n", namespace).get("status") or {}).get("conditions") or []),
                timeout=60, what=f"{name} WaitingForNodes")
            for i in range(spec["workers"]):
                nodes.append(cluster.add_node(pool_name, i, spot=pool_config.get("spot", False)))
        workers = f"trainop.io/job-name={name},trainop.io/role=worker"
        running = wait_until(lambda: len(w := pods(cluster, namespace, workers)) == spec["workers"] and w,
                             timeout=90, what=f"{spec['workers']} workers of {name} Running")
        for worker in running:
            pod = cluster.get("pod", worker, "-n", namespace)
            limits = pod["spec"]["containers"][0]["resources"]["limits"]
            assert limits["nvidia.com/gpu"] == str(spec["gpusPerWorker"])
            assert ("rdma/ib" in limits) == bool(spec.get("infiniband"))
            pool = pod["spec"]["nodeSelector"]["kubernetes.azure.com/agentpool"]
            assert pod["spec"]["nodeName"].startswith(f"aks-{pool}-")
            assert pool == (pool_name or ("ibgpu" if spec.get("infiniband") else "gpu"))
        if spec.get("launcher", "mpi") == "mpi":
            launcher = wait_until(lambda: pods(cluster, namespace, f"trainop.io/job-name={name},trainop.io/role=launcher"),
                                  timeout=90, what=f"{name}'s launcher Running")
            cluster.end_pod(namespace, launcher[0], 0)
        else:
            for worker in running:
                cluster.end_pod(namespace, worker, 0)
        wait_until(lambda: (cluster.get("dtj", name, "-n", namespace).get("status") or {}).get("phase") == "Succeeded",
                   timeout=90, what=f"{name} Succeeded")
    finally:
        if stage:
            cluster.kubectl("delete", "dstage", stage["name"], "-n", namespace, "--wait=true", "--timeout=60s",
                            check=False)
        for kind, obj in cleanup:
            cluster.kubectl("delete", kind, obj, "--wait=false", check=False)
        for node in nodes:
            cluster.kubectl("delete", "node", node, "--wait=false", check=False)


# ---- on this machine --------------------------------------------------------------------------
def image_folder(root: Path, classes: int = 2, per_class: int = 16) -> Path:
    """A tiny ImageNet-style folder (<class>/<image>.JPEG) in place of the staged ImageNet."""
    from PIL import Image

    for c in range(classes):
        folder = root / f"n{c:08d}"
        folder.mkdir(parents=True)
        for i in range(per_class):
            Image.new("RGB", (72, 72), (40 * c, 7 * i, 90)).save(folder / f"img{i}.JPEG")
    return root


@pytest.mark.trainer
@pytest.mark.timeout(600)
@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_example_trains_locally_reduced(tmp_path, path):
    job = load(path)
    config_file = tmp_path / "operator.yaml"
    config_file.write_text(yaml.safe_dump(FAST))
    extra = ["--config", str(config_file)]
    if (job["spec"].get("data") or {}).get("dataStageRef"):
        extra += ["--data-dir", str(image_folder(tmp_path / "imagenet"))]
    result = subprocess.run(
        [sys.executable, "-m", "trainop", "run", str(path), "--local", "--epochs", "1", "--steps", "2", *extra],
        capture_output=True, text=True, cwd=REPO, timeout=580,
        env=dict(os.environ, TRAINOP_STATE=str(tmp_path / "state")))
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr}"
    table = dict(line.strip().split("  ", 1) for line in result.stdout.split("\n\n")[-1].strip().splitlines())
    table = {k.strip(): v.strip() for k, v in table.items()}
    assert float(table["images/sec (all ranks)"].replace(",", "")) > 0
    assert table["steps"] == "2 (1 epochs)"
    checkpoint = Path(table["checkpoint"])
    assert checkpoint.is_file() and checkpoint.parent == tmp_path / "state/runs" / job["metadata"]["name"] / "1/output"
    final = [json.loads(line) for line in Path(table["metrics"]).read_text().splitlines()][-1]
    assert final["final"] and final["worldSize"] == 2
    assert "model: ResNet-50 -> ResNet-18" in result.stdout
