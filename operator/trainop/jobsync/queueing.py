"""Admission and its lifecycle: the native queue's answer (asked by the controller before
decide) or Kueue's from the cached Workload, the Workload created/replaced/finished/released as
actions, eviction as stop-and-requeue, the admitted flavors' placement, suspension.
"""

from __future__ import annotations

import dataclasses

from trainop import admission, conditions, kueue, priority
from trainop.actions import Create, Outcome, PatchStatus, Ref
from trainop.admission import Decision
from trainop.jobsync import elastic
from trainop.jobsync.model import TERMINAL, _delete_pods, _finish, _Plan, _pod_ready, _Status, _ts
from trainop.render import common
from trainop.render import dtj as render
from trainop.spec import Job, SpecError


def _admit(plan: _Plan, job: Job, prio: priority.Priority, st: _Status) -> Outcome | None:
    """The whole gang fits the quotas (native queue or Kueue), or no child is made; an admitted
    job keeps the shape it was admitted with (status.admittedShape)."""
    if st.is_true("Admitted"):
        return _shape_kept(plan, job, st)
    decision = _admission(plan, job, prio)
    if decision is None:  # the controller asks the native queue and decides again
        plan.out.asks = job
        return plan.out
    if decision.outcome == "Unsatisfiable":
        _finish(st, "Failed", "Unsatisfiable", decision.message, plan.now)
        return plan.out
    if not decision.admitted and \
            conditions.get_condition(st.data.get("conditions"), "Admitted") is None:
        plan.out.events.append(("Normal", decision.reason, decision.message))
    st.cond("Admitted", decision.admitted, decision.reason, decision.message)
    if not decision.admitted:
        st.phase("Queued")
        return plan.wait(decision.message)
    st.data["admittedShape"] = admission.shape_digest(elastic.largest(job), plan.snap.memo)
    st.data["admittedGeneration"] = plan.body["metadata"].get("generation")
    return None


def _shape_kept(plan: _Plan, job: Job, st: _Status) -> Outcome | None:
    """A reservation holds for the shape it was made for. The CRD freezes the shape's fields
    from admission on; what its rule cannot afford to compare (a podTemplate's containers and
    their resources) is compared here: a job whose pods would differ from what was admitted is
    stopped and queues again, as Kueue's jobframework stops a job that no longer matches its
    Workload, so a reservation for 1 GPU never runs 16 (issue 22 H1).

    Only an edit of the spec can do that. The shape is rendered with the operator's
    configuration (launcherResources, a sidecar's requests), which an upgrade may change: a job
    whose spec is still the generation admitted keeps running (its pods were made and counted
    with the old values; only pods made later get the new ones), and the digest follows, so a
    later edit is judged against it. (Found by the helm-upgrade e2e test: a new launcherResources
    stopped and requeued every running job.)"""
    digest = admission.shape_digest(elastic.largest(job), plan.snap.memo)
    known = st.data.setdefault("admittedShape", digest)  # (jobs admitted before it existed)
    generation = plan.body["metadata"].get("generation")
    # Jobs admitted before admittedGeneration existed: the generation the last reconcile saw,
    # which judged that spec's shape equal to admittedShape (or it would have stopped the gang).
    admitted_at = st.data.setdefault("admittedGeneration", st.data.get("observedGeneration"))
    if known == digest:
        return None
    if admitted_at is not None and admitted_at == generation:
        st.data["admittedShape"] = digest
        return None
    pods, launcher = plan.snap.pods, plan.snap.launcher
    _delete_pods(plan, pods)  # first: see model._stop
    if launcher and not launcher["metadata"].get("deletionTimestamp"):
        plan.delete(launcher)
    why = "the gang's shape changed since it was admitted (spec.podTemplate's containers or " \
          "resources)"
    if pods or launcher:
        st.phase("Queued")
        return plan.wait(f"{why}: stopping the gang to queue it again")
    st.cond("Admitted", False, "ShapeChanged", f"{why}; it queues again with its new shape")
    for type_ in ("Running", "WorkersReady"):
        if conditions.get_condition(st.data.get("conditions"), type_):
            st.cond(type_, False, "ShapeChanged", "stopped: queued again")
    st.data.pop("admittedShape")
    st.data.pop("admittedGeneration", None)
    st.data.pop("startTime", None)
    st.phase("Queued")
    return plan.wait(f"{why}: queued again")


def _admission(plan: _Plan, job: Job, prio: priority.Priority) -> Decision | None:
    """Kueue's answer from the cached Workload (a missing one is created here, as an action),
    or the native queue's, which the controller asked before this decide (None: not yet)."""
    if not plan.snap.kueue:
        return plan.snap.admission
    if plan.snap.workload is None:
        queue = (plan.body.get("spec") or {}).get("queue")
        plan.out.actions.append(Create(kueue.render_workload(job, queue, prio, plan.snap.memo,
                                                             slices=_slices(plan, job)), plan.body))
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
    why = kueue.mismatch(_at_workload_size(plan, job, wl), prio, wl, plan.snap.memo)
    if why is None:
        return None
    plan.out.actions += kueue.release_actions(wl)
    if st.is_true("Admitted"):
        st.cond("Admitted", False, "WorkloadMismatch", f"{why}; a new Workload queues")
    st.phase("Queued")
    return plan.wait(f"{why}: replacing the Workload")


def _slices(plan: _Plan, job: Job) -> bool:
    """Kueue's workload slices follow this job's size (config kueue.workloadSlices)."""
    return job.elastic is not None and plan.cfg.kueue_workload_slices


def _at_workload_size(plan: _Plan, job: Job, wl: dict) -> Job:
    """A shrunk elastic job, judged at its Workload's count while that count waits to be
    lowered in place (_kueue_follow_size): still what was admitted, not a new shape."""
    count = kueue.worker_count(wl)
    if not _slices(plan, job) or not count or not job.workers < count <= job.elastic.max_workers:
        return job
    return dataclasses.replace(job, workers=count)


def _kueue_follow_size(plan: _Plan, job: Job, st: _Status) -> None:
    """Kueue's Workloads follow an elastic gang's size (docs/elastic.md): slices Kueue replaced
    go (trainop holds their finalizer); a bigger slice no grow waits for any more goes; with
    workload slices, a shrunk gang's Workload count is lowered in place once no more workers
    than the new size hold resources (a terminating pod still holds its GPUs). A bigger size
    is jobsync/elastic.py's (a new slice, admitted before the gang grows). Without slices a
    resize replaces the Workload (_kueue_workload_stale): admitted again at the new size."""
    snap = plan.snap
    for wl in snap.replaced_workloads:
        plan.out.actions += kueue.release_actions(wl)
    if not _slices(plan, job):
        return
    grow_to = (st.data.get("elastic") or {}).get("growTo")
    pending = snap.workload_slice
    if pending is not None and grow_to != kueue.worker_count(pending):
        plan.out.actions += kueue.release_actions(pending)
    count, wl = kueue.worker_count(snap.workload), snap.workload
    holding = sum(1 for p in snap.pods if (p.get("status") or {}).get("phase") not in TERMINAL
                  and p["metadata"]["labels"].get(common.LABEL_ROLE) == render.WORKER)
    if kueue.admitted(wl) and count and count > job.workers and holding <= job.workers \
            and not (grow_to and grow_to <= count):
        plan.out.actions.append(kueue.scale_down(wl, job.workers))


def _suspension(plan: _Plan, job: Job, st: _Status) -> Outcome | None:
    if job.run_policy.suspend:
        return _suspend(plan, job, st)
    if st.is_true("Suspended"):
        st.cond("Suspended", False, "JobResumed", "the gang starts again")
        st.data.pop("startTime", None)
    return None


def _suspend(plan: _Plan, job: Job, st: _Status) -> Outcome:
    pods, launcher = plan.snap.pods, plan.snap.launcher
    _delete_pods(plan, pods)  # first: see model._stop
    if launcher and not launcher["metadata"].get("deletionTimestamp"):
        plan.delete(launcher)
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
        plan.out.actions += kueue.release_actions(plan.snap.workload) + \
            kueue.release_actions(plan.snap.workload_slice)
    return plan.out


def _kueue_finish(plan: _Plan, st: _Status) -> None:
    """The ended job gives its Workload's quota back (Finished, finalizer dropped) once no pod
    of it holds resources: a terminating pod, or a worker cleanPodPolicy keeps running, still
    holds its GPUs, so Kueue must not hand them to another job yet."""
    if any(p.get("status", {}).get("phase") not in TERMINAL for p in plan.snap.pods):
        return
    plan.out.actions += kueue.finish_actions(plan.snap.workload,
                                             st.data.get("phase") == "Succeeded", st.stamp) + \
        kueue.release_actions(plan.snap.workload_slice)


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
    _delete_pods(plan, pods)  # first: see model._stop
    if launcher and not launcher["metadata"].get("deletionTimestamp"):
        plan.delete(launcher)
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
