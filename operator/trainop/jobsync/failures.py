"""Why a gang attempt failed and what follows (JobSet's failure policy): `pod_failure` classifies a
pod's end (exit code, OOMKilled, StorageLimit, SshdNotExecutable, Evicted, Preempted, NodeLost,
SpotEviction, PodDeleted),
`action_for` applies runPolicy.failurePolicy, `restart_gang` is the one restart path (the attempt
in status first, the old pods deleted by later reconciles), `attempt`/`restart_counts` read status.
"""

from __future__ import annotations

import dataclasses

from trainop import conditions, preflight
from trainop.actions import Outcome
from trainop.jobsync.model import TERMINAL, _finish, _launcher_outcome, _Plan, _Status, _stop, _ts
from trainop.render import common
from trainop.render import dtj as render
from trainop.spec import FailureRule, Job

# runPolicy.failurePolicy actions, named after JobSet's failurePolicy (RestartJobSet counts
# against maxRestarts, RestartJobSetAndIgnoreMaxRestarts does not, FailJobSet).
RESTART, RESTART_UNCOUNTED, FAIL_JOB = "RestartGang", "RestartGangAndIgnoreBackoffLimit", "FailJob"

# Causes that are not the job's fault: by default they restart the gang without counting.
DISRUPTIONS = frozenset({"Evicted", "Preempted", "NodeLost", "SpotEviction", "PodDeleted"})

# The reasons Kubernetes gives the DisruptionTarget condition, and what trainop calls them.
DISRUPTION_REASONS = {"EvictionByEvictionAPI": "Evicted", "TerminationByKubelet": "Evicted",
                      "PreemptionByScheduler": "Preempted", "DeletionByTaintManager": "NodeLost",
                      "DeletionByPodGC": "NodeLost"}

# The kubelet's eviction messages for a pod past its own local-storage limits (an emptyDir's
# sizeLimit, an ephemeral-storage limit: kubelet/eviction/helpers.go). Such an eviction is the
# job's doing, not node pressure: it counts (StorageLimit), or a job that fills its disk would
# restart forever.
STORAGE_LIMIT_MESSAGES = ("Usage of EmptyDir volume ", "exceeded its local ephemeral storage limit",
                          "Pod ephemeral local storage usage exceeds the total limit")

HISTORY = 10  # restarts kept in status.restarts.history (the newest)


def node_lost(body: dict) -> dict | None:
    """The node's Ready condition when it is Unknown, else None. Only Unknown: the node
    lifecycle controller sets it (with the node.kubernetes.io/unreachable taints) once the
    kubelet has not renewed its Lease for --node-monitor-grace-period (40-50 s by default), so
    nobody on the node can end or report its pods. Ready False is the kubelet's own word (its
    container runtime restarting, PLEG): it still runs and ends its pods, and a containerd
    restart must not restart every gang on the node."""
    ready = next((c for c in (body.get("status") or {}).get("conditions") or []
                  if c.get("type") == "Ready"), None)
    return ready if ready is not None and ready.get("status") == "Unknown" else None


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
    """status.restarts as {failures, disruptions, spotEvictions, unhealthyNodes, resizes, history};
    an old int (every restart counted then) becomes that many failures."""
    old = (status or {}).get("restarts")
    if isinstance(old, dict):
        return {"failures": int(old.get("failures") or 0),
                "disruptions": int(old.get("disruptions") or 0),
                "spotEvictions": int(old.get("spotEvictions") or 0),
                "unhealthyNodes": int(old.get("unhealthyNodes") or 0),
                "resizes": int(old.get("resizes") or 0),
                "history": list(old.get("history") or [])}
    return {"failures": int(old or 0), "disruptions": 0, "spotEvictions": 0, "unhealthyNodes": 0,
            "resizes": 0, "history": []}


@dataclasses.dataclass
class Failure:
    """Why a pod of the gang ended: `cause` is the class runPolicy.failurePolicy matches
    (Error, OOMKilled, StorageLimit, SshdNotExecutable, Evicted, Preempted, NodeLost, SpotEviction,
    PodDeleted, WorkerExited, LauncherFailed, or a caller's own such as UnhealthyNode); `reason` the pod's
    own word, `detail` what the operator concluded (a failed preflight's verdict, the kubelet's
    eviction message)."""
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
    detail = ""
    if cause == "Evicted" and any(m in (st.get("message") or "") for m in STORAGE_LIMIT_MESSAGES):
        cause, detail = "StorageLimit", st["message"].strip()
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
            if not cause and (term.get("message") or "").startswith(render.SSHD_EXEC_FAILED):
                # the MPI worker's shell could not start sshd: the image's doing, every attempt
                cause, detail = "SshdNotExecutable", term["message"].strip()[:1024]
            return Failure(name, cs["name"], term.get("exitCode"), reason,
                           term.get("finishedAt") or "", node,
                           cause or ("OOMKilled" if reason == "OOMKilled" else "Error"), conds, detail)
    if cause or st.get("phase") == "Failed":
        return Failure(name, (pod["spec"]["containers"][0])["name"], None,
                       (disrupted or {}).get("reason") or st.get("reason") or cause or "Failed",
                       "", node, cause or st.get("reason") or "Failed", conds, detail)
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


def lost_node_failure(pod: dict, lost: dict[str, dict], spot: bool = False) -> Failure | None:
    """A pod that has not ended, bound to a node judged lost (Ready Unknown, or its Node deleted:
    `deleted` in the verdict): NodeLost (SpotEviction on a spot pool), a disruption. Its status will never change (no kubelet reports it), so waiting for
    its end would wait for the taint manager (the unreachable taint's tolerationSeconds, 300 by
    default) and then for ever (the deleted pod stays Terminating until its kubelet confirms)."""
    node = (pod.get("spec") or {}).get("nodeName") or ""
    verdict = lost.get(node)
    if verdict is None or (pod.get("status") or {}).get("phase") in TERMINAL:
        return None
    if verdict.get("deleted"):
        reason, detail = "NodeDeleted", f"the Node was deleted at {verdict['since']}"
    else:
        since = f" since {verdict['since']}" if verdict.get("since") else ""
        said = f": {verdict['message']}" if verdict.get("message") else ""
        reason, detail = "NodeStatusUnknown", f"the node is lost (Ready Unknown{since}{said})"
    return Failure(pod["metadata"]["name"], pod["spec"]["containers"][0]["name"], None,
                   reason, "", node, "SpotEviction" if spot else "NodeLost", detail=detail)


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
    failures += _on_lost_nodes(plan, job, failures, attempt_)
    failures.sort(key=lambda f: (not f.disruption, f.finished or "~"))
    if job.launcher == "mpi" and _launcher_outcome(plan.snap.launcher) == "Failed":
        failures.append(_launcher_failure(job, plan.snap.pods))
    return failures


def _on_lost_nodes(plan: _Plan, job: Job, known: list[Failure], attempt_: int) -> list[Failure]:
    """The attempt's pods (workers and the launcher's) on a lost node, before or after launch:
    the gang cannot go on without them, nor start (a worker there never becomes Ready). Read
    from the Node, as soon as the node lifecycle controller judges it (its
    --node-monitor-grace-period), not from the pods' eviction, which waits for the unreachable
    taint's tolerationSeconds (300 s by default; why trainop renders no shorter one:
    docs/pools-and-failures.md, "A node lost under the gang"). A launcher that completed has
    finished the job, whatever its node became since."""
    if not plan.snap.lost_nodes or (job.launcher == "mpi" and
                                    _launcher_outcome(plan.snap.launcher) == "Complete"):
        return []
    named = {f.pod for f in known}
    return [f for p in plan.snap.pods
            if p["metadata"].get("labels", {}).get(common.LABEL_ATTEMPT) == str(attempt_)
            and p["metadata"]["name"] not in named
            and (f := lost_node_failure(p, plan.snap.lost_nodes, job.placement.spot))]


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
