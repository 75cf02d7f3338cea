"""The pods the operator reads, kept from its own watch of them (informer.py says why not
kopf's), and the routing of their changes (kopf's routers do the same for every other kind:
handlers/indexes.py).

    index            key                 value
    dtj_pods         (ns, job-name)      a job's pods (its workers and its launcher Job's pod),
                                         slimmed to what decide reads (slim_pod)
    stage_servers    (ns, stage)         a DataStage's Ganesha server pod, with its
                                         CLIENTS_ANNOTATION
    stage_readers    (ns, stage)         the running pods labelled LABEL_READS_STAGE with the
                                         DataStage's name: {podIP, nodeName} (the export's
                                         clients: render/datastage.py export_clients)

Each index maps a key to a Store: the pods under it by uid, iterated as the pods (as kopf's
index stores are, so the controller reads both alike).

Routing: a job's pod wakes its job (and the namespace's queue when it ends or goes: what frees
GPUs no quota counts); a DataStage's server pod wakes the DataStage; a pod that starts or stops
reading a DataStage, or moves, or gets its address, wakes the DataStage (the cache remembers
each pod's reading, so a pod whose label went is seen too).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from trainop import phases
from trainop.handlers.indexes import LABEL_JOB, LABEL_STAGE, slim_obj
from trainop.jobsync.starting import NOT_STARTING
from trainop.render import datastage as render_stage
from trainop.render.fabric import PREFLIGHT

INDEXES = ("dtj_pods", "stage_servers", "stage_readers")
LABELS = (LABEL_JOB, LABEL_STAGE, render_stage.LABEL_READS_STAGE)  # a pod without any: not held


def _containers(items) -> list[dict]:
    return [{k: c[k] for k in ("name", "resources", "restartPolicy") if k in c} for c in items or []]


def _short_waiting(state: dict) -> dict:
    """A container state with a waiting message of at most 1 KiB (an image pull's can be long)."""
    waiting = state.get("waiting")
    if not waiting or len(waiting.get("message") or "") <= 1024:
        return state
    return {**state, "waiting": {**waiting, "message": waiting["message"][:1024]}}


def slim_pod(body) -> dict:
    spec, st = body.get("spec") or {}, body.get("status") or {}
    out_spec = {"containers": _containers(spec.get("containers")),
                "initContainers": _containers(spec.get("initContainers"))}
    for key in ("activeDeadlineSeconds", "priorityClassName", "nodeName"):
        if spec.get(key) is not None:
            out_spec[key] = spec[key]
    # the DataStage claim it mounts: a started job keeps it even if the DataStage goes (jobsync)
    data = [v for v in spec.get("volumes") or [] if v.get("name") == "data" and v.get("persistentVolumeClaim")]
    if data:
        out_spec["volumes"] = [{"name": "data", "persistentVolumeClaim": {
            "claimName": data[0]["persistentVolumeClaim"].get("claimName")}}]
    out_status = {k: st[k] for k in ("phase", "reason", "podIP") if k in st}  # (podIP: the
    # launcher's hostAliases, jobsync/gang.py)
    if st.get("reason") == "Evicted" and st.get("message"):  # a storage-limit eviction counts
        out_status["message"] = st["message"][:1024]            # (jobsync/failures.py): short
    # reasons too: PodScheduled's Unschedulable (WaitingForNodes), DisruptionTarget's cause;
    # and when: schedulingTimeoutSeconds counts from PodScheduled=False's lastTransitionTime
    # (jobsync._waiting_since), whatever the job's cached status says
    out_status["conditions"] = [
        {k: c[k] for k in ("type", "status", "reason", "lastTransitionTime") if k in c}
        for c in st.get("conditions") or []]
    out_status["containerStatuses"] = [
        {k: _short_waiting(cs[k]) if k == "state" else cs[k] for k in ("name", "state", "lastState") if k in cs}
        for cs in st.get("containerStatuses") or []]
    # the preflight's result is its termination message (preflight.py; at most 4 KiB); of the
    # other init containers only why one cannot start (jobsync/starting.py)
    inits = []
    for cs in st.get("initContainerStatuses") or []:
        if cs.get("name") == PREFLIGHT:
            inits.append({k: cs[k] for k in ("name", "state", "lastState") if k in cs})
        elif ((cs.get("state") or {}).get("waiting") or {}).get("reason") in NOT_STARTING:
            inits.append({"name": cs.get("name"), "state": _short_waiting(cs["state"])})
    if inits:
        out_status["initContainerStatuses"] = inits
    return slim_obj(body, spec=out_spec, status=out_status)


def slim_server(body) -> dict:
    annotations = body["metadata"].get("annotations") or {}
    slim = slim_obj(body)
    slim["metadata"]["annotations"] = {k: annotations[k] for k in (render_stage.CLIENTS_ANNOTATION,)
                                       if k in annotations}
    return slim


def reading(body) -> tuple[str, str, str] | None:
    """What a pod reads: (its DataStage, pod IP, node name), "" while unknown; None for a pod
    that is no reader, or a finished one (its address goes back to the pool, and another
    namespace's pod may get it)."""
    stage = (body["metadata"].get("labels") or {}).get(render_stage.LABEL_READS_STAGE)
    if not stage or phases.finished(body):
        return None
    return stage, (body.get("status") or {}).get("podIP") or "", (body.get("spec") or {}).get("nodeName") or ""


def owners(labels: dict) -> tuple[str | None, str | None]:
    """By its labels: the job a pod is of, the DataStage it is the server of."""
    server = labels.get(LABEL_STAGE) if labels.get(render_stage.LABEL_ROLE) == "nfs-server" else None
    return labels.get(LABEL_JOB), server


def entries(body, slim: dict) -> list[tuple[str, tuple, dict]]:
    """(index, key, value) of every index entry a pod makes (none for a pod of no interest);
    `slim` is its slim_pod."""
    meta = body["metadata"]
    ns = meta.get("namespace")
    job, server = owners(meta.get("labels") or {})
    out = []
    if job:
        out.append(("dtj_pods", (ns, job), slim))
    if server:
        out.append(("stage_servers", (ns, server), slim_server(body)))
    found = reading(body)
    if found:
        out.append(("stage_readers", (ns, found[0]), {"podIP": found[1], "nodeName": found[2]}))
    return out


class Store(dict):
    """One key's pods, by uid; iterated as the pods (kopf's index stores are)."""

    def __iter__(self):
        return iter(self.values())


class PodCache:
    """The three indexes, and the routing of each change to the controller's wake-ups. Fed by
    informer.PodWatches in the event loop (and by the test harness, event by event). `slim`:
    what a job's pod is kept as (the harness keeps whole pods to test that slimming loses
    nothing decide reads)."""

    def __init__(self, controller, slim: Callable[[dict], dict] = slim_pod) -> None:
        self.ctl, self.slim = controller, slim
        self.ix: dict[str, dict[tuple, Store]] = {name: {} for name in INDEXES}
        self.held: dict[str, tuple[dict, list]] = {}  # uid -> (its last slim pod, its entries)
        self.synced = asyncio.Event()  # every first list is in (informer.PodWatches)

    def observe(self, kind: str, body: dict) -> None:
        """One watch event (ADDED, MODIFIED, DELETED) of a pod."""
        uid = body["metadata"]["uid"]
        _, before = self.held.pop(uid, (None, []))
        for index, key, _ in before:
            store = self.ix[index][key]
            store.pop(uid, None)
            if not store:
                del self.ix[index][key]
        after = []
        labels = body["metadata"].get("labels") or {}
        if kind != "DELETED" and not labels.keys().isdisjoint(LABELS):  # else of no interest
            slim = self.slim(body)
            after = entries(body, slim)
            for index, key, value in after:
                self.ix[index].setdefault(key, Store())[uid] = value
            if after:
                self.held[uid] = (slim, after)
        self._route(kind, body, before, after)

    def replace(self, namespace: str | None, items: list[dict]) -> None:
        """A whole list of the namespace's (None: every namespace's) pods: each is observed,
        and the pods held that it lacks went while no watch ran (deleted, as client-go's
        informers report them: with their last state known)."""
        listed = {i["metadata"]["uid"] for i in items}
        gone = [pod for uid, (pod, _) in self.held.items() if uid not in listed
                and namespace in (None, pod["metadata"].get("namespace"))]
        for pod in gone:
            self.observe("DELETED", pod)
        for item in items:
            self.observe("MODIFIED" if item["metadata"]["uid"] in self.held else "ADDED", item)

    def _route(self, kind: str, body: dict, before: list, after: list) -> None:
        ctl, ns = self.ctl, body["metadata"].get("namespace")
        # its owners by its labels now and by those it had (a pod deleted before it was ever
        # seen has no entries; one whose label was taken off had them)
        job, server = owners(body["metadata"].get("labels") or {})
        jobs = {key[1] for index, key, _ in before if index == "dtj_pods"} | ({job} if job else set())
        if jobs:
            ctl.applier.seen("Pod", body)  # the index has it now
        for job in jobs:
            if kind == "DELETED":  # its last state says why it went (jobsync: departed)
                ctl.pod_departed(ns, job, slim_pod(body))
            ctl.enqueue_job(ns, job)
        if jobs and (kind == "DELETED" or phases.finished(body)):
            ctl.wake_gate(ns)  # what frees GPUs no quota counts
        stages = {key[1] for index, key, _ in before if index == "stage_servers"} | \
            ({server} if server else set())
        readings = [{(key[1], v["podIP"], v["nodeName"]) for index, key, v in side
                     if index == "stage_readers"} for side in (before, after)]
        if readings[0] != readings[1]:  # its DataStage's export serves its address
            stages |= {r[0] for r in readings[0] | readings[1]}
        for stage in stages:
            ctl.enqueue_stage(ns, stage)
