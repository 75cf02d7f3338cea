"""spec.elastic on real kubelets (issue 26, the operator's half): a node taken away under a
running MPI gang (`DevCluster.kill_node`: a VM that loses power), the gang continuing at the
smaller size on the node left, then growing back when the node returns (`revive_node`).

The dev cluster's two real nodes (system, gpu) form the job's pool: a CPU job whose nodeSelector
matches both and that tolerates the GPU node's taint, each worker asking for more than half a
node's CPUs, so the real scheduler puts one worker on each node. The ranks are a shell under
mpirun (launcher pod, ssh to the workers) that says its rank, the world size and
TRAINOP_ELASTIC_MAX_WORLD, then waits: what is proved here is the operator's half (the size,
the pods, mpirun's -np and hostfile, the env, the status and the Event). Resuming the model at
another world size is the trainer's half (another branch of this issue), so growAtCheckpoint is
false and no checkpoint is written (spec.output is Blob, for the checkpoint requirement).
The system node gets the trainer image first (real nodes of a CPU pool do not hold it:
nodes.node_images), which the next `devcluster up` prunes again."""

from __future__ import annotations

import pytest

from tests.e2e.test_real_pods import RUN_TIMEOUT, reduced, with_blob_output
from tests.fixtures.waiting import wait_until
from trainop.devcluster import images

pytestmark = [pytest.mark.real, pytest.mark.azurite]

RANK = ('echo "elastic rank $OMPI_COMM_WORLD_RANK of $OMPI_COMM_WORLD_SIZE, '
        'max world $TRAINOP_ELASTIC_MAX_WORLD"; exec sleep 100000')


@pytest.fixture(scope="module")
def trainer_everywhere(real_cluster):
    for node in real_cluster.dev.real_nodes:
        if not node.pool.gpus:
            images.load(str(node.containerd_socket), ["trainer-pytorch"])


def elastic_manifest(name: str) -> dict:
    manifest = reduced("pytorch-horovod-synthetic.yaml", name)
    spec = manifest["spec"]
    spec.update(gpusPerWorker=0, command=["sh", "-c", RANK],
                # both real nodes; a worker needs more than half a node's 2 CPUs: one per node
                nodePool={"nodeSelector": {"kubernetes.io/os": "linux"},
                          "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists",
                                           "effect": "NoSchedule"}]},
                resources={"requests": {"cpu": "1100m", "memory": "128Mi"}},
                runPolicy={"backoffLimit": 0},
                elastic={"minWorkers": 1, "shrinkAfterSeconds": 5, "growAtCheckpoint": False})
    return manifest


def test_a_node_taken_away_shrinks_the_running_gang_and_its_return_grows_it(real_cluster, trainer_everywhere,
                                                                          real_namespace, real_operator, pod_azurite):
    ns, name, cluster = real_namespace, "elastic", real_cluster
    manifest = elastic_manifest(name)
    with_blob_output(manifest, cluster, ns, pod_azurite)
    cluster.apply(manifest, ns)

    def status() -> dict:
        return cluster.get("dtj", name, "-n", ns).get("status") or {}

    def pods(attempt: int, role: str = "worker") -> list[dict]:
        return [p for p in cluster.get("pods", "-n", ns, "-l", f"trainop.io/job-name={name},trainop.io/role={role},"
                                       f"trainop.io/attempt={attempt}")["items"]
                if p["status"].get("phase") == "Running" and not p["metadata"].get("deletionTimestamp")]

    def ranks_said(attempt: int, size: int) -> str | None:
        launcher = pods(attempt, "launcher")
        if not launcher:
            return None
        log = cluster.kubectl("logs", "-n", ns, launcher[0]["metadata"]["name"], "-c", "launcher",
                              check=False).stdout
        said = [line for line in log.splitlines() if line.startswith("elastic rank ")]
        return log if len(said) == size and all(f"of {size}, max world 2" in line for line in said) else None

    wait_until(lambda: ranks_said(0, 2), timeout=RUN_TIMEOUT, interval=1, what="attempt 0: 2 ranks")
    first = pods(0)
    assert len({p["spec"]["nodeName"] for p in first}) == 2  # one worker per real node
    cluster.assert_ran_on_real_nodes(ns, f"trainop.io/job-name={name}")

    # the node of worker 1 loses power; the node lifecycle controller judges it lost after 20 s
    node = next(p["spec"]["nodeName"] for p in first if p["metadata"]["name"] == f"{name}-worker-1")
    cluster.dev.kill_node(node)
    try:
        wait_until(lambda: ranks_said(2, 1), timeout=180, interval=1,
                   what=f"the gang running at 1 worker (status: {status()})")
        st = status()
        assert st["elastic"]["workers"] == 1 and st["workers"]["total"] == 1
        lost, shrink = st["restarts"]["history"][-2:]
        assert (lost["cause"], lost["node"], lost["counted"]) == ("NodeLost", node, False)
        assert (shrink["cause"], shrink["fromWorkers"], shrink["toWorkers"]) == ("CapacityLost", 2, 1)
        survivors = pods(2)
        assert [p["metadata"]["name"] for p in survivors] == [f"{name}-worker-0"]
        assert survivors[0]["spec"]["nodeName"] != node
    finally:
        cluster.dev.revive_node(node)

    # the node is back: the pool holds two workers again, the gang grows at once
    wait_until(lambda: ranks_said(3, 2), timeout=180, interval=1,
               what=f"the gang running at 2 workers again (status: {status()})")
    st = status()
    grow = st["restarts"]["history"][-1]
    assert (grow["cause"], grow["fromWorkers"], grow["toWorkers"], grow["attempt"]) == ("CapacityReturned", 1, 2, 3)
    assert st["elastic"]["workers"] == 2 and st["restarts"]["failures"] == 0
    assert len({p["spec"]["nodeName"] for p in pods(3)}) == 2
    events = cluster.get("events", "-n", ns, "--field-selector", f"involvedObject.name={name}")["items"]
    assert [e["type"] for e in events if e["reason"] == "Resized"] == ["Normal", "Normal"]
    assert not [line for line in real_operator.logs().splitlines() if "ERROR" in line]
