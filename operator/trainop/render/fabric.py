"""InfiniBand pod shaping and the preflight fabric check: what render/dtj.py merges into the pods
of a job with `infiniband: true` or `spec.preflight.enabled`. Pure: a parsed spec.Job in, dicts
out. The operator's `infiniband` and `preflight` configuration sections arrive as `job.fabric`.

    script = fabric.memlock_preamble(job) + script             # workers' and launcher's shell
    fabric.shape_pod(job, pod_spec, role, index, master)        # IB parts, preflight container
    service["spec"] |= fabric.service_fields(job)               # DNS during the preflight

InfiniBand (docs/security.md, "InfiniBand"):
- memlock: RDMA registers (pins) memory. The ranks get the container's RLIMIT_MEMLOCK, which
  the node's containerd passes on from its own service limit; Kubernetes has no field for it.
  The training shell raises its soft limit to the hard one (allowed without any capability)
  and warns, naming the fix, when that is not unlimited.
- IPC_LOCK (`infiniband.ipcLock`, off by default): added to the training containers. It lets a
  process pin memory past RLIMIT_MEMLOCK, but only a process whose effective set holds it: a
  non-root process (every trainop pod is non-root) loses it at exec, because Kubernetes sets
  no ambient capabilities. It also needs a namespace whose Pod Security level is privileged.
- NCCL_TOPO_FILE for the pool's VM size, read from the node (a read-only hostPath of that one
  file) or, with `infiniband.topologyFilesFrom: image`, from the training image (no mount, so
  no privileged namespace).
- One fabric: a required podAffinity keeps every worker of the job on one value of
  `infiniband.fabricTopologyKey` (on AKS the agent pool, one VM scale set: only VMs of one
  scale set share an InfiniBand fabric).

Preflight: an init container `preflight` in every worker runs `python -m
trainop_trainer.preflight` under torchrun with a static rendezvous on worker 0 (node rank =
worker index), so its ranks are the training ranks' GPUs on the training nodes, before sshd or
torchrun start. Worker 0's container writes its result as its termination message, which the
operator reads from the pod's status (trainop/preflight.py); no pod writes the job's status.
"""

from __future__ import annotations

import copy
import shlex

from trainop.render import common
from trainop.spec import Job

PREFLIGHT = "preflight"          # the init container's name
PREFLIGHT_PORT = 29401           # its rendezvous (the training rendezvous is 29400)
PREFLIGHT_EXIT_SLOW = 3          # every rank exits with this when the gang is below threshold
TERMINATION_LOG = "/dev/termination-log"
UNHEALTHY_TAINT = "trainop.io/unhealthy"
TOPOLOGY_VOLUME = "nccl-topology"
TRAINING_CONTAINERS = ("worker", "launcher")  # render/dtj.py's names; never the log shipper

# Runs before the training command in the shell of every worker and of the launcher.
MEMLOCK_PREAMBLE = """\
ulimit -S -l "$(ulimit -H -l)" 2>/dev/null || true
if [ "$(ulimit -l)" != unlimited ]; then
  echo "trainop: max locked memory is $(ulimit -l) KiB, not unlimited: RDMA memory registration \
may fail. Give the node's container runtime LimitMEMLOCK=infinity (docs/security.md)" >&2
fi
"""


def memlock_preamble(job: Job) -> str:
    """Shell lines that raise the memlock soft limit to the hard one on InfiniBand jobs; empty
    otherwise. sshd and torchrun start after it, from that shell, so every rank inherits the limit."""
    return MEMLOCK_PREAMBLE if job.infiniband else ""


def ib_env(job: Job) -> dict[str, str]:
    return {"NCCL_TOPO_FILE": job.topology_file} if job.infiniband and job.topology_file else {}


def _training_security(job: Job, ctx: dict | None = None) -> dict:
    """`ctx` (restricted's by default), with IPC_LOCK added where the admin asks for it."""
    ctx = copy.deepcopy(ctx) if ctx else common.container_security_context()
    if job.infiniband and job.fabric.ipc_lock:
        caps = ctx.setdefault("capabilities", {})  # (a root job keeps the runtime's defaults)
        caps["add"] = [*caps.get("add", []), "IPC_LOCK"]
    return ctx


def fabric_affinity(job: Job) -> dict:
    """Every worker on one value of the fabric label: the scheduler places the first worker
    anywhere the nodeSelector allows (a pod that matches its own affinity term may start a
    domain), and every later one where a worker of this job already is."""
    selector = {"matchLabels": {common.LABEL_JOB: job.name, common.LABEL_ROLE: "worker"}}
    return {"podAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [
        {"labelSelector": selector, "topologyKey": job.fabric.topology_key}]}}


def shape_pod(job: Job, pod_spec: dict, role: str, index: int | None = None,
              master: str = "") -> None:
    """Merge the InfiniBand parts and (workers) the preflight init container into `pod_spec`,
    after the log shipper's parts. The preflight shares the training container's environment
    and resources (the same GPUs and RDMA device: the kubelet hands the devices of an init
    container on to the containers after it, so the pod asks for no more). `master`: worker
    0's DNS name, where the preflight's rendezvous listens."""
    if job.infiniband:
        for container in pod_spec["containers"]:
            if container["name"] in TRAINING_CONTAINERS:
                container["securityContext"] = _training_security(job, container["securityContext"])
                container["env"] = container["env"] + common.env(ib_env(job))
        if _mounts_topology(job):
            pod_spec["volumes"] = pod_spec["volumes"] + [_topology_volume(job)]
            for container in pod_spec["containers"]:
                if container["name"] in TRAINING_CONTAINERS:
                    container["volumeMounts"] = container.get("volumeMounts", []) + \
                        [_topology_mount(job)]
        if role == "worker":
            pod_spec["affinity"] = fabric_affinity(job)
    if role == "worker" and job.preflight.enabled:
        main = pod_spec["containers"][0]
        pod_spec["initContainers"] = pod_spec.get("initContainers", []) + \
            [preflight_container(job, index or 0, master, main["env"], main.get("resources") or {})]


def _mounts_topology(job: Job) -> bool:
    return bool(job.infiniband and job.topology_file and job.fabric.topology_files_from == "node")


def _topology_volume(job: Job) -> dict:
    return {"name": TOPOLOGY_VOLUME, "hostPath": {"path": job.topology_file, "type": "File"}}


def _topology_mount(job: Job) -> dict:
    return {"name": TOPOLOGY_VOLUME, "mountPath": job.topology_file, "readOnly": True}


def preflight_args(job: Job) -> list[str]:
    f = job.fabric
    return ["--min-busbw", repr(job.preflight.min_busbw), "--size-mb", str(f.preflight_size_mb),
            "--iterations", str(f.preflight_iterations), "--workers", str(job.workers),
            "--result-file", TERMINATION_LOG, "--exit-code-slow", str(PREFLIGHT_EXIT_SLOW)]


def preflight_script(job: Job, index: int, master: str) -> str:
    """torchrun with a static rendezvous: node rank = worker index, so rank r runs on worker
    r // slotsPerWorker, the layout the operator maps pairs back to nodes with."""
    cmd = ["torchrun", f"--nnodes={job.workers}", f"--nproc-per-node={job.slots_per_worker}",
           f"--node-rank={index}", f"--master-addr={master}", f"--master-port={PREFLIGHT_PORT}",
           "--max-restarts=0", "-m", "trainop_trainer.preflight", *preflight_args(job)]
    wait = (f'deadline=$(($(date +%s) + 300)); until getent hosts {master} >/dev/null; do '
            f'[ "$(date +%s)" -lt "$deadline" ] || {{ echo "trainop: {master} does not resolve" '
            f'>&2; exit 1; }}; sleep 1; done')
    # torchrun exits 1 whatever code its ranks returned, so the container's code would not
    # say "below the threshold": the shell reads the verdict this worker's first process wrote
    # and exits with PREFLIGHT_EXIT_SLOW for it. SIGTERM (the pod deleted) goes on to torchrun.
    run = ['pid=""', """trap '[ -z "$pid" ] || kill -TERM "$pid" 2>/dev/null' TERM INT""",
           shlex.join(cmd) + " &", "pid=$!",
           'wait "$pid"; rc=$?',
           'while kill -0 "$pid" 2>/dev/null; do wait "$pid"; rc=$?; done',
           f"""if [ "$rc" -ne 0 ] && grep -q '"passed":false' {TERMINATION_LOG} 2>/dev/null; then """
           f"exit {PREFLIGHT_EXIT_SLOW}; fi",
           'exit "$rc"']
    return "\n".join(["set -eu", wait, "set +e", *run]) + "\n"


def preflight_container(job: Job, index: int, master: str, env: list[dict],
                        resources: dict) -> dict:
    out = {"name": PREFLIGHT, "image": job.preflight.image or job.image,
           "command": ["sh", "-c", preflight_script(job, index, master)],
           "env": list(env),
           "securityContext": _training_security(job),
           "volumeMounts": [{"name": "shm", "mountPath": "/dev/shm"}]
           + ([_topology_mount(job)] if _mounts_topology(job) else []),
           # The result is short JSON; File (the default) keeps what the program wrote.
           "terminationMessagePolicy": "File"}
    if job.image_pull_policy:
        out["imagePullPolicy"] = job.image_pull_policy
    if resources:
        out["resources"] = resources
    return out


def service_fields(job: Job) -> dict:
    """The preflight runs before any worker is Ready: worker 0's DNS name must resolve anyway
    (the launcher still waits for Ready workers; jobsync checks readiness itself)."""
    return {"publishNotReadyAddresses": True} if job.preflight.enabled else {}
