"""Operator configuration: node pools, default images, limits. YAML at $TRAINOP_CONFIG (the Helm
chart renders it from values); without it, defaults that match `trainop devcluster` (AKS-shaped
pools `system`, `gpu`, `ibgpu`, and `spotgpu`: autoscaled spot VMs, at zero nodes).

    from trainop import config
    cfg = config.load()              # $TRAINOP_CONFIG or defaults; ConfigError names the key
    pool = cfg.node_pools["gpu"]     # NodePool(name, node_selector, tolerations, ...)
    cfg.section("logship")           # raw dict of a section other modules own (or {})

Format (every key optional; camelCase like Helm values):

    resyncSeconds: 2                 # first retry after a failed reconcile (doubles up to 5 min)
    safetyResyncSeconds: 300         # every object is re-judged from the caches this often, in
                                     # case a wake-up was lost (nothing polls the API server)
    gpuResource: nvidia.com/gpu      # default GPU resource name of every pool
    rdmaResource: rdma/ib            # default RDMA device resource of every pool
    nodePools:
      gpu:
        nodeSelector: {kubernetes.azure.com/agentpool: gpu}
        tolerations: [{key: nvidia.com/gpu, operator: Exists, effect: NoSchedule}]
        infiniband: false            # true: the pool's nodes have the RDMA resource
        instanceType: Standard_ND96isr_H100_v5  # the pool's VM size (node label
                                     # node.kubernetes.io/instance-type): picks NCCL_TOPO_FILE
        preflightMinBusBandwidthGBps: 150  # spec.preflight's threshold for jobs in this pool
        gpuResource: nvidia.com/gpu  # per-pool override
        rdmaResource: rdma/ib        # per-pool override
      spotgpu:                       # an AKS pool the cluster autoscaler sizes, of spot VMs
        nodeSelector: {kubernetes.azure.com/agentpool: spotgpu}
        autoscale: {minNodes: 0, maxNodes: 8}  # capacity checks count maxNodes, not the nodes
                                     # present: a job that fits creates its pods, which wait
                                     # (WaitingForNodes) until the autoscaler adds nodes
        gpusPerNode: 8               # the VM size's GPUs: what a pool at zero nodes offers
                                     # (default: the largest node present)
        spot: true                   # pods get AKS's spot toleration; a node loss there is a
                                     # SpotEviction (spec.nodePool.fallback)
    schedulingTimeoutSeconds: 900    # how long pods on an autoscaled pool may wait for nodes
                                     # before the job fails (SchedulingTimeout); a job's
                                     # runPolicy.schedulingTimeoutSeconds overrides it
    startTimeoutSeconds: 600         # how long a pod may fail to start (an image that cannot
                                     # be pulled, a missing Secret or ConfigMap for its env)
                                     # before the job fails; runPolicy.startTimeoutSeconds
                                     # overrides it; null: never (the condition stays)
    defaultNodePools: {cpu: system, gpu: gpu, infiniband: ibgpu}
    images: {pytorch: IMAGE, tensorflow: IMAGE, keras: IMAGE}
    launcherResources: {requests: {cpu: 500m, memory: 512Mi}}
    limits:
      maxGpusPerJob: 64              # null: no limit (spec.parse refuses a bigger job)
      namespaceGpus: 32              # GPUs a namespace without a ResourceQuota may use (admission.py)
      maxPriority: 1000000000        # highest class value spec.priorityClassName may name
                                     # (priority.py); null: no cap
      emptyDirSizeLimit: 20Gi        # sizeLimit of the emptyDirs trainop adds to a job's pods
                                     # (the shared log folder, /output without a claim): the
                                     # kubelet evicts a pod past it, a counted StorageLimit
                                     # failure; null: none
      maxCheckpointGraceSeconds: 600 # the most seconds the ranks' share of a pod's
                                     # terminationGracePeriodSeconds may be when it is sized
                                     # from the job's slowest checkpoint save (render/dtj.py,
                                     # docs/long-runs.md); at least 30
    infiniband:                      # what `infiniband: true` jobs get (render/fabric.py)
      ipcLock: false                 # true: add IPC_LOCK to the training containers (docs/security.md:
                                     # the namespace must then allow privileged pods)
      fabricTopologyKey: kubernetes.azure.com/agentpool  # node label whose value is one IB
                                     # fabric (on AKS a pool is one VM scale set): a required
                                     # podAffinity keeps every worker of a job on one value
      topologyFiles:                 # instance type -> NCCL topology file
        Standard_ND96isr_H100_v5: /opt/microsoft/ndv5-topo.xml
      topologyFilesFrom: node        # node: a read-only hostPath of the file (the namespace
                                     # must allow privileged pods); image: the path is inside
                                     # the training image, nothing is mounted
      socketTransport: warn          # NCCL chose sockets on an IB job: warn (Warning Event) | fail
    preflight:                       # spec.preflight (render/fabric.py, preflight.py)
      image: null                    # null: images.pytorch (needs torch and trainop_trainer)
      sizeMB: 64                     # all-reduced per iteration
      iterations: 20
      taintUnhealthyNodes: false     # true: taint a node the check finds slow (the chart then
                                     # grants `patch` on nodes, limited to that taint)
      maxTaintedNodes: 2             # never more nodes of the cluster with the taint at once
                                     # (counted from the nodes; an admin removes it)
    kueue:
      workloadSlices: false          # true once Kueue runs with its ElasticJobsViaWorkloadSlices
                                     # feature gate (alpha in v0.17): an elastic job's Workload
                                     # shrinks in place and grows through a replacement slice,
                                     # keeping its reservation (docs/elastic.md); false: a new
                                     # Workload per size, queued again
    blob:
      # Endpoints an accountURL (DataStage source, job output) may name besides https:// on Azure
      # Storage's own host suffixes (blob.AZURE_BLOB_SUFFIXES). scheme://host[:port][/path]: the
      # scheme and host must match (a host "*.example.com" matches its subdomains), the port if
      # given, the path as a prefix of whole segments. http:// only where listed here.
      allowedAccountURLs: [https://*.blob.local.azurestack.external, http://127.0.0.1:10000]
      # ServiceAccounts spec.output.blob.auth.serviceAccountName may name besides
      # logship.workloadIdentityServiceAccount (the pods then run as it), and the only ones a
      # DataStage's source.blob.auth.serviceAccountName may name (its copy pod runs as it): NAME
      # (any served namespace) or NAMESPACE/NAME, shell patterns allowed; `default` never
      allowedServiceAccounts: [team-wi, research/uploader-*]
    jobNetwork:                      # the job's NetworkPolicy (render/dtj.py)
      deniedEgressCIDRs: [169.254.0.0/16, 168.63.129.16/32, fe80::/10]  # what a job's pods may
                                     # not reach: link-local (Azure IMDS at 169.254.169.254, the
                                     # node's managed identity) and Azure's WireServer; [] opens
                                     # egress entirely (no Egress rule); DNS (53) stays open
    gangScheduling:                  # PodGroups (render/podgroup.py), where the API is served
      scheduler: null                # scheduler-plugins | volcano | null (none)
      schedulerName: null            # the pods' schedulerName; default scheduler-plugins-scheduler
                                     # or volcano
      allowedQueues: []              # Volcano queues (cluster-wide) schedulingPolicy.queue may
                                     # name; none: the PodGroup names no queue (Volcano's default)
    podTemplate:
      allow:                         # what spec.podTemplate may add beyond Pod Security
        hostPath: false              # "restricted" (render/overrides.py, docs/security.md)
        hostNetwork: false           # also hostPort on a container
        hostPID: false
        hostIPC: false
        privileged: false            # privileged, allowPrivilegeEscalation, root, Unconfined
        capabilities: []             # added capabilities besides NET_BIND_SERVICE
        volumeTypes: []              # inline volume types besides restricted's (e.g. nfs); csi
                                     # only here (a CSI driver may be handed the pod's token)
        secrets: []                  # Secrets a pod template may reference (env, envFrom,
                                     # volumes, imagePullSecrets): NAME or NAMESPACE/NAME, shell
                                     # patterns allowed; none by default (job pods hold no API
                                     # token, so job code can read no Secret it is not given)
        envFromWithoutPrefix: false  # envFrom on a worker's GPU container with no prefix (or
                                     # one NVIDIA_ names start with): only where the GPU nodes'
                                     # toolkit ignores NVIDIA_VISIBLE_DEVICES (docs/security.md)
    datastage:                       # raw keys: render/datastage.py; checked here:
      allowedNfsExports:             # existing exports destination.nfs may name (none by default);
                                     # the copy Job mounts them read-write, so each entry says
                                     # whose it is: `namespaces`, or {namespace} in the path
        - {server: 10.240.0.4, path: /export/team-a, namespaces: [team-a]}
        - {server: 10.240.0.4, path: "/export/{namespace}"}  # each namespace its own folder
                                     # path: a prefix of whole segments; namespaces: ["*"] shares
                                     # the export read-write between every namespace (one team)
      allowProvisionedServers: false # destination.provision: an NFS server pod in the tenant's
                                     # namespace (docs/datastage.md, docs/security.md M8)
      server: ganesha                # the provisioned server: ganesha (NFS-Ganesha, non-root, one
                                     # capability) or kernel (kernel nfsd: a privileged pod)
      nfsClientCIDRs: []             # more clients of every provisioned server, beside the ones
                                     # it always serves: its DataStage's readers (the pods, and
                                     # the nodes their kubelets mount from); admitted by its
                                     # NetworkPolicy and its export's client list. Optional: a
                                     # node subnet here admits every node (and, with Azure CNI,
                                     # every pod) in it
"""

from __future__ import annotations

import copy
import fnmatch
import ipaddress
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import yaml

GPU_TOLERATION = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
POOL_LABEL = "kubernetes.azure.com/agentpool"
# What AKS puts on every node of a spot pool (label and NoSchedule taint, same key and value).
SPOT_LABEL, SPOT_VALUE = "kubernetes.azure.com/scalesetpriority", "spot"
SPOT_TOLERATION = {"key": SPOT_LABEL, "operator": "Equal", "value": SPOT_VALUE,
                   "effect": "NoSchedule"}

DEFAULTS: dict = {
    "resyncSeconds": 2,
    "safetyResyncSeconds": 300,
    "gpuResource": "nvidia.com/gpu",
    "rdmaResource": "rdma/ib",
    "nodePools": {
        "system": {"nodeSelector": {POOL_LABEL: "system"}},
        "gpu": {"nodeSelector": {POOL_LABEL: "gpu"}, "tolerations": [GPU_TOLERATION]},
        "ibgpu": {"nodeSelector": {POOL_LABEL: "ibgpu"}, "tolerations": [GPU_TOLERATION],
                  "infiniband": True},
        # An autoscaled spot pool, at zero nodes until a job needs it (the dev cluster has none:
        # tests add KWOK nodes as the cluster autoscaler would).
        "spotgpu": {"nodeSelector": {POOL_LABEL: "spotgpu"}, "tolerations": [GPU_TOLERATION],
                    "autoscale": {"minNodes": 0, "maxNodes": 4}, "gpusPerNode": 4, "spot": True},
    },
    "defaultNodePools": {"cpu": "system", "gpu": "gpu", "infiniband": "ibgpu"},
    "images": {
        "pytorch": "trainop/trainer-pytorch:0.1.0",
        "tensorflow": "trainop/trainer-tensorflow:0.1.0",
        "keras": "trainop/trainer-keras:0.1.0",
    },
    "launcherResources": {"requests": {"cpu": "500m", "memory": "512Mi"}},
    "schedulingTimeoutSeconds": 900,
    "startTimeoutSeconds": 600,
    # 1e9 is the highest value Kubernetes lets a user-defined PriorityClass have: larger ones
    # are system-cluster-critical and system-node-critical, which no training job may borrow.
    # The emptyDirs trainop adds to a job's pods (the log folder it shares with the shipper, and
    # /output without a claim) are on the node's disk: job code could fill it (review L7).
    "limits": {"maxGpusPerJob": None, "maxPriority": 1_000_000_000, "emptyDirSizeLimit": "20Gi",
               "maxCheckpointGraceSeconds": 600},
    "blob": {"allowedAccountURLs": [], "allowedServiceAccounts": []},
    # Where AKS's HPC images keep NCCL's topology files for the ND sizes whose PCIe layout NCCL
    # cannot discover inside a VM (Azure/azhpc-images: ndv4, ndv5). A file must exist on the node.
    "infiniband": {"ipcLock": False, "fabricTopologyKey": POOL_LABEL, "socketTransport": "warn",
                   "topologyFilesFrom": "node",
                   "topologyFiles": {"Standard_ND96asr_v4": "/opt/microsoft/ndv4-topo.xml",
                                     "Standard_ND96amsr_A100_v4": "/opt/microsoft/ndv4-topo.xml",
                                     "Standard_ND96isr_H100_v5": "/opt/microsoft/ndv5-topo.xml"}},
    "preflight": {"image": None, "sizeMB": 64, "iterations": 20, "taintUnhealthyNodes": False,
                  "maxTaintedNodes": 2},
    "datastage": {"allowedNfsExports": [], "nfsClientCIDRs": [], "allowProvisionedServers": False,
                  "server": "ganesha"},
    "gangScheduling": {"scheduler": None, "schedulerName": None, "allowedQueues": []},
    # IMDS (169.254.169.254) hands out the node's managed identity; WireServer (168.63.129.16)
    # the VM's configuration. No training job needs either (workload identity goes to Entra ID).
    "jobNetwork": {"deniedEgressCIDRs": ["169.254.0.0/16", "168.63.129.16/32", "fe80::/10"]},
    "podTemplate": {"allow": {"hostPath": False, "hostNetwork": False, "hostPID": False,
                              "hostIPC": False, "privileged": False, "capabilities": [],
                              "volumeTypes": [], "secrets": [], "envFromWithoutPrefix": False}},
}
ALLOW_SWITCHES = ("hostPath", "hostNetwork", "hostPID", "hostIPC", "privileged", "envFromWithoutPrefix")


@dataclass(frozen=True)
class PodTemplateAllow:
    """podTemplate.allow: what spec.podTemplate may add beyond Pod Security "restricted"."""
    host_path: bool = False
    host_network: bool = False
    host_pid: bool = False
    host_ipc: bool = False
    privileged: bool = False
    capabilities: tuple[str, ...] = ()
    volume_types: tuple[str, ...] = ()
    secrets: tuple[str, ...] = ()  # NAME or NAMESPACE/NAME patterns (fnmatch)
    env_from_without_prefix: bool = False

    def secret_allowed(self, namespace: str, name: str) -> bool:
        return allowed_name(self.secrets, namespace, name)


def allowed_name(patterns: tuple[str, ...], namespace: str, name: str) -> bool:
    """Is `namespace`/`name` on an admin's list of NAME or NAMESPACE/NAME shell patterns?"""
    return any(fnmatch.fnmatchcase(f"{namespace}/{name}" if "/" in p else name, p) for p in patterns)


NAMESPACE_PLACEHOLDER = "{namespace}"


@dataclass(frozen=True)
class NfsExport:
    """datastage.allowedNfsExports[i]: an existing export, and the namespaces that may stage into
    it (the copy Job mounts it read-write). `{namespace}` in the path stands for the DataStage's
    own namespace; namespaces ("*",): every namespace (one team's cluster)."""
    server: str
    path: str
    namespaces: tuple[str, ...] = ()

    def prefix_for(self, namespace: str) -> str | None:
        """The path prefix `namespace` may use on this export; None: not this namespace's."""
        if NAMESPACE_PLACEHOLDER in self.path:
            return self.path.replace(NAMESPACE_PLACEHOLDER, namespace)
        return self.path if ("*" in self.namespaces or namespace in self.namespaces) else None


class ConfigError(ValueError):
    """The configuration file is wrong; the message names the key."""


@dataclass(frozen=True)
class Autoscale:
    """`nodePools.<name>.autoscale`: the cluster autoscaler's bounds of the pool."""
    min_nodes: int
    max_nodes: int


@dataclass(frozen=True)
class NodePool:
    name: str
    node_selector: dict[str, str]
    tolerations: list[dict] = field(default_factory=list)
    infiniband: bool = False
    gpu_resource: str = "nvidia.com/gpu"
    rdma_resource: str = "rdma/ib"
    autoscale: Autoscale | None = None
    gpus_per_node: int | None = None  # None: the largest node present says
    spot: bool = False
    instance_type: str | None = None                 # nodePools.<name>.instanceType
    preflight_min_busbw: float | None = None         # nodePools.<name>.preflightMinBusBandwidthGBps


@dataclass(frozen=True)
class Fabric:
    """The `infiniband` and `preflight` sections, checked (render/fabric.py, preflight.py)."""
    ipc_lock: bool = False
    topology_key: str = POOL_LABEL
    topology_files: dict[str, str] = field(default_factory=dict)
    topology_files_from: str = "node"    # node (hostPath) | image
    socket_transport: str = "warn"       # warn | fail
    preflight_image: str | None = None   # None: images.pytorch
    preflight_size_mb: int = 64
    preflight_iterations: int = 20
    taint_unhealthy_nodes: bool = False
    max_tainted_nodes: int = 2           # preflight.maxTaintedNodes


@dataclass(frozen=True)
class Config:
    resync_seconds: float
    safety_resync_seconds: float
    node_pools: dict[str, NodePool]
    default_node_pools: dict[str, str]
    images: dict[str, str]
    launcher_resources: dict
    max_gpus_per_job: int | None
    max_priority: int | None
    raw: dict
    scheduling_timeout_seconds: int | None = 900  # default for jobs on autoscaled pools
    start_timeout_seconds: int | None = 600  # default runPolicy.startTimeoutSeconds
    allowed_account_urls: tuple[str, ...] = ()       # blob.allowedAccountURLs
    allowed_service_accounts: tuple[str, ...] = ()   # blob.allowedServiceAccounts
    allowed_nfs_exports: tuple[NfsExport, ...] = ()  # datastage.allowedNfsExports
    allow_provisioned_servers: bool = False          # datastage.allowProvisionedServers
    nfs_server: str = "ganesha"                      # datastage.server: ganesha | kernel
    denied_egress_cidrs: tuple[str, ...] = ()        # jobNetwork.deniedEgressCIDRs
    empty_dir_size_limit: str | None = None          # limits.emptyDirSizeLimit
    max_checkpoint_grace_seconds: int = 600          # limits.maxCheckpointGraceSeconds
    nfs_client_cidrs: tuple[str, ...] = ()           # datastage.nfsClientCIDRs
    pod_template_allow: PodTemplateAllow = PodTemplateAllow()  # podTemplate.allow
    gang_scheduler: str | None = None        # gangScheduling.scheduler
    gang_scheduler_name: str | None = None   # gangScheduling.schedulerName
    allowed_queues: tuple[str, ...] = ()     # gangScheduling.allowedQueues (Volcano)
    fabric: Fabric = field(default_factory=Fabric)   # infiniband.*, preflight.*
    kueue_workload_slices: bool = False      # kueue.workloadSlices

    def section(self, name: str) -> dict:
        return copy.deepcopy(self.raw.get(name) or {})


# A size as the CRD's shmSize takes it (a Quantity without sign or exponent): 20Gi, 500M
QUANTITY = re.compile(r"[0-9]+(\.[0-9]+)?([KMGTPE]i|[kMGTPE])?")


def _merge(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict) and key != "nodePools":
            out[key] = _merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def _pool(name: str, raw: dict, top: dict) -> NodePool:
    where = f"nodePools.{name}"
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: must be a mapping with nodeSelector")
    selector = raw.get("nodeSelector")
    if not isinstance(selector, dict) or not selector:
        raise ConfigError(f"{where}.nodeSelector: required, a non-empty map of node labels")
    tolerations = raw.get("tolerations") or []
    if not isinstance(tolerations, list):
        raise ConfigError(f"{where}.tolerations: must be a list of tolerations")
    spot = raw.get("spot", False)
    if not isinstance(spot, bool):
        raise ConfigError(f"{where}.spot: must be true or false")
    if spot and SPOT_TOLERATION not in tolerations:
        tolerations = [*tolerations, dict(SPOT_TOLERATION)]
    gpus_per_node = raw.get("gpusPerNode")
    if gpus_per_node is not None and not _count(gpus_per_node):
        raise ConfigError(f"{where}.gpusPerNode: must be a non-negative integer (the GPUs of "
                          f"one node of the pool's VM size)")
    instance_type = raw.get("instanceType")
    if instance_type is not None and not isinstance(instance_type, str):
        raise ConfigError(f"{where}.instanceType: must be a VM size such as Standard_ND96isr_H100_v5")
    busbw = raw.get("preflightMinBusBandwidthGBps")
    if busbw is not None and (isinstance(busbw, bool) or not isinstance(busbw, (int, float))
                              or busbw < 0):
        raise ConfigError(f"{where}.preflightMinBusBandwidthGBps: must be a number >= 0 (GB/s)")
    return NodePool(name=name, node_selector={str(k): str(v) for k, v in selector.items()},
                    tolerations=tolerations, infiniband=bool(raw.get("infiniband", False)),
                    gpu_resource=raw.get("gpuResource") or top["gpuResource"],
                    rdma_resource=raw.get("rdmaResource") or top["rdmaResource"],
                    autoscale=_autoscale(where, raw.get("autoscale")),
                    gpus_per_node=gpus_per_node, spot=spot,
                    instance_type=instance_type,
                    preflight_min_busbw=None if busbw is None else float(busbw))


def _count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _autoscale(where: str, raw) -> Autoscale | None:
    if raw is None:
        return None
    if not isinstance(raw, dict) or set(raw) - {"minNodes", "maxNodes"}:
        raise ConfigError(f"{where}.autoscale: must be {{minNodes: N, maxNodes: M}} (the "
                          f"cluster autoscaler's --min-count and --max-count of the pool)")
    low, high = raw.get("minNodes", 0), raw.get("maxNodes")
    if not _count(low):
        raise ConfigError(f"{where}.autoscale.minNodes: must be a non-negative integer")
    if not _count(high) or high < 1 or high < low:
        raise ConfigError(f"{where}.autoscale.maxNodes: required, an integer >= 1 and >= minNodes")
    return Autoscale(min_nodes=low, max_nodes=high)


def from_dict(data: dict | None) -> Config:
    if data is not None and not isinstance(data, dict):
        raise ConfigError("the configuration must be a YAML mapping")
    raw = _merge(DEFAULTS, data or {})
    pools = {name: _pool(name, spec, raw) for name, spec in (raw["nodePools"] or {}).items()}
    for kind, name in raw["defaultNodePools"].items():
        if name is not None and name not in pools:
            raise ConfigError(f"defaultNodePools.{kind}: {name!r} is not in nodePools "
                              f"({', '.join(sorted(pools))})")
    resync = raw["resyncSeconds"]
    if not isinstance(resync, (int, float)) or resync <= 0:
        raise ConfigError("resyncSeconds: must be a positive number")
    safety = raw["safetyResyncSeconds"]
    if not isinstance(safety, (int, float)) or isinstance(safety, bool) or safety <= 0:
        raise ConfigError("safetyResyncSeconds: must be a positive number")
    max_gpus = raw["limits"].get("maxGpusPerJob")
    if max_gpus is not None and (not isinstance(max_gpus, int) or max_gpus < 0):
        raise ConfigError("limits.maxGpusPerJob: must be a non-negative integer or null")
    max_priority = raw["limits"].get("maxPriority")
    if max_priority is not None and (not isinstance(max_priority, int)
                                     or isinstance(max_priority, bool)):
        raise ConfigError("limits.maxPriority: must be an integer or null")
    empty_dir = raw["limits"].get("emptyDirSizeLimit")
    if empty_dir is not None and not QUANTITY.fullmatch(str(empty_dir)):
        raise ConfigError(f"limits.emptyDirSizeLimit: {empty_dir!r} is not a size such as 20Gi (or null: no limit)")
    grace_cap = raw["limits"].get("maxCheckpointGraceSeconds")
    if not _count(grace_cap) or not 30 <= grace_cap <= 86400:
        raise ConfigError("limits.maxCheckpointGraceSeconds: must be an integer from 30 (Kubernetes' default grace "
                          "period) to 86400 (seconds)")
    timeout = raw.get("schedulingTimeoutSeconds")
    if timeout is not None and (not _count(timeout) or timeout < 1):
        raise ConfigError("schedulingTimeoutSeconds: must be a positive integer (seconds) or null")
    start_timeout = raw.get("startTimeoutSeconds")
    if start_timeout is not None and (not _count(start_timeout) or start_timeout < 1):
        raise ConfigError("startTimeoutSeconds: must be a positive integer (seconds) or null")
    return Config(resync_seconds=float(resync), safety_resync_seconds=float(safety),
                  node_pools=pools,
                  default_node_pools=dict(raw["defaultNodePools"]), images=dict(raw["images"]),
                  launcher_resources=raw["launcherResources"], max_gpus_per_job=max_gpus,
                  max_priority=max_priority, raw=raw, scheduling_timeout_seconds=timeout,
                  start_timeout_seconds=start_timeout,
                  allowed_account_urls=_account_urls(raw), allowed_nfs_exports=_nfs_exports(raw),
                  allowed_service_accounts=_service_accounts(raw),
                  nfs_client_cidrs=_cidrs(raw, "datastage", "nfsClientCIDRs"),
                  allow_provisioned_servers=_switch(raw, "datastage", "allowProvisionedServers"),
                  nfs_server=_nfs_server(raw),
                  denied_egress_cidrs=_cidrs(raw, "jobNetwork", "deniedEgressCIDRs"),
                  empty_dir_size_limit=None if empty_dir is None else str(empty_dir),
                  max_checkpoint_grace_seconds=grace_cap,
                  pod_template_allow=_pod_template_allow(raw),
                  fabric=_fabric(raw), kueue_workload_slices=_switch(raw, "kueue", "workloadSlices"),
                  **_gang_scheduling(raw))


GANG_SCHEDULERS = ("scheduler-plugins", "volcano")


def _gang_scheduling(raw: dict) -> dict:
    gang = raw.get("gangScheduling") or {}
    kind, name = gang.get("scheduler"), gang.get("schedulerName")
    if kind is not None and kind not in GANG_SCHEDULERS:
        raise ConfigError(f"gangScheduling.scheduler: {kind!r} is not one of "
                          f"{', '.join(GANG_SCHEDULERS)} (or null)")
    if name is not None and not (isinstance(name, str) and name):
        raise ConfigError("gangScheduling.schedulerName: must be a scheduler's name or null")
    queues = _names(gang.get("allowedQueues"), "gangScheduling.allowedQueues")
    return {"gang_scheduler": kind, "gang_scheduler_name": name, "allowed_queues": queues}


def _names(value, where: str) -> tuple[str, ...]:
    value = value or []
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise ConfigError(f"{where}: must be a list of names")
    return tuple(value)


def _service_accounts(raw: dict) -> tuple[str, ...]:
    if (raw.get("logship") or {}).get("workloadIdentityServiceAccount") == "default":
        raise ConfigError("logship.workloadIdentityServiceAccount: the namespace's default "
                          "ServiceAccount runs every pod that names none, and the shipper's "
                          "Role would be bound to it; create a ServiceAccount for uploads")
    names = _names((raw.get("blob") or {}).get("allowedServiceAccounts"),
                   "blob.allowedServiceAccounts")
    for i, name in enumerate(names):
        if name.rsplit("/", 1)[-1] == "default":
            # the Role of the shipper would be bound to every pod that names no account
            raise ConfigError(f"blob.allowedServiceAccounts[{i}]: {name!r}: the namespace's "
                              f"default ServiceAccount runs every pod that names none; create "
                              f"a ServiceAccount for uploads instead")
    return names


def _pod_template_allow(raw: dict) -> PodTemplateAllow:
    allow = (raw.get("podTemplate") or {}).get("allow") or {}
    if not isinstance(allow, dict):
        raise ConfigError("podTemplate.allow: must be a mapping of switches")
    for key in ALLOW_SWITCHES:
        if not isinstance(allow.get(key, False), bool):
            raise ConfigError(f"podTemplate.allow.{key}: must be true or false")
    lists = {}
    for key in ("capabilities", "volumeTypes", "secrets"):
        lists[key] = _names(allow.get(key), f"podTemplate.allow.{key}")
    return PodTemplateAllow(host_path=allow.get("hostPath", False),
                            host_network=allow.get("hostNetwork", False),
                            host_pid=allow.get("hostPID", False), host_ipc=allow.get("hostIPC", False),
                            privileged=allow.get("privileged", False),
                            capabilities=lists["capabilities"], volume_types=lists["volumeTypes"],
                            secrets=lists["secrets"],
                            env_from_without_prefix=allow.get("envFromWithoutPrefix", False))


def _fabric(raw: dict) -> Fabric:
    ib, pre = raw.get("infiniband") or {}, raw.get("preflight") or {}
    files = ib.get("topologyFiles") or {}
    if not isinstance(files, dict) or not all(
            isinstance(v, str) and v.startswith("/") for v in files.values()):
        raise ConfigError("infiniband.topologyFiles: must map instance types to absolute paths "
                          "on the node, e.g. {Standard_ND96isr_H100_v5: /opt/microsoft/ndv5-topo.xml}")
    if ib.get("topologyFilesFrom", "node") not in ("node", "image"):
        raise ConfigError("infiniband.topologyFilesFrom: must be node (mounted from the node) or "
                          "image (the path is inside the training image)")
    if ib.get("socketTransport", "warn") not in ("warn", "fail"):
        raise ConfigError("infiniband.socketTransport: must be warn or fail")
    key = ib.get("fabricTopologyKey", POOL_LABEL)
    if not isinstance(key, str) or not key:
        raise ConfigError("infiniband.fabricTopologyKey: must be a node label key")
    for name in ("sizeMB", "iterations", "maxTaintedNodes"):
        value = pre.get(name, 1)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"preflight.{name}: must be a positive integer")
    return Fabric(ipc_lock=bool(ib.get("ipcLock", False)), topology_key=key,
                  topology_files={str(k): v for k, v in files.items()},
                  topology_files_from=ib.get("topologyFilesFrom", "node"),
                  socket_transport=ib.get("socketTransport", "warn"),
                  preflight_image=pre.get("image") or None,
                  preflight_size_mb=int(pre.get("sizeMB", 64)),
                  preflight_iterations=int(pre.get("iterations", 20)),
                  taint_unhealthy_nodes=bool(pre.get("taintUnhealthyNodes", False)),
                  max_tainted_nodes=int(pre.get("maxTaintedNodes", 2)))


def _list(raw: dict, section: str, key: str) -> list:
    value = (raw.get(section) or {}).get(key)
    if value is None:
        return []
    if not isinstance(value, list):
        raise ConfigError(f"{section}.{key}: must be a list")
    return value


def _account_urls(raw: dict) -> tuple[str, ...]:
    out = []
    for i, entry in enumerate(_list(raw, "blob", "allowedAccountURLs")):
        parts = urlsplit(entry) if isinstance(entry, str) else None
        if parts is None or parts.scheme not in ("http", "https") or not parts.hostname \
                or parts.query or parts.fragment or parts.username:
            raise ConfigError(f"blob.allowedAccountURLs[{i}]: {entry!r} is not scheme://host[:port][/path] "
                              f"(http or https, no query)")
        out.append(entry.rstrip("/"))
    return tuple(out)


def _nfs_exports(raw: dict) -> tuple[NfsExport, ...]:
    out = []
    for i, entry in enumerate(_list(raw, "datastage", "allowedNfsExports")):
        where = f"datastage.allowedNfsExports[{i}]"
        if not isinstance(entry, dict) or not entry.get("server") or \
                not str(entry.get("path", "")).startswith("/") or \
                set(entry) - {"server", "path", "namespaces"}:
            raise ConfigError(f"{where}: must be {{server: ADDRESS, path: /PREFIX, namespaces: [NAME, ...]}}")
        path, names = str(entry["path"]), entry.get("namespaces") or []
        if not isinstance(names, list) or not all(isinstance(n, str) and n for n in names):
            raise ConfigError(f"{where}.namespaces: must be a list of namespace names (or [\"*\"])")
        # The copy Job mounts an export read-write: one open to every namespace lets any of
        # them overwrite another's staged data, so whose it is must be said.
        if not names and NAMESPACE_PLACEHOLDER not in path:
            raise ConfigError(f"{where}: say which namespaces may stage into {entry['server']}:{path} "
                              f"(namespaces: [team-a]), or give each its own folder with "
                              f"{NAMESPACE_PLACEHOLDER} in the path (/export/{NAMESPACE_PLACEHOLDER}); "
                              f"namespaces: [\"*\"] shares it read-write between every namespace")
        out.append(NfsExport(str(entry["server"]), path, tuple(names)))
    return tuple(out)


def _switch(raw: dict, section: str, key: str) -> bool:
    value = (raw.get(section) or {}).get(key, False)
    if not isinstance(value, bool):
        raise ConfigError(f"{section}.{key}: must be true or false")
    return value


NFS_SERVERS = ("ganesha", "kernel")


def _nfs_server(raw: dict) -> str:
    """datastage.server: which NFS server destination.provision runs. ganesha (NFS-Ganesha in user
    space: non-root, one capability) by default; kernel (nfsd: a privileged pod, the node's nfsd
    module) only where an admin chooses it."""
    value = (raw.get("datastage") or {}).get("server", "ganesha")
    if value not in NFS_SERVERS:
        raise ConfigError(f"datastage.server: {value!r} is not one of {', '.join(NFS_SERVERS)} "
                          f"(ganesha: NFS-Ganesha, unprivileged; kernel: kernel nfsd, a privileged pod)")
    return value


def _cidrs(raw: dict, section: str, key: str) -> tuple[str, ...]:
    out = []
    for i, entry in enumerate(_list(raw, section, key)):
        try:
            out.append(str(ipaddress.ip_network(entry)))
        except (TypeError, ValueError):
            raise ConfigError(f"{section}.{key}[{i}]: {entry!r} is not a CIDR such as 10.224.0.0/16") from None
    return tuple(out)


def load(path: str | os.PathLike | None = None) -> Config:
    """Read `path`, else $TRAINOP_CONFIG, else the built-in defaults."""
    path = path or os.environ.get("TRAINOP_CONFIG")
    if not path:
        return from_dict(None)
    try:
        data = yaml.safe_load(Path(path).read_text())
    except OSError as exc:
        raise ConfigError(f"cannot read the configuration {path}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path} is not valid YAML: {exc}") from None
    return from_dict(data)
