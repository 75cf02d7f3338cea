"""The decisions of a DistributedTrainingJob's reconcile, in mpi-operator's order: defaults and
parse -> terminal jobs (cleanup, TTL) -> deadline -> suspend -> data -> placement -> Service,
hostfile, SSH Secret (generated once) -> workers -> failures (gang restart or Failed) -> launcher
only when every worker is Ready (their pod IPs its hostAliases) -> status.

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

import datetime as dt

from trainop import conditions, podgroup, priority
from trainop.actions import Outcome, SetFinalizers
from trainop.config import Config
from trainop.jobsync import elastic
from trainop.jobsync.data import _data_claim, _show_metrics, _take_checkpoint, _with_save
from trainop.jobsync.failures import _compact, _fallen_back, attempt, restart_counts
from trainop.jobsync.gang import _capacity, _child_problem, _children, _run_gang
from trainop.jobsync.model import LEGACY_FINALIZER, TERMINAL, JobSnapshot, _events, _finish, _Plan, _Status, _stop
from trainop.jobsync.queueing import (
    _admit,
    _kueue_evicted,
    _kueue_finish,
    _kueue_follow_size,
    _kueue_placement,
    _kueue_workload_stale,
    _suspension,
)
from trainop.render import dtj as render
from trainop.spec import MANAGED_BY, Job, SpecError, managed_by, parse_cached


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
    if LEGACY_FINALIZER in (meta.get("finalizers") or ()):
        plan.out.actions.append(SetFinalizers.dropping(snap.body, LEGACY_FINALIZER))
    _take_checkpoint(snap, cfg, st)  # first: pods created in this pass resume from it
    _decide(plan, st)
    _show_metrics(snap, st)
    st.data["observedGeneration"] = meta.get("generation")
    out = plan.out
    out.status = st.data
    out.events = _events(old.get("conditions"), st.data.get("conditions")) + out.events
    return out


def _decide(plan: _Plan, st: _Status) -> Outcome:
    """The steps in mpi-operator's order; each returns the Outcome when the reconcile ends
    there (a wait, a failure), None to go on."""
    parsed = _parse(plan, st)
    if isinstance(parsed, Outcome):
        return parsed
    job, prio = parsed
    plan.prio = prio
    plan.pod_grace = render.delete_grace_seconds(_with_save(job, st))
    if st.data.get("phase") in TERMINAL:
        return _terminal(plan, job.run_policy, st)
    st.data["gpus"] = job.total_gpus
    stopped = _deadline(plan, job.run_policy, st) or _suspension(plan, job, st) or \
        (plan.snap.kueue and _kueue_evicted(plan, job, st))
    if stopped:
        return stopped
    claim = _data_claim(plan.snap.stage, job, st, plan.snap.pods)
    if claim is False:
        return plan.wait("waiting for data")
    waiting = _capacity(plan, job, st) or \
        (plan.snap.kueue and _kueue_workload_stale(plan, job, prio, st)) or \
        _admit(plan, job, prio, st)
    if waiting:
        return waiting
    if plan.snap.kueue:
        placed = _kueue_placement(plan, job, st)
        if not isinstance(placed, Job):
            return placed
        job = placed
        _kueue_follow_size(plan, job, st)
    blocked = _child_problem(plan, st)
    if blocked:
        return blocked
    _children(plan, job, st)
    return _run_gang(plan, job, st, claim)


def _parse(plan: _Plan, st: _Status) -> tuple[Job, priority.Priority] | Outcome:
    """The job parsed and bound to its class, fallback pool and gang scheduler; an Outcome when
    there is nothing more to decide (finished and cleaned up, or an invalid spec)."""
    body, cfg = plan.body, plan.cfg
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
        job = parse_cached(body, cfg, plan.snap.memo)
        # The class is judged until the job is admitted; after that, one deleted or capped
        # since stops nothing.
        job, prio = priority.for_job(job, plan.snap.classes, cfg, plan.snap.kueue, strict=(
            st.data.get("phase") not in TERMINAL and not st.is_true("Admitted")),
            memo=plan.snap.memo)
    except SpecError as exc:
        if st.data.get("phase") not in TERMINAL:
            _finish(st, "Failed", "InvalidSpec", str(exc), plan.now)
        return plan.out
    job = elastic.current(_fallen_back(job, st), st)
    return podgroup.bind(job, plan.snap.gang_scheduler, cfg, plan.snap.memo), prio


def _terminal(plan: _Plan, rp, st: _Status) -> Outcome:
    """A finished job: its pods cleaned as cleanPodPolicy says, then deleted after its TTL."""
    if not st.data.get("cleanedUp") and _stop(plan, rp.clean_pod_policy) == 0:
        st.data["cleanedUp"] = True
    if rp.ttl_seconds_after_finished is not None and st.data.get("completionTime"):
        left = (conditions.parse_time(st.data["completionTime"])
                + dt.timedelta(seconds=rp.ttl_seconds_after_finished) - plan.now).total_seconds()
        if left <= 0:
            plan.out.delete_self = True
        else:
            plan.out.requeue_after = left
            return plan.wait(f"deleting the job in {left:.0f}s (TTL)")
    return plan.out


def _deadline(plan: _Plan, rp, st: _Status) -> Outcome | None:
    """runPolicy.activeDeadlineSeconds: Failed once it is past, else a wake-up at its moment."""
    if not (rp.active_deadline_seconds and st.data.get("startTime")):
        return None
    ran = (plan.now - conditions.parse_time(st.data["startTime"])).total_seconds()
    if ran >= rp.active_deadline_seconds:
        _finish(st, "Failed", "DeadlineExceeded",
                f"the job ran {ran:.0f}s, longer than runPolicy.activeDeadlineSeconds="
                f"{rp.active_deadline_seconds}", plan.now)
        _stop(plan, rp.clean_pod_policy)
        return plan.out
    plan.out.requeue_after = rp.active_deadline_seconds - ran  # the deadline's exact moment
    return None
