"""trainop against Kubeflow's MPI Operator v0.6.0 on one dev cluster (real API server, scheduler,
controller-manager; KWOK nodes), one operator after the other, the same N jobs of 2 workers x
4 GPUs each:

    .venv/bin/python bench/control_plane.py --jobs 10 100 500 [--window 30] [--md docs/benchmarks.md]
    .venv/bin/python bench/control_plane.py --jobs 10 100 --operators trainop trainop@../old-checkout
    .venv/bin/python bench/control_plane.py --jobs 500 --operators trainop --profile .cache/profile
    .venv/bin/python bench/profile_summary.py .cache/profile/trainop-500.txt --match trainop/

`trainop@DIR` runs the operator of another checkout (a commit to compare: `git worktree add DIR
COMMIT`) on the same cluster, CRDs and script, one after the other like the others.

Each N gets a new cluster; the first operator starts once no node has changed for 5 s (a new
cluster's controller-manager patches its nodes for a while: at 500 nodes about two minutes, which
fell on the first operator's ramp only). Per operator and N it reports
- ramp: seconds from the first job applied until every launcher pod is Running; p50/p99 of each
  job's apply -> its launcher pod Running (seen by this script's watch), and the same from the
  API server's audit log (the create, and KWOK's status write that makes the pod Running): the
  watch runs in this script, which shares the 2 cores with the operator and lags behind a
  CPU-hungry one at 100 jobs and more; the operator's API requests over the ramp (audit log),
  and how many met a 409 (a create of something that existed: its cache behind its own writes);
  and (`p50_steps_s`, in the JSON lines) the median seconds of each step of a job's path in the
  audit log: applied -> the operator's first child -> the workers created -> both Running (KWOK)
  -> the launcher Job created -> its pod bound -> Running, which says where the p50 goes;
- the operator's CPU seconds over the ramp and its peak RSS (/proc: utime+stime, VmHWM); an
  operator that dies during the ramp is restarted, as its Deployment would (`restarts`; CPU is
  summed over its lives, sampled every 0.2 s; peak RSS is its last life's);
- steady state: the operator's own API requests per second over `--window` seconds with every
  job running, counted in the API server's audit log by the operator's user agents (kopf and the
  Python client for trainop ("trainop/<identity>", kube.configure), client-go's "mpi-operator" for MPI Operator; this script's own client
  says "trainop-bench"), and its CPU share of one core over that window. (A difference of
  apiserver_request_total with the operator up and stopped also counted KWOK's tail of pod
  status updates, a few requests/s at N=500.)

MPI Operator is built from the Go module proxy (bench/mpi_operator/: a wrapper go.mod, see
/work/shared/TOOLCHAIN.md), runs with -kube-api-qps 200 -kube-api-burst 400 (its default of 5
would make it the slow one for the wrong reason), and its jobs use
launcherCreationPolicy: WaitForWorkersReady, which is trainop's rule too (the launcher starts
once every worker is Ready), so both measure the same path.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from kubernetes import client as k8s
from kubernetes import watch
from kubernetes.client.exceptions import ApiException

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "operator"))

from trainop import paths  # noqa: E402
from trainop.devcluster import kubectl  # noqa: E402
from trainop.devcluster.cluster import DevCluster  # noqa: E402
from trainop.devcluster.pools import NodePool  # noqa: E402

MPI_VERSION = "v0.6.0"
MPI_MODULE = "github.com/kubeflow/mpi-operator"
IMAGE = "trainop/trainer-pytorch:0.1.0"  # KWOK runs nothing: any name will do
GPU_TOLERATION = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}


# ---- MPI Operator ------------------------------------------------------------------------------

def mpi_operator_binary() -> Path:
    """Build (once, cached by version) MPI Operator from the wrapper module in bench/mpi_operator."""
    out = paths.cache_dir() / f"mpi-operator-{MPI_VERSION}" / "mpi-operator"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ, GOFLAGS="-mod=mod", CGO_ENABLED="0")
        subprocess.run(["go", "build", "-trimpath", "-ldflags=-s -w", "-o", str(out),
                        f"{MPI_MODULE}/cmd/mpi-operator"], cwd=REPO / "bench" / "mpi_operator",
                       env=env, check=True)
    return out


def mpi_crd() -> Path:
    gomodcache = subprocess.run(["go", "env", "GOMODCACHE"], capture_output=True, text=True,
                                check=True).stdout.strip()
    return Path(gomodcache) / f"{MPI_MODULE}@{MPI_VERSION}" / "manifests/base/kubeflow.org_mpijobs.yaml"


def mpijob(name: str) -> dict:
    worker = {"containers": [{"name": "worker", "image": IMAGE,
                              "resources": {"limits": {"nvidia.com/gpu": 4}}}],
              "nodeSelector": {"kubernetes.azure.com/agentpool": "gpu"},
              "tolerations": [GPU_TOLERATION]}
    launcher = {"containers": [{"name": "launcher", "image": IMAGE, "command": ["mpirun", "true"],
                                "resources": {"requests": {"cpu": "500m", "memory": "512Mi"}}}]}
    return {"apiVersion": "kubeflow.org/v2beta1", "kind": "MPIJob", "metadata": {"name": name},
            "spec": {"slotsPerWorker": 4, "launcherCreationPolicy": "WaitForWorkersReady",
                     "runPolicy": {"cleanPodPolicy": "Running"},
                     "mpiReplicaSpecs": {
                         "Launcher": {"replicas": 1, "template": {"spec": launcher}},
                         "Worker": {"replicas": 2, "template": {"spec": worker}}}}}


def dtj(name: str) -> dict:
    return {"apiVersion": "trainop.io/v1alpha1", "kind": "DistributedTrainingJob",
            "metadata": {"name": name}, "spec": {"workers": 2, "gpusPerWorker": 4}}


OPERATORS = {
    # name: (job manifest, group/version/plural, launcher pod label selector, job label on it)
    "trainop": (dtj, ("trainop.io", "v1alpha1", "distributedtrainingjobs"),
                "trainop.io/role=launcher", "trainop.io/job-name"),
    "mpi-operator": (mpijob, ("kubeflow.org", "v2beta1", "mpijobs"),
                     "training.kubeflow.org/job-role=launcher", "training.kubeflow.org/job-name"),
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 120) -> None:
    """Until the operator's liveness endpoint answers: kopf serves it once its startup handlers
    ran, and it processes a job's events only after its indexes are filled. (A fixed sleep made
    a slow start on a loaded machine count against the first jobs' latency.)"""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{url} did not answer within {timeout:.0f}s")


def start_operator(name: str, cluster: DevCluster, namespace: str, log: Path) -> subprocess.Popen:
    env = dict(os.environ, KUBECONFIG=str(cluster.kubeconfig), PYTHONUNBUFFERED="1")
    health = None
    name, _, tree = name.partition("@")
    if name == "trainop":
        root = Path(tree).resolve() if tree else REPO
        env["PYTHONPATH"] = os.pathsep.join([str(root / "operator"), str(root)])
        health = f"http://127.0.0.1:{_free_port()}/healthz"
        cmd = [sys.executable, "-m", "trainop", "operator", "--standalone", "--namespace", namespace,
               f"--liveness={health}"]
    else:
        cmd = [str(mpi_operator_binary()), f"-kubeConfig={cluster.kubeconfig}",
               f"-namespace={namespace}", "-kube-api-qps=200", "-kube-api-burst=400",
               "-threadiness=2"]
    proc = subprocess.Popen(cmd, env=env, stdout=log.open("ab"), stderr=subprocess.STDOUT,
                            start_new_session=True)
    if health:
        wait_healthy(health, proc)
    return proc


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


# ---- measurements ------------------------------------------------------------------------------

def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def peak_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0


# Seconds between the last launcher Running and the steady-state window: at N=500 the Job
# controller's and KWOK's status updates (and the watch events they send every operator) go on
# for a while after the last launcher runs; 10 s was not enough on 2 cores (run 2: 2.07% CPU).
SETTLE_S = 30
OWN_AGENTS = {"trainop": ("kopf/", "trainop/"), "mpi-operator": ("mpi-operator/",)}


def own_requests(audit_log: Path, operator: str, t0: float, t1: float) -> tuple[int, int]:
    """Requests of the operator's user agents received between wall-clock t0 and t1 (audit
    IDs: a watch has two events, ResponseStarted and ResponseComplete, a call one), and how
    many of them met a 409 (a create of what exists already: its cache behind its own writes).
    A watch that the API server ends is started again, and that counts: on 2026-12-06 the
    second operator on a cluster had its four idle watches (roles, rolebindings, claims,
    priority classes) end after 6 s and again after 70 s, in its window at N=100, in both
    A/B runs (0.27 req/s as counted before, by audit event; 0.13 by request)."""
    agents, seen, conflicts = OWN_AGENTS[operator], set(), 0
    with audit_log.open() as f:
        for line in f:
            event = json.loads(line)
            if not (event.get("userAgent") or "").startswith(agents):
                continue
            when = dt.datetime.fromisoformat(event["requestReceivedTimestamp"].replace("Z", "+00:00"))
            if t0 <= when.timestamp() < t1 and event.get("auditID") not in seen:
                seen.add(event.get("auditID"))
                conflicts += (event.get("responseStatus") or {}).get("code") == 409
    return len(seen), conflicts


# The path of one job, as the API server received it (audit log): each marker's request, first
# (or, for the workers, the last of the gang) per job. Both operators walk the same path
# (`launcherCreationPolicy: WaitForWorkersReady`), so the differences between their steps say
# where one loses time to the other.
MARKERS = ("applied", "first child", "workers created", "workers running", "launcher job",
           "launcher bound", "launcher running")


def audit_path(audit_log: Path, namespace: str, plural: str) -> dict[str, dict[str, float]]:
    """Per job, the wall-clock time of each of MARKERS (those seen). Names are the two operators'
    common ones: `<job>-worker-<i>` pods, a `<job>-launcher` Job, whose pod is
    `<job>-launcher-<suffix>` (named by the Job controller: its create's audit event may carry
    no name, so the launcher's own steps start at the scheduler's binding)."""
    path: dict[str, dict[str, float]] = {}
    workers_running: dict[str, dict[str, float]] = {}

    def mark(job: str, marker: str, when: float, last: bool = False) -> None:
        seen = path.setdefault(job, {})
        seen[marker] = max(seen.get(marker, when), when) if last else min(seen.get(marker, when), when)

    with audit_log.open() as f:
        for line in f:
            if namespace not in line:
                continue
            event = json.loads(line)
            ref = event.get("objectRef") or {}
            if event.get("stage") != "ResponseComplete" or ref.get("namespace") != namespace:
                continue
            if (event.get("responseStatus") or {}).get("code", 200) >= 300:
                continue
            name, resource, sub = ref.get("name") or "", ref.get("resource"), ref.get("subresource")
            verb, agent = event["verb"], event.get("userAgent") or ""
            when = dt.datetime.fromisoformat(event["requestReceivedTimestamp"].replace("Z", "+00:00")).timestamp()
            if resource == plural and verb == "create" and not sub:
                mark(name, "applied", when)
            elif "-launcher-" in name and resource == "pods":
                job = name.rsplit("-launcher-", 1)[0]
                if sub == "binding":
                    mark(job, "launcher bound", when)
                elif sub == "status" and agent.startswith("kwok"):
                    mark(job, "launcher running", when)
            elif "-worker-" in name and resource == "pods":
                job = name.rsplit("-worker-", 1)[0]
                if verb == "create" and not sub:
                    mark(job, "workers created", when, last=True)
                elif sub == "status" and agent.startswith("kwok"):
                    workers_running.setdefault(job, {}).setdefault(name, when)
            elif resource == "jobs" and verb == "create" and name.endswith("-launcher"):
                mark(name[:-len("-launcher")], "launcher job", when)
            if verb == "create" and resource != plural and not agent.startswith(("kwok", "kube-")):
                # (a child is named <job> (the Service, trainop's NetworkPolicy) or <job>-...)
                job = next((j for j in path if name == j or name.startswith(j + "-")), None)
                if job:
                    mark(job, "first child", when)
    for job, pods in workers_running.items():
        mark(job, "workers running", max(pods.values()))
    return path


def audit_latencies(audit_log: Path, namespace: str, plural: str) -> tuple[dict[str, float], dict[str, float]]:
    """Per job, seconds from its create to its launcher pod's first status write by KWOK (the
    pod Running), both as the API server received them: the same path as LauncherWatch's,
    without this script's own watch, which lags behind under a CPU-hungry operator on 2 cores
    (its thread shares them). And the median seconds of each step of that path (MARKERS)."""
    path = audit_path(audit_log, namespace, plural)
    done = {job: seen for job, seen in path.items() if "applied" in seen and "launcher running" in seen}
    steps = {}
    for before, after in zip(MARKERS, MARKERS[1:]):
        gaps = [seen[after] - seen[before] for seen in done.values() if before in seen and after in seen]
        if gaps:
            steps[f"{before} -> {after}"] = round(percentile(gaps, 50), 3)
    return {job: seen["launcher running"] - seen["applied"] for job, seen in done.items()}, steps


class LauncherWatch:
    """When each job's launcher pod was first seen Running (monotonic seconds)."""

    def __init__(self, core: k8s.CoreV1Api, namespace: str, selector: str, job_label: str):
        self.running: dict[str, float] = {}
        self._stop = threading.Event()
        self._args = core, namespace, selector, job_label
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        core, namespace, selector, job_label = self._args
        while not self._stop.is_set():
            w = watch.Watch()
            try:
                for event in w.stream(core.list_namespaced_pod, namespace, label_selector=selector,
                                      timeout_seconds=30):
                    pod = event["object"]
                    job = (pod.metadata.labels or {}).get(job_label)
                    if job and pod.status.phase == "Running" and job not in self.running:
                        self.running[job] = time.monotonic()
                    if self._stop.is_set():
                        break
            except Exception:  # a dropped watch: start again (the listing re-reports)
                time.sleep(0.2)

    def close(self) -> None:
        self._stop.set()


def percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(p / 100 * len(ordered)) - 1))]


def wait_nodes_quiet(core: k8s.CoreV1Api, quiet: float = 5, timeout: float = 600) -> float:
    """Until no node has changed for `quiet` seconds; returns the seconds waited. A new cluster's
    controller-manager patches every node for a while after they register (at 500 nodes for
    about two minutes, 9 patches/s, held to its client's 20 QPS): a ramp started before that
    ends makes whichever operator runs first on the cluster (trainop, which watches nodes)
    process a node event per patch that the second never sees."""
    start = time.monotonic()
    versions, since = None, start
    while time.monotonic() - start < timeout:
        now = {n.metadata.name: n.metadata.resource_version for n in core.list_node().items}
        if now != versions:
            versions, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet:
            return round(time.monotonic() - start, 1)
        time.sleep(1)
    raise TimeoutError(f"nodes still changing after {timeout}s")


def wait_namespace_gone(core: k8s.CoreV1Api, namespace: str, timeout: float = 600) -> None:
    try:
        core.delete_namespace(namespace)
    except ApiException as exc:
        if exc.status != 404:
            raise
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            core.read_namespace(namespace)
        except ApiException as exc:
            if exc.status == 404:
                return
            raise
        time.sleep(1)
    raise TimeoutError(f"namespace {namespace} still there after {timeout}s")


def profiler(pid: int, out: Path) -> subprocess.Popen:
    """py-spy (the venv's) sampling every thread holding the GIL at 100 Hz, until SIGINT; raw
    collapsed stacks (`bench/profile_summary.py` sums them by function)."""
    return subprocess.Popen([str(Path(sys.executable).with_name("py-spy")), "record", "--pid", str(pid),
                             "--rate", "100", "--gil", "--nonblocking", "--format", "raw",
                             "--output", str(out)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def run_one(cluster: DevCluster, api: k8s.ApiClient, operator: str, n: int, window: float,
            logs: Path, profile: Path | None = None) -> dict:
    core, custom = k8s.CoreV1Api(api), k8s.CustomObjectsApi(api)
    kind, _, tree = operator.partition("@")
    make, (group, version, plural), selector, job_label = OPERATORS[kind]
    label = kind + (f"-{Path(tree).name.lower()}" if tree else "")
    namespace = f"bench-{label}-{n}"
    core.create_namespace({"metadata": {"name": namespace}})
    while True:  # pods are refused until the ServiceAccount controller made `default`
        try:
            core.read_namespaced_service_account("default", namespace)
            break
        except ApiException:
            time.sleep(0.2)
    log = logs / f"{label}-{n}.log"
    proc = start_operator(operator, cluster, namespace, log)
    if kind != "trainop":  # (trainop: start_operator waited for its liveness endpoint)
        time.sleep(3)  # started: its informers' initial listings done
    watcher = LauncherWatch(core, namespace, selector, job_label)
    spy = profiler(proc.pid, profile / f"{label}-{n}.txt") if profile and kind == "trainop" else None
    cpu0, cpu_before, restarts = cpu_seconds(proc.pid), 0.0, 0
    applied: dict[str, float] = {}
    start, wall_start = time.monotonic(), time.time()
    for i in range(n):
        name = f"j{i:04d}"
        custom.create_namespaced_custom_object(group, version, namespace, plural, make(name))
        applied[name] = time.monotonic()
    deadline = start + max(300, 3 * n)
    last = cpu0
    while len(watcher.running) < n and time.monotonic() < deadline:
        if proc.poll() is not None:  # died (MPI Operator exits when it misses a lease renewal):
            restarts += 1            # restart it as its Deployment would, and keep counting
            cpu_before += last - cpu0
            proc = start_operator(operator, cluster, namespace, log)
            time.sleep(0.5)
            cpu0 = last = cpu_seconds(proc.pid)
            continue
        try:
            last = cpu_seconds(proc.pid)
        except FileNotFoundError:
            continue
        time.sleep(0.2)
    done, wall_done = time.monotonic(), time.time()
    ramp_cpu = cpu_before + cpu_seconds(proc.pid) - cpu0
    if spy:
        spy.send_signal(signal.SIGINT)
        spy.wait(60)
    latencies = [watcher.running[j] - applied[j] for j in applied if j in watcher.running]
    result = {"operator": operator, "jobs": n, "running": len(watcher.running),
              "all_running_s": round(done - start, 1) if len(watcher.running) == n else None,
              "p50_s": round(percentile(latencies, 50), 2) if latencies else None,
              "p99_s": round(percentile(latencies, 99), 2) if latencies else None,
              "ramp_cpu_s": round(ramp_cpu, 1), "restarts": restarts}
    watcher.close()
    time.sleep(2)  # the audit log's events of the ramp written
    result["ramp_requests"], result["ramp_409"] = own_requests(cluster.audit_log, kind,
                                                               wall_start, wall_done)
    seen, steps = audit_latencies(cluster.audit_log, namespace, plural)
    result["p50_steps_s"] = steps
    if seen:
        result |= {"p50_audit_s": round(percentile(list(seen.values()), 50), 2),
                   "p99_audit_s": round(percentile(list(seen.values()), 99), 2)}
    time.sleep(SETTLE_S)  # the last status writes, Events and the controllers' tail settle
    c0, w0, t0 = cpu_seconds(proc.pid), time.time(), time.monotonic()
    time.sleep(window)
    c1, w1, t1 = cpu_seconds(proc.pid), time.time(), time.monotonic()
    result["peak_rss_mb"] = round(peak_rss_mb(proc.pid), 0)
    stop(proc)
    time.sleep(2)  # the audit log's last events of the window written
    own, _ = own_requests(cluster.audit_log, kind, w0, w1)
    result |= {"steady_req_s": round(own / (w1 - w0), 2),
               "steady_cpu_pct": round(100 * (c1 - c0) / (t1 - t0), 2)}
    wait_namespace_gone(core, namespace)
    return result


# ---- the run -----------------------------------------------------------------------------------

def bench_pools(n: int) -> list[NodePool]:
    """8-GPU nodes (2 workers each) for N jobs, and CPU nodes for the launchers (110 pods each)."""
    return [NodePool("system", max(2, n // 60 + 2), "Standard_D96s_v5", cpu="96", memory="384Gi",
                     mode="system"),
            NodePool("gpu", n + 2, "Standard_ND96asr_v4", cpu="96", memory="880Gi", gpus=8)]


def machine() -> str:
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor())
    return f"{os.cpu_count()} cores ({model}), {platform.system()} {platform.release()}"


def markdown(results: list[dict]) -> str:
    head = ("| operator | jobs | all launchers Running (s) | p50 / p99 apply->Running (s) | "
            "p50 / p99 in the audit log (s) | "
            "ramp CPU (s) | ramp: its API requests (409s) | peak RSS (MB) | "
            "steady: its own API req/s (audit log) | steady CPU (% of a core) |\n"
            "|---|---|---|---|---|---|---|---|---|---|\n")
    rows = "".join(
        f"| {r['operator']} | {r['jobs']} | {r['all_running_s'] if r['all_running_s'] is not None else str(r['running']) + ' of ' + str(r['jobs'])} "
        f"| {r['p50_s']} / {r['p99_s']} | {r.get('p50_audit_s')} / {r.get('p99_audit_s')} | {r['ramp_cpu_s']} | "
        f"{r['ramp_requests']} ({r['ramp_409']}) | {r['peak_rss_mb']:.0f} | "
        f"{r['steady_req_s']} | {r['steady_cpu_pct']} |\n" for r in results)
    return head + rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--jobs", type=int, nargs="+", default=[10, 100, 500])
    p.add_argument("--operators", nargs="+", default=["trainop", "mpi-operator"],
                   help="trainop, mpi-operator, or trainop@DIR (another checkout's operator)")
    p.add_argument("--window", type=float, default=30, help="steady-state window, seconds")
    p.add_argument("--md", type=Path, help="append the table (with machine and date) to this file")
    p.add_argument("--json", type=Path, help="write the raw results here")
    p.add_argument("--crds", type=Path, help="install these CRDs (a folder; default: this "
                   "checkout's crds/), e.g. another checkout's when this one's is refused")
    p.add_argument("--profile", type=Path, help="a folder: py-spy samples each trainop ramp into "
                   "<operator>-<N>.txt (py-spy's own CPU is not counted in the operator's), and "
                   "keeps the API server's audit log of each N there (audit-<N>.jsonl); "
                   "needs py-spy in the venv (.venv/bin/pip install py-spy: a profiling tool, "
                   "not one of the project's dependencies)")
    args = p.parse_args()
    for op in args.operators:
        if op.partition("@")[0] not in OPERATORS:
            p.error(f"--operators: {op!r} is not one of {', '.join(OPERATORS)} or trainop@DIR")

    if "mpi-operator" in args.operators:
        mpi_operator_binary()
    if args.profile:
        if not Path(sys.executable).with_name("py-spy").exists():
            p.error("--profile needs py-spy in the venv: .venv/bin/pip install py-spy")
        args.profile.mkdir(parents=True, exist_ok=True)
    results = []
    for n in args.jobs:
        with tempfile.TemporaryDirectory(prefix="trainop-bench-") as tmp:
            cluster = DevCluster(Path(tmp) / "cluster", pools=bench_pools(n), die_with_parent=True,
                                 audit_log=Path(tmp) / "audit.jsonl")
            logs = Path(tmp) / "logs"
            logs.mkdir()
            try:
                cluster.up(timeout=600, crds=True, crds_dir=args.crds)
                refused = cluster.crd_errors
                if refused:  # (else every job's create fails with a bare 404)
                    raise RuntimeError(f"the API server refused CRDs: {refused}")
                if "mpi-operator" in args.operators:  # (--operators trainop needs no Go module)
                    kubectl.run(cluster.kubeconfig, "apply", "--server-side", "-f", str(mpi_crd()),
                                check=True)
                    kubectl.run(cluster.kubeconfig, "create", "namespace", "mpi-operator", check=True)
                from kubernetes import config as k8s_config
                api = k8s_config.new_client_from_config(config_file=str(cluster.kubeconfig))
                api.user_agent = "trainop-bench"  # not counted as either operator's (own_requests)
                print(f"nodes quiet after {wait_nodes_quiet(k8s.CoreV1Api(api))} s", flush=True)
                for operator in args.operators:
                    result = run_one(cluster, api, operator, n, args.window, logs, args.profile)
                    print(json.dumps(result), flush=True)
                    results.append(result)
            finally:
                keep = REPO / ".cache" / "bench-logs"
                keep.mkdir(parents=True, exist_ok=True)
                for f in logs.glob("*.log"):
                    shutil.copy(f, keep / f.name)
                if args.profile and cluster.audit_log.exists():
                    shutil.copy(cluster.audit_log, args.profile / f"audit-{n}.jsonl")
                cluster.down()
    table = markdown(results)
    print(table)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    if args.md:
        stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        with args.md.open("a") as f:
            f.write(f"\n### {stamp}, {machine()}\n\n{table}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
