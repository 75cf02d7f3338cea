"""Useful training time over a simulated 8-hour spot trace, with spec.elastic and without it
(issue 26): the real control plane (etcd, API server, scheduler, controller-manager), KWOK
nodes, the operator as production runs it, and simulated ranks.

    .venv/bin/python bench/elastic.py [--hours 8] [--speed 60] [--nodes 4] [--seed 26] \
        [--evictions-per-hour 0.15] [--return-minutes 45] [--json OUT]

Two jobs run side by side, each on a spot pool of its own of `--nodes` 4-GPU KWOK nodes, as
4 workers x 4 GPUs: `plain` (no spec.elastic) and `elastic` (minWorkers 1, shrinkAfterSeconds
5 trace-minutes, growAtCheckpoint). The same trace is replayed on both pools, `--speed` trace
seconds per wall second.

The trace (`trace()`, printed with the result; the seed replays it): each node slot alternates
up and down. Up times are exponential with a rate of `--evictions-per-hour` per VM: Azure
publishes a spot VM size's eviction rate as a bucket (0-5 %, 5-10 %, 10-15 %, 15-20 %, 20+ %;
the Azure portal and Resource Graph's SpotResources table, type
microsoft.compute/skuspotevictionrate/location), read as the chance of an eviction within an
hour; 0.15 is the 15-20 % bucket's lower edge, where GPU sizes often sit. That reading of the
bucket is an assumption of this bench (Microsoft's pages give the buckets, not their unit).
Down times (the VM taken back until the autoscaler gets a spot VM again) are exponential with
a mean of `--return-minutes`: an assumed figure, in the range of the hour-scale unavailability
gaps of the SkyPilot spot traces (github.com/skypilot-org/spot-traces; Wu et al., "Can't Be
Late", NSDI '24), not fitted to them. Memoryless both ways, independent per node: real
evictions come in bursts (co-evictions within minutes, Kim et al., "Spot-and-Scoot", 2026), so
the independent trace is kind to the plain job, which is stopped by any single eviction.

An eviction: the node's pods evicted through the Eviction API and the Node deleted (what the
spot VM's removal leaves, without PodGC's 40 s quarantine, which no speed-up could scale).
A return: a new Node of the pool (the autoscaler's).

Simulated ranks (`Ranks`), one per job, read the job as the operator leaves it: while the
attempt's launcher pod is Running, work accrues at size / maxWorkers per trace second (linear
scaling: the trainer keeps the global batch with gradient accumulation, so a step at 2 workers
takes twice as long; real scaling is sub-linear, which favours the smaller size a little more
than this). Every 10 trace-minutes of full-size work it writes a checkpoint report into the
job's progress ConfigMap, as worker 0's log shipper does (status.checkpoint, what
growAtCheckpoint waits for). A new attempt rolls the work back to the last checkpoint: the
evicted rank never saves. Restart costs are the control plane's real wall time times the
speed-up (pods deleted and created, the launcher once every worker is Ready), which over-states
them at high speeds: a KWOK restart of ~2 s wall is ~2 trace-minutes at --speed 60, the order of
a real gang's restart on AKS (pods, NCCL rendezvous, checkpoint load).

Useful training time: the full-size-equivalent hours of work held at the end.
"""

from __future__ import annotations

import argparse
import copy
import datetime as dt
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import yaml
from kubernetes import client as k8s
from kubernetes import config as kube_config
from kubernetes.client.exceptions import ApiException

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "operator"))
sys.path.insert(0, str(REPO))

from bench.control_plane import _free_port, machine, wait_healthy  # noqa: E402
from trainop import config  # noqa: E402
from trainop.devcluster.cluster import DevCluster  # noqa: E402
from trainop.devcluster.pools import NodePool  # noqa: E402

GROUP, VERSION, PLURAL = "trainop.io", "v1alpha1", "distributedtrainingjobs"
WORKERS, GPUS = 4, 4
CHECKPOINT_EVERY = 600.0  # trace seconds of full-size work between two checkpoints
SHRINK_AFTER = 300.0      # trace seconds


def trace(hours: float, nodes: int, rate: float, back_minutes: float, seed: int) -> list[tuple[float, str, int]]:
    """[(trace second, "evict" | "return", node slot)], sorted."""
    rng = random.Random(seed)
    end, events = hours * 3600, []
    for slot in range(nodes):
        t = 0.0
        while True:
            t += rng.expovariate(rate / 3600)
            if t >= end:
                break
            events.append((t, "evict", slot))
            t += rng.expovariate(1 / (back_minutes * 60))
            if t >= end:
                break
            events.append((t, "return", slot))
    return sorted(events)


class Pool:
    """The KWOK nodes of one job's spot pool; a slot's node is evicted and comes back anew."""

    def __init__(self, core: k8s.CoreV1Api, label: str, slots: int):
        self.core, self.label, self.made = core, label, 0
        self.nodes: dict[int, str] = {}
        for slot in range(slots):
            self.give(slot)

    def give(self, slot: int) -> None:
        node = NodePool(self.label, self.made + 1, "Standard_NC24ads_A100_v4", "24", "220Gi", gpus=GPUS).node(self.made)
        node["metadata"]["labels"][config.SPOT_LABEL] = config.SPOT_VALUE
        node["spec"]["taints"].append({"key": config.SPOT_LABEL, "value": config.SPOT_VALUE, "effect": "NoSchedule"})
        self.core.create_node(node)
        self.nodes[slot], self.made = node["metadata"]["name"], self.made + 1

    def take(self, slot: int) -> None:
        name = self.nodes.pop(slot)
        pods = self.core.list_pod_for_all_namespaces(field_selector=f"spec.nodeName={name}").items
        for pod in pods:
            try:
                self.core.create_namespaced_pod_eviction(pod.metadata.name, pod.metadata.namespace, k8s.V1Eviction(
                    metadata=k8s.V1ObjectMeta(name=pod.metadata.name, namespace=pod.metadata.namespace)))
            except ApiException as exc:
                if exc.status not in (404, 429):
                    raise
        self.core.delete_node(name)


class Ranks(threading.Thread):
    """The simulated trainer of one job (see the module docstring)."""

    def __init__(self, api, namespace: str, name: str, speed: float):
        super().__init__(daemon=True)
        self.core, self.custom = k8s.CoreV1Api(api), k8s.CustomObjectsApi(api)
        self.ns, self.name, self.speed = namespace, name, speed
        self.work = self.saved = 0.0  # trace seconds of full-size work
        self.attempt, self.stop, self.uid = 0, threading.Event(), None
        self.at_size: dict[int, float] = {}  # trace seconds trained at each size
        self.rolled_back = 0.0

    def _state(self) -> tuple[int, int, bool]:
        job = self.custom.get_namespaced_custom_object(GROUP, VERSION, self.ns, PLURAL, self.name)
        self.uid = job["metadata"]["uid"]
        st = job.get("status") or {}
        attempt, size = int(st.get("attempt") or 0), int((st.get("elastic") or {}).get("workers") or WORKERS)
        pods = self.core.list_namespaced_pod(self.ns, label_selector=(
            f"trainop.io/job-name={self.name},trainop.io/role=launcher,trainop.io/attempt={attempt}")).items
        training = st.get("phase") == "Running" and any(
            p.status.phase == "Running" and not p.metadata.deletion_timestamp for p in pods)
        return attempt, size, training

    def _checkpoint(self) -> None:
        step = int(self.work)
        path = f"/output/checkpoints/{self.name}-{self.uid[:8]}/attempt-{self.attempt}/step-{step}"
        self.core.patch_namespaced_config_map(f"{self.name}-progress", self.ns, {"data": {"checkpoint": json.dumps(
            {"step": step, "time": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"), "path": path})}})
        self.saved = self.work

    def run(self) -> None:
        last = time.monotonic()
        while not self.stop.is_set():
            time.sleep(0.2)
            now = time.monotonic()
            step, last = (now - last) * self.speed, now
            try:
                attempt, size, training = self._state()
            except ApiException:
                continue
            if attempt != self.attempt:  # a restart: back to the last checkpoint
                self.rolled_back += self.work - self.saved
                self.work, self.attempt = self.saved, attempt
            if training:
                self.work += step * size / WORKERS
                self.at_size[size] = self.at_size.get(size, 0.0) + step
                if self.work - self.saved >= CHECKPOINT_EVERY:
                    self._checkpoint()


def pool_config(labels: dict[str, str]) -> dict:
    pools = copy.deepcopy(config.DEFAULTS["nodePools"])
    for name, label in labels.items():
        pools[name] = {"nodeSelector": {config.POOL_LABEL: label}, "tolerations": [config.GPU_TOLERATION],
                       "gpusPerNode": GPUS, "autoscale": {"minNodes": 0, "maxNodes": 16}, "spot": True}
    return {"resyncSeconds": 0.5, "nodePools": pools, "schedulingTimeoutSeconds": None}


def job(name: str, pool: str, speed: float, elastic: bool) -> dict:
    spec = {"workers": WORKERS, "gpusPerWorker": GPUS, "nodePool": {"name": pool},
            "output": {"pvc": {"claimName": "out"}}, "runPolicy": {"backoffLimit": 0}}
    if elastic:
        spec["elastic"] = {"minWorkers": 1, "shrinkAfterSeconds": max(1, round(SHRINK_AFTER / speed))}
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": "DistributedTrainingJob", "metadata": {"name": name},
            "spec": spec}


def claim(core: k8s.CoreV1Api, namespace: str) -> None:
    """A bound claim (a hostPath PV pre-bound to it) for spec.output: the scheduler needs it bound."""
    core.create_persistent_volume({"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": f"pv-{namespace}"},
                                   "spec": {"capacity": {"storage": "1Gi"}, "accessModes": ["ReadWriteMany"],
                                            "storageClassName": "", "hostPath": {"path": "/tmp/trainop-bench"},
                                            "claimRef": {"namespace": namespace, "name": "out"}}})
    core.create_namespaced_persistent_volume_claim(namespace, {
        "apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": "out"},
        "spec": {"accessModes": ["ReadWriteMany"], "storageClassName": "", "volumeName": f"pv-{namespace}",
                 "resources": {"requests": {"storage": "1Gi"}}}})


def run(args: argparse.Namespace) -> dict:
    events = trace(args.hours, args.nodes, args.evictions_per_hour, args.return_minutes, args.seed)
    with tempfile.TemporaryDirectory(prefix="trainop-elastic-") as tmp:
        state = Path(tmp)
        cluster = DevCluster(state / "cluster", pools=[NodePool("system", 2, "Standard_D8s_v5", cpu="8", memory="32Gi",
                                                                 mode="system")], die_with_parent=True)
        cluster.up(timeout=600, crds=True)
        operator = None
        try:
            if cluster.crd_errors:
                raise RuntimeError("the API server refused the CRDs")
            api = kube_config.new_client_from_config(config_file=str(cluster.kubeconfig))
            core, custom = k8s.CoreV1Api(api), k8s.CustomObjectsApi(api)
            ns = "elastic-bench"
            core.create_namespace({"metadata": {"name": ns}})
            claim(core, ns)
            labels = {"spotplain": "spotplain", "spotelastic": "spotelastic"}
            (state / "config.yaml").write_text(yaml.safe_dump(pool_config(labels)))
            port = _free_port()
            env = dict(os.environ, KUBECONFIG=str(cluster.kubeconfig), TRAINOP_CONFIG=str(state / "config.yaml"),
                       PYTHONPATH=str(REPO / "operator"))
            operator = subprocess.Popen([sys.executable, "-m", "trainop", "operator", f"--liveness=http://127.0.0.1:{port}/healthz",
                                         "--namespace", ns], env=env, stdout=(state / "operator.log").open("wb"),
                                        stderr=subprocess.STDOUT, start_new_session=True)
            wait_healthy(f"http://127.0.0.1:{port}/healthz", operator)
            pools = {name: Pool(core, label, args.nodes) for name, label in labels.items()}
            ranks = {}
            for name, pool in (("plain", "spotplain"), ("elastic", "spotelastic")):
                custom.create_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, job(name, pool, args.speed, name == "elastic"))
            for name in ("plain", "elastic"):  # the clock starts once both run at full size
                deadline = time.monotonic() + 120
                while time.monotonic() < deadline:
                    st = custom.get_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, name).get("status") or {}
                    if st.get("phase") == "Running":
                        break
                    time.sleep(0.2)
                ranks[name] = Ranks(api, ns, name, args.speed)
            start = time.monotonic()
            for r in ranks.values():
                r.start()
            for at, what, slot in events:
                wait = start + at / args.speed - time.monotonic()
                if wait > 0:
                    time.sleep(wait)
                for pool in pools.values():
                    (pool.take if what == "evict" else pool.give)(slot)
            time.sleep(max(0.0, start + args.hours * 3600 / args.speed - time.monotonic()))
            for r in ranks.values():
                r.stop.set()
                r.join()
            result = {"machine": machine(), "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                      "hours": args.hours, "speed": args.speed, "nodes": args.nodes, "seed": args.seed,
                      "evictions_per_hour": args.evictions_per_hour, "return_minutes": args.return_minutes,
                      "trace": [(round(t / 60, 1), what, slot) for t, what, slot in events], "jobs": {}}
            for name, r in ranks.items():
                st = custom.get_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, name).get("status") or {}
                counts = st.get("restarts") or {}
                result["jobs"][name] = {
                    "useful_hours": round(r.work / 3600, 2), "of_hours": args.hours,
                    "hours_at_size": {str(k): round(v / 3600, 2) for k, v in sorted(r.at_size.items())},
                    "rolled_back_hours": round(r.rolled_back / 3600, 2),
                    "restarts": {k: counts.get(k, 0) for k in ("failures", "disruptions", "resizes")},
                    "phase": st.get("phase")}
            return result
        finally:
            if operator is not None:
                operator.terminate()
                operator.wait(30)
            cluster.down()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hours", type=float, default=8)
    parser.add_argument("--speed", type=float, default=60, help="trace seconds per wall second")
    parser.add_argument("--nodes", type=int, default=WORKERS)
    parser.add_argument("--seed", type=int, default=26)
    parser.add_argument("--evictions-per-hour", type=float, default=0.15, help="per VM")
    parser.add_argument("--return-minutes", type=float, default=45, help="mean time until a spot VM comes back")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    result = run(args)
    text = json.dumps(result, indent=1)
    if args.json:
        args.json.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
