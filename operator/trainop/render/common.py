"""Helpers every renderer shares: the labels on every child, object metadata, env lists, the
security contexts of pods and containers, and where the operator mounts its own files inside pods. Pure: no I/O, no clock, no randomness.

    from trainop.render import common
    meta = common.metadata("j1-worker-0", "team-a", common.labels("j1", "worker", 0))
    container["env"] = common.env({"NCCL_DEBUG": "WARN"})

Owner references are added by kube.ensure(obj, owner=...), not here, so renderers stay
independent of the live object's uid.
"""

from __future__ import annotations

from trainop import GROUP

LABEL_JOB = f"{GROUP}/job-name"
LABEL_ROLE = f"{GROUP}/role"
LABEL_INDEX = f"{GROUP}/replica-index"
LABEL_ATTEMPT = f"{GROUP}/attempt"
# On a training job's pods that mount a DataStage's claim: the DataStage's name. Not
# trainop.io/datastage, which routes a child to its DataStage. A provisioned NFS server's
# NetworkPolicy admits these pods (render/datastage.py).
LABEL_READS_STAGE = f"{GROUP}/reads-datastage"

# Everything the operator mounts into a pod lives under this folder (SSH key, hostfile, sshd
# config); the MPI-over-sshd test maps it onto a temporary folder.
MOUNT_ROOT = "/etc/trainop"


def container_security_context() -> dict:
    """What the `restricted` Pod Security profile asks of every container: no privilege
    escalation (no_new_privs: setuid binaries and file capabilities cannot raise it either) and
    no capabilities. docs/security.md lists every pod the operator makes and its exceptions."""
    return {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}


def pod_security_context(fields: dict) -> dict:
    """A non-root pod under the runtime's default seccomp filter, then `fields` (runAsUser,
    runAsGroup, fsGroup, ...), which win."""
    return {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}} | fields


def labels(job_name: str, role: str | None = None, index: int | None = None) -> dict[str, str]:
    out = {LABEL_JOB: job_name}
    if role is not None:
        out[LABEL_ROLE] = role
    if index is not None:
        out[LABEL_INDEX] = str(index)
    return out


def metadata(name: str, namespace: str, labels_: dict[str, str],
             annotations: dict[str, str] | None = None) -> dict:
    meta: dict = {"name": name, "namespace": namespace, "labels": dict(labels_)}
    if annotations:
        meta["annotations"] = dict(annotations)
    return meta


def env(values: dict[str, str]) -> list[dict]:
    """{"A": "1"} -> [{"name": "A", "value": "1"}], in the mapping's order."""
    return [{"name": k, "value": str(v)} for k, v in values.items()]


def scratch_volume(name: str, size_limit: str | None) -> dict:
    """An emptyDir on the node's disk that trainop adds and job code writes into, capped by the
    admin's limits.emptyDirSizeLimit: past it the kubelet evicts the pod (a counted
    StorageLimit failure, jobsync/failures.py) before the node's disk fills."""
    return {"name": name, "emptyDir": {"sizeLimit": size_limit} if size_limit else {}}
