"""Which priority a job gets. A namespace user cannot pick a number: `spec.priorityClassName`
names a class that a cluster admin created, and the operator's `limits.maxPriority` may cap it.

    classes = priority.Classes.of(pod_classes, workload_classes)   # from the watch caches
    prio = priority.resolve("high", classes, cfg, kueue=False)     # Priority or SpecError
    job = priority.bind(job, prio)          # the pods carry prio's PriorityClass
    kueue: prio.ref -> Workload spec.priorityClassRef, prio.value -> spec.priority

The same rules as Kubernetes and Kueue, which own these kinds:
- A natively admitted job (no spec.queue, or Kueue absent) names a scheduling.k8s.io/v1
  PriorityClass. Its value orders the namespace's queue (admission.py) and its pods carry it,
  so the scheduler's preemption agrees with the queue.
- A job that Kueue admits names a Kueue WorkloadPriorityClass (it orders the ClusterQueue and
  leaves the pods' own priority alone) or a PriorityClass, looked up in that order, as Kueue's
  jobframework does for its label and for the pods' priorityClassName.
- Unset: the cluster's globalDefault PriorityClass (the lowest-valued one if several claim it,
  as the API server and Kueue both pick), else no class and 0. Kubernetes has no per-namespace
  default.

Pure: the classes come from the operator's indexes (handlers/indexes.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from trainop.config import Config
from trainop.memo import Memos
from trainop.spec import Job, SpecError

FIELD = "spec.priorityClassName"
POD, WORKLOAD = "PriorityClass", "WorkloadPriorityClass"
GROUPS = {POD: "scheduling.k8s.io", WORKLOAD: "kueue.x-k8s.io"}
SUGGEST = 10  # class names a refusal lists at most


@dataclass(frozen=True)
class Class:
    kind: str   # POD | WORKLOAD
    name: str
    value: int
    global_default: bool = False

    @property
    def ref(self) -> dict:
        """Kueue v1beta2 Workload spec.priorityClassRef."""
        return {"group": GROUPS[self.kind], "kind": self.kind, "name": self.name}

    def describe(self) -> str:
        return f"{self.kind} {self.name!r} (value {self.value})"


@dataclass(frozen=True)
class Classes:
    pod: dict[str, Class] = field(default_factory=dict)
    workload: dict[str, Class] = field(default_factory=dict)

    @staticmethod
    def of(pod_classes, workload_classes=()) -> Classes:
        """From PriorityClass and WorkloadPriorityClass objects (dicts as the API serves them)."""
        return Classes(
            pod={o["metadata"]["name"]: Class(POD, o["metadata"]["name"], int(o.get("value") or 0),
                                              bool(o.get("globalDefault")))
                 for o in pod_classes},
            workload={o["metadata"]["name"]: Class(WORKLOAD, o["metadata"]["name"],
                                                   int(o.get("value") or 0))
                      for o in workload_classes})

    def default(self) -> Class | None:
        defaults = [c for c in self.pod.values() if c.global_default]
        return min(defaults, key=lambda c: (c.value, c.name)) if defaults else None


@dataclass(frozen=True)
class Priority:
    value: int
    cls: Class | None = None  # the class the value comes from; None: no class at all

    @property
    def ref(self) -> dict | None:
        return self.cls.ref if self.cls else None

    @property
    def pod_class(self) -> str | None:
        """The priorityClassName of the job's pods (a WorkloadPriorityClass is not one)."""
        return self.cls.name if self.cls and self.cls.kind == POD else None


NONE = Priority(0)


def resolve(name: str | None, classes: Classes, cfg: Config, kueue: bool) -> Priority:
    """The priority `name` gives a job (Kueue-admitted when `kueue`); SpecError naming
    spec.priorityClassName when no such class exists or it is above limits.maxPriority."""
    if not name:
        default = classes.default()
        return Priority(default.value, default) if default else NONE
    found = (kueue and classes.workload.get(name)) or classes.pod.get(name)
    if found is None:
        raise SpecError(FIELD, _unknown(name, classes, cfg, kueue))
    if cfg.max_priority is not None and found.value > cfg.max_priority:
        raise SpecError(FIELD, f"{found.describe()} is above limits.maxPriority={cfg.max_priority}"
                               f", the highest priority the cluster admin allows jobs; "
                               f"{_choices(classes, cfg, kueue)}")
    return Priority(found.value, found)


def _unknown(name: str, classes: Classes, cfg: Config, kueue: bool) -> str:
    if not kueue and name in classes.workload:
        return (f"{name!r} is a Kueue WorkloadPriorityClass, which orders only jobs that Kueue "
                f"admits: set spec.queue to a LocalQueue, or {_choices(classes, cfg, kueue)}")
    what = "WorkloadPriorityClass or PriorityClass" if kueue else "PriorityClass"
    return f"no {what} {name!r} exists; {_choices(classes, cfg, kueue)}"


def _choices(classes: Classes, cfg: Config, kueue: bool) -> str:
    """The classes a job may name here, lowest first."""
    pool = list(classes.pod.values()) + (list(classes.workload.values()) if kueue else [])
    ok = sorted((c for c in pool if cfg.max_priority is None or c.value <= cfg.max_priority),
                key=lambda c: (c.value, c.name))
    if not ok:
        return ("no class a job may use exists: leave it unset, or ask the cluster admin to "
                "create a PriorityClass")
    names = ", ".join(f"{c.name} ({c.value})" for c in ok[:SUGGEST])
    more = f" and {len(ok) - SUGGEST} more" if len(ok) > SUGGEST else ""
    return f"use one of {names}{more}, or leave it unset for the cluster's default"


def bind(job: Job, prio: Priority, memo: Memos | None = None) -> Job:
    """`job` whose pods carry `prio`'s PriorityClass. With the controller's `memo`, one object
    per (parsed Job, class), so the per-Job memos (admission.gang_pods) keep hitting when a
    namespace's queue is judged again and again."""
    if job.pod_priority_class == prio.pod_class:
        return job
    make = lambda: dataclasses.replace(job, pod_priority_class=prio.pod_class)  # noqa: E731
    return make() if memo is None else memo.bound.get(job, ("class", prio.pod_class), make)


def for_job(job: Job, classes: Classes, cfg: Config, kueue: bool,
            strict: bool = True, memo: Memos | None = None) -> tuple[Job, Priority]:
    """The job bound to its priority. `strict=False` is for a job already admitted: a class
    deleted or capped since must not stop it; its new pods get the cluster's default."""
    try:
        prio = resolve(job.priority_class_name, classes, cfg, kueue)
    except SpecError:
        if strict:
            raise
        prio = NONE
    return bind(job, prio, memo), prio
