"""Logs and results that outlive pods: what a DistributedTrainingJob's pods need so that their
output reaches `spec.output`. Pure: spec in, manifest fragments out.

The DTJ renderer calls `pod_parts(...)` for each pod it renders and merges the result:

    parts = logship.pod_parts(job, "worker", 0, attempt, command, cfg.section("logship"),
                              output_mount={"name": "output", "mountPath": "/output"})
    pod["spec"]["initContainers"] = parts.init_containers      # the native sidecar
    pod["spec"]["volumes"] += parts.volumes
    main["volumeMounts"] += parts.mounts; main["env"] += parts.env; main["command"] = parts.command
    pod["metadata"]["labels"] |= parts.labels
    pod["spec"]["serviceAccountName"]  (when not None); drain_seconds: render/dtj.py grace_seconds

applies `rbac(job, cfg)` and creates `progress_config_map(job, cfg)` once per job, puts
`status_urls(job, attempt, cfg)` into the status, and copies `progress_metrics(config_map)` into
`status.metrics` (and what progress.py derives from it into `status.progress`) for display only.

Blob output: the training container tees stdout+stderr into LOG_FILE on an emptyDir shared with
the `logship` native sidecar (`python -m trainop.logship`), which appends it to
`<prefix>/<namespace>/<job>-<uid8>/<attempt>/<pod>.log` (job_path). Worker 0 (where rank 0 runs: first in the MPI hostfile,
node rank 0 for torchrun) also uploads the trainer's output dir to `.../<attempt>/output/` and
reports its metrics into the job's progress ConfigMap (`<job>-progress`). PVC output: the tee
writes straight onto the claim, under `logs/<job>/<attempt>/<pod>.log`, and the trainer's output
is on the claim already; worker 0's sidecar only reports the metrics and checkpoints.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

from trainop.render import common, identity
from trainop.resume import Resume
from trainop.spec import Job, Output, own_name

SIDECAR = "logship"
VOLUME = "trainop-run"  # the log folder: an emptyDir shared with the sidecar, or the output claim
RUN_DIR = "/var/trainop"
LOG_FILE = f"{RUN_DIR}/train.log"  # Blob output: the file the sidecar ships
METRICS_NAME = "metrics.jsonl"  # the trainer's --metrics-file, inside its --output-dir
# The keys of the trainer's metrics contract (docs/DEVELOPING.md); nothing else reaches the status.
METRIC_KEYS = ("epoch", "step", "loss", "imagesPerSec", "imagesPerSecPerGPU", "stepTime", "worldSize", "final",
               "totalSteps", "time", "badSamples")
# The string-valued keys and every value each may have: the network NCCL chose (the trainer's
# nccl.py; jobsync sets condition Transport from it).
METRIC_WORDS = {"transport": ("IB", "Socket")}
PROGRESS_KEY = "metrics"  # the progress ConfigMap's key of the latest report, as JSON
# Its key of the last HISTORY_SAMPLES reports' throughput, `[[time, step, imagesPerSec], ...]`
# oldest first (JSON): what `trainop describe` draws. Read by the CLI only, never by the operator.
HISTORY_KEY = "history"
HISTORY_SAMPLES = 60
PROGRESS_ROLE = "progress"  # its trainop.io/role label
# The reporting sidecar's API token: projected into that one container (every job pod sets
# automountServiceAccountToken: false, so the training container gets none), with the API
# server as audience, at the path in-cluster clients read, for the shortest lifetime the API
# server accepts; the kubelet renews it at 80% and the client re-reads it every minute.
API_TOKEN_VOLUME = "trainop-api-token"
API_TOKEN_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
API_TOKEN_SECONDS = 600
DEFAULTS = {
    "image": "trainop/operator:0.1.0",  # the sidecar runs the operator's own package
    "intervalSeconds": 2,
    "metricsIntervalSeconds": 15,  # status.metrics is patched at most this often
    "shipWorkerLogs": False,  # True: every worker ships its log; False: only worker 0 (rank 0)
    # Shipping streams 4 MiB blocks: ~60 MiB RSS whatever the log's size (bench/logship_rss.py).
    "resources": {"requests": {"cpu": "50m", "memory": "96Mi"}, "limits": {"memory": "256Mi"}},
    # Seconds the sidecar keeps retrying its final flush and output upload after SIGTERM; the
    # pod's grace period is this plus the ranks' share (render/dtj.py grace_seconds).
    "drainSeconds": 300,
}

# The training container's wrapper: stdout+stderr go both to the container's own stream (what
# `kubectl logs` shows) and, byte for byte the same, to LOG_FILE. A fifo instead of a pipeline
# keeps the shell as PID 1 with the command's exit status, and forwards SIGTERM to the command;
# `tee -a` only appends, so the file only grows (the shipper's resume relies on that).
TEE_SCRIPT = """\
log="$1"; shift
mkdir -p "${log%/*}"
fifo="$log.fifo"; rm -f "$fifo"; mkfifo "$fifo"
tee -a "$log" < "$fifo" & tee_pid=$!
"$@" > "$fifo" 2>&1 & pid=$!
trap 'kill -TERM "$pid" 2>/dev/null' TERM INT
wait "$pid"; rc=$?
while kill -0 "$pid" 2>/dev/null; do wait "$pid"; rc=$?; done
wait "$tee_pid"; rm -f "$fifo"
exit "$rc"
"""


def job_path(prefix: str, namespace: str, name: str, uid: str | None) -> str:
    """`<prefix>/<namespace>/<job>-<uid8>`: the blob folder of one job, its attempts inside. The
    namespace and the uid keep it apart from a job of the same name in another namespace, or an
    earlier one here, writing the same container: neither appends to its logs, nor is one
    resumed from the other's checkpoints (resume.py accepts only this folder)."""
    return "/".join(p for p in (prefix.strip("/"), namespace, own_name(name, uid)) if p)


def job_folder(job: Job) -> str:
    return job_path(job.output.prefix, job.namespace, job.name, job.uid)


def run_path(folder: str, attempt: int) -> str:
    """`<job folder>/<attempt>`: the blob folder of one attempt (also what `trainop logs` reads)."""
    return f"{folder}/{attempt}"


def status_urls(job: Job, attempt: int, cfg: dict) -> dict[str, str]:
    """`logsURL` and `outputURL` for the job's status (empty without output). No credential:
    the URL is the account endpoint, never a SAS."""
    out = job.output
    if out is None:
        return {}
    if out.claim is not None:
        return {"logsURL": f"pvc://{out.claim}/logs/{job.name}/{attempt}/", "outputURL": f"pvc://{out.claim}/"}
    base = f"{out.account_url}/{out.container}/{run_path(job_folder(job), attempt)}/"
    return {"logsURL": base, "outputURL": f"{base}output/"}


def service_account_name(job: Job, out: Output) -> str:
    """The identity of pods that ship: the federated ServiceAccount for workload identity (the
    webhook can only federate the pod's own account), else a per-job one (created by `rbac`).
    Either way only the sidecar holds a credential of it (`pod_parts`)."""
    return (out.auth.service_account_name if out.auth else None) or f"{job.name}-{SIDECAR}"


def progress_name(job: Job) -> str:
    return f"{job.name}-progress"


def progress_config_map(job: Job, cfg: dict) -> dict | None:
    """Where worker 0's sidecar reports the trainer's metrics (None without spec.output: no
    sidecar). Created empty by the operator, owned by the job; the sidecar may only patch this
    one object (it never reads it).

    Why a separate object and not the job's status: RBAC cannot limit a writer of the status
    subresource to some of its keys, so a sidecar allowed to write `status.metrics` could also
    write `phase`, `cleanedUp` or `restarts`, which the operator acts on. The operator reads
    this ConfigMap only to copy its metrics into `status.metrics` for display
    (`progress_metrics`), never to decide anything."""
    if job.output is None:
        return None
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": common.metadata(progress_name(job), job.namespace,
                                        common.labels(job.name, PROGRESS_ROLE)),
            "data": {}}


def safe_metrics(obj: dict) -> dict:
    """The contract's keys of a metrics report, each a bool or a number (or one of the words
    METRIC_WORDS allows); NaN and infinities
    become the strings "NaN", "Infinity", "-Infinity" (JSON has no literal for them, and one
    NaN would make the whole patch invalid JSON)."""
    out: dict = {}
    for key in METRIC_KEYS:
        value = obj.get(key)
        if isinstance(value, bool) or (isinstance(value, int) and abs(value) < 2 ** 63):
            out[key] = value
        elif isinstance(value, float):
            out[key] = value if math.isfinite(value) else \
                "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
        elif value in ("NaN", "Infinity", "-Infinity"):
            out[key] = value
    for key, words in METRIC_WORDS.items():
        if obj.get(key) in words:
            out[key] = obj[key]
    return out


def progress_metrics(config_map: dict | None) -> dict | None:
    """What the progress ConfigMap says, checked as untrusted input (training code decides what
    the trainer's metrics file holds): only the contract's keys, numbers or bools; None when it
    holds nothing usable."""
    text = ((config_map or {}).get("data") or {}).get(PROGRESS_KEY)
    if not text or len(text) > 4096:
        return None
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    return (safe_metrics(obj) or None) if isinstance(obj, dict) else None


def history_samples(reports: list[dict]) -> list[list[float]]:
    """`[time, step, imagesPerSec]` of the last HISTORY_SAMPLES per-epoch reports (the final one
    averages the run, so it is left out), only finite non-negative numbers."""
    out = []
    for r in reports:
        sample = [r.get("time"), r.get("step"), r.get("imagesPerSec")]
        if not r.get("final") and all(_finite(v) and v >= 0 for v in sample):
            out.append(sample)
    return out[-HISTORY_SAMPLES:]


def progress_history(config_map: dict | None) -> list[list[float]]:
    """The progress ConfigMap's history, checked as untrusted input like `progress_metrics`:
    samples that are not three finite non-negative numbers are dropped, at most HISTORY_SAMPLES."""
    text = ((config_map or {}).get("data") or {}).get(HISTORY_KEY)
    if not text or len(text) > 64 * HISTORY_SAMPLES:
        return []
    try:
        obj = json.loads(text)
    except ValueError:
        return []
    if not isinstance(obj, list):
        return []
    return [list(s) for s in obj if isinstance(s, list) and len(s) == 3
            and all(_finite(v) and v >= 0 for v in s)][-HISTORY_SAMPLES:]


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True)
class PodParts:
    command: list[str]
    init_containers: list[dict] = field(default_factory=list)
    volumes: list[dict] = field(default_factory=list)
    mounts: list[dict] = field(default_factory=list)  # for the training container
    env: list[dict] = field(default_factory=list)  # for the training container
    labels: dict[str, str] = field(default_factory=dict)
    annotations: dict[str, str] = field(default_factory=dict)
    service_account_name: str | None = None
    # The sidecar's share of the pod's grace period: it drains after the training container
    # ended (render/dtj.py grace_seconds adds the ranks' share)
    drain_seconds: int | None = None


def pod_parts(job: Job, role: str, index: int | None, attempt: int, command: list[str], cfg: dict,
              output_mount: dict | None = None, resume: Resume | None = None) -> PodParts | None:
    """What the pod of `role` (launcher | worker) / `index` needs; `command` is the training
    container's full command line, `output_mount` the training container's volumeMount of the
    trainer's --output-dir (worker 0's sidecar uploads it and reports its metrics.jsonl). None
    when the pod does not ship (no output, or a worker other than 0 without shipWorkerLogs).
    The training container is named `role` (render/dtj.py): with workload identity it is kept
    out of the webhook's token injection, so only the sidecar can act as the identity.
    `resume` (resume.plan): with a blob folder to fetch, worker 0 gets an init container that
    downloads it into the shared emptyDir before training starts."""
    cfg = {**DEFAULTS, **cfg}
    out = job.output
    primary = role == "worker" and index == 0
    if out is None or (role == "worker" and not primary and not cfg["shipWorkerLogs"]):
        return None
    if out.claim is not None:
        claim = {"command": _tee(f"{RUN_DIR}/logs/{job.name}/{attempt}/$(POD_NAME).log", command),
                 "mounts": [{"name": VOLUME, "mountPath": RUN_DIR}], "env": _field_env()[:1]}
        volume = {"name": VOLUME, "persistentVolumeClaim": {"claimName": out.claim}}
        if not (primary and output_mount is not None):
            return PodParts(volumes=[volume], **claim)
        return PodParts(  # nothing to ship: worker 0's sidecar only reports
            init_containers=[_reporter(job, attempt, cfg, output_mount)], volumes=[volume, _api_token_volume()],
            service_account_name=service_account_name(job, out),
            drain_seconds=int(cfg["drainSeconds"]), **claim)
    shared = {"name": VOLUME, "mountPath": RUN_DIR}
    reports = primary and output_mount is not None
    init = [_sidecar(job, attempt, out, cfg, shared, output_mount if primary else None)]
    if primary and resume is not None and resume.fetch:
        init.append(_fetcher(out, cfg, shared, resume))
    return PodParts(
        command=_tee(LOG_FILE, command),
        init_containers=init,
        volumes=[common.scratch_volume(VOLUME, job.empty_dir_size_limit)] + ([_api_token_volume()] if reports else []),
        mounts=[shared],
        labels=out.auth.pod_labels(),
        annotations=out.auth.pod_annotations([role]),
        service_account_name=service_account_name(job, out),
        drain_seconds=int(cfg["drainSeconds"]),
    )


def _tee(log_file: str, command: list[str]) -> list[str]:
    return ["/bin/sh", "-c", TEE_SCRIPT, "trainop-tee", log_file, *command]


def _field_env() -> list[dict]:
    """POD_NAME (names the log blob, expanded as $(POD_NAME) in args), POD_NAMESPACE, POD_UID."""
    return [{"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}
            for name, path in (("POD_NAME", "metadata.name"), ("POD_NAMESPACE", "metadata.namespace"),
                               ("POD_UID", "metadata.uid"))]


def _api_token_volume() -> dict:
    """What the kubelet's own kube-api-access volume holds (token, ca.crt, namespace), for the
    reporting sidecar alone (API_TOKEN_DIR)."""
    return {"name": API_TOKEN_VOLUME, "projected": {"sources": [
        {"serviceAccountToken": {"path": "token", "expirationSeconds": API_TOKEN_SECONDS}},
        {"configMap": {"name": "kube-root-ca.crt", "items": [{"key": "ca.crt", "path": "ca.crt"}]}},
        {"downwardAPI": {"items": [{"path": "namespace",
                                    "fieldRef": {"apiVersion": "v1", "fieldPath": "metadata.namespace"}}]}}]}}


def _sidecar(job: Job, attempt: int, out: Output, cfg: dict, shared: dict, output_mount: dict | None) -> dict:
    args = ["--account-url", out.account_url, "--container", out.container,
            "--dest", run_path(job_folder(job), attempt), "--file", f"{LOG_FILE}=$(POD_NAME).log",
            *_timing(cfg)]
    mounts = [dict(shared)]
    if output_mount:
        args += ["--output-dir", output_mount["mountPath"]]
        more_args, more_mounts = _reporting(job, attempt, cfg, output_mount, upload=True)
        args, mounts = args + more_args, mounts + more_mounts
    return _container(cfg, args, _field_env() + out.auth.container_env(), mounts)


def _reporter(job: Job, attempt: int, cfg: dict, output_mount: dict) -> dict:
    """Worker 0's sidecar when the output is a claim: the logs and the output are on the claim
    already, so it only reports the metrics and the checkpoints (no storage credential)."""
    args, mounts = _reporting(job, attempt, cfg, output_mount, upload=False)
    return _container(cfg, [*_timing(cfg), *args], _field_env(), mounts)


def _reporting(job: Job, attempt: int, cfg: dict, output_mount: dict, upload: bool) -> tuple[list[str], list[dict]]:
    """The sidecar's arguments and mounts that report the trainer's metrics (and, with
    spec.checkpoint, each completed checkpoint: uploaded first when `upload` and the checkpoints
    are not on a claim) into the progress ConfigMap."""
    output_dir = output_mount["mountPath"]
    args = ["--metrics-file", f"{output_dir}/{METRICS_NAME}", "--progress", progress_name(job),
            "--metrics-interval", str(cfg["metricsIntervalSeconds"])]
    mounts = [{**output_mount, "readOnly": True},
              {"name": API_TOKEN_VOLUME, "mountPath": API_TOKEN_DIR, "readOnly": True}]
    ck = job.checkpoint
    if ck is not None:
        args += ["--checkpoint-dir", ck.attempt_dir(attempt)]
        if upload and not ck.on_claim:
            args += ["--checkpoint-upload"]
        if ck.claim:  # the checkpoint volume, to see the trainer's folders (render/dtj.py)
            mounts.append({"name": "checkpoints", "mountPath": "/checkpoints", "readOnly": True})
    return args, mounts


def _timing(cfg: dict) -> list[str]:
    return ["--interval", str(cfg["intervalSeconds"]), "--drain-timeout", str(cfg["drainSeconds"])]


def _container(cfg: dict, args: list[str], env: list[dict], mounts: list[dict]) -> dict:
    return {
        "name": SIDECAR,
        "image": cfg["image"],
        # Native sidecar: started before, stopped after the training container. Kubernetes >= 1.29
        # (every AKS version in support); older API servers reject restartPolicy here.
        "restartPolicy": "Always",
        "command": ["python", "-m", "trainop.logship"],
        "args": args,
        "env": env,
        "volumeMounts": mounts,
        "resources": cfg["resources"],
        # runs as the pod's (the job's) user, so it reads whatever the trainer wrote
        "securityContext": common.container_security_context(),
    }


def _fetcher(out: Output, cfg: dict, shared: dict, resume: Resume) -> dict:
    """An init container that downloads the checkpoint to resume from (a blob folder under this
    job's prefix, resume.accept checked it) into the shared emptyDir, COMPLETE last."""
    return {
        "name": "fetch-checkpoint",
        "image": cfg["image"],
        "command": ["python", "-m", "trainop.logship"],
        "args": ["--account-url", out.account_url, "--container", out.container,
                 "--fetch", resume.fetch, "--fetch-to", resume.resume_from],
        "env": _field_env() + out.auth.container_env(),
        "volumeMounts": [dict(shared)],
        "resources": cfg["resources"],
        "securityContext": common.container_security_context(),
    }


def rbac(job: Job, cfg: dict) -> list[dict]:
    """The identity through which worker 0's sidecar reports metrics: a Role that may only
    patch the job's progress ConfigMap (`progress_config_map`), bound to the shipping pods'
    ServiceAccount (created here, without automounted token, unless it is the federated
    workload-identity one, which the user owns).

    Why this path: the pod already runs next to the metrics file, so it reports them itself; the
    operator needs no access to the job's storage account (which, with workload identity, it
    could not get without holding a broad identity of its own), and the credential cannot read
    or change the job, its status, any pod or any other object."""
    out = job.output
    if out is None:
        return []
    return identity.objects(
        f"{job.name}-{SIDECAR}", job.namespace, common.labels(job.name),
        [identity.rule("", "configmaps", progress_name(job), ["patch"])],
        account=service_account_name(job, out), automount=False)
