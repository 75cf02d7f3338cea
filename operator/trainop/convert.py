"""Translate a Kubeflow MPIJob (kubeflow.org/v2beta1), PyTorchJob or TFJob (kubeflow.org/v1) into
a DistributedTrainingJob.

    dtj, warnings = convert.convert(mpijob)        # ConvertError for a kind it cannot read

Pure: no API calls, no files. Every warning is "<source field>: <what became of it>", for each
field not carried over and each default that differs (docs/migrating.md has the whole map).
What the operator's spec check (spec.py, judged against `cfg`, the built-in configuration by
default) would refuse is left out with a warning, so that the output is a job the API server and
the operator accept; anything it still refuses is a warning too.
"""

from __future__ import annotations

import copy
import re
import shlex
from dataclasses import dataclass, field

from trainop import API_VERSION, config, spec
from trainop.config import Config

KIND = "DistributedTrainingJob"
GPU_RESOURCES = ("nvidia.com/gpu",)
# Names of the volumes the operator puts into a job's pods (render/dtj.py, render/logship.py): a
# user volume of that name is renamed, since a podTemplate may not reuse one.
RESERVED_VOLUMES = ("ssh", "mpi", "shm", "output", "data", "checkpoints", "logs", "trainop-run",
                    "trainop-api-token")
# The Kueue label a Kubeflow job is queued by; a DistributedTrainingJob names its queue in spec.queue.
KUEUE_QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
# Container fields the translation reads; any other one is reported as dropped.
READ_CONTAINER = {"name", "image", "imagePullPolicy", "command", "args", "env", "envFrom", "resources",
                  "volumeMounts", "securityContext"}
# Pod fields the translation reads; any other one is reported as dropped.
READ_POD = {"containers", "initContainers", "volumes", "nodeSelector", "tolerations", "affinity",
            "priorityClassName", "securityContext", "restartPolicy", "imagePullSecrets",
            "serviceAccountName", "serviceAccount", "hostNetwork", "hostPID", "hostIPC",
            "terminationGracePeriodSeconds"}


class ConvertError(ValueError):
    """Input that is not a job this module reads: one line saying what it got."""


@dataclass
class _Ctx:
    cfg: Config
    namespace: str
    warnings: list[str] = field(default_factory=list)

    def warn(self, where: str, message: str) -> None:
        self.warnings.append(f"{where}: {message}")


@dataclass
class _Role:
    """One replica spec of the source job, with its training container picked out."""
    name: str          # Launcher, Worker, Master, Chief, ...
    path: str          # spec.mpiReplicaSpecs.Worker
    replicas: int
    meta: dict         # template.metadata
    pod: dict          # template.spec
    index: int         # the training container's index
    restart_policy: str | None

    @property
    def container(self) -> dict:
        return self.pod["containers"][self.index]

    @property
    def cpath(self) -> str:
        return f"{self.path}.template.spec.containers[{self.index}]"


def _role(specs: dict, name: str, path: str, default_container: str | None) -> _Role | None:
    raw = (specs or {}).get(name)
    if raw is None:
        return None
    template = raw.get("template") or {}
    pod = copy.deepcopy(template.get("spec") or {})
    containers = pod.get("containers") or []
    if not containers:
        raise ConvertError(f"{path}.template.spec.containers: the replica has no container")
    # The Training Operator's training container is the one of its default name; the MPI
    # Operator's is the first.
    index = next((i for i, c in enumerate(containers) if c.get("name") == default_container), 0)
    replicas = raw.get("replicas")
    return _Role(name, f"{path}.{name}", 1 if replicas is None else int(replicas),
                 template.get("metadata") or {}, pod, index, raw.get("restartPolicy"))


# ---- the entry point ---------------------------------------------------------------------------

def convert(obj: dict, cfg: Config | None = None) -> tuple[dict, list[str]]:
    """The DistributedTrainingJob for `obj` and the warnings, in the order of the fields."""
    if not isinstance(obj, dict):
        raise ConvertError(f"expected a Kubernetes object, got a YAML {type(obj).__name__}")
    api, kind = obj.get("apiVersion"), obj.get("kind")
    reader = READERS.get((api, kind))
    if reader is None:
        raise ConvertError(f"{kind or 'an object without kind'} ({api or 'no apiVersion'}) is not a kind "
                           f"trainop convert reads: MPIJob (kubeflow.org/v2beta1), PyTorchJob or "
                           f"TFJob (kubeflow.org/v1)")
    meta = obj.get("metadata") or {}
    if not meta.get("name"):
        raise ConvertError(f"{kind}: metadata.name is missing")
    ctx = _Ctx(cfg or config.from_dict(None), meta.get("namespace") or "default")
    out_spec: dict = {}
    reader(obj.get("spec") or {}, out_spec, ctx)
    dtj = {"apiVersion": API_VERSION, "kind": KIND, "metadata": _metadata(meta, out_spec, ctx),
           "spec": out_spec}
    _judge(dtj, ctx)
    return dtj, ctx.warnings


def _metadata(meta: dict, out_spec: dict, ctx: _Ctx) -> dict:
    out = {"name": meta["name"]}
    if meta.get("namespace"):
        out["namespace"] = meta["namespace"]
    labels = dict(meta.get("labels") or {})
    if KUEUE_QUEUE_LABEL in labels:
        out_spec["queue"] = labels.pop(KUEUE_QUEUE_LABEL)
        ctx.warn(f"metadata.labels[{KUEUE_QUEUE_LABEL}]", f"became spec.queue: {out_spec['queue']} "
                 f"(trainop's own Kueue integration reads spec.queue, not the label)")
    if labels:
        out["labels"] = labels
    if meta.get("annotations"):
        out["annotations"] = dict(meta["annotations"])
    if not re.fullmatch(r"[a-z][a-z0-9-]{0,47}", meta["name"]):
        ctx.warn("metadata.name", f"{meta['name']!r} is refused by the DistributedTrainingJob CRD: a job "
                 f"name is at most 48 lowercase letters, digits and '-', starting with a letter "
                 f"(pods are named <name>-worker-<i>); rename it")
    return out


def _judge(dtj: dict, ctx: _Ctx) -> None:
    """What the operator's spec check still refuses (rare: most refusals are left out above)."""
    try:
        spec.parse(dtj, ctx.cfg)
    except spec.SpecError as exc:
        ctx.warn(exc.field, f"the operator would refuse the translated job: {str(exc).split(': ', 1)[1]}")


# ---- MPIJob --------------------------------------------------------------------------------------

# mpirun (Open MPI, Hydra) and horovodrun options that take a value (two for the *mca/env ones);
# any other option is taken as a flag. `--opt=value` needs no table.
_TWO_VALUES = {"-mca", "--mca", "-gmca", "--gmca", "-genv", "-env"}
_ONE_VALUE = {"-n", "-np", "--n", "--np", "-c", "-N", "-npernode", "--npernode", "-npersocket",
              "-ppn", "-H", "-host", "--host", "--hosts", "-hostfile", "--hostfile", "-machinefile",
              "--machinefile", "-f", "-bind-to", "--bind-to", "-map-by", "--map-by", "-rank-by",
              "--rank-by", "-x", "-wdir", "--wdir", "-wd", "-path", "--path", "-prefix", "--prefix",
              "-output-filename", "--output-filename", "-launcher", "-bootstrap", "-launcher-exec",
              "-bootstrap-exec", "-iface", "-genvlist", "-envlist", "-timeout", "--timeout", "-p",
              "--ssh-port", "-i", "--ssh-identity-file", "--start-timeout", "--network-interface",
              "--mpi-args", "--config-file", "--min-np", "--max-np", "--slots-per-host",
              "--host-discovery-script", "-tune", "--tune"}
MPI_LAUNCHERS = ("mpirun", "mpiexec", "mpiexec.hydra", "horovodrun", "orterun", "prterun")


@dataclass
class _Launch:
    program: list[str]
    ranks: str | None = None
    env: list[dict] = field(default_factory=list)      # -x NAME=VALUE, -genv NAME VALUE
    forwarded: list[str] = field(default_factory=list)  # -x NAME
    dropped: list[str] = field(default_factory=list)


def parse_launch(argv: list[str]) -> _Launch | None:
    """The rank program of an mpirun/horovodrun command line and what its options asked for;
    None when `argv` is not one (a shell line is split when it is a single command)."""
    if len(argv) == 3 and argv[0].rsplit("/", 1)[-1] in ("sh", "bash") and argv[1] == "-c" \
            and not re.search(r"[;&|<>`$(]", argv[2]):
        argv = shlex.split(argv[2])
    if not argv or argv[0].rsplit("/", 1)[-1] not in MPI_LAUNCHERS:
        return None
    out, i = _Launch(program=[]), 1
    while i < len(argv):
        opt = argv[i]
        if not opt.startswith("-") or opt == "--":
            out.program = argv[i + (opt == "--"):]
            break
        name, _, inline = opt.partition("=")
        count = 0 if inline else 2 if name in _TWO_VALUES else 1 if name in _ONE_VALUE else 0
        values = [inline] if inline else argv[i + 1:i + 1 + count]
        i += 1 + count
        if name in ("-n", "-np", "--n", "--np", "-c") and values:
            out.ranks = values[0]
        elif name == "-x" and values:
            key, eq, value = values[0].partition("=")
            if eq:
                out.env.append({"name": key, "value": value})
            else:
                out.forwarded.append(key)
        elif name in ("-genv", "-env") and len(values) == 2:
            out.env.append({"name": values[0], "value": values[1]})
        else:
            out.dropped.append(shlex.join([opt, *([] if inline else values)]))
    return out


def _mpijob(src: dict, out: dict, ctx: _Ctx) -> None:
    path = "spec.mpiReplicaSpecs"
    specs = src.get("mpiReplicaSpecs") or {}
    launcher = _role(specs, "Launcher", path, None)
    worker = _role(specs, "Worker", path, None)
    if launcher is None:
        raise ConvertError(f"{path}.Launcher: missing; an MPIJob has a launcher")
    for name in set(specs) - {"Launcher", "Worker"}:
        ctx.warn(f"{path}.{name}", "not an MPIJob replica type: dropped")
    as_worker = bool(src.get("runLauncherAsWorker"))
    # trainop's own runLauncherAsWorker needs a worker beside it; with none, the launcher's
    # ranks go to one worker instead
    keep_as_worker = as_worker and worker is not None and worker.replicas >= 1
    workers = (worker.replicas if worker else 0) + (as_worker and not keep_as_worker)
    if workers < 1:
        raise ConvertError(f"{path}.Worker: no workers (and runLauncherAsWorker is not set): "
                           f"nothing to run the ranks")
    main = worker or launcher
    out.update(framework=_guess_framework([launcher.container, main.container], ctx), launcher="mpi")
    _image(main, [], out, ctx)
    image = launcher.container.get("image")
    if worker and image and image != out.get("image"):
        out.setdefault("mpirun", {})["image"] = image
        ctx.warn(f"{launcher.cpath}.image", f"{image}: became spec.mpirun.image (the workers run "
                 f"spec.image)")
    out["workers"] = workers
    if keep_as_worker:
        out.setdefault("mpirun", {})["runLauncherAsWorker"] = True
        ctx.warn("spec.runLauncherAsWorker", "became spec.mpirun.runLauncherAsWorker: the launcher "
                 "runs ranks (rank 0 among them) and gets a worker's resources and GPUs")
    elif as_worker:
        ctx.warn("spec.runLauncherAsWorker", f"no Worker replicas: workers is {workers}, which runs "
                 f"the launcher's ranks (trainop's runLauncherAsWorker needs a worker beside it)")
    _resources(main, out, ctx)
    _slots(src, out, ctx)
    impl = src.get("mpiImplementation") or "OpenMPI"
    if impl != "OpenMPI":
        out["mpiImplementation"] = impl
        ctx.warn("spec.mpiImplementation", f"{impl}: carried over; trainop renders Hydra's own mpirun "
                 f"flags for it (-f hostfile -n -ppn, ssh through trainop's config) and the image's "
                 f"mpirun must accept them")
    if src.get("sshAuthMountPath"):
        out["ssh"] = {"mountPath": src["sshAuthMountPath"]}
        ctx.warn("spec.sshAuthMountPath", f"{src['sshAuthMountPath']}: became spec.ssh.mountPath (the "
                 f"key as id_rsa, id_rsa.pub, authorized_keys, known_hosts); the workers' sshd is "
                 f"trainop's own, with its config under /etc/trainop, not the image's")
    if src.get("launcherCreationPolicy") == "AtStartup":
        ctx.warn("spec.launcherCreationPolicy", "AtStartup: dropped; trainop creates the launcher once "
                 "every worker is Ready (the MPI Operator's WaitForWorkersReady)")
    _user([launcher, *([worker] if worker else [])], out, ctx)
    _launch(launcher, out, ctx)
    if worker:
        c = worker.container
        if c.get("command") or c.get("args"):
            ctx.warn(f"{worker.cpath}.command", f"{shlex.join([*(c.get('command') or []), *(c.get('args') or [])])}: "
                     f"dropped; trainop runs its own sshd on every worker (the ranks come from the "
                     f"launcher's command)")
    if keep_as_worker:
        if launcher.container.get("resources"):
            ctx.warn(f"{launcher.cpath}.resources", "dropped: a launcher that runs ranks gets the "
                     "workers' resources and GPUs (spec.resources, gpusPerWorker)")
    else:
        _launcher_resources(launcher, out, ctx)
    templates: dict = {}
    _env([launcher, *([worker] if worker else [])], out, templates, ctx)
    _placement(main, out, ctx)
    _pods({"worker": main, **({"launcher": launcher} if worker else {})}, out, templates, ctx)
    _run_policy(src.get("runPolicy") or {}, "spec.runPolicy", "mpi-operator", workers, out, ctx)
    _restart_policies([launcher, *([worker] if worker else [])], ctx)
    if templates:
        out["podTemplate"] = templates


def _guess_framework(containers: list[dict], ctx: _Ctx) -> str:
    text = " ".join(str(c.get(k) or "") for c in containers for k in ("image", "command", "args")).lower()
    guess = "keras" if "keras" in text else "tensorflow" if "tensorflow" in text or "tf_" in text \
        else "pytorch"
    ctx.warn("spec.mpiReplicaSpecs.Launcher.template.spec.containers[0].image", f"an MPIJob names no framework: spec.framework is {guess} (guessed from "
             f"the image and command); with spec.image and spec.command set it only labels the job")
    return guess


def _slots(src: dict, out: dict, ctx: _Ctx) -> None:
    gpus = out.get("gpusPerWorker", 0)
    slots = src.get("slotsPerWorker")
    trainop_default = max(gpus, 1)
    if slots is None:
        slots = 1
        if trainop_default != 1:
            ctx.warn("spec.slotsPerWorker", f"unset: the MPI Operator runs 1 rank per worker, trainop "
                     f"one per GPU ({gpus}); slotsPerWorker: 1 keeps the MPIJob's ranks")
    elif slots != trainop_default:
        ctx.warn("spec.slotsPerWorker", f"{slots}: carried over; trainop's default is one rank per GPU "
                 f"({trainop_default}), so leave it out to get that")
    if slots != trainop_default:
        out["slotsPerWorker"] = slots


def _launch(launcher: _Role, out: dict, ctx: _Ctx) -> None:
    c, where = launcher.container, f"{launcher.cpath}.command"
    argv = [*(c.get("command") or []), *(c.get("args") or [])]
    launch = parse_launch(argv)
    if launch is None or not launch.program:
        ctx.warn(where, f"{shlex.join(argv) or '(the image entrypoint)'}: no mpirun or horovodrun "
                 f"command with a program found; spec.command is not set, so the ranks would run "
                 f"trainop's built-in trainer: set spec.command to what each rank runs")
        return
    out["command"] = launch.program
    if argv[0].rsplit("/", 1)[-1] == "horovodrun" or "horovodrun" in argv[-1:]:
        ctx.warn(where, "horovodrun: replaced by trainop's mpirun (Horovod's ranks find each other "
                 "through MPI the same way)")
    hosts = out["workers"] + bool((out.get("mpirun") or {}).get("runLauncherAsWorker"))
    total = hosts * out.get("slotsPerWorker", max(out.get("gpusPerWorker", 0), 1))
    if launch.ranks is not None and launch.ranks != str(total):
        ctx.warn(where, f"-np {launch.ranks}: trainop runs {hosts} pods x slotsPerWorker = {total} ranks; "
                 f"change workers or slotsPerWorker to get {launch.ranks}")
    if launch.env:
        out.setdefault("env", []).extend(launch.env)
        ctx.warn(where, f"{', '.join(e['name'] for e in launch.env)}: moved from mpirun's -x/-genv "
                 f"into spec.env (which mpirun forwards to every rank)")
    if launch.forwarded:
        ctx.warn(where, f"-x {' -x '.join(launch.forwarded)}: dropped; each worker's ranks get that "
                 f"worker container's own environment (and spec.env), so a variable of the image "
                 f"reaches them without -x; set a value in spec.env to change it")
    kept, dropped = [], []
    for group in launch.dropped:
        try:
            spec.check_mpirun_args(tuple(shlex.split(group)))
            kept += shlex.split(group)
        except spec.SpecError:
            dropped.append(group)
    if kept:
        out.setdefault("mpirun", {})["extraArgs"] = kept
        ctx.warn(where, f"mpirun options carried over into spec.mpirun.extraArgs: {shlex.join(kept)}")
    if dropped:
        ctx.warn(where, f"mpirun options dropped, trainop renders its own (the hostfile, the rank "
                 f"count, the ssh transport): {' '.join(dropped)}")


def _launcher_resources(launcher: _Role, out: dict, ctx: _Ctx) -> None:
    res, where = launcher.container.get("resources") or {}, f"{launcher.cpath}.resources"
    keep = {which: {k: v for k, v in (res.get(which) or {}).items()
                    if k in spec.WORKER_RESOURCES or k.startswith("hugepages-")}
            for which in ("requests", "limits")}
    keep = {k: v for k, v in keep.items() if v}
    if keep:
        out.setdefault("mpirun", {})["resources"] = keep
        ctx.warn(where, "became spec.mpirun.resources")
    if any(set(res.get(w) or {}) - set(keep.get(w) or {}) for w in ("requests", "limits")):
        ctx.warn(where, "GPUs and other devices dropped: the launcher runs mpirun only")


# ---- PyTorchJob and TFJob ------------------------------------------------------------------------

_TORCHRUN = (["torchrun"], ["python", "-m", "torch.distributed.run"], ["python3", "-m", "torch.distributed.run"],
             ["python", "-m", "torch.distributed.launch"], ["python3", "-m", "torch.distributed.launch"])
# torchrun's flags that take no value; every other option does (unless written --opt=value).
_TORCHRUN_FLAGS = {"--standalone", "--no-python", "--no_python", "--run-path", "--run_path",
                   "-m", "--module", "--use-env", "--use_env"}


def parse_torchrun(argv: list[str]) -> tuple[list[str], str | None]:
    """The program torchrun starts in `argv` (after the torchrun words), as spec.command (trainop's
    torchrun runs it with --no-python), and its --nproc-per-node."""
    i, flags, nproc = 0, set(), None
    while i < len(argv) and argv[i].startswith("-"):
        name, eq, value = argv[i].partition("=")
        if name in _TORCHRUN_FLAGS:
            flags.add(name.replace("_", "-"))
            i += 1
            if name in ("-m", "--module"):
                break
            continue
        if not eq:
            value = argv[i + 1] if i + 1 < len(argv) else ""
            i += 1
        i += 1
        if name.replace("_", "-") == "--nproc-per-node":
            nproc = value
    program = argv[i:]
    if "--no-python" in flags:
        return program, nproc
    return ["python", *(["-m"] if flags & {"-m", "--module"} else []), *program], nproc


def _pytorchjob(src: dict, out: dict, ctx: _Ctx) -> None:
    path = "spec.pytorchReplicaSpecs"
    specs = src.get("pytorchReplicaSpecs") or {}
    master, worker = (_role(specs, n, path, "pytorch") for n in ("Master", "Worker"))
    roles = [r for r in (master, worker) if r]
    if not roles:
        raise ConvertError(f"{path}: neither Master nor Worker replicas")
    for name in set(specs) - {"Master", "Worker"}:
        ctx.warn(f"{path}.{name}", "not a PyTorchJob replica type: dropped")
    main = worker or master
    out.update(framework="pytorch", launcher="torchrun")
    _image(main, roles, out, ctx)
    out["workers"] = sum(r.replicas for r in roles)
    _resources(main, out, ctx, others=roles)
    nproc = src.get("nprocPerNode")
    if nproc is not None and str(nproc).isdigit():
        if int(nproc) != max(out.get("gpusPerWorker", 0), 1):
            out["slotsPerWorker"] = int(nproc)
    elif nproc is not None:
        ctx.warn("spec.nprocPerNode", f"{nproc}: trainop starts one process per GPU (one on CPU); "
                 f"set spec.slotsPerWorker to another number")
    elif out.get("gpusPerWorker", 0) > 1:
        ctx.warn("spec.nprocPerNode", f"unset: the Training Operator starts one process per pod, "
                 f"trainop's torchrun one per GPU ({out['gpusPerWorker']}); slotsPerWorker: 1 keeps "
                 f"the PyTorchJob's")
        out["slotsPerWorker"] = 1
    if src.get("elasticPolicy"):
        ctx.warn("spec.elasticPolicy", "dropped: trainop's torchrun has a fixed world size "
                 "(--nnodes=workers, --max-restarts=0); a failure restarts the whole gang")
    _user(roles, out, ctx)
    _program(main, roles, out, ctx, strip=_TORCHRUN, runner="torchrun")
    _training_operator_pods(src, main, roles, out, ctx)


def _tfjob(src: dict, out: dict, ctx: _Ctx) -> None:
    path = "spec.tfReplicaSpecs"
    specs = src.get("tfReplicaSpecs") or {}
    roles = [r for r in (_role(specs, n, path, "tensorflow") for n in ("Chief", "Master", "Worker")) if r]
    if not roles:
        raise ConvertError(f"{path}: no Chief, Master or Worker replicas")
    for name in set(specs) - {"Chief", "Master", "Worker"}:
        ctx.warn(f"{path}.{name}", f"dropped: trainop has no {name} role; the workers train "
                 f"data-parallel with Horovod (all-reduce), with no parameter servers or evaluator")
    main = next((r for r in roles if r.name == "Worker"), roles[0])
    out.update(framework="tensorflow", launcher="mpi")
    _image(main, roles, out, ctx)
    out["workers"] = sum(r.replicas for r in roles)
    _resources(main, out, ctx, others=roles)
    if out.get("gpusPerWorker", 0) > 1:
        out["slotsPerWorker"] = 1
        ctx.warn(f"{main.cpath}.resources", "a TFJob runs one process per pod (a strategy over its "
                 "GPUs); slotsPerWorker: 1 keeps that, where Horovod usually runs one rank per GPU "
                 "(leave slotsPerWorker out)")
    ctx.warn(path, "TF_CONFIG is not set: trainop starts the workers' processes with mpirun, so the "
             "code must join them through Horovod (hvd.init()), not a tf.distribute strategy that "
             "reads TF_CONFIG")
    if src.get("successPolicy") or src.get("enableDynamicWorker"):
        ctx.warn("spec.successPolicy", "dropped: a trainop job succeeds when the launcher's mpirun does "
                 "(every rank exited 0)")
    _user(roles, out, ctx)
    _program(main, roles, out, ctx, strip=(), runner="mpirun")
    _training_operator_pods(src, main, roles, out, ctx)


def _training_operator_pods(src: dict, main: _Role, roles: list[_Role], out: dict, ctx: _Ctx) -> None:
    """What a PyTorchJob and a TFJob share after their program: env, placement, the main
    role's pod as every worker's template, runPolicy and the replicas' restart policies."""
    templates: dict = {}
    _env(roles, out, templates, ctx)
    _placement(main, out, ctx)
    _pods({"worker": main}, out, templates, ctx, others=[r for r in roles if r is not main])
    _run_policy(src.get("runPolicy") or {}, "spec.runPolicy", "training-operator", out["workers"], out, ctx)
    _restart_policies(roles, ctx)
    if templates:
        out["podTemplate"] = templates


def _program(main: _Role, roles: list[_Role], out: dict, ctx: _Ctx, strip, runner: str) -> None:
    c = main.container
    command, args = list(c.get("command") or []), list(c.get("args") or [])
    for other in roles:
        if other is not main and [other.container.get(k) for k in ("command", "args")] != \
                [c.get(k) for k in ("command", "args")]:
            ctx.warn(f"{other.cpath}.command", f"differs from {main.name}'s: dropped; every trainop "
                     f"worker runs the same program (the rank tells them apart)")
    prefix = next((p for p in strip if command[:len(p)] == p), None)
    if prefix:
        program, nproc = parse_torchrun(command[len(prefix):] + args)
        ctx.warn(f"{main.cpath}.command", f"{shlex.join(command + args)}: trainop runs {runner} itself "
                 f"(--nnodes, --nproc-per-node, rendezvous); spec.command is the program it starts: "
                 f"{shlex.join(program)}")
        if nproc and nproc.isdigit() and "slotsPerWorker" not in out and \
                int(nproc) != max(out.get("gpusPerWorker", 0), 1):
            out["slotsPerWorker"] = int(nproc)
        command, args = program, []
    if command:
        out["command"] = command + args
    elif args:
        out["args"] = args
        ctx.warn(f"{main.cpath}.command", f"unset: the image's entrypoint ran the program; trainop runs "
                 f"spec.command under {runner} and cannot read the image, so without it the ranks "
                 f"run trainop's trainer with these args: set spec.command to the entrypoint")
    else:
        ctx.warn(f"{main.cpath}.command", "unset: the image's entrypoint ran the program; set "
                 "spec.command to it (without it the ranks run trainop's built-in trainer)")


# ---- pieces every kind shares --------------------------------------------------------------------

def _image(main: _Role, roles: list[_Role], out: dict, ctx: _Ctx) -> None:
    c = main.container
    if c.get("image"):
        out["image"] = c["image"]
    if c.get("imagePullPolicy"):
        out["imagePullPolicy"] = c["imagePullPolicy"]
    for other in roles:
        if other is not main and other.container.get("image") != c.get("image"):
            ctx.warn(f"{other.cpath}.image", f"{other.container.get('image')}: dropped; every pod of a "
                     f"trainop job runs spec.image ({c.get('image')}, the {main.name}'s)")


def _resources(main: _Role, out: dict, ctx: _Ctx, others: list[_Role] = ()) -> None:
    res, where = main.container.get("resources") or {}, f"{main.cpath}.resources"
    keep: dict = {}
    gpus = 0
    for which in ("limits", "requests"):
        for key, value in (res.get(which) or {}).items():
            if key in GPU_RESOURCES:
                gpus = max(gpus, int(value))
            elif key in spec.WORKER_RESOURCES or key.startswith("hugepages-"):
                keep.setdefault(which, {})[key] = value
            elif key.startswith("rdma/"):
                out["infiniband"] = True
                ctx.warn(f"{where}.{which}[{key}]", "became spec.infiniband: true (the pool's RDMA "
                         "device, requested by the operator, and the NCCL/UCX settings for it)")
            else:
                ctx.warn(f"{where}.{which}[{key}]", "dropped: a worker may request only cpu, memory, "
                         "ephemeral-storage, hugepages-* and GPUs (spec.gpusPerWorker)")
    if gpus:
        out["gpusPerWorker"] = gpus
        ctx.warn(f"{where}.limits[nvidia.com/gpu]", f"became spec.gpusPerWorker: {gpus}")
    if keep:
        out["resources"] = keep
    for other in others:
        if other is not main and other.container.get("resources") != main.container.get("resources"):
            ctx.warn(f"{other.cpath}.resources", f"differs from {main.name}'s: dropped; every trainop "
                     f"worker is alike (spec.resources, spec.gpusPerWorker)")


def _user(roles: list[_Role], out: dict, ctx: _Ctx) -> None:
    """spec.securityContext from the pods' and training containers' users (the first that sets one)."""
    found: dict = {}
    for role in roles:
        for where, sc in ((f"{role.path}.template.spec.securityContext", role.pod.get("securityContext") or {}),
                          (f"{role.cpath}.securityContext", role.container.get("securityContext") or {})):
            for key in ("runAsUser", "runAsGroup", "fsGroup"):
                if key in sc and key not in found:
                    found[key] = (sc[key], where)
            for key in sorted(set(sc) - {"runAsUser", "runAsGroup", "fsGroup", "runAsNonRoot"}):
                ctx.warn(f"{where}.{key}", "dropped: every trainop pod runs with runAsNonRoot, seccomp "
                         "RuntimeDefault, no privilege escalation and no capabilities "
                         "(a podTemplate container entry may add a securityContext the admin allows)")
    if found.get("runAsUser", (None,))[0] == 0 and not ctx.cfg.pod_template_allow.privileged:
        ctx.warn(found.pop("runAsUser")[1] + ".runAsUser", "0 (root): dropped; trainop runs a job as root "
                 "only where the admin's podTemplate.allow.privileged allows it: the pods run as uid "
                 "10001 unless spec.securityContext.runAsUser names the image's non-root user")
    if not found.get("runAsUser"):
        ctx.warn(f"{roles[0].cpath}.securityContext", "no runAsUser: Kubernetes would run the image's user "
                 "(often root); trainop runs every pod as uid/gid 10001 (spec.securityContext), which "
                 "needs an /etc/passwd entry with a shell in the image for ssh and sshd")
    sc = {key: found[key][0] for key in ("runAsUser", "runAsGroup", "fsGroup") if key in found}
    if "runAsUser" in sc and "runAsGroup" not in sc:
        sc["runAsGroup"] = sc["runAsUser"]
        ctx.warn(found["runAsUser"][1] + ".runAsUser", f"{sc['runAsUser']}: became spec.securityContext; "
                 f"runAsGroup is set to the same id (Kubernetes would use the image's primary group, "
                 f"trainop 10001): change it if the user's group differs")
    if sc:
        out["securityContext"] = sc


def _env(roles: list[_Role], out: dict, templates: dict, ctx: _Ctx) -> None:
    """Plain values go to spec.env (every rank, forwarded by mpirun); valueFrom and envFrom to the
    role's training container in podTemplate; NVIDIA_* and unlisted Secrets are left out."""
    env = {e["name"]: e for e in out.get("env") or []}
    for role in roles:
        c, trole = role.container, _trainop_role(role, out)
        for i, e in enumerate(c.get("env") or []):
            where = f"{role.cpath}.env[{i}]"
            if e["name"].startswith(spec.GPU_ENV_PREFIX):
                ctx.warn(where, f"{e['name']}: dropped; NVIDIA_* variables would expose GPUs past "
                         f"spec.gpusPerWorker, and the operator refuses them")
            elif "valueFrom" in e:
                if _secret_ok(e["valueFrom"].get("secretKeyRef"), where, ctx):
                    _container_entry(templates, trole, out).setdefault("env", []).append(e)
            elif e["name"] in env and env[e["name"]].get("value") != e.get("value"):
                ctx.warn(where, f"{e['name']}: dropped; spec.env already sets it to "
                         f"{env[e['name']].get('value')!r} (every pod of a trainop job gets one env)")
            else:
                env[e["name"]] = {"name": e["name"], **({"value": str(e["value"])} if "value" in e else {})}
        for i, e in enumerate(c.get("envFrom") or []):
            where = f"{role.cpath}.envFrom[{i}]"
            if trole in spec.GPU_CONTAINERS and spec.may_set_gpu_env(e) \
                    and not ctx.cfg.pod_template_allow.env_from_without_prefix:
                ctx.warn(where, "dropped; without a prefix it could set NVIDIA_VISIBLE_DEVICES in the "
                         "GPU container, which the operator refuses: name each variable in "
                         "spec.podTemplate.worker's env with valueFrom.configMapKeyRef, or add a "
                         "prefix (the names change), or ask the cluster admin for "
                         "podTemplate.allow.envFromWithoutPrefix")
            elif _secret_ok(e.get("secretRef"), where, ctx):
                _container_entry(templates, trole, out).setdefault("envFrom", []).append(e)
    if env:
        out["env"] = list(env.values())


def _secret_ok(ref: dict | None, where: str, ctx: _Ctx) -> bool:
    if not ref or ctx.cfg.pod_template_allow.secret_allowed(ctx.namespace, ref.get("name", "")):
        return True
    ctx.warn(where, f"Secret {ref.get('name')!r}: dropped; a job's pods reach only the Secrets the "
             f"cluster admin lists (podTemplate.allow.secrets); once listed, add it back under "
             f"spec.podTemplate")
    return False


def _trainop_role(role: _Role, out: dict) -> str:
    return "launcher" if role.name == "Launcher" and out.get("launcher") == "mpi" else "worker"


def _container_entry(templates: dict, trole: str, out: dict) -> dict:
    """podTemplate.<role>.spec.containers' entry for the training container (named like the role)."""
    containers = templates.setdefault(trole, {}).setdefault("spec", {}).setdefault("containers", [])
    entry = next((c for c in containers if c["name"] == trole), None)
    if entry is None:
        entry = {"name": trole}
        containers.insert(0, entry)
    return entry


def _placement(main: _Role, out: dict, ctx: _Ctx) -> None:
    pod, where = main.pod, f"{main.path}.template.spec"
    if pod.get("nodeSelector"):
        out["nodePool"] = {"nodeSelector": dict(pod["nodeSelector"])}
        if pod.get("tolerations"):
            out["nodePool"]["tolerations"] = pod["tolerations"]
        ctx.warn(f"{where}.nodeSelector", "became spec.nodePool.nodeSelector (and tolerations): the "
                 "operator's named pools (spec.nodePool.name) bring their own selector, tolerations, "
                 "GPU resource and InfiniBand settings")
    else:
        kind = "infiniband" if out.get("infiniband") else "gpu" if out.get("gpusPerWorker") else "cpu"
        ctx.warn(f"{where}.nodeSelector", f"unset: the pods run on the operator's default {kind} pool "
                 f"({ctx.cfg.default_node_pools.get(kind)}); set spec.nodePool to choose")


def _pods(roles: dict[str, _Role], out: dict, templates: dict, ctx: _Ctx, others: list[_Role] = ()) -> None:
    """Volumes, mounts, extra containers, affinity and pod labels into spec.podTemplate; what
    trainop owns or refuses is reported."""
    worker_sel = (out.get("nodePool") or {}).get("nodeSelector") or {}
    worker_tol = (out.get("nodePool") or {}).get("tolerations") or []
    for trole, role in roles.items():
        pod, where = role.pod, f"{role.path}.template.spec"
        tmpl = templates.setdefault(trole, {})
        pspec = tmpl.setdefault("spec", {})
        for kind in ("labels", "annotations"):
            kept = {k: v for k, v in (role.meta.get(kind) or {}).items()
                    if not k.startswith(("trainop.io/", spec.IDENTITY_PREFIX))}
            if len(kept) < len(role.meta.get(kind) or {}):
                ctx.warn(f"{role.path}.template.metadata.{kind}", "trainop.io/ and azure.workload.identity/ "
                         "keys dropped: they are the operator's")
            if kept:
                tmpl.setdefault("metadata", {})[kind] = kept
        grace = pod.get("terminationGracePeriodSeconds")
        if grace is not None:
            out["terminationGracePeriodSeconds"] = max(grace, out.get("terminationGracePeriodSeconds", 0))
            ctx.warn(f"{where}.terminationGracePeriodSeconds", f"{grace}: became "
                     f"spec.terminationGracePeriodSeconds ({out['terminationGracePeriodSeconds']}, "
                     f"every pod of the job)")
        renamed, shm = _volumes(role, pspec, ctx)
        if shm and trole == "worker":
            out["shmSize"] = shm
        c = role.container
        mounts = []
        for m in c.get("volumeMounts") or []:
            if m["name"] not in renamed:
                continue  # its volume was dropped (warned there)
            if m.get("mountPath") == "/dev/shm":
                continue  # became spec.shmSize
            mounts.append({**m, "name": renamed[m["name"]]})
        if mounts:
            _container_entry(templates, trole, out)["volumeMounts"] = mounts
        for key in sorted(set(c) - READ_CONTAINER):
            ctx.warn(f"{role.cpath}.{key}", f"dropped: the operator renders the training container's "
                     f"{key} itself (a sidecar in spec.podTemplate may carry its own)")
        for i, extra in enumerate(pod.get("containers") or []):
            if i != role.index:
                _sidecar(extra, f"{where}.containers[{i}]", pspec, "containers", renamed, ctx)
        for i, extra in enumerate(pod.get("initContainers") or []):
            _sidecar(extra, f"{where}.initContainers[{i}]", pspec, "initContainers", renamed, ctx)
        if pod.get("affinity"):
            pspec["affinity"] = pod["affinity"]
        if trole == "launcher":
            extra_sel = {k: v for k, v in (pod.get("nodeSelector") or {}).items() if k not in worker_sel}
            for k, v in (pod.get("nodeSelector") or {}).items():
                if k in worker_sel and worker_sel[k] != v:
                    ctx.warn(f"{where}.nodeSelector[{k}]", f"{v}: dropped; the launcher runs in the "
                             f"workers' pool ({k}={worker_sel[k]})")
            if extra_sel:
                pspec["nodeSelector"] = extra_sel
            tol = [t for t in pod.get("tolerations") or [] if t not in worker_tol]
            if tol:
                pspec["tolerations"] = tol
        elif pod.get("tolerations") and not worker_sel:
            pspec["tolerations"] = pod["tolerations"]
        if pod.get("priorityClassName"):
            out.setdefault("priorityClassName", pod["priorityClassName"])
            if out["priorityClassName"] != pod["priorityClassName"]:
                ctx.warn(f"{where}.priorityClassName", f"{pod['priorityClassName']}: dropped; a gang has "
                         f"one priority ({out['priorityClassName']})")
        pulls = [ref for i, ref in enumerate(pod.get("imagePullSecrets") or [])
                 if _secret_ok(ref, f"{where}.imagePullSecrets[{i}]", ctx)]
        if pulls:
            pspec["imagePullSecrets"] = pulls
        _pod_refusals(pod, where, ctx)
        if not pspec:
            tmpl.pop("spec")
        if not tmpl:
            templates.pop(trole)
    for role in others:  # Training Operator roles folded into the workers
        for key in ("volumes", "initContainers", "affinity", "nodeSelector", "tolerations"):
            if role.pod.get(key) and role.pod.get(key) != roles["worker"].pod.get(key):
                ctx.warn(f"{role.path}.template.spec.{key}", f"differs from {roles['worker'].name}'s: "
                         f"dropped; every trainop worker gets the same pod")


def _volumes(role: _Role, pspec: dict, ctx: _Ctx) -> tuple[dict[str, str], str | None]:
    """The role's volumes into the template; returns old name -> new name of those kept, and the
    size of a memory volume at /dev/shm (the operator mounts /dev/shm itself: spec.shmSize)."""
    allow, where = ctx.cfg.pod_template_allow, f"{role.path}.template.spec.volumes"
    shm = {m["name"] for m in role.container.get("volumeMounts") or [] if m.get("mountPath") == "/dev/shm"}
    renamed, shm_size = {}, None
    for i, vol in enumerate(role.pod.get("volumes") or []):
        name, here = vol["name"], f"{where}[{i}]"
        kind = next((k for k in vol if k != "name"), "emptyDir")
        sources = (vol.get("projected") or {}).get("sources") or []
        if name in shm:
            shm_size = (vol.get("emptyDir") or {}).get("sizeLimit")
            ctx.warn(here, f"{name} at /dev/shm: became spec.shmSize "
                     f"({shm_size or 'unset: 1Gi, trainop`s default'}); the operator mounts /dev/shm itself")
            continue
        if kind == "hostPath" and not allow.host_path:
            ctx.warn(here, f"{name} (hostPath): dropped; node files are refused unless the admin allows "
                     f"podTemplate.allow.hostPath (or use a persistentVolumeClaim)")
            continue
        if kind not in spec.RESTRICTED_VOLUME_TYPES + ("hostPath",) + allow.volume_types:
            ctx.warn(here, f"{name} ({kind}): dropped; only {', '.join(spec.RESTRICTED_VOLUME_TYPES)} "
                     f"volumes unless the admin allows more (podTemplate.allow.volumeTypes)")
            continue
        if any("serviceAccountToken" in s for s in sources):
            ctx.warn(here, f"{name}: dropped; a projected ServiceAccount token is never handed to job pods")
            continue
        secrets = [(vol.get("secret") or {}).get("secretName")] + \
            [(s.get("secret") or {}).get("name") for s in sources]
        if not all(_secret_ok({"name": s} if s else None, here, ctx) for s in secrets):
            continue
        new = f"user-{name}" if name in RESERVED_VOLUMES else name
        if new != name:
            ctx.warn(here, f"{name}: renamed {new}; the operator's own volume has that name")
        pspec.setdefault("volumes", []).append({**vol, "name": new})
        renamed[name] = new
    return renamed, (str(shm_size) if shm_size else None)


def _sidecar(c: dict, where: str, pspec: dict, key: str, renamed: dict, ctx: _Ctx) -> None:
    c = copy.deepcopy(c)
    if c.get("name") in ("worker", "launcher", "logship", "fetch-checkpoint", "preflight"):
        ctx.warn(f"{where}.name", f"{c['name']}: renamed user-{c['name']}; the operator's container has "
                 f"that name")
        c["name"] = f"user-{c['name']}"
    c["volumeMounts"] = [{**m, "name": renamed[m["name"]]} for m in c.get("volumeMounts") or []
                         if m["name"] in renamed]
    c["env"] = [e for i, e in enumerate(c.get("env") or [])
                if _secret_ok(((e.get("valueFrom") or {}).get("secretKeyRef")), f"{where}.env[{i}]", ctx)
                and not e["name"].startswith(spec.GPU_ENV_PREFIX)]
    c["envFrom"] = [e for i, e in enumerate(c.get("envFrom") or [])
                    if _secret_ok(e.get("secretRef"), f"{where}.envFrom[{i}]", ctx)]
    for which in ("limits", "requests"):
        res = (c.get("resources") or {}).get(which) or {}
        for k in [k for k in res if k not in spec.CONTAINER_RESOURCES and not k.startswith("hugepages-")]:
            ctx.warn(f"{where}.resources.{which}[{k}]", "dropped: an added container gets no GPU or "
                     "other device (spec.gpusPerWorker counts the job's GPUs)")
            del res[k]
    pspec.setdefault(key, []).append({k: v for k, v in c.items() if v != []})
    ctx.warn(where, f"{c['name']}: carried over into spec.podTemplate as an extra container")


def _pod_refusals(pod: dict, where: str, ctx: _Ctx) -> None:
    allow = ctx.cfg.pod_template_allow
    for key in ("serviceAccountName", "serviceAccount"):
        if pod.get(key):
            ctx.warn(f"{where}.{key}", f"{pod[key]}: dropped; job pods run without an API token "
                     f"(with spec.output, as the log shipper's ServiceAccount)")
    for key, ok in (("hostNetwork", allow.host_network), ("hostPID", allow.host_pid), ("hostIPC", allow.host_ipc)):
        if pod.get(key):
            ctx.warn(f"{where}.{key}", "dropped: refused unless the admin allows "
                     f"podTemplate.allow.{key}" + ("; add it back under spec.podTemplate" if ok else ""))
    for key in sorted(set(pod) - READ_POD):
        ctx.warn(f"{where}.{key}", "dropped: the operator renders this pod field itself")


def _restart_policies(roles: list[_Role], ctx: _Ctx) -> None:
    for role in roles:
        policy = role.restart_policy or role.pod.get("restartPolicy")
        if policy:
            ctx.warn(f"{role.path}.restartPolicy", f"{policy}: dropped; trainop restarts the whole gang "
                     f"when any pod fails (runPolicy.backoffLimit counts those restarts; "
                     f"runPolicy.failurePolicy.rules decide per exit code, like ExitCode)")


def _run_policy(run: dict, where: str, source: str, workers: int, out: dict, ctx: _Ctx) -> None:
    mpi = source == "mpi-operator"
    policy: dict = {}
    if "backoffLimit" in run:
        policy["backoffLimit"] = run["backoffLimit"]
        ctx.warn(f"{where}.backoffLimit", f"{run['backoffLimit']}: carried over with another meaning: "
                 + ("the MPI Operator retried the launcher Job alone, " if mpi else
                    "the Training Operator restarted single pods, ")
                 + "trainop restarts the whole gang and counts only the job's own failures "
                   "(evictions and lost nodes do not count)")
    else:
        ctx.warn(f"{where}.backoffLimit", "unset: trainop allows 3 gang restarts ("
                 + ("the MPI Operator's launcher Job allowed 6 launcher retries)" if mpi
                    else "the Training Operator allowed 6 pod restarts)"))
    clean = run.get("cleanPodPolicy")
    if clean is None:
        policy["cleanPodPolicy"] = "None"
        ctx.warn(f"{where}.cleanPodPolicy", "unset: None, the source's default, is kept (trainop's default "
                 "is Running: delete the pods still running when the job ends, such as idle sshd "
                 "workers holding GPUs)")
    else:
        policy["cleanPodPolicy"] = clean
    ttl = run.get("ttlSecondsAfterFinished")
    if ttl is not None and mpi:
        ctx.warn(f"{where}.ttlSecondsAfterFinished", f"{ttl}: dropped; the MPI Operator deletes only the "
                 f"launcher Job then, while trainop's would delete the whole DistributedTrainingJob and "
                 f"every child; the job is kept, cleanPodPolicy frees its pods' nodes (set "
                 f"spec.runPolicy.ttlSecondsAfterFinished to delete the job itself)")
    elif ttl is not None:
        policy["ttlSecondsAfterFinished"] = ttl
    if run.get("activeDeadlineSeconds") is not None:
        policy["activeDeadlineSeconds"] = run["activeDeadlineSeconds"]
    if run.get("suspend"):
        policy["suspend"] = True
    if run.get("managedBy"):
        ctx.warn(f"{where}.managedBy", f"{run['managedBy']}: dropped; trainop leaves alone a job whose "
                 f"runPolicy.managedBy names another controller (no pods, no status), so the copy "
                 f"would never run")
    _scheduling(run.get("schedulingPolicy") or {}, f"{where}.schedulingPolicy", workers, mpi, policy, out, ctx)
    for key in sorted(set(run) - {"backoffLimit", "cleanPodPolicy", "ttlSecondsAfterFinished",
                                  "activeDeadlineSeconds", "suspend", "managedBy", "schedulingPolicy"}):
        ctx.warn(f"{where}.{key}", "dropped: trainop's runPolicy has no such field")
    out["runPolicy"] = policy


def _scheduling(sp: dict, where: str, workers: int, mpi: bool, policy: dict, out: dict, ctx: _Ctx) -> None:
    keep: dict = {}
    if sp.get("minAvailable") is not None:
        # The MPI Operator counts the launcher in the group; trainop creates it after the workers.
        given = sp["minAvailable"]
        value = min(given - 1 if mpi else given, workers)
        if value >= 1 and value != workers:
            keep["minAvailable"] = value
        ctx.warn(f"{where}.minAvailable", f"{given}: "
                 + (f"became {value}" if "minAvailable" in keep else "dropped (the default, every worker)")
                 + ("; trainop's PodGroup counts workers only (the launcher starts once they are Ready)" if mpi else ""))
    queue = sp.get("queue")
    if queue and queue in ctx.cfg.allowed_queues:
        keep["queue"] = queue
    elif queue:
        ctx.warn(f"{where}.queue", f"{queue}: dropped; a job may name only a Volcano queue the admin "
                 f"lists (gangScheduling.allowedQueues: {', '.join(ctx.cfg.allowed_queues) or 'none'})")
    if sp.get("minResources"):
        keep["minResources"] = sp["minResources"]
    if sp.get("scheduleTimeoutSeconds"):
        keep["scheduleTimeoutSeconds"] = sp["scheduleTimeoutSeconds"]
    if sp.get("priorityClass"):
        out.setdefault("priorityClassName", sp["priorityClass"])
        ctx.warn(f"{where}.priorityClass", f"became spec.priorityClassName: {out['priorityClassName']} (it "
                 f"must exist and be at most the operator's limits.maxPriority, else the job fails)")
    if keep:
        policy["schedulingPolicy"] = keep
        ctx.warn(where, "carried over: it applies only where the operator's configuration names a gang "
                 "scheduler (gangScheduling.scheduler)")


READERS = {("kubeflow.org/v2beta1", "MPIJob"): _mpijob,
           ("kubeflow.org/v1", "PyTorchJob"): _pytorchjob,
           ("kubeflow.org/v1", "TFJob"): _tfjob}
