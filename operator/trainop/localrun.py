"""The local backend of `trainop run JOB.yaml --local`: a DistributedTrainingJob as real processes
on this machine.

Nothing about the job is re-derived here. spec.parse reads it (the CRD's own schema and defaults,
then the operator's checks), and the processes run the operator's own renders from
render/dtj.py: the launcher's script (wait for the hosts, then mpirun over the hostfile) for MPI
jobs, every worker's torchrun script for torchrun jobs, with the environment the containers get.
Only the pod's view of the world is mapped onto this machine:

- what a pod sees under /etc/trainop (hostfile, hosts, ssh config), /output and the data mount
  lives in the run folder (or --data-dir);
- every worker's cluster DNS name is 127.0.0.1, and torchrun's rendezvous port a free local one;
- the hostfile is one line, `127.0.0.1 slots=<every rank>` (Open MPI refuses a host named twice);
- `python` is this interpreter's (its folder leads PATH).

Unless `full`, the job is reduced to finish in about a minute on 2 CPU cores (see reduce());
every change is listed before the run starts.
"""

from __future__ import annotations

import json
import os
import queue
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field, replace
from importlib import util as importlib_util
from pathlib import Path
from typing import TextIO

from trainop import paths
from trainop.render import common, dtj
from trainop.spec import CHECKPOINT_VOLUME_MOUNT, Job

LOCALHOST = "127.0.0.1"
# The reduced run: at most MAX_RANKS ranks; each training value at most these.
MAX_RANKS = 2
SMALL = {"batch_size": 8, "epochs": 2, "steps_per_epoch": 5, "image_size": 64}
SMALL_MODEL = "resnet18"  # the trainer's default is resnet50
# Horovod's background thread negotiates every cycle (1 ms by default) and spins in MPI while its
# rank is busy elsewhere (loading, saving, a slower peer). Ranks sharing a few CPU cores pay for
# that spin in their own compute: a 2-rank 12-step PyTorch run here, 13.4 -> 11.0 CPU-s and
# 8.4 -> 7.2 s at 50 ms (TensorFlow 26.3 -> 23.6 CPU-s), and its steps no slower.
HOROVOD_CYCLE_TIME = "50"
TRAINER = ["python", "-m", "trainop_trainer"]
STOP_GRACE_SECONDS = 10


class LocalRunError(RuntimeError):
    """This machine cannot run the job (a missing tool, a bad option); one line."""


@dataclass(frozen=True)
class Options:
    full: bool = False  # run the manifest's own sizes
    epochs: int | None = None
    steps_per_epoch: int | None = None
    data_dir: Path | None = None  # a local folder in place of the job's data
    cpus: int = field(default_factory=lambda: os.cpu_count() or 1)


@dataclass(frozen=True)
class Plan:
    job: Job  # as it runs here, after reduce()
    notes: tuple[str, ...]  # every change from the manifest, for the user
    run_dir: Path
    scripts: dict[str, str]  # process name -> the rendered shell script, localized
    files: dict[str, str]  # path under run_dir -> content (what the pods get mounted)
    env: dict[str, str]  # added to this process's environment
    trainer: bool  # runs the built-in trainer, so its metric reports are expected
    rdzv_port: int | None = None  # torchrun: worker 0's rendezvous store, started first

    @property
    def output_dir(self) -> Path:
        return self.run_dir / "output"

    @property
    def ranks(self) -> int:
        return self.job.total_slots

    @property
    def checkpoint_root(self) -> Path | None:
        """The job's checkpoint root (spec.checkpoint) in the run folder."""
        env = self.env.get("TRAINOP_CHECKPOINT_DIR")
        return Path(env).parent if env else None


def _uses_trainer(job: Job) -> bool:
    return not job.command and job.args is None


def reduce(job: Job, opts: Options) -> tuple[Job, list[str], list[str]]:
    """(the job to run here, notes naming each change, extra trainer arguments)."""
    notes: list[str] = []
    extra: list[str] = []
    if job.infiniband:
        job = replace(job, infiniband=False)
        notes.append("infiniband: none on this machine, so the TCP settings (NCCL_IB_DISABLE=1)")
    if job.launcher == "mpi" and job.mpi_implementation != "OpenMPI":
        notes.append(f"mpiImplementation: {job.mpi_implementation} -> OpenMPI (the MPI installed here)")
        job = replace(job, mpi_implementation="OpenMPI")
    if opts.data_dir is not None:
        job = replace(job, synthetic=False, data_stage=None)
        notes.append(f"data: the local folder {opts.data_dir}")
    elif job.data_stage:
        notes.append(f"data: synthetic in place of DataStage {job.data_stage!r} "
                     f"(--data-dir DIR trains on a local copy)")
        job = replace(job, synthetic=True, data_stage=None)
    if not opts.full and job.total_slots > MAX_RANKS:
        workers = min(job.workers, MAX_RANKS)
        slots = max(1, MAX_RANKS // workers)
        notes.append(f"ranks: {job.workers} workers x {job.slots_per_worker} ranks -> {workers} x {slots}")
        job = replace(job, workers=workers, slots_per_worker=slots)
    if not _uses_trainer(job):
        notes.append("spec.command/args: run as written (training values are the manifest's)")
        return job, notes, extra
    t = target = job.training
    if not opts.full:
        target = replace(t, batch_size=min(t.batch_size, SMALL["batch_size"]),
                         epochs=min(t.epochs, SMALL["epochs"]),
                         steps_per_epoch=min(t.steps_per_epoch or SMALL["steps_per_epoch"],
                                             SMALL["steps_per_epoch"]),
                         image_size=min(t.image_size or 224, SMALL["image_size"]),
                         precision="fp32", compile=False)
        extra = ["--model", SMALL_MODEL]
        notes.append("model: ResNet-50 -> ResNet-18")
    if opts.epochs is not None:
        target = replace(target, epochs=opts.epochs)
    if opts.steps_per_epoch is not None:
        target = replace(target, steps_per_epoch=opts.steps_per_epoch)
    ck = job.checkpoint
    if ck and not opts.full and target.steps_per_epoch and ck.every_steps > target.steps_per_epoch:
        notes.append(f"checkpoint every {ck.every_steps} steps -> every {target.steps_per_epoch} (one epoch)")
        job = replace(job, checkpoint=replace(ck, every_steps=target.steps_per_epoch))
    for label, before, after in [
        ("batch size per rank", t.batch_size, target.batch_size),
        ("image size", t.image_size or 224, target.image_size or 224),
        ("epochs", t.epochs, target.epochs),
        ("steps per epoch", t.steps_per_epoch or "the trainer's default", target.steps_per_epoch),
        ("precision", t.precision, target.precision),
        ("compile", t.compile, target.compile),
    ]:
        if before != after:
            notes.append(f"{label}: {before} -> {after}")
    t = target
    return replace(job, training=t), notes, extra


def _remap(text: str, mapping: dict[str, str]) -> str:
    """Replace each path of `mapping` where it starts a shell word or follows `=`, and is
    followed by `/` or the word's end (so /data never rewrites /database)."""
    for src, dst in mapping.items():
        text = re.sub(rf"(^|[\s'\"=]){re.escape(src)}(?=$|[/\s'\"])",
                      lambda m, dst=dst: m.group(1) + dst, text, flags=re.M)
    return text


def _localize_hosts(text: str, job: Job, rdzv_port: int) -> str:
    text = text.replace(f"{dtj.host(job, 0)}:{dtj.RDZV_PORT}", f"{LOCALHOST}:{rdzv_port}")
    for i in reversed(range(job.workers)):  # worker-10 before worker-1
        text = text.replace(dtj.host(job, i), LOCALHOST)
    return text


def _search_path() -> str:
    """PATH with this interpreter's folder first: its `python`, `torchrun` (and a venv's mpirun)."""
    return f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"


def plan(job: Job, opts: Options, run_dir: Path, rdzv_port: int) -> Plan:
    """What runs, where, with which environment; starts nothing and writes nothing."""
    trainer = _uses_trainer(job)
    job, notes, extra = reduce(job, opts)
    mounts = {common.MOUNT_ROOT: str(run_dir / "etc-trainop"), dtj.OUTPUT_DIR: str(run_dir / "output"),
              CHECKPOINT_VOLUME_MOUNT: str(run_dir / "checkpoints")}
    if opts.data_dir is not None:
        mounts[job.data_mount_path] = str(opts.data_dir.resolve())
    if extra:  # options the CRD has no field for: appended to the rendered trainer arguments
        job = replace(job, args=tuple(dtj.trainer_args(job) + extra))

    def localize(text: str) -> str:
        return _remap(_localize_hosts(text, job, rdzv_port), mounts)

    files = {}
    if job.launcher == "mpi":
        conf = os.path.relpath(dtj.CONF_DIR, common.MOUNT_ROOT)
        for name, content in dtj.render_config_map(job)["data"].items():
            files[f"etc-trainop/{conf}/{name}"] = localize(content)
        files[f"etc-trainop/{conf}/hostfile"] = f"{LOCALHOST} slots={job.total_slots}\n"
        scripts = {"launcher": localize(dtj.launcher_script(job))}
    else:
        scripts = {dtj.worker_name(job, i).removeprefix(f"{job.name}-"): localize(dtj.torchrun_script(job))
                   for i in range(job.workers)}
    env = {e["name"]: localize(e.get("value", "")) for e in dtj.container_env(job)}
    env["PATH"] = _search_path()
    if os.geteuid() == 0:
        # Pods run mpirun as a non-root user; here it is whoever runs `trainop run --local`, and
        # Open MPI refuses root unless told twice.
        env |= {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    if "OMP_NUM_THREADS" not in env and "OMP_NUM_THREADS" not in os.environ:
        # One thread pool per rank sized to its share of the cores, not every core each.
        env["OMP_NUM_THREADS"] = str(max(1, opts.cpus // job.total_slots))
    if job.launcher == "mpi" and "HOROVOD_CYCLE_TIME" not in env and "HOROVOD_CYCLE_TIME" not in os.environ:
        env["HOROVOD_CYCLE_TIME"] = HOROVOD_CYCLE_TIME
    return Plan(job=job, notes=tuple(notes), run_dir=run_dir, scripts=scripts, files=files, env=env,
                trainer=trainer, rdzv_port=rdzv_port if job.launcher == "torchrun" else None)


def preflight(job: Job) -> None:
    """LocalRunError naming what this machine lacks to run `job`, and how to get it."""
    fix = "run scripts/bootstrap.sh demo (or trainer_images/install.sh)"
    if job.framework != "pytorch":
        # `make demo` installs PyTorch only; Horovod must then be rebuilt with TensorFlow too.
        fix = ("run scripts/bootstrap.sh test, or only TRAINOP_FRAMEWORKS=pytorch,tensorflow "
               "trainer_images/install.sh (scripts/bootstrap.sh demo installs PyTorch alone)")
    tool = "mpirun" if job.launcher == "mpi" else "torchrun"
    if shutil.which(tool, path=_search_path()) is None:
        raise LocalRunError(f"spec.launcher {job.launcher}: {tool} is not installed; {fix}")
    if not _uses_trainer(job):
        return
    needs = ["trainop_trainer", "torch" if job.framework == "pytorch" else "tensorflow"]
    if job.launcher == "mpi":
        needs.append("horovod.torch" if job.framework == "pytorch" else "horovod.tensorflow")
    for module in needs:
        try:
            found = importlib_util.find_spec(module) is not None
        except ImportError:
            found = False
        if not found:
            raise LocalRunError(f"spec.framework {job.framework} (launcher {job.launcher}): Python "
                                f"module {module} is not installed in {sys.prefix}; {fix}")


def new_run_dir(job_name: str) -> Path:
    """<state dir>/runs/<job>/<n>, n one more than the last run's."""
    root = paths.state_dir() / "runs" / job_name
    root.mkdir(parents=True, exist_ok=True)
    taken = [int(p.name) for p in root.iterdir() if p.name.isdigit()]
    run_dir = root / str(max(taken, default=0) + 1)
    run_dir.mkdir()
    return run_dir


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((LOCALHOST, 0))
        return sock.getsockname()[1]


# ---- running ----------------------------------------------------------------------------------
@dataclass
class Outcome:
    ok: bool
    seconds: float
    reports: list[dict]  # the trainer's metric reports, in order
    failure: str | None = None  # one line when not ok
    log: Path | None = None
    checkpoint: Path | None = None

    @property
    def final(self) -> dict | None:
        return next((r for r in reversed(self.reports) if r.get("final")), None)


def parse_report(line: str) -> dict | None:
    """A metrics line of the trainer contract (JSON object with imagesPerSec), else None."""
    line = line.strip()
    if not line.startswith("{"):
        return None
    try:
        obj = json.loads(line)
    except ValueError:
        return None
    return obj if isinstance(obj, dict) and "imagesPerSec" in obj else None


class Progress:
    """An epoch bar redrawn in place on a terminal; one line per report otherwise (logs, CI)."""

    WIDTH = 24

    def __init__(self, stream: TextIO, epochs: int):
        self.stream, self.epochs = stream, epochs
        self.tty = stream.isatty()
        self.last: dict | None = None
        self.start = time.monotonic()

    def line(self) -> str:
        r = self.last or {}
        done = r.get("epoch", 0) if r else 0
        filled = int(self.WIDTH * done / max(self.epochs, 1))
        elapsed = int(time.monotonic() - self.start)
        bar = "#" * filled + "." * (self.WIDTH - filled)
        text = f"[{bar}] epoch {done}/{self.epochs}"
        if r:
            text += f"  step {r['step']}  loss {r['loss']:.3f}  {r['imagesPerSec']:.1f} img/s"
        return text + f"  {elapsed // 60}:{elapsed % 60:02d}"

    def report(self, record: dict) -> None:
        self.last = record
        if not self.tty and not record.get("final"):
            print(self.line(), file=self.stream, flush=True)
        self.tick()

    def tick(self) -> None:
        if self.tty:
            print("\r" + self.line(), end="", file=self.stream, flush=True)

    def close(self) -> None:
        if self.tty:
            print(file=self.stream, flush=True)


def _stop(procs: dict[str, subprocess.Popen]) -> None:
    """SIGTERM every process group still running, SIGKILL what outlives the grace period."""
    alive = [p for p in procs.values() if p.poll() is None]
    for proc in alive:
        with _ignore_gone():
            os.killpg(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_SECONDS
    for proc in alive:
        try:
            proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            with _ignore_gone():
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


class _ignore_gone:
    def __enter__(self):
        return self

    def __exit__(self, kind, exc, tb):
        return kind is ProcessLookupError


def write_files(p: Plan) -> None:
    for rel, content in p.files.items():
        target = p.run_dir / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(content)
    p.output_dir.mkdir(parents=True, exist_ok=True)
    for name, script in p.scripts.items():  # kept beside the log: exactly what ran
        (p.run_dir / f"{name}.sh").write_text(script)


def _wait_for_port(port: int, proc: subprocess.Popen, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        with socket.socket() as sock:
            if sock.connect_ex((LOCALHOST, port)) == 0:
                return
        time.sleep(0.1)


def newest_checkpoint(root: Path | None) -> Path | None:
    """The newest complete `attempt-<n>/step-<k>` under `root` (the trainer's layout): what the
    log shipper would report to the operator, found here by looking."""
    found = []
    for marker in (root.glob("attempt-*/step-*/COMPLETE") if root else ()):
        step_dir = marker.parent
        if step_dir.name[5:].isdigit() and step_dir.parent.name[8:].isdigit():
            found.append((int(step_dir.name[5:]), int(step_dir.parent.name[8:]), step_dir))
    return max(found)[2] if found else None


def execute_with_restarts(p: Plan, progress: Progress, echo: TextIO | None = None,
                          deadline_seconds: int | None = None, say=print) -> Outcome:
    """`execute()`, and with spec.checkpoint on, gang restarts as the operator makes them: up to
    runPolicy.backoffLimit, each attempt saving into its own attempt-<n> folder and resuming
    from the newest complete checkpoint (resume.py's layout). Without checkpoints a local run
    stops at the first failure (a restart would only repeat it from step 0)."""
    limit = p.job.run_policy.backoff_limit if p.checkpoint_root else 0
    reports: list[dict] = []
    failure = None
    for attempt in range(limit + 1):
        plan_ = p
        if attempt:
            newest = newest_checkpoint(p.checkpoint_root)
            env = dict(p.env, TRAINOP_CHECKPOINT_DIR=str(p.checkpoint_root / f"attempt-{attempt}"),
                       TRAINOP_RESUME_FROM=str(newest or ""))
            plan_ = replace(p, env=env)
            say(f"attempt {attempt}: restarting the gang ({failure}); "
                + (f"resuming from {newest}" if newest else "no complete checkpoint yet: from step 0"))
        outcome = execute(plan_, progress, echo, deadline_seconds, attempt)
        reports += outcome.reports
        if outcome.ok or attempt == limit:
            break
        failure = outcome.failure
    outcome.reports = reports
    return outcome


def execute(p: Plan, progress: Progress, echo: TextIO | None = None,
            deadline_seconds: int | None = None, attempt: int = 0) -> Outcome:
    """Run the plan's processes (a gang: the first failure stops the rest); their merged
    output goes to <run>/train.log (<run>/train-attempt-<n>.log for a restart; and `echo`,
    if given)."""
    write_files(p)
    env = dict(os.environ) | p.env
    log_path = p.run_dir / ("train.log" if not attempt else f"train-attempt-{attempt}.log")
    lines: queue.Queue = queue.Queue()
    procs: dict[str, subprocess.Popen] = {}
    start = time.monotonic()
    with log_path.open("w") as log:
        for name, script in p.scripts.items():
            procs[name] = subprocess.Popen(["sh", "-c", script], env=env, cwd=p.run_dir,
                                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                           text=True, errors="replace", start_new_session=True)
            if p.rdzv_port and len(procs) == 1:
                # In a cluster worker 0 hosts the rendezvous store (the endpoint is its name);
                # here every agent is on 127.0.0.1 and the first to bind would host it, so a
                # failing rank could take the store down with it: let worker 0 bind first.
                _wait_for_port(p.rdzv_port, procs[name])
        readers = [threading.Thread(target=_pump, args=(proc.stdout, lines), daemon=True)
                   for proc in procs.values()]
        for reader in readers:
            reader.start()
        reports: list[dict] = []
        failure = None
        stall = p.job.run_policy.stall_timeout_seconds
        moved = (None, start)  # (step, when) of the last report whose step moved, as the operator
        try:
            while any(r.is_alive() for r in readers) or not lines.empty():
                try:
                    line = lines.get(timeout=0.5)
                except queue.Empty:
                    progress.tick()
                else:
                    log.write(line)
                    if echo is not None:
                        echo.write(line)
                    if (record := parse_report(line)) is not None:
                        reports.append(record)
                        progress.report(record)
                        if record.get("step") != moved[0]:
                            moved = (record.get("step"), time.monotonic())
                failed = [(n, pr.returncode) for n, pr in procs.items() if pr.poll() not in (None, 0)]
                if failed and failure is None:
                    name, code = failed[0]
                    failure = f"{name} exited with code {code}"
                    _stop(procs)
                if stall and failure is None and moved[0] is not None and time.monotonic() - moved[1] > stall:
                    failure = (f"Stall: no step past {moved[0]} for {stall}s "
                               f"(runPolicy.stallTimeoutSeconds; every rank's stacks are in the log)")
                    _stop(procs)
                if deadline_seconds and failure is None and time.monotonic() - start > deadline_seconds:
                    failure = f"spec.runPolicy.activeDeadlineSeconds ({deadline_seconds}s) exceeded"
                    _stop(procs)
        except BaseException:
            _stop(procs)
            raise
        finally:
            progress.close()
        for name, proc in procs.items():
            code = proc.wait()
            if code and failure is None:
                failure = f"{name} exited with code {code}"
    if failure is None and p.trainer and not any(r.get("final") for r in reports):
        failure = "the trainer ended without its final report"
    return Outcome(ok=failure is None, seconds=time.monotonic() - start, reports=reports,
                   failure=failure, log=log_path, checkpoint=_checkpoint(p.output_dir))


def _pump(stream, lines: queue.Queue) -> None:
    for line in stream:
        lines.put(line)
    stream.close()


def _checkpoint(output_dir: Path) -> Path | None:
    """The trainer's last saved model: the newest file in the output folder but the metrics."""
    files = [f for f in output_dir.glob("*") if f.is_file() and f.suffix != ".jsonl"]
    return max(files, key=lambda f: f.stat().st_mtime_ns) if files else None


def summary(p: Plan, outcome: Outcome) -> list[tuple[str, str]]:
    """The final table's rows."""
    final = outcome.final or {}
    job = p.job
    rows = [("job", f"{job.name} ({job.framework}, launcher {job.launcher}, "
                    f"{job.workers} workers x {job.slots_per_worker} rank{'s' if job.slots_per_worker > 1 else ''})")]
    if final:
        total = float(final["imagesPerSec"])
        rows += [("images/sec (all ranks)", f"{total:,.1f}"),
                 ("images/sec per worker", f"{total / job.workers:,.1f}"),
                 ("images/sec per rank", f"{float(final['imagesPerSecPerGPU']):,.1f}"),
                 ("final loss", f"{float(final['loss']):.4f}"),
                 ("steps", f"{final['step']} ({final['epoch']} epochs)")]
    rows += [("wall time", f"{outcome.seconds:.0f} s"),
             ("checkpoint", str(outcome.checkpoint) if outcome.checkpoint else "none written"),
             ("metrics", str(p.output_dir / "metrics.jsonl")),
             ("log", str(outcome.log))]
    return rows
