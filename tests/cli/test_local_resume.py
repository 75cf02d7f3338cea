"""Resume on restart, with real processes: `trainop run --local` of a job with a checkpoint volume;
a rank is killed (SIGKILL) once a checkpoint is complete; the gang restarts as the operator
restarts it, the next attempt resumes at the saved step, and the final parameters are bitwise
those of an uninterrupted run with the same seed (on CPU: deterministic kernels, the same
batches in the same order, and a two-rank sum that is the same whichever rank adds).
PyTorch with Horovod (mpirun) and native DDP (torchrun, gloo); TensorFlow (custom loop) and
Keras (model.fit) with Horovod, TensorFlow's op determinism on (TF_DETERMINISTIC_OPS=1)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
STEPS, EPOCHS, EVERY = 10, 2, 4  # 20 steps, checkpoints at 4, 8, ...
DIGEST = re.compile(r"rank 0/2 parameter sha256 ([0-9a-f]{64})")


def manifest(tmp_path: Path, name: str, framework: str, launcher: str, **spec) -> Path:
    job = {"apiVersion": "trainop.io/v1alpha1", "kind": "DistributedTrainingJob",
           "metadata": {"name": name},
           "spec": {"framework": framework, "launcher": launcher, "workers": 2, "gpusPerWorker": 1,
                    "data": {"synthetic": True}, "training": {"batchSize": 4, "imageSize": 32},
                    "checkpoint": {"everySteps": EVERY, "volume": {"claimName": "checkpoints"}},
                    "runPolicy": {"backoffLimit": 2}, **spec}}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


def start(path: Path, state: Path, epochs: int = EPOCHS) -> subprocess.Popen:
    env = dict(os.environ, TRAINOP_STATE=str(state), OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="",
               TF_DETERMINISTIC_OPS="1", TF_CPP_MIN_LOG_LEVEL="3")
    return subprocess.Popen([sys.executable, "-m", "trainop", "run", str(path), "--local",
                             "--epochs", str(epochs), "--steps", str(STEPS)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO)


def rank_pid(run_dir: Path, rank: int) -> int | None:
    """The trainer process of `rank` in this run (found by its environment, as the launcher set it)."""
    want = f"TRAINOP_CHECKPOINT_DIR={run_dir}/".encode()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            env = (proc / "environ").read_bytes().split(b"\0")
            cmd = (proc / "cmdline").read_bytes()
        except OSError:
            continue
        if b"trainop_trainer" in cmd and any(e.startswith(want) for e in env) and \
                (f"OMPI_COMM_WORLD_RANK={rank}".encode() in env or f"RANK={rank}".encode() in env):
            return int(proc.name)
    return None


def wait_for(what: str, fn, proc: subprocess.Popen, timeout: float = 240):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = fn()
        if value:
            return value
        assert proc.poll() is None, f"the run ended before {what}: {proc.stdout.read()}"
        time.sleep(0.05)
    raise AssertionError(f"no {what} within {timeout}s")


def digest(run_dir: Path, log: str) -> str:
    found = DIGEST.findall((run_dir / log).read_text())
    assert len(found) == 1, (run_dir / log).read_text()[-3000:]
    return found[0]


@pytest.mark.trainer
@pytest.mark.mpi
@pytest.mark.timeout(600)
@pytest.mark.parametrize("framework,launcher", [("pytorch", "mpi"), ("pytorch", "torchrun"),
                                                ("tensorflow", "mpi"), ("keras", "mpi")])
def test_killed_rank_restarts_the_gang_which_resumes_and_ends_bitwise_equal(tmp_path, framework, launcher):
    name = f"resume-{framework}-{launcher}"
    path = manifest(tmp_path, name, framework, launcher)
    state = tmp_path / "state"
    runs = state / "runs" / name

    # 1. uninterrupted
    plain = start(path, state)
    out, _ = plain.communicate(timeout=300)
    assert plain.returncode == 0, out
    expected = digest(runs / "1", "train.log")

    # 2. rank 1 killed once a checkpoint is complete
    run = start(path, state)
    run_dir = runs / "2"
    saved = wait_for("complete checkpoint", lambda: sorted(
        run_dir.glob("checkpoints/*/attempt-0/step-*/COMPLETE")), run)
    killed_after = int(saved[0].parent.name[5:])
    os.kill(wait_for("rank 1", lambda: rank_pid(run_dir, 1), run), signal.SIGKILL)
    out, _ = run.communicate(timeout=300)
    assert run.returncode == 0, out + "".join(f"\n--- {log.name}:\n" + log.read_text()[-4000:]
                                              for log in sorted(run_dir.glob("train*.log")))
    assert "attempt 1: restarting the gang" in out, out

    # the second attempt started at the step it was given, the newest complete checkpoint then
    second = (run_dir / "train-attempt-1.log").read_text()
    resumed = re.search(r"resuming from (\S+)/attempt-0/step-(\d+) at step (\d+)", second)
    assert resumed, second[-3000:]
    assert int(resumed[2]) == int(resumed[3]) >= killed_after
    assert int(resumed[3]) < STEPS * EPOCHS
    assert list(run_dir.glob("checkpoints/*/attempt-1/step-*/COMPLETE"))  # it saved into its own folder
    assert digest(run_dir, "train-attempt-1.log") == expected
