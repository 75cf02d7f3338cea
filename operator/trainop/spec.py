"""Typed parse of a DistributedTrainingJob: the CRD's defaults applied, then every check the
schema cannot express, each error naming the field and the fix.

    job = spec.parse(body, cfg)      # raises SpecError("spec.nodePool.name: ...")
    job.total_gpus, job.placement.node_selector, job.slots_per_worker

Pure: no API calls. Checks against live nodes take the node list as an argument
(`capacity_error`).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

from trainop import blob, crds, fastjson
from trainop.config import Autoscale, Config, Fabric, NodePool, PodTemplateAllow, allowed_name
from trainop.memo import Memos

KIND = "DistributedTrainingJob"
INSTANCE_TYPE_LABEL = "node.kubernetes.io/instance-type"  # the kubelet's well-known label


class SpecError(ValueError):
    """Bad input: `field` names it, the message says what to change."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


class NoMatchingNodes(SpecError):
    """No node matches the job's pool yet: the job waits (nodes may be added), where any other
    capacity error fails it."""


@dataclass(frozen=True)
class Placement:
    node_selector: dict[str, str]
    tolerations: tuple[dict, ...]
    pool: str | None  # name in the operator's config, None for an explicit nodeSelector
    gpu_resource: str
    rdma_resource: str
    autoscale: Autoscale | None = None  # the pool's autoscaler bounds (config nodePools)
    gpus_per_node: int | None = None
    spot: bool = False


@dataclass(frozen=True)
class Fallback:
    """`spec.nodePool.fallback`: after `after` spot evictions the next attempt runs here."""
    placement: Placement
    after: int


@dataclass(frozen=True)
class FailureRule:
    """One rule of `spec.runPolicy.failurePolicy.rules` (exactly one `on*` is set)."""
    action: str                              # RestartGang | RestartGangAndIgnoreBackoffLimit | FailJob
    exit_operator: str | None = None         # onExitCodes.operator: In | NotIn
    exit_values: tuple[int, ...] = ()
    container: str | None = None             # onExitCodes.containerName
    pod_conditions: tuple[tuple[str, str], ...] = ()  # onPodConditions: (type, status)
    reasons: tuple[str, ...] = ()            # onFailureReasons


@dataclass(frozen=True)
class Preflight:
    """`spec.preflight`, with the pool's threshold when the spec names none."""
    enabled: bool
    min_busbw: float  # GB/s; 0: measure and report only
    image: str = ""   # preflight.image of the configuration, else the PyTorch trainer image


@dataclass(frozen=True)
class Training:
    batch_size: int
    epochs: int
    steps_per_epoch: int | None
    image_size: int | None
    precision: str
    channels_last: bool
    compile: bool


@dataclass(frozen=True)
class RunPolicy:
    backoff_limit: int
    active_deadline_seconds: int | None
    ttl_seconds_after_finished: int | None
    clean_pod_policy: str
    suspend: bool
    scheduling_timeout_seconds: int | None = None  # resolved: the spec's, else the config's
                                                   # default on an autoscaled pool
    failure_rules: tuple[FailureRule, ...] = ()
    start_timeout_seconds: int | None = None  # resolved: the spec's, else the config's
    stall_timeout_seconds: int | None = None  # runPolicy.stallTimeoutSeconds (None: off)


@dataclass(frozen=True)
class Elastic:
    """`spec.elastic` (docs/elastic.md): the gang's size may go down to `min_workers` when the
    pool does not give lost workers back within `shrink_after_seconds`, and back up to
    `max_workers` (always spec.workers) when capacity returns."""
    min_workers: int
    max_workers: int
    shrink_after_seconds: int
    grow_at_checkpoint: bool


# runPolicy.managedBy: the MPI Operator's convention (its own name or absent: it reconciles;
# anything else, such as MultiKueue's, belongs to another controller and is left alone).
MANAGED_BY = "trainop.io/operator"


def managed_by(body: dict) -> str:
    """Who reconciles the job, read from the raw body: a job another controller owns is never
    parsed or judged by trainop (its spec is that controller's business)."""
    run = ((body.get("spec") or {}).get("runPolicy") or {})
    return run.get("managedBy") or MANAGED_BY


@dataclass(frozen=True)
class FlavorPlacement:
    """What the ResourceFlavor Kueue admitted a pod set on adds to that pod set's pods: its
    nodeLabels as nodeSelector terms and its tolerations (kueue.place; Kueue's podset.Merge)."""
    node_selector: tuple[tuple[str, str], ...] = ()
    tolerations: tuple[dict, ...] = ()


@dataclass(frozen=True)
class SchedulingPolicy:
    """`spec.runPolicy.schedulingPolicy` (render/podgroup.py)."""
    min_available: int | None = None
    queue: str | None = None
    min_resources: dict | None = None
    priority_class: str | None = None
    schedule_timeout_seconds: int | None = None


@dataclass(frozen=True)
class SecurityContext:
    """`spec.securityContext`: the user of every pod; root (uid 0) only where the admin's
    podTemplate.allow.privileged lets pods escalate (parse() refuses it otherwise)."""
    run_as_user: int
    run_as_group: int
    fs_group: int

    @property
    def root(self) -> bool:
        return self.run_as_user == 0


@dataclass(frozen=True)
class Output:
    """`spec.output`, checked. `blob` xor `claim`."""
    account_url: str | None = None
    container: str | None = None
    prefix: str = ""
    auth: blob.BlobAuth | None = None
    claim: str | None = None


def parse_output(output: dict | None, wi_account: str | None,
                 field_: str = "spec.output") -> Output | None:
    """The CRD's output block as an Output; SpecError naming the field for what the schema
    cannot reject. `wi_account`: the configuration's default workload-identity ServiceAccount
    (logship.workloadIdentityServiceAccount)."""
    if not output:
        return None
    if "pvc" in output:
        return Output(claim=output["pvc"]["claimName"])
    spec = output["blob"]
    where = f"{field_}.blob"
    try:
        url = blob.check_account_url(spec.get("accountURL"), f"{where}.accountURL")
        auth = blob.parse_auth(spec.get("auth"), f"{where}.auth")
    except blob.BlobConfigError as exc:
        raise SpecError(*str(exc).split(": ", 1)) from None
    if auth.method == "WorkloadIdentity" and not auth.service_account_name:
        account = wi_account
        if not account:
            raise SpecError(f"{where}.auth.serviceAccountName",
                            "required with workloadIdentity: name the ServiceAccount federated with the "
                            "managed identity that may write the container (or set "
                            "logship.workloadIdentityServiceAccount in the operator's configuration)")
        auth = blob.BlobAuth("WorkloadIdentity", service_account_name=account)
    return Output(account_url=url, container=spec["container"], prefix=spec.get("prefix", "").strip("/"), auth=auth)


@dataclass(frozen=True)
class Checkpoint:
    """`spec.checkpoint`, resolved: where the trainer saves (TRAINOP_CHECKPOINT_DIR is
    `<root>/attempt-<n>`) and how often. Layout and the resume decision: resume.py and
    docs/long-runs.md."""
    every_steps: int
    root: str  # the folder in the pods that holds attempt-<n>/step-<k>
    claim: str | None = None  # spec.checkpoint.volume.claimName (mounted at /checkpoints)
    on_claim: bool = False  # root is on a claim (the volume, or an output claim): persists

    def attempt_dir(self, attempt: int) -> str:
        return f"{self.root}/attempt-{attempt}"


CHECKPOINT_VOLUME_MOUNT = "/checkpoints"


def own_name(name: str, uid: str | None) -> str:
    """`<name>-<uid8>`: the folder of this job alone, not of an earlier or later one of its name."""
    return name + (f"-{uid[:8]}" if uid else "")


def _checkpoint(spec: dict, name: str, uid: str | None) -> Checkpoint | None:
    ck = spec.get("checkpoint") or {}
    claim = (ck.get("volume") or {}).get("claimName")
    output = spec.get("output") or {}
    enabled = ck.get("enabled")
    if enabled is None:
        # Every framework's built-in trainer saves and resumes (TensorFlow and Keras under
        # Horovod: the only launcher they have is mpi).
        enabled = bool(claim or output)
    if not enabled:
        return None
    if not (claim or output):
        raise SpecError("spec.checkpoint.enabled", "checkpoints need a place that outlives the pods; "
                        "set spec.checkpoint.volume.claimName or spec.output")
    # On a claim, the job's uid is in the folder's name: a later job of the same name on the
    # same claim never resumes from this one's checkpoints (Blob output: the job's folder,
    # render/logship.job_path, is named the same way).
    own = own_name(name, uid)
    if claim:
        return Checkpoint(ck["everySteps"], f"{CHECKPOINT_VOLUME_MOUNT}/{own}", claim, on_claim=True)
    if "pvc" in output:
        return Checkpoint(ck["everySteps"], f"/output/checkpoints/{own}", on_claim=True)
    return Checkpoint(ck["everySteps"], "/output/checkpoints")


@dataclass(frozen=True)
class Job:
    name: str
    namespace: str
    uid: str | None  # metadata.uid (None only for a body never stored: renderer tests, local runs)
    framework: str
    launcher: str  # mpi | torchrun
    image: str
    image_pull_policy: str | None
    command: tuple[str, ...] | None
    args: tuple[str, ...] | None
    env: tuple[dict, ...]
    workers: int
    gpus_per_worker: int
    slots_per_worker: int
    mpi_implementation: str
    resources: dict
    shm_size: str
    placement: Placement
    infiniband: bool
    data_stage: str | None
    synthetic: bool
    data_mount_path: str
    training: Training
    output: Output | None  # spec.output, parsed
    run_policy: RunPolicy
    launcher_resources: dict  # spec.mpirun.resources, else the operator's launcherResources
    logship: dict  # the operator's `logship` configuration section (render/logship.py)
    security: SecurityContext
    priority_class_name: str | None = None  # spec.priorityClassName (priority.py resolves it)
    # spec.podTemplate, checked: role -> {metadata, spec} (render/overrides.py merges it)
    pod_template: dict = field(default_factory=dict)
    scheduling_policy: SchedulingPolicy = SchedulingPolicy()
    gang_scheduler: str | None = None       # set by podgroup.bind: scheduler-plugins | volcano
    gang_scheduler_name: str | None = None  # the pods' schedulerName under it
    fallback: Fallback | None = None        # spec.nodePool.fallback
    pod_priority_class: str | None = None   # the pods' priorityClassName, set by priority.bind
    checkpoint: Checkpoint | None = None    # spec.checkpoint, resolved (None: off)
    preflight: Preflight = Preflight(False, 0.0, "")  # spec.preflight
    topology_file: str | None = None  # NCCL_TOPO_FILE on the node (IB, known instance type)
    fabric: Fabric = Fabric()          # the operator's infiniband/preflight sections
    denied_egress: tuple[str, ...] = ()  # jobNetwork.deniedEgressCIDRs (render/dtj.py)
    empty_dir_size_limit: str | None = None  # limits.emptyDirSizeLimit (render: scratch_volume)
    launcher_image: str | None = None        # spec.mpirun.image (None: spec.image)
    mpirun_args: tuple[str, ...] = ()        # spec.mpirun.extraArgs, checked
    launcher_command: tuple[str, ...] | None = None  # spec.mpirun.command
    ssh_mount_path: str | None = None        # spec.ssh.mountPath
    termination_grace_period_seconds: int | None = None  # spec.terminationGracePeriodSeconds
    max_checkpoint_grace_seconds: int = 600  # limits.maxCheckpointGraceSeconds (render/dtj.py save_grace)
    # status.checkpoint.saveSeconds, the slowest save reported, set by jobsync before rendering
    # (render/dtj.py sizes the pods' grace period from it)
    save_seconds: float | None = None
    launcher_as_worker: bool = False         # spec.mpirun.runLauncherAsWorker
    # Kueue's admitted flavors per pod set ("workers", "launcher"), set by kueue.place once the
    # Workload is admitted; render/dtj.py adds them to the pods' placement.
    flavors: tuple[tuple[str, FlavorPlacement], ...] = ()
    elastic: Elastic | None = None  # spec.elastic; `workers` is the current size (jobsync/elastic.py)

    def flavor(self, pod_set: str) -> FlavorPlacement | None:
        return dict(self.flavors).get(pod_set)

    @property
    def rank_hosts(self) -> int:
        """Pods that run ranks: the workers, and the launcher with runLauncherAsWorker."""
        return self.workers + self.launcher_as_worker

    @property
    def total_gpus(self) -> int:
        return self.rank_hosts * self.gpus_per_worker

    @property
    def total_slots(self) -> int:
        return self.rank_hosts * self.slots_per_worker


def _placement(spec: dict, cfg: Config) -> Placement:
    pool_spec = spec.get("nodePool") or {}
    if "nodeSelector" in pool_spec:
        return Placement(node_selector=dict(pool_spec["nodeSelector"]),
                         tolerations=tuple(pool_spec.get("tolerations") or ()), pool=None,
                         gpu_resource=cfg.raw["gpuResource"], rdma_resource=cfg.raw["rdmaResource"])
    if "name" in pool_spec:
        field, name = "spec.nodePool.name", pool_spec["name"]
    else:
        kind = "infiniband" if spec["infiniband"] else "gpu" if spec["gpusPerWorker"] else "cpu"
        field, name = "spec.nodePool", cfg.default_node_pools.get(kind)
        if name is None:
            raise SpecError(field, f"the operator has no default {kind} node pool; set "
                                   f"nodePool.name or nodePool.nodeSelector")
    pool: NodePool | None = cfg.node_pools.get(name)
    if pool is None:
        raise SpecError(field, f"node pool {name!r} does not exist in the operator's "
                               f"configuration; use one of {', '.join(sorted(cfg.node_pools))} "
                               f"or set nodePool.nodeSelector")
    return _pool_placement(pool, spec, cfg, "spec.infiniband")


def _pool_placement(pool: NodePool, spec: dict, cfg: Config, field: str) -> Placement:
    if spec["infiniband"] and not pool.infiniband:
        raise SpecError(field, f"node pool {pool.name!r} has no InfiniBand; choose a pool "
                        f"with InfiniBand ({', '.join(sorted(p.name for p in cfg.node_pools.values() if p.infiniband)) or 'none configured'}) "
                        f"or set infiniband: false")
    selector = dict(pool.node_selector)
    if pool.instance_type:  # NCCL_TOPO_FILE is chosen by it: only nodes of that size
        selector.setdefault(INSTANCE_TYPE_LABEL, pool.instance_type)
    return Placement(node_selector=selector, tolerations=tuple(pool.tolerations),
                     pool=pool.name, gpu_resource=pool.gpu_resource,
                     rdma_resource=pool.rdma_resource, autoscale=pool.autoscale,
                     gpus_per_node=pool.gpus_per_node, spot=pool.spot)


def _fallback(spec: dict, cfg: Config, placement: Placement) -> Fallback | None:
    raw = (spec.get("nodePool") or {}).get("fallback")
    if not raw:
        return None
    field = "spec.nodePool.fallback"
    if not placement.spot:
        raise SpecError(field, f"node pool {placement.pool or placement.node_selector!r} is not a "
                               f"spot pool (spot: true in the operator's configuration); a "
                               f"fallback applies after spot evictions: remove it or name a spot pool")
    pool = cfg.node_pools.get(raw["name"])
    if pool is None:
        raise SpecError(f"{field}.name", f"node pool {raw['name']!r} does not exist in the "
                                         f"operator's configuration; use one of "
                                         f"{', '.join(sorted(cfg.node_pools))}")
    if pool.spot:
        raise SpecError(f"{field}.name", f"node pool {pool.name!r} is a spot pool too; name an "
                                         f"on-demand pool")
    return Fallback(_pool_placement(pool, spec, cfg, f"{field}.name"), raw["afterSpotEvictions"])


def _failure_rules(run: dict) -> tuple[FailureRule, ...]:
    out = []
    for rule in (run.get("failurePolicy") or {}).get("rules") or []:
        codes = rule.get("onExitCodes") or {}
        out.append(FailureRule(
            action=rule["action"], exit_operator=codes.get("operator"),
            exit_values=tuple(codes.get("values") or ()), container=codes.get("containerName"),
            pod_conditions=tuple((c["type"], c.get("status", "True"))
                                 for c in rule.get("onPodConditions") or ()),
            reasons=tuple(rule.get("onFailureReasons") or ())))
    return tuple(out)


def _scheduling_timeout(run: dict, placement: Placement, cfg: Config) -> int | None:
    """The job's own value; else, on an autoscaled pool (nodes expected to come), the
    configuration's default. A fixed pool's pods wait for busy nodes without a deadline."""
    if run.get("schedulingTimeoutSeconds") is not None:
        return run["schedulingTimeoutSeconds"]
    return cfg.scheduling_timeout_seconds if placement.autoscale else None


# What spec.resources may set (the CRD's CEL rule says the same; repeated here because the GPU
# count of a job, which admission and maxGpusPerJob judge, relies on it, and --local has no API
# server). A GPU limit set here would give pods GPUs that status.gpus and quotas never see.
WORKER_RESOURCES = ("cpu", "memory", "ephemeral-storage")


def _check_resources(resources: dict) -> None:
    for which in ("requests", "limits"):
        for key in resources.get(which) or {}:
            if key not in WORKER_RESOURCES and not key.startswith("hugepages-"):
                raise SpecError(f"spec.resources.{which}", f"{key!r} cannot be set here: GPUs come "
                                f"from spec.gpusPerWorker and the RDMA device from spec.infiniband "
                                f"(which quotas and maxGpusPerJob count); only "
                                f"{', '.join(WORKER_RESOURCES)} and hugepages-<size> may be set")


def _output(output: dict | None, cfg: Config, namespace: str) -> Output | None:
    default = cfg.section("logship").get("workloadIdentityServiceAccount")
    out = parse_output(output, default)
    account = out.auth.service_account_name if out is not None and out.auth else None
    if account and account != default and not allowed_name(cfg.allowed_service_accounts,
                                                           namespace, account):
        # The pods run as it and its shipper acts as it: a namespace user who may create jobs
        # but not pods would otherwise borrow any identity of the namespace.
        raise SpecError("spec.output.blob.auth.serviceAccountName", f"{account!r} is not a "
                        f"ServiceAccount jobs may upload as: leave it out for the operator's "
                        f"default ({default or 'none configured'}), or ask the cluster admin to "
                        f"add it to blob.allowedServiceAccounts")
    if account == "default":
        raise SpecError("spec.output.blob.auth.serviceAccountName", "the namespace's default "
                        "ServiceAccount runs every pod that names none, and the shipper's Role "
                        "would be bound to it: name a ServiceAccount made for uploads")
    if out is not None and out.account_url:  # the shipper's credential goes there
        try:
            blob.check_endpoint_allowed(out.account_url, "spec.output.blob.accountURL",
                                        cfg.allowed_account_urls)
        except blob.BlobConfigError as exc:
            raise SpecError(*str(exc).split(": ", 1)) from None
    return out


# ---- spec.podTemplate: what Pod Security "restricted" allows, unless podTemplate.allow says more,
# and no identity the job's pods would not have without it (docs/security.md, "What a namespace
# user can reach through a job"). Conflicts with what the operator renders are judged by
# render/overrides.py against the rendered pods themselves (parse() renders every pod variant
# once), so no list of its names can go stale.
# csi is restricted's too, but only the admin's volumeTypes opens it: a CSI driver may be handed
# the pod's ServiceAccount token (CSIDriver tokenRequests), e.g. the Key Vault driver's.
RESTRICTED_VOLUME_TYPES = ("configMap", "downwardAPI", "emptyDir", "ephemeral",
                           "persistentVolumeClaim", "projected", "secret")
RESTRICTED_CAPABILITIES = ("NET_BIND_SERVICE",)
SELINUX_TYPES = ("", "container_t", "container_init_t", "container_kvm_t", "container_engine_t")
CONTAINER_RESOURCES = WORKER_RESOURCES
# The NVIDIA container toolkit's knobs: read from a container's environment at its creation, after
# the device plugin's own value, so NVIDIA_VISIBLE_DEVICES=all would hand the container every GPU
# of the node past the scheduler and every quota.
GPU_ENV_PREFIX = "NVIDIA_"
# Baseline Pod Security: AppArmor through the (pre-1.30) annotation, only these values.
APPARMOR_ANNOTATION = "container.apparmor.security.beta.kubernetes.io/"
# Labels and annotations of the AKS workload-identity webhook: only the operator opts a pod in,
# and only the operator says which containers it skips (render/dtj.py).
IDENTITY_PREFIX = "azure.workload.identity/"
PROBES = ("livenessProbe", "readinessProbe", "startupProbe")


# The one container of each role that holds GPUs (render/dtj.py gives the limit to the worker
# role's training container only). Every other container gets NVIDIA_VISIBLE_DEVICES=void as an
# `env` entry, which beats any envFrom, so envFrom is judged here only.
GPU_CONTAINERS = {"worker": "worker"}


def _check_env_names(env: list[dict], where: str) -> None:
    for j, e in enumerate(env or []):
        if e.get("name", "").startswith(GPU_ENV_PREFIX):
            raise SpecError(f"{where}[{j}].name", f"{e['name']} tells the NVIDIA container runtime "
                            f"which GPUs to expose, past spec.gpusPerWorker and every quota: remove "
                            f"it (a worker sees the GPUs it requests)")


def may_set_gpu_env(env_from: dict) -> bool:
    """Can this envFrom entry set an NVIDIA_* variable (no prefix, or one such names share)?"""
    prefix = env_from.get("prefix") or ""
    return GPU_ENV_PREFIX.startswith(prefix) or prefix.startswith(GPU_ENV_PREFIX)


def _check_gpu_env_from(env_from: list[dict], where: str, allow: PodTemplateAllow) -> None:
    """envFrom on the GPU container: the operator never reads the ConfigMap or Secret (it may
    change after this check), so only a prefix that no NVIDIA_* name can start with keeps the
    device plugin's NVIDIA_VISIBLE_DEVICES the container's own (the kubelet puts the plugin's
    variables first, so the pod's win). An admin whose GPU nodes' container toolkit ignores the
    variable in unprivileged containers opens it (podTemplate.allow.envFromWithoutPrefix)."""
    if allow.env_from_without_prefix:
        return
    for j, source in enumerate(env_from or []):
        if may_set_gpu_env(source):
            raise SpecError(f"{where}[{j}].prefix", "without a prefix, envFrom could set "
                            "NVIDIA_VISIBLE_DEVICES in the GPU container and expose every GPU of the "
                            "node: give it a prefix such as \"CFG_\" (not one NVIDIA_ names can "
                            "start with), or name each variable in env with "
                            "valueFrom.configMapKeyRef, or ask the cluster admin for "
                            "podTemplate.allow.envFromWithoutPrefix")


def _check_container_security(sc: dict, where: str, allow: PodTemplateAllow) -> None:
    fix = "remove it (or ask the cluster admin for podTemplate.allow.privileged)"
    escalating = {"privileged": sc.get("privileged") is True,
                  "allowPrivilegeEscalation": sc.get("allowPrivilegeEscalation") is True,
                  "runAsNonRoot": sc.get("runAsNonRoot") is False,
                  "runAsUser": sc.get("runAsUser") == 0,
                  "seccompProfile.type": (sc.get("seccompProfile") or {}).get("type") == "Unconfined",
                  "appArmorProfile.type": (sc.get("appArmorProfile") or {}).get("type") == "Unconfined",
                  "procMount": sc.get("procMount", "Default") != "Default",
                  "seLinuxOptions": bool(set(sc.get("seLinuxOptions") or {}) - {"level"}) and (
                      (sc["seLinuxOptions"].get("type") or "") not in SELINUX_TYPES
                      or bool(sc["seLinuxOptions"].get("user") or sc["seLinuxOptions"].get("role"))),
                  "windowsOptions.hostProcess": (sc.get("windowsOptions") or {}).get("hostProcess") is True}
    for key, bad in escalating.items():
        if bad and not allow.privileged:
            raise SpecError(f"{where}.securityContext.{key}", f"escalates privilege beyond Pod "
                            f"Security \"restricted\": {fix}")
    added = ((sc.get("capabilities") or {}).get("add")) or []
    for i, cap in enumerate(added):
        if cap not in RESTRICTED_CAPABILITIES + allow.capabilities and not allow.privileged:
            raise SpecError(f"{where}.securityContext.capabilities.add[{i}]", f"{cap} is not allowed: "
                            f"only {', '.join(RESTRICTED_CAPABILITIES + allow.capabilities)} may be "
                            f"added (the cluster admin's podTemplate.allow.capabilities)")


def _check_handlers(c: dict, where: str) -> None:
    """Baseline Pod Security: a probe or lifecycle hook may not name another host (the kubelet
    would send requests from the node to it)."""
    handlers = [(p, c.get(p)) for p in PROBES] + \
        [(f"lifecycle.{h}", (c.get("lifecycle") or {}).get(h)) for h in ("postStart", "preStop")]
    for path, handler in handlers:
        for kind in ("httpGet", "tcpSocket"):
            if ((handler or {}).get(kind) or {}).get("host"):
                raise SpecError(f"{where}.{path}.{kind}.host", "a probe or hook reaches the pod "
                                "itself only (Pod Security baseline): remove host")


def _check_containers(containers: list[dict], where: str, allow: PodTemplateAllow) -> None:
    for i, c in enumerate(containers):
        here = f"{where}[{i}]"
        _check_container_security(c.get("securityContext") or {}, here, allow)
        _check_handlers(c, here)
        _check_env_names(c.get("env") or [], f"{here}.env")
        for which in ("requests", "limits"):
            for key in (c.get("resources") or {}).get(which) or {}:
                if key not in CONTAINER_RESOURCES and not key.startswith("hugepages-"):
                    raise SpecError(f"{here}.resources.{which}", f"{key!r} cannot be requested by an "
                                    f"added container: GPUs come from spec.gpusPerWorker and the RDMA "
                                    f"device from spec.infiniband (which quotas count); only "
                                    f"{', '.join(CONTAINER_RESOURCES)} and hugepages-<size>")
        for j, port in enumerate(c.get("ports") or []):
            if port.get("hostPort") and not allow.host_network:
                raise SpecError(f"{here}.ports[{j}].hostPort", "binds a port of the node: remove it "
                                "(or ask the cluster admin for podTemplate.allow.hostNetwork)")


def _secret_refs(node, path: str):
    """(field, Secret name) of every Secret reference in a pod template's spec, however it is
    spelled: env valueFrom.secretKeyRef, envFrom.secretRef, a secret volume's secretName, a
    projected secret source, a CSI or other volume's secret reference (nodePublishSecretRef,
    secretRef, secretName), imagePullSecrets. And (field, None) for a projected
    serviceAccountToken."""
    if isinstance(node, list):
        for i, item in enumerate(node):
            yield from _secret_refs(item, f"{path}[{i}]")
        return
    if not isinstance(node, dict):
        return
    for key, value in node.items():
        here = f"{path}.{key}"
        if key == "serviceAccountToken":
            yield here, None
        elif key == "secretName" and isinstance(value, str):
            yield here, value
        elif key in ("secretKeyRef", "secretRef", "nodePublishSecretRef", "secret") \
                and isinstance(value, dict) and "name" in value:
            yield f"{here}.name", value["name"]
        elif key == "imagePullSecrets" and isinstance(value, list):
            for i, ref in enumerate(value):
                yield f"{here}[{i}].name", (ref or {}).get("name", "")
        else:
            yield from _secret_refs(value, here)


def _check_identity(pod: dict, where: str, namespace: str, allow: PodTemplateAllow) -> None:
    """No Secret the admin did not list (job pods hold no API token: job code reads no Secret
    it is not handed, and the operator cannot know which Secrets the job's creator may read),
    and never a token of the pod's ServiceAccount (the shipper's identity, a federated one)."""
    for field_, secret in _secret_refs(pod, f"{where}.spec"):
        if secret is None:
            raise SpecError(field_, "a projected ServiceAccount token would hand job code the "
                            "identity of the pod (the log shipper's, or a federated Azure "
                            "identity); job pods hold no token: remove it")
        if not allow.secret_allowed(namespace, secret):
            raise SpecError(field_, f"Secret {secret!r} is not one a pod template may reference: "
                            f"remove it, or ask the cluster admin to add it to "
                            f"podTemplate.allow.secrets")


def _check_metadata(meta: dict, where: str, allow: PodTemplateAllow) -> None:
    for kind in ("labels", "annotations"):
        for key, value in (meta.get(kind) or {}).items():
            if key.startswith(IDENTITY_PREFIX):
                raise SpecError(f"{where}.metadata.{kind}[{key}]", "the workload-identity "
                                "webhook's keys are the operator's (it opts in the log shipper "
                                "alone): remove it")
            if kind == "annotations" and key.startswith(APPARMOR_ANNOTATION) and \
                    value != "runtime/default" and not value.startswith("localhost/") \
                    and not allow.privileged:
                raise SpecError(f"{where}.metadata.annotations[{key}]", f"AppArmor {value!r} "
                                f"lifts the profile (Pod Security baseline allows runtime/default "
                                f"and localhost/*): remove it (or ask the cluster admin for "
                                f"podTemplate.allow.privileged)")


def _pod_template(spec: dict, allow: PodTemplateAllow, namespace: str) -> dict:
    """spec.podTemplate checked against what the admin allows: role -> override."""
    out = {}
    for role, override in (spec.get("podTemplate") or {}).items():
        where = f"spec.podTemplate.{role}"
        if role == "launcher" and spec["launcher"] != "mpi":
            raise SpecError(where, "a torchrun job has no launcher pod: use podTemplate.worker")
        pod = override.get("spec") or {}
        _check_metadata(override.get("metadata") or {}, where, allow)
        for key, allowed in (("hostNetwork", allow.host_network), ("hostPID", allow.host_pid),
                             ("hostIPC", allow.host_ipc)):
            if pod.get(key) and not allowed:
                raise SpecError(f"{where}.spec.{key}", f"shares the node's namespaces with the pod: "
                                f"remove it (or ask the cluster admin for podTemplate.allow.{key})")
        for i, volume in enumerate(pod.get("volumes") or []):
            kind = next((k for k in volume if k != "name"), "emptyDir")  # the API's default
            if kind == "hostPath" and not allow.host_path:
                raise SpecError(f"{where}.spec.volumes[{i}].hostPath", "mounts the node's files into "
                                "the pod: use a persistentVolumeClaim, configMap, secret or emptyDir "
                                "(or ask the cluster admin for podTemplate.allow.hostPath)")
            if kind not in RESTRICTED_VOLUME_TYPES + ("hostPath",) + allow.volume_types:
                raise SpecError(f"{where}.spec.volumes[{i}].{kind}", f"volume type {kind!r} is not "
                                f"allowed: use one of {', '.join(RESTRICTED_VOLUME_TYPES)} (a "
                                f"persistentVolumeClaim reaches any storage), or ask the cluster "
                                f"admin for podTemplate.allow.volumeTypes")
        _check_containers(pod.get("initContainers") or [], f"{where}.spec.initContainers", allow)
        _check_containers(pod.get("containers") or [], f"{where}.spec.containers", allow)
        for i, c in enumerate(pod.get("containers") or []):
            if c.get("name") == GPU_CONTAINERS.get(role):
                _check_gpu_env_from(c.get("envFrom"), f"{where}.spec.containers[{i}].envFrom", allow)
        _check_identity(pod, where, namespace, allow)
        out[role] = override
    return out


def _scheduling_policy(policy: dict) -> SchedulingPolicy:
    return SchedulingPolicy(min_available=policy.get("minAvailable"), queue=policy.get("queue"),
                            min_resources={k: str(v) for k, v in policy["minResources"].items()}
                            if policy.get("minResources") else None,
                            priority_class=policy.get("priorityClass"),
                            schedule_timeout_seconds=policy.get("scheduleTimeoutSeconds"))


def priority_class_name(spec: dict) -> str | None:
    """spec.priorityClassName, or the one class the pod templates or the Volcano PodGroup
    (runPolicy.schedulingPolicy.priorityClass) name: every name is the job's one class, judged
    by priority.py against limits.maxPriority (the CRD's rules refuse some conflicts; repeated
    for --local)."""
    named = {f"spec.podTemplate.{role}.spec.priorityClassName":
             (o.get("spec") or {}).get("priorityClassName")
             for role, o in (spec.get("podTemplate") or {}).items()}
    named["spec.runPolicy.schedulingPolicy.priorityClass"] = \
        ((spec.get("runPolicy") or {}).get("schedulingPolicy") or {}).get("priorityClass")
    named = {f: n for f, n in named.items() if n}
    if spec.get("priorityClassName") and any(n != spec["priorityClassName"] for n in named.values()):
        where = next(f for f, n in named.items() if n != spec["priorityClassName"])
        raise SpecError(where, "conflicts with spec.priorityClassName: set only spec.priorityClassName")
    if len(set(named.values())) > 1:
        raise SpecError(list(named)[-1], f"names another priority class than "
                        f"{list(named)[0]}: a gang has one priority; set spec.priorityClassName instead")
    return spec.get("priorityClassName") or next(iter(named.values()), None)


def _volcano_queue(spec: dict, cfg: Config) -> None:
    """A Volcano queue is cluster-wide and carries its own capacity and priority: a job may name
    only one the admin listed (gangScheduling.allowedQueues)."""
    queue = ((spec.get("runPolicy") or {}).get("schedulingPolicy") or {}).get("queue")
    if queue and queue not in cfg.allowed_queues:
        raise SpecError("spec.runPolicy.schedulingPolicy.queue", f"Volcano queue {queue!r} is not "
                        f"one jobs may name ({', '.join(cfg.allowed_queues) or 'none listed'}): "
                        f"leave it out for Volcano's default, or ask the cluster admin to add it "
                        f"to gangScheduling.allowedQueues")


# The most JSON a DistributedTrainingJob's or DataStage's spec (with its labels) may hold (issue 22 M7). The
# operator keeps every object's spec in memory, shared by all namespaces; the API server's own
# bound is about 1.5 MB an object, so a few hundred large jobs in one namespace would fill its
# 512Mi. A real spec with a pod template is a few KiB. The caches keep a larger spec as its size
# only (handlers/indexes.py), and parsing fails it naming `spec`. CRD size bounds (maxLength,
# maxItems) cannot say this: they bound each field, and their product is no bound at all.
MAX_SPEC_BYTES = 128 * 1024
OVERSIZED = "trainop.io/oversized-bytes"  # not a field of either CRD: the API server prunes it


def _json_size(value) -> int:
    return len(json.dumps(value, separators=(",", ":"), default=str))


def held_size(body: dict) -> int:
    """What of `body` a user can make large and the caches keep: its spec and labels."""
    labels = (body.get("metadata") or {}).get("labels")
    return _json_size(body.get("spec") or {}) + (_json_size(labels) if labels else 0)


def bounded(body: dict) -> dict:
    """`body` as the caches may keep it: itself, or, where its spec and labels (what a user
    can make large and the operator reads) exceed MAX_SPEC_BYTES, without its labels and with
    only the size and runPolicy.managedBy for a spec (a job another controller owns stays
    that controller's)."""
    spec, size = body.get("spec") or {}, held_size(body)
    if size <= MAX_SPEC_BYTES:
        return body
    run = spec.get("runPolicy") if isinstance(spec.get("runPolicy"), dict) else {}
    held = {OVERSIZED: size, **({"runPolicy": {"managedBy": run["managedBy"]}} if run.get("managedBy") else {})}
    return {**body, "metadata": {**body["metadata"], "labels": {}}, "spec": held}


def _check_size(body: dict, fix: str) -> None:
    size = (body.get("spec") or {}).get(OVERSIZED) or held_size(body)
    if size > MAX_SPEC_BYTES:
        raise SpecError("spec", f"is {size // 1024} KiB of JSON (with metadata.labels); the operator takes at most "
                        f"{MAX_SPEC_BYTES // 1024} KiB (it holds every spec of the cluster in "
                        f"memory): {fix}")


def parse(body: dict, cfg: Config) -> Job:
    """The job as a typed value; SpecError for input only the operator can judge."""
    _check_size(body, "move large scripts or files into a ConfigMap and mount "
                "it through spec.podTemplate")
    obj = crds.default({"apiVersion": body.get("apiVersion", "trainop.io/v1alpha1"),
                        "kind": KIND, "metadata": body.get("metadata", {}),
                        "spec": body.get("spec") or {}})
    for error in crds.validate(obj):  # the API server already enforces these; --local does not
        raise SpecError(*error.split(": ", 1))
    spec, meta = obj["spec"], obj["metadata"]
    if spec["launcher"] == "torchrun" and spec["framework"] != "pytorch":
        raise SpecError("spec.launcher", f"torchrun runs PyTorch only; use launcher: mpi for "
                                         f"{spec['framework']} (Horovod)")
    image = spec.get("image") or cfg.images.get(spec["framework"])
    if not image:
        raise SpecError("spec.image", f"the operator has no default image for "
                                      f"{spec['framework']}; set spec.image")
    _check_resources(spec.get("resources") or {})
    _check_env_names(spec.get("env") or [], "spec.env")
    _volcano_queue(spec, cfg)
    gpus = spec["gpusPerWorker"]
    hosts = spec["workers"] + _launcher_as_worker(spec)
    total = hosts * gpus
    if cfg.max_gpus_per_job is not None and total > cfg.max_gpus_per_job:
        raise SpecError("spec.gpusPerWorker", f"the job needs {total} GPUs ({hosts} "
                        f"{'pods with ranks' if hosts != spec['workers'] else 'workers'} x {gpus}); this "
                        f"cluster allows at most {cfg.max_gpus_per_job} per job: reduce workers or "
                        f"gpusPerWorker")
    data, train, run, output = spec["data"], spec["training"], spec["runPolicy"], spec.get("output")
    user = spec["securityContext"]
    if user["runAsUser"] == 0 and not cfg.pod_template_allow.privileged:
        raise SpecError("spec.securityContext.runAsUser", "0 (root) needs the cluster admin's "
                        "podTemplate.allow.privileged (and a namespace at Pod Security baseline): "
                        "use the image's own non-root user")
    placement = _placement(spec, cfg)
    job = Job(
        name=meta["name"], namespace=meta.get("namespace", "default"), uid=meta.get("uid"),
        framework=spec["framework"], launcher=spec["launcher"], image=image,
        image_pull_policy=spec.get("imagePullPolicy"),
        command=tuple(spec["command"]) if spec.get("command") else None,
        args=tuple(spec["args"]) if "args" in spec else None,
        env=tuple(spec.get("env") or ()), workers=spec["workers"], gpus_per_worker=gpus,
        slots_per_worker=spec.get("slotsPerWorker") or max(gpus, 1),
        mpi_implementation=spec["mpiImplementation"], resources=spec.get("resources") or {},
        shm_size=str(spec["shmSize"]), placement=placement,
        infiniband=spec["infiniband"],
        data_stage=(data.get("dataStageRef") or {}).get("name"),
        synthetic=bool(data.get("synthetic")), data_mount_path=data["mountPath"],
        training=Training(batch_size=train["batchSize"], epochs=train["epochs"],
                          steps_per_epoch=train.get("stepsPerEpoch"),
                          image_size=train.get("imageSize"), precision=train["precision"],
                          channels_last=train["channelsLast"], compile=train["compile"]),
        output=_output(output, cfg, meta.get("namespace", "default")),
        run_policy=RunPolicy(backoff_limit=run["backoffLimit"],
                             active_deadline_seconds=run.get("activeDeadlineSeconds"),
                             ttl_seconds_after_finished=run.get("ttlSecondsAfterFinished"),
                             clean_pod_policy=run["cleanPodPolicy"], suspend=run["suspend"],
                             scheduling_timeout_seconds=_scheduling_timeout(run, placement, cfg),
                             failure_rules=_failure_rules(run),
                             start_timeout_seconds=run.get("startTimeoutSeconds", cfg.start_timeout_seconds),
                             stall_timeout_seconds=run.get("stallTimeoutSeconds")),
        launcher_resources=_launcher_resources(spec, cfg), logship=cfg.section("logship"),
        security=SecurityContext(run_as_user=user["runAsUser"], run_as_group=user["runAsGroup"],
                                 fs_group=user.get("fsGroup", user["runAsGroup"])),
        priority_class_name=priority_class_name(spec),
        pod_template=_pod_template(spec, cfg.pod_template_allow, meta.get("namespace", "default")),
        scheduling_policy=_scheduling_policy(run.get("schedulingPolicy") or {}),
        fallback=_fallback(spec, cfg, placement),
        preflight=_preflight(spec, cfg), topology_file=_topology_file(spec, cfg),
        fabric=cfg.fabric, denied_egress=cfg.denied_egress_cidrs,
        empty_dir_size_limit=cfg.empty_dir_size_limit,
        checkpoint=_checkpoint(spec, meta["name"], meta.get("uid")),
        launcher_image=(spec.get("mpirun") or {}).get("image"),
        mpirun_args=_mpirun_args(spec), launcher_command=_launcher_command(spec),
        ssh_mount_path=_ssh_mount_path(spec, data["mountPath"]),
        termination_grace_period_seconds=spec.get("terminationGracePeriodSeconds"),
        max_checkpoint_grace_seconds=cfg.max_checkpoint_grace_seconds,
        launcher_as_worker=_launcher_as_worker(spec),
        elastic=_elastic(spec),
    )
    if job.pod_template:
        # The operator's own fields win: the merge refuses an override that contradicts what
        # the renderer makes (render/overrides.py), judged here once so that bad input fails
        # the job before any child exists. Imported here: the renderers import this module.
        from trainop.render import dtj
        dtj.check_overrides(job)
    return job


# mpirun flags that would break the gang (spec.mpirun.extraArgs): the rank count and the hosts
# are the operator's (the hostfile is the gang), so is the ssh transport (its own config, keys
# and pinned host key), and --app replaces the program. Open MPI spells them with one or two
# dashes; Hydra (Intel MPI, MPICH) with one.
MPIRUN_DENIED = {
    "the rank count (spec.workers x slotsPerWorker)": ("np", "n", "c"),
    "the hosts (the operator's hostfile is the gang)": (
        "hostfile", "machinefile", "default-hostfile", "H", "host", "f", "hosts", "ppn",
        "rankfile", "add-hostfile", "add-host"),
    "the ssh transport (the operator's keys and pinned host key)": (
        "launcher", "launcher-exec", "bootstrap", "bootstrap-exec", "rsh", "launch-agent"),
    "the program (spec.command)": ("app", "configfile"),
}
# MCA parameters of the same things (--mca NAME VALUE; -mca; --prtemca in Open MPI 5).
MCA_DENIED = ("plm_rsh_", "plm_ssh_", "orte_default_hostfile", "prte_default_hostfile")
MCA_FLAGS = ("mca", "gmca", "prtemca", "pmixmca")


def _mpirun_args(spec: dict) -> tuple[str, ...]:
    args = tuple((spec.get("mpirun") or {}).get("extraArgs") or ())
    if args and spec["launcher"] != "mpi":
        raise SpecError("spec.mpirun", "a torchrun job has no mpirun: remove spec.mpirun")
    check_mpirun_args(args)
    return args


def check_mpirun_args(args: tuple[str, ...]) -> None:
    """SpecError naming spec.mpirun.extraArgs[i] for a flag that would break the gang."""
    for i, arg in enumerate(args):
        flag = arg.lstrip("-").split("=", 1)[0]
        if not arg.startswith("-"):
            continue
        for what, flags in MPIRUN_DENIED.items():
            if flag in flags:
                raise SpecError(f"spec.mpirun.extraArgs[{i}]", f"{arg} would change {what}: remove "
                                f"it (spec.mpirun.command replaces the whole launcher command)")
        if flag in MCA_FLAGS and i + 1 < len(args) and args[i + 1].startswith(MCA_DENIED):
            raise SpecError(f"spec.mpirun.extraArgs[{i + 1}]", f"{args[i + 1]} is the operator's "
                            f"(the ssh transport or the hostfile): remove it")


def _launcher_command(spec: dict) -> tuple[str, ...] | None:
    mpirun = spec.get("mpirun") or {}
    if mpirun and spec["launcher"] != "mpi":
        raise SpecError("spec.mpirun", "a torchrun job has no launcher pod: remove spec.mpirun")
    return tuple(mpirun["command"]) if mpirun.get("command") else None


def _launcher_as_worker(spec: dict) -> bool:
    """spec.mpirun.runLauncherAsWorker: the launcher pod is also the last rank host."""
    mpirun = spec.get("mpirun") or {}
    if not mpirun.get("runLauncherAsWorker"):
        return False
    if mpirun.get("resources"):
        raise SpecError("spec.mpirun.resources", "a launcher that runs ranks gets what a worker "
                        "gets (spec.resources and gpusPerWorker): remove mpirun.resources")
    if (spec.get("preflight") or {}).get("enabled"):
        raise SpecError("spec.preflight.enabled", "the fabric check runs on the worker pods only, "
                        "not on a launcher that runs ranks: turn one of them off")
    if (spec.get("output") or {}).get("blob"):
        raise SpecError("spec.mpirun.runLauncherAsWorker", "rank 0 runs on the launcher, while "
                        "the log shipper uploads worker 0's output folder: use spec.output.pvc "
                        "(shared by every pod) or add a worker instead")
    return True


def _elastic(spec: dict) -> Elastic | None:
    """spec.elastic, checked. spec.workers is the largest size: it is what quota and Kueue
    admit and what the CRD freezes once admitted, so maxWorkers may only repeat it."""
    raw = spec.get("elastic")
    if raw is None:
        return None
    workers, low = spec["workers"], raw["minWorkers"]
    high = raw.get("maxWorkers", workers)
    if high != workers:
        raise SpecError("spec.elastic.maxWorkers", f"{high} differs from spec.workers ({workers}), "
                        f"the largest size the gang is admitted with: set spec.workers: {high} "
                        f"and leave maxWorkers out (it defaults to spec.workers)")
    if low > high:
        raise SpecError("spec.elastic.minWorkers", f"{low} is more than maxWorkers ({high}): "
                        f"use at most {high}")
    smaller = [size for size in range(1, high) if high % size == 0]
    if low < high and not any(size >= low for size in smaller):
        raise SpecError("spec.elastic.minWorkers", f"no size from {low} to {high - 1} divides "
                        f"maxWorkers ({high}), so the gang could never shrink: the trainer "
                        f"shares each global batch evenly among the ranks, in {high} parts per "
                        f"rank of a full gang; use minWorkers: {smaller[-1]} (the sizes: "
                        f"{', '.join(map(str, smaller + [high]))})")
    if (spec.get("mpirun") or {}).get("runLauncherAsWorker"):
        raise SpecError("spec.elastic", "a launcher that runs ranks is one rank host the gang can "
                        "never shed: remove spec.mpirun.runLauncherAsWorker (add a worker instead) "
                        "or spec.elastic")
    if not _checkpoint_enabled(spec):
        raise SpecError("spec.elastic", "a resize restarts the gang from its last checkpoint: "
                        "set spec.checkpoint (a volume claim) or spec.output")
    if raw["growAtCheckpoint"] and not spec.get("output"):
        raise SpecError("spec.elastic.growAtCheckpoint", "the operator learns of a new checkpoint "
                        "from worker 0's log shipper, which runs with spec.output only: set "
                        "spec.output, or growAtCheckpoint: false (the ranks save on SIGTERM)")
    return Elastic(min_workers=low, max_workers=high,
                   shrink_after_seconds=raw["shrinkAfterSeconds"],
                   grow_at_checkpoint=raw["growAtCheckpoint"])


def _checkpoint_enabled(spec: dict) -> bool:
    ck = spec.get("checkpoint") or {}
    enabled = ck.get("enabled")
    return bool((ck.get("volume") or {}).get("claimName") or spec.get("output")) \
        if enabled is None else bool(enabled)


def _launcher_resources(spec: dict, cfg: Config) -> dict:
    resources = (spec.get("mpirun") or {}).get("resources")
    if not resources:
        return cfg.launcher_resources
    for which in ("requests", "limits"):
        for key in resources.get(which) or {}:
            if key not in WORKER_RESOURCES and not key.startswith("hugepages-"):
                raise SpecError(f"spec.mpirun.resources.{which}", f"{key!r} cannot be set here: "
                                f"only {', '.join(WORKER_RESOURCES)} and hugepages-<size>")
    return resources


# Where the operator mounts something itself: an image's ssh folder may not sit on or above them.
OPERATOR_MOUNTS = ("/etc/trainop", "/output", "/dev/shm", "/var/run/secrets")


def _ssh_mount_path(spec: dict, data_mount: str) -> str | None:
    path = (spec.get("ssh") or {}).get("mountPath")
    if path is None:
        return None
    if spec["launcher"] != "mpi":
        raise SpecError("spec.ssh", "a torchrun job uses no ssh: remove spec.ssh")
    clean = "/" + "/".join(p for p in path.split("/") if p not in ("", "."))
    if ".." in clean.split("/"):
        raise SpecError("spec.ssh.mountPath", f"{path!r}: write it without '..'")
    for taken in OPERATOR_MOUNTS + (data_mount,):
        if clean == taken or clean.startswith(taken + "/") or taken.startswith(clean.rstrip("/") + "/"):
            raise SpecError("spec.ssh.mountPath", f"{path!r} overlaps {taken}, where the operator "
                            f"mounts something itself: choose the image's ssh folder, e.g. "
                            f"/home/mpiuser/.ssh or /root/.ssh")
    return clean


def _pool_of(spec: dict, cfg: Config) -> NodePool | None:
    """The configured pool a job runs in (None for an explicit nodeSelector)."""
    pool_spec = spec.get("nodePool") or {}
    if "nodeSelector" in pool_spec:
        return None
    if "name" in pool_spec:
        return cfg.node_pools.get(pool_spec["name"])
    kind = "infiniband" if spec["infiniband"] else "gpu" if spec["gpusPerWorker"] else "cpu"
    return cfg.node_pools.get(cfg.default_node_pools.get(kind) or "")


def _preflight(spec: dict, cfg: Config) -> Preflight:
    raw = spec.get("preflight") or {}
    pool = _pool_of(spec, cfg)
    threshold = raw.get("minBusBandwidthGBps")
    if threshold is None:
        threshold = (pool.preflight_min_busbw if pool else None) or 0.0
    image = cfg.fabric.preflight_image or cfg.images.get("pytorch") or ""
    return Preflight(enabled=bool(raw.get("enabled")), min_busbw=float(threshold), image=image)


def _topology_file(spec: dict, cfg: Config) -> str | None:
    """NCCL's topology file for the pool's VM size (infiniband.topologyFiles), IB jobs only."""
    pool = _pool_of(spec, cfg)
    if not spec["infiniband"] or pool is None or not pool.instance_type:
        return None
    return cfg.fabric.topology_files.get(pool.instance_type)


# Parsing validates against the CRD's schema (milliseconds): a reconcile that runs on every watch
# event of a child parses each spec once. Keyed by the spec's text (uid and generation would
# do for objects from the API server, not for hand-made bodies in tests and `trainop local`),
# and the uid: a job re-created under its name must not get the old one's folders.


def parse_cached(body: dict, cfg: Config, memo: Memos | None = None) -> Job:
    """parse(), remembered in the controller's `memo` per spec and configuration (the same Job
    object for one generation of one job, which keeps the per-Job memos hitting); SpecError is
    not cached. Without a memo: parse()."""
    if memo is None:
        return parse(body, cfg)
    meta = body.get("metadata") or {}
    key = fastjson.canonical([meta.get("name"), meta.get("namespace"), meta.get("uid"),
                              body.get("apiVersion"), body.get("spec")])
    return memo.parsed.get(cfg, key, lambda: parse(body, cfg))


def node_matches(node: dict, selector: dict[str, str]) -> bool:
    labels = node["metadata"].get("labels") or {}
    return all(labels.get(k) == v for k, v in selector.items())


@dataclass(frozen=True)
class PoolTotals:
    """One resource over the nodes a selector matches."""
    nodes: int
    largest: int  # the largest node's allocatable (0 without nodes)
    total: int


class Nodes(tuple):
    """The pool nodes of one moment (the controller rebuilds it when a node event arrives),
    remembering its answers per (selector, resource): during a burst of new jobs every job asks
    the same few questions of hundreds of nodes (issue 30: 5 % of the operator's CPU at 500
    jobs). Immutable, so a remembered answer is never stale; plain lists are wrapped by
    `of()`."""

    @classmethod
    def of(cls, nodes) -> Nodes:
        return nodes if isinstance(nodes, Nodes) else cls(nodes)

    def totals(self, selector: dict[str, str], resource: str) -> PoolTotals:
        memo = self.__dict__.setdefault("_totals", {})  # a lost race recomputes the same value
        key = (tuple(sorted(selector.items())), resource)
        if key not in memo:
            sizes = [allocatable(n, resource) for n in self if node_matches(n, selector)]
            memo[key] = PoolTotals(len(sizes), max(sizes, default=0), sum(sizes))
        return memo[key]


def capacity_error(job: Job, nodes: list[dict]) -> SpecError | None:
    """A SpecError when no node of the job's pool could ever hold one worker; else None.
    An autoscaled pool is judged by the nodes it can have (config `gpusPerNode`, else its
    largest node present), not by the nodes present: at zero nodes it still fits."""
    pool, nodes = job.placement, Nodes.of(nodes)
    where = f"node pool {pool.pool!r}" if pool.pool else f"nodeSelector {pool.node_selector}"
    field = "spec.nodePool.name" if pool.pool else "spec.nodePool.nodeSelector"
    present = nodes.totals(pool.node_selector, pool.gpu_resource)
    if not present.nodes and not pool.autoscale:
        return NoMatchingNodes(field, f"no node matches {where}; check the selector or add "
                                      f"nodes to the pool")
    gpus = node_gpus(pool, present)
    if gpus is not None and job.gpus_per_worker > gpus:
        return SpecError("spec.gpusPerWorker", f"{job.gpus_per_worker} {pool.gpu_resource} per "
                         f"worker, but the largest node of {where} has {gpus}; use at most "
                         f"{gpus} and more workers")
    if job.infiniband and present.nodes and \
            nodes.totals(pool.node_selector, pool.rdma_resource).largest < 1:
        return SpecError("spec.infiniband", f"no node of {where} has {pool.rdma_resource}; "
                                            f"choose an InfiniBand pool or set infiniband: false")
    if pool.autoscale and gpus and job.gpus_per_worker:
        need = nodes_needed(job, gpus)
        if need > pool.autoscale.max_nodes:
            return SpecError("spec.workers", f"{job.workers} workers of {job.gpus_per_worker} GPUs "
                             f"need {need} nodes of {gpus} GPUs, but {where} grows to at most "
                             f"{pool.autoscale.max_nodes} (autoscale.maxNodes); use fewer workers")
    return None


def allocatable(node: dict, resource: str) -> int:
    """An extended resource's allocatable (GPUs, RDMA devices): Kubernetes allows only whole
    numbers for them."""
    return int((node.get("status", {}).get("allocatable") or {}).get(resource, 0) or 0)


def node_gpus(pool: Placement, present: PoolTotals) -> int | None:
    """GPUs of one node of the pool: the configured VM size's, else the largest node present;
    None when unknown (an autoscaled pool at zero nodes without gpusPerNode)."""
    if pool.gpus_per_node is not None:
        return pool.gpus_per_node
    return present.largest if present.nodes else None


def nodes_needed(job: Job, gpus_per_node: int) -> int:
    """Nodes the gang's workers fill, packed by the scheduler (whole workers per node)."""
    per_node = max(gpus_per_node // max(job.gpus_per_worker, 1), 1)
    return -(-job.workers // per_node)


# ---- DataStage ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class Stage:
    """A DataStage's spec, defaulted and checked."""
    name: str
    namespace: str
    uid: str | None  # metadata.uid (None only in renderer tests of a body never stored)
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


def parse_stage(obj: dict) -> Stage:
    """The DataStage as a Stage. The CRD schema already rejected what it can; this checks the
    rest (URL shape, auth block) and fills defaults from the same schema. What the admin allows
    (endpoints, exports) is stagesync's to judge, with the configuration."""
    _check_size(obj, "split the data set into several DataStages")
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
        name=meta["name"], namespace=meta["namespace"], uid=meta.get("uid"), account_url=url, container=src["container"],
        prefixes=prefixes, auth=auth,
        nfs_server=nfs["server"] if nfs else None, nfs_path=nfs["path"] if nfs else "/",
        capacity=nfs["capacity"] if nfs else (provision or {}).get("size", ""),
        storage_class=(provision or {}).get("storageClassName"),
        mount_options=tuple(dest.get("mountOptions") or ()),
        extract=bool(spec.get("extract")), verify=bool(spec.get("verify")),
        concurrency=copy["concurrency"], range_concurrency=copy["rangeConcurrency"],
        backoff_limit=copy["backoffLimit"], existing_claim=(claim or {}).get("claimName"),
        spec_digest=hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:8])
