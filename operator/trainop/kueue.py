"""Kueue decides admission for jobs that name a LocalQueue (`spec.queue`) when Kueue is installed.

The operator does what Kueue's jobframework does for its built-in integrations, for a kind Kueue
does not know: it creates one Workload per job (owned by the job) whose podSets are the gang's
pods, waits, with no pod created, until Kueue admits it (condition QuotaReserved and Admitted),
then starts the gang. The Workload's priority is the class `spec.priorityClassName` names
(priority.py): `spec.priorityClassRef` and its value in `spec.priority`, as jobframework writes
them for Kueue's own kinds (the Workload's schema requires the value with the reference).
When the job finishes it marks the Workload Finished and drops Kueue's
finalizer so the quota is released at once.

    kueue.manages(body)                  # spec.queue set and the Workload API served
    kueue.render_workload(job, queue, prio)  # pure: the Workload manifest
    kueue.decide(job, body, prio)        # Decision (creates the Workload if missing)
    kueue.finish(namespace, job_name)    # the job Succeeded/Failed: release the quota
    kueue.release(namespace, job_name)   # the job was suspended: give the quota back

Not done: Kueue's flavor assignment (nodeSelector of the admitted ResourceFlavor) is not copied
onto the pods (the job's own node pool selects the nodes), and an eviction of an admitted
Workload (preemption) does not stop a running gang.
"""

from __future__ import annotations

import threading
import time

from kubernetes.client.exceptions import ApiException

from trainop import conditions, kube
from trainop import priority as priorities
from trainop.admission import ADMITTED, QUEUED, Decision, gang_pods
from trainop.render import common
from trainop.spec import Job

GROUP, VERSION = "kueue.x-k8s.io", "v1beta2"
API_VERSION = f"{GROUP}/{VERSION}"
FINALIZER = f"{GROUP}/resource-in-use"
RECHECK_SECONDS = 30.0  # how long "Kueue is not installed" is believed

_lock = threading.Lock()
_served: tuple[bool, float] | None = None


def installed() -> bool:
    """Is Kueue's Workload API served? (cached; a positive answer for good)"""
    global _served
    with _lock:
        if _served and (_served[0] or time.monotonic() - _served[1] < RECHECK_SECONDS):
            return _served[0]
        try:
            kube.request("GET", f"/apis/{API_VERSION}")
            found = True
        except ApiException as exc:
            if exc.status != 404:
                raise
            found = False
        _served = (found, time.monotonic())
        return found


def manages(body: dict) -> bool:
    return bool((body.get("spec") or {}).get("queue")) and installed()


def workload_name(job_name: str) -> str:
    return f"dtj-{job_name}"


def render_workload(job: Job, queue: str,
                    prio: priorities.Priority = priorities.NONE) -> dict:
    """One podSet for the workers (count = workers) and one for the MPI launcher; `job` is
    bound to `prio` (priority.bind), so a PriorityClass is also on the pod templates."""
    pods = gang_pods(job)
    sets = [("workers", job.workers, pods[0])]
    if job.launcher == "mpi":
        sets.append(("launcher", 1, pods[-1]))
    spec: dict = {"queueName": queue, "podSets": [
        {"name": name, "count": count,
         "template": {"metadata": {"labels": dict(pod["metadata"].get("labels") or {})},
                      "spec": pod["spec"]}}
        for name, count, pod in sets]}
    if prio.ref is not None:
        spec["priorityClassRef"] = prio.ref
    spec["priority"] = prio.value
    return {"apiVersion": API_VERSION, "kind": "Workload",
            "metadata": common.metadata(workload_name(job.name), job.namespace,
                                        common.labels(job.name)),
            "spec": spec}


def decide(job: Job, body: dict, prio: priorities.Priority = priorities.NONE) -> Decision:
    spec = body.get("spec") or {}
    wl = kube.ensure(render_workload(job, spec["queue"], prio), owner=body, update=False)
    conds = (wl.get("status") or {}).get("conditions")
    if conditions.is_true(conds, "Admitted"):
        cq = ((wl.get("status") or {}).get("admission") or {}).get("clusterQueue", "?")
        return Decision(ADMITTED, "KueueAdmitted",
                        f"Workload {wl['metadata']['name']} admitted by ClusterQueue {cq}")
    why = conditions.get_condition(conds, "QuotaReserved") or {}
    return Decision(QUEUED, "WaitingForKueue",
                    f"Workload {wl['metadata']['name']} waits in LocalQueue {spec['queue']}: "
                    f"{why.get('message') or 'not admitted yet'}")


def finish(namespace: str, job_name: str, succeeded: bool) -> None:
    """Mark the job's Workload Finished and drop Kueue's finalizer (jobframework's ending)."""
    name = workload_name(job_name)
    wl = kube.get(API_VERSION, "Workload", name, namespace)
    if wl is None:
        return
    conds = (wl.get("status") or {}).get("conditions") or []
    if not conditions.is_true(conds, "Finished"):
        done = conditions.set_condition(
            conds, "Finished", True, "Succeeded" if succeeded else "Failed",
            "the DistributedTrainingJob " + ("succeeded" if succeeded else "failed"))
        kube.patch(API_VERSION, "Workload", name, namespace, {"status": {"conditions": done}},
                   subresource="status")
    _drop_finalizer(wl)


def release(namespace: str, job_name: str) -> None:
    """The job was suspended: delete its Workload (its quota goes back to the ClusterQueue);
    resuming creates a new one, which queues again."""
    wl = kube.get(API_VERSION, "Workload", workload_name(job_name), namespace)
    if wl is not None:
        _drop_finalizer(wl)
        kube.delete(API_VERSION, "Workload", wl["metadata"]["name"], namespace,
                    uid=wl["metadata"]["uid"])


def _drop_finalizer(wl: dict) -> None:
    """Kueue keeps its finalizer on an admitted Workload until the job's controller (for a
    kind it knows) lets go; for ours, trainop does."""
    if FINALIZER in (wl["metadata"].get("finalizers") or []):
        rest = [f for f in wl["metadata"]["finalizers"] if f != FINALIZER]
        kube.patch(API_VERSION, "Workload", wl["metadata"]["name"], wl["metadata"]["namespace"],
                   {"metadata": {"finalizers": rest or None,
                                 "resourceVersion": wl["metadata"]["resourceVersion"]}})
