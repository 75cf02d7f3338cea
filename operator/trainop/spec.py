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
from dataclasses import dataclass

from trainop import blob, crds
from trainop.config import Config, NodePool

KIND = "DistributedTrainingJob"


class SpecError(ValueError):
    """Bad input: `field` names it, the message says what to change."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


@dataclass(frozen=True)
class Placement:
    node_selector: dict[str, str]
    tolerations: tuple[dict, ...]
    pool: str | None  # name in the operator's config, None for an explicit nodeSelector
    gpu_resource: str
    rdma_resource: str


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


@dataclass(frozen=True)
class SecurityContext:
    """`spec.securityContext`: the non-root user of every pod (the schema forbids uid 0)."""
    run_as_user: int
    run_as_group: int
    fs_group: int


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


def _checkpoint(spec: dict, name: str, uid: str | None) -> Checkpoint | None:
    ck = spec.get("checkpoint") or {}
    claim = (ck.get("volume") or {}).get("claimName")
    output = spec.get("output") or {}
    enabled = ck.get("enabled")
    if enabled is None:
        enabled = bool(claim or output) and spec["framework"] == "pytorch"
    if not enabled:
        return None
    if spec["framework"] != "pytorch":
        raise SpecError("spec.checkpoint.enabled", f"resuming from checkpoints is implemented for "
                        f"framework pytorch, not {spec['framework']}; set enabled: false")
    if not (claim or output):
        raise SpecError("spec.checkpoint.enabled", "checkpoints need a place that outlives the pods; "
                        "set spec.checkpoint.volume.claimName or spec.output")
    # On a claim, the job's uid is in the folder's name: a later job of the same name on the
    # same claim never resumes from this one's checkpoints. Blob output needs none: its folder
    # is shipped per attempt and the operator names the exact checkpoint (resume.py).
    own = name + (f"-{uid[:8]}" if uid else "")
    if claim:
        return Checkpoint(ck["everySteps"], f"{CHECKPOINT_VOLUME_MOUNT}/{own}", claim, on_claim=True)
    if "pvc" in output:
        return Checkpoint(ck["everySteps"], f"/output/checkpoints/{own}", on_claim=True)
    return Checkpoint(ck["everySteps"], "/output/checkpoints")


@dataclass(frozen=True)
class Job:
    name: str
    namespace: str
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
    launcher_resources: dict
    logship: dict  # the operator's `logship` configuration section (render/logship.py)
    security: SecurityContext
    priority_class_name: str | None = None  # spec.priorityClassName (priority.py resolves it)
    pod_priority_class: str | None = None   # the pods' priorityClassName, set by priority.bind
    checkpoint: Checkpoint | None = None    # spec.checkpoint, resolved (None: off)

    @property
    def total_gpus(self) -> int:
        return self.workers * self.gpus_per_worker

    @property
    def total_slots(self) -> int:
        return self.workers * self.slots_per_worker


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
    if spec["infiniband"] and not pool.infiniband:
        raise SpecError("spec.infiniband", f"node pool {name!r} has no InfiniBand; choose a pool "
                        f"with InfiniBand ({', '.join(sorted(p.name for p in cfg.node_pools.values() if p.infiniband)) or 'none configured'}) "
                        f"or set infiniband: false")
    return Placement(node_selector=dict(pool.node_selector), tolerations=tuple(pool.tolerations),
                     pool=pool.name, gpu_resource=pool.gpu_resource,
                     rdma_resource=pool.rdma_resource)


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


def _output(output: dict | None, cfg: Config) -> Output | None:
    out = parse_output(output, cfg.section("logship").get("workloadIdentityServiceAccount"))
    if out is not None and out.account_url:  # the shipper's credential goes there
        try:
            blob.check_endpoint_allowed(out.account_url, "spec.output.blob.accountURL",
                                        cfg.allowed_account_urls)
        except blob.BlobConfigError as exc:
            raise SpecError(*str(exc).split(": ", 1)) from None
    return out


def parse(body: dict, cfg: Config) -> Job:
    """The job as a typed value; SpecError for input only the operator can judge."""
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
    gpus = spec["gpusPerWorker"]
    total = spec["workers"] * gpus
    if cfg.max_gpus_per_job is not None and total > cfg.max_gpus_per_job:
        raise SpecError("spec.gpusPerWorker", f"the job needs {total} GPUs ({spec['workers']} "
                        f"workers x {gpus}); this cluster allows at most {cfg.max_gpus_per_job} "
                        f"per job: reduce workers or gpusPerWorker")
    data, train, run, output = spec["data"], spec["training"], spec["runPolicy"], spec.get("output")
    user = spec["securityContext"]
    return Job(
        name=meta["name"], namespace=meta.get("namespace", "default"),
        framework=spec["framework"], launcher=spec["launcher"], image=image,
        image_pull_policy=spec.get("imagePullPolicy"),
        command=tuple(spec["command"]) if spec.get("command") else None,
        args=tuple(spec["args"]) if "args" in spec else None,
        env=tuple(spec.get("env") or ()), workers=spec["workers"], gpus_per_worker=gpus,
        slots_per_worker=spec.get("slotsPerWorker") or max(gpus, 1),
        mpi_implementation=spec["mpiImplementation"], resources=spec.get("resources") or {},
        shm_size=str(spec["shmSize"]), placement=_placement(spec, cfg),
        infiniband=spec["infiniband"],
        data_stage=(data.get("dataStageRef") or {}).get("name"),
        synthetic=bool(data.get("synthetic")), data_mount_path=data["mountPath"],
        training=Training(batch_size=train["batchSize"], epochs=train["epochs"],
                          steps_per_epoch=train.get("stepsPerEpoch"),
                          image_size=train.get("imageSize"), precision=train["precision"],
                          channels_last=train["channelsLast"], compile=train["compile"]),
        output=_output(output, cfg),
        run_policy=RunPolicy(backoff_limit=run["backoffLimit"],
                             active_deadline_seconds=run.get("activeDeadlineSeconds"),
                             ttl_seconds_after_finished=run.get("ttlSecondsAfterFinished"),
                             clean_pod_policy=run["cleanPodPolicy"], suspend=run["suspend"]),
        launcher_resources=cfg.launcher_resources, logship=cfg.section("logship"),
        security=SecurityContext(run_as_user=user["runAsUser"], run_as_group=user["runAsGroup"],
                                 fs_group=user.get("fsGroup", user["runAsGroup"])),
        priority_class_name=spec.get("priorityClassName"),
        checkpoint=_checkpoint(spec, meta["name"], meta.get("uid")),
    )


# Parsing validates against the CRD's schema (milliseconds): a reconcile that runs on every watch
# event of a child parses each spec once. Keyed by the spec's text (uid and generation would
# do for objects from the API server, not for hand-made bodies in tests and `trainop local`).
_PARSED: dict[str, tuple[Config, Job]] = {}
_PARSED_MAX = 4096


def parse_cached(body: dict, cfg: Config) -> Job:
    """parse(), remembered per spec and configuration; SpecError is not cached."""
    meta = body.get("metadata") or {}
    key = json.dumps([meta.get("name"), meta.get("namespace"), body.get("apiVersion"),
                      body.get("spec")], sort_keys=True, default=str)
    hit = _PARSED.get(key)
    if hit is not None and hit[0] is cfg:
        return hit[1]
    job = parse(body, cfg)
    if len(_PARSED) >= _PARSED_MAX:
        _PARSED.pop(next(iter(_PARSED)))  # oldest first: dicts keep insertion order
    _PARSED[key] = (cfg, job)
    return job


def _node_matches(node: dict, selector: dict[str, str]) -> bool:
    labels = node["metadata"].get("labels") or {}
    return all(labels.get(k) == v for k, v in selector.items())


def capacity_error(job: Job, nodes: list[dict]) -> SpecError | None:
    """A SpecError when no node of the job's pool could ever hold one worker; else None."""
    pool = job.placement
    where = f"node pool {pool.pool!r}" if pool.pool else f"nodeSelector {pool.node_selector}"
    field = "spec.nodePool.name" if pool.pool else "spec.nodePool.nodeSelector"
    matching = [n for n in nodes if _node_matches(n, pool.node_selector)]
    if not matching:
        return SpecError(field, f"no node matches {where}; check the selector or add nodes to "
                                f"the pool")

    def most(resource: str) -> int:
        return max(int((n.get("status", {}).get("allocatable") or {}).get(resource, 0) or 0)
                   for n in matching)

    if job.gpus_per_worker > (gpus := most(pool.gpu_resource)):
        return SpecError("spec.gpusPerWorker", f"{job.gpus_per_worker} {pool.gpu_resource} per "
                         f"worker, but the largest node of {where} has {gpus}; use at most "
                         f"{gpus} and more workers")
    if job.infiniband and most(pool.rdma_resource) < 1:
        return SpecError("spec.infiniband", f"no node of {where} has {pool.rdma_resource}; "
                                            f"choose an InfiniBand pool or set infiniband: false")
    return None


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
