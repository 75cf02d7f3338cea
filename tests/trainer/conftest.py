"""Helpers for the trainer's acceptance tests: real 2-rank runs under mpirun (Open MPI) and
torchrun on CPU, each run once and shared by the tests that read it."""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest

VENV_BIN = Path(sys.executable).parent
# Tiny configuration: 32 px images, ResNet-18, a handful of steps; the synthetic task is learnable.
TINY = ["--synthetic", "--image-size", "32", "--model", "resnet18", "--num-classes", "4", "--synthetic-batches", "2",
        "--batch-size", "8", "--epochs", "3", "--steps-per-epoch", "4", "--warmup-epochs", "1",
        "--base-lr", "0.002", "--loader-workers", "1",
        "--report-seconds", "0"]  # one report per epoch: tests count them (test_report.py tests the others)
RUN_TIMEOUT = 300


def free_port_block(n: int = 4) -> int:
    """A base port with `n` consecutive free ports (rendezvous + one per TensorFlow worker)."""
    for _ in range(100):
        # Below Linux's ephemeral range (32768+), where other processes' outgoing connections land.
        base = random.randint(20000, 32000 - n)
        try:
            socks = []
            for p in range(base, base + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free port block")


def base_env() -> dict:
    env = dict(os.environ)
    env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", TF_CPP_MIN_LOG_LEVEL="3",
               OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", CUDA_VISIBLE_DEVICES="",
               HOROVOD_CYCLE_TIME="50")  # as `trainop run --local` sets it (why: localrun.HOROVOD_CYCLE_TIME)
    env.pop("TF_CONFIG", None)
    return env


def launch_command(launcher: str, ranks: int, args: list[str], port: int) -> list[str]:
    trainer = ["-m", "trainop_trainer", *args]
    if launcher == "mpirun":
        return [shutil.which("mpirun") or "mpirun", "-np", str(ranks), "--oversubscribe", "--bind-to", "none",
                "-x", "PYTHONUNBUFFERED", "-x", "OMP_NUM_THREADS", "-x", "TF_CPP_MIN_LOG_LEVEL",
                "-x", "CUDA_VISIBLE_DEVICES", "-x", "HOROVOD_CYCLE_TIME", "-x", f"MASTER_PORT={port}",
                sys.executable, *trainer]
    if launcher == "torchrun":
        return [str(VENV_BIN / "torchrun"), "--nnodes", "1", "--nproc-per-node", str(ranks),
                "--master-addr", "127.0.0.1", "--master-port", str(port), *trainer]
    return [sys.executable, *trainer]


DIGEST = re.compile(r"trainop_trainer: rank (\d+)/\d+ parameter sha256 ([0-9a-f]{64})")


def parse_digests(stderr: str) -> dict[int, str]:
    """rank -> digest, wherever the report sits in the stream: the ranks and TensorFlow's C++
    logger share one pipe, so a report is not assumed to own a line. A rank that reports twice
    with different digests keeps both visible (the identity check then fails)."""
    out: dict[int, str] = {}
    for match in DIGEST.finditer(stderr):
        rank, digest = int(match.group(1)), match.group(2)
        out[rank] = digest if out.get(rank, digest) == digest else f"{out[rank]}|{digest}"
    return out


@dataclass
class Run:
    returncode: int
    lines: list[tuple[float, str]]  # stdout lines with their arrival time (monotonic seconds)
    stderr: str
    wall: float
    output_dir: Path
    args: list[str] = field(default_factory=list)

    @property
    def records(self) -> list[dict]:
        return [json.loads(line) for _, line in self.lines if line.startswith("{")]

    @property
    def digests(self) -> dict[int, str]:
        return parse_digests(self.stderr)

    def explain(self) -> str:
        return f"exit {self.returncode}\nstdout:\n" + "\n".join(text for _, text in self.lines) + f"\nstderr:\n{self.stderr[-4000:]}"


def run_trainer(launcher: str, args: list[str], output_dir: Path, ranks: int = 2) -> Run:
    output_dir.mkdir(parents=True, exist_ok=True)
    full = [*args, "--output-dir", str(output_dir)]
    cmd = launch_command(launcher, ranks, full, free_port_block())
    start = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=base_env(),
                            cwd=output_dir)
    lines: list[tuple[float, str]] = []
    err: list[str] = []
    reader = threading.Thread(target=lambda: err.extend(proc.stderr), daemon=True)
    reader.start()
    for line in proc.stdout:  # timestamps as lines arrive: compared with the reported throughput
        lines.append((time.monotonic(), line.rstrip("\n")))
    try:
        proc.wait(timeout=RUN_TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    reader.join(timeout=10)
    return Run(proc.returncode, lines, "".join(err), time.monotonic() - start, output_dir, full)


@pytest.fixture(scope="session")
def trainer_runs(tmp_path_factory):
    """Memoized runs: several tests read one run instead of training again."""
    cache: dict[tuple, Run] = {}

    def get(launcher: str, framework: str, backend: str, extra: tuple[str, ...] = (), ranks: int = 2) -> Run:
        key = (launcher, framework, backend, extra, ranks)
        if key not in cache:
            out = tmp_path_factory.mktemp(f"{launcher}-{framework}-{backend}")
            cache[key] = run_trainer(launcher, ["--framework", framework, "--backend", backend, *TINY, *extra],
                                     out, ranks)
        return cache[key]

    return get


def make_image_folder(root: Path, classes: int = 3, per_class: int = 8) -> Path:
    """A tiny ImageNet-style set: `<wnid>/<name>.JPEG`, each class its own colour plus noise."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    for c in range(classes):
        d = root / f"n{c:08d}"
        d.mkdir(parents=True)
        for i in range(per_class):
            colour = np.array([80 * c % 256, 255 - 60 * c, 40 + 50 * c], dtype=np.float32)
            pixels = np.clip(colour + rng.normal(0, 30, (40 + i, 48, 3)), 0, 255).astype(np.uint8)
            Image.fromarray(pixels).save(d / f"n{c:08d}_{i}.JPEG", quality=90)
    return root


@pytest.fixture(scope="session")
def image_folder(tmp_path_factory) -> Path:
    return make_image_folder(tmp_path_factory.mktemp("imagenet") / "train")


@pytest.fixture(scope="session")
def image_tars(image_folder, tmp_path_factory) -> Path:
    """The same images as two .tar shards of `<class>/<image>` members (every other file in each)."""
    import tarfile

    root = tmp_path_factory.mktemp("imagenet-tar")
    files = sorted(image_folder.glob("*/*.JPEG"))
    for k in range(2):
        with tarfile.open(root / f"train-{k:02d}.tar", "w") as tar:
            for f in files[k::2]:
                tar.add(f, arcname=f"{f.parent.name}/{f.name}")
    return root


class Background:
    """Runs that tests only read (never time), started when collection ends and done one after
    another in a thread of their own, their processes at nice 19 (issue 29).

    Why: the trainer's tests are CPU-bound and come after tests/cluster and tests/e2e, which keep
    the 2 cores only 40-75 % busy while they wait on their clusters (docs/DEVELOPING.md, "Where
    the cores are idle"). At nice 19 a run takes the cores only when the tests before it leave
    them idle (the kernel gives it 1.5 % of a core that a nice-0 process wants), and the test that
    reads it finds it done. Run alone, nothing else wants the cores: it takes as long as before.

    That holds only where the kernel does not group processes by session (sched(7), "The
    autogroup feature"). This project's machine does, and each run starts a session of its own,
    which the scheduler weighs as one nice-0 process whatever its processes' nice: a chain takes
    a fair share beside the lanes (four Keras ranks at 13 % of a core each beside an e2e test's
    pods, 2026-12-07). That is what the measured runs had (test_elastic found its chains done).
    Not done: the session's autogroup at nice 19 too (/proc/<pid>/autogroup), which would keep
    the chains to idle cores; the two lanes keep both cores busy, and test_elastic, in the main
    lane that ends last, waits for its chain, so it could lengthen the run; not measured.
    """

    def __init__(self) -> None:
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="trainer-background")
        self.futures: dict[tuple, Future] = {}
        self.groups: set[int] = set()  # process groups still running, killed at the session's end

    def submit(self, key: tuple, fn, *args) -> None:
        if key not in self.futures:
            self.futures[key] = self.pool.submit(fn, *args)

    def run(self, cmd: list[str], timeout: float, **kw) -> subprocess.CompletedProcess:
        """subprocess.run at nice 19, in a process group of its own (mpirun's ranks included)."""
        proc = subprocess.Popen(cmd, preexec_fn=lambda: os.nice(19), start_new_session=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)
        self.groups.add(proc.pid)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            raise
        finally:
            self.groups.discard(proc.pid)
        return subprocess.CompletedProcess(cmd, proc.returncode, out, err)

    def stop(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        for group in list(self.groups):
            try:
                os.killpg(group, signal.SIGKILL)
            except ProcessLookupError:
                pass


BACKGROUND = Background()


def pytest_collection_finish(session):
    """The elastic chains of the collected tests/trainer/test_elastic.py cases start now (not
    for `--collect-only`, which runs nothing)."""
    if session.config.option.collectonly:
        return
    cases = list(dict.fromkeys(  # in the tests' order: the first test's chain is done first
        item.callspec.params["chained"] for item in session.items
        if item.path.parent.name == "trainer" and item.path.name == "test_elastic.py"
        and "chained" in getattr(getattr(item, "callspec", None), "params", {})))
    if cases:
        from tests.trainer import test_elastic

        # (pytest's own factory, which the tmp_path_factory fixture returns; fixtures are not
        # available to a hook)
        test_elastic.start_chains(cases, session.config._tmp_path_factory)


def pytest_sessionfinish(session):
    BACKGROUND.stop()
