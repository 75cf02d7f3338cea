"""DataStage: spec -> manifests. Pure: no I/O, no clock, no randomness.

    stage = datastage.parse(obj, cfg)                 # SpecError naming the field
    datastage.server_objects(stage, cfg)              # provision only: Service + StatefulSet
    datastage.volume_objects(stage, server)           # the NFS PV (cluster-scoped) + ROX claim
    datastage.copy_objects(stage, server, cfg)        # stager identity (SA/Role/Binding) + copy Job

Children are named after the DataStage (see the *_name functions). Namespaced children get the
DataStage as owner (kube.ensure); the PersistentVolume is cluster-scoped and cannot, so it carries
labels naming its DataStage and is deleted by the DataStage's finalizer.

The copy Job mounts the export itself, read-write, as an inline nfs volume; the PV and claim are
read-only (ReadOnlyMany, nfs.readOnly) because only training jobs use them.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

from trainop import GROUP, blob, crds
from trainop.config import Config
from trainop.render import common, identity
from trainop.spec import SpecError

LABEL_STAGE = f"{GROUP}/datastage"
LABEL_STAGE_NAMESPACE = f"{GROUP}/datastage-namespace"  # on the cluster-scoped PV
LABEL_ROLE = common.LABEL_ROLE
SHARE_MOUNT = "/share"
NFS_PORT = 2049
EXPORT_DIR = "/exports"  # inside the NFS server image (trainer_images/nfs-server)
DEFAULTS = {
    "image": "trainop/operator:0.1.0",  # the stager is part of the operator's package
    "nfsServerImage": "trainop/nfs-server:0.1.0",
    "progressIntervalSeconds": 5,
    # The copy runs as the operator image's non-root user; a provisioned server hands its export
    # root to the same uid/gid. An existing export must let this user write (or set yours here).
    "securityContext": {"runAsUser": 10001, "runAsGroup": 10001, "runAsNonRoot": True},
    "resources": {"requests": {"cpu": "1", "memory": "1Gi"}, "limits": {"memory": "4Gi"}},
    "nfsServerResources": {"requests": {"cpu": "1", "memory": "2Gi"}},
}


@dataclass(frozen=True)
class Stage:
    """A DataStage's spec, defaulted and checked."""
    name: str
    namespace: str
    account_url: str
    container: str
    prefixes: tuple[str, ...]
    auth: blob.BlobAuth
    nfs_server: str | None  # None: provisioned, or an existing claim
    nfs_path: str
    capacity: str
    storage_class: str | None
    mount_options: tuple[str, ...]
    extract: bool
    verify: bool
    concurrency: int
    range_concurrency: int
    backoff_limit: int
    spec_digest: str
    existing_claim: str | None = None  # destination.volumeClaim: the user's claim, no NFS at all

    @property
    def provisioned(self) -> bool:
        return self.nfs_server is None and self.existing_claim is None


def parse(obj: dict) -> Stage:
    """The DataStage as a Stage. The CRD schema already rejected what it can; this checks the
    rest (URL shape, auth block) and fills defaults from the same schema."""
    obj = crds.default(obj)
    meta, spec = obj["metadata"], obj.get("spec") or {}
    src = (spec.get("source") or {}).get("blob") or {}
    try:
        url = blob.check_account_url(src.get("accountURL"), "spec.source.blob.accountURL")
        auth = blob.parse_auth(src.get("auth"), "spec.source.blob.auth")
    except blob.BlobConfigError as exc:
        field, message = str(exc).split(": ", 1)
        raise SpecError(field, message) from None
    if not src.get("container"):
        raise SpecError("spec.source.blob.container", "required: the container to copy")
    prefixes = tuple(src.get("prefixes") or [src.get("prefix", "")])
    dest = spec.get("destination") or {}
    nfs, provision, claim = dest.get("nfs"), dest.get("provision"), dest.get("volumeClaim")
    if [bool(nfs), bool(provision), bool(claim)].count(True) != 1:
        raise SpecError("spec.destination", "set exactly one of nfs (an existing export), provision "
                                            "(an in-cluster NFS server) or volumeClaim (an existing claim)")
    copy = spec.get("copy") or {}
    return Stage(
        name=meta["name"], namespace=meta["namespace"], account_url=url, container=src["container"],
        prefixes=prefixes, auth=auth,
        nfs_server=nfs["server"] if nfs else None, nfs_path=nfs["path"] if nfs else "/",
        capacity=nfs["capacity"] if nfs else (provision or {}).get("size", ""),
        storage_class=(provision or {}).get("storageClassName"),
        mount_options=tuple(dest.get("mountOptions") or ()),
        extract=bool(spec.get("extract")), verify=bool(spec.get("verify")),
        concurrency=copy["concurrency"], range_concurrency=copy["rangeConcurrency"],
        backoff_limit=copy["backoffLimit"], existing_claim=(claim or {}).get("claimName"),
        spec_digest=hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:8])


# ---- names ----------------------------------------------------------------------------------

def volume_name(namespace: str, name: str) -> str:
    """Cluster-scoped, so the namespace is part of it (and the finalizer, which may face an
    unparsable spec, needs only the metadata)."""
    return f"trainop-{namespace}-{name}"


def claim_name(stage: Stage) -> str:
    return stage.existing_claim or f"{stage.name}-data"


def server_name(stage: Stage) -> str:
    return f"{stage.name}-nfs"


def copy_job_name(stage: Stage) -> str:
    """Changes with the spec: an edited DataStage gets a new copy Job (which resumes on the share)."""
    return f"{stage.name}-copy-{stage.spec_digest}"


def stager_identity_name(stage: Stage) -> str:
    return f"{stage.name}-stager"


def labels(stage: Stage, role: str) -> dict[str, str]:
    return {LABEL_STAGE: stage.name, LABEL_ROLE: role}


def _placement(cfg: Config) -> dict:
    """Copy Job and NFS server run on the CPU pool (defaultNodePools.cpu), never on GPU nodes."""
    pool = cfg.node_pools.get(cfg.default_node_pools.get("cpu") or "")
    if pool is None:
        return {}
    out: dict = {"nodeSelector": dict(pool.node_selector)}
    if pool.tolerations:
        out["tolerations"] = list(pool.tolerations)
    return out


def _settings(cfg: Config) -> dict:
    return {**DEFAULTS, **cfg.section("datastage")}


# ---- provisioned NFS server -----------------------------------------------------------------

def server_objects(stage: Stage, cfg: Config) -> list[dict]:
    """Service (its ClusterIP is what the PV uses: kubelets mount with the node's DNS, which
    cannot resolve cluster Service names) and the single-replica server StatefulSet, whose disk
    claim is deleted with it."""
    if not stage.provisioned:
        return []
    name, lbl, settings = server_name(stage), labels(stage, "nfs-server"), _settings(cfg)
    service = {
        "apiVersion": "v1", "kind": "Service",
        "metadata": common.metadata(name, stage.namespace, lbl),
        "spec": {"type": "ClusterIP", "selector": lbl,
                 "ports": [{"name": "nfs", "port": NFS_PORT, "targetPort": NFS_PORT, "protocol": "TCP"}]},
    }
    claim_spec: dict = {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": stage.capacity}}}
    if stage.storage_class:
        claim_spec["storageClassName"] = stage.storage_class
    statefulset = {
        "apiVersion": "apps/v1", "kind": "StatefulSet",
        "metadata": common.metadata(name, stage.namespace, lbl),
        "spec": {
            "serviceName": name, "replicas": 1, "selector": {"matchLabels": lbl},
            "persistentVolumeClaimRetentionPolicy": {"whenDeleted": "Delete", "whenScaled": "Retain"},
            "template": {
                "metadata": {"labels": lbl},
                "spec": {
                    **_placement(cfg),
                    "containers": [{
                        "name": "nfs-server", "image": settings["nfsServerImage"],
                        # The kernel NFS server needs to mount nfsd and start kernel threads.
                        "securityContext": {"privileged": True},
                        "ports": [{"name": "nfs", "containerPort": NFS_PORT, "protocol": "TCP"}],
                        "readinessProbe": {"tcpSocket": {"port": NFS_PORT}, "periodSeconds": 5},
                        "env": [{"name": "EXPORT_OWNER", "value": _owner(settings)}],
                        "volumeMounts": [{"name": "export", "mountPath": EXPORT_DIR}],
                        "resources": settings["nfsServerResources"],
                    }],
                },
            },
            "volumeClaimTemplates": [{"metadata": {"name": "export", "labels": lbl}, "spec": claim_spec}],
        },
    }
    return [service, statefulset]


def _owner(settings: dict) -> str:
    """uid:gid the copy runs as, which must own the provisioned export."""
    ctx = settings["securityContext"]
    return f"{ctx.get('runAsUser', 0)}:{ctx.get('runAsGroup', ctx.get('runAsUser', 0))}"


def server_address(stage: Stage, service: dict | None) -> str | None:
    """The NFS server for the PV and the copy Job; None while a provisioned Service has no IP."""
    if not stage.provisioned:
        return stage.nfs_server
    ip = ((service or {}).get("spec") or {}).get("clusterIP")
    return ip if ip and ip != "None" else None


# ---- volume ---------------------------------------------------------------------------------

def volume_objects(stage: Stage, server: str | None) -> list[dict]:
    """The NFS PV, pre-bound to the claim (claimRef) so no other claim can take it, and the
    claim, bound to the PV by name. Retain: deleting the PV never touches the data. None for an
    existing claim: the user's volume is used as it is."""
    if stage.existing_claim:
        return []
    pv_name, pvc_name = volume_name(stage.namespace, stage.name), claim_name(stage)
    pv_labels = {**labels(stage, "volume"), LABEL_STAGE_NAMESPACE: stage.namespace}
    pv_spec: dict = {
        "capacity": {"storage": stage.capacity},
        "accessModes": ["ReadOnlyMany"],
        "persistentVolumeReclaimPolicy": "Retain",
        "storageClassName": "",
        "nfs": {"server": server, "path": stage.nfs_path, "readOnly": True},
        "claimRef": {"apiVersion": "v1", "kind": "PersistentVolumeClaim",
                     "namespace": stage.namespace, "name": pvc_name},
    }
    if stage.mount_options:
        pv_spec["mountOptions"] = list(stage.mount_options)
    pv = {"apiVersion": "v1", "kind": "PersistentVolume",
          "metadata": {"name": pv_name, "labels": pv_labels}, "spec": pv_spec}
    pvc = {"apiVersion": "v1", "kind": "PersistentVolumeClaim",
           "metadata": common.metadata(pvc_name, stage.namespace, labels(stage, "volume")),
           "spec": {"accessModes": ["ReadOnlyMany"], "storageClassName": "", "volumeName": pv_name,
                    "resources": {"requests": {"storage": stage.capacity}}}}
    return [pv, pvc]


# ---- copy -----------------------------------------------------------------------------------

def stager_service_account(stage: Stage) -> str:
    """The federated ServiceAccount for workload identity (the user's), else our own."""
    return stage.auth.service_account_name or stager_identity_name(stage)


def rbac_objects(stage: Stage) -> list[dict]:
    """What lets the copy pod report progress: patch the status of this one DataStage, nothing
    else. The operator never needs the data's credentials for that."""
    return identity.objects(
        stager_identity_name(stage), stage.namespace, labels(stage, "copy"),
        [identity.rule(GROUP, "datastages/status", stage.name, ["get", "patch"])],
        account=stager_service_account(stage))


def stager_args(stage: Stage, progress_interval: float) -> list[str]:
    args = ["--account-url", stage.account_url, "--container", stage.container, "--dest", SHARE_MOUNT,
            "--concurrency", str(stage.concurrency), "--range-concurrency", str(stage.range_concurrency),
            "--datastage", f"{stage.namespace}/{stage.name}", "--progress-interval", str(progress_interval)]
    for prefix in stage.prefixes:
        if prefix:
            args += ["--prefix", prefix]
    if stage.verify:
        args.append("--verify")
    if stage.extract:
        args.append("--extract")
    return args


def _share_volume(stage: Stage, server: str | None) -> dict:
    if stage.existing_claim:
        return {"name": "share", "persistentVolumeClaim": {"claimName": stage.existing_claim}}
    # An inline nfs volume: the one thing that keeps this pod out of the `restricted` profile,
    # which allows claims but not nfs (docs/security.md).
    return {"name": "share", "nfs": {"server": server, "path": stage.nfs_path}}


def copy_job(stage: Stage, server: str | None, cfg: Config) -> dict:
    settings = _settings(cfg)
    lbl = labels(stage, "copy")
    pod_labels = {**lbl, **stage.auth.pod_labels()}
    return {
        "apiVersion": "batch/v1", "kind": "Job",
        "metadata": common.metadata(copy_job_name(stage), stage.namespace, lbl),
        "spec": {
            "backoffLimit": stage.backoff_limit,
            "template": {
                "metadata": {"labels": pod_labels},
                "spec": {
                    **_placement(cfg),
                    "restartPolicy": "Never",
                    "serviceAccountName": stager_service_account(stage),
                    "securityContext": common.pod_security_context(settings["securityContext"]),
                    "containers": [{
                        "name": "stager", "image": settings["image"],
                        "command": ["python", "-m", "trainop.stager"],
                        "args": stager_args(stage, settings["progressIntervalSeconds"]),
                        "env": stage.auth.container_env(),
                        "volumeMounts": [{"name": "share", "mountPath": SHARE_MOUNT}],
                        "resources": settings["resources"],
                        # the stager's one-line error becomes the pod's termination message
                        "terminationMessagePolicy": "FallbackToLogsOnError",
                        "securityContext": common.container_security_context(),
                    }],
                    "volumes": [_share_volume(stage, server)],
                },
            },
        },
    }


def copy_objects(stage: Stage, server: str, cfg: Config) -> list[dict]:
    return [*rbac_objects(stage), copy_job(stage, server, cfg)]
