"""The decisions of a DataStage's reconcile: parse -> what the admin allows (account endpoint,
NFS export) -> referenced Secret / ServiceAccount exist (until the copy of this spec is done) ->
(provision) NetworkPolicy, NFS server Service + StatefulSet, wait until it serves -> PV (only
ours: labelled with this DataStage's uid) + claim -> stager identity + copy Job -> phase from
the Job. The finalizer FINALIZER is the reconcile's too (not kopf's, whose handlers would also
run on a standby replica: leader.py): put on before any child exists, and once the DataStage is
being deleted, its work is done (`_release`): the cluster-scoped PV (the one child owner
references cannot remove), deleted only if its label carries this DataStage's uid, then the
finalizer taken off.

    outcome = stagesync.decide(StageSnapshot(body, ...), cfg)

Pure, like jobsync.decide: the snapshot holds what the watch caches hold (controller.py).
Bad input (a spec the schema could not reject, a missing Secret or key) sets Failed naming the
field, posts a Warning Event, and creates nothing. ServiceAccounts and claims are watched, so
creating one wakes the DataStage; Secrets are not (the operator must not hold every credential
of a namespace), so a DataStage whose Secret or key is missing looks again every
SECRET_RECHECK_SECONDS, reading that one Secret. Once the copy of the current spec has
completed, the Secret is no longer needed: deleting it leaves a Ready stage Ready (a job that
mounts the claim needs no credential), and only a new copy (an edited spec, a deleted copy Job)
asks for it again.

Status keys written here: phase, conditions, claimName, volumeName, server, copyJobName,
observedGeneration, and the copy's progress (counters, skipped, lastError, progress): the copy
Job's stager reports those into the DataStage's progress ConfigMap (render/datastage.py), which
the controller reads by name for each reconcile (it is not watched: ConfigMaps are watched by
the job label only); the operator checks the report and writes the status, so the stager's
identity has no right on the DataStage at all. While a copy runs, the DataStage is looked at
again every `datastage.progressIntervalSeconds`, the stager's reporting interval.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass, field

from trainop import blob, conditions, kube
from trainop.actions import (
    Apply,
    Create,
    Delete,
    Outcome,
    Patch,
    Ref,
    SetFinalizers,
    delete,
)
from trainop.config import Config, allowed_name
from trainop.render import datastage as render
from trainop.spec import SpecError, Stage, parse_stage

_METHOD_REFS = {method: ref for ref, method in blob.SECRET_REFS.items()}
log = logging.getLogger("trainop.stagesync")
AUTH_FIELD = "spec.source.blob.auth"
NFS_FIELD = "spec.destination.nfs"
SECRET_RECHECK_SECONDS = 10.0  # also how often a PV name held by a foreign PV is looked at again
FINALIZER = "trainop.io/finalizer"  # what earlier versions' kopf handler put on: the same name
OWNED_KEYS = ("phase", "conditions", "claimName", "volumeName", "server", "copyJobName",
              "observedGeneration", "bytesCopied", "bytesTotal", "filesCopied", "filesTotal",
              "skippedBlobs", "skipped", "lastError", "progress")


@dataclass
class StageSnapshot:
    body: dict
    secret_keys: dict[str, tuple[str, ...]] = field(default_factory=dict)  # Secret -> its keys (read
    #                                                  from the API by the controller, not watched)
    service_accounts: set[str] = field(default_factory=set)               # names in the namespace
    claims: set[str] = field(default_factory=set)  # PersistentVolumeClaims it names (volumeClaim)
    service: dict | None = None      # the provisioned NFS server's Service
    statefulset: dict | None = None  # ... and StatefulSet
    copy_jobs: list[dict] = field(default_factory=list)  # label trainop.io/datastage=<name>
    volume: dict | None = None  # the PV named render.volume_name(uid), read by name (not watched)
    progress: dict | None = None  # the stager's progress ConfigMap, read by name (not watched)
    readers: list[tuple[str, str]] = field(default_factory=list)  # (pod IP, its node's InternalIP)
    #                                  of each running pod labelled as reading it ("" while unknown)
    server_pod: dict | None = None  # the Ganesha server's pod (its CLIENTS_ANNOTATION)


class _Status:
    def __init__(self, old: dict, generation: int | None, stamp: str):
        self.old_phase = old.get("phase")
        self.data = {k: copy.deepcopy(old[k]) for k in OWNED_KEYS if k in old}
        self.data["observedGeneration"] = generation
        self.generation, self.stamp = generation, stamp
        self.events: list[tuple[str, str, str]] = []

    def cond(self, type_: str, status: bool, reason: str, message: str) -> None:
        self.data["conditions"] = conditions.set_condition(
            self.data.get("conditions"), type_, status, reason, message,
            generation=self.generation, timestamp=self.stamp)

    def phase(self, value: str, reason: str, message: str, warning: bool = False) -> None:
        """Set the phase and the Ready condition; an Event only when the phase changes."""
        self.data["phase"] = value
        self.cond("Ready", value == "Ready", reason, message)
        if value != self.old_phase:
            self.events.append(("Warning" if warning else "Normal", reason, message))

    def outcome(self, actions: list, waiting: str | None = None) -> Outcome:
        return Outcome(actions=actions, status=self.data, events=self.events, waiting=waiting)


class MissingSecret(SpecError):
    """The referenced Secret, or its key, does not exist (yet)."""


def secret_refs(body: dict) -> set[str]:
    """Names of the Secrets a DataStage's auth block points at."""
    auth = ((((body.get("spec") or {}).get("source") or {}).get("blob") or {}).get("auth")) or {}
    return {ref["name"] for key, ref in auth.items()
            if key.endswith("SecretRef") and isinstance(ref, dict) and ref.get("name")}


def check_references(stage: Stage, snap: StageSnapshot) -> None:
    """The Secret (and key) or the federated ServiceAccount the copy pod will need."""
    auth = stage.auth
    if auth.method == "WorkloadIdentity":
        if not auth.service_account_name:
            raise SpecError(f"{AUTH_FIELD}.serviceAccountName", "required with workloadIdentity: name the ServiceAccount federated with a managed identity that may read the container")
        if auth.service_account_name not in snap.service_accounts:
            raise SpecError(f"{AUTH_FIELD}.serviceAccountName", f"ServiceAccount {auth.service_account_name!r} not found in namespace {stage.namespace}; create it (with the azure.workload.identity/client-id annotation)")
        return
    where = f"{AUTH_FIELD}.{_METHOD_REFS[auth.method]}"
    keys = snap.secret_keys.get(auth.secret_name)
    if keys is None:
        raise MissingSecret(f"{where}.name", f"Secret {auth.secret_name!r} not found in namespace {stage.namespace}; create it with the credential under key {auth.secret_key!r}")
    if auth.secret_key not in keys:
        raise MissingSecret(f"{where}.key", f"Secret {auth.secret_name!r} has no key {auth.secret_key!r}; add it or fix the key")


# NFS mount options a DataStage may set (the kubelet mounts its PV on the node). Left out on
# purpose: addr=/mountaddr=/mounthost=/port=/mountport= (they point the mount at another server
# than the one allowed), rw (the PV is read-only), suid/dev/exec-style widenings, context= and
# other security labels, and anything unknown.
MOUNT_OPTIONS = frozenset({"hard", "soft", "intr", "nointr", "ac", "noac", "cto", "nocto",
                           "lock", "nolock", "sharecache", "nosharecache", "resvport", "noresvport",
                           "ro", "nosuid", "nodev", "noexec", "noatime", "nodiratime", "relatime",
                           "fsc", "nofsc", "rdirplus", "nordirplus", "tcp"})
MOUNT_OPTION_VALUES = frozenset({"vers", "nfsvers", "minorversion", "nconnect", "rsize", "wsize",
                                 "timeo", "retrans", "acregmin", "acregmax", "acdirmin",
                                 "acdirmax", "actimeo", "lookupcache", "proto", "local_lock",
                                 "max_connect", "retry", "sec"})
MOUNT_FIELD = "spec.destination.mountOptions"


def check_mount_options(options: tuple[str, ...]) -> None:
    for i, option in enumerate(options):
        key, eq, _value = option.partition("=")
        if (option in MOUNT_OPTIONS) if not eq else (key in MOUNT_OPTION_VALUES):
            continue
        raise SpecError(f"{MOUNT_FIELD}[{i}]", f"{option!r} is not an allowed NFS mount option; use "
                                              f"{', '.join(sorted(MOUNT_OPTION_VALUES))} (as key=value) "
                                              f"or {', '.join(sorted(MOUNT_OPTIONS))}")


def check_allowed(stage: Stage, cfg: Config) -> None:
    """What only the cluster admin may open up: the account endpoint credentials are sent to, the
    existing NFS exports a namespace may mount (a PV is cluster-wide, and the copy Job mounts the
    export read-write: without this, any namespace could overwrite any export the nodes reach),
    provisioned servers (an NFS server pod in the tenant's namespace), the mount options, and the
    ServiceAccount the copy pod runs as (with its Role bound to it): like a job's upload account,
    one the admin lists in blob.allowedServiceAccounts, else a user who may create DataStages but
    not pods would run pods as any identity of the namespace."""
    account = stage.auth.service_account_name
    if account and not allowed_name(cfg.allowed_service_accounts, stage.namespace, account):
        raise SpecError(f"{AUTH_FIELD}.serviceAccountName", f"{account!r} is not a ServiceAccount "
                        f"DataStages may read as (the copy pod runs as it): ask the cluster admin "
                        f"to add it to blob.allowedServiceAccounts")
    try:
        blob.check_endpoint_allowed(stage.account_url, "spec.source.blob.accountURL",
                                    cfg.allowed_account_urls)
    except blob.BlobConfigError as exc:
        raise SpecError(*str(exc).split(": ", 1)) from None
    check_mount_options(stage.mount_options)
    if stage.provisioned and not cfg.allow_provisioned_servers:
        raise SpecError("spec.destination.provision",
                        "provisioned NFS servers are off in this cluster (they run an NFS server pod "
                        "in your namespace); use destination.volumeClaim or an allowed "
                        "destination.nfs export, or ask the cluster admin to set "
                        "datastage.allowProvisionedServers")
    if stage.nfs_server is None:
        return
    ask = ("ask the cluster admin to add it to datastage.allowedNfsExports in the operator "
           "configuration, or use destination.volumeClaim")
    exports = [e for e in cfg.allowed_nfs_exports if e.server == stage.nfs_server]
    if not exports:
        raise SpecError(f"{NFS_FIELD}.server", f"NFS server {stage.nfs_server!r} is not an allowed "
                                               f"export server; {ask}")
    mine = [p for p in (e.prefix_for(stage.namespace) for e in exports) if p is not None]
    if not mine:
        raise SpecError(f"{NFS_FIELD}.server", f"no export on {stage.nfs_server} is allowed for "
                                               f"namespace {stage.namespace}; {ask}")
    if not any(_under(stage.nfs_path, prefix) for prefix in mine):
        raise SpecError(f"{NFS_FIELD}.path", f"{stage.nfs_path!r} on {stage.nfs_server} is not under an "
                                             f"export path allowed for namespace {stage.namespace} "
                                             f"({', '.join(mine)}); {ask}")


def _under(path: str, prefix: str) -> bool:
    """`path` is `prefix` or below it, by whole segments, after removing . and .. segments."""
    parts: list[str] = []
    for part in path.split("/"):
        if part == "..":
            if parts:
                parts.pop()
        elif part not in ("", "."):
            parts.append(part)
    clean, want = "/" + "/".join(parts), prefix.rstrip("/") or "/"
    return want == "/" or clean == want or clean.startswith(want + "/")


def foreign_volume(stage: Stage, volume: dict | None) -> str | None:
    """A PV of our name that does not carry our uid: never patched, never deleted."""
    if volume is None:
        return None
    got = (volume["metadata"].get("labels") or {}).get(render.LABEL_STAGE_UID)
    if got == stage.uid:
        return None
    return (f"PersistentVolume {volume['metadata']['name']} exists and its label "
            f"{render.LABEL_STAGE_UID} is {got!r}, not this DataStage's uid; it is not touched. "
            f"A cluster admin must delete or rename it")


def _version(obj: dict | None) -> str:
    return (obj or {}).get("metadata", {}).get("resourceVersion", "")


def decide(snap: StageSnapshot, cfg: Config, stamp: str) -> Outcome:
    """Every decision of one reconcile; `stamp` is now (RFC 3339) for new conditions."""
    body = snap.body
    meta = body["metadata"]
    st = _Status(body.get("status") or {}, meta.get("generation"), stamp)
    finalizers = tuple(meta.get("finalizers") or ())
    if meta.get("deletionTimestamp"):  # the finalizer's turn: creating anything now would leak it
        return _release(snap)
    if FINALIZER not in finalizers:  # before any child: a PV made without it could outlive us
        return Outcome([SetFinalizers.adding(body, FINALIZER)])
    try:
        stage = parse_stage(body)
        check_allowed(stage, cfg)
        job_name = render.copy_job_name(stage)
        current = next((j for j in snap.copy_jobs if j["metadata"]["name"] == job_name
                        and kube.controlled_by(j, body)), None)
        if not _succeeded(current):  # the credential matters only while there is copying to do
            check_references(stage, snap)
    except SpecError as exc:
        st.phase("Failed", "InvalidSpec", str(exc), warning=True)
        out = st.outcome([])
        if isinstance(exc, MissingSecret):
            out.requeue_after = SECRET_RECHECK_SECONDS
        return out
    if not stage.existing_claim and (taken := foreign_volume(stage, snap.volume)):
        st.phase("Failed", "VolumeConflict", taken, warning=True)
        out = st.outcome([])
        out.requeue_after = SECRET_RECHECK_SECONDS  # PVs are not watched: look again
        return out

    actions: list = []
    server = stage.nfs_server
    if stage.provisioned:
        # the policy first, so the server never serves unprotected
        actions.append(Apply(render.network_policy(stage, cfg, snap.readers), body, None))
        if cfg.nfs_server == "ganesha":
            actions += _clients(cfg, snap)
        service, statefulset = render.server_objects(stage, cfg, (body.get("status") or {}).get("server"))
        actions += [Apply(service, body, _version(snap.service)),
                    Apply(statefulset, body, _version(snap.statefulset))]
        server = render.server_address(stage, snap.service)
        ready = (((snap.statefulset or {}).get("status") or {}).get("readyReplicas") or 0) >= 1
        st.cond("ServerReady", ready and bool(server), "ServerReady" if ready else "ServerStarting",
                f"NFS server {render.server_name(stage)} at {server}" if ready
                else f"waiting for NFS server {render.server_name(stage)} to be ready")
        if not (ready and server):
            st.phase("Provisioning", "ServerStarting", f"waiting for NFS server {render.server_name(stage)}")
            return st.outcome(actions, waiting="NFS server not ready")
    if stage.existing_claim:
        if stage.existing_claim not in snap.claims:
            st.phase("Pending", "ClaimMissing", f"waiting for PersistentVolumeClaim {stage.existing_claim} "
                                                f"(spec.destination.volumeClaim.claimName) in {stage.namespace}")
            return st.outcome(actions, waiting="claim missing")
        st.data["claimName"] = stage.existing_claim
    else:
        st.data["server"] = server
        pv, pvc = render.volume_objects(stage, server)
        # cluster-scoped: no owner reference; the finalizer deletes it. The guard: a name taken
        # meanwhile by a PV without our uid is a conflict, not something to apply over.
        actions += [Apply(pv, None, _version(snap.volume), guard=(render.LABEL_STAGE_UID, stage.uid)),
                    Apply(pvc, body, None)]
        if _released(snap.volume, stage.uid):  # its claim was deleted and made again: rebind
            actions.append(Patch(Ref.of(snap.volume), {"spec": {"claimRef": {"uid": None,
                                                                             "resourceVersion": None}}}))
        st.data |= {"volumeName": pv["metadata"]["name"], "claimName": pvc["metadata"]["name"]}

    for obj in render.copy_objects(stage, server, cfg):
        if obj["kind"] != "Job":
            actions.append(Apply(obj, body, None))
    for job in snap.copy_jobs:  # an earlier spec's copy goes
        if job["metadata"]["name"] != job_name and not job["metadata"].get("deletionTimestamp"):
            actions.append(delete(job))
    if current is None:  # a Job's template is immutable: created once per spec
        actions.append(Create(render.copy_job(stage, server, cfg), body))
    st.data["copyJobName"] = job_name
    if snap.progress is not None and kube.controlled_by(snap.progress, body):  # ours, not a look-alike
        st.data |= render.progress_report(snap.progress)
    out = _copy_phase(st, current, actions)
    if out.status["phase"] == "Copying":  # the report is read, not watched: look again
        out.requeue_after = float(render.stage_settings(cfg)["progressIntervalSeconds"])
    return out


def _clients(cfg: Config, snap: StageSnapshot) -> list:
    """The Ganesha server's client list (render.export_clients) onto its running pod, when the
    pod's annotation says otherwise (a new pod has none: it serves nobody until then)."""
    pod = snap.server_pod
    want = render.clients_annotation(render.export_clients(cfg, snap.readers))
    if pod is None or pod["metadata"].get("deletionTimestamp") or \
            pod["metadata"].get("annotations", {}).get(render.CLIENTS_ANNOTATION) == want:
        return []
    return [Patch(Ref.of(pod), {"metadata": {"annotations": {render.CLIENTS_ANNOTATION: want}}})]


def _released(volume: dict | None, uid: str) -> bool:
    """Our PV, Released: the claim it was bound to is gone (someone deleted it; Apply made it
    again), and the binder never binds a PV whose claimRef names another claim's uid."""
    return volume is not None and ((volume.get("status") or {}).get("phase") == "Released") and \
        (volume["metadata"].get("labels") or {}).get(render.LABEL_STAGE_UID) == uid


def _finished(job: dict | None) -> dict:
    status = (job or {}).get("status") or {}
    return {c["type"]: c for c in status.get("conditions") or [] if c.get("status") == "True"}


def _succeeded(job: dict | None) -> bool:
    return job is not None and ("Complete" in _finished(job) or
                                ((job.get("status") or {}).get("succeeded") or 0) >= 1)


def _copy_phase(st: _Status, job: dict | None, actions: list) -> Outcome:
    finished = _finished(job)
    name = (job or {}).get("metadata", {}).get("name") or st.data["copyJobName"]
    if _succeeded(job):
        st.cond("Copied", True, "CopyComplete", f"copy Job {name} succeeded")
        skipped = st.data.get("skippedBlobs") or 0
        note = f"; {skipped} blob(s) skipped, see status.skipped" if skipped else ""
        st.phase("Ready", "CopyComplete", f"data staged; claim {st.data['claimName']} is ready to "
                                          f"mount read-only{note}")
        return st.outcome(actions)
    if "Failed" in finished:
        why = st.data.get("lastError") or finished["Failed"].get("message") or "failed"
        message = f"copy Job {name} failed: {why}; fix the cause, then delete the Job to retry (the copy resumes)"
        st.cond("Copied", False, "CopyFailed", message)
        st.phase("Failed", "CopyFailed", message, warning=True)
        return st.outcome(actions)
    st.cond("Copied", False, "Copying", f"copy Job {name} is running")
    st.phase("Copying", "Copying", f"copy Job {name} is copying blobs to the share")
    return st.outcome(actions, waiting="copy Job running")


def _release(snap: StageSnapshot) -> Outcome:
    """The finalizer's work: the PV (cluster-scoped, so owner references cannot remove it), only
    if its label carries this DataStage's uid, and only that incarnation (uid precondition),
    then the finalizer off. Namespaced children go with the DataStage through their owner
    references."""
    meta = snap.body["metadata"]
    finalizers = tuple(meta.get("finalizers") or ())
    if FINALIZER not in finalizers:
        return Outcome()
    actions: list = []
    pv = snap.volume
    if pv is not None and not pv["metadata"].get("deletionTimestamp") and \
            (pv["metadata"].get("labels") or {}).get(render.LABEL_STAGE_UID) == meta["uid"]:
        actions.append(Delete(Ref.of(pv)))  # (a PV without our uid is left alone)
    actions.append(SetFinalizers.dropping(snap.body, FINALIZER))
    return Outcome(actions)
