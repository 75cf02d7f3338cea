"""DataStage: spec -> manifests. Pure: no I/O, no clock, no randomness.

    stage = spec.parse_stage(obj)                     # the model (spec.py): SpecError naming the field
    datastage.server_objects(stage, cfg)              # provision only: Service + StatefulSet
    datastage.network_policy(stage, cfg, readers)     # provision only: who may reach the server
    datastage.export_clients(cfg, readers)            # provision (Ganesha) only: whom the export serves
    datastage.volume_objects(stage, server)           # the NFS PV (cluster-scoped) + ROX claim
    datastage.copy_objects(stage, server, cfg)        # stager identity (SA/Role/Binding) + copy Job
    datastage.progress_config_map(stage)              # where the stager reports (progress_report reads it)

Children are named after the DataStage (see the *_name functions). Namespaced children get the
DataStage as owner (kube.ensure); the PersistentVolume is cluster-scoped and cannot, so it is
named after the DataStage's uid (two namespaces can never share a name), carries a label with
that uid, and is deleted by the DataStage's finalizer only while the label says it is its own.

The PV and claim are read-only (ReadOnlyMany, nfs.readOnly) because only training jobs use them.
The copy Job writes: into an existing export as an inline nfs volume, into a provisioned
server's disk directly (its claim, on the server's node), since that server exports read-only.
"""

from __future__ import annotations

import json
from collections.abc import Iterable

from trainop import GROUP
from trainop.config import Config
from trainop.render import common, identity
from trainop.spec import Stage

LABEL_STAGE = f"{GROUP}/datastage"
LABEL_STAGE_NAMESPACE = f"{GROUP}/datastage-namespace"  # on the cluster-scoped PV
LABEL_STAGE_UID = f"{GROUP}/datastage-uid"  # on the PV: the only thing the finalizer trusts
LABEL_READS_STAGE = common.LABEL_READS_STAGE  # on job pods that mount the claim
LABEL_ROLE = common.LABEL_ROLE
SHARE_MOUNT = "/share"
NFS_PORT = 2049
EXPORT_DIR = "/exports"  # inside the NFS server images (trainer_images/nfs-server, -kernel)
GANESHA_UID = 10002  # trainer_images/nfs-server's user: not the copy's uid, so it owns no file it serves
GANESHA_RUN_DIR = "/run/ganesha"  # its writable place (config, pid, recovery): an emptyDir
# The Ganesha pod's client list (export_clients, comma-separated): an annotation that stagesync
# puts on the running server pod and the downward API puts in a file of it (CLIENTS_FILE), which
# the server follows. Not the pod template: a change there would restart the server. Not a
# ConfigMap: the kubelet refreshes a ConfigMap volume at its next periodic sync of the pod (a
# minute or more, while a new reader's mount keeps failing), but a pod's own annotations at
# once, since changing them is a pod update, which makes the kubelet sync the pod.
CLIENTS_ANNOTATION = f"{GROUP}/nfs-clients"
CLIENTS_DIR = "/etc/trainop/nfs-clients"
CLIENTS_FILE = f"{CLIENTS_DIR}/clients"
# The PV's mount option when the DataStage names no version: both servers speak NFSv4 only (one
# TCP port, no rpcbind or mountd), and 4.1 is what Ganesha is set up and tested for.
DEFAULT_NFS_VERSION = "nfsvers=4.1"
# Kernel server (datastage.server: kernel): read-only to every client: the copy Job writes the
# server's disk directly, so no NFS client can change the data. fsid=0: the NFSv4 root (clients
# mount "<server>:/"); no "insecure": only privileged source ports (kubelets' kernel mounts).
EXPORT_OPTIONS = "ro,fsid=0,sync,no_subtree_check,root_squash"
DEFAULTS = {
    "image": "trainop/operator:0.1.0",  # the stager is part of the operator's package
    "nfsServerImage": "trainop/nfs-server:0.2.0",  # NFS-Ganesha (datastage.server: ganesha)
    "nfsKernelServerImage": "trainop/nfs-server-kernel:0.1.0",  # datastage.server: kernel
    "progressIntervalSeconds": 5,
    # The copy runs as the operator image's non-root user; a provisioned server's disk becomes
    # writable to its group through the copy pod's fsGroup (the kernel server also chowns it to
    # this uid/gid). An existing export must let this user write (or set yours here).
    "securityContext": {"runAsUser": 10001, "runAsGroup": 10001, "runAsNonRoot": True},
    "resources": {"requests": {"cpu": "1", "memory": "1Gi"}, "limits": {"memory": "4Gi"}},
    "nfsServerResources": {"requests": {"cpu": "1", "memory": "2Gi"}},
    # The Ganesha container's seccomp profile. Not RuntimeDefault: containerd's default profile
    # (1.6.20 tried here) refuses open_by_handle_at(2) with EPERM even to a container that holds
    # CAP_DAC_READ_SEARCH, and Ganesha's VFS FSAL cannot serve a file without it ("Could not get
    # handle for path /exports, error Operation not permitted"). Where the nodes have a profile
    # that is RuntimeDefault plus open_by_handle_at, name it: {type: Localhost, localhostProfile: ...}.
    "nfsServerSeccompProfile": {"type": "Unconfined"},
}


# ---- names ----------------------------------------------------------------------------------

def volume_name(uid: str) -> str:
    """Cluster-scoped: from the DataStage's uid, which no other object shares (a name made of
    namespace and name let `team-a/x` and `team/a-x` collide). The finalizer, which may face an
    unparsable spec, needs only the metadata."""
    return f"trainop-{uid}"


def claim_name(stage: Stage) -> str:
    return stage.existing_claim or f"{stage.name}-data"


def server_name(stage: Stage) -> str:
    return f"{stage.name}-nfs"


def server_disk_claim(stage: Stage) -> str:
    """The StatefulSet's claim from its volumeClaimTemplate "export" (replica 0)."""
    return f"export-{server_name(stage)}-0"


def copy_job_name(stage: Stage) -> str:
    """Changes with the spec: an edited DataStage gets a new copy Job (which resumes on the share)."""
    return f"{stage.name}-copy-{stage.spec_digest}"


def progress_name(stage_name: str) -> str:
    """The stager's progress ConfigMap; from the name alone (the controller reads it by name)."""
    return f"{stage_name}-progress"


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


def stage_settings(cfg: Config) -> dict:
    return {**DEFAULTS, **cfg.section("datastage")}


# ---- provisioned NFS server -----------------------------------------------------------------

def server_objects(stage: Stage, cfg: Config, address: str | None = None) -> list[dict]:
    """Service (its ClusterIP is what the PV uses: kubelets mount with the node's DNS, which
    cannot resolve cluster Service names) and the single-replica server StatefulSet, whose disk
    claim is deleted with it. `address`: the ClusterIP the PV was made with (status.server); a
    Service made again (someone deleted it) asks for that same IP, since the PV's server field
    is immutable and mounted pods use it."""
    if not stage.provisioned:
        return []
    name, lbl, settings = server_name(stage), labels(stage, "nfs-server"), stage_settings(cfg)
    service = {
        "apiVersion": "v1", "kind": "Service",
        "metadata": common.metadata(name, stage.namespace, lbl),
        "spec": {"type": "ClusterIP", "selector": lbl,
                 "ports": [{"name": "nfs", "port": NFS_PORT, "targetPort": NFS_PORT, "protocol": "TCP"}]},
    }
    if address:
        service["spec"]["clusterIP"] = address
    claim_spec: dict = {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": stage.capacity}}}
    if stage.storage_class:
        claim_spec["storageClassName"] = stage.storage_class
    pod_spec = _ganesha_pod(settings) if cfg.nfs_server == "ganesha" else _kernel_pod(settings)
    statefulset = {
        "apiVersion": "apps/v1", "kind": "StatefulSet",
        "metadata": common.metadata(name, stage.namespace, lbl),
        "spec": {
            "serviceName": name, "replicas": 1, "selector": {"matchLabels": lbl},
            "persistentVolumeClaimRetentionPolicy": {"whenDeleted": "Delete", "whenScaled": "Retain"},
            "template": {"metadata": {"labels": lbl}, "spec": {**_placement(cfg), **pod_spec}},
            "volumeClaimTemplates": [{"metadata": {"name": "export", "labels": lbl}, "spec": claim_spec}],
        },
    }
    return [service, statefulset]


def export_clients(cfg: Config, readers: Iterable[tuple[str, str]]) -> list[str]:
    """The Ganesha export's client list (its CLIENT block), sorted: `datastage.nfsClientCIDRs`
    and, for each reader (a running pod of the namespace labelled LABEL_READS_STAGE with this
    DataStage's name: (its pod IP, its node's InternalIP), either "" while unknown), both
    addresses: the node's because the kubelet mounts the PV from its node's address, the pod's
    for a client in the pod itself. Every other address gets Access_Type None (NFS4ERR_ACCESS),
    so this list is a second wall behind the NetworkPolicy, one that holds where the CNI
    enforces no policy, and, unlike a node subnet, one that leaves out the pods of other
    namespaces where pods take their addresses from the node subnet (Azure CNI)."""
    found = set(cfg.nfs_client_cidrs)
    for pod_ip, node_ip in readers:
        found.update(ip for ip in (pod_ip, node_ip) if ip)
    return sorted(found)


def clients_annotation(clients: list[str]) -> str:
    """CLIENTS_ANNOTATION's value: the list as the server's entrypoint reads it ("" for nobody)."""
    return ",".join(clients)


def _server_container(settings: dict, image: str) -> dict:
    return {"name": "nfs-server", "image": image,
            "ports": [{"name": "nfs", "containerPort": NFS_PORT, "protocol": "TCP"}],
            "readinessProbe": {"tcpSocket": {"port": NFS_PORT}, "periodSeconds": 5},
            "volumeMounts": [{"name": "export", "mountPath": EXPORT_DIR}],
            "resources": settings["nfsServerResources"]}


def _ganesha_pod(settings: dict) -> dict:
    """NFS-Ganesha (trainer_images/nfs-server), as uid/gid GANESHA_UID, one capability:
    DAC_READ_SEARCH, without which the kernel refuses open_by_handle_at(2), the call by which
    Ganesha's VFS FSAL opens every file a client names by handle. The image grants it to the
    ganesha.nfsd binary as a file capability (a non-root container process gets none from its
    securityContext: the runtime sets no ambient capabilities); the kernel grants a file capability
    on exec only without no_new_privs, hence allowPrivilegeEscalation: true, bounded by the
    capability set (drop ALL, add DAC_READ_SEARCH) and an image without set-user-ID programs.
    Seccomp: `nfsServerSeccompProfile` (Unconfined by default: see DEFAULTS). Pod Security:
    `baseline` refuses DAC_READ_SEARCH (and Unconfined), so this pod needs a namespace at
    `privileged` level; it is still no privileged container, holds no root and no other
    capability, and its root filesystem is read-only (docs/security.md). Its clients come from
    its own CLIENTS_ANNOTATION through a downwardAPI volume, not an env var, so that a new list
    reaches the running server without a restart (trainer_images/nfs-server follows the file;
    until stagesync has annotated a new pod, the file is empty and the server serves nobody)."""
    container = _server_container(settings, settings["nfsServerImage"])
    container["env"] = [{"name": "EXPORT_DIR", "value": EXPORT_DIR},
                        {"name": "CLIENTS_FILE", "value": CLIENTS_FILE},
                        {"name": "RUN_DIR", "value": GANESHA_RUN_DIR}]
    # /tmp: Ganesha tests the file system for OFD locks with a file there
    container["volumeMounts"] = [*container["volumeMounts"], {"name": "run", "mountPath": GANESHA_RUN_DIR},
                                 {"name": "tmp", "mountPath": "/tmp"},
                                 {"name": "clients", "mountPath": CLIENTS_DIR, "readOnly": True}]
    container["securityContext"] = {
        "runAsUser": GANESHA_UID, "runAsGroup": GANESHA_UID, "runAsNonRoot": True,
        "allowPrivilegeEscalation": True, "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"], "add": ["DAC_READ_SEARCH"]},
        "seccompProfile": dict(settings["nfsServerSeccompProfile"])}
    return {"securityContext": {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}},
            # SIGTERM: ganesha.nfsd stops its threads and exits 0 in well under a second.
            "terminationGracePeriodSeconds": 30,
            "containers": [container],
            "volumes": [*({"name": name, "emptyDir": {"medium": "Memory", "sizeLimit": "16Mi"}}
                          for name in ("run", "tmp")),
                        {"name": "clients", "downwardAPI": {"items": [{
                            "path": CLIENTS_FILE.rsplit("/", 1)[1],
                            "fieldRef": {"fieldPath": f"metadata.annotations['{CLIENTS_ANNOTATION}']"}}]}}]}


def _kernel_pod(settings: dict) -> dict:
    """datastage.server: kernel (trainer_images/nfs-server-kernel): privileged, because the kernel
    NFS server needs to mount nfsd and start kernel threads."""
    container = _server_container(settings, settings["nfsKernelServerImage"])
    container["securityContext"] = {"privileged": True}
    container["env"] = [{"name": "EXPORT_OWNER", "value": _owner(settings)},
                        {"name": "EXPORT_OPTIONS", "value": EXPORT_OPTIONS}]
    return {"containers": [container]}


def network_policy(stage: Stage, cfg: Config, readers: Iterable[tuple[str, str]] = ()) -> dict | None:
    """Who may reach a provisioned server's NFS port: pods of this namespace that mount this
    DataStage's claim (LABEL_READS_STAGE, put on job pods by render/dtj.py), the nodes those
    readers run on (`readers` as in export_clients), and the subnets in `datastage.nfsClientCIDRs`.
    The kubelet mounts NFS volumes from its node's address, not the pod's, so under a CNI that
    applies policy to other nodes' traffic the readers' nodes must be listed. The copy pod needs
    no entry: it writes the server's disk, not over NFS."""
    if not stage.provisioned:
        return None
    sources: list[dict] = [{"podSelector": {"matchLabels": {LABEL_READS_STAGE: stage.name}}}]
    nodes = sorted({node_ip for _, node_ip in readers if node_ip})
    sources += [{"ipBlock": {"cidr": cidr}} for cidr in
                [*cfg.nfs_client_cidrs, *(f"{ip}/128" if ":" in ip else f"{ip}/32" for ip in nodes)]]
    return {
        "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
        "metadata": common.metadata(server_name(stage), stage.namespace, labels(stage, "nfs-server")),
        "spec": {"podSelector": {"matchLabels": labels(stage, "nfs-server")},
                 "policyTypes": ["Ingress"],
                 "ingress": [{"from": sources, "ports": [{"protocol": "TCP", "port": NFS_PORT}]}]},
    }


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
    pv_name, pvc_name = volume_name(stage.uid), claim_name(stage)
    pv_labels = {**labels(stage, "volume"), LABEL_STAGE_NAMESPACE: stage.namespace,
                 LABEL_STAGE_UID: stage.uid}
    pv_spec: dict = {
        "capacity": {"storage": stage.capacity},
        "accessModes": ["ReadOnlyMany"],
        "persistentVolumeReclaimPolicy": "Retain",
        "storageClassName": "",
        "nfs": {"server": server, "path": stage.nfs_path, "readOnly": True},
        "claimRef": {"apiVersion": "v1", "kind": "PersistentVolumeClaim",
                     "namespace": stage.namespace, "name": pvc_name},
    }
    options = list(stage.mount_options)
    if stage.provisioned and not any(o.split("=")[0] in ("nfsvers", "vers") for o in options):
        options.insert(0, DEFAULT_NFS_VERSION)  # our own server: we know what it speaks
    if options:
        pv_spec["mountOptions"] = options
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
    """What lets the copy pod report progress: patch this DataStage's progress ConfigMap, nothing
    else; never the DataStage's status (a stager that could write it could say Ready while the
    data is half there: the operator reads the report, checks it, and writes the status). The
    operator never needs the data's credentials for that."""
    return identity.objects(
        stager_identity_name(stage), stage.namespace, labels(stage, "copy"),
        [identity.rule("", "configmaps", progress_name(stage.name), ["patch"])],
        account=stager_service_account(stage))


def progress_config_map(stage: Stage) -> dict:
    """Created empty by the operator (owned by the DataStage); the stager merge-patches its
    PROGRESS_KEY with its counters and last error (stager.ProgressSink)."""
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": common.metadata(progress_name(stage.name), stage.namespace, labels(stage, "progress"))}


PROGRESS_KEY = "status"  # the progress ConfigMap's key: the stager's report, as JSON
MAX_REPORT = 16384       # a report is a few hundred bytes, plus up to SKIPPED_LISTED names
_COUNTERS = ("bytesCopied", "bytesTotal", "filesCopied", "filesTotal", "skippedBlobs")
SKIPPED_LISTED, MAX_LINE = 20, 1024


def progress_report(config_map: dict | None) -> dict:
    """The status keys the stager's report gives, checked as untrusted input (the copy pod runs
    with the user's credential and image): known keys only, counters as non-negative integers,
    at most SKIPPED_LISTED skipped names and one line of error, each cut to MAX_LINE; {} for
    anything else. The one-glance `progress` text is made here, from the checked counters."""
    text = ((config_map or {}).get("data") or {}).get(PROGRESS_KEY)
    if not isinstance(text, str) or len(text) > MAX_REPORT:
        return {}
    try:
        raw = json.loads(text)
    except ValueError:
        return {}
    if not isinstance(raw, dict):
        return {}
    out: dict = {k: raw[k] for k in _COUNTERS
                 if isinstance(raw.get(k), int) and not isinstance(raw[k], bool) and raw[k] >= 0}
    skipped = raw.get("skipped")
    if isinstance(skipped, list):
        out["skipped"] = [s[:MAX_LINE] for s in skipped[:SKIPPED_LISTED] if isinstance(s, str)]
    if "lastError" in raw:
        error = raw["lastError"]
        out["lastError"] = error.splitlines()[0][:MAX_LINE] if isinstance(error, str) and error else None
    if "filesTotal" in out and "filesCopied" in out and "bytesTotal" in out and "bytesCopied" in out:
        total, done = out["bytesTotal"], min(out["bytesCopied"], out["bytesTotal"])
        percent = 100 * done // total if total else 100
        out["progress"] = f"{out['filesCopied']}/{out['filesTotal']} files, {percent}%"
    return out


def stager_args(stage: Stage, progress_interval: float) -> list[str]:
    args = ["--account-url", stage.account_url, "--container", stage.container, "--dest", SHARE_MOUNT,
            "--concurrency", str(stage.concurrency), "--range-concurrency", str(stage.range_concurrency),
            "--progress-configmap", f"{stage.namespace}/{progress_name(stage.name)}",
            "--progress-interval", str(progress_interval)]
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
    if stage.provisioned:  # the server's own disk (it exports read-only); see _with_server
        return {"name": "share", "persistentVolumeClaim": {"claimName": server_disk_claim(stage)}}
    # An inline nfs volume: the one thing that keeps this pod out of the `restricted` profile,
    # which allows claims but not nfs (docs/security.md).
    return {"name": "share", "nfs": {"server": server, "path": stage.nfs_path}}


def copy_job(stage: Stage, server: str | None, cfg: Config) -> dict:
    settings = stage_settings(cfg)
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
                    "securityContext": _copy_security_context(stage, settings),
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
                    **_with_server(stage),
                },
            },
        },
    }


def _copy_security_context(stage: Stage, settings: dict) -> dict:
    """A provisioned server's fresh disk belongs to root, and the NFS-Ganesha server, running as
    non-root, cannot hand it over: the copy pod's fsGroup has the kubelet make the disk's root
    group-writable by the copy's group (once: OnRootMismatch). Not for an existing claim or export:
    that would change the group of data that is not ours."""
    ctx = common.pod_security_context(settings["securityContext"])
    if stage.provisioned and "fsGroup" not in ctx:
        group = ctx.get("runAsGroup", ctx.get("runAsUser"))
        if group is not None:
            ctx |= {"fsGroup": group, "fsGroupChangePolicy": "OnRootMismatch"}
    return ctx


def _with_server(stage: Stage) -> dict:
    """A provisioned server's disk is ReadWriteOnce: the copy pod runs on the server pod's node."""
    if not stage.provisioned:
        return {}
    return {"affinity": {"podAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [{
        "labelSelector": {"matchLabels": labels(stage, "nfs-server")},
        "topologyKey": "kubernetes.io/hostname"}]}}}


def copy_objects(stage: Stage, server: str, cfg: Config) -> list[dict]:
    return [*rbac_objects(stage), progress_config_map(stage), copy_job(stage, server, cfg)]
