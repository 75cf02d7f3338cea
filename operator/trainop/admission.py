"""Gang admission: does a job's whole demand (every worker and the launcher) fit the namespace's
ResourceQuotas and the operator's own limits, and in which order are queued jobs admitted?

Pure: the caller (gate.py, from the controller's caches) passes the live ResourceQuotas, pods, jobs and nodes.

    demand = admission.job_demand(job)                       # Usage summed over the gang's pods
    ledgers = admission.ledgers(ns, quotas, pods, cfg)       # hard - used per quota (or cap)
    decisions = admission.plan(candidates, ledgers, nodes)   # uid -> Decision, in queue order

Counting follows the API server's quota admission: a pod's usage is its effective requests
(containers + native sidecars, or the largest init container if more; a resource with only a
limit requests its limit), `requests.<r>` for every resource, the bare `cpu`/`memory`/
`ephemeral-storage` names as requests, `limits.<r>`, and `pods`/`count/pods`; a quota's scopes
(Terminating, BestEffort, PriorityClass, ...) decide which pods it counts. `used` is what the API
server wrote in the quota's status, or what the namespace's live trainop pods add up to where
that is more (the status can trail a pod created a moment ago); the caller adds what admitted
jobs still have to create (`outstanding`), so a gang admitted a moment ago but not yet created
is not admitted twice.

Queue policy: priority (the value of the job's class, priority.py; higher first), then creation
time (FIFO), then name.
Walking the queue in that order, every job that does not fit still *reserves* its demand, so
a job further back is admitted only with room no earlier job needs. A large job therefore
cannot be starved by a stream of small ones (they never take what it waits for), while jobs
that need only room nobody ahead of them wants (another quota, CPU-only jobs while the queue
waits for GPUs) still run at once. This is Kueue's StrictFIFO with backfill limited to
resources the head of the queue does not need: it never delays the head.
"""

from __future__ import annotations

import hashlib
import json
from collections import defaultdict
from dataclasses import dataclass, field
from decimal import Decimal

from kubernetes.utils.quantity import parse_quantity

from trainop import phases
from trainop.config import Config, ConfigError
from trainop.memo import Memos
from trainop.render import dtj as render
from trainop.spec import Job, Nodes

ADMITTED, QUEUED, UNSATISFIABLE = "Admitted", "Queued", "Unsatisfiable"
# Resources a quota may name bare (meaning requests.<r>), as the API server allows.
BARE = ("cpu", "memory", "ephemeral-storage")
NAMESPACE_CAP = "the operator's limits.namespaceGpus"

Usage = dict[str, Decimal]  # quota key (requests.cpu, pods, ...) -> quantity


@dataclass(frozen=True)
class Decision:
    outcome: str   # ADMITTED | QUEUED | UNSATISFIABLE
    reason: str    # CamelCase, for the Admitted / Failed condition
    message: str

    @property
    def admitted(self) -> bool:
        return self.outcome == ADMITTED


@dataclass
class Ledger:
    """One limit on the namespace: a ResourceQuota, or the operator's GPU cap."""
    name: str                # "ResourceQuota team-a/gpu" or NAMESPACE_CAP
    hard: Usage
    used: Usage              # as the API server counts it (the quota's status.used)
    scopes: tuple = ()       # (scopeName, operator, values) the pods must all match
    taken: Usage = field(default_factory=dict)     # outstanding demand of admitted jobs
    waiting: dict[str, Usage] = field(default_factory=dict)  # queued job -> reserved demand

    def free(self, key: str) -> Decimal:
        return self.hard[key] - self.used.get(key, Decimal(0)) - self.taken.get(key, Decimal(0))

    def ahead(self, key: str) -> Decimal:
        return sum((u.get(key, Decimal(0)) for u in self.waiting.values()), Decimal(0))


@dataclass(frozen=True)
class Candidate:
    """A job asking for admission (or already admitted: `admitted=True` only reserves)."""
    key: str                 # the job's name (one namespace is judged at a time)
    priority: int
    created: str             # metadata.creationTimestamp (RFC 3339 sorts as text)
    demand: list[dict]       # the pods the gang will have (rendered manifests)
    outstanding: list[dict]  # those of `demand` not yet counted in the quotas' usage
    gpus: int
    gpus_resource: str
    pool: str
    pool_selector: dict[str, str]
    admitted: bool = False
    max_nodes: int | None = None      # an autoscaled pool: what it can grow to
    gpus_per_node: int | None = None  # its VM size's GPUs (None: the largest node present)


# ---- quantities and pod usage ------------------------------------------------------------

def quantity(value) -> Decimal:
    return Decimal(parse_quantity(value))


def show(value: Decimal, key: str = "") -> str:
    """A quantity as a person writes it: 16, 500m, 4Gi."""
    if key.split(".")[-1] in ("memory", "ephemeral-storage") or key.endswith("storage"):
        for suffix, size in (("Ti", 2 ** 40), ("Gi", 2 ** 30), ("Mi", 2 ** 20), ("Ki", 2 ** 10)):
            if value >= size and value % size == 0:
                return f"{value // size}{suffix}"
    if value == value.to_integral_value():
        return str(int(value))
    if (value * 1000) == (value * 1000).to_integral_value():
        return f"{int(value * 1000)}m"
    return str(value)


def _container(container: dict) -> tuple[Usage, Usage]:
    res = container.get("resources") or {}
    limits = {k: quantity(v) for k, v in (res.get("limits") or {}).items()}
    requests = {k: quantity(v) for k, v in (res.get("requests") or {}).items()}
    return {**limits, **requests}, limits  # a limit without a request requests the limit


def _add(total: Usage, more: Usage) -> Usage:
    out = dict(total)
    for key, value in more.items():
        out[key] = out.get(key, Decimal(0)) + value
    return out


def _max(a: Usage, b: Usage) -> Usage:
    return {k: max(a.get(k, Decimal(0)), b.get(k, Decimal(0))) for k in set(a) | set(b)}


def _effective(pod_spec: dict, which: int) -> Usage:
    """Pod requests (which=0) or limits (which=1) as the scheduler and quota compute them."""
    total: Usage = {}
    for c in pod_spec.get("containers") or []:
        total = _add(total, _container(c)[which])
    sidecars: Usage = {}
    init_peak: Usage = {}
    for c in pod_spec.get("initContainers") or []:
        usage = _container(c)[which]
        if c.get("restartPolicy") == "Always":  # a native sidecar runs beside the containers
            sidecars = _add(sidecars, usage)
        else:
            init_peak = _max(init_peak, _add(sidecars, usage))
    return _max(_add(total, sidecars), init_peak)


def pod_requests(pod_spec: dict) -> Usage:
    """What the scheduler reserves for a pod: its effective requests."""
    return _effective(pod_spec, 0)


def pod_usage(pod: dict) -> Usage:
    """What one pod counts in a ResourceQuota (see the module docstring)."""
    spec = pod.get("spec") or {}
    out: Usage = {"pods": Decimal(1), "count/pods": Decimal(1)}
    for res, value in _effective(spec, 0).items():
        out[f"requests.{res}"] = value
        if res in BARE:
            out[res] = value
    for res, value in _effective(spec, 1).items():
        out[f"limits.{res}"] = value
    return out


def counts_in_quota(pod: dict) -> bool:
    """The API server stops counting a pod once it has finished."""
    return not phases.finished(pod)


def _scope_matches(scope: tuple, pod: dict) -> bool:
    name, op, values = scope
    spec = pod.get("spec") or {}
    if name in ("Terminating", "NotTerminating"):
        hit = spec.get("activeDeadlineSeconds") is not None
        return hit == (name == "Terminating")
    if name in ("BestEffort", "NotBestEffort"):
        requests_, limits = _effective(spec, 0), _effective(spec, 1)
        hit = not any(requests_.values()) and not any(limits.values())
        return hit == (name == "BestEffort")
    if name == "PriorityClass":
        cls = spec.get("priorityClassName")
        return {"In": cls in values, "NotIn": cls not in values,
                "Exists": cls is not None, "DoesNotExist": cls is None}[op]
    if name == "CrossNamespacePodAffinity":
        return False  # our pods carry no affinity terms
    return True  # a scope we do not know: count the pod (the conservative choice)


def _quota_scopes(quota: dict) -> tuple:
    spec = quota.get("spec") or {}
    scopes = [(s, "Exists", ()) for s in spec.get("scopes") or []]
    for expr in (spec.get("scopeSelector") or {}).get("matchExpressions") or []:
        scopes.append((expr["scopeName"], expr["operator"], tuple(expr.get("values") or ())))
    return tuple(scopes)


# ---- the namespace's limits --------------------------------------------------------------

def namespace_gpu_cap(cfg: Config) -> int | None:
    """limits.namespaceGpus: GPUs a namespace may use when no ResourceQuota limits them."""
    cap = (cfg.raw.get("limits") or {}).get("namespaceGpus")
    if cap is not None and (not isinstance(cap, int) or isinstance(cap, bool) or cap < 0):
        raise ConfigError("limits.namespaceGpus: must be a non-negative integer or null")
    return cap


def ledgers(namespace: str, quotas: list[dict], pods: list[dict], cfg: Config,
            gpu_resources: set[str]) -> list[Ledger]:
    """Every ResourceQuota of the namespace, plus the operator's GPU cap when no quota limits
    any of `gpu_resources` (then `used` is counted from the namespace's live pods)."""
    out = []
    counted = [p for p in pods if counts_in_quota(p)]  # a deleting pod counts until it is gone
    for q in quotas:
        hard = {k: quantity(v) for k, v in ((q.get("spec") or {}).get("hard") or {}).items()}
        used = {k: quantity(v) for k, v in ((q.get("status") or {}).get("used") or {}).items()}
        ledger = Ledger(f"ResourceQuota {namespace}/{q['metadata']['name']}", hard, used,
                        _quota_scopes(q))
        # status.used can trail the pods: the quota controller recounts from its own informer
        # after a deletion and may write a sum that misses a pod created a moment before. The
        # pods we see count too, so the larger of the two is used (both only undercount).
        ledger.used = _max(used, _usage_for(ledger, counted))
        out.append(ledger)
    cap = namespace_gpu_cap(cfg)
    keys = {f"requests.{r}" for r in gpu_resources}
    if cap is not None and not any(keys & set(ledger.hard) for ledger in out):
        used: Usage = {}
        for pod in counted:
            used = _add(used, {k: v for k, v in pod_usage(pod).items() if k in keys})
        out.append(Ledger(NAMESPACE_CAP, {k: Decimal(cap) for k in keys}, used))
    return out


# ---- a job's demand ----------------------------------------------------------------------

def gang_pods(job: Job, memo: Memos | None = None) -> list[dict]:
    """The pods the gang will have: every worker and, for MPI, the launcher Job's pod.
    Rendering a gang is the costly part of judging a queue, and every evaluation of a namespace
    judges all its jobs: the controller's `memo` keeps it per parsed Job (spec.parse_cached
    returns the same object for one generation of one job)."""
    if memo is None:
        return _render_gang(job)
    return memo.gangs.get(job, "gang", lambda: _render_gang(job))


def pod_sets(job: Job, memo: Memos | None = None) -> list[dict]:
    """The gang as Kueue's pod sets: the workers (count = workers, as worker 0 renders) and,
    for MPI, the launcher (1)."""
    pods = gang_pods(job, memo)
    sets = [(render.WORKER_POD_SET, job.workers, pods[0])]
    if job.launcher == "mpi":
        sets.append((render.LAUNCHER_POD_SET, 1, pods[-1]))
    return [{"name": name, "count": count,
             "template": {"metadata": {"labels": dict(pod["metadata"].get("labels") or {})},
                          "spec": pod["spec"]}}
            for name, count, pod in sets]


def shape(sets: list[dict] | None) -> list:
    """What a reservation is made for: each pod set's name and count and every container's
    requests and limits, quantities normalised ("1000m" is 1 CPU); Kueue's
    EquivalentToWorkload compares the same."""
    def amounts(resources: dict | None) -> dict:
        return {k: quantity(v) for k, v in (resources or {}).items()}

    out = []
    for ps in sets or []:
        spec = (ps.get("template") or {}).get("spec") or {}
        out.append((ps.get("name"), ps.get("count"), [
            (group, c.get("name"), amounts((c.get("resources") or {}).get("requests")),
             amounts((c.get("resources") or {}).get("limits")))
            for group in ("initContainers", "containers") for c in spec.get(group) or []]))
    return out


def shape_digest(job: Job, memo: Memos | None = None) -> str:
    """status.admittedShape: the admitted shape, short (a job stopped when it changes)."""
    text = json.dumps(shape(pod_sets(job, memo)), sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _render_gang(job: Job) -> list[dict]:
    pods = [render.render_worker(job, i, 0) for i in range(job.workers)]
    if job.launcher == "mpi":
        pods.append({"metadata": {}, "spec": render.render_launcher(job, 0)["spec"]["template"]
                     ["spec"]})
    return pods


def outstanding(job: Job, live: list[dict], memo: Memos | None = None) -> list[dict]:
    """The gang's pods not yet counted in quota usage: rendered pods whose live twin (same
    name, or the launcher's pod) is missing or finished. A deleted pod still counts until it
    is gone, so a restarting gang's old pods and its new ones are never both admitted."""
    counted = {p["metadata"]["name"] for p in live if counts_in_quota(p)}
    launcher_counted = any(
        (p["metadata"].get("labels") or {}).get(render.common.LABEL_ROLE) == render.LAUNCHER
        for p in live if counts_in_quota(p))
    out = []
    for pod in gang_pods(job, memo):
        name = pod["metadata"].get("name")
        if (name in counted) if name else launcher_counted:
            continue
        out.append(pod)
    return out


def candidate(job: Job, meta: dict, live: list[dict], admitted: bool = False,
              priority: int = 0, memo: Memos | None = None) -> Candidate:
    return Candidate(
        key=job.name, priority=priority,
        created=meta.get("creationTimestamp") or "", demand=gang_pods(job, memo),
        outstanding=outstanding(job, live, memo), gpus=job.total_gpus,
        gpus_resource=job.placement.gpu_resource, pool=job.placement.pool or "",
        pool_selector=dict(job.placement.node_selector), admitted=admitted,
        max_nodes=job.placement.autoscale.max_nodes if job.placement.autoscale else None,
        gpus_per_node=job.placement.gpus_per_node)


def _usage_for(ledger: Ledger, pods: list[dict]) -> Usage:
    total: Usage = {}
    for pod in pods:
        if all(_scope_matches(s, pod) for s in ledger.scopes):
            total = _add(total, pod_usage(pod))
    return {k: v for k, v in total.items() if k in ledger.hard and v}


# ---- judgement and order -----------------------------------------------------------------

def _label(key: str) -> str:
    """requests.nvidia.com/gpu -> nvidia.com/gpu: the message names what the job asks for."""
    return key.removeprefix("requests.")


def pool_gpus(nodes: list[dict], selector: dict[str, str], resource: str,
              max_nodes: int | None = None, gpus_per_node: int | None = None) -> int | None:
    """GPUs the pool has in all; for an autoscaled pool (`max_nodes`), what it has at
    maxNodes (nodes of `gpus_per_node`, else of its largest node present; None when that is
    unknown: a pool at zero nodes without gpusPerNode in the configuration)."""
    present = Nodes.of(nodes).totals(selector, resource)
    if max_nodes is None:
        return present.total
    per_node = gpus_per_node if gpus_per_node is not None else \
        present.largest if present.nodes else None
    return None if per_node is None else max(present.total, max_nodes * per_node)


def unsatisfiable(c: Candidate, ledgers_: list[Ledger], nodes: list[dict]) -> str | None:
    """Why the job can never be admitted as it is (and what to change), or None. (`nodes` as a
    spec.Nodes remembers the pool totals across the candidates of a judgement.)"""
    for ledger in ledgers_:
        for key, need in _usage_for(ledger, c.demand).items():
            if need > ledger.hard[key]:
                return (f"needs {show(need, key)} {_label(key)} but {ledger.name} allows at most "
                        f"{show(ledger.hard[key], key)}; reduce workers or per-worker resources, "
                        f"or ask for a larger quota")
    if c.gpus:
        total = pool_gpus(nodes, c.pool_selector, c.gpus_resource, c.max_nodes, c.gpus_per_node)
        where = f"node pool {c.pool!r}" if c.pool else f"nodeSelector {c.pool_selector}"
        if total is not None and c.gpus > total:
            grows = f" at maxNodes={c.max_nodes}" if c.max_nodes else ""
            return (f"needs {c.gpus} {c.gpus_resource} but {where} has {total} in all{grows}; "
                    f"use at most {total} GPUs (workers x gpusPerWorker) or add nodes to the pool")
    return None


def _shortfall(c: Candidate, ledgers_: list[Ledger]) -> str | None:
    """The first limit the job's outstanding demand does not fit, described; None if it fits."""
    for ledger in ledgers_:
        for key, need in sorted(_usage_for(ledger, c.outstanding).items()):
            free, ahead = ledger.free(key), ledger.ahead(key)
            if need > free - ahead:
                text = (f"needs {show(need, key)} {_label(key)}; {show(max(free, Decimal(0)), key)}"
                        f" of {show(ledger.hard[key], key)} free in {ledger.name}")
                if ahead:
                    names = ", ".join(n for n, u in ledger.waiting.items() if u.get(key))
                    text += f", {show(ahead, key)} of it held for jobs ahead in the queue ({names})"
                return text
    return None


def order(candidates: list[Candidate]) -> list[Candidate]:
    """Queue order: priority (higher first), then first come first served, then name."""
    return sorted(candidates, key=lambda c: (-c.priority, c.created, c.key))


def plan(candidates: list[Candidate], ledgers_: list[Ledger],
         nodes: list[dict]) -> dict[str, Decision]:
    """Decide every waiting job of a namespace at once (key -> Decision). Admitted jobs in
    `candidates` only take their outstanding demand; the others are judged in queue order."""
    for c in candidates:
        if c.admitted:
            for ledger in ledgers_:
                ledger.taken = _add(ledger.taken, _usage_for(ledger, c.outstanding))
    out: dict[str, Decision] = {}
    nodes = Nodes.of(nodes)  # one set for every candidate: its pool totals are summed once
    for c in order([c for c in candidates if not c.admitted]):
        why = unsatisfiable(c, ledgers_, nodes)
        if why:
            out[c.key] = Decision(UNSATISFIABLE, "Unsatisfiable", why)
            continue
        short = _shortfall(c, ledgers_)
        if short is None:
            for ledger in ledgers_:
                ledger.taken = _add(ledger.taken, _usage_for(ledger, c.outstanding))
            limits = ", ".join(ledger.name for ledger in ledgers_) or "no quota limits it"
            out[c.key] = Decision(ADMITTED, "QuotaReserved",
                                  f"the whole gang ({len(c.demand)} pods, {c.gpus} GPUs) fits: "
                                  f"{limits}")
        else:
            for ledger in ledgers_:  # reserve: nothing behind it may take what it waits for
                ledger.waiting[c.key] = _usage_for(ledger, c.outstanding)
            out[c.key] = Decision(QUEUED, "QuotaExceeded", short)
    return out


def gpu_totals(candidates: list[Candidate], decisions: dict[str, Decision]) -> dict[str, int]:
    """Jobs and GPUs by state, for the metrics and `trainop quota`."""
    out = {"queuedJobs": 0, "queuedGpus": 0, "admittedGpus": 0}
    for c in candidates:
        outcome = ADMITTED if c.admitted else getattr(decisions.get(c.key), "outcome", None)
        if outcome == QUEUED:
            out["queuedJobs"] += 1
            out["queuedGpus"] += c.gpus
        elif outcome == ADMITTED:
            out["admittedGpus"] += c.gpus
    return out


def by_job(pods: list[dict], label: str) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = defaultdict(list)
    for pod in pods:
        name = (pod["metadata"].get("labels") or {}).get(label)
        if name:
            out[name].append(pod)
    return out
