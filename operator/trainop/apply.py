"""The apply layer: executes a decide()'s actions, writes the status keys that changed and posts
the Events. The only place where a decision becomes API calls (through kube.py).

    applier = apply.Applier()
    problems = applier.run(outcome.actions)           # [] or Problem(reason, message)s
    written = apply.write_status(body, changes)       # the object as the API server returned it
    apply.post_event(body, "Warning", "GangRestart", "pod x died")

Cost in steady state is zero: an `Apply` of a child whose live resourceVersion is the one this
process's last apply produced (and whose rendering has not changed) is skipped without a call.
A child the caches show missing is created with POST (never adopted: a 409 whose object another
owner controls is reported as a conflict); an existing one is server-side applied (force, field
manager "trainop"), which puts an edited field back and leaves API-server defaults alone.

Children that decide() applies without reading them (`live_version` None: the helper
identities' ServiceAccount/Role/RoleBinding, a DataStage's NetworkPolicy and claim) are still
watched: `observe()` forgets one that was deleted or changed by someone else, and the event
wakes its owner, whose reconcile applies it again.

Pods and Jobs it created are remembered (`created`) until the watch shows them: the snapshot
of the owner's next reconcile counts them (read your writes, as client-go's controllers keep
"expectations"). In a burst the pods' events can arrive after the job's own status event
has woken its reconcile (they come on another watch); without this, that reconcile found no pods and
created them again (a 409 and a GET each).

Secrets are the one kind the operator does not watch: listing them would give it every
credential of every namespace it serves. A job's SSH Secret is created once (POST; a 409 is
checked for ownership with one GET) and remembered here, so the next reconciles skip it;
after a restart the first reconcile of each job pays that POST again. Nothing tells it that
someone deleted one, so it is read again (one GET) whenever the gang's pods are about to be
created (`_check_ssh_secret`), and made again, with a new key, if it is gone: a running gang
has its key mounted already, and a (re)start is when a missing Secret would stop the pods;
reading every job's Secret at the safety resync instead would cost N/safetyResyncSeconds
requests per second at rest, where the steady state costs none.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import logging
import os
import threading
import time
from concurrent.futures import Executor, ThreadPoolExecutor

from kubernetes.client.exceptions import ApiException

from trainop import fastjson, kube, preflight, sshkeys
from trainop.actions import (
    Apply,
    Create,
    CreateSSHSecret,
    Delete,
    Patch,
    PatchStatus,
    Problem,
    Ref,
    SetFinalizers,
    TaintNode,
)
from trainop.render import dtj as render_dtj

log = logging.getLogger("trainop.apply")
COMPONENT = "trainop"
_HOST = os.environ.get("HOSTNAME") or os.uname().nodename


class Applier:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        # (apiVersion, kind, namespace, name) -> (digest of what we applied, resourceVersion
        # the API server returned for it)
        self._applied: dict[tuple, tuple[str, str]] = {}
        self._ssh_secrets: dict[str, object] = {}  # job uid -> its spec.Job: the SSH Secret exists
        self._ssh_fresh: set[str] = set()  # ... just made or confirmed: its first pods need no read
        # owner uid -> (kind, name) -> (the object our create returned, time.monotonic() then):
        # until an event of it reaches seen(), or CREATED_TTL_S for an event that never comes
        # (one the watch missed while it restarted)
        self._created: dict[str, dict[tuple[str, str], tuple[dict, float]]] = {}
        # The calls of one stage (run()) run here: a pool of its own beside the controller's
        # reconcile threads, so a reconcile waiting for its stage never holds a slot it needs.
        self.pool: Executor = ThreadPoolExecutor(max_workers=8, thread_name_prefix="trainop-stage")

    def run(self, actions: list) -> list[Problem]:
        """Execute `actions` in order; returns the problems met: a name another owner holds,
        a child the API server refused as invalid. Other API errors raise (retried).

        "In order" by stages (`stages`): the children a gang's pods need (its NetworkPolicy,
        Service, ConfigMap, SSH Secret) go together, then its pods together, each stage's calls
        at once. A new job's first reconcile then waits for two round trips, not six: its
        launcher ran 0.1-0.2 s sooner on the 10-job benchmark. A stage still completes before
        the next starts (no pod before its NetworkPolicy), and its outcomes are judged in order,
        as if sequential; only the siblings after a refused one have been tried as well."""
        problems = []
        for stage in stages(actions):
            checked: set = set()
            for action in stage:  # (at most one GET for the gang, before any of its pods)
                if isinstance(action, Create):
                    self._check_ssh_secret(action, checked)
            results = [self._try(stage[0])] if len(stage) == 1 else list(self.pool.map(self._try, stage))
            for action, exc in zip(stage, results):
                if exc is None:
                    continue
                if isinstance(exc, kube.OwnershipError):
                    problems.append(Problem("NameConflict", str(exc)))
                elif exc.status == 403 and "violates PodSecurity" in (exc.body or ""):
                    problems.append(Problem("PodSecurity", _pod_security(action, exc), _said(exc)))
                    return problems
                elif rejected(exc):
                    problems.append(Problem("ChildRejected", _rejection(action, exc)))
                    return problems  # the children after it depend on it (e.g. pods on their Service)
                else:
                    raise exc
        return problems

    def _try(self, action) -> Exception | None:
        """One action; the OwnershipError or ApiException it met (for run() to judge), else
        None."""
        try:
            if isinstance(action, Apply):
                self._apply(action)
            elif isinstance(action, Create):
                live = _create(kube.with_owner(action.obj, action.owner), action.owner)
                if ((action.owner or {}).get("kind"), live.get("kind")) in _READ_YOUR_CREATES:
                    self._remember(live)
            elif isinstance(action, CreateSSHSecret):
                self._create_ssh_secret(action)
            elif isinstance(action, Delete):
                _delete(action.ref, action.grace_seconds)
            elif isinstance(action, SetFinalizers):
                _set_finalizers(action.ref, list(action.finalizers), action.resource_version)
            elif isinstance(action, Patch):
                _patch(action)
            elif isinstance(action, PatchStatus):
                _patch_status(action)
            elif isinstance(action, TaintNode):
                _taint_node(action)
            else:
                raise TypeError(f"unknown action {action!r}")
        except (kube.OwnershipError, ApiException) as exc:
            return exc
        return None

    def forget(self, owner_uid: str) -> None:
        """The owner is gone: drop what was remembered about its children."""
        with self._lock:
            self._applied = {k: v for k, v in self._applied.items() if k[4] != owner_uid}
            self._ssh_secrets.pop(owner_uid, None)
            self._ssh_fresh.discard(owner_uid)
            self._created.pop(owner_uid, None)

    def _remember(self, live: dict) -> None:
        owner = kube.controller_uid(live)
        if owner is None:
            return
        now = time.monotonic()
        with self._lock:
            self._created.setdefault(owner, {})[(live["kind"], live["metadata"]["name"])] = (live, now)

    def seen(self, kind: str, body: dict) -> None:
        """A watch event of a Pod or Job (any type): from here on the caches know it."""
        owner = kube.controller_uid(body)
        if owner is None or owner not in self._created:  # (the common case: no lock)
            return
        key, uid = (kind, body["metadata"]["name"]), body["metadata"].get("uid")
        with self._lock:
            mine = self._created.get(owner, {})
            if key in mine and mine[key][0]["metadata"].get("uid") == uid:
                self._drop(owner, [key])

    def created(self, owner_uid: str | None, kind: str, cached: list[dict]) -> list[dict]:
        """The `kind` objects created for the owner that the `cached` ones (the index's) do not
        show yet. One the cache has (same uid) is forgotten here as well: its watch event can
        reach seen() before the create's own thread has remembered it."""
        if owner_uid not in self._created:
            return []
        now, have = time.monotonic(), {c["metadata"].get("uid") for c in cached}
        with self._lock:
            mine = self._created.get(owner_uid, {})
            self._drop(owner_uid, [k for k, (obj, t) in mine.items() if k[0] == kind and (
                obj["metadata"].get("uid") in have or now - t > CREATED_TTL_S)])
            return [obj for (k, _), (obj, _) in mine.items() if k == kind]

    def _drop(self, owner_uid: str, keys: list) -> None:
        """(Under the lock.) An owner with nothing left unseen leaves the map: seen() then
        returns at its first check for every event of its children."""
        mine = self._created.get(owner_uid, {})
        for key in keys:
            del mine[key]
        if not mine:
            self._created.pop(owner_uid, None)

    def has_ssh_secret(self, owner_uid: str | None) -> bool:
        with self._lock:
            return owner_uid in self._ssh_secrets

    def _check_ssh_secret(self, action: Create, checked: set) -> None:
        """Before the first pod of a gang's (re)start that this run creates: is the job's SSH
        Secret, which no watch shows, still there? One GET; made again if it is gone."""
        uid = ((action.owner or {}).get("metadata") or {}).get("uid")
        with self._lock:
            job = self._ssh_secrets.get(uid)
        if action.obj.get("kind") != "Pod" or job is None or uid in checked:
            return
        checked.add(uid)
        with self._lock:
            if uid in self._ssh_fresh:
                self._ssh_fresh.discard(uid)
                return
        name = render_dtj.secret_name(job)
        if kube.get("v1", "Secret", name, job.namespace) is None:
            log.info("SSH Secret %s/%s is gone: made again with a new key", job.namespace, name)
            secret = render_dtj.render_ssh_secret(job, *sshkeys.generate())
            _create(kube.with_owner(secret, action.owner), action.owner)

    def observe(self, obj: dict, deleted: bool) -> None:
        """A watch event of a child applied with live_version None: forget what was applied
        if it was deleted, or changed after the version our last apply returned."""
        meta = obj["metadata"]
        ident = (obj.get("apiVersion"), obj.get("kind"), meta.get("namespace"), meta["name"])
        seen = meta.get("resourceVersion") or ""
        with self._lock:
            for key in [k for k in self._applied if k[:4] == ident]:
                if deleted or _newer(seen, self._applied[key][1]):
                    del self._applied[key]

    def _create_ssh_secret(self, action: CreateSSHSecret) -> None:
        secret = render_dtj.render_ssh_secret(action.job, *sshkeys.generate())
        _create(kube.with_owner(secret, action.owner), action.owner)  # (a 409 keeps the old key)
        with self._lock:
            self._ssh_secrets[action.owner["metadata"]["uid"]] = action.job
            self._ssh_fresh.add(action.owner["metadata"]["uid"])

    def _apply(self, action: Apply) -> None:
        desired = kube.with_owner(action.obj, action.owner)
        ref = Ref.of(desired)
        key = (ref.api_version, ref.kind, ref.namespace, ref.name,
               (action.owner or {}).get("metadata", {}).get("uid"))
        digest = hashlib.sha256(fastjson.canonical(desired)).hexdigest()
        with self._lock:
            seen = self._applied.get(key)
        if seen and seen[0] == digest and action.live_version in (None, seen[1]):
            return  # ours and unchanged since we applied it
        if action.live_version == "" or (action.live_version is None and seen is None):
            live = _create(desired, action.owner, then_apply=True, guard=action.guard)
        else:
            live = kube.apply(desired)
        with self._lock:
            self._applied[key] = (digest, live["metadata"].get("resourceVersion", ""))


# What an owner's snapshot reads of its created children, as (owner kind, child kind) (see the
# module docstring; a DataStage's copy Jobs are not read so, and would only wait here), and how
# long one is trusted without its watch event (client-go's expectations wait 5 minutes; a
# reconcile that trusts a pod that is not there only waits for it, so less).
_READ_YOUR_CREATES = {("DistributedTrainingJob", "Pod"), ("DistributedTrainingJob", "Job")}
CREATED_TTL_S = 30.0

# Kinds that need another object at once, so never in a stage with it: those that start pods (a
# StatefulSet's pod made before its ServiceAccount is refused, and its controller retries only
# after a backoff), and bindings (the API server lets the operator bind a Role only if the Role
# exists and it holds the Role's rights itself: a RoleBinding sent beside its Role was refused).
_ALONE = ("Pod", "Job", "StatefulSet", "Deployment", "DaemonSet", "ReplicaSet", "RoleBinding",
          "ClusterRoleBinding")


def stages(actions: list) -> list[list]:
    """`actions` cut into stages that may run at once: consecutive Apply/Create/CreateSSHSecret
    of the objects pods need, or consecutive creates of the gang's pods; any other action (a
    workload that makes pods, such as a launcher Job or a DataStage's StatefulSet; a RoleBinding,
    after its Role; a delete, a finalizer, a patch, a taint) is a stage of its own, where order
    matters (pods before their launcher Job)."""
    def group(action) -> str | None:
        if isinstance(action, CreateSSHSecret) or \
                (isinstance(action, (Apply, Create)) and action.obj.get("kind") not in _ALONE):
            return "needed"
        if isinstance(action, Create) and action.obj.get("kind") == "Pod":
            return "pods"
        return None

    out: list[list] = []
    for action in actions:
        g = group(action)
        if out and g is not None and group(out[-1][0]) == g:
            out[-1].append(action)
        else:
            out.append([action])
    return out


def _newer(version: str, than: str) -> bool:
    """resourceVersions are opaque by contract, integers in etcd: compare them as such, and
    call any other difference newer (a needless re-apply, never a missed one)."""
    try:
        return int(version) > int(than)
    except ValueError:
        return version != than


def rejected(exc: ApiException) -> bool:
    """Did the API server refuse the child for what it is, so that retrying cannot help? 422
    (invalid), 400 (an admission webhook's or the API server's bad request) and 403 from
    admission (a LimitRange, a webhook, a ValidatingAdmissionPolicy). Not a 403 of RBAC (the
    operator's own rights: an admin fixes the chart) nor an exceeded ResourceQuota (other pods
    free it): those are retried."""
    if exc.status in (400, 422):
        return True
    text = exc.body or ""
    return exc.status == 403 and "exceeded quota" not in text and \
        not ("cannot " in text and " resource " in text)  # RBAC: "User ... cannot create resource"


def _rejection(action, exc: ApiException) -> str:
    """The API server's own words (they name the child's field), and the owner's field that
    most likely produced it."""
    try:
        said = json.loads(exc.body or "{}").get("message") or exc.reason
    except ValueError:
        said = exc.reason
    field = "spec.resources" if "resources" in str(said) else "spec"
    obj = getattr(action, "obj", None) or {}
    what = f"{obj.get('kind', 'a child')} {obj.get('metadata', {}).get('name', '')}".strip()
    return (f"{field}: the API server refused {what}: {said}; fix the spec and create the job "
            f"again")


def _said(exc: ApiException) -> str:
    try:
        return json.loads(exc.body or "{}").get("message") or exc.reason
    except ValueError:
        return exc.reason


def _pod_security(action, exc: ApiException) -> str:
    """A pod the namespace's Pod Security admission refused: the API server's words and the
    label an admin sets to admit it (InfiniBand's IPC_LOCK and topology file need privileged:
    docs/security.md)."""
    said = _said(exc)
    obj = getattr(action, "obj", None) or {}
    namespace = obj.get("metadata", {}).get("namespace", "")
    return (f"the namespace's Pod Security admission refused the job's pods: {said}. An "
            f"admin who accepts what they need (docs/security.md, InfiniBand) sets the label "
            f"pod-security.kubernetes.io/enforce=privileged on namespace {namespace} "
            f"(kubectl label --overwrite ns {namespace} "
            f"pod-security.kubernetes.io/enforce=privileged); the operator retries")


def _create(desired: dict, owner: dict | None, then_apply: bool = False,
            guard: tuple[str, str] | None = None) -> dict:
    """POST; on 409 the existing object must be the owner's, or carry the `guard` label (then
    applied, if asked)."""
    try:
        return kube.create(desired)
    except ApiException as exc:
        if exc.status != 409:
            raise
    ref = Ref.of(desired)
    live = kube.get(ref.api_version, ref.kind, ref.name, ref.namespace)
    if live is None:
        return kube.create(desired)  # it was being deleted a moment ago
    if owner is not None and not kube.controlled_by(live, owner):
        raise kube.OwnershipError(f"{ref} already exists and is not controlled by "
                                  f"{owner['kind']} {owner['metadata']['name']}; delete or "
                                  f"rename it")
    if guard is not None and (live["metadata"].get("labels") or {}).get(guard[0]) != guard[1]:
        raise kube.OwnershipError(f"{ref} already exists without label {guard[0]}={guard[1]}; "
                                  f"it is not ours to change")
    return kube.apply(desired) if then_apply else live


def _delete(ref: Ref, grace_seconds: int | None = None) -> None:
    kube.delete(ref.api_version, ref.kind, ref.name, ref.namespace, uid=ref.uid, grace_seconds=grace_seconds)


def _set_finalizers(ref: Ref, finalizers: list[str], resource_version: str) -> None:
    try:  # (merge patch replaces the list; the resourceVersion makes it refuse a stale one)
        kube.patch(ref.api_version, ref.kind, ref.name, ref.namespace,
                   {"metadata": {"finalizers": finalizers or None,
                                 "resourceVersion": resource_version}})
    except ApiException as exc:
        if exc.status not in (404, 409):  # gone, or changed: the next reconcile sees it anew
            raise


def _patch(action: Patch) -> None:
    ref = action.ref  # (metadata.uid in the patch: only that incarnation)
    if isinstance(action.patch, list):
        try:
            kube.json_patch(ref.api_version, ref.kind, ref.name, ref.namespace,
                            [{"op": "test", "path": "/metadata/uid", "value": ref.uid}, *action.patch])
        except ApiException as exc:
            if exc.status not in (404, 409, 422):  # gone, or changed since (a `test` failed)
                raise
        return
    patch = {**action.patch, "metadata": {**action.patch.get("metadata", {}), "uid": ref.uid}}
    try:
        kube.patch(ref.api_version, ref.kind, ref.name, ref.namespace, patch)
    except ApiException as exc:
        if exc.status not in (404, 409):  # gone, or another incarnation
            raise


def _patch_status(action: PatchStatus) -> None:
    ref = action.ref
    try:
        kube.patch(ref.api_version, ref.kind, ref.name, ref.namespace, action.patch,
                   subresource="status")
    except ApiException as exc:
        if exc.status not in (404, 409):  # gone, or changed since the cache saw it
            raise


def _taint_node(action: TaintNode) -> None:
    """Add the taint unless one with its key is there, and only while fewer than `limit` nodes
    carry it (preflight.taint_refused: counted from the nodes, the cluster's own state). Merge
    patch replaces the taints list, so the patch carries the resourceVersion it was read at: a
    concurrent change (the node lifecycle controller's own taints) makes it fail with 409, and
    the reconcile is retried."""
    node = kube.get("v1", "Node", action.node)
    if node is None:
        return  # gone: nothing to keep pods off
    taints = list((node.get("spec") or {}).get("taints") or [])
    if any(t.get("key") == action.taint["key"] for t in taints):
        return
    if action.limit is not None:
        key = action.taint["key"]
        refused = preflight.taint_refused(preflight.carrying(kube.list_objects("v1", "Node"), key), key, action.limit)
        if refused:
            log.warning("node %s not tainted: %s", action.node, refused)
            return
    kube.patch("v1", "Node", action.node, None,
               {"metadata": {"resourceVersion": node["metadata"]["resourceVersion"]},
                "spec": {"taints": taints + [dict(action.taint)]}})
    log.warning("tainted node %s %s=%s:%s: the job's preflight found it slow", action.node,
                action.taint["key"], action.taint.get("value", ""), action.taint["effect"])


def write_status(body: dict, changes: dict, subresource: str = "status") -> dict:
    """JSON merge patch of the changed status keys (None removes a key)."""
    meta = body["metadata"]
    return kube.patch(body["apiVersion"], body["kind"], meta["name"], meta["namespace"],
                      {"status": changes}, subresource=subresource)


def post_events(body: dict, events: list[tuple[str, str, str]]) -> None:
    """post_event() for each (type, reason, message) in order, in the controller's event pool:
    a call that fails otherwise than post_event() expects (leadership lost meanwhile, the API
    server unreachable) drops the rest, said once, since no reconcile is there to retry them."""
    try:
        for type_, reason, message in events:
            post_event(body, type_, reason, message)
    except Exception as exc:  # noqa: BLE001 (a thread of the pool: nobody else would see it)
        log.warning("%d Event(s) on %s/%s not posted: %s", len(events),
                    body["metadata"].get("namespace"), body["metadata"].get("name"), exc)


def post_event(body: dict, type_: str, reason: str, message: str,
               now: dt.datetime | None = None) -> None:
    """A core/v1 Event about `body` (what `kubectl describe` shows)."""
    meta = body["metadata"]
    stamp = (now or dt.datetime.now(dt.timezone.utc)).strftime("%Y-%m-%dT%H:%M:%SZ")
    event = {
        "apiVersion": "v1", "kind": "Event",
        "metadata": {"generateName": f"{meta['name']}.", "namespace": meta["namespace"]},
        "involvedObject": {"apiVersion": body["apiVersion"], "kind": body["kind"],
                           "name": meta["name"], "namespace": meta["namespace"],
                           "uid": meta.get("uid")},
        "type": type_, "reason": reason, "message": message[:1024],
        "source": {"component": COMPONENT}, "reportingComponent": COMPONENT,
        "reportingInstance": _HOST, "firstTimestamp": stamp, "lastTimestamp": stamp, "count": 1,
    }
    try:  # (kube.create wants a name; an Event has generateName)
        kube.request("POST", kube.path("v1", "Event", meta["namespace"]), body=event)
    except ApiException as exc:  # an Event is a courtesy: never fail a reconcile for it
        log.warning("could not post Event %s/%s on %s/%s: %s", type_, reason,
                    meta["namespace"], meta["name"], exc.reason)
