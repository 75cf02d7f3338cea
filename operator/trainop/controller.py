"""Observe -> decide -> act. kopf's indexes (handlers/indexes.py) and the caches of the
operator's own watches (handlers/caches.py, informer.py) hold the observed state and
wake keys in a work queue; workers take a key, build its snapshot from the indexes, call the
pure decide() (jobsync, stagesync), and hand the outcome to the apply layer in a thread.

Why a work queue fed by change handlers rather than a kopf daemon per job: kopf daemons and
timers need a finalizer on every object to stop them, and that finalizer is what hung namespace
deletion while the operator was down; a queue also coalesces a burst of child events into one
reconcile, keeps one object's reconciles serial, and holds deadlines (`add_after`) without a
task per job, so 500 idle jobs cost nothing but their cache entries.

Nothing polls: a reconcile runs when something it reads changed, at a deadline decide() named
(activeDeadlineSeconds, TTL), after an API error (backoff), or at the safety resync
(`safetyResyncSeconds`, minutes), which re-reads every object from the caches in case a
wake-up was ever lost.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import random
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import urllib3
from kubernetes.client.exceptions import ApiException

from trainop import (
    GROUP,
    VERSION,
    apply,
    conditions,
    gate,
    jobsync,
    kube,
    kueue,
    leader,
    metrics,
    podgroup,
    priority,
    stagesync,
)
from trainop.actions import Problem
from trainop.config import Config
from trainop.handlers import caches
from trainop.handlers.indexes import NODE_ADDRESS, NODE_LOST, NODE_POOL, NODE_TAINTED, POD_GROUPS
from trainop.memo import Memos
from trainop.render import dtj as render_dtj
from trainop.render import logship as render_logship
from trainop.spec import Nodes, SpecError, priority_class_name
from trainop.workqueue import WorkQueue

log = logging.getLogger("trainop.controller")
JOB, STAGE = "DistributedTrainingJob", "DataStage"
WORKERS = 8           # reconciles in flight (each mostly waits on the API server)
MAX_BACKOFF = 300.0   # seconds between retries of a reconcile that keeps failing
TRANSIENT_RETRIES = 6  # 2+4+8+16+32 s of an unreachable API server before it is an ERROR
DEADLINE_SLACK = 0.05  # wake a little after a deadline, never a little before it
# How long a deleted Node's pods are judged lost by this process: PodGC has deleted them well
# before (its quarantine is 40 s), and a gang restarted for them has deleted them itself.
DELETED_NODE_MEMORY_S = 600.0


def _transient(exc: Exception) -> bool:
    """The API server unreachable, restarting or overloaded (a control-plane upgrade, etcd away):
    retrying heals it. Anything else (a refusal, a bug) is an ERROR at once."""
    if isinstance(exc, ApiException):
        return not exc.status or exc.status == 429 or exc.status >= 500
    return isinstance(exc, (urllib3.exceptions.HTTPError, ConnectionError, TimeoutError))


def _rv(obj: dict | None) -> int:
    try:
        return int((obj or {}).get("metadata", {}).get("resourceVersion") or 0)
    except ValueError:  # opaque by contract; etcd's are integers
        return 0


def _controlled(obj: dict, uid: str | None) -> bool:
    return uid is not None and apply.kube.controller_uid(obj) == uid


def _with_created(cached: list[dict], created: list[dict]) -> list[dict]:
    """The cached objects and those we created that the cache does not show yet (Applier.
    created): ours replaces a cached one of its name (an earlier incarnation, another uid,
    whose deletion the watch has not shown either: our create succeeded, so it is gone)."""
    if not created:
        return cached
    names = {c["metadata"]["name"] for c in created}
    return [c for c in cached if c["metadata"]["name"] not in names] + created


class Controller:
    def __init__(self, cfg: Config, indices, leadership=None, *, whole: bool = False) -> None:
        # the caches of the operator's own watches beside kopf's indexes: one lookup for all
        # (handlers/caches.py; whole: the test harness's, of objects not slimmed)
        self.caches = {cls: cls(self, whole) for cls in (caches.PodCache, caches.ChildCache)}
        self.cfg, self.ix = cfg, {**indices, **{k: v for c in self.caches.values() for k, v in c.ix.items()}}
        self.synced = asyncio.Event()  # their first lists are in (informer.Watches)
        # only the Lease's holder reconciles (leader.py); a standby's caches stay warm
        self.leadership = leadership if leadership is not None else leader.Solo()
        self.queue = WorkQueue()
        self.applier = apply.Applier()
        self.pool = ThreadPoolExecutor(max_workers=WORKERS, thread_name_prefix="trainop-apply")
        # Events are posted here, after the reconcile that decided them has returned: a
        # courtesy to the reader of `kubectl describe`, never worth holding up the job's next
        # reconcile (two Events took 60-80 ms of a launcher's start on the 10-job benchmark).
        # One reconcile's Events stay in their order (one task each).
        self.event_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="trainop-events")
        self.written: dict[tuple, dict] = {}   # key -> the object our last status write returned
        self.problems: dict[tuple, Problem] = {}  # key -> what the last apply met (for decide)
        self.failures: dict[tuple, int] = {}   # key -> consecutive failed reconciles
        self.said: dict[tuple, tuple] = {}     # key -> (phase, waiting) last logged
        self.departed: dict[tuple, dict] = {}  # (ns, job) -> pod name -> last state (deleted)
        self.lost_seen: set[str] = set()  # nodes judged lost, until they report again (node_back)
        # node name -> (time.monotonic(), its lost verdict) for DELETED_NODE_MEMORY_S after its
        # Node was deleted (node_deleted), or until a Node of that name is added again
        self.deleted_nodes: dict[str, tuple[float, dict]] = {}
        self.pool_nodes: Nodes | None = None  # nodes(), until the next node event
        self.tasks: list[asyncio.Task] = []
        self.memo = Memos()  # what decide() may remember between reconciles (memo.py)
        self.gate = gate.Gate(self.memo)  # the native admission queue, asked before decide

    # ---- lifecycle -----------------------------------------------------------------------

    def start(self) -> None:
        self.tasks = [asyncio.create_task(self._worker(), name=f"trainop-worker-{i}")
                      for i in range(WORKERS)]
        self.tasks.append(asyncio.create_task(self._safety_resync(), name="trainop-resync"))
        self.tasks.append(asyncio.create_task(self._take_over(), name="trainop-take-over"))

    async def stop(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        for pool in (self.pool, self.applier.pool, self.event_pool):
            pool.shutdown(wait=False, cancel_futures=True)

    # ---- wake-ups (from handlers/indexes.py, in the event loop) ----------------------------

    def enqueue_job(self, namespace: str, name: str) -> None:
        if (namespace, name) in self.ix["dtj_bodies"]:  # a child of a job not (yet) seen: no-op
            self.queue.add((JOB, namespace, name))

    def enqueue_stage(self, namespace: str, name: str) -> None:
        if (namespace, name) in self.ix["stage_bodies"]:
            self.queue.add((STAGE, namespace, name))

    def job_gone(self, namespace: str, name: str, uid: str | None) -> None:
        key = (JOB, namespace, name)
        self.queue.forget(key)
        for memo in (self.written, self.problems, self.failures, self.said):
            memo.pop(key, None)
        self.departed.pop((namespace, name), None)
        self.gate.forget(namespace, name)
        if uid:
            self.applier.forget(uid)

    def stage_gone(self, namespace: str, name: str) -> None:
        key = (STAGE, namespace, name)
        self.queue.forget(key)
        for memo in (self.written, self.problems, self.failures, self.said):
            memo.pop(key, None)

    def child_changed(self, kind: str, namespace: str, owner: str, body: dict,
                      deleted: bool) -> None:
        """A child that decide() applies without reading it (the identities' ServiceAccount,
        Role, RoleBinding; a DataStage's NetworkPolicy and claim) changed or went: the apply
        layer forgets it unless the change is its own write, and the owner's reconcile applies
        it again."""
        self.applier.observe(body, deleted)
        (self.enqueue_job if kind == JOB else self.enqueue_stage)(namespace, owner)

    def pod_departed(self, namespace: str, job: str, pod: dict) -> None:
        """Remember a deleted pod's last state (one per pod name: bounded by the gang's size)
        for the job's next decisions: a worker that vanished names its node and cause."""
        self.departed.setdefault((namespace, job), {})[pod["metadata"]["name"]] = pod

    def wake_gate(self, namespace: str) -> None:
        for name in self.gate.wake(namespace):
            self.enqueue_job(namespace, name)

    def wake_all_gates(self) -> None:
        """A priority class changed: every namespace's queue order may have."""
        for namespace in {ns for ns, _ in self.ix["dtj_bodies"]}:
            self.wake_gate(namespace)

    def wake_waiting_for_nodes(self) -> None:
        """A node came or went: the jobs waiting for a matching node, and the elastic ones below
        their largest size (their grow compares the pool's nodes: jobsync/elastic.py)."""
        for (namespace, name), store in self.ix["dtj_bodies"].items():
            for body in store:
                status, spec = body.get("status") or {}, body.get("spec") or {}
                cond = conditions.get_condition(status.get("conditions"), "Created")
                shrunk = bool(spec.get("elastic")) and \
                    (status.get("elastic") or {}).get("workers", 0) < (spec.get("workers") or 0)
                if cond and cond.get("reason") == "NoMatchingNodes" or shrunk:
                    self.enqueue_job(namespace, name)

    def wake_starting(self) -> None:
        """A lost node changed (its unreachable taint came): the jobs still starting, which
        may wait for it before they create pods (only on a lost node's events: rare)."""
        for (namespace, name), store in self.ix["dtj_bodies"].items():
            if any((body.get("status") or {}).get("phase") == "Starting" for body in store):
                self.enqueue_job(namespace, name)

    def node_back(self, node: str) -> None:
        """A node judged lost is no more (its kubelet reports again): the pool has its room
        back, which a shrunk elastic gang grows into (only nodes seen lost: a cheap check on
        every other node update)."""
        if node in self.lost_seen:
            self.lost_seen.discard(node)
            self.wake_waiting_for_nodes()

    def node_deleted(self, node: str) -> None:
        """A Node was deleted (a spot VM taken back, a scale-down, `kubectl delete node`):
        nothing will run or end its pods again, and the PodGC deletes them only after its 40 s
        quarantine, checked every 20 s (kube-controller-manager, neither configurable). Its
        gangs are judged as on a lost node, now (docs/pools-and-failures.md)."""
        since = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        self.deleted_nodes[node] = (time.monotonic(), {"name": node, "since": since, "deleted": True})
        self.lost_seen.discard(node)  # (a deleted node reports no more)
        self._wake_jobs_with_pods_on(node)

    def node_added(self, node: str) -> None:
        """A Node (again) of a name deleted a moment ago: judged by its own status from now."""
        self.deleted_nodes.pop(node, None)

    def lost_nodes(self) -> dict[str, dict]:
        """The nodes whose pods are lost: Ready Unknown (the index) or deleted a while ago."""
        lost = {n["name"]: n for n in self._all("nodes", (NODE_LOST,))}
        if self.deleted_nodes:
            now = time.monotonic()
            self.deleted_nodes = {n: v for n, v in self.deleted_nodes.items()
                                  if now - v[0] < DELETED_NODE_MEMORY_S}
            lost.update((n, v) for n, (_, v) in self.deleted_nodes.items())
        return lost

    def wake_jobs_on_node(self, node: str) -> None:
        """A node was judged lost: the jobs with a pod bound to it (a scan of the pod cache,
        only on such an event: a lost node's object changes a few times, not every heartbeat)."""
        self.lost_seen.add(node)
        self._wake_jobs_with_pods_on(node)

    def _wake_jobs_with_pods_on(self, node: str) -> None:
        for (namespace, name), store in self.ix["dtj_pods"].items():
            if any((p.get("spec") or {}).get("nodeName") == node for p in store):
                self.enqueue_job(namespace, name)

    def wake_waiting_for_flavor(self, flavor: str) -> None:
        """A ResourceFlavor appeared or changed: jobs that Kueue admitted on it and that wait
        for the cache to hold it (jobsync: WaitingForResourceFlavor)."""
        for (namespace, name), store in self.ix["dtj_bodies"].items():
            for body in store:
                cond = conditions.get_condition((body.get("status") or {}).get("conditions"),
                                                "Created")
                if cond and cond.get("reason") == "WaitingForResourceFlavor" and any(
                        flavor in kueue.flavor_names(w)
                        for w in self._all("dtj_admission", (namespace, name, "Workload"))):
                    self.enqueue_job(namespace, name)

    def wake_jobs_of_stage(self, namespace: str, stage: str) -> None:
        for (ns, name), store in self.ix["dtj_bodies"].items():
            if ns == namespace and any(_stage_ref(body) == stage for body in store):
                self.enqueue_job(ns, name)

    def wake_stages_referencing(self, namespace: str, name: str) -> None:
        for (ns, stage), store in self.ix["stage_bodies"].items():
            if ns == namespace and any(name in _stage_refs(body) for body in store):
                self.enqueue_stage(ns, stage)

    # ---- the loop ------------------------------------------------------------------------

    async def _take_over(self) -> None:
        """A standby that gets the Lease judges every object at once: it has run no reconcile,
        so it knows no deadline (add_after) of its own. (A single replica starts leading.)"""
        await self.leadership.wait_leading()
        self.enqueue_all()

    def enqueue_all(self) -> None:
        for ns, name in list(self.ix["dtj_bodies"]):
            self.queue.add((JOB, ns, name))
        for ns, name in list(self.ix["stage_bodies"]):
            self.queue.add((STAGE, ns, name))

    async def _worker(self) -> None:
        """Nothing is taken from the queue while this replica is not the leader: wake-ups and
        deadlines only queue keys (coalesced), and kube.py's fence refuses any write that a
        reconcile already running when the Lease was lost would still send."""
        await self.synced.wait()  # (kopf's indexes: its own barrier, indexes.py)
        while True:
            await self.leadership.wait_leading()
            key = await self.queue.get()
            if not self.leadership.is_leading():  # lost between the wait and the get
                self.queue.done(key)
                self.queue.add(key)
                continue
            try:
                kind = key[0]
                with metrics.reconcile(kind):
                    if kind == JOB:
                        await self._reconcile_job(key)
                    else:
                        await self._reconcile_stage(key)
                self.failures.pop(key, None)
            except asyncio.CancelledError:
                raise
            except kube.NotLeading:  # the Lease was lost mid-reconcile: the process stops
                self.queue.add(key)
            except Exception as exc:  # the API away, a refusal, a bug: retried with backoff
                n = self.failures[key] = self.failures.get(key, 0) + 1
                delay = min(MAX_BACKOFF, self.cfg.resync_seconds * 2 ** (n - 1))
                reason = f"{exc.status} {exc.reason}" if isinstance(exc, ApiException) \
                    else repr(exc)
                # An API server restarting or overloaded heals itself: a WARNING, until it has
                # lasted TRANSIENT_RETRIES tries (a minute and more), then an ERROR
                level = logging.WARNING if _transient(exc) and n < TRANSIENT_RETRIES else logging.ERROR
                log.log(level, "reconcile failed (%s); retrying in %.1fs", reason, delay,
                        exc_info=level == logging.ERROR and not isinstance(exc, ApiException), extra=_ref(key))
                self.queue.add_after(key, delay)
            finally:
                self.queue.done(key)

    async def _safety_resync(self) -> None:
        """Every object once per period, spread over it, from the caches (no API call unless
        a decision differs from what was last done), while this replica leads. (A DataStage's
        PersistentVolume, which no watch shows, is read by name in each of its reconciles, so
        this puts back a deleted one.)"""
        period = self.cfg.safety_resync_seconds
        await asyncio.sleep(period * random.uniform(0.5, 1.0))
        while True:
            await self.leadership.wait_leading()
            keys = [(JOB, ns, n) for ns, n in list(self.ix["dtj_bodies"])] + \
                   [(STAGE, ns, n) for ns, n in list(self.ix["stage_bodies"])]
            for i, key in enumerate(keys):
                self.queue.add_after(key, period * i / max(len(keys), 1))
            await asyncio.sleep(period)

    def _one(self, index: str, key) -> dict | None:
        store = self.ix[index].get(key)
        return next(iter(store), None) if store else None

    def _all(self, index: str, key) -> list[dict]:
        store = self.ix[index].get(key)
        return list(store) if store else []

    def _fresh(self, key: tuple, cached: dict | None) -> dict | None:
        """The cached object, or what our own status write returned if the watch has not
        delivered it yet (read your writes: a stale status would repeat a transition)."""
        mine = self.written.get(key)
        if cached is None or mine is None:
            return cached
        if _rv(mine) > _rv(cached) and mine["metadata"].get("uid") == cached["metadata"].get("uid"):
            return mine
        self.written.pop(key, None)  # the cache caught up
        return cached

    def _say(self, key: tuple, phase: str | None, waiting: str | None) -> None:
        """Log a state change once, at INFO (waiting is normal: never a warning)."""
        if self.said.get(key) != (phase, waiting):
            self.said[key] = (phase, waiting)
            log.info("%s %s%s", key[0], phase or "New", f": {waiting}" if waiting else "",
                     extra=_ref(key))

    # ---- DistributedTrainingJob ------------------------------------------------------------

    def nodes(self) -> Nodes:
        """The pool nodes, one set between node events: the set remembers its pool totals, so
        a burst of new jobs sums hundreds of nodes once, not once per job (issue 30)."""
        if self.pool_nodes is None:
            self.pool_nodes = Nodes(n for key, store in self.ix["nodes"].items()
                                    if key[0] == NODE_POOL for n in store)
        return self.pool_nodes

    def node_changed(self) -> None:
        """Any node event (kopf has indexed it before handlers run): nodes() rebuilds."""
        self.pool_nodes = None

    def priority_classes(self) -> priority.Classes:
        found: dict[str, list] = {"PriorityClass": [], "WorkloadPriorityClass": []}
        for (kind, _), store in self.ix["scheduling"].items():  # (ResourceFlavors too)
            if kind in found:
                found[kind].extend(store)
        return priority.Classes.of(found["PriorityClass"], found["WorkloadPriorityClass"])

    def namespace_view(self, namespace: str) -> gate.NamespaceView:
        wakes = self.gate.wakes(namespace)  # with the caches, in the loop that runs the wake-ups
        quotas = self._all("quotas", namespace)
        if gate.unlimited(quotas, self.cfg):  # the gate needs only the nodes then
            return gate.NamespaceView(pods=[], quotas=[], jobs=[], nodes=self.nodes())
        pods, jobs = [], []
        for (ns, _), store in self.ix["dtj_pods"].items():
            if ns == namespace:
                pods.extend(store)
        for (ns, name), store in self.ix["dtj_bodies"].items():
            if ns == namespace:
                jobs.extend(self._fresh((JOB, ns, name), body) for body in store)
        return gate.NamespaceView(pods=pods, quotas=quotas, jobs=jobs, nodes=self.nodes(),
                                  classes=self.priority_classes(), wakes=wakes)

    def job_snapshot(self, key: tuple) -> tuple[jobsync.JobSnapshot, gate.NamespaceView | None] \
            | None:
        """The job's snapshot for decide(), and the namespace's view for the gate (read here, in
        the event loop that owns the indexes: decide() runs in a pool thread); the view only
        for a job still at the gate."""
        _, ns, name = key
        body = self._fresh(key, self._one("dtj_bodies", (ns, name)))
        if body is None:
            return None
        uid, ck = body["metadata"].get("uid"), (ns, name)
        launcher = self._one("dtj_children", (*ck, "Job"))
        if launcher is not None and not _controlled(launcher, uid):
            launcher = None
        launchers = [launcher] if launcher else []
        launcher = next(iter(_with_created(launchers, self.applier.created(uid, "Job", launchers))),
                        None)
        # the job's pods and its launcher Job's pod; another incarnation's (a job deleted and
        # made again) are not this job's: the garbage collector removes them
        owners = {uid, launcher["metadata"].get("uid") if launcher else None}
        pods = [p for p in self._all("dtj_pods", ck)
                if any(_controlled(p, owner) for owner in owners if owner)]
        conds = (body.get("status") or {}).get("conditions")
        created = conditions.is_true(conds, "Created")
        view = None if conditions.is_true(conds, "Admitted") else self.namespace_view(ns)
        stage = _stage_ref(body)
        # Chosen by name, and the progress report only from the job's own: a ConfigMap that
        # someone labelled like it is not the shipper's report (the hostfile's owner is judged
        # by jobsync, which never adopts).
        config_maps = {c["metadata"]["name"]: c for c in self._all("dtj_children", (*ck, "ConfigMap"))}
        services = {s["metadata"]["name"]: s for s in self._all("dtj_children", (*ck, "Service"))}
        named = SimpleNamespace(name=name)  # what the renderers' name functions read
        progress = config_maps.get(render_logship.progress_name(named))
        if progress is not None and not _controlled(progress, uid):
            progress = None
        workload, workload_slice, replaced = kueue.pick(
            [w for w in self._all("dtj_admission", (*ck, "Workload")) if _controlled(w, uid)])
        pod_group = next((g for kind in POD_GROUPS
                          for g in self._all("dtj_admission", (*ck, kind)) if _controlled(g, uid)), None)
        flavors = {n: f for n in kueue.flavor_names(workload)
                   for f in self._all("scheduling", ("ResourceFlavor", n))}
        snap = jobsync.JobSnapshot(
            body=body,
            pods=_with_created(pods, self.applier.created(uid, "Pod", pods)),
            launcher=launcher,
            # by name: with runLauncherAsWorker the launcher has a Service of its own
            service=services.get(render_dtj.service_name(named)),
            launcher_service=services.get(render_dtj.launcher_service_name(named)),
            config_map=config_maps.get(render_dtj.config_map_name(named)),
            progress=progress, network_policy=self._one("dtj_children", (*ck, "NetworkPolicy")),
            ssh_secret=self.applier.has_ssh_secret(uid),
            # an elastic gang's size follows its pool's nodes (jobsync/elastic.py)
            nodes=[] if created and not (body.get("spec") or {}).get("elastic") else self.nodes(),
            tainted_nodes=tuple(self._all("nodes", (NODE_TAINTED,))),
            lost_nodes=self.lost_nodes(),
            stage=self._one("stage_bodies", (ns, stage)) if stage else None,
            classes=self.priority_classes(),
            workload=workload, workload_slice=workload_slice, replaced_workloads=replaced,
            flavors=flavors, pod_group=pod_group,
            problem=self.problems.pop(key, None), memo=self.memo,
            departed=[p for p in self.departed.get(ck, {}).values()
                      if any(_controlled(p, owner) for owner in owners if owner)])
        return snap, view

    async def _reconcile_job(self, key: tuple) -> None:
        found = self.job_snapshot(key)
        if found is None:
            return
        snap, view = found
        loop = asyncio.get_running_loop()
        # decide() in the pool too: the gate may judge a whole namespace
        outcome, problem = await loop.run_in_executor(self.pool, self._decide_and_act, key, snap,
                                                      view)
        if problem:  # decide again at once, knowing it
            self.problems[key] = problem
            self.queue.add(key)
            return
        metrics.queue_totals(key[1], self.gate.totals(key[1]))
        for name in self.gate.drain_admitted(key[1]):
            self.enqueue_job(key[1], name)
        if outcome.requeue_after is not None:
            self.queue.add_after(key, outcome.requeue_after + DEADLINE_SLACK)
        self._say(key, (outcome.status or {}).get("phase"), outcome.waiting)

    # ---- DataStage -------------------------------------------------------------------------

    def stage_snapshot(self, key: tuple) -> stagesync.StageSnapshot | None:
        _, ns, name = key
        body = self._fresh(key, self._one("stage_bodies", (ns, name)))
        if body is None:
            return None
        refs = _stage_refs(body)
        return stagesync.StageSnapshot(
            body=body,
            service_accounts={r for r in refs if ("ServiceAccount", ns, r) in self.ix["references"]},
            claims={r for r in refs if ("PersistentVolumeClaim", ns, r) in self.ix["references"]},
            service=self._one("stage_children", (ns, name, "Service")),
            statefulset=self._one("stage_children", (ns, name, "StatefulSet")),
            copy_jobs=self._all("stage_children", (ns, name, "Job")),
            readers=[(r["podIP"], self._one("nodes", (NODE_ADDRESS, r["nodeName"])) or "")
                     for r in self._all("stage_readers", (ns, name))],
            server_pod=self._one("stage_servers", (ns, name)))

    async def _reconcile_stage(self, key: tuple) -> None:
        snap = self.stage_snapshot(key)
        if snap is None:
            return
        loop = asyncio.get_running_loop()
        outcome, problem = await loop.run_in_executor(self.pool, self._decide_and_act_stage,
                                                      key, snap)
        if problem:
            log.warning("%s", problem.message, extra=_ref(key))  # a user's object in the way
        if outcome.requeue_after is not None:
            self.queue.add_after(key, outcome.requeue_after)
        self._say(key, (outcome.status or {}).get("phase"), outcome.waiting)

    # ---- acting (in a pool thread) ---------------------------------------------------------

    def _decide_and_act(self, key: tuple, snap: jobsync.JobSnapshot,
                        view: gate.NamespaceView | None):
        snap.kueue = kueue.manages(snap.body)
        snap.gang_scheduler = podgroup.scheduler(self.cfg)
        _confirm_class(snap)
        _confirm_flavors(snap)
        now = dt.datetime.now(dt.timezone.utc)
        outcome = jobsync.decide(snap, self.cfg, now)
        if outcome.asks is not None:  # at the native gate: judge the queue, decide again
            snap.admission = self.gate.decide(outcome.asks, snap.body, self.cfg, view)
            outcome = jobsync.decide(snap, self.cfg, now)
        return outcome, self._act(key, snap.body, outcome)

    def _decide_and_act_stage(self, key: tuple, snap: stagesync.StageSnapshot):
        for name in stagesync.secret_refs(snap.body):  # read, never watched (stagesync.py)
            secret = apply.kube.get("v1", "Secret", name, key[1])
            if secret is not None:
                snap.secret_keys[name] = tuple(sorted(secret.get("data") or {}))  # names only
        if not ((snap.body.get("spec") or {}).get("destination") or {}).get("volumeClaim"):
            # its PV, read by name (cluster-scoped, not watched): is the name ours?
            snap.volume = apply.kube.get("v1", "PersistentVolume",
                                         stagesync.render.volume_name(snap.body["metadata"]["uid"]))
        if snap.copy_jobs:  # the stager's report, read by name (ConfigMaps are watched by the job label only)
            snap.progress = apply.kube.get("v1", "ConfigMap",
                                           stagesync.render.progress_name(snap.body["metadata"]["name"]), key[1])
        now = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        outcome = stagesync.decide(snap, self.cfg, now)
        return outcome, self._act(key, snap.body, outcome)

    def _act(self, key: tuple, body: dict, outcome) -> Problem | None:
        problems = self.applier.run(outcome.actions)
        if problems:
            return problems[0]
        old = body.get("status") or {}
        if outcome.status is not None:
            new = outcome.status if key[0] == JOB else {**old, **outcome.status}  # a stage owns only its keys
            changes = merge_patch(old, new)
            if changes:
                try:
                    self.written[key] = apply.write_status(body, changes)
                except ApiException as exc:
                    if exc.status != 404:  # 404: deleted meanwhile; nothing left to say
                        raise
                    return None
        if outcome.events:
            self.event_pool.submit(apply.post_events, body, outcome.events)
        if outcome.delete_self:
            log.info("ttlSecondsAfterFinished elapsed: deleting the job", extra=_ref(key))
            meta = body["metadata"]
            apply.kube.delete(body["apiVersion"], body["kind"], meta["name"], meta["namespace"],
                              uid=meta["uid"])
        return None


def merge_patch(old: dict, new: dict) -> dict:
    """The JSON merge patch (RFC 7386) that turns `old` into `new`: changed keys, None for
    removed ones, recursing into maps (a map sent whole would keep the old map's other keys:
    a stale `metrics.loss` or `lastFailure.exitCode`). Lists are replaced whole."""
    out = {}
    for k in set(old) | set(new):
        if k not in new:
            out[k] = None
        elif old.get(k) != new[k]:
            both_maps = isinstance(old.get(k), dict) and isinstance(new[k], dict)
            out[k] = merge_patch(old[k], new[k]) if both_maps else new[k]
    return out


def _ref(key: tuple) -> dict:
    """The object a log line is about, as kopf's formatters expect it: `[ns/name]` before the
    text, `object` in JSON lines."""
    return {"k8s_ref": {"apiVersion": f"{GROUP}/{VERSION}", "kind": key[0],
                        "namespace": key[1], "name": key[2]}}


def _confirm_class(snap: jobsync.JobSnapshot) -> None:
    """A class the watch cache does not hold yet (an admin made it a moment before the job)
    is read from the API server before a job still at the gate fails for naming it."""
    try:  # spec.priorityClassName or an alias of it (a pod template's, the Volcano PodGroup's)
        name = priority_class_name(snap.body.get("spec") or {})
    except SpecError:
        return  # names two classes: decide fails the job with the field
    conds = (snap.body.get("status") or {}).get("conditions")
    if not name or name in snap.classes.pod or name in snap.classes.workload or \
            (snap.body.get("status") or {}).get("phase") in jobsync.TERMINAL or \
            conditions.is_true(conds, "Admitted"):
        return
    found = apply.kube.get("scheduling.k8s.io/v1", "PriorityClass", name, None)
    wpc = apply.kube.get(kueue.API_VERSION, "WorkloadPriorityClass", name, None) \
        if snap.kueue else None
    seen = priority.Classes.of([found] if found else [], [wpc] if wpc else [])
    snap.classes = priority.Classes(pod=snap.classes.pod | seen.pod,
                                    workload=snap.classes.workload | seen.workload)


def _confirm_flavors(snap: jobsync.JobSnapshot) -> None:
    """An admitted flavor the watch cache does not hold yet is read from the API server (Kueue
    admitted the job on it, so it exists unless deleted a moment ago)."""
    for name in kueue.flavor_names(snap.workload) - set(snap.flavors):
        found = apply.kube.get(kueue.API_VERSION, "ResourceFlavor", name, None)
        if found is not None:
            snap.flavors[name] = found


def _stage_ref(body: dict) -> str | None:
    return (((body.get("spec") or {}).get("data") or {}).get("dataStageRef") or {}).get("name")


def _stage_refs(body: dict) -> set[str]:
    """Names of the ServiceAccount a DataStage's auth block points at and of the claim its
    destination names (both watched)."""
    spec = body.get("spec") or {}
    auth = (((spec.get("source") or {}).get("blob") or {}).get("auth")) or {}
    out = {auth.get("serviceAccountName"),
           ((spec.get("destination") or {}).get("volumeClaim") or {}).get("claimName")}
    return {n for n in out if n}
