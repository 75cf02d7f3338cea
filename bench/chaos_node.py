"""Chaos, one fault: a GPU node dies under training (issue 24), as one row of bench/chaos.py's table.

On a dev cluster with real nodes (system=1, gpu=1), a checkpointing 2-worker PyTorch + Horovod
job runs; once its first checkpoint is reported, the node of its workers is killed as a VM that
loses power (its pods' network cut first, so that it falls silent; then kubelet, containerd,
device plugin and every container process SIGKILLed: `DevCluster.kill_node`). The node lifecycle controller marks it Ready Unknown after
--node-monitor-grace-period (20 s on the dev cluster, 40-50 s by default elsewhere); the operator
then restarts the gang as a disruption (NodeLost) and force-deletes the old pods; the node is
brought back (`DevCluster.revive_node`: the dev cluster has no other GPU node) and the job resumes
from its checkpoint and Succeeds. The scenario is tests/e2e/test_node_lost.py's `lose_a_node`,
which the suite asserts; this measures it.

Row: fault, jobs_affected, jobs_recovered, recovery_seconds (the node killed -> the job's Running
condition True again; it includes the grace period above and bringing the node back),
duplicate_children, lost_jobs, counted_restarts (against backoffLimit), operator_error_lines.

    .venv/bin/python bench/chaos_node.py     # starts its own real-node dev cluster, prints the row as JSON
    .venv/bin/python bench/chaos.py --faults ... node   # the same, as the last row of chaos.py's table

Only one real-node dev cluster may run on a machine at a time.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from tests.e2e.conftest import RealCluster  # noqa: E402
from tests.e2e.test_node_lost import NodeLoss, duplicates, lose_a_node  # noqa: E402
from tests.fixtures import azurite as azurite_fixture  # noqa: E402
from tests.fixtures.cluster import OperatorProcess  # noqa: E402
from trainop.devcluster import nodes  # noqa: E402
from trainop.devcluster.cluster import DevCluster  # noqa: E402
from trainop.devcluster.pools import parse_pools  # noqa: E402

FAULT = "a GPU node's kubelet, containerd and containers killed under training"


def row(loss: NodeLoss | None, operator_log: str, error: str = "") -> dict:
    """The table row of one run (`loss` None: the scenario did not finish, `error` says why)."""
    st = (loss.status if loss else {}) or {}
    out = {"fault": FAULT, "jobs_affected": 1,
           "jobs_recovered": int(bool(loss) and st.get("phase") == "Succeeded"),
           "recovery_seconds": round(loss.fault_to_running, 1) if loss else None,
           "duplicate_children": duplicates(loss) if loss else None,
           "lost_jobs": 0 if loss and st.get("phase") == "Succeeded" else 1,
           "counted_restarts": int(((st.get("restarts") or {}).get("failures")) or 0),
           "operator_error_lines": sum("ERROR" in line for line in operator_log.splitlines())}
    if error:
        out["error"] = error
    return out


def node_lost(cluster: RealCluster, namespace: str, operator: OperatorProcess, azurite) -> dict:
    """bench/chaos.py's entry: run the fault on `cluster` (real nodes, the operator watching
    `namespace`, `azurite` reachable from pods at nodes.HOST_IP) and return its row."""
    try:
        loss = lose_a_node(cluster, namespace, azurite, name="chaosnode")
    except AssertionError as exc:  # a wait that timed out: the row says the job was lost
        return row(None, operator.logs(), str(exc)[:300])
    return row(loss, operator.logs())


def run() -> dict:
    """The fault on a real-node dev cluster of its own: the row."""
    with tempfile.TemporaryDirectory(prefix="chaos-node-") as tmp:
        work = Path(tmp)
        pools = parse_pools("system=0,gpu=0,ibgpu=0", real="system=1,gpu=1")
        dev = DevCluster(work / "cluster", pools=pools, die_with_parent=True)
        try:
            dev.up(timeout=900, crds=True)
            cluster = RealCluster(dev)
            cluster.kubectl("create", "namespace", "chaos-node")
            (work / "azurite").mkdir()
            with azurite_fixture.running(work / "azurite", https=False, host=nodes.HOST_IP) as azurite:
                operator = OperatorProcess(cluster, ["chaos-node"], work / "operator.log").start()
                try:
                    result = node_lost(cluster, "chaos-node", operator, azurite)
                finally:
                    operator.stop()
        finally:
            dev.down()
    return result


if __name__ == "__main__":
    print(json.dumps(run(), indent=1))
