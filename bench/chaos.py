"""Faults of the control plane, injected in the middle of a ramp of N jobs on the dev cluster
(real etcd, kube-apiserver, controller-manager and scheduler; KWOK nodes), one after the other,
each in a namespace and with an operator of its own:

    .venv/bin/python bench/chaos.py [--jobs 100] [--faults apiserver etcd ...] [--md docs/benchmarks.md]

Faults (FAULTS below). Half the jobs are applied first; the outages begin once a quarter of the
jobs run, and the other half is applied while the component is away (each create retried until
the API server answers), so jobs are in flight at every stage:
- apiserver:  kube-apiserver SIGKILLed, started again after --down seconds;
- etcd:       etcd SIGKILLed, started again on its data after --down seconds;
- freeze:     kube-apiserver SIGSTOPped for --freeze seconds (every watch stalls), then SIGCONT;
- operator:   the operator SIGKILLed and started again, as its Deployment would;
- standby:    two replicas under a Lease, the leader SIGKILLed: the standby takes over;
- controller-manager: down for --cm-down seconds (Services' endpoints, GC, quotas pause);
- progress:   once every job runs, progress ConfigMaps of three jobs filled with what a buggy or
              hostile trainer can write: not JSON, JSON of the wrong shapes with an infinity
              and a 2**70, and nearly 1 MiB;
- node:       (only when named) bench/chaos_node.py: a GPU node killed under a training job, on a
              real-node cluster of its own, recovery counted from the kill;
- upgrade:    once every job runs, the operator stopped (SIGTERM, as a rolling update does) and
              this checkout's started with a new configuration (other images, launcher
              resources, timeouts); with --upgrade-from DIR the jobs were made by the operator
              of another checkout (an older commit: `git worktree add DIR COMMIT`).

Per fault one row: jobs (in flight when the fault hit), back (status Running at the end),
recovery (seconds from the component's return until every job's status says Running), pods
created twice (the API server's audit log: a successful create of one name more than once),
lost jobs, restarts counted against a job's backoffLimit (status.restarts.failures), and the
operator's ERROR lines. tests/cluster/test_chaos.py runs the same faults at a few jobs and
asserts the outcome (not the time); docs/reliability.md says what each one proves.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from kubernetes import client as k8s
from kubernetes import config as kube_config
from kubernetes.client.exceptions import ApiException

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "operator"))
sys.path.insert(0, str(REPO))

from bench.control_plane import _free_port, bench_pools, machine, wait_healthy, wait_namespace_gone  # noqa: E402
from trainop.devcluster.cluster import WRITES_ONLY, DevCluster  # noqa: E402

GROUP, VERSION, PLURAL = "trainop.io", "v1alpha1", "distributedtrainingjobs"
# What `upgrade` changes: everything a new release's values could, that a running pod carries.
UPGRADED_CONFIG = {"images": {"pytorch": "trainop/trainer-pytorch:0.2.0"},
                   "launcherResources": {"requests": {"cpu": "750m", "memory": "768Mi"}},
                   "startTimeoutSeconds": 900, "schedulingTimeoutSeconds": 1200}


def job(name: str) -> dict:
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": "DistributedTrainingJob",
            "metadata": {"name": name}, "spec": {"workers": 2, "gpusPerWorker": 4}}


def job_reconciles(metrics: str) -> int:
    """DistributedTrainingJob reconciles counted in an operator's Prometheus text."""
    return int(sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                   if line.startswith("trainop_reconcile_duration_seconds_count{")
                   and "DistributedTrainingJob" in line))


def retry(call: Callable, timeout: float = 120, until_found: bool = False):
    """`call()` until the API server answers (it may be down or frozen while a fault lasts) and,
    with `until_found`, until the object exists."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return call()
        except ApiException as exc:
            if exc.status and exc.status < 500 and exc.status != 429 and not (until_found and exc.status == 404):
                raise
            if time.monotonic() > deadline:
                raise
        except Exception:  # connection refused or timed out: the component is away
            if time.monotonic() > deadline:
                raise
        time.sleep(0.5)


class Operator:
    """`python -m trainop operator` for one namespace, as its Deployment runs it; with `lease`, a
    replica under kopf-free leader election (leader.py) instead of --standalone."""

    def __init__(self, cluster: DevCluster, namespace: str, log: Path, config: dict | None = None,
                 lease: str | None = None, tree: Path = REPO):
        self.cluster, self.namespace, self.log, self.lease, self.tree = cluster, namespace, log, lease, tree
        self.config = log.with_suffix(".config.yaml")
        self.config.write_text(yaml.safe_dump(config or {}))
        self.proc: subprocess.Popen | None = None

    def start(self) -> Operator:
        health = f"http://127.0.0.1:{_free_port()}/healthz"
        self.metrics_port = _free_port()
        env = dict(os.environ, KUBECONFIG=str(self.cluster.kubeconfig), PYTHONUNBUFFERED="1",
                   TRAINOP_CONFIG=str(self.config), POD_ID=self.log.stem,
                   PYTHONPATH=os.pathsep.join([str(self.tree / "operator"), str(self.tree)]))
        mode = ["--lease", self.lease, "--lease-namespace", self.namespace] if self.lease else ["--standalone"]
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "trainop", "operator", *mode, "--namespace", self.namespace,
             f"--liveness={health}", f"--metrics-port={self.metrics_port}"], env=env, stdout=self.log.open("ab"), stderr=subprocess.STDOUT,
            start_new_session=True)
        wait_healthy(health, self.proc)
        return self

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()

    def reconciles(self) -> int:
        """DistributedTrainingJob reconciles this process has done (its /metrics)."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as resp:
            return job_reconciles(resp.read().decode())

    def error_lines(self) -> list[str]:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return [line for line in text.splitlines() if " ERROR " in line or "[ERROR" in line]


@dataclass
class Run:
    """One fault's namespace, jobs and operators; `returned` (wall clock) is set by the fault
    when the component it took away is back."""
    cluster: DevCluster
    api: k8s.ApiClient
    namespace: str
    jobs: int
    logs: Path
    down_s: float = 5.0
    freeze_s: float = 60.0
    cm_down_s: float = 60.0
    upgrade_from: Path | None = None  # the checkout whose operator runs before `upgrade`
    operators: list[Operator] = field(default_factory=list)
    returned: float | None = None
    in_flight: int = 0
    pods_before: dict[str, tuple] | None = None  # faults once every job runs: no pod made anew or changed

    @property
    def core(self) -> k8s.CoreV1Api:
        return k8s.CoreV1Api(self.api)

    @property
    def custom(self) -> k8s.CustomObjectsApi:
        return k8s.CustomObjectsApi(self.api)

    def operator(self, name: str = "operator", **kwargs) -> Operator:
        self.operators.append(Operator(self.cluster, self.namespace, self.logs / f"{self.namespace}-{name}.log",
                                       **kwargs).start())
        return self.operators[-1]

    def items(self) -> list[dict]:
        return retry(lambda: self.custom.list_namespaced_custom_object(
            GROUP, VERSION, self.namespace, PLURAL, _request_timeout=3))["items"]

    def running(self) -> set[str]:
        """Jobs whose status says Running: what the operator has seen and written, which is what
        this bench asks of it. (Not the launcher pods' phase: KWOK, unlike a kubelet, never
        retries a pod status write that failed while etcd was away, and leaves such a pod
        Pending for good.)"""
        return {j["metadata"]["name"] for j in self.items() if (j.get("status") or {}).get("phase") == "Running"}

    def create(self, indexes) -> None:
        """Apply jobs j<index>, each retried until the API server answers (one that timed out
        on a frozen server may have been made: AlreadyExists is fine)."""
        for i in indexes:
            try:
                retry(lambda i=i: self.custom.create_namespaced_custom_object(
                    GROUP, VERSION, self.namespace, PLURAL, job(f"j{i:04d}"), _request_timeout=5), timeout=600)
            except ApiException as exc:
                if exc.status != 409:
                    raise

    def wait_running(self, count: int, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if len(self.running()) >= count:
                return True
            time.sleep(0.5)
        return False

    def pods(self) -> dict[str, tuple]:
        """Each pod's uid and containers' images: a pod made anew or changed in place (an image
        patched restarts its container) shows as a different value."""
        return {p.metadata.name: (p.metadata.uid, tuple(c.image for c in p.spec.containers))
                for p in retry(lambda: self.core.list_namespaced_pod(self.namespace)).items}


# ---- the faults ---------------------------------------------------------------------------------

def outage(run: Run, take_down: Callable[[], None], bring_back: Callable[[], None], seconds: float) -> None:
    """Half the jobs applied, a quarter of them Running: `take_down()`; the other half applied
    meanwhile, as users go on applying (each create retried until the API server answers);
    `bring_back()` after `seconds`."""
    run.wait_running(max(1, run.jobs // 4), timeout=max(300, 3 * run.jobs))
    run.in_flight = run.jobs - len(run.running())
    take_down()
    rest = threading.Thread(target=run.create, args=(range(run.jobs // 2, run.jobs),), daemon=True)
    rest.start()
    try:
        time.sleep(seconds)  # the outage itself
    finally:
        bring_back()
    run.returned = time.time()
    rest.join()


def all_running(run: Run) -> None:
    """Every job Running and every launcher pod made and Running (the status says Running once
    the launcher's batch Job exists; the Job controller makes its pod after)."""
    run.create(range(run.jobs // 2, run.jobs))
    deadline = time.monotonic() + max(300, 3 * run.jobs)
    while len(run.running()) < run.jobs or sum(
            p.status.phase == "Running" for p in run.core.list_namespaced_pod(
                run.namespace, label_selector="trainop.io/role=launcher").items) < run.jobs:
        if time.monotonic() > deadline:
            raise RuntimeError(f"not every job of {run.namespace} runs before the fault")
        time.sleep(0.5)
    run.in_flight = run.jobs
    run.pods_before = run.pods()


def apiserver(run: Run) -> None:
    outage(run, lambda: run.cluster.stop_component("kube-apiserver"),
           lambda: run.cluster.start_component("kube-apiserver"), run.down_s)


def etcd(run: Run) -> None:
    def back() -> None:
        run.cluster.start_component("etcd")
        retry(lambda: run.core.list_namespace(limit=1, _request_timeout=5))
    outage(run, lambda: run.cluster.stop_component("etcd"), back, run.down_s)


def freeze(run: Run) -> None:
    outage(run, lambda: run.cluster.signal_component("kube-apiserver", signal.SIGSTOP),
           lambda: run.cluster.signal_component("kube-apiserver", signal.SIGCONT), run.freeze_s)


def operator(run: Run) -> None:
    op = run.operators[0]
    outage(run, lambda: op.stop(signal.SIGKILL), op.start, 0)  # restarted at once, as by its ReplicaSet


def standby(run: Run) -> None:
    # the leader; the second replica stands by and takes over when the Lease expires
    outage(run, lambda: run.operators[0].stop(signal.SIGKILL), lambda: None, 0)


def controller_manager(run: Run) -> None:
    outage(run, lambda: run.cluster.stop_component("kube-controller-manager"),
           lambda: run.cluster.start_component("kube-controller-manager"), run.cm_down_s)


# What a buggy or hostile trainer can write into the one ConfigMap its shipper may patch: not
# JSON, JSON of the wrong shapes, a number JSON cannot hold, and a value of nearly 1 MiB.
GARBAGE = {
    "j0000": {"metrics": "{not json", "checkpoint": "\x00\x01garbage"},
    "j0001": {"metrics": "x" * (1024 * 1024 - 4096), "checkpoint": "{}"},
    "j0002": {"metrics": json.dumps({"step": -5, "epoch": "x", "loss": float("inf"), "imagesPerSec": [1],
                                     "totalSteps": 2 ** 70, "time": {"a": 1}}),
              "checkpoint": json.dumps({"step": "latest", "url": 7, "saveSeconds": -1})},
}
SENTINEL = ("j0003", {"metrics": json.dumps({"step": 7, "epoch": 1})})  # planted last: read last


def progress(run: Run) -> None:
    all_running(run)
    run.in_flight = len(GARBAGE)  # jobs with garbage
    for name, data in [*GARBAGE.items(), SENTINEL]:
        owner = run.custom.get_namespaced_custom_object(GROUP, VERSION, run.namespace, PLURAL, name)
        cm = {"metadata": {
            "name": f"{name}-progress",  # render/logship.progress_name, labels and owner as made
            "labels": {"trainop.io/job-name": name, "trainop.io/role": "progress"},
            "ownerReferences": [{"apiVersion": f"{GROUP}/{VERSION}", "kind": "DistributedTrainingJob",
                                 "name": name, "uid": owner["metadata"]["uid"], "controller": True}]},
            "data": data}
        try:
            run.core.replace_namespaced_config_map(cm["metadata"]["name"], run.namespace, cm)
        except ApiException as exc:
            if exc.status != 404:
                raise
            run.core.create_namespaced_config_map(run.namespace, cm)
    run.returned = time.time()
    # the operator has read the ConfigMaps (one watch: in order) once it shows the sentinel's step
    name, deadline = SENTINEL[0], time.monotonic() + 60
    while ((run.custom.get_namespaced_custom_object(GROUP, VERSION, run.namespace, PLURAL, name)
            .get("status") or {}).get("metrics") or {}).get("step") != 7:
        if time.monotonic() > deadline:
            raise RuntimeError(f"the operator never showed {name}'s planted progress report")
        time.sleep(0.2)


def upgrade(run: Run) -> None:
    all_running(run)
    run.operators[0].stop(signal.SIGTERM)
    new = run.operator("upgraded", config=UPGRADED_CONFIG)
    run.returned = time.time()
    # the pods are compared once the new operator has judged every job (its first listing wakes
    # each one): compared at once, a stop and requeue of every job went unseen
    deadline = time.monotonic() + 120
    while new.reconciles() < run.jobs:
        if time.monotonic() > deadline:
            raise RuntimeError(f"the upgraded operator reconciled {new.reconciles()} of {run.jobs} jobs in 120 s")
        time.sleep(0.2)


FAULTS: dict[str, Callable[[Run], None]] = {
    "apiserver": apiserver, "etcd": etcd, "freeze": freeze, "operator": operator, "standby": standby,
    "controller-manager": controller_manager, "progress": progress, "upgrade": upgrade,
}


# ---- one fault's run ---------------------------------------------------------------------------

def created_twice(audit_log: Path, namespace: str) -> list[str]:
    """Objects of `namespace` that an operator created (201) more than once."""
    created: Counter = Counter()
    with audit_log.open() as f:
        for line in f:
            event = json.loads(line)
            ref = event.get("objectRef") or {}
            if (event.get("verb") == "create" and event.get("stage") == "ResponseComplete"
                    and ref.get("namespace") == namespace and ref.get("resource") not in ("events", None)
                    and ref.get("name") and (event.get("responseStatus") or {}).get("code") == 201
                    and (event.get("userAgent") or "").startswith(("trainop/", "kopf/"))):
                created[(ref["resource"], ref["name"])] += 1
    return sorted(f"{resource}/{name}" for (resource, name), n in created.items() if n > 1)


def _running_since(item: dict) -> float:
    for cond in (item.get("status") or {}).get("conditions") or []:
        if cond["type"] == "Running" and cond["status"] == "True":
            return dt.datetime.fromisoformat(cond["lastTransitionTime"].replace("Z", "+00:00")).timestamp()
    return float("inf")


def run_fault(cluster: DevCluster, api: k8s.ApiClient, fault: str, jobs: int, logs: Path,
              timeout: float | None = None, **options) -> dict:
    """Apply `jobs` jobs, inject `fault`, wait until every job runs again (or `timeout`), and
    return the row."""
    namespace = f"chaos-{fault}"
    core = k8s.CoreV1Api(api)
    core.create_namespace({"metadata": {"name": namespace}})
    run = Run(cluster, api, namespace, jobs, logs, **options)
    try:
        retry(lambda: core.read_namespaced_service_account("default", namespace), until_found=True)
        if fault == "standby":
            run.operator("replica-a", lease="trainop")
            run.operator("replica-b", lease="trainop")
        else:
            run.operator(tree=(run.upgrade_from or REPO) if fault == "upgrade" else REPO)
        run.create(range(jobs // 2))  # the fault applies the rest
        FAULTS[fault](run)
        recovered = run.wait_running(jobs, timeout or max(300, 3 * jobs))
        items = run.items()
        # when the last job became Running, as the operator stamped it (this script's own polls
        # lag behind an API server that has just come back)
        done = max(_running_since(j) for j in items)
        after = run.pods()
        new_pods = sorted(name for name, was in after.items()
                          if run.pods_before is not None and run.pods_before.get(name) != was)
        return {
            "fault": fault, "jobs": jobs, "in_flight": run.in_flight, "back": len(run.running()),
            "recovery_s": round(max(0.0, done - run.returned)) if recovered else None,
            "created_twice": created_twice(cluster.audit_log, namespace),
            "lost": sorted(j["metadata"]["name"] for j in items
                           if (j.get("status") or {}).get("phase") != "Running"),
            "counted_restarts": sum(int(((j.get("status") or {}).get("restarts") or {}).get("failures") or 0)
                                    for j in items),
            "new_pods": new_pods,
            "error_lines": [line for op in run.operators for line in op.error_lines()],
        }
    finally:
        for op in run.operators:
            op.stop()


def chaos_cluster(state: Path, jobs: int) -> DevCluster:
    """A cluster for `jobs` jobs at a time that records every write (WRITES_ONLY)."""
    return DevCluster(state / "cluster", pools=bench_pools(jobs), die_with_parent=True,
                      audit_log=state / "audit.jsonl", audit_rules=WRITES_ONLY)


def row(r: dict) -> str:
    anew = len(r["new_pods"]) if r["fault"] in ("progress", "upgrade") else "—"
    return (f"| {r['fault']} | {r['in_flight']}/{r['jobs']} | {r['back']} | "
            f"{r['recovery_s'] if r['recovery_s'] is not None else 'never'} | {len(r['created_twice'])} | "
            f"{len(r['lost'])} | {r['counted_restarts']} | {anew} | {len(r['error_lines'])} |")


def node_row() -> dict:
    """bench/chaos_node.py's fault (its own real-node cluster, one job) in this table's shape;
    its recovery counts from the kill, the node-monitor grace period included."""
    from bench import chaos_node
    r = chaos_node.run()
    return {"fault": "node (killed under training; recovery from the kill)", "jobs": 1, "in_flight": 1,
            "back": r["jobs_recovered"], "recovery_s": r["recovery_seconds"],
            "created_twice": ["?"] * (r["duplicate_children"] or 0), "lost": ["chaosnode"] * r["lost_jobs"],
            "counted_restarts": r["counted_restarts"], "new_pods": [],
            "error_lines": ["?"] * r["operator_error_lines"], **({"error": r["error"]} if "error" in r else {})}


HEADER = ("| fault | jobs in flight / all | back Running | recovery after return (s) | created twice | "
          "lost | counted restarts | pods made anew or changed | operator ERROR lines |\n"
          "|---|---|---|---|---|---|---|---|---|")


def kwok_rows(args: argparse.Namespace, faults: list[str]) -> list[dict]:
    """The control-plane faults, one after the other on one KWOK dev cluster of their own."""
    results = []
    with tempfile.TemporaryDirectory(prefix="trainop-chaos-") as tmp:
        state = Path(tmp)
        cluster = chaos_cluster(state, args.jobs)
        cluster.up(timeout=600, crds=True)
        try:
            refused = cluster.crd_errors
            if refused:
                raise RuntimeError(f"the API server refused CRDs: {refused}")
            api = kube_config.new_client_from_config(config_file=str(cluster.kubeconfig))
            api.user_agent = "trainop-bench"
            for fault in faults:
                result = run_fault(cluster, api, fault, args.jobs, state, down_s=args.down,
                                   freeze_s=args.freeze, cm_down_s=args.cm_down, upgrade_from=args.upgrade_from)
                print(json.dumps(result), flush=True)
                results.append(result)
                wait_namespace_gone(k8s.CoreV1Api(api), f"chaos-{fault}")
        finally:
            keep = REPO / ".cache" / "chaos-logs"  # the operators' logs outlive the run
            keep.mkdir(parents=True, exist_ok=True)
            for log in state.glob("*.log"):
                shutil.copy(log, keep / log.name)
            cluster.down()
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=100)
    parser.add_argument("--faults", nargs="+", choices=[*FAULTS, "node"], default=list(FAULTS),
                        help="node: bench/chaos_node.py's GPU node killed under training, on a "
                             "real-node cluster of its own (not in the default list: minutes, root)")
    parser.add_argument("--down", type=float, default=5.0, help="seconds apiserver/etcd stay down")
    parser.add_argument("--freeze", type=float, default=60.0,
                        help="seconds the API server stays frozen (past the operator's 30 s request timeout)")
    parser.add_argument("--cm-down", type=float, default=60.0, help="seconds the controller-manager stays down")
    parser.add_argument("--upgrade-from", type=Path, help="`upgrade`: the checkout whose operator makes "
                        "the jobs before this one takes over (default: this one)")
    parser.add_argument("--md", type=Path, help="append the table to this Markdown file")
    args = parser.parse_args()
    results, kwok_faults = [], [f for f in args.faults if f != "node"]
    if kwok_faults:
        results += kwok_rows(args, kwok_faults)
    if "node" in args.faults:
        results.append(node_row())
        print(json.dumps(results[-1]), flush=True)
    title = (f"\n### Chaos, {args.jobs} jobs ({dt.date.today()}, {machine()}, --down {args.down:g} s, "
             f"--freeze {args.freeze:g} s, --cm-down {args.cm_down:g} s)\n\n")
    table = title + HEADER + "\n" + "\n".join(row(r) for r in results) + "\n"
    print(table)
    if args.md:
        with args.md.open("a") as f:
            f.write(table)
    return 0 if all(r["back"] == r["jobs"] and not r["created_twice"] and not r["counted_restarts"]
                    for r in results) else 1


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
