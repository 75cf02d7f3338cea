"""Helpers every renderer shares: the labels on every child, object metadata, env lists, and
where the operator mounts its own files inside pods. Pure: no I/O, no clock, no randomness.

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

# Everything the operator mounts into a pod lives under this folder (SSH key, hostfile, sshd
# config); the MPI-over-sshd test maps it onto a temporary folder.
MOUNT_ROOT = "/etc/trainop"


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
