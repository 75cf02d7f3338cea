"""The native admission queue between a job's reconcile and its first pod: it runs the pure
admission.plan() over every waiting job of a namespace at once, from the operator's watch caches,
and keeps the decisions. The controller owns one Gate (no module state) and asks it BEFORE
jobsync.decide() runs: decide() says when a job reaches the gate (Outcome.asks), the controller
asks the gate and decides again with the answer in the snapshot (JobSnapshot.admission), so
decide() itself never calls out.

    gate = Gate()                                 # one per controller
    decision = gate.decide(job, body, cfg, view, prio)  # the controller, for jobsync
    names = gate.wake(namespace)                  # room may have appeared: re-judge these jobs
    names = gate.drain_admitted(namespace)        # jobs an evaluation admitted for others
    totals = gate.totals(namespace)               # GPUs admitted/queued, for the metrics

`view` is the namespace's NamespaceView (pods, quotas, jobs, nodes and the priority classes,
from kopf indexes), read in the event loop; the queue is judged again only when a job asks for
the first time, or `wake` marked the namespace dirty (a quota changed, a job ended or was
deleted, a pod went away).

One lock per namespace: two jobs judged at the same moment would both see the same free room.
A job admitted here counts as admitted (its outstanding demand is held) from that moment, even
before its own status says so, so a second evaluation can never hand out the same room twice:
not even one whose view was read before the admitted job reached the caches (its candidate is
kept, `_Namespace.held`, until the job's view says it ended or the job is deleted: `forget`).
Jobs that name a queue go to Kueue when Kueue is installed (kueue.py, judged inside decide()
from the cached Workload: pure).
"""

from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass, field

from trainop import admission, conditions, kueue, phases, priority
from trainop.admission import Decision
from trainop.config import Config
from trainop.memo import Memos
from trainop.render import common
from trainop.spec import MANAGED_BY, Job, SpecError, managed_by, parse_cached

ADMITTED_EARLIER = Decision(admission.ADMITTED, "QuotaReserved",
                            "the whole gang fits the namespace's quotas")


@dataclass
class NamespaceView:
    pods: list[dict]    # the namespace's trainop pods (label trainop.io/job-name)
    quotas: list[dict]  # its ResourceQuotas
    jobs: list[dict]    # its DistributedTrainingJobs
    nodes: list[dict]
    classes: priority.Classes = field(default_factory=priority.Classes)  # what orders the queue
    # gate.wakes(namespace) when the view was read (None: now). A view read before a wake must
    # not mark the queue judged: the room that wake announced is not in it.
    wakes: int | None = None


def unlimited(quotas: list[dict], cfg: Config) -> bool:
    """No ResourceQuota and no operator GPU cap: nothing for the namespace's jobs to queue for."""
    return not quotas and admission.namespace_gpu_cap(cfg) is None


@dataclass
class _Namespace:
    lock: threading.Lock = field(default_factory=threading.Lock)
    asking: set[str] = field(default_factory=set)            # job names that reached the gate
    admitted: dict[str, tuple[str, int]] = field(default_factory=dict)  # name -> (uid, generation)
    held: dict[str, admission.Candidate] = field(default_factory=dict)  # the admitted ones' demand
    decisions: dict[str, Decision] = field(default_factory=dict)
    wakes: int = 0     # how often wake() said room may have appeared
    judged: int = -1   # the wakes the last evaluation's view had seen
    admitted_for_others: set[str] = field(default_factory=set)  # to wake (drain_admitted)
    totals: dict = field(default_factory=dict)  # the last evaluation's GPU totals (metrics)


def _is_admitted(space: _Namespace, body: dict) -> bool:
    meta = body["metadata"]
    if conditions.is_true((body.get("status") or {}).get("conditions"), "Admitted"):
        return True
    return space.admitted.get(meta["name"]) == (meta["uid"], meta.get("generation"))


def _asks(space: _Namespace, body: dict) -> bool:
    cond = conditions.get_condition((body.get("status") or {}).get("conditions"), "Admitted")
    return body["metadata"]["name"] in space.asking or (
        cond is not None and cond.get("reason") == "QuotaExceeded")


def _evaluate(namespace: str, space: _Namespace, cfg: Config, view: NamespaceView,
              memo: Memos | None = None) -> None:
    """Re-judge every waiting job of the namespace (lock held)."""
    live = admission.by_job(view.pods, common.LABEL_JOB)
    candidates, gpu_resources, names = [], set(), set()
    in_view = {body["metadata"]["name"] for body in view.jobs}
    for name in space.admitted.keys() - in_view:  # admitted, but this view was read before it
        candidates.append(space.held[name])      # reached the caches: its room stays taken
        gpu_resources.add(space.held[name].gpus_resource)
    for body in view.jobs:
        spec, meta = body.get("spec") or {}, body["metadata"]
        if phases.finished(body) or (spec.get("runPolicy") or {}).get("suspend") or \
                managed_by(body) != MANAGED_BY or kueue.manages(body):
            continue
        admitted = _is_admitted(space, body)
        if not admitted and not _asks(space, body):
            continue  # not at the gate yet (e.g. still waiting for its data)
        try:
            # bound to its class: the pods' priorityClassName decides PriorityClass-scoped quotas
            job, prio = priority.for_job(parse_cached(body, cfg, memo), view.classes, cfg,
                                         kueue=False, strict=not admitted, memo=memo)
        except SpecError:
            continue  # jobsync fails it with the reason
        names.add(job.name)
        gpu_resources.add(job.placement.gpu_resource)
        candidates.append(admission.candidate(job, meta, live.get(job.name, []), admitted,
                                              prio.value, memo))
    ledgers = admission.ledgers(namespace, view.quotas, view.pods, cfg, gpu_resources)
    decisions = admission.plan(candidates, ledgers, view.nodes)
    for body in view.jobs:
        name = body["metadata"]["name"]
        if getattr(decisions.get(name), "admitted", False):
            space.admitted[name] = (body["metadata"]["uid"], body["metadata"].get("generation"))
            space.admitted_for_others.add(name)
    for c in candidates:
        if c.key in space.admitted and c.key in names:
            space.held[c.key] = dataclasses.replace(c, admitted=True)
    # Let go of what the view shows ended, suspended or handed to another queue; one it does
    # not show yet keeps its place (forget() lets go of a deleted one).
    space.admitted = {n: v for n, v in space.admitted.items() if n in names or n not in in_view}
    space.held = {n: c for n, c in space.held.items() if n in space.admitted}
    space.asking &= names
    space.decisions = decisions
    space.judged = max(space.judged, space.wakes if view.wakes is None else view.wakes)
    space.totals = admission.gpu_totals(candidates, decisions)


class Gate:
    """Every namespace's queue state. Locking: `_lock` only guards the map of namespaces; each
    namespace's own lock serialises its judging (decide() runs on the controller's pool
    threads), so two namespaces are judged in parallel and one is never judged twice at once."""

    def __init__(self, memo: Memos | None = None) -> None:
        self.memo = memo  # the controller's (memo.py): parsed specs, rendered gangs
        self._spaces: dict[str, _Namespace] = {}
        self._lock = threading.Lock()

    def _space(self, namespace: str) -> _Namespace:
        with self._lock:  # one lock object per namespace, even when two threads ask at once
            return self._spaces.setdefault(namespace, _Namespace())

    def decide(self, job: Job, body: dict, cfg: Config, view: NamespaceView) -> Decision:
        """May this job's gang be created now? For a job not yet Admitted and not Kueue's
        (jobsync asked: Outcome.asks); `job` is bound to its priority."""
        if unlimited(view.quotas, cfg):
            # Nothing limits the namespace: each job is judged alone, on whether its pool can
            # ever hold it (judging the whole namespace per new job would cost O(jobs^2) in a
            # burst).
            c = admission.candidate(job, body["metadata"], [], False, 0, self.memo)
            why = admission.unsatisfiable(c, [], view.nodes)
            if why:
                return Decision(admission.UNSATISFIABLE, "Unsatisfiable", why)
            return Decision(admission.ADMITTED, "QuotaReserved",
                            f"the whole gang ({len(c.demand)} pods, {c.gpus} GPUs) fits: "
                            f"no quota limits it")
        space = self._space(job.namespace)
        with space.lock:
            new = job.name not in space.asking
            space.asking.add(job.name)
            if not _is_admitted(space, body) and (
                    new or space.judged < space.wakes or job.name not in space.decisions):
                _evaluate(job.namespace, space, cfg, view, self.memo)
            space.admitted_for_others.discard(job.name)
            if _is_admitted(space, body):  # admitted here, its status not written yet
                return space.decisions.get(job.name) or ADMITTED_EARLIER
            # Absent only if the job changed under us (suspended, edited): judge it next time.
            return space.decisions.get(job.name) or Decision(
                admission.QUEUED, "QuotaExceeded", "waiting for the namespace's queue to be judged")

    def forget(self, namespace: str, name: str) -> None:
        """The job was deleted: its room is free (the next evaluation, which wake() asks for,
        no longer holds it)."""
        space = self._spaces.get(namespace)
        if space is None:
            return
        with space.lock:
            space.admitted.pop(name, None)
            space.held.pop(name, None)
            space.asking.discard(name)
            space.decisions.pop(name, None)

    def wake(self, namespace: str) -> list[str]:
        """Room may have appeared in `namespace`: the jobs to reconcile (their next decide()
        judges the queue again), none if nobody waits."""
        space = self._spaces.get(namespace)
        if space is None or not space.asking:
            return []
        with space.lock:
            space.wakes += 1
            return sorted(n for n in space.asking if n not in space.admitted)

    def wakes(self, namespace: str) -> int:
        """Read with a NamespaceView, in the same moment (see NamespaceView.wakes)."""
        space = self._spaces.get(namespace)
        return space.wakes if space is not None else 0

    def drain_admitted(self, namespace: str) -> list[str]:
        """Jobs that another job's evaluation admitted: they must reconcile to start their
        gang."""
        space = self._spaces.get(namespace)
        if space is None:
            return []
        with space.lock:
            out, space.admitted_for_others = sorted(space.admitted_for_others), set()
            return out

    def totals(self, namespace: str) -> dict:
        space = self._spaces.get(namespace)
        return dict(space.totals) if space is not None else {}
