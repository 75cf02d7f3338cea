"""The decisions of a DistributedTrainingJob's reconcile, in mpi-operator's order: defaults and
parse -> terminal jobs (cleanup, TTL) -> deadline -> suspend -> data -> placement -> Service,
hostfile, SSH Secret (generated once) -> workers -> failures (gang restart or Failed) -> launcher
only when every worker is Ready and published in DNS -> status.

    outcome = jobsync.decide(JobSnapshot(body, pods=..., launcher=...), cfg, now)
    outcome.actions, outcome.status, outcome.events, outcome.requeue_after

Pure: everything comes from the snapshot (the operator's watch caches, controller.py builds it)
and the clock is an argument, so tests/unit/test_jobsync_decide.py feeds tables of snapshots.
Level-based: an interrupted reconcile (operator restart, conflict) re-runs without duplicates.
Children carry the gang attempt (`attempt(status)`, status.attempt) as a label; a gang restart
(`restart_gang`) first bumps the attempt in status, later reconciles delete the previous
attempt's pods and recreate them. Failures are classified (`pod_failure`: exit code, OOMKilled,
Evicted, Preempted, NodeLost, SpotEviction, PodDeleted) and judged by
runPolicy.failurePolicy (`action_for`); status.restarts counts failures and disruptions apart.
"""

from __future__ import annotations

import copy
import dataclasses
import datetime as dt
from dataclasses import dataclass, field

from trainop import conditions, kueue, phases, podgroup, preflight, priority, progress, resume
from trainop.actions import (
    Apply,
    Create,
    CreateSSHSecret,
    DropFinalizer,
    Outcome,
    PatchStatus,
    Problem,
    Ref,
    TaintNode,
    delete,
)
from trainop.admission import Decision
from trainop.config import Config
from trainop.render import common, logship
from trainop.render import dtj as render
from trainop.spec import (
    MANAGED_BY,
    FailureRule,
    Job,
    NoMatchingNodes,
    SpecError,
    capacity_error,
    managed_by,
    parse_cached,
)

TERMINAL = phases.TERMINAL
# What the timer-based operator put on every job (kopf's, for its timer); nothing needs it now,
# and left in place it would hold a deleted job (and its namespace) until someone removes it.
LEGACY_FINALIZER = "trainop.io/finalizer"
# Conditions whose becoming True (or False, for these gates) is worth a Warning Event.
WARN_TRUE = {"Failed", "Restarting", "Evicted"}
WARN_FALSE = {"Created", "DataReady", "Transport", "CheckpointAccepted"}
# How long a failed preflight waits for worker 0's report before it counts as an ordinary failure.
REPORT_GRACE_SECONDS = 60


@dataclass
class JobSnapshot:
    """What one reconcile may look at: the job and its children as the watch caches hold them."""
    body: dict
    pods: list[dict] = field(default_factory=list)        # label trainop.io/job-name=<job>
    launcher: dict | None = None                          # the launcher batch/v1 Job
    service: dict | None = None
    config_map: dict | None = None                        # the MPI hostfile ConfigMap
    progress: dict | None = None                          # the log shipper's ConfigMap (display only)
    network_policy: dict | None = None                    # the job's pods' isolation
    ssh_secret: bool = False   # this process made or found the job's SSH Secret (apply.py)
    endpoint_slices: list[dict] = field(default_factory=list)
    nodes: list[dict] = field(default_factory=list)
    stage: dict | None = None                             # the referenced DataStage
    # The native queue's answer (gate.py), asked by the controller when a decide() of this
    # snapshot returned Outcome.asks; None: not asked yet.
    admission: Decision | None = None
    classes: priority.Classes = field(default_factory=priority.Classes)  # cluster-scoped
    kueue: bool = False        # Kueue admits this job (spec.queue and Kueue is installed)
    workload: dict | None = None  # its Kueue Workload (the watch cache's, controlled by the job)
    flavors: dict[str, dict] = field(default_factory=dict)  # the admitted ResourceFlavors by name
    gang_scheduler: str | None = None  # served gang scheduler of the configuration (podgroup.py)
    pod_group: dict | None = None  # its PodGroup, where that scheduler's API is served
    problem: Problem | None = None                        # what the last apply met (apply.py)
    # The last state of the job's pods deleted since this process started (the DELETED watch
    # event's object): why a vanished worker went (DisruptionTarget, its node). Empty after an
    # operator restart, then a vanished worker is PodDeleted.
    departed: list[dict] = field(default_factory=list)


# ---- the gang attempt, its restarts and why they happened ----------------------------------

# runPolicy.failurePolicy actions, named after JobSet's failurePolicy (RestartJobSet counts
# against maxRestarts, RestartJobSetAndIgnoreMaxRestarts does not, FailJobSet).
RESTART, RESTART_UNCOUNTED, FAIL_JOB = "RestartGang", "RestartGangAndIgnoreBackoffLimit", "FailJob"
# Causes that are not the job's fault: by default they restart the gang without counting.
DISRUPTIONS = frozenset({"Evicted", "Preempted", "NodeLost", "SpotEviction", "PodDeleted"})
# The reasons Kubernetes gives the DisruptionTarget condition, and what trainop calls them.
DISRUPTION_REASONS = {"EvictionByEvictionAPI": "Evicted", "TerminationByKubelet": "Evicted",
                      "PreemptionByScheduler": "Preempted", "DeletionByTaintManager": "NodeLost",
                      "DeletionByPodGC": "NodeLost"}
HISTORY = 10  # restarts kept in status.restarts.history (the newest)


def attempt(status: dict | None) -> int:
    """THE gang attempt number: the pods' trainop.io/attempt label, the logs' blob folder
    <job>/<attempt>, `trainop logs --attempt`. Every reader uses this. A job written before
    status.attempt existed kept it in status.restarts (an int then): read the same."""
    status = status or {}
    if status.get("attempt") is not None:
        return int(status["attempt"])
    old = status.get("restarts")
    return old if isinstance(old, int) else 0


def restart_counts(status: dict | None) -> dict:
    """status.restarts as {failures, disruptions, spotEvictions, unhealthyNodes, history}; an old int (every
    restart counted then) becomes that many failures."""
    old = (status or {}).get("restarts")
    if isinstance(old, dict):
        return {"failures": int(old.get("failures") or 0),
                "disruptions": int(old.get("disruptions") or 0),
                "spotEvictions": int(old.get("spotEvictions") or 0),
                "unhealthyNodes": int(old.get("unhealthyNodes") or 0),
                "history": list(old.get("history") or [])}
    return {"failures": int(old or 0), "disruptions": 0, "spotEvictions": 0, "unhealthyNodes": 0,
            "history": []}


@dataclass
class Failure:
    """Why a pod of the gang ended: `cause` is the class runPolicy.failurePolicy matches
    (Error, OOMKilled, Evicted, Preempted, NodeLost, SpotEviction, PodDeleted, WorkerExited,
    LauncherFailed, or a caller's own such as UnhealthyNode); `reason` the pod's own word."""
    pod: str
    container: str
    exit_code: int | None
    reason: str
    finished: str = ""
    node: str = ""
    cause: str = ""
    conditions: tuple[tuple[str, str], ...] = ()  # the pod's (type, status), for onPodConditions
    detail: str = ""  # what the operator concluded (a failed preflight's verdict)

    def __post_init__(self):
        self.cause = self.cause or self.reason

    @property
    def disruption(self) -> bool:
        return self.cause in DISRUPTIONS

    def describe(self) -> str:
        """One line naming the pod, its node, the container and the cause (and what the
        operator concluded, `detail`, such as a failed preflight's verdict)."""
        return self._what() + (f": {self.detail}" if self.detail else "")

    def _what(self) -> str:
        where = f"pod {self.pod}" + (f" on node {self.node}" if self.node else "")
        if self.exit_code is not None:  # the cause too when it is more than the exit (Evicted)
            also = "" if self.cause in (self.reason, "Error") else f": {self.cause}"
            return (f"{where} container {self.container} exited with code {self.exit_code} "
                    f"({self.reason}){also}")
        if self.cause == self.reason:
            return f"{where} container {self.container} ({self.reason})"
        return f"{where} container {self.container}: {self.cause} ({self.reason})"

    def as_status(self) -> dict:
        out = {"pod": self.pod, "container": self.container, "reason": self.reason,
               "cause": self.cause, "message": self.describe()}
        if self.exit_code is not None:
            out["exitCode"] = self.exit_code
        if self.node:
            out["node"] = self.node
        return out


class _Status:
    """The status being built: conditions keep their transition times, phase is a summary."""

    def __init__(self, old: dict, generation: int | None, now: dt.datetime):
        self.data = copy.deepcopy(old or {})
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

    def delete(self, obj: dict) -> int:
        self.out.actions.append(delete(obj))
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


def pod_failure(pod: dict, spot: bool = False) -> Failure | None:
    """Why a pod of the gang ended badly, naming its container, exit code, node and cause;
    None while it has not. `spot`: the pod runs on a spot pool, where a lost node is the
    spot VM taken back (SpotEviction)."""
    name, st = pod["metadata"]["name"], pod.get("status") or {}
    node = (pod.get("spec") or {}).get("nodeName") or ""
    conds = tuple((c.get("type"), c.get("status")) for c in st.get("conditions") or [])
    disrupted = next((c for c in st.get("conditions") or []
                      if c.get("type") == "DisruptionTarget" and c.get("status") == "True"), None)
    cause = None
    if disrupted is not None:
        cause = DISRUPTION_REASONS.get(disrupted.get("reason") or "", "Evicted")
    elif st.get("reason") in ("Evicted", "NodeLost", "Preempting"):  # the kubelet's, node lifecycle's
        cause = {"Preempting": "Preempted"}.get(st["reason"], st["reason"])
    if cause == "NodeLost" and spot:
        cause = "SpotEviction"
    for cs in st.get("initContainerStatuses") or []:  # the preflight (render/fabric.py)
        term = (cs.get("state") or {}).get("terminated") or {}
        if cs.get("name") == preflight.CONTAINER and term.get("exitCode"):
            return Failure(name, cs["name"], term["exitCode"], term.get("reason") or "Error",
                           term.get("finishedAt") or "", node, cause or "Error", conds)
    for cs in st.get("containerStatuses") or []:
        term = (cs.get("state") or {}).get("terminated") or \
            (cs.get("lastState") or {}).get("terminated")
        if term and (term.get("exitCode") or st.get("phase") == "Failed"):
            reason = term.get("reason") or "Error"
            return Failure(name, cs["name"], term.get("exitCode"), reason,
                           term.get("finishedAt") or "", node,
                           cause or ("OOMKilled" if reason == "OOMKilled" else "Error"), conds)
    if cause or st.get("phase") == "Failed":
        return Failure(name, (pod["spec"]["containers"][0])["name"], None,
                       (disrupted or {}).get("reason") or st.get("reason") or cause or "Failed",
                       "", node, cause or st.get("reason") or "Failed", conds)
    return None


def action_for(failure: Failure, rules: tuple[FailureRule, ...]) -> tuple[str, int | None]:
    """(action, index of the rule that matched) for a failure: the first matching rule of
    runPolicy.failurePolicy, as Kubernetes' podFailurePolicy; without one, a disruption
    restarts the gang without counting and anything else counts."""
    for i, rule in enumerate(rules):
        if _matches(rule, failure):
            return rule.action, i
    return (RESTART_UNCOUNTED if failure.disruption else RESTART), None


def _matches(rule: FailureRule, failure: Failure) -> bool:
    if rule.exit_operator:  # exit code 0 never matches (as podFailurePolicy's onExitCodes)
        if not failure.exit_code or rule.container not in (None, failure.container):
            return False
        return (failure.exit_code in rule.exit_values) == (rule.exit_operator == "In")
    if rule.pod_conditions:
        return any(c in failure.conditions for c in rule.pod_conditions)
    return failure.cause in rule.reasons


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
    many deletions it had to issue (0: nothing left to clean)."""
    issued, launcher, pods = 0, plan.snap.launcher, plan.snap.pods
    if launcher and not launcher["metadata"].get("deletionTimestamp") and \
            (policy == "All" or _launcher_outcome(launcher) is None):
        issued += plan.delete(launcher)
    if policy == "All":
        issued += _delete_pods(plan, pods)
    elif policy == "Running":
        issued += _delete_pods(plan, pods,
                               keep=lambda p: p.get("status", {}).get("phase") in TERMINAL)
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
        warn = (cond["status"] == "True" and cond["type"] in WARN_TRUE) or \
            (cond["status"] == "False" and cond["type"] in WARN_FALSE)
        out.append(("Warning" if warn else "Normal", cond.get("reason") or cond["type"],
                    cond.get("message") or ""))
    return out



def decide(snap: JobSnapshot, cfg: Config, now: dt.datetime) -> Outcome:
    """Every decision of one reconcile of the job in `snap` (see the module docstring)."""
    owner = managed_by(snap.body)
    if owner != MANAGED_BY:
        # Another controller owns it (runPolicy.managedBy, the MPI Operator's rule): no child,
        # no status write, not even observedGeneration; one INFO line says why.
        return Outcome(waiting=f"runPolicy.managedBy is {owner}: left to that controller")
    meta = snap.body["metadata"]
    old = snap.body.get("status") or {}
    st = _Status(old, meta.get("generation"), now)
    plan = _Plan(snap, cfg, now)
    if isinstance(old.get("restarts"), int):  # written before restarts had two counters
        st.data["attempt"] = attempt(old)
        st.data["restarts"] = _compact(restart_counts(old))
    finalizers = tuple(meta.get("finalizers") or ())
    if LEGACY_FINALIZER in finalizers:
        plan.out.actions.append(DropFinalizer(Ref.of(snap.body), finalizers, LEGACY_FINALIZER,
                                              meta.get("resourceVersion", "")))
    _take_checkpoint(snap, cfg, st)  # first: pods created in this pass resume from it
    _decide(plan, st)
    _show_metrics(snap, st)
    st.data["observedGeneration"] = meta.get("generation")
    out = plan.out
    out.status = st.data
    out.events = _events(old.get("conditions"), st.data.get("conditions")) + out.events
    return out


def _show_metrics(snap: JobSnapshot, st: _Status) -> None:
    """The log shipper's latest report into `status.metrics`, and what it says of progress
    (percent, throughput, ETA: progress.py) into `status.progress`, for people, `trainop get`
    and kubectl's columns. Display only: the shipper writes its own ConfigMap, never this job's
    status, and nothing decided here reads `metrics` or `progress` (docs/security.md). Copied
    also once the job is over, since the final report may land after the launcher completed;
    an ETA only while the job runs."""
    metrics = logship.progress_metrics(snap.progress)
    if metrics is not None:
        st.data["metrics"] = metrics
        shown = progress.compute(metrics, running=st.data.get("phase") == "Running")
        if shown is not None:
            st.data["progress"] = shown
        else:
            st.data.pop("progress", None)


def _take_checkpoint(snap: JobSnapshot, cfg: Config, st: _Status) -> None:
    """The checkpoint the log shipper reported (resume.accept: only one in this job's own
    location) into `status.checkpoint`, which the next attempt resumes from (resume.plan). A
    refused report leaves the known one in place and says why (a Warning, once per reason)."""
    try:
        job = parse_cached(snap.body, cfg)
    except SpecError:
        return
    if job.checkpoint is None:
        return
    found, refused = resume.accept(job, snap.progress)
    if refused:
        st.cond("CheckpointAccepted", False, "CheckpointRejected", refused)
    elif found:
        st.data["checkpoint"] = found
        if conditions.get_condition(st.data.get("conditions"), "CheckpointAccepted"):
            st.cond("CheckpointAccepted", True, "CheckpointReported",
                    f"step {found['step']} at {found['url']}")


def _decide(plan: _Plan, st: _Status) -> Outcome:
    body, cfg, now = plan.body, plan.cfg, plan.now
    # A job that failed validation may be fixed by editing it: judge the new generation afresh.
    failed = conditions.get_condition(st.data.get("conditions"), "Failed")
    if failed and failed.get("reason") == "InvalidSpec" and \
            st.data.get("observedGeneration") != body["metadata"].get("generation"):
        st.data = {}

    ttl = ((body.get("spec") or {}).get("runPolicy") or {}).get("ttlSecondsAfterFinished")
    if st.data.get("phase") in TERMINAL and plan.snap.kueue:
        _kueue_finish(plan, st)
    if st.data.get("phase") in TERMINAL and st.data.get("cleanedUp") and ttl is None:
        return plan.out  # finished, cleaned, kept: nothing to look at (not even a parse)

    try:
        job = parse_cached(body, cfg)
        # The class is judged until the job is admitted; after that, one deleted or capped
        # since stops nothing.
        job, prio = priority.for_job(job, plan.snap.classes, cfg, plan.snap.kueue, strict=(
            st.data.get("phase") not in TERMINAL and not st.is_true("Admitted")))
    except SpecError as exc:
        if st.data.get("phase") not in TERMINAL:
            _finish(st, "Failed", "InvalidSpec", str(exc), now)
        return plan.out
    job = _fallen_back(job, st)
    job = podgroup.bind(job, plan.snap.gang_scheduler, cfg)

    rp = job.run_policy
    if st.data.get("phase") in TERMINAL:
        if not st.data.get("cleanedUp") and _stop(plan, rp.clean_pod_policy) == 0:
            st.data["cleanedUp"] = True
        if rp.ttl_seconds_after_finished is not None and st.data.get("completionTime"):
            left = (conditions.parse_time(st.data["completionTime"])
                    + dt.timedelta(seconds=rp.ttl_seconds_after_finished) - now).total_seconds()
            if left <= 0:
                plan.out.delete_self = True
            else:
                plan.out.requeue_after = left
                return plan.wait(f"deleting the job in {left:.0f}s (TTL)")
        return plan.out

    st.data["gpus"] = job.total_gpus
    if rp.active_deadline_seconds and st.data.get("startTime"):
        ran = (now - conditions.parse_time(st.data["startTime"])).total_seconds()
        if ran >= rp.active_deadline_seconds:
            _finish(st, "Failed", "DeadlineExceeded",
                    f"the job ran {ran:.0f}s, longer than runPolicy.activeDeadlineSeconds="
                    f"{rp.active_deadline_seconds}", now)
            _stop(plan, rp.clean_pod_policy)
            return plan.out
        plan.out.requeue_after = rp.active_deadline_seconds - ran  # the deadline's exact moment

    if rp.suspend:
        return _suspend(plan, job, st)
    if st.is_true("Suspended"):
        st.cond("Suspended", False, "JobResumed", "the gang starts again")
        st.data.pop("startTime", None)

    if plan.snap.kueue:
        stopping = _kueue_evicted(plan, job, st)
        if stopping is not None:
            return stopping

    claim = _data_claim(plan.snap.stage, job, st, plan.snap.pods)
    if claim is False:
        return plan.wait("waiting for data")

    if not st.is_true("Created"):  # an autoscaled pool is judged at maxNodes (spec.py)
        problem = capacity_error(job, plan.snap.nodes)
        if isinstance(problem, NoMatchingNodes):
            st.cond("Created", False, "NoMatchingNodes", str(problem))
            st.phase("Pending")
            return plan.wait(str(problem))
        if problem:
            _finish(st, "Failed", "Unsatisfiable", str(problem), now)
            return plan.out
    if plan.snap.kueue:
        stale = _kueue_workload_stale(plan, job, prio, st)
        if stale is not None:
            return stale
    if not st.is_true("Admitted"):  # the whole gang fits the quotas, or no child is made
        decision = _admission(plan, job, prio)
        if decision is None:  # the controller asks the native queue and decides again
            plan.out.asks = job
            return plan.out
        if decision.outcome == "Unsatisfiable":
            _finish(st, "Failed", "Unsatisfiable", decision.message, now)
            return plan.out
        if not decision.admitted and \
                conditions.get_condition(st.data.get("conditions"), "Admitted") is None:
            plan.out.events.append(("Normal", decision.reason, decision.message))
        st.cond("Admitted", decision.admitted, decision.reason, decision.message)
        if not decision.admitted:
            st.phase("Queued")
            return plan.wait(decision.message)
    if plan.snap.kueue:
        placed = _kueue_placement(plan, job, st)
        if not isinstance(placed, Job):
            return placed
        job = placed
    problem = plan.snap.problem
    if problem and problem.reason == "ChildRejected":  # fails, so the gate frees its quota
        _finish(st, "Failed", "ChildRejected", problem.message, now)
        return plan.out
    if problem and problem.reason == "PodSecurity":  # waits: an admin may relabel the namespace
        st.cond("Created", False, "PodSecurityForbidden", problem.message)
        st.phase("Pending")
        return plan.wait(problem.message)
    conflict = (problem.message if problem else None) or _foreign_child(plan)
    if conflict:
        st.cond("Created", False, "NameConflict", conflict)
        st.phase("Pending")
        return plan.wait(conflict)
    # The pods' isolation is kept in shape always (free while unchanged: see apply.py) ...
    plan.out.actions.append(Apply(render.render_network_policy(job), plan.body,
                                  _version(plan.snap.network_policy)))
    # ... the rest only when a (re)start needs it: while the gang runs, mpirun has read it.
    if not st.is_true("Running"):
        _shared_children(plan, job)
    st.cond("Created", True, "ChildrenCreated",
            "Service, hostfile and SSH key created" if job.launcher == "mpi"
            else "Service created")
    return _run_gang(plan, job, st, claim)


def _admission(plan: _Plan, job: Job, prio: priority.Priority) -> Decision | None:
    """Kueue's answer from the cached Workload (a missing one is created here, as an action),
    or the native queue's, which the controller asked before this decide (None: not yet)."""
    if not plan.snap.kueue:
        return plan.snap.admission
    if plan.snap.workload is None:
        queue = (plan.body.get("spec") or {}).get("queue")
        plan.out.actions.append(Create(kueue.render_workload(job, queue, prio), plan.body))
    return kueue.decide(job, plan.body, plan.snap.workload)


def _kueue_workload_stale(plan: _Plan, job: Job, prio: priority.Priority,
                          st: _Status) -> Outcome | None:
    """The shape is frozen from admission on (the CRD's rule); a job edited before its
    admission was written, or while queued, must never run on the room Kueue reserved for its
    old shape: its Workload is deleted before any pod exists, the job queues again, and the
    next reconcile creates a Workload of its new shape (Kueue's ensureOneWorkload)."""
    wl = plan.snap.workload
    if wl is None or plan.snap.pods or plan.snap.launcher:
        return None
    if wl["metadata"].get("deletionTimestamp"):  # never admitted on a Workload going away
        st.phase("Queued")
        return plan.wait(f"waiting for Workload {wl['metadata']['name']} to be deleted")
    why = kueue.mismatch(job, prio, wl)
    if why is None:
        return None
    plan.out.actions += kueue.release_actions(wl)
    if st.is_true("Admitted"):
        st.cond("Admitted", False, "WorkloadMismatch", f"{why}; a new Workload queues")
    st.phase("Queued")
    return plan.wait(f"{why}: replacing the Workload")


def _suspend(plan: _Plan, job: Job, st: _Status) -> Outcome:
    pods, launcher = plan.snap.pods, plan.snap.launcher
    if launcher and not launcher["metadata"].get("deletionTimestamp"):
        plan.delete(launcher)
    _delete_pods(plan, pods)
    if st.is_true("Admitted"):  # resuming asks for admission again
        st.cond("Admitted", False, "JobSuspended", "suspended: its quota is free for others")
    st.cond("Suspended", True, "JobSuspended",
            "runPolicy.suspend is true: pods deleted; Secret, hostfile and Service kept")
    if conditions.get_condition(st.data.get("conditions"), "Running"):
        st.cond("Running", False, "JobSuspended", "suspended")
    st.phase("Suspended")
    st.data["workers"] = {"ready": 0, "total": job.workers, "summary": f"0/{job.workers}"}
    plan.out.requeue_after = None  # no deadline runs while suspended
    if pods or launcher:
        return plan.wait("waiting for the suspended gang's pods to go")
    if plan.snap.kueue:  # only now: a terminating pod still holds its GPUs
        plan.out.actions += kueue.release_actions(plan.snap.workload)
    return plan.out


def _kueue_finish(plan: _Plan, st: _Status) -> None:
    """The ended job gives its Workload's quota back (Finished, finalizer dropped) once no pod
    of it holds resources: a terminating pod, or a worker cleanPodPolicy keeps running, still
    holds its GPUs, so Kueue must not hand them to another job yet."""
    if any(p.get("status", {}).get("phase") not in TERMINAL for p in plan.snap.pods):
        return
    plan.out.actions += kueue.finish_actions(plan.snap.workload,
                                             st.data.get("phase") == "Succeeded", st.stamp)


def _kueue_admitted(st: _Status) -> bool:
    cond = conditions.get_condition(st.data.get("conditions"), "Admitted")
    return bool(cond) and cond.get("status") == "True" and cond.get("reason") == "KueueAdmitted"


def _kueue_evicted(plan: _Plan, job: Job, st: _Status) -> Outcome | None:
    """Kueue evicted or preempted the job's Workload (or withdrew its admission): stop the
    gang and queue again, as Kueue's jobframework stops the kinds it knows. Not a restart: no
    runPolicy.backoffLimit is used and the attempt stays; `evictions` counts them. Once every pod
    is gone the Workload's quota reservation is released (kueue.requeue_patch) and the job
    waits at the gate (WaitingForKueue) until Kueue admits it again. None: nothing to stop."""
    wl = plan.snap.workload
    if _kueue_admitted(st):
        why = kueue.stop_reason(wl)
        if why is None:
            return None
        reason, message = why
        queue = (plan.body.get("spec") or {}).get("queue")
        again = f"the job waits in LocalQueue {queue} to be admitted again"
        st.cond("Evicted", True, reason, f"{message}; the gang is stopped and {again}")
        st.cond("Admitted", False, "WaitingForKueue", f"stopped ({reason}); {again}")
        for type_ in ("Running", "WorkersReady"):
            if conditions.get_condition(st.data.get("conditions"), type_):
                st.cond(type_, False, reason, "stopped by Kueue")
        st.data["evictions"] = int(st.data.get("evictions") or 0) + 1
        st.data.pop("startTime", None)  # the next run's deadline counts from its own start
    elif not st.is_true("Evicted") or st.is_true("Admitted"):
        return None
    pods, launcher = plan.snap.pods, plan.snap.launcher
    if launcher and not launcher["metadata"].get("deletionTimestamp"):
        plan.delete(launcher)
    _delete_pods(plan, pods)
    st.phase("Queued")
    st.data["workers"] = {"ready": 0, "total": job.workers, "summary": f"0/{job.workers}"}
    if pods or launcher:
        return plan.wait("waiting for the evicted gang's pods to go")
    patch = kueue.requeue_patch(wl, st.stamp)
    if patch is not None:
        plan.out.actions.append(PatchStatus(Ref.of(wl), patch))
    return None  # on to the gate: queued until Kueue admits the Workload again


def _kueue_placement(plan: _Plan, job: Job, st: _Status) -> Job | Outcome:
    """The admitted job with its flavors' nodeSelector and tolerations (kueue.place); a job
    re-admitted after an eviction says so."""
    if st.is_true("Evicted"):
        st.cond("Evicted", False, "Readmitted", "Kueue admitted the Workload again")
    try:
        return kueue.place(job, plan.snap.workload or {}, plan.snap.flavors)
    except (kueue.FlavorMissing, SpecError) as exc:
        if st.is_true("Running"):  # it started on its flavors; an edit since is Kueue's next
            return job             # admission's business (its pods keep their placement)
        if isinstance(exc, SpecError):
            _finish(st, "Failed", "FlavorConflict", str(exc), plan.now)
            return plan.out
        why = f"waiting for ResourceFlavor {exc.args[0]}, which Kueue admitted the job on"
        st.cond("Created", False, "WaitingForResourceFlavor", why)
        st.phase("Starting")
        return plan.wait(why)


def _data_claim(stage: dict | None, job: Job, st: _Status, pods: list[dict]):
    """The DataStage's claim name, None for synthetic data, False while waiting.

    A job starts only on a Ready DataStage. Once it has started (DataReady was True), it keeps
    the claim it started with whatever happens to the DataStage afterwards (its Secret deleted,
    its spec edited and copying again, Failed, even deleted: the claim stays while pods use
    it), so a running job is never frozen and a restart of its gang mounts the same claim. A job
    that has not started yet waits for Ready again, so it never begins on a share being
    rewritten."""
    if not job.data_stage:
        return None
    field_ = "spec.data.dataStageRef.name"
    phase = ((stage or {}).get("status") or {}).get("phase") or ("Pending" if stage else "gone")
    if st.is_true("DataReady") and phase != "Ready":
        claim = ((stage or {}).get("status") or {}).get("claimName") or _mounted_claim(pods)
        if claim:
            st.cond("DataReady", True, "DataStageChanged",
                    f"DataStage {job.data_stage} is {phase}; this job keeps claim {claim}, which "
                    f"it started with (new jobs wait until the DataStage is Ready)")
            return claim
    if stage is None:
        st.cond("DataReady", False, "DataStageNotFound",
                f"{field_}: DataStage {job.data_stage!r} does not exist in namespace "
                f"{job.namespace}; create it or fix the name")
    else:
        phase = (stage.get("status") or {}).get("phase") or "Pending"
        claim = (stage.get("status") or {}).get("claimName")
        if phase == "Ready" and claim:
            st.cond("DataReady", True, "DataStageReady",
                    f"DataStage {job.data_stage} is Ready; claim {claim} mounted read-only at "
                    f"{job.data_mount_path}")
            return claim
        st.cond("DataReady", False,
                "DataStageFailed" if phase == "Failed" else "WaitingForDataStage",
                f"DataStage {job.data_stage} is {phase}; the job starts when it is Ready")
    st.phase("Staging" if stage is not None else "Pending")
    return False


def _mounted_claim(pods: list[dict]) -> str | None:
    """The data claim a pod of this job mounts (when the DataStage no longer says it)."""
    for pod in pods:
        for volume in (pod.get("spec") or {}).get("volumes") or []:
            if volume.get("name") == "data" and volume.get("persistentVolumeClaim"):
                return volume["persistentVolumeClaim"].get("claimName")
    return None


def _controlled(obj: dict, body: dict) -> bool:
    uid = body["metadata"].get("uid")
    return any(ref.get("controller") and ref.get("uid") == uid
               for ref in obj["metadata"].get("ownerReferences") or [])


def _foreign_child(plan: _Plan) -> str | None:
    """A child's name taken by an object this job does not control (never adopted)."""
    snap = plan.snap
    for obj in (snap.service, snap.config_map, snap.network_policy):
        if obj is not None and not _controlled(obj, snap.body):
            meta = obj["metadata"]
            return (f"{obj.get('kind', 'object')} {meta.get('namespace')}/{meta['name']} already "
                    f"exists and is not controlled by this job; delete or rename it")
    return None


def _version(obj: dict | None) -> str:
    return (obj or {}).get("metadata", {}).get("resourceVersion", "") if obj else ""


def _shared_children(plan: _Plan, job: Job) -> None:
    snap, body, acts = plan.snap, plan.body, plan.out.actions
    acts.append(Apply(render.render_service(job), body, _version(snap.service)))
    pod_group = podgroup.render_for(job)
    if pod_group is not None:  # before any pod of the group; put back if deleted
        acts.append(Apply(pod_group, body, _version(snap.pod_group)))
    for obj in logship.rbac(job, job.logship):
        acts.append(Apply(obj, body, None))  # kinds the operator does not watch
    progress = logship.progress_config_map(job, job.logship)
    if progress is not None and snap.progress is None:
        acts.append(Create(progress, body))  # created once: its data is the shipper's
    if job.launcher != "mpi":
        return
    acts.append(Apply(render.render_config_map(job), body, _version(snap.config_map)))
    if not snap.ssh_secret:  # generated once: a new key on every reconcile would break the gang
        acts.append(CreateSSHSecret(job, body))


def _endpoints_published(job: Job, slices: list[dict]) -> bool:
    """The headless Service's EndpointSlices list every worker, ready, with its hostname:
    exactly what cluster DNS serves for host(job, i)."""
    service = render.service_name(job)
    published = {ep.get("hostname") for s in slices
                 if (s["metadata"].get("labels") or {}).get("kubernetes.io/service-name") == service
                 for ep in s.get("endpoints") or []
                 if (ep.get("conditions") or {}).get("ready") and ep.get("addresses")}
    return all(render.worker_name(job, i) in published for i in range(job.workers))


def _run_gang(plan: _Plan, job: Job, st: _Status, claim) -> Outcome:
    body, now = plan.body, plan.now
    attempt_ = attempt(st.data)
    st.data.setdefault("attempt", attempt_)
    st.data.setdefault("restarts", {"failures": 0, "disruptions": 0})
    pods, launcher = plan.snap.pods, plan.snap.launcher
    label = common.LABEL_ATTEMPT
    stale = [p for p in pods if p["metadata"]["labels"].get(label) != str(attempt_)]
    stale_launcher = launcher is not None and \
        launcher["metadata"].get("labels", {}).get(label) != str(attempt_)
    if stale or stale_launcher:  # the previous attempt must be gone before names are reused
        if stale_launcher and not launcher["metadata"].get("deletionTimestamp"):
            plan.delete(launcher)
        _delete_pods(plan, stale)
        st.phase("Starting")
        return plan.wait("waiting for the previous attempt's pods to go")

    workers = {int(p["metadata"]["labels"][common.LABEL_INDEX]): p for p in pods
               if p["metadata"]["labels"].get(common.LABEL_ROLE) == render.WORKER}
    launched = launcher is not None or (job.launcher == "torchrun" and st.is_true("Running"))
    failures = _gang_failures(plan, job, workers, launched, attempt_)
    if job.preflight.enabled or job.infiniband:
        outcome = _fabric(plan, job, st, workers, attempt_, failures)
        if outcome is not None:
            return outcome
    if failures:
        return _gang_failed(plan, job, st, failures[0])

    if job.launcher == "mpi" and _launcher_outcome(launcher) == "Complete" or \
            job.launcher == "torchrun" and len(workers) == job.workers and \
            all(p.get("status", {}).get("phase") == "Succeeded" for p in workers.values()):
        _finish(st, "Succeeded", "JobSucceeded",
                "the launcher completed" if job.launcher == "mpi" else "every worker completed",
                now)
        _stop(plan, job.run_policy.clean_pod_policy)
        plan.out.requeue_after = None
        return plan.out
    if launched:  # after success: a job that completed is not failed for its transport
        if job.launcher == "mpi":  # the launcher's pod may wait for room too
            for_nodes, timed_out = _nodes_waiting(plan, job, st, workers)
            if timed_out:
                return plan.out
            plan.out.waiting = for_nodes
        stopped = _training_transport(plan, job, st)
        if stopped is not None:
            return stopped

    resume_from = resume.plan(job, st.data.get("checkpoint"))
    for i in range(job.workers):
        if i not in workers:
            plan.out.actions.append(Create(render.render_worker(job, i, attempt_, claim, resume_from), body))
    if "startTime" not in st.data:
        st.data["startTime"] = _ts(now)
        if job.run_policy.active_deadline_seconds:
            plan.out.requeue_after = float(job.run_policy.active_deadline_seconds)
    st.data.update(logship.status_urls(job, attempt_, job.logship))
    ready = sum(1 for p in workers.values() if _pod_ready(p))
    st.data["workers"] = {"ready": ready, "total": job.workers,
                          "summary": f"{ready}/{job.workers}"}
    if plan.snap.kueue:
        _report_pods_ready(plan, job, ready)
    if not launched:
        st.phase("Starting")
        for_nodes, timed_out = _nodes_waiting(plan, job, st, workers)
        if timed_out:
            return plan.out
        waiting = _gang_waiting(plan, job, st, ready)
        if waiting:
            return plan.wait(for_nodes or waiting)
        if job.launcher == "mpi":
            plan.out.actions.append(Create(render.render_launcher(job, attempt_, resume_from), body))
    # Asserted on every pass (idempotent), so an operator that died between creating the
    # launcher and writing the status still records the transition after its restart.
    if ready == job.workers:
        st.cond("WorkersReady", True, "AllWorkersReady",
                f"{job.workers}/{job.workers} workers ready and resolvable")
    if st.is_true("Restarting"):
        st.cond("Restarting", False, "GangRestarted", f"attempt {attempt_} is running")
    st.cond("Running", True, "LauncherCreated" if job.launcher == "mpi" else "WorkersRunning",
            f"{job.total_slots} ranks on {job.workers} workers (attempt {attempt_})")
    st.phase("Running")
    return plan.out


def _report_pods_ready(plan: _Plan, job: Job, ready_workers: int) -> None:
    """Kueue's PodsReady on the Workload: every pod of the gang Ready (or done), the MPI
    launcher's included, as the jobframework reports it for an MPIJob."""
    ready = ready_workers == job.workers
    if ready and job.launcher == "mpi":
        ready = any(p["metadata"]["labels"].get(common.LABEL_ROLE) == render.LAUNCHER and
                    (_pod_ready(p) or p.get("status", {}).get("phase") == "Succeeded")
                    for p in plan.snap.pods)
    patch = kueue.pods_ready_patch(plan.snap.workload, ready, _ts(plan.now))
    if patch is not None:
        plan.out.actions.append(PatchStatus(Ref.of(plan.snap.workload), patch))


def _gang_waiting(plan: _Plan, job: Job, st: _Status, ready: int) -> str | None:
    """None when every worker is Ready and, for ssh, published in DNS; else what it waits for
    (and the WorkersReady condition says so)."""
    if ready < job.workers:
        st.cond("WorkersReady", False, "WaitingForWorkers",
                f"{ready}/{job.workers} workers ready")
        return f"{ready}/{job.workers} workers ready"
    if job.launcher == "mpi" and not _endpoints_published(job, plan.snap.endpoint_slices):
        st.cond("WorkersReady", False, "WaitingForDNS",
                "every worker is Ready; waiting for their DNS names (EndpointSlices)")
        return "waiting for the workers' DNS names"
    return None


def _launcher_failure(job: Job, pods: list[dict]) -> Failure:
    for pod in pods:
        if pod["metadata"]["labels"].get(common.LABEL_ROLE) == render.LAUNCHER:
            failure = pod_failure(pod, job.placement.spot)
            if failure:
                return failure
    return Failure(render.launcher_name(job), render.LAUNCHER, None, "LauncherFailed")


def _gang_failures(plan: _Plan, job: Job, workers: dict[int, dict], launched: bool,
                   attempt_: int) -> list[Failure]:
    """The failures of this attempt, the cause first: a disruption anywhere in the gang
    (its peers' exits are its consequence: NCCL or mpirun lose a rank), else the first to
    finish. Before launch a disrupted pod is simply recreated, which is no failure."""
    spot = job.placement.spot
    failures = [f for p in workers.values() if (f := pod_failure(p, spot))
                and (launched or not f.disruption or (p.get("status") or {}).get("phase") == "Failed")]
    if launched:
        departed = {p["metadata"]["name"]: p for p in plan.snap.departed
                    if p["metadata"].get("labels", {}).get(common.LABEL_ATTEMPT) == str(attempt_)}
        for i in range(job.workers):
            pod = workers.get(i)
            if pod is None or pod["metadata"].get("deletionTimestamp"):
                name = render.worker_name(job, i)
                last = pod or departed.get(name)
                known = pod_failure(last, spot) if last else None
                if known is None:
                    known = Failure(name, render.WORKER, None, "PodDeleted",
                                    node=((last or {}).get("spec") or {}).get("nodeName") or "")
                if all(f.pod != name for f in failures):
                    failures.append(known)
            elif job.launcher == "mpi" and pod.get("status", {}).get("phase") == "Succeeded":
                failures.append(Failure(pod["metadata"]["name"], render.WORKER, 0,
                                        "WorkerExited"))
    failures.sort(key=lambda f: (not f.disruption, f.finished or "~"))
    if job.launcher == "mpi" and _launcher_outcome(plan.snap.launcher) == "Failed":
        failures.append(_launcher_failure(job, plan.snap.pods))
    return failures


def _fabric(plan: _Plan, job: Job, st: _Status, workers: dict[int, dict], attempt: int,
            failures: list[Failure]) -> Outcome | None:
    """The preflight's report (render/fabric.py, preflight.py): status.preflight, the Transport
    condition, and on a failed check the uncounted restart after tainting the slow node. None:
    carry on."""
    rep = preflight.report(workers.get(0), job.workers)
    if rep is None:
        return _await_report(plan, workers, failures)
    threshold = job.preflight.min_busbw
    verdict = preflight.judge(rep, threshold, workers)
    stopped = _transport(plan, job, st, rep.transport, f"preflight of attempt {attempt}",
                         gloo=rep.backend == "gloo")
    if stopped is not None:
        return stopped
    # Uncounted only when the slow node is out of the next attempt's way, and at most once per
    # worker: a gang that keeps failing after that has a problem no taint fixes.
    uncounted = (not verdict.passed and verdict.node is not None
                 and job.fabric.taint_unhealthy_nodes
                 and restart_counts(st.data)["unhealthyNodes"] < job.workers)
    if not verdict.passed and verdict.node is not None and not uncounted:
        why = "the operator's preflight.taintUnhealthyNodes is false" \
            if not job.fabric.taint_unhealthy_nodes else \
            f"{job.workers} uncounted restarts were used"
        verdict = preflight.Verdict(False, verdict.suspect, verdict.node,
                                    f"{verdict.message}; node not tainted ({why})")
    st.data["preflight"] = preflight.status(rep, verdict, threshold, attempt, tainted=uncounted)
    if verdict.passed:
        return None
    if uncounted:
        plan.out.actions.append(TaintNode(verdict.node, preflight.TAINT))
    pod0 = render.worker_name(job, 0)
    cause = next((f for f in failures if f.pod == pod0 and f.container == "preflight"), None)
    failure = Failure(pod0, "preflight", cause.exit_code if cause else None, "FabricCheckFailed",
                      cause.finished if cause else "", node=verdict.node or "",
                      cause="UnhealthyNode" if uncounted else "", detail=verdict.message)
    if uncounted:  # the node is out of the next attempt's way: the cluster's fault, not the job's
        return restart_gang(plan, job, st, failure, counted=False)
    return _gang_failed(plan, job, st, failure)


def _await_report(plan: _Plan, workers: dict[int, dict], failures: list[Failure]) -> Outcome | None:
    """Another worker's preflight ended first: every rank learns the verdict at the same
    collective, but the containers end moments apart (seen on real pods), and the verdict is in
    worker 0's. Judging now would take a slow node for an ordinary (counted) failure, so wait for
    worker 0's to end, its pod's update wakes the job, at most REPORT_GRACE_SECONDS after the
    first one. None: nothing to wait for (worker 0's ended without a report, or it is gone)."""
    first = next((f for f in failures if f.container == preflight.CONTAINER), None)
    worker0 = workers.get(0)
    if first is None or worker0 is None or worker0["metadata"].get("deletionTimestamp") \
            or preflight.terminated(worker0) is not None:
        return None
    try:
        waited = (plan.now - conditions.parse_time(first.finished)).total_seconds()
    except ValueError:
        return None
    left = REPORT_GRACE_SECONDS - waited
    if left <= 0:
        return None
    plan.out.requeue_after = min(plan.out.requeue_after or left, left)
    return plan.wait(f"pod {first.pod}'s preflight ended (exit code {first.exit_code}); waiting "
                     f"up to {left:.0f}s for worker 0's, which carries the verdict")


def _transport(plan: _Plan, job: Job, st: _Status, transport: str, source: str,
               gloo: bool = False) -> Outcome | None:
    """Condition Transport from the network NCCL chose (IB, Socket or unknown), as the
    preflight or the trainer reported it (`source` says which). Both are job-side input: what
    they can do is limited to this job, a Warning Event when an InfiniBand job runs on sockets,
    or, where the admin set infiniband.socketTransport: fail, failing it. None: carry on."""
    wanted = "IB" if job.infiniband else "Socket"
    if transport == "Socket" and job.infiniband:
        message = (f"NCCL chose sockets, not InfiniBand, on an InfiniBand job ({source}): check "
                   f"the RDMA device plugin, memlock and NCCL_IB_HCA on the nodes")
        if job.fabric.socket_transport == "fail":
            st.cond("Transport", False, "Socket", message)
            _finish(st, "Failed", "SocketTransport",
                    message + "; the operator's infiniband.socketTransport is fail", plan.now)
            _stop(plan, job.run_policy.clean_pod_policy)
            plan.out.requeue_after = None
            return plan.out
    else:
        message = f"Gloo uses TCP sockets ({source})" if gloo else f"NCCL uses {transport} ({source})"
    st.cond("Transport", transport in (wanted, "unknown"),
            transport if transport != "unknown" else "Unknown", message)
    return None


def _training_transport(plan: _Plan, job: Job, st: _Status) -> Outcome | None:
    """The network NCCL chose during training: the trainer's metrics key `transport`, from the
    log shipper's progress ConfigMap (checked by logship.progress_metrics; only NCCL runs report
    it, so a CPU job says nothing here). Read while the gang runs; it overrides the preflight's
    word, since it is what the training itself uses. The ConfigMap keeps the latest report of
    any attempt, so the message does not claim one."""
    transport = (logship.progress_metrics(plan.snap.progress) or {}).get("transport")
    if transport is None:
        return None
    return _transport(plan, job, st, transport, "the trainer's report")


def _gang_failed(plan: _Plan, job: Job, st: _Status, failure: Failure) -> Outcome:
    action, rule = action_for(failure, job.run_policy.failure_rules)
    if action == FAIL_JOB:
        st.data["lastFailure"] = failure.as_status()
        _finish(st, "Failed", "FailurePolicy",
                f"{failure.describe()}; runPolicy.failurePolicy.rules[{rule}] says FailJob",
                plan.now)
        _stop(plan, job.run_policy.clean_pod_policy)
        plan.out.requeue_after = None
        return plan.out
    return restart_gang(plan, job, st, failure, counted=action == RESTART)


def restart_gang(plan: _Plan, job: Job, st: _Status, failure: Failure, counted: bool) -> Outcome:
    """THE restart path: tear the gang down and start attempt + 1 (later reconciles delete
    the old attempt's pods, then create the new ones). `counted`: whether it uses one of
    runPolicy.backoffLimit's restarts (a failure of the job) or not (a disruption, an
    unhealthy node: the cluster's fault). A counted restart past the limit fails the job.
    Status: restarts.failures or .disruptions (+ spotEvictions) up by one, the cause into
    restarts.history (newest HISTORY) and lastFailure, the Restarting condition names the pod,
    the node and the cause."""
    counts = restart_counts(st.data)
    limit = job.run_policy.backoff_limit
    st.data["lastFailure"] = failure.as_status()
    if counted and counts["failures"] >= limit:
        _finish(st, "Failed", "BackoffLimitExceeded",
                f"{failure.describe()}; runPolicy.backoffLimit={limit} restarts used", plan.now)
        _stop(plan, job.run_policy.clean_pod_policy)
        plan.out.requeue_after = None
        return plan.out
    counts["failures" if counted else "disruptions"] += 1
    if failure.cause == "SpotEviction":
        counts["spotEvictions"] += 1
    if failure.cause == "UnhealthyNode":  # a preflight tainted the node (at most one per worker)
        counts["unhealthyNodes"] += 1
    next_attempt = attempt(st.data) + 1
    counts["history"] = (counts["history"] + [{
        "attempt": next_attempt, "time": _ts(plan.now), "cause": failure.cause,
        "counted": counted, "pod": failure.pod, "node": failure.node,
        "message": failure.describe()}])[-HISTORY:]
    st.data["restarts"] = _compact(counts)
    st.data["attempt"] = next_attempt
    used = (f"restart {counts['failures']} of backoffLimit {limit}" if counted else
            f"{'a disruption' if failure.disruption else failure.cause}: not counted against "
            f"backoffLimit ({counts['failures']} of {limit} used)")
    where = ""
    if job.fallback and failure.cause == "SpotEviction" and \
            counts["spotEvictions"] == job.fallback.after:
        where = f"; next attempt on node pool {job.fallback.placement.pool!r} (nodePool.fallback)"
    st.cond("Restarting", True, "GangRestart",
            f"{failure.describe()}; restarting the gang as attempt {next_attempt} ({used}){where}")
    st.cond("WorkersReady", False, "GangRestart", "the gang is being recreated")
    if st.is_true("WaitingForNodes"):
        st.cond("WaitingForNodes", False, "GangRestart", "the gang is being recreated")
    if conditions.get_condition(st.data.get("conditions"), "Running"):
        st.cond("Running", False, "GangRestart", failure.describe())
    st.phase("Starting")
    return plan.wait("restarting the gang")


def _compact(counts: dict) -> dict:
    """status.restarts as written: both counters always, the rest once it has something."""
    return {k: v for k, v in counts.items() if v or k in ("failures", "disruptions")}


def _fallen_back(job: Job, st: _Status) -> Job:
    """The job as this attempt runs it: on spec.nodePool.fallback's pool once the spot pool
    took back its nodes afterSpotEvictions times (status.nodePool says which)."""
    fb = job.fallback
    if fb is not None and restart_counts(st.data)["spotEvictions"] >= fb.after:
        job = dataclasses.replace(job, placement=fb.placement)
    if job.placement.pool:
        st.data["nodePool"] = job.placement.pool
    return job


def _unschedulable(pod: dict) -> bool:
    return not (pod.get("spec") or {}).get("nodeName") and any(
        c.get("type") == "PodScheduled" and c.get("status") == "False"
        and c.get("reason") == "Unschedulable"
        for c in (pod.get("status") or {}).get("conditions") or [])


def _waiting_since(st: _Status, pending: list[dict], was: bool) -> dt.datetime | None:
    """When the wait for nodes began: the earliest of the scheduler's own word on the pending
    pods (PodScheduled False since ...) and our WaitingForNodes condition. The pods' time keeps
    the deadline (and the condition's text, hence the one INFO line) the same when a reconcile
    reads a status from the cache that does not hold our last write yet."""
    times = [c["lastTransitionTime"] for p in pending
             for c in (p.get("status") or {}).get("conditions") or []
             if c.get("type") == "PodScheduled" and c.get("lastTransitionTime")]
    since = conditions.get_condition(st.data.get("conditions"), "WaitingForNodes") if was else None
    if since and since.get("lastTransitionTime"):
        times.append(since["lastTransitionTime"])
    return min((conditions.parse_time(t) for t in times), default=None)


def _nodes_waiting(plan: _Plan, job: Job, st: _Status,
                   workers: dict[int, dict]) -> tuple[str | None, bool]:
    """(what the gang waits for, timed out). Workers, or the MPI launcher (it goes to the same
    pool), that the scheduler cannot place wait for nodes (an autoscaled pool grows: that is
    the autoscaler's cue); the WaitingForNodes condition says how many nodes are missing, and
    runPolicy.schedulingTimeoutSeconds (counted from when the wait began) fails the job at its
    exact moment if they never come."""
    waiting = [p for p in workers.values() if _unschedulable(p)]
    launcher = [p for p in plan.snap.pods if _unschedulable(p)
                and p["metadata"]["labels"].get(common.LABEL_ROLE) == render.LAUNCHER]
    pending = len(waiting)
    was = st.is_true("WaitingForNodes")
    if not waiting and not launcher:
        if was:
            st.cond("WaitingForNodes", False, "NodesAvailable", "every pod of the gang has a node")
        return None, False
    pool = job.placement
    where = f"node pool {pool.pool!r}" if pool.pool else f"nodeSelector {pool.node_selector}"
    if not pending:
        text = f"the launcher waits for room on {where}: the scheduler finds no node for it"
    elif pool.autoscale:
        gpus = pool.gpus_per_node
        per_node = max(gpus // job.gpus_per_worker, 1) if gpus and job.gpus_per_worker else 1
        missing = -(-pending // per_node)
        text = (f"{pending}/{job.workers} workers wait for nodes of {where}: "
                f"{'' if gpus else 'up to '}{missing} more node{'s' if missing > 1 else ''} "
                f"needed (the pool autoscales to at most {pool.autoscale.max_nodes})")
    else:  # a fixed pool: its nodes are busy (or too few); they wait for room
        text = (f"{pending}/{job.workers} workers wait for room on {where}: the scheduler "
                f"finds no node for them")
    timeout = job.run_policy.scheduling_timeout_seconds
    start = _waiting_since(st, waiting + launcher, was) or plan.now
    if timeout:
        deadline = start + dt.timedelta(seconds=timeout)
        left = (deadline - plan.now).total_seconds()
        if left <= 0:
            _finish(st, "Failed", "SchedulingTimeout",
                    f"{text}; they did not come within runPolicy.schedulingTimeoutSeconds="
                    f"{timeout}: check the pool's autoscaler (quota, VM availability, maxNodes)",
                    plan.now)
            st.cond("WaitingForNodes", False, "SchedulingTimeout", "the job failed")
            _stop(plan, "All" if job.run_policy.clean_pod_policy == "All" else "Running")
            plan.out.requeue_after = None
            return text, True
        plan.out.requeue_after = min(left, plan.out.requeue_after or left)
        text += f"; the job fails at {_ts(deadline)} if they do not come (schedulingTimeoutSeconds={timeout})"
    st.cond("WaitingForNodes", True, "WaitingForNodes", text)
    return text, False
