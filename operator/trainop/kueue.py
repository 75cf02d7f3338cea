"""Kueue decides admission for jobs that name a LocalQueue (`spec.queue`) when Kueue is installed.

The operator does for its kind what Kueue's jobframework (pkg/controller/jobframework/
reconciler.go) does for the kinds Kueue knows:
- one Workload per job (owned by the job), whose podSets are the gang's pods; no pod exists
  until Kueue admits it (QuotaReserved and Admitted). Its priority is the class
  `spec.priorityClassName` names (priority.py): `spec.priorityClassRef` and `spec.priority`.
- on admission, the admitted ResourceFlavors' `nodeLabels` and `tolerations` go onto each pod
  set's pods (`place`, Kueue's podset.FromAssignment + Merge: a label that contradicts the
  job's own nodeSelector is an error, not an override).
- while the gang runs, `PodsReady` on the Workload says whether every pod is Ready (what
  Kueue's waitForPodsReady waits for; `pods_ready_patch`, generatePodsReadyCondition).
- when Kueue evicts the Workload (preemption, a PodsReady timeout, a stopped queue) or takes
  its admission back, the gang stops and the job queues again (`stop_reason`); once its pods are
  gone, the quota reservation is released (`requeue_patch`: Requeued, QuotaReserved=False
  "Pending", no admission), so Kueue can admit it again later.
- a finished job marks its Workload Finished and drops Kueue's finalizer (`finish_actions`); a
  suspended one deletes it (`release_actions`); both only once no pod of the job holds GPUs
  any more (a terminating pod, or a worker kept by cleanPodPolicy None, still does).
- the shape is frozen from admission: a job whose pods no longer match its Workload
  (`mismatch`) gets a new Workload before any pod is created; an admitted one is never
  stretched.

    kueue.manages(body)                      # spec.queue set and the Workload API served
    kueue.render_workload(job, queue, prio)  # pure: the Workload manifest
    kueue.decide(job, body, workload)        # pure: Decision from the cached Workload
    kueue.mismatch(job, prio, workload)      # pure: the job no longer matches its Workload
    kueue.stop_reason(workload)              # pure: why an admitted job must stop, or None
    kueue.requeue_patch(workload, now)       # pure: give the evicted quota back, or None
    kueue.pods_ready_patch(workload, ready, now)  # pure: the PodsReady condition, or None
    kueue.place(job, workload, flavors)      # pure: the job with its admitted flavors
    kueue.finish_actions(wl, succeeded, now) # pure: the job ended and its pods are gone
    kueue.release_actions(wl)                # pure: suspended and its pods are gone

Admission and eviction are judged from the same watch cache of Workloads (handlers/indexes.py),
so a later reconcile never sees an older Workload than the one that admitted the job.
"""

from __future__ import annotations

import dataclasses

from trainop import conditions, kube
from trainop import priority as priorities
from trainop.actions import Delete, Patch, PatchStatus, Ref, SetFinalizers
from trainop.admission import ADMITTED, QUEUED, Decision, pod_sets, shape
from trainop.memo import Memos
from trainop.render import common
from trainop.render import dtj as render
from trainop.spec import FlavorPlacement, Job, SpecError

GROUP, VERSION = "kueue.x-k8s.io", "v1beta2"
API_VERSION = f"{GROUP}/{VERSION}"
FINALIZER = f"{GROUP}/resource-in-use"
def installed() -> bool:
    """Is Kueue's Workload API served? (kube.served: cached)"""
    return kube.served(API_VERSION)


def manages(body: dict) -> bool:
    return bool((body.get("spec") or {}).get("queue")) and installed()


def workload_name(job_name: str) -> str:
    return f"dtj-{job_name}"


# Kueue's workload slices (pkg/workloadslicing, feature gate ElasticJobsViaWorkloadSlices, alpha
# since v0.13): a Workload marked elastic may lower its pod sets' counts while admitted (the
# webhook's validateImmutablePodSet lets a count go down, the workload controller updates the
# usage in its cache); a bigger size is a new Workload naming the one it replaces, which the
# scheduler admits counting the old one's usage as its own, then finishes the old one
# (Finished, reason WorkloadSliceReplaced).
ELASTIC_ANNOTATION = "kueue.x-k8s.io/elastic-job"
REPLACES_ANNOTATION = "kueue.x-k8s.io/workload-slice-replacement-for"
SLICE_REPLACED = "WorkloadSliceReplaced"


def slice_name(job_name: str, attempt: int) -> str:
    """The replacement slice for the attempt that will run at the bigger size."""
    return f"dtj-{job_name}-a{attempt}"


def render_workload(job: Job, queue: str, prio: priorities.Priority = priorities.NONE,
                    memo: Memos | None = None, slices: bool = False,
                    replaces: dict | None = None, attempt: int = 0) -> dict:
    """One podSet for the workers (count = workers) and one for the MPI launcher; `job` is
    bound to `prio` (priority.bind), so a PriorityClass is also on the pod templates.
    `slices`: an elastic job's Workload is marked elastic (kueue.workloadSlices); `replaces`:
    the admitted Workload a bigger slice replaces (named for `attempt`)."""
    spec: dict = {"queueName": queue, "podSets": pod_sets(job, memo)}
    if prio.ref is not None:
        spec["priorityClassRef"] = prio.ref
    spec["priority"] = prio.value
    name = slice_name(job.name, attempt) if replaces else workload_name(job.name)
    meta = common.metadata(name, job.namespace, common.labels(job.name))
    if slices and job.elastic is not None:
        meta["annotations"] = {ELASTIC_ANNOTATION: "true"}
        if replaces:
            meta["annotations"][REPLACES_ANNOTATION] = \
                f"{replaces['metadata']['namespace']}/{replaces['metadata']['name']}"
    return {"apiVersion": API_VERSION, "kind": "Workload", "metadata": meta, "spec": spec}


def pick(workloads: list[dict]) -> tuple[dict | None, dict | None, list[dict]]:
    """The job's Workloads (controlled by it) as (the one it runs on, a bigger slice waiting
    for admission, slices Kueue replaced). The newest admitted slice wins: Kueue admits a
    replacement before it finishes the old one."""
    done = [w for w in workloads if conditions.is_true(_conds(w), "Finished")]
    replaced = [w for w in done if (conditions.get_condition(_conds(w), "Finished") or {})
                .get("reason") == SLICE_REPLACED]
    live = sorted((w for w in workloads if w not in done),
                  key=lambda w: (w["metadata"].get("creationTimestamp") or "", w["metadata"]["name"]))
    slices = [w for w in live if REPLACES_ANNOTATION in (w["metadata"].get("annotations") or {})]
    admitted_slices = [w for w in slices if admitted(w)]
    if admitted_slices:
        return admitted_slices[-1], None, replaced
    base = [w for w in live if w not in slices]
    if base:
        return base[0], (slices[-1] if slices else None), replaced
    return (slices[-1] if slices else (done[-1] if len(done) > len(replaced) else None)), None, replaced


def worker_count(wl: dict | None) -> int | None:
    """The workers' pod set count of a Workload."""
    for ps in ((wl or {}).get("spec") or {}).get("podSets") or []:
        if ps.get("name") == render.WORKER_POD_SET:
            return ps.get("count")
    return None


def scale_down(wl: dict, workers: int) -> Patch:
    """An elastic Workload's workers' count lowered in place (workload slices): that one item
    (a merge patch would replace the pod sets' whole list, and the cache holds them slimmed),
    only if the pod set is still where and what the cache saw."""
    i, ps = next((i, ps) for i, ps in enumerate(wl["spec"]["podSets"])
                 if ps.get("name") == render.WORKER_POD_SET)
    at = f"/spec/podSets/{i}"
    return Patch(Ref.of(wl), [{"op": "test", "path": f"{at}/name", "value": ps["name"]},
                              {"op": "test", "path": f"{at}/count", "value": ps["count"]},
                              {"op": "replace", "path": f"{at}/count", "value": workers}])


def _conds(wl: dict | None) -> list[dict]:
    return ((wl or {}).get("status") or {}).get("conditions") or []


def admitted(wl: dict | None) -> bool:
    """Kueue admits it now: Admitted and QuotaReserved, and not being evicted."""
    conds = _conds(wl)
    return conditions.is_true(conds, "Admitted") and conditions.is_true(conds, "QuotaReserved") \
        and not conditions.is_true(conds, "Evicted")


def decide(job: Job, body: dict, workload: dict | None) -> Decision:
    """Pure: admission from `workload`, the job's Workload as the watch cache holds it. None:
    not seen yet; jobsync then creates it (a Create action) and the job is judged once the
    cache has it (its event wakes the job), which keeps admission and eviction on one view."""
    queue = (body.get("spec") or {}).get("queue")
    name = workload_name(job.name)
    if workload is None:
        return Decision(QUEUED, "WaitingForKueue",
                        f"Workload {name} waits in LocalQueue {queue}: being created")
    conds = _conds(workload)
    if admitted(workload):
        cq = ((workload.get("status") or {}).get("admission") or {}).get("clusterQueue", "?")
        return Decision(ADMITTED, "KueueAdmitted",
                        f"Workload {name} admitted by ClusterQueue {cq}")
    why = conditions.get_condition(conds, "QuotaReserved") or {}
    if conditions.is_true(conds, "QuotaReserved"):  # evicted: the stopped gang gives it back
        why = conditions.get_condition(conds, "Evicted") or why
    return Decision(QUEUED, "WaitingForKueue",
                    f"Workload {name} waits in LocalQueue {queue}: "
                    f"{why.get('message') or 'not admitted yet'}")


def mismatch(job: Job, prio: priorities.Priority, wl: dict,
             memo: Memos | None = None) -> str | None:
    """Why the job's pods no longer match what its Workload asked Kueue for (None: they match).
    A job edited while queued must never run on the room Kueue admitted for its old shape:
    jobsync deletes such a Workload before any pod exists and a new one queues (Kueue's
    jobframework ensureOneWorkload does the same for the kinds it knows)."""
    want = shape(render_workload(job, "", prio, memo)["spec"]["podSets"])
    have = shape((wl.get("spec") or {}).get("podSets"))
    if want == have:
        return None
    counts = lambda shape: ", ".join(f"{n}×{c}" for n, c, _ in shape)  # noqa: E731
    return (f"the job's pods ({counts(want)}) no longer match Workload "
            f"{wl['metadata']['name']} ({counts(have)}, or their resources differ)")


# ---- the admitted job's lifecycle (pure: decisions on the cached Workload) ----------------

def stop_reason(wl: dict | None) -> tuple[str, str] | None:
    """Why a job Kueue had admitted must stop its gang and queue again, as (reason, message)
    for its conditions; None while Kueue still admits it. Reasons: Preempted (Kueue evicted
    it for a higher priority or a cohort's reclaim), Evicted (any other eviction: PodsReady
    timeout, a stopped queue, an admission check, node failures), NotAdmitted (the admission
    was withdrawn without an eviction), WorkloadDeleted (someone deleted the Workload)."""
    if wl is None:
        return ("WorkloadDeleted", "its Kueue Workload was deleted; a new one queues for "
                "admission")
    name, conds = wl["metadata"]["name"], _conds(wl)
    evicted = conditions.get_condition(conds, "Evicted")
    if evicted and evicted.get("status") == "True":
        kind = evicted.get("reason") or "Evicted"
        return ("Preempted" if kind == "Preempted" else "Evicted",
                f"Kueue evicted Workload {name} ({kind}): {evicted.get('message') or kind}")
    if not admitted(wl):
        cond = conditions.get_condition(conds, "QuotaReserved") or \
            conditions.get_condition(conds, "Admitted") or {}
        return ("NotAdmitted", f"Kueue no longer admits Workload {name}: "
                               f"{cond.get('message') or 'its admission was removed'}")
    return None


def _set(wl: dict, conds: list[dict], type_: str, status: bool, reason: str, message: str,
         stamp: str) -> list[dict]:
    return conditions.set_condition(conds, type_, status, reason, message[:32768],
                                    generation=wl["metadata"].get("generation"), timestamp=stamp)


def _status_patch(wl: dict, status: dict) -> dict:
    # A merge patch replaces the whole list: the resourceVersion makes the API server refuse it
    # (409) if Kueue wrote the Workload since the cache saw it; the next event decides again.
    return {"metadata": {"resourceVersion": wl["metadata"]["resourceVersion"]}, "status": status}


def requeue_patch(wl: dict | None, now: str) -> dict | None:
    """The evicted job's pods are gone: release its quota reservation as the jobframework does
    for a stopped job (Requeued, True after a preemption or node failures; QuotaReserved=False
    "Pending"; Admitted=False; no admission), so that Kueue queues the Workload again. None when
    there is nothing to release."""
    conds = _conds(wl)
    evicted = conditions.get_condition(conds, "Evicted")
    if wl is None or not evicted or evicted.get("status") != "True" or \
            not conditions.is_true(conds, "QuotaReserved"):
        return None
    kind, message = evicted.get("reason") or "Evicted", evicted.get("message") or ""
    out = _set(wl, conds, "Requeued", kind in ("Preempted", "NodeFailures"), kind, message, now)
    out = _set(wl, out, "QuotaReserved", False, "Pending", message, now)
    if conditions.is_true(out, "Admitted"):
        out = _set(wl, out, "Admitted", False, "NoReservation", "The workload has no reservation",
                   now)
    if conditions.get_condition(out, "PodsReady"):
        out = _set(wl, out, "PodsReady", False, "WaitForStart",
                   "Not all pods are ready or succeeded", now)
    return _status_patch(wl, {"conditions": out, "admission": None})


def pods_ready_patch(wl: dict | None, ready: bool, now: str) -> dict | None:
    """The Workload's PodsReady condition for an admitted gang (True once every pod is Ready),
    with the jobframework's reasons: Started / Recovered when True, WaitForStart before the
    first time, WaitForRecovery after a pod failed. None when the condition already says so."""
    if wl is None or not admitted(wl):
        return None
    conds = _conds(wl)
    old = conditions.get_condition(conds, "PodsReady") or {}
    if ready:
        reason = "Recovered" if old.get("reason") in ("WaitForRecovery", "Recovered") \
            else "Started"
        message = "All pods reached readiness and the workload is running"
    elif old.get("status") == "True" or old.get("reason") == "WaitForRecovery":
        reason, message = "WaitForRecovery", "At least one pod has failed, waiting for recovery"
    else:
        reason, message = "WaitForStart", "Not all pods are ready or succeeded"
    if old.get("status") == ("True" if ready else "False") and old.get("reason") == reason:
        return None
    return _status_patch(wl, {"conditions": _set(wl, conds, "PodsReady", ready, reason, message,
                                                 now)})


class FlavorMissing(LookupError):
    """An admitted flavor the caches do not hold (yet): wait for it."""


def place(job: Job, wl: dict, flavors: dict[str, dict]) -> Job:
    """`job` with the nodeLabels and tolerations of the ResourceFlavors Kueue admitted each pod
    set on (status.admission.podSetAssignments[].flavors), as Kueue's podset.FromAssignment and
    Merge apply them to the kinds it knows. SpecError when a flavor's label contradicts the
    job's own nodeSelector (Kueue's "conflicting nodeSelector"); FlavorMissing when a flavor is
    not in `flavors` (name -> ResourceFlavor)."""
    admission = (wl.get("status") or {}).get("admission") or {}
    out = []
    for assignment in admission.get("podSetAssignments") or []:
        # The pool's selector and the role's spec.podTemplate nodeSelector: judged here, at
        # admission, so a contradiction fails the job instead of every render (overrides.apply).
        role = "launcher" if assignment.get("name") == "launcher" else "worker"
        template = ((job.pod_template.get(role) or {}).get("spec") or {}).get("nodeSelector") or {}
        own = {**template, **dict(job.placement.node_selector)}
        labels: dict[str, str] = {}
        tolerations: list[dict] = []
        for name in dict.fromkeys((assignment.get("flavors") or {}).values()):
            flavor = flavors.get(name)
            if flavor is None:
                raise FlavorMissing(name)
            fspec = flavor.get("spec") or {}
            labels.update(fspec.get("nodeLabels") or {})
            tolerations += [t for t in fspec.get("tolerations") or [] if t not in tolerations]
            for key, value in (fspec.get("nodeLabels") or {}).items():
                if key in own and own[key] != value:
                    field = (f"spec.podTemplate.{role}.spec.nodeSelector"
                             if key not in job.placement.node_selector
                             else "spec.nodePool.name" if job.placement.pool
                             else "spec.nodePool.nodeSelector")
                    raise SpecError(field, (
                        f"Kueue admitted pod set {assignment.get('name')} on ResourceFlavor "
                        f"{name}, whose nodeLabels say {key}={value}, but the job's nodeSelector "
                        f"says {key}={own[key]}; choose a node pool that matches the "
                        f"ClusterQueue's flavor, or a LocalQueue whose flavors match the pool"))
        if labels or tolerations:
            out.append((assignment.get("name"), FlavorPlacement(
                tuple(sorted(labels.items())), tuple(tolerations))))
    return dataclasses.replace(job, flavors=tuple(out)) if out else job


def flavor_names(wl: dict | None) -> set[str]:
    admission = ((wl or {}).get("status") or {}).get("admission") or {}
    return {name for a in admission.get("podSetAssignments") or []
            for name in (a.get("flavors") or {}).values()}


# ---- the job's ending (pure: actions on the cached Workload) --------------------------------

def finish_actions(wl: dict | None, succeeded: bool, now: str) -> list:
    """The finished job's Workload: Finished, then Kueue's finalizer dropped (jobframework's
    ending), one step per reconcile (each write changes its resourceVersion; the Workload's
    event wakes the job for the next). jobsync asks only once no pod of the job holds its
    resources any more."""
    if wl is None:
        return []
    conds = _conds(wl)
    if not conditions.is_true(conds, "Finished"):
        done = _set(wl, conds, "Finished", True, "Succeeded" if succeeded else "Failed",
                    "the DistributedTrainingJob " + ("succeeded" if succeeded else "failed"), now)
        return [PatchStatus(Ref.of(wl), _status_patch(wl, {"conditions": done}))]
    return _drop_finalizer(wl)


def release_actions(wl: dict | None) -> list:
    """The suspended job's Workload is deleted once its pods are gone (its quota goes back to
    the ClusterQueue); resuming creates a new one, which queues again."""
    if wl is None:
        return []
    return _drop_finalizer(wl) + [Delete(Ref.of(wl))]


def _drop_finalizer(wl: dict) -> list:
    """Kueue keeps its finalizer on an admitted Workload until the job's controller (for a
    kind it knows) lets go; for ours, trainop does."""
    if FINALIZER not in (wl["metadata"].get("finalizers") or ()):
        return []
    return [SetFinalizers.dropping(wl, FINALIZER)]
