"""One reconcile of a DistributedTrainingJob, in mpi-operator's order: defaults and parse ->
terminal jobs (cleanup, TTL) -> deadline -> suspend -> data -> placement -> Service, hostfile,
SSH Secret (generated once) -> workers -> failures (gang restart or Failed) -> launcher only
when every worker is Ready and published in DNS -> status.

Level-based: everything is recomputed from the live objects and the job's status, so an
interrupted reconcile (operator restart, conflict) re-runs without duplicates. Children carry
the gang attempt (= status.restarts) as a label; a gang restart first bumps the attempt in
status, later reconciles delete the previous attempt's pods and recreate them.

`sync()` returns what to write and say; handlers/dtj.py applies it.
"""

from __future__ import annotations

import copy
import datetime as dt
from dataclasses import dataclass, field

from trainop import API_VERSION, conditions, gate, kube, sshkeys
from trainop.config import Config
from trainop.kube import OwnershipError
from trainop.render import common, logship
from trainop.render import dtj as render
from trainop.spec import Job, SpecError, capacity_error, parse

TERMINAL = ("Succeeded", "Failed")
# Conditions whose becoming True (or False, for these gates) is worth a Warning Event.
WARN_TRUE = {"Failed", "Restarting"}
WARN_FALSE = {"Created", "DataReady"}


@dataclass
class Result:
    status: dict
    events: list[tuple[str, str, str]] = field(default_factory=list)  # (type, reason, message)
    wait: str | None = None    # why the job is not settled yet (-> kopf.TemporaryError)
    delay: float | None = None  # when to look again (None: the timer's interval)
    delete_job: bool = False   # ttlSecondsAfterFinished elapsed


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

    def __init__(self, old: dict, generation: int | None):
        self.data = copy.deepcopy(old or {})
        self.generation = generation

    def cond(self, type_: str, status: bool, reason: str, message: str) -> None:
        self.data["conditions"] = conditions.set_condition(
            self.data.get("conditions"), type_, status, reason, message,
            generation=self.generation)

    def is_true(self, type_: str) -> bool:
        return conditions.is_true(self.data.get("conditions"), type_)

    def phase(self, value: str) -> None:
        self.data["phase"] = value


def _now() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


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


def _delete_pods(pods: list[dict], keep=lambda pod: False) -> int:
    n = 0
    for pod in pods:
        if not keep(pod) and not pod["metadata"].get("deletionTimestamp"):
            kube.delete("v1", "Pod", pod["metadata"]["name"], pod["metadata"]["namespace"],
                        uid=pod["metadata"]["uid"])
            n += 1
    return n


def _children(job: Job) -> tuple[list[dict], dict | None]:
    pods = kube.list_objects("v1", "Pod", job.namespace, {common.LABEL_JOB: job.name})
    launcher = kube.get("batch/v1", "Job", render.launcher_name(job), job.namespace) \
        if job.launcher == "mpi" else None
    return pods, launcher


def _stop(job: Job, policy: str, pods: list[dict], launcher: dict | None) -> int:
    """Finish: an active launcher always stops; pods go as cleanPodPolicy says. Returns how
    many deletions it had to issue (0: nothing left to clean)."""
    issued = 0
    if launcher and not launcher["metadata"].get("deletionTimestamp") and \
            (policy == "All" or _launcher_outcome(launcher) is None):
        issued += kube.delete("batch/v1", "Job", launcher["metadata"]["name"], job.namespace,
                              uid=launcher["metadata"]["uid"])
    if policy == "All":
        issued += _delete_pods(pods)
    elif policy == "Running":
        issued += _delete_pods(pods, keep=lambda p: p.get("status", {}).get("phase") in TERMINAL)
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


def sync(body: dict, cfg: Config, now: dt.datetime | None = None) -> Result:
    now = now or _now()
    meta = body["metadata"]
    old = body.get("status") or {}
    st = _Status(old, meta.get("generation"))
    result = _sync(body, cfg, st, now)
    st.data["observedGeneration"] = meta.get("generation")
    result.status = st.data
    result.events = _events(old.get("conditions"), st.data.get("conditions")) + result.events
    return result


def _sync(body: dict, cfg: Config, st: _Status, now: dt.datetime) -> Result:
    res = Result(status={})
    # A job that failed validation may be fixed by editing it: judge the new generation afresh.
    failed = conditions.get_condition(st.data.get("conditions"), "Failed")
    if failed and failed.get("reason") == "InvalidSpec" and \
            st.data.get("observedGeneration") != body["metadata"].get("generation"):
        st.data = {}

    ttl = ((body.get("spec") or {}).get("runPolicy") or {}).get("ttlSecondsAfterFinished")
    if st.data.get("phase") in TERMINAL and st.data.get("cleanedUp") and ttl is None:
        return res  # finished, cleaned, kept: nothing to look at (no API call, no parse)

    try:
        job = parse(body, cfg)
        logship.parse_output(job.output, job.logship)
    except SpecError as exc:
        if st.data.get("phase") not in TERMINAL:
            _finish(st, "Failed", "InvalidSpec", str(exc), now)
        return res

    rp = job.run_policy
    if st.data.get("phase") in TERMINAL:
        if not st.data.get("cleanedUp") and _stop(job, rp.clean_pod_policy, *_children(job)) == 0:
            st.data["cleanedUp"] = True
        if rp.ttl_seconds_after_finished is not None and st.data.get("completionTime"):
            left = (conditions.parse_time(st.data["completionTime"])
                    + dt.timedelta(seconds=rp.ttl_seconds_after_finished) - now).total_seconds()
            if left <= 0:
                res.delete_job = True
            else:
                res.wait, res.delay = f"deleting the job in {left:.0f}s (TTL)", left
        return res

    st.data["gpus"] = job.total_gpus
    if rp.active_deadline_seconds and st.data.get("startTime"):
        ran = (now - conditions.parse_time(st.data["startTime"])).total_seconds()
        if ran > rp.active_deadline_seconds:
            _finish(st, "Failed", "DeadlineExceeded",
                    f"the job ran {ran:.0f}s, longer than runPolicy.activeDeadlineSeconds="
                    f"{rp.active_deadline_seconds}", now)
            _stop(job, rp.clean_pod_policy, *_children(job))
            return res

    if rp.suspend:
        return _suspend(job, st, res, cfg)
    if st.is_true("Suspended"):
        st.cond("Suspended", False, "JobResumed", "the gang starts again")
        st.data.pop("startTime", None)

    claim = _data_claim(job, st)
    if claim is False:
        res.wait, res.delay = "waiting for data", cfg.resync_seconds
        return res

    if not st.is_true("Created"):
        nodes = kube.list_objects("v1", "Node")
        problem = capacity_error(job, nodes)
        if problem and "no node matches" in str(problem):
            st.cond("Created", False, "NoMatchingNodes", str(problem))
            st.phase("Pending")
            res.wait, res.delay = str(problem), cfg.resync_seconds
            return res
        if problem:
            _finish(st, "Failed", "Unsatisfiable", str(problem), now)
            return res
    if not st.is_true("Admitted"):  # the whole gang fits the quotas, or no child is made
        decision = gate.decide(job, body, cfg)
        if decision.outcome == "Unsatisfiable":
            _finish(st, "Failed", "Unsatisfiable", decision.message, now)
            return res
        if not decision.admitted and \
                conditions.get_condition(st.data.get("conditions"), "Admitted") is None:
            res.events.append(("Normal", decision.reason, decision.message))
        st.cond("Admitted", decision.admitted, decision.reason, decision.message)
        if not decision.admitted:
            st.phase("Queued")
            res.wait, res.delay = decision.message, cfg.resync_seconds
            return res
    try:
        # While the gang runs, mpirun has read these already: check them again only when a
        # (re)start needs them, so a running job costs two reads per resync.
        if not st.is_true("Running"):
            _ensure_shared_children(job, body)
    except OwnershipError as exc:
        st.cond("Created", False, "NameConflict", str(exc))
        st.phase("Pending")
        res.wait, res.delay = str(exc), cfg.resync_seconds
        return res
    st.cond("Created", True, "ChildrenCreated",
            "Service, hostfile and SSH key created" if job.launcher == "mpi"
            else "Service created")
    return _run_gang(job, body, st, res, cfg, claim, now)


def _suspend(job: Job, st: _Status, res: Result, cfg: Config) -> Result:
    pods, launcher = _children(job)
    if launcher:
        kube.delete("batch/v1", "Job", launcher["metadata"]["name"], job.namespace,
                    uid=launcher["metadata"]["uid"])
    _delete_pods(pods)
    if st.is_true("Admitted"):  # resuming asks for admission again
        st.cond("Admitted", False, "JobSuspended", "suspended: its quota is free for others")
    st.cond("Suspended", True, "JobSuspended",
            "runPolicy.suspend is true: pods deleted; Secret, hostfile and Service kept")
    if conditions.get_condition(st.data.get("conditions"), "Running"):
        st.cond("Running", False, "JobSuspended", "suspended")
    st.phase("Suspended")
    st.data["workers"] = {"ready": 0, "total": job.workers, "summary": f"0/{job.workers}"}
    if pods or launcher:
        res.wait, res.delay = "waiting for the suspended gang's pods to go", cfg.resync_seconds
    return res


def _data_claim(job: Job, st: _Status):
    """The DataStage's claim name, None for synthetic data, False while waiting."""
    if not job.data_stage:
        return None
    stage = kube.get(API_VERSION, "DataStage", job.data_stage, job.namespace)
    field = "spec.data.dataStageRef.name"
    if stage is None:
        st.cond("DataReady", False, "DataStageNotFound",
                f"{field}: DataStage {job.data_stage!r} does not exist in namespace "
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


def _ensure_shared_children(job: Job, body: dict) -> None:
    kube.ensure(render.render_service(job), owner=body)
    for obj in logship.rbac(job, job.logship):
        kube.ensure(obj, owner=body)
    if job.launcher != "mpi":
        return
    kube.ensure(render.render_config_map(job), owner=body)
    secret = kube.get("v1", "Secret", render.secret_name(job), job.namespace)
    if secret is None:  # generated once: a new key on every reconcile would break the gang
        secret = kube.ensure(render.render_ssh_secret(job, *sshkeys.generate()), owner=body,
                             update=False)
    elif not kube.controlled_by(secret, body):
        raise OwnershipError(f"Secret {job.namespace}/{secret['metadata']['name']} already "
                             f"exists and is not controlled by this job; delete or rename it")


def _endpoints_published(job: Job) -> bool:
    """The headless Service's EndpointSlices list every worker, ready, with its hostname:
    exactly what cluster DNS serves for host(job, i)."""
    slices = kube.list_objects("discovery.k8s.io/v1", "EndpointSlice", job.namespace,
                               {"kubernetes.io/service-name": render.service_name(job)})
    published = {ep.get("hostname") for s in slices for ep in s.get("endpoints") or []
                 if (ep.get("conditions") or {}).get("ready") and ep.get("addresses")}
    return all(render.worker_name(job, i) in published for i in range(job.workers))


def _run_gang(job: Job, body: dict, st: _Status, res: Result, cfg: Config, claim,
              now: dt.datetime) -> Result:
    attempt = int(st.data.get("restarts") or 0)
    pods, launcher = _children(job)
    label = common.LABEL_ATTEMPT
    stale = [p for p in pods if p["metadata"]["labels"].get(label) != str(attempt)]
    stale_launcher = launcher is not None and \
        launcher["metadata"].get("labels", {}).get(label) != str(attempt)
    if stale or stale_launcher:  # the previous attempt must be gone before names are reused
        if stale_launcher:
            kube.delete("batch/v1", "Job", launcher["metadata"]["name"], job.namespace,
                        uid=launcher["metadata"]["uid"])
        _delete_pods(stale)
        st.phase("Starting")
        res.wait, res.delay = "waiting for the previous attempt's pods to go", cfg.resync_seconds
        return res

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
        return _gang_failed(job, st, res, cfg, failures[0], pods, launcher, now)

    if job.launcher == "mpi" and _launcher_outcome(launcher) == "Complete" or \
            job.launcher == "torchrun" and len(workers) == job.workers and \
            all(p.get("status", {}).get("phase") == "Succeeded" for p in workers.values()):
        _finish(st, "Succeeded", "JobSucceeded",
                "the launcher completed" if job.launcher == "mpi" else "every worker completed",
                now)
        _stop(job, job.run_policy.clean_pod_policy, pods, launcher)
        return res

    for i in range(job.workers):
        if i not in workers:
            kube.ensure(render.render_worker(job, i, attempt, claim), owner=body, update=False)
    st.data.setdefault("startTime", _ts(now))
    st.data.update(logship.status_urls(job, attempt, job.logship))
    ready = sum(1 for p in workers.values() if _pod_ready(p))
    st.data["workers"] = {"ready": ready, "total": job.workers,
                          "summary": f"{ready}/{job.workers}"}
    if not launched:
        st.phase("Starting")
        if not _gang_ready(job, st, res, cfg, ready):
            return res
        if job.launcher == "mpi":
            kube.ensure(render.render_launcher(job, attempt), owner=body, update=False)
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
    return res


def _gang_ready(job: Job, st: _Status, res: Result, cfg: Config, ready: int) -> bool:
    """Every worker Ready and, for ssh, published in DNS; else a waiting condition."""
    if ready < job.workers:
        st.cond("WorkersReady", False, "WaitingForWorkers",
                f"{ready}/{job.workers} workers ready")
        res.wait, res.delay = f"{ready}/{job.workers} workers ready", cfg.resync_seconds
        return False
    if job.launcher == "mpi" and not _endpoints_published(job):
        st.cond("WorkersReady", False, "WaitingForDNS",
                "every worker is Ready; waiting for their DNS names (EndpointSlices)")
        res.wait, res.delay = "waiting for the workers' DNS names", cfg.resync_seconds
        return False
    return True


def _launcher_failure(job: Job, pods: list[dict]) -> Failure:
    for pod in pods:
        if pod["metadata"]["labels"].get(common.LABEL_ROLE) == render.LAUNCHER:
            failure = pod_failure(pod)
            if failure:
                return failure
    return Failure(render.launcher_name(job), render.LAUNCHER, None, "LauncherFailed")


def _gang_failed(job: Job, st: _Status, res: Result, cfg: Config, failure: Failure,
                 pods: list[dict], launcher: dict | None, now: dt.datetime) -> Result:
    restarts = int(st.data.get("restarts") or 0)
    limit = job.run_policy.backoff_limit
    st.data["lastFailure"] = failure.as_status()
    if restarts >= limit:
        _finish(st, "Failed", "BackoffLimitExceeded",
                f"{failure.describe()}; runPolicy.backoffLimit={limit} restarts used", now)
        _stop(job, job.run_policy.clean_pod_policy, pods, launcher)
        return res
    st.data["restarts"] = restarts + 1
    st.cond("Restarting", True, "GangRestart",
            f"{failure.describe()}; restarting the gang (restart {restarts + 1} of {limit})")
    st.cond("WorkersReady", False, "GangRestart", "the gang is being recreated")
    if conditions.get_condition(st.data.get("conditions"), "Running"):
        st.cond("Running", False, "GangRestart", failure.describe())
    st.phase("Starting")
    res.wait, res.delay = "restarting the gang", cfg.resync_seconds
    return res
