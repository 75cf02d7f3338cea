"""Bench: seconds from `kubectl apply` to the launcher's first training step, on real pods.

Starts a dev cluster with real nodes (`system=1,gpu=1`: kubelets on containerd + runc, CNI,
kube-proxy, CoreDNS; images loaded), runs the operator as a host process, then RUNS times applies
the reduced PyTorch + Horovod example (2 workers x 1 rank, ResNet-18, 64-pixel images) and
measures apply -> first step report in the launcher's log (read through the kubelet, as
`kubectl logs` does). Breaks that time into apply -> workers Ready -> launcher Running -> first
step, and prints p50 of each. Each run is deleted (and its pods gone) before the next.

    .venv/bin/python bench/real_pods.py [--runs 5]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from tests.e2e.conftest import RealCluster  # noqa: E402
from tests.e2e.test_real_pods import reduced  # noqa: E402
from tests.fixtures.cluster import OperatorProcess  # noqa: E402
from tests.fixtures.waiting import wait_until  # noqa: E402
from trainop.devcluster.cluster import DevCluster  # noqa: E402
from trainop.devcluster.pools import parse_pools  # noqa: E402


def one_run(cluster: RealCluster, namespace: str, index: int) -> dict[str, float]:
    name = f"bench{index}"
    # as its recorded runs (README): 64 px, unpaced, the first report at the epoch's end
    manifest = reduced("pytorch-horovod-synthetic.yaml", name, steps=3, image_size=64, paced=False)
    started = time.monotonic()
    cluster.apply(manifest, namespace)
    marks = {}

    def pods(role: str) -> list[dict]:
        return cluster.get("pods", "-n", namespace, "-l", f"trainop.io/job-name={name},trainop.io/role={role}")["items"]

    def ready(pod: dict) -> bool:
        return any(c["type"] == "Ready" and c["status"] == "True" for c in pod["status"].get("conditions", []))

    wait_until(lambda: len([p for p in pods("worker") if ready(p)]) == 2, timeout=600, interval=0.2,
               what="workers Ready")
    marks["workers Ready"] = time.monotonic() - started
    launcher = wait_until(lambda: [p for p in pods("launcher") if p["status"].get("phase") == "Running"],
                          timeout=600, interval=0.2, what="launcher Running")[0]
    marks["launcher Running"] = time.monotonic() - started
    wait_until(lambda: '"step"' in cluster.kubectl("logs", "-n", namespace, launcher["metadata"]["name"],
                                                   "-c", "launcher", check=False).stdout,
               timeout=600, interval=0.2, what="the first step report")
    marks["first step"] = time.monotonic() - started
    cluster.kubectl("delete", "dtj", name, "-n", namespace, "--wait=true")
    wait_until(lambda: not cluster.get("pods", "-n", namespace, "-l", f"trainop.io/job-name={name}")["items"],
               timeout=300, what="the run's pods gone")
    return marks


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="trainop-bench-") as tmp:
        dev = DevCluster(Path(tmp) / "cluster", pools=parse_pools("system=0,gpu=0,ibgpu=0", real="system=1,gpu=1"),
                         die_with_parent=True)
        up_started = time.monotonic()
        try:
            dev.up(timeout=900, crds=True)
            cluster = RealCluster(dev)
            print(f"cluster with real nodes up in {time.monotonic() - up_started:.1f}s", flush=True)
            cluster.kubectl("create", "namespace", "bench")
            wait_until(lambda: cluster.kubectl("get", "-n", "bench", "sa", "default", check=False).returncode == 0,
                       timeout=30, what="the default ServiceAccount")
            op = OperatorProcess(cluster, ["bench"], Path(tmp) / "operator.log").start()
            try:
                runs = []
                for i in range(args.runs):
                    runs.append(one_run(cluster, "bench", i))
                    print(f"run {i}: " + ", ".join(f"{k} {v:.1f}s" for k, v in runs[-1].items()), flush=True)
            finally:
                op.stop()
        finally:
            dev.down()
    p50 = {key: statistics.median(run[key] for run in runs) for key in runs[0]}
    print(json.dumps({"date": datetime.now(timezone.utc).isoformat(timespec="minutes"),
                      "machine": f"{platform.node()} ({subprocess.run(['nproc'], capture_output=True, text=True).stdout.strip()} cores)",
                      "runs": args.runs, "p50_seconds": {k: round(v, 1) for k, v in p50.items()}}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
