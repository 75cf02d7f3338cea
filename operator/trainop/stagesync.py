"""One reconcile of a DataStage: parse -> referenced Secret / ServiceAccount exist -> (provision)
NFS server Service + StatefulSet, wait until it serves -> PV + claim -> stager identity + copy Job
-> phase from the Job. `cleanup()` is the finalizer's work: the cluster-scoped PV.

Bad input (a spec the schema could not reject, a missing Secret or key) sets Failed naming the
field, posts a Warning Event, and creates nothing; it is re-checked on every tick, so creating
the Secret afterwards lets the DataStage proceed. Level-based like jobsync: every step is
create-if-missing from the live objects, so an interrupted reconcile re-runs cleanly.

Status keys written here: phase, conditions, claimName, volumeName, server, copyJobName,
observedGeneration. The copy Job's stager writes the progress counters and lastError itself
(status subresource), so the two writers never touch the same key.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

from trainop import blob, conditions, kube
from trainop.config import Config
from trainop.render import datastage as render
from trainop.spec import SpecError

_METHOD_REFS = {method: ref for ref, method in blob.SECRET_REFS.items()}
AUTH_FIELD = "spec.source.blob.auth"
OWNED_KEYS = ("phase", "conditions", "claimName", "volumeName", "server", "copyJobName", "observedGeneration")


@dataclass
class Result:
    status: dict  # the OWNED_KEYS, as they should be
    events: list[tuple[str, str, str]] = field(default_factory=list)  # (type, reason, message)
    wait: str | None = None  # why it is not settled (-> kopf.TemporaryError)


class _Status:
    def __init__(self, old: dict, generation: int | None):
        self.old_phase = old.get("phase")
        self.data = {k: copy.deepcopy(old[k]) for k in OWNED_KEYS if k in old}
        self.data["observedGeneration"] = generation
        self.generation = generation
        self.events: list[tuple[str, str, str]] = []

    def cond(self, type_: str, status: bool, reason: str, message: str) -> None:
        self.data["conditions"] = conditions.set_condition(
            self.data.get("conditions"), type_, status, reason, message, generation=self.generation)

    def phase(self, value: str, reason: str, message: str, warning: bool = False) -> None:
        """Set the phase and the Ready condition; an Event only when the phase changes."""
        self.data["phase"] = value
        self.cond("Ready", value == "Ready", reason, message)
        if value != self.old_phase:
            self.events.append(("Warning" if warning else "Normal", reason, message))

    def result(self, wait: str | None = None) -> Result:
        return Result(self.data, self.events, wait)


def check_references(stage: render.Stage) -> None:
    """The Secret (and key) or the federated ServiceAccount the copy pod will need."""
    auth = stage.auth
    if auth.method == "WorkloadIdentity":
        if not auth.service_account_name:
            raise SpecError(f"{AUTH_FIELD}.serviceAccountName", "required with workloadIdentity: name the ServiceAccount federated with a managed identity that may read the container")
        if kube.get("v1", "ServiceAccount", auth.service_account_name, stage.namespace) is None:
            raise SpecError(f"{AUTH_FIELD}.serviceAccountName", f"ServiceAccount {auth.service_account_name!r} not found in namespace {stage.namespace}; create it (with the azure.workload.identity/client-id annotation)")
        return
    where = f"{AUTH_FIELD}.{_METHOD_REFS[auth.method]}"
    secret = kube.get("v1", "Secret", auth.secret_name, stage.namespace)
    if secret is None:
        raise SpecError(f"{where}.name", f"Secret {auth.secret_name!r} not found in namespace {stage.namespace}; create it with the credential under key {auth.secret_key!r}")
    if auth.secret_key not in (secret.get("data") or {}):
        raise SpecError(f"{where}.key", f"Secret {auth.secret_name!r} has no key {auth.secret_key!r}; add it or fix the key")


def sync(body: dict, cfg: Config) -> Result:
    meta = body["metadata"]
    st = _Status(body.get("status") or {}, meta.get("generation"))
    if meta.get("deletionTimestamp"):  # the finalizer's turn: creating anything now would leak it
        return st.result()
    try:
        stage = render.parse(body)
        check_references(stage)
    except SpecError as exc:
        st.phase("Failed", "InvalidSpec", str(exc), warning=True)
        return st.result()

    server = stage.nfs_server
    if stage.provisioned:
        service, statefulset = render.server_objects(stage, cfg)
        server = render.server_address(stage, kube.ensure(service, owner=body))
        live = kube.ensure(statefulset, owner=body)
        ready = ((live.get("status") or {}).get("readyReplicas") or 0) >= 1
        st.cond("ServerReady", ready and bool(server), "ServerReady" if ready else "ServerStarting",
                f"NFS server {render.server_name(stage)} at {server}" if ready
                else f"waiting for NFS server {render.server_name(stage)} to be ready")
        if not (ready and server):
            st.phase("Provisioning", "ServerStarting", f"waiting for NFS server {render.server_name(stage)}")
            return st.result(wait="NFS server not ready")
    if stage.existing_claim:
        if kube.get("v1", "PersistentVolumeClaim", stage.existing_claim, stage.namespace) is None:
            st.phase("Pending", "ClaimMissing", f"waiting for PersistentVolumeClaim {stage.existing_claim} "
                                                f"(spec.destination.volumeClaim.claimName) in {stage.namespace}")
            return st.result(wait="claim missing")
        st.data["claimName"] = stage.existing_claim
    else:
        st.data["server"] = server
        pv, pvc = render.volume_objects(stage, server)
        kube.ensure(pv)  # cluster-scoped: no owner reference; the finalizer deletes it
        kube.ensure(pvc, owner=body)
        st.data |= {"volumeName": pv["metadata"]["name"], "claimName": pvc["metadata"]["name"]}

    for obj in render.copy_objects(stage, server, cfg):
        kube.ensure(obj, owner=body, update=obj["kind"] != "Job")  # a Job's template is immutable
    job_name = render.copy_job_name(stage)
    st.data["copyJobName"] = job_name
    for old in kube.list_objects("batch/v1", "Job", stage.namespace,
                                 labels=render.labels(stage, "copy")):
        if old["metadata"]["name"] != job_name:  # an earlier spec's copy
            kube.delete("batch/v1", "Job", old["metadata"]["name"], stage.namespace, uid=old["metadata"]["uid"])
    return _copy_phase(st, kube.get("batch/v1", "Job", job_name, stage.namespace), body)


def _copy_phase(st: _Status, job: dict | None, body: dict) -> Result:
    status = (job or {}).get("status") or {}
    finished = {c["type"]: c for c in status.get("conditions") or [] if c.get("status") == "True"}
    name = (job or {}).get("metadata", {}).get("name")
    if "Complete" in finished or (status.get("succeeded") or 0) >= 1:
        st.cond("Copied", True, "CopyComplete", f"copy Job {name} succeeded")
        st.phase("Ready", "CopyComplete", f"data staged; claim {st.data['claimName']} is ready to mount read-only")
        return st.result()
    if "Failed" in finished:
        why = (body.get("status") or {}).get("lastError") or finished["Failed"].get("message") or "failed"
        message = f"copy Job {name} failed: {why}; fix the cause, then delete the Job to retry (the copy resumes)"
        st.cond("Copied", False, "CopyFailed", message)
        st.phase("Failed", "CopyFailed", message, warning=True)
        return st.result()
    st.cond("Copied", False, "Copying", f"copy Job {name} is running")
    st.phase("Copying", "Copying", f"copy Job {name} is copying blobs to the share")
    return st.result(wait="copy Job running")


def cleanup(body: dict) -> None:
    """Finalizer: the PV (cluster-scoped, so owner references cannot remove it). Namespaced
    children go with the DataStage through their owner references."""
    meta = body["metadata"]
    kube.delete("v1", "PersistentVolume", render.volume_name(meta["namespace"], meta["name"]))

