"""The caches the operator's own watches feed (informer.py says why not kopf's), and the routing
of their changes (kopf's routers do the same for the other kinds: handlers/indexes.py).

    index            key                      value
    dtj_pods         (ns, job-name)           a job's pods (its workers and its launcher Job's
                                              pod), slimmed to what decide reads (slim_pod)
    dtj_children     (ns, job-name, kind)     its launcher batch/v1 Job ("Job": with its status),
                                              its headless Services ("Service"), its hostfile and
                                              progress ConfigMaps ("ConfigMap": only the keys
                                              decide reads, each at most MAX_PROGRESS_VALUE; only
                                              these two names, controlled by a job), its
                                              NetworkPolicy ("NetworkPolicy", restored if
                                              edited/deleted)
    stage_servers    (ns, stage)              a DataStage's Ganesha server pod, with its
                                              CLIENTS_ANNOTATION
    stage_readers    (ns, stage)              the running pods labelled LABEL_READS_STAGE with the
                                              DataStage's name: {podIP, nodeName} (the export's
                                              clients: render/datastage.py export_clients)

Each index maps a key to a Store: the objects under it by uid, iterated as the objects (as
kopf's index stores are, so the controller reads both alike). WATCHED says what is watched
and with which label selector.

Routing: a job's pod or child wakes its job (a pod also the namespace's queue when it ends or
goes: what frees GPUs no quota counts); a DataStage's server pod wakes the DataStage; a pod
that starts or stops reading a DataStage, or moves, or gets its address, wakes the DataStage
(the cache remembers each pod's reading, so a pod whose label went is seen too).
"""

from __future__ import annotations

from types import SimpleNamespace

from trainop import GROUP, phases
from trainop.handlers.indexes import LABEL_JOB, LABEL_STAGE, slim_obj
from trainop.jobsync.starting import NOT_STARTING
from trainop.render import common
from trainop.render import datastage as render_stage
from trainop.render import dtj as render_dtj
from trainop.render import logship as render_logship
from trainop.render.fabric import PREFLIGHT
from trainop.resume import CHECKPOINT_KEY

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


# What decide reads of the progress ConfigMap (render/logship.py, resume.py), each value at most
# this long (the shipper writes a few hundred bytes): the rest (the history `trainop describe`
# draws, anything a user adds) is not held in the operator's memory.
PROGRESS_KEYS = (render_logship.PROGRESS_KEY, CHECKPOINT_KEY)
MAX_PROGRESS_VALUE = 4096


def _jobs_config_map(body) -> bool:
    """One of the two ConfigMaps a job has (its hostfile, its progress), controlled by a job.
    Anyone who may create ConfigMaps can put the job-name label on one: without this a flood of
    labelled ConfigMaps would fill the shared operator's memory (issue 22 M7)."""
    meta = body["metadata"]
    job = SimpleNamespace(name=meta["labels"][LABEL_JOB])  # what the name renderers read
    if meta["name"] not in (render_dtj.config_map_name(job), render_logship.progress_name(job)):
        return False
    return any(ref.get("controller") and ref.get("kind") == "DistributedTrainingJob"
               and str(ref.get("apiVersion", "")).startswith(f"{GROUP}/")
               for ref in meta.get("ownerReferences") or [])


def _slim_config_map(body) -> dict | None:
    if not _jobs_config_map(body):
        return None  # not indexed (and dropped if it was)
    if body["metadata"]["labels"].get(common.LABEL_ROLE) == render_logship.PROGRESS_ROLE:
        data = {k: v for k, v in (body.get("data") or {}).items()
                if k in PROGRESS_KEYS and isinstance(v, str) and len(v) <= MAX_PROGRESS_VALUE}
        return slim_obj(body, data=data)
    return slim_obj(body)


def slim_child(body) -> dict | None:
    """A job's launcher Job, Service, ConfigMap or NetworkPolicy as dtj_children keeps it (None:
    a ConfigMap that is not one of the job's two)."""
    kind = body.get("kind")
    if kind == "ConfigMap":
        return _slim_config_map(body)
    if kind == "Job":  # the launcher
        return slim_obj(body, status=dict(body.get("status") or {}))
    return slim_obj(body)


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


class Store(dict):
    """One key's objects, by uid; iterated as the objects (kopf's index stores are)."""

    def __iter__(self):
        return iter(self.values())


class Cache:
    """Indexes fed by the operator's own watches (informer.Watches), in the event loop (and by
    the test harness, event by event): `entries(body)` says where an object goes, `route` whom
    its change wakes."""

    INDEXES: tuple[str, ...] = ()

    def __init__(self, controller, whole: bool = False) -> None:
        # whole: objects kept as they came, not slimmed (the test harness: that slimming loses
        # nothing decide reads)
        self.ctl, self.whole = controller, whole
        self.ix: dict[str, dict[tuple, Store]] = {name: {} for name in self.INDEXES}
        self.held: dict[str, tuple[dict, list]] = {}  # uid -> (its last kept form, its entries)

    def entries(self, body) -> tuple[dict | None, list[tuple[str, tuple, dict]]]:
        """(what is kept of it, [(index, key, value)]): nothing for an object of no interest."""
        raise NotImplementedError

    def route(self, kind: str, body: dict, before: list, after: list) -> None:
        raise NotImplementedError

    def observe(self, kind: str, body: dict) -> None:
        """One watch event (ADDED, MODIFIED, DELETED)."""
        uid = body["metadata"]["uid"]
        _, before = self.held.pop(uid, (None, []))
        for index, key, _ in before:
            store = self.ix[index][key]
            store.pop(uid, None)
            if not store:
                del self.ix[index][key]
        after: list = []
        if kind != "DELETED":
            kept, after = self.entries(body)
            for index, key, value in after:
                self.ix[index].setdefault(key, Store())[uid] = value
            if after:
                self.held[uid] = (kept, after)
        self.route(kind, body, before, after)

    def replace(self, namespace: str | None, items: list[dict], kind: str) -> None:
        """A whole list of the namespace's (None: every namespace's) objects of `kind`: each is
        observed, and those held that it lacks went while no watch ran (deleted, as client-go's
        informers report them: with their last state known)."""
        listed = {i["metadata"]["uid"] for i in items}
        gone = [obj for uid, (obj, _) in self.held.items() if uid not in listed
                and obj.get("kind") == kind and namespace in (None, obj["metadata"].get("namespace"))]
        for obj in gone:
            self.observe("DELETED", obj)
        for item in items:
            self.observe("MODIFIED" if item["metadata"]["uid"] in self.held else "ADDED", item)


class PodCache(Cache):
    """dtj_pods, stage_servers, stage_readers."""

    INDEXES = ("dtj_pods", "stage_servers", "stage_readers")

    def entries(self, body):
        meta = body["metadata"]
        labels = meta.get("labels") or {}
        if labels.keys().isdisjoint(LABELS):
            return None, []
        ns, slim = meta.get("namespace"), body if self.whole else slim_pod(body)
        job, server = owners(labels)
        out = []
        if job:
            out.append(("dtj_pods", (ns, job), slim))
        if server:
            out.append(("stage_servers", (ns, server), slim_server(body)))
        found = reading(body)
        if found:
            out.append(("stage_readers", (ns, found[0]), {"podIP": found[1], "nodeName": found[2]}))
        return slim, out

    def route(self, kind, body, before, after):
        ctl, ns = self.ctl, body["metadata"].get("namespace")
        # its owners by its labels now and by those it had (a pod deleted before it was ever
        # seen has no entries; one whose label was taken off had them)
        job, server = owners(body["metadata"].get("labels") or {})
        jobs = {key[1] for index, key, _ in before if index == "dtj_pods"} | ({job} if job else set())
        if jobs:
            ctl.applier.seen("Pod", body)  # the index has it now
        for name in jobs:
            if kind == "DELETED":  # its last state says why it went (jobsync: departed)
                ctl.pod_departed(ns, name, slim_pod(body))
            ctl.enqueue_job(ns, name)
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


class ChildCache(Cache):
    """dtj_children: a job's launcher Job, Services, ConfigMaps and NetworkPolicy."""

    INDEXES = ("dtj_children",)

    def entries(self, body):
        meta = body["metadata"]
        job = (meta.get("labels") or {}).get(LABEL_JOB)
        slim = slim_child(body) if job else None
        if slim is None:
            return None, []
        slim = body if self.whole else slim
        return slim, [("dtj_children", (meta.get("namespace"), job, body.get("kind")), slim)]

    def route(self, kind, body, before, after):
        meta = body["metadata"]
        job = (meta.get("labels") or {}).get(LABEL_JOB)
        self.ctl.applier.seen(body.get("kind"), body)  # (a launcher Job it created)
        for name in {key[1] for _, key, _ in before} | ({job} if job else set()):
            self.ctl.enqueue_job(meta.get("namespace"), name)


# What the operator's own watches list and watch: (apiVersion, kind, label selector, the class
# of the cache that keeps them: one instance each, Controller.caches).
WATCHED = (("v1", "Pod", None, PodCache),
           ("batch/v1", "Job", LABEL_JOB, ChildCache),
           ("v1", "Service", LABEL_JOB, ChildCache),
           ("v1", "ConfigMap", LABEL_JOB, ChildCache),
           ("networking.k8s.io/v1", "NetworkPolicy", LABEL_JOB, ChildCache))


def watches(instances: dict) -> list[tuple]:
    """WATCHED with each cache class replaced by its instance in `instances` (class -> cache)."""
    return [(api_version, kind, selector, instances[cls]) for api_version, kind, selector, cls in WATCHED]
