"""The reconcile's working state: the snapshot it reads (JobSnapshot), the status it builds
(_Status: conditions with lastTransitionTime kept), the plan of actions (_Plan), and the small
helpers every policy shares (stop and clean the gang, finish the job, the Events of condition
changes).
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field

from trainop import conditions, fastjson, phases, priority
from trainop.actions import Outcome, Problem, delete
from trainop.admission import Decision
from trainop.config import Config
from trainop.memo import Memos

TERMINAL = phases.TERMINAL

# What the timer-based operator put on every job (kopf's, for its timer); nothing needs it now,
# and left in place it would hold a deleted job (and its namespace) until someone removes it.
LEGACY_FINALIZER = "trainop.io/finalizer"

# Conditions whose becoming True (or False, for these gates) is worth a Warning Event.
WARN_TRUE = {"Failed", "Restarting", "Evicted"}

WARN_FALSE = {"Created", "DataReady", "Transport", "CheckpointAccepted"}

# Reasons that are news, not trouble, whatever their condition: an elastic gang's resize
# (jobsync/elastic.py; the disruption that caused a shrink had its own Warning).
NORMAL_REASONS = {"Resized"}


@dataclass
class JobSnapshot:
    """What one reconcile may look at: the job and its children as the watch caches hold them."""
    body: dict
    pods: list[dict] = field(default_factory=list)        # label trainop.io/job-name=<job>
    launcher: dict | None = None                          # the launcher batch/v1 Job
    service: dict | None = None
    launcher_service: dict | None = None  # runLauncherAsWorker's (render/dtj.py)
    config_map: dict | None = None                        # the MPI hostfile ConfigMap
    progress: dict | None = None                          # the log shipper's ConfigMap (display only)
    network_policy: dict | None = None                    # the job's pods' isolation
    ssh_secret: bool = False   # this process made or found the job's SSH Secret (apply.py)
    nodes: list[dict] = field(default_factory=list)
    # the nodes that carry the preflight's taint (preflight.maxTaintedNodes counts them)
    tainted_nodes: tuple[str, ...] = ()
    # the nodes judged lost (Ready Unknown: failures.node_lost) by name: {name, since, message}
    lost_nodes: dict[str, dict] = field(default_factory=dict)
    stage: dict | None = None                             # the referenced DataStage
    # The native queue's answer (gate.py), asked by the controller when a decide() of this
    # snapshot returned Outcome.asks; None: not asked yet.
    admission: Decision | None = None
    classes: priority.Classes = field(default_factory=priority.Classes)  # cluster-scoped
    kueue: bool = False        # Kueue admits this job (spec.queue and Kueue is installed)
    workload: dict | None = None  # its Kueue Workload (the watch cache's, controlled by the job)
    # an elastic job's bigger Workload slice waiting for admission, and the slices Kueue
    # replaced (finished) since (kueue.pick)
    workload_slice: dict | None = None
    replaced_workloads: list[dict] = field(default_factory=list)
    flavors: dict[str, dict] = field(default_factory=dict)  # the admitted ResourceFlavors by name
    gang_scheduler: str | None = None  # served gang scheduler of the configuration (podgroup.py)
    pod_group: dict | None = None  # its PodGroup, where that scheduler's API is served
    memo: Memos | None = None  # the controller's memos (memo.py); None: nothing remembered
    problem: Problem | None = None                        # what the last apply met (apply.py)
    # The last state of the job's pods deleted since this process started (the DELETED watch
    # event's object): why a vanished worker went (DisruptionTarget, its node). Empty after an
    # operator restart, then a vanished worker is PodDeleted.
    departed: list[dict] = field(default_factory=list)


class _Status:
    """The status being built: conditions keep their transition times, phase is a summary."""

    def __init__(self, old: dict, generation: int | None, now: dt.datetime):
        self.data = fastjson.clone(old or {})
        self.generation = generation
        self.stamp = _ts(now)

    def cond(self, type_: str, status: bool, reason: str, message: str) -> None:
        self.data["conditions"] = conditions.set_condition(
            self.data.get("conditions"), type_, status, reason, message,
            generation=self.generation, timestamp=self.stamp)

    def is_true(self, type_: str) -> bool:
        return conditions.is_true(self.data.get("conditions"), type_)

    def phase(self, value: str) -> None:
        self.data["phase"] = value


class _Plan:
    """The outcome being built, with the snapshot it is built from."""

    def __init__(self, snap: JobSnapshot, cfg: Config, now: dt.datetime):
        self.snap, self.cfg, self.now = snap, cfg, now
        self.body = snap.body
        self.out = Outcome()
        # gracePeriodSeconds of the job's pods' deletions (render/dtj.py delete_grace_seconds),
        # set once the job is parsed; None: each pod's own
        self.pod_grace: int | None = None
        self.prio = priority.NONE  # the job's priority, once judged (a Workload slice's)

    def delete(self, obj: dict) -> int:
        self.out.actions.append(delete(obj, self.pod_grace if obj.get("kind") == "Pod" else None))
        return 1

    def wait(self, why: str) -> Outcome:
        self.out.waiting = why
        return self.out


def _ts(moment: dt.datetime) -> str:
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")


def _pod_ready(pod: dict) -> bool:
    if pod["metadata"].get("deletionTimestamp") or pod.get("status", {}).get("phase") != "Running":
        return False
    return any(c.get("type") == "Ready" and c.get("status") == "True"
               for c in pod.get("status", {}).get("conditions") or [])


def _launcher_outcome(job_obj: dict | None) -> str | None:
    for cond in ((job_obj or {}).get("status") or {}).get("conditions") or []:
        if cond.get("status") == "True" and cond.get("type") in ("Complete", "Failed"):
            return cond["type"]
    return None


def _delete_pods(plan: _Plan, pods: list[dict], keep=lambda pod: False) -> int:
    return sum(plan.delete(pod) for pod in pods
               if not keep(pod) and not pod["metadata"].get("deletionTimestamp"))


def _stop(plan: _Plan, policy: str) -> int:
    """Finish: an active launcher always stops; pods go as cleanPodPolicy says. Returns how
    many deletions it had to issue (0: nothing left to clean).

    Pods before the launcher Job, here and wherever a gang stops: the garbage collector deletes
    the Job's pod with the pod's own grace period, and a later deletion may only shorten it, so
    the launcher's pod gets plan.pod_grace (mpirun must outlive the ranks' save) only when the
    operator's own deletion reaches it first."""
    issued, launcher, pods = 0, plan.snap.launcher, plan.snap.pods
    if policy == "All":
        issued += _delete_pods(plan, pods)
    elif policy == "Running":
        issued += _delete_pods(plan, pods,
                               keep=lambda p: p.get("status", {}).get("phase") in TERMINAL)
    if launcher and not launcher["metadata"].get("deletionTimestamp") and \
            (policy == "All" or _launcher_outcome(launcher) is None):
        issued += plan.delete(launcher)
    return issued


def _finish(st: _Status, phase: str, reason: str, message: str, now: dt.datetime) -> None:
    st.cond(phase, True, reason, message)
    if st.data.get("conditions") and conditions.get_condition(st.data["conditions"], "Running"):
        st.cond("Running", False, reason, message)
    st.phase(phase)
    st.data.setdefault("completionTime", _ts(now))


def _events(old: list[dict] | None, new: list[dict] | None) -> list[tuple[str, str, str]]:
    """One Event per condition transition (status or reason changed)."""
    out = []
    for cond in new or []:
        before = conditions.get_condition(old, cond["type"])
        keys = ("status", "reason", "message") if cond["type"] in WARN_TRUE | WARN_FALSE \
            else ("status", "reason")
        if before and all(before.get(k) == cond.get(k) for k in keys):
            continue
        if before is None and cond["status"] == "False" and cond["type"] not in WARN_FALSE:
            continue  # a gate that was never open closing says nothing new
        warn = ((cond["status"] == "True" and cond["type"] in WARN_TRUE) or
                (cond["status"] == "False" and cond["type"] in WARN_FALSE)) and \
            cond.get("reason") not in NORMAL_REASONS
        out.append(("Warning" if warn else "Normal", cond.get("reason") or cond["type"],
                    cond.get("message") or ""))
    return out


def _controlled(obj: dict, body: dict) -> bool:
    uid = body["metadata"].get("uid")
    return any(ref.get("controller") and ref.get("uid") == uid
               for ref in obj["metadata"].get("ownerReferences") or [])


def _version(obj: dict | None) -> str:
    return (obj or {}).get("metadata", {}).get("resourceVersion", "") if obj else ""
