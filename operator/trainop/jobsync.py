"""The decisions of a DistributedTrainingJob's reconcile, in mpi-operator's order: defaults and
parse -> terminal jobs (cleanup, TTL) -> deadline -> suspend -> data -> placement -> Service,
hostfile, SSH Secret (generated once) -> workers -> failures (gang restart or Failed) -> launcher
only when every worker is Ready and published in DNS -> status.

    outcome = jobsync.decide(JobSnapshot(body, pods=..., launcher=...), cfg, now)
    outcome.actions, outcome.status, outcome.events, outcome.requeue_after

Pure: everything comes from the snapshot (the operator's watch caches, controller.py builds it)
and the clock is an argument, so tests/unit/test_jobsync_decide.py feeds tables of snapshots.
Level-based: an interrupted reconcile (operator restart, conflict) re-runs without duplicates.
Children carry the gang attempt (= status.restarts) as a label; a gang restart first bumps the
attempt in status, later reconciles delete the previous attempt's pods and recreate them.
"""

from __future__ import annotations

import copy
import datetime as dt
from collections.abc import Callable
from dataclasses import dataclass, field

from trainop import conditions, phases, priority, resume
from trainop.actions import Apply, Create, CreateSSHSecret, DropFinalizer, Outcome, Problem, Ref, delete
from trainop.admission import Decision
from trainop.config import Config
from trainop.render import common, logship
from trainop.render import dtj as render
from trainop.spec import Job, SpecError, capacity_error, parse_cached

TERMINAL = phases.TERMINAL
# What the timer-based operator put on every job (kopf's, for its timer); nothing needs it now,
# and left in place it would hold a deleted job (and its namespace) until someone removes it.
LEGACY_FINALIZER = "trainop.io/finalizer"
# Conditions whose becoming True (or False, for these gates) is worth a Warning Event.
WARN_TRUE = {"Failed", "Restarting"}
WARN_FALSE = {"Created", "DataReady", "CheckpointAccepted"}


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
    admit: Callable[[Job, priority.Priority], Decision] | None = None  # the gate (gate.py)
    classes: priority.Classes = field(default_factory=priority.Classes)  # cluster-scoped
    kueue: bool = False        # Kueue admits this job (spec.queue and Kueue is installed)
    problem: Problem | None = None                        # what the last apply met (apply.py)


@dataclass
class Failure:
    pod: str
    container: str
    exit_code: int | None
    reason: str
    finished: str = ""

    def describe(self) -> str:
        code = "" if self.exit_code is None else f" exited with code {self.exit_code}"
        return f"pod {self.pod} container {self.container}{code} ({self.reason})"

    def as_status(self) -> dict:
        out = {"pod": self.pod, "container": self.container, "reason": self.reason,
               "message": self.describe()}
        if self.exit_code is not None:
            out["exitCode"] = self.exit_code
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


def pod_failure(pod: dict) -> Failure | None:
    """Why a pod of the gang ended badly, naming its container, exit code and reason."""
    name, st = pod["metadata"]["name"], pod.get("status") or {}
    for cs in st.get("containerStatuses") or []:
        term = (cs.get("state") or {}).get("terminated") or \
            (cs.get("lastState") or {}).get("terminated")
        if term and (term.get("exitCode") or st.get("phase") == "Failed"):
            return Failure(name, cs["name"], term.get("exitCode"),
                           term.get("reason") or "Error", term.get("finishedAt") or "")
    if st.get("phase") == "Failed":  # evicted, node lost: no container state to show
        return Failure(name, (pod["spec"]["containers"][0])["name"], None,
                       st.get("reason") or "Failed", "")
    return None


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
    meta = snap.body["metadata"]
    old = snap.body.get("status") or {}
    st = _Status(old, meta.get("generation"), now)
    plan = _Plan(snap, cfg, now)
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
    """The log shipper's latest report into `status.metrics`, for people and `trainop jobs`.
    Display only: the shipper writes its own ConfigMap, never this job's status, and nothing
    decided here reads `metrics` (docs/security.md). Copied also once the job is over, since
    the final report may land after the launcher completed."""
    metrics = logship.progress_metrics(snap.progress)
    if metrics is not None:
        st.data["metrics"] = metrics


def attempt_of(status: dict) -> int:
    """The gang attempt the status is at (pods carry it as a label; checkpoints are saved per
    attempt). The one place that knows it is `status.restarts`."""
    return int(status.get("restarts") or 0)


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

    claim = _data_claim(plan.snap.stage, job, st, plan.snap.pods)
    if claim is False:
        return plan.wait("waiting for data")

    if not st.is_true("Created"):
        problem = capacity_error(job, plan.snap.nodes)
        if problem and "no node matches" in str(problem):
            st.cond("Created", False, "NoMatchingNodes", str(problem))
            st.phase("Pending")
            return plan.wait(str(problem))
        if problem:
            _finish(st, "Failed", "Unsatisfiable", str(problem), now)
            return plan.out
    if not st.is_true("Admitted"):  # the whole gang fits the quotas, or no child is made
        decision = plan.snap.admit(job, prio)
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
    problem = plan.snap.problem
    if problem and problem.reason == "ChildRejected":  # fails, so the gate frees its quota
        _finish(st, "Failed", "ChildRejected", problem.message, now)
        return plan.out
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
    return plan.out


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
    attempt = attempt_of(st.data)
    pods, launcher = plan.snap.pods, plan.snap.launcher
    label = common.LABEL_ATTEMPT
    stale = [p for p in pods if p["metadata"]["labels"].get(label) != str(attempt)]
    stale_launcher = launcher is not None and \
        launcher["metadata"].get("labels", {}).get(label) != str(attempt)
    if stale or stale_launcher:  # the previous attempt must be gone before names are reused
        if stale_launcher and not launcher["metadata"].get("deletionTimestamp"):
            plan.delete(launcher)
        _delete_pods(plan, stale)
        st.phase("Starting")
        return plan.wait("waiting for the previous attempt's pods to go")

    workers = {int(p["metadata"]["labels"][common.LABEL_INDEX]): p for p in pods
               if p["metadata"]["labels"].get(common.LABEL_ROLE) == render.WORKER}
    launched = launcher is not None or (job.launcher == "torchrun" and st.is_true("Running"))
    failures = [f for f in (pod_failure(p) for p in workers.values()) if f]
    if launched:
        for i in range(job.workers):
            pod = workers.get(i)
            if pod is None or pod["metadata"].get("deletionTimestamp"):
                failures.append(Failure(render.worker_name(job, i), render.WORKER, None,
                                        "PodDeleted"))
            elif job.launcher == "mpi" and pod.get("status", {}).get("phase") == "Succeeded":
                failures.append(Failure(pod["metadata"]["name"], render.WORKER, 0,
                                        "WorkerExited"))
    failures.sort(key=lambda f: f.finished or "~")  # the first to fail is the cause
    if job.launcher == "mpi" and _launcher_outcome(launcher) == "Failed":
        failures.append(_launcher_failure(job, pods))
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

    resume_from = resume.plan(job, st.data.get("checkpoint"))
    for i in range(job.workers):
        if i not in workers:
            plan.out.actions.append(Create(render.render_worker(job, i, attempt, claim, resume_from), body))
    if "startTime" not in st.data:
        st.data["startTime"] = _ts(now)
        if job.run_policy.active_deadline_seconds:
            plan.out.requeue_after = float(job.run_policy.active_deadline_seconds)
    st.data.update(logship.status_urls(job, attempt, job.logship))
    ready = sum(1 for p in workers.values() if _pod_ready(p))
    st.data["workers"] = {"ready": ready, "total": job.workers,
                          "summary": f"{ready}/{job.workers}"}
    if not launched:
        st.phase("Starting")
        waiting = _gang_waiting(plan, job, st, ready)
        if waiting:
            return plan.wait(waiting)
        if job.launcher == "mpi":
            plan.out.actions.append(Create(render.render_launcher(job, attempt, resume_from), body))
    # Asserted on every pass (idempotent), so an operator that died between creating the
    # launcher and writing the status still records the transition after its restart.
    if ready == job.workers:
        st.cond("WorkersReady", True, "AllWorkersReady",
                f"{job.workers}/{job.workers} workers ready and resolvable")
    if st.is_true("Restarting"):
        st.cond("Restarting", False, "GangRestarted", f"attempt {attempt} is running")
    st.cond("Running", True, "LauncherCreated" if job.launcher == "mpi" else "WorkersRunning",
            f"{job.total_slots} ranks on {job.workers} workers (attempt {attempt})")
    st.phase("Running")
    return plan.out


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
            failure = pod_failure(pod)
            if failure:
                return failure
    return Failure(render.launcher_name(job), render.LAUNCHER, None, "LauncherFailed")


def _gang_failed(plan: _Plan, job: Job, st: _Status, failure: Failure) -> Outcome:
    restarts = attempt_of(st.data)
    limit = job.run_policy.backoff_limit
    st.data["lastFailure"] = failure.as_status()
    if restarts >= limit:
        _finish(st, "Failed", "BackoffLimitExceeded",
                f"{failure.describe()}; runPolicy.backoffLimit={limit} restarts used", plan.now)
        _stop(plan, job.run_policy.clean_pod_policy)
        plan.out.requeue_after = None
        return plan.out
    st.data["restarts"] = restarts + 1
    st.cond("Restarting", True, "GangRestart",
            f"{failure.describe()}; restarting the gang (restart {restarts + 1} of {limit})")
    st.cond("WorkersReady", False, "GangRestart", "the gang is being recreated")
    if conditions.get_condition(st.data.get("conditions"), "Running"):
        st.cond("Running", False, "GangRestart", failure.describe())
    st.phase("Starting")
    return plan.wait("restarting the gang")
