"""Bench: what a DataStage's provisioned NFS-Ganesha server serves to N parallel readers, as MB/s
in all and MB per core-second of the server pod's CPU (issue 28; docs/datastage.md's bandwidth
section is written from these figures).

Starts a dev cluster with one real node (`system=1`: kubelet on containerd + runc, CNI,
kube-proxy; images loaded), then runs the server exactly as the operator renders it
(render/datastage.py: StatefulSet and Service; the reader's address in the server pod's client
list annotation, as stagesync puts it there), with its disk a hostPath PV
holding FILES random files of MB MiB written as the copy Job would. A reader pod (libnfs's
user-space client, from the server's image: this kernel has no NFS client) then runs, for each
count in READERS, that many `nfs-cp` loops at once, each copying every file through the server
into memory. The server's CPU is its cgroup's usage before and after.

    .venv/bin/python bench/nfs_readers.py [--files 8] [--mb 64] [--readers 1,2,4,8] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from tests.e2e.conftest import RealCluster  # noqa: E402
from tests.e2e.test_nfs_ganesha import COPY_UID, client_pod, run_pods, sh  # noqa: E402
from tests.fixtures.waiting import wait_until  # noqa: E402
from trainop import config  # noqa: E402
from trainop.devcluster.cluster import DevCluster  # noqa: E402
from trainop.devcluster.pools import parse_pools  # noqa: E402
from trainop.render import datastage  # noqa: E402
from trainop.spec import parse_stage  # noqa: E402

NS, STAGE, CLASS = "bench", "bench", "trainop-bench-hostpath"
SERVER = f"{STAGE}-nfs-0"  # the StatefulSet's one pod
# Each reader copies every file to memory (nfs-cp refuses /dev/null) and deletes it.
READ = ('rm -f /scratch/failed; for r in $(seq $3); do (for f in $(seq -f %03g 0 $(($2 - 1))); do '
        'nfs-cp "nfs://$1/bench/$f.bin?version=4" /scratch/$r >/dev/null && rm /scratch/$r '
        '|| touch /scratch/failed; done) & done; wait; test ! -e /scratch/failed')


def serve(cluster: RealCluster, disk: Path, reader_ip: str) -> str:
    """The operator's rendering of a provisioned server, applied as it is; its Service's IP."""
    stage = parse_stage({"apiVersion": "trainop.io/v1alpha1", "kind": "DataStage",
                         "metadata": {"name": STAGE, "namespace": NS, "uid": "bench"},
                         "spec": {"source": {"blob": {"accountURL": "https://bench.blob.core.windows.net",
                                                      "container": "bench"}},
                                  "destination": {"provision": {"size": "64Gi", "storageClassName": CLASS}}}})
    cfg = config.from_dict({})
    service, statefulset = datastage.server_objects(stage, cfg)
    cluster.apply({"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": "bench-export"},
                   "spec": {"capacity": {"storage": "64Gi"}, "accessModes": ["ReadWriteOnce"],
                            "storageClassName": CLASS, "persistentVolumeReclaimPolicy": "Retain",
                            "hostPath": {"path": str(disk)},
                            "claimRef": {"namespace": NS, "name": datastage.server_disk_claim(stage)}}})
    cluster.apply([service, statefulset], NS)
    cluster.kubectl("rollout", "status", "-n", NS, f"statefulset/{statefulset['metadata']['name']}", "--timeout=300s")
    # the client list, as the operator puts it on the running server pod (stagesync._clients)
    clients = datastage.clients_annotation(datastage.export_clients(cfg, [(reader_ip, "")]))
    cluster.kubectl("annotate", "pod", SERVER, "-n", NS, f"{datastage.CLIENTS_ANNOTATION}={clients}")
    wait_until(lambda: f"read-only to: {clients}" in cluster.logs(NS, SERVER), timeout=60,
               what="the server reloaded with the reader")
    return cluster.get("service", service["metadata"]["name"], "-n", NS)["spec"]["clusterIP"]


def server_cpu_seconds(cluster: RealCluster) -> float:
    _, out = sh(cluster, NS, SERVER, "cat /sys/fs/cgroup/cpu.stat 2>/dev/null || cat /sys/fs/cgroup/cpuacct/cpuacct.usage")
    found = re.search(r"usage_usec (\d+)", out)
    return int(found.group(1)) / 1e6 if found else int(out.split()[0]) / 1e9


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--files", type=int, default=8)
    parser.add_argument("--mb", type=int, default=64, help="MiB per file")
    parser.add_argument("--readers", default="1,2,4,8", help="reader counts, comma-separated")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    size, results = args.mb << 20, []
    with tempfile.TemporaryDirectory(prefix="trainop-nfs-bench-") as tmp:
        disk = Path(tmp) / "disk"
        (disk / "bench").mkdir(parents=True)
        for i in range(args.files):  # written onto the server's disk as the copy Job does: the
            path = disk / "bench" / f"{i:03d}.bin"  # bench measures serving, not staging
            path.write_bytes(os.urandom(size))
            os.chown(path, COPY_UID, COPY_UID)
        dev = DevCluster(Path(tmp) / "cluster", pools=parse_pools("system=0,gpu=0,ibgpu=0", real="system=1"),
                         die_with_parent=True)
        try:
            dev.up(timeout=900, crds=True)
            cluster = RealCluster(dev)
            cluster.kubectl("create", "namespace", NS)
            wait_until(lambda: cluster.kubectl("get", "-n", NS, "sa", "default", check=False).returncode == 0,
                       timeout=30, what="the default ServiceAccount")
            run_pods(cluster, NS, [client_pod("reader", {datastage.LABEL_READS_STAGE: STAGE})])
            server = serve(cluster, disk, cluster.get("pod", "reader", "-n", NS)["status"]["podIP"])
            for readers in [int(n) for n in args.readers.split(",")]:
                cpu0, wall0 = server_cpu_seconds(cluster), time.monotonic()
                rc, out = sh(cluster, NS, "reader", READ, server, str(args.files), str(readers))
                wall, cpu = time.monotonic() - wall0, server_cpu_seconds(cluster) - cpu0
                if rc != 0:
                    raise SystemExit(f"readers failed: {out[-2000:]}")
                mb = readers * args.files * size / 1e6
                results.append({"readers": readers, "MB": round(mb), "seconds": round(wall, 2),
                                "MBps": round(mb / wall), "serverCpuSeconds": round(cpu, 2),
                                "MBPerServerCoreSecond": round(mb / cpu)})
                print(f"{readers} readers: {mb:.0f} MB in {wall:.2f} s = {mb / wall:.0f} MB/s; "
                      f"server CPU {cpu:.2f} s = {mb / cpu:.0f} MB per server core-second", flush=True)
        finally:
            dev.down()
    report = {"date": datetime.now(timezone.utc).isoformat(timespec="minutes"),
              "machine": f"{platform.node()} ({os.cpu_count()} cores)", "files": args.files, "MiBPerFile": args.mb,
              "results": results}
    print(json.dumps(report, indent=1))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
