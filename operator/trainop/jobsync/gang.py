"""The gang itself: capacity before the first child, the shared children (Service, hostfile,
SSH key, PodGroup), the attempt's workers, the launcher once every worker is Ready (with
their pod IPs as its hostAliases), success, and waiting for nodes (schedulingTimeoutSeconds).
"""

from __future__ import annotations

import datetime as dt

from trainop import conditions, podgroup, resume
from trainop.actions import Apply, Create, CreateSSHSecret, Outcome, force_delete
from trainop.jobsync import elastic, stall, starting
from trainop.jobsync.data import _with_save
from trainop.jobsync.fabric import _fabric, _training_transport
from trainop.jobsync.failures import _gang_failed, _gang_failures, attempt
from trainop.jobsync.model import (
    _controlled,
    _delete_pods,
    _finish,
    _launcher_outcome,
    _Plan,
    _pod_ready,
    _Status,
    _stop,
    _ts,
    _version,
)
from trainop.jobsync.queueing import _report_pods_ready
from trainop.render import common, logship
from trainop.render import dtj as render
from trainop.spec import Job, NoMatchingNodes, capacity_error


def _capacity(plan: _Plan, job: Job, st: _Status) -> Outcome | None:
    """Before the first child: can the job's pool ever hold a worker? (An autoscaled pool is
    judged at maxNodes: spec.py.) No matching node yet waits; too small fails."""
    if st.is_true("Created"):
        return None
    problem = capacity_error(job, plan.snap.nodes)
    if isinstance(problem, NoMatchingNodes):
        st.cond("Created", False, "NoMatchingNodes", str(problem))
        st.phase("Pending")
        return plan.wait(str(problem))
    if problem:
        _finish(st, "Failed", "Unsatisfiable", str(problem), plan.now)
        return plan.out
    return None


def _child_problem(plan: _Plan, st: _Status) -> Outcome | None:
    """What the last apply met (apply.Problem, by its typed reason), or a name taken by a
    child of someone else."""
    problem = plan.snap.problem
    if problem and problem.reason == "ChildRejected":  # fails, so the gate frees its quota
        _finish(st, "Failed", "ChildRejected", problem.message, plan.now)
        return plan.out
    template = (plan.body.get("spec") or {}).get("podTemplate")
    if problem and problem.reason == "PodSecurity" and template:  # the user's to fix
        _finish(st, "Failed", "ChildRejected", f"spec.podTemplate: the namespace's Pod Security "
                f"admission refused the job's pods: {problem.said}; fix the pod template and "
                f"create the job again", plan.now)
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
    return None


def _children(plan: _Plan, job: Job, st: _Status) -> None:
    # Every child is kept in shape, also while the gang runs (free while unchanged: see
    # apply.py): a deleted Service takes the workers' DNS names, a deleted Role the shipper's
    # progress reports (docs/DEVELOPING.md, "How each applied child is repaired").
    plan.out.actions.append(Apply(render.render_network_policy(job), plan.body,
                                  _version(plan.snap.network_policy)))
    _shared_children(plan, job)
    st.cond("Created", True, "ChildrenCreated",
            "Service, hostfile and SSH key created" if job.launcher == "mpi"
            else "Service created")


def _foreign_child(plan: _Plan) -> str | None:
    """A child's name taken by an object this job does not control (never adopted)."""
    snap = plan.snap
    for obj in (snap.service, snap.config_map, snap.network_policy):
        if obj is not None and not _controlled(obj, snap.body):
            meta = obj["metadata"]
            return (f"{obj.get('kind', 'object')} {meta.get('namespace')}/{meta['name']} already "
                    f"exists and is not controlled by this job; delete or rename it")
    return None


def _shared_children(plan: _Plan, job: Job) -> None:
    snap, body, acts = plan.snap, plan.body, plan.out.actions
    acts.append(Apply(render.render_service(job), body, _version(snap.service)))
    pod_group = podgroup.render_for(job)
    if pod_group is not None:  # before any pod of the group; put back if deleted
        acts.append(Apply(pod_group, body, _version(snap.pod_group)))
    for obj in logship.rbac(job, job.logship):
        acts.append(Apply(obj, body, None))  # not read: watched by apply.Applier.observe
    progress = logship.progress_config_map(job, job.logship)
    if progress is not None and snap.progress is None:
        acts.append(Create(progress, body))  # created once: its data is the shipper's
    if job.launcher != "mpi":
        return
    acts.append(Apply(render.render_config_map(job), body, _version(snap.config_map)))
    if job.launcher_as_worker:
        acts.append(Apply(render.render_launcher_service(job), body, _version(snap.launcher_service)))
    if not snap.ssh_secret:  # generated once: a new key on every reconcile would break the gang
        acts.append(CreateSSHSecret(job, body))


def _addresses(job: Job, workers: dict[int, dict]) -> dict[str, str] | None:
    """Each worker's name in the hostfile -> its pod IP, for the launcher's hostAliases; None
    while one has no IP yet. The launcher resolves the workers from its own /etc/hosts, so it
    never waits for the EndpointSlice controller and CoreDNS to publish them (0.5-1.2 s after
    Ready on a fresh Service, issue 30) nor for a name CoreDNS cached as unknown (5 s)."""
    out = {}
    for i in range(job.workers):
        ip = ((workers.get(i) or {}).get("status") or {}).get("podIP")
        if not ip:
            return None
        out[render.host(job, i)] = ip
    return out


def _run_gang(plan: _Plan, job: Job, st: _Status, claim) -> Outcome:
    """The gang's attempt: the previous attempt's pods gone first, then failures judged, success
    seen, the missing workers created, the launcher once every worker is Ready."""
    attempt_ = attempt(st.data)
    st.data.setdefault("attempt", attempt_)
    st.data.setdefault("restarts", {"failures": 0, "disruptions": 0})
    previous = _previous_attempt(plan, st, attempt_)
    if previous:
        return previous
    never = starting.judge(plan, job, st, plan.snap.pods)  # an image or Secret that is not there
    if never:
        return never
    workers = {int(p["metadata"]["labels"][common.LABEL_INDEX]): p for p in plan.snap.pods
               if p["metadata"]["labels"].get(common.LABEL_ROLE) == render.WORKER}
    launched = plan.snap.launcher is not None or \
        (job.launcher == "torchrun" and st.is_true("Running"))
    ended = _judged(plan, job, st, workers, launched, attempt_) or \
        _succeeded(plan, job, st, workers) or \
        (launched and (_launched(plan, job, st, workers) or stall.judge(plan, job, st, attempt_)
                       or (job.elastic and elastic.grow(plan, job, st))))
    if ended:
        return ended
    unfenced = _unfenced_lost_nodes(plan) if len(workers) < job.workers else []
    if unfenced:
        st.phase("Starting")
        return plan.wait(f"waiting for the node lifecycle controller to taint lost node(s) {', '.join(unfenced)} "
                         "unreachable: until then the scheduler could bind the new pods there")
    resume_from = resume.plan(job, st.data.get("checkpoint"))
    job = _with_save(job, st)  # the pods made now: their grace period from the slowest save
    ready = _workers(plan, job, st, workers, attempt_, claim, resume_from)
    if not launched:
        st.phase("Starting")
        for_nodes, timed_out = _nodes_waiting(plan, job, st, workers)
        if timed_out:
            return plan.out
        if for_nodes and job.elastic:
            pending = [p for p in workers.values() if _unschedulable(p)]
            shrunk = pending and elastic.shrink(plan, job, st, workers,
                                                _waiting_since(st, pending, True) or plan.now)
            if shrunk:
                return shrunk
        waiting = _gang_waiting(job, st, ready)
        if waiting:
            return plan.wait(for_nodes or waiting)
        if job.launcher == "mpi":
            addresses = _addresses(job, workers)
            if addresses is None:  # (a Ready pod has its IP: a cache from before the IP)
                return plan.wait("waiting for the workers' pod IPs")
            plan.out.actions.append(Create(
                render.render_launcher(job, attempt_, resume_from, claim, addresses), plan.body))
    # Asserted on every pass (idempotent), so an operator that died between creating the
    # launcher and writing the status still records the transition after its restart.
    if ready == job.workers:
        st.cond("WorkersReady", True, "AllWorkersReady",
                f"{job.workers}/{job.workers} workers ready")
    if st.is_true("Restarting"):
        st.cond("Restarting", False, "GangRestarted", f"attempt {attempt_} is running")
    st.cond("Running", True, "LauncherCreated" if job.launcher == "mpi" else "WorkersRunning",
            f"{job.total_slots} ranks on {job.workers} workers"
            f"{' and the launcher' if job.launcher_as_worker else ''} (attempt {attempt_})")
    st.phase("Running")
    return plan.out


def _unfenced_lost_nodes(plan: _Plan) -> list[str]:
    """Nodes judged lost (Ready Unknown) that do not carry the unreachable NoSchedule taint yet.
    The node lifecycle controller sets the condition, then taints the node from a queue of its
    own: a moment later, seconds on a loaded control plane. A gang restarted in between had its
    new pods bound to the dead node again (the scheduler reads taints, not conditions), which
    then restarted the gang a second time (seen in a CI run, tests/e2e/test_node_lost.py). A
    deleted Node takes no pods."""
    return sorted(name for name, verdict in plan.snap.lost_nodes.items()
                  if not verdict.get("fenced") and not verdict.get("deleted"))


def _previous_attempt(plan: _Plan, st: _Status, attempt_: int) -> Outcome | None:
    """The previous attempt's pods and launcher must be gone before their names are reused."""
    label, launcher = common.LABEL_ATTEMPT, plan.snap.launcher
    stale = [p for p in plan.snap.pods if p["metadata"]["labels"].get(label) != str(attempt_)]
    stale_launcher = launcher is not None and \
        launcher["metadata"].get("labels", {}).get(label) != str(attempt_)
    if not (stale or stale_launcher):
        return None
    lost = [p for p in stale if (p.get("spec") or {}).get("nodeName") in plan.snap.lost_nodes]
    # A pod on a lost node would stay Terminating until its kubelet confirms, which a dead node
    # never does (PodGC forces only pods of a node with the out-of-service taint, or of a
    # deleted Node), and its name is the next attempt's. So it goes with grace 0, also when
    # already Terminating. Safe for a gang: the rest of the attempt is being deleted, so a rank
    # still alive on a partitioned node has no peers to make progress with; the next attempt
    # writes its checkpoints and logs into folders of its own (attempt-<n>); and a node that
    # comes back finds the pod gone (or under another uid) and its kubelet kills the
    # containers. (The unreachable NoSchedule taint keeps new pods off the node meanwhile:
    # _unfenced_lost_nodes waits for it.)
    # Pods first, then the launcher: see model._stop.
    plan.out.actions.extend(force_delete(p) for p in lost)
    _delete_pods(plan, [p for p in stale if p not in lost])
    if stale_launcher and not launcher["metadata"].get("deletionTimestamp"):
        plan.delete(launcher)
    st.phase("Starting")
    return plan.wait("waiting for the previous attempt's pods to go")


def _judged(plan: _Plan, job: Job, st: _Status, workers: dict[int, dict], launched: bool,
            attempt_: int) -> Outcome | None:
    """The gang's failures (and the fabric's verdict) decided: a restart or Failed."""
    failures = _gang_failures(plan, job, workers, launched, attempt_)
    if job.preflight.enabled or job.infiniband:
        outcome = _fabric(plan, job, st, workers, attempt_, failures)
        if outcome is not None:
            return outcome
    return _gang_failed(plan, job, st, failures[0]) if failures else None


def _succeeded(plan: _Plan, job: Job, st: _Status, workers: dict[int, dict]) -> Outcome | None:
    if not (job.launcher == "mpi" and _launcher_outcome(plan.snap.launcher) == "Complete" or
            job.launcher == "torchrun" and len(workers) == job.workers and
            all(p.get("status", {}).get("phase") == "Succeeded" for p in workers.values())):
        return None
    _finish(st, "Succeeded", "JobSucceeded",
            "the launcher completed" if job.launcher == "mpi" else "every worker completed",
            plan.now)
    _stop(plan, job.run_policy.clean_pod_policy)
    plan.out.requeue_after = None
    return plan.out


def _launched(plan: _Plan, job: Job, st: _Status, workers: dict[int, dict]) -> Outcome | None:
    """A running gang (after success: a job that completed is not failed for its transport):
    its launcher's pod may wait for room too; the training's transport is checked."""
    if job.launcher == "mpi":
        for_nodes, timed_out = _nodes_waiting(plan, job, st, workers)
        if timed_out:
            return plan.out
        plan.out.waiting = for_nodes
    return _training_transport(plan, job, st)


def _workers(plan: _Plan, job: Job, st: _Status, workers: dict[int, dict], attempt_: int,
             claim, resume_from) -> int:
    """The missing workers created, the run's start and log URLs recorded; the Ready count."""
    for i in range(job.workers):
        if i not in workers:
            plan.out.actions.append(Create(
                render.render_worker(job, i, attempt_, claim, resume_from), plan.body))
    if "startTime" not in st.data:
        st.data["startTime"] = _ts(plan.now)
        if job.run_policy.active_deadline_seconds:
            plan.out.requeue_after = float(job.run_policy.active_deadline_seconds)
    st.data.update(logship.status_urls(job, attempt_, job.logship))
    ready = sum(1 for p in workers.values() if _pod_ready(p))
    st.data["workers"] = {"ready": ready, "total": job.workers,
                          "summary": f"{ready}/{job.workers}"}
    if plan.snap.kueue:
        _report_pods_ready(plan, job, ready)
    return ready


def _gang_waiting(job: Job, st: _Status, ready: int) -> str | None:
    """None when every worker is Ready; else what it waits for (and the WorkersReady condition
    says so)."""
    if ready < job.workers:
        st.cond("WorkersReady", False, "WaitingForWorkers",
                f"{ready}/{job.workers} workers ready")
        return f"{ready}/{job.workers} workers ready"
    return None


def _unschedulable(pod: dict) -> bool:
    return not (pod.get("spec") or {}).get("nodeName") and any(
        c.get("type") == "PodScheduled" and c.get("status") == "False"
        and c.get("reason") == "Unschedulable"
        for c in (pod.get("status") or {}).get("conditions") or [])


def _unjudged(pod: dict) -> bool:
    """Pending, not bound and without the scheduler's PodScheduled verdict yet."""
    status = pod.get("status") or {}
    bound = (pod.get("spec") or {}).get("nodeName")
    judged = any(c.get("type") == "PodScheduled" for c in status.get("conditions") or [])
    return status.get("phase", "Pending") == "Pending" and not bound and not judged


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
    if any(_unjudged(p) for p in workers.values()):
        # The scheduler has not yet tried every worker: a count now would be short (1/2, then
        # 2/2 a moment later, a line each). Its verdict on the pod wakes this job again.
        return None, False
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
