"""The admission gate between a job's reconcile and its first pod: it reads the namespace's live
state, runs admission.plan() over every waiting job at once, and keeps the decisions.

    decision = gate.decide(job, body, cfg)   # jobsync, before any child exists
    gate.wake(namespace, cfg)                # handlers/admission.py, when room may have appeared

Reads happen on `wake` (events: a quota changed, a job ended or was deleted, a pod went away)
and when a job first asks; a waiting job's periodic reconcile only looks up the last decision
(cheap), with a full re-evaluation at most every RECHECK_SECONDS as a safety net.

One lock per namespace: two jobs judged at the same moment would both see the same free room.
A job admitted here counts as admitted (its outstanding demand is held) from that moment, even
before its own status says so, so a second evaluation can never hand out the same room twice.
Jobs that name a queue go to Kueue when Kueue is installed (kueue.py).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import prometheus_client as prom

from trainop import API_VERSION, admission, conditions, kube, kueue
from trainop.admission import Decision
from trainop.config import Config
from trainop.render import common
from trainop.spec import KIND, Job, SpecError, parse

RECHECK_SECONDS = 30.0
ADMITTED_EARLIER = Decision(admission.ADMITTED, "QuotaReserved",
                            "the whole gang fits the namespace's quotas")
TERMINAL = ("Succeeded", "Failed")

QUEUED_JOBS = prom.Gauge("trainop_queued_jobs", "Jobs waiting for GPU quota (native admission)",
                         ["namespace"])
QUEUED_GPUS = prom.Gauge("trainop_queued_gpus", "GPUs the queued jobs ask for", ["namespace"])
ADMITTED_GPUS = prom.Gauge("trainop_admitted_gpus",
                           "GPUs of admitted, unfinished jobs (native admission)", ["namespace"])


@dataclass
class _Namespace:
    lock: threading.Lock = field(default_factory=threading.Lock)
    asking: set[str] = field(default_factory=set)            # job names that reached the gate
    admitted: dict[str, tuple[str, int]] = field(default_factory=dict)  # name -> (uid, generation)
    decisions: dict[str, Decision] = field(default_factory=dict)
    checked: float = 0.0  # time.monotonic() of the last evaluation
    dirty: bool = True


_spaces: dict[str, _Namespace] = {}
_spaces_lock = threading.Lock()


def _space(namespace: str) -> _Namespace:
    with _spaces_lock:  # one lock object per namespace, even when two threads ask at once
        return _spaces.setdefault(namespace, _Namespace())


def _is_admitted(space: _Namespace, body: dict) -> bool:
    meta = body["metadata"]
    if conditions.is_true((body.get("status") or {}).get("conditions"), "Admitted"):
        return True
    return space.admitted.get(meta["name"]) == (meta["uid"], meta.get("generation"))


def _asks(space: _Namespace, body: dict) -> bool:
    cond = conditions.get_condition((body.get("status") or {}).get("conditions"), "Admitted")
    return body["metadata"]["name"] in space.asking or (
        cond is not None and cond.get("reason") == "QuotaExceeded")


def _evaluate(namespace: str, space: _Namespace, cfg: Config) -> None:
    """Re-judge every waiting job of the namespace from the live state (lock held)."""
    # Pods before quotas: a pod created in between is then counted twice (safe), never missed.
    pods = kube.list_objects("v1", "Pod", namespace)
    quotas = kube.list_objects("v1", "ResourceQuota", namespace)
    jobs = kube.list_objects(API_VERSION, KIND, namespace)
    nodes = kube.list_objects("v1", "Node")
    live = admission.by_job(pods, common.LABEL_JOB)
    candidates, gpu_resources, names = [], set(), set()
    for body in jobs:
        spec, meta = body.get("spec") or {}, body["metadata"]
        if (body.get("status") or {}).get("phase") in TERMINAL or \
                (spec.get("runPolicy") or {}).get("suspend") or kueue.manages(body):
            continue
        admitted = _is_admitted(space, body)
        if not admitted and not _asks(space, body):
            continue  # not at the gate yet (e.g. still waiting for its data)
        try:
            job = parse(body, cfg)
        except SpecError:
            continue  # jobsync fails it with the reason
        names.add(job.name)
        gpu_resources.add(job.placement.gpu_resource)
        candidates.append(admission.candidate(job, meta, live.get(job.name, []), admitted,
                                              int(spec.get("priority") or 0)))
    ledgers = admission.ledgers(namespace, quotas, pods, cfg, gpu_resources)
    decisions = admission.plan(candidates, ledgers, nodes)
    for body in jobs:
        name = body["metadata"]["name"]
        if getattr(decisions.get(name), "admitted", False):
            space.admitted[name] = (body["metadata"]["uid"], body["metadata"].get("generation"))
    space.admitted = {n: v for n, v in space.admitted.items() if n in names}
    space.asking &= names
    space.decisions = decisions
    space.checked, space.dirty = time.monotonic(), False
    totals = admission.gpu_totals(candidates, decisions)
    QUEUED_JOBS.labels(namespace).set(totals["queuedJobs"])
    QUEUED_GPUS.labels(namespace).set(totals["queuedGpus"])
    ADMITTED_GPUS.labels(namespace).set(totals["admittedGpus"])


def decide(job: Job, body: dict, cfg: Config) -> Decision:
    """May this job's gang be created now? Called for a job that is not yet Admitted."""
    if kueue.manages(body):
        return kueue.decide(job, body)
    space = _space(job.namespace)
    with space.lock:
        new = job.name not in space.asking
        space.asking.add(job.name)
        if not _is_admitted(space, body) and (
                new or space.dirty or job.name not in space.decisions or
                time.monotonic() - space.checked > RECHECK_SECONDS):
            _evaluate(job.namespace, space, cfg)
        if _is_admitted(space, body):  # admitted here, its status not written yet
            return space.decisions.get(job.name) or ADMITTED_EARLIER
        # Absent only if the job changed under us (suspended, edited): judge it next time.
        return space.decisions.get(job.name) or Decision(
            admission.QUEUED, "QuotaExceeded", "waiting for the namespace's queue to be judged")


def wake(namespace: str, cfg: Config) -> None:
    """Room may have appeared in `namespace`: re-judge its queue now (if it has one)."""
    space = _spaces.get(namespace)
    if space is None or not space.asking:
        return
    with space.lock:
        space.dirty = True
        if any(d.outcome == admission.QUEUED for d in space.decisions.values()):
            _evaluate(namespace, space, cfg)
