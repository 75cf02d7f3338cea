"""Checkpoints that a restarted gang resumes from: saved every N steps and on SIGTERM, atomically,
into one folder per attempt; loaded by rank 0 and broadcast, so only rank 0's host needs them.

Layout (the operator's contract, docs/long-runs.md):

    <root>/attempt-<n>/step-<k>/state.pt   PyTorch: model, optimizer, step, epoch, every rank's RNG state,
                                           as tensors and plain data only (loaded with
                                           torch.load(weights_only=True): no pickled object, so
                                           a file someone else wrote cannot run code here)
    <root>/attempt-<n>/step-<k>/state.index, state.data-*
                                           TensorFlow/Keras: a tf.train.Checkpoint of the model,
                                           optimizer, step (the data position) and RNG
    <root>/attempt-<n>/step-<k>/COMPLETE   JSON {"step", "epoch", "time", "worldSize", "files",
                                           "saveSeconds"}, and for an elastic run (elastic.py)
                                           "elastic": {"maxWorld", "globalBatch", "batchSize"} and
                                           "samples" (the global data position: step x globalBatch)

A checkpoint is resumed at the world size that saved it; an elastic run's (TRAINOP_ELASTIC_MAX_WORLD)
at any size that divides its maximum (elastic.check_resume says what else is accepted and why).

`saveSeconds` is how long the state files took to serialise, write and fsync: the log shipper
reports it, and the operator sizes the pods' terminationGracePeriodSeconds from the slowest save
(docs/long-runs.md), so that the save on SIGTERM fits.

A checkpoint is written into `<root>/attempt-<n>/.step-<k>.tmp`, every file and the folder
fsynced, COMPLETE last, then renamed to `step-<k>` (rename is atomic within one file system) and
the parent fsynced: a reader (the next attempt, the log shipper that uploads it) sees either no
`step-<k>` or a whole one, and a crash mid-write leaves only a `.tmp` folder that is ignored and
later removed. A copy elsewhere (Blob) is complete when its COMPLETE is, which is uploaded last.

Settings come from flags or, so that any training code launched by the operator can use them,
from the environment the operator renders: TRAINOP_CHECKPOINT_DIR (this attempt's folder),
TRAINOP_CHECKPOINT_EVERY (steps), TRAINOP_RESUME_FROM (a checkpoint folder, `latest` for the
newest complete one under the checkpoint root, or empty).

Only the job's own checkpoints are read: with a checkpoint folder set, a folder to resume from
must lie, links resolved, under the checkpoint root (`<root>`, the operator names it by the
job's uid) or under FETCHED (where the operator's init container downloads the job's own blob
copy); `latest` follows no link out of the root.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

MARKER = "COMPLETE"
STATE = "state.pt"
LATEST = "latest"
# Where worker 0's fetch-checkpoint init container puts the job's own checkpoint from Blob
# Storage (the operator's trainop.resume.RESUME_DIR; tests/unit/test_resume.py holds them equal).
FETCHED = "/var/trainop/resume"
STOP_DEADLINE = 60.0  # seconds from SIGTERM to the step boundary where the save starts
KEEP = 2  # complete checkpoints kept per attempt folder: the newest, and one in case it is bad
_STEP = re.compile(r"^step-(\d+)$")
_ATTEMPT = re.compile(r"^attempt-(\d+)$")


class CheckpointError(ValueError):
    """A checkpoint that cannot be resumed from; the message names it and the fix."""


@dataclass(frozen=True)
class Settings:
    directory: Path | None  # this attempt's folder; None: checkpointing off
    every: int  # steps between checkpoints (0: only on SIGTERM)
    resume_from: str | None  # a folder, LATEST, or None


def step_of(path: Path) -> int | None:
    m = _STEP.match(path.name)
    return int(m.group(1)) if m else None


def is_complete(path: Path) -> bool:
    return step_of(path) is not None and (path / MARKER).is_file()


def latest(root: Path) -> Path | None:
    """The newest complete checkpoint under `root` (attempt folders, or one attempt's folder):
    the highest step, the later attempt on a tie. A link (to a folder elsewhere on a shared
    claim, say) is not followed."""
    root = Path(root)
    if not root.is_dir():
        return None
    found = []
    for attempt_dir in [root, *(p for p in root.iterdir() if _ATTEMPT.match(p.name) and not p.is_symlink())]:
        a = int(_ATTEMPT.match(attempt_dir.name).group(1)) if _ATTEMPT.match(attempt_dir.name) else -1
        for step_dir in attempt_dir.iterdir() if attempt_dir.is_dir() else ():
            if not step_dir.is_symlink() and is_complete(step_dir):
                found.append((step_of(step_dir), a, step_dir))
    return max(found)[2] if found else None


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(directory: Path, step: int, files: dict[str, object], meta: dict,
                 save=None) -> Path:
    """`files` (name -> object, written by `save(obj, path)`) as `<directory>/step-<step>`.
    `save` may write several files from one name (a tf.train.Checkpoint prefix writes
    `<name>.index` and `<name>.data-*`): every file it leaves is fsynced and listed in COMPLETE.
    Returns the final folder. Older complete checkpoints beyond KEEP are removed after."""
    started = time.monotonic()
    directory.mkdir(parents=True, exist_ok=True)
    final = directory / f"step-{step}"
    tmp = directory / f".step-{step}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    for name, obj in files.items():
        save(obj, tmp / name)
    written = sorted(p for p in tmp.rglob("*") if p.is_file())
    for path in written:
        with open(path, "rb+") as f:
            os.fsync(f.fileno())
    marker = dict(meta, step=step, time=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                  files=[str(p.relative_to(tmp)) for p in written],
                  saveSeconds=round(time.monotonic() - started, 1))
    with open(tmp / MARKER, "w") as f:
        f.write(json.dumps(marker, sort_keys=True) + "\n")
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(tmp)
    if final.exists():  # the same step saved twice (SIGTERM right after a periodic save)
        shutil.rmtree(final)
    os.rename(tmp, final)
    _fsync_dir(directory)
    _prune(directory)
    return final


def _prune(directory: Path) -> None:
    complete = sorted((p for p in directory.iterdir() if is_complete(p)), key=step_of)
    for old in complete[:-KEEP]:
        shutil.rmtree(old, ignore_errors=True)
    for tmp in directory.glob(".step-*.tmp"):  # a crash's leftovers
        shutil.rmtree(tmp, ignore_errors=True)


def resolve(resume_from: str | None, directory: Path | None, fetched: str = FETCHED) -> Path | None:
    """The folder to resume from: `latest` looks under the checkpoint root (the parent of this
    attempt's folder); a path must be a complete checkpoint, and with a checkpoint folder set,
    one of this job's own (under the root or `fetched`)."""
    if not resume_from:
        return None
    if resume_from == LATEST:
        if directory is None:
            raise CheckpointError("--resume-from latest needs --checkpoint-dir (or TRAINOP_CHECKPOINT_DIR)")
        return latest(directory.parent)
    path = Path(resume_from)
    if directory is not None:
        owns = [os.path.realpath(directory.parent), os.path.realpath(fetched)]
        real = os.path.realpath(path)
        if not any(real.startswith(root + os.sep) for root in owns):
            raise CheckpointError(f"--resume-from {path}: not one of this job's own checkpoints (resolves to "
                                  f"{real}, outside {directory.parent} and {fetched}); pass a step-<k> folder "
                                  f"under the checkpoint root, or `latest`")
    if not (path / MARKER).is_file():
        raise CheckpointError(f"--resume-from {path}: not a complete checkpoint (no {MARKER} file); "
                              f"pass a step-<k> folder written by the trainer, or `latest`")
    return path


class StopFlag:
    """SIGTERM sets it: the loop saves at the next step boundary (every rank agrees first) and
    ends. The pod's grace period leaves room for it (the operator sizes it from the slowest
    save, `saveSeconds`). A rank that cannot reach a step boundary (blocked in a collective
    with a dead peer) still ends: STOP_DEADLINE seconds after the SIGTERM, as SIGTERM's default
    action would have; once the gang has agreed to stop (`reached`), the save takes what it
    takes: only the pod's grace period ends it."""

    def __init__(self, deadline: float = STOP_DEADLINE):
        self.requested = False
        self.saving = False
        self.deadline = deadline

    def reached(self) -> None:
        """The step boundary where the gang saves and ends: no deadline from here on."""
        self.saving = True

    def install(self) -> None:
        signal.signal(signal.SIGTERM, self._set)

    def _set(self, signum, frame):
        if self.requested:
            return
        self.requested = True
        print("trainop_trainer: SIGTERM: saving a checkpoint at the next step", file=sys.stderr, flush=True)
        threading.Thread(target=self._expire, daemon=True).start()

    def _expire(self) -> None:
        time.sleep(self.deadline)
        if self.saving:
            return
        print(f"trainop_trainer: no step boundary {self.deadline:.0f}s after SIGTERM; exiting without a checkpoint",
              file=sys.stderr, flush=True)
        os._exit(143)


# ---- PyTorch --------------------------------------------------------------------------------
def torch_rng_state() -> dict:
    import random

    import numpy as np
    import torch

    # numpy's state as a list: an ndarray would need a pickled object (weights_only refuses it)
    name, keys, pos, has_gauss, cached = np.random.get_state()
    out = {"torch": torch.get_rng_state(), "numpy": [name, keys.tolist(), pos, has_gauss, cached],
           "python": random.getstate()}
    if torch.cuda.is_available():
        out["cuda"] = torch.cuda.get_rng_state_all()
    return out


def set_torch_rng_state(state: dict) -> None:
    import random

    import numpy as np
    import torch

    torch.set_rng_state(state["torch"])
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _meta(step: int, epoch: int, world_size: int, elastic) -> dict:
    meta = {"epoch": epoch, "worldSize": world_size}
    if elastic is not None:
        meta.update(elastic=elastic.meta(), samples=step * elastic.global_batch)
    return meta


def torch_save(directory: Path, step: int, epoch: int, world_size: int, model, optimizer,
               rng_states: list[dict], elastic=None) -> Path:
    """`elastic`: the run's elastic.Elastic (None: not elastic), recorded in state.pt and COMPLETE."""
    import torch

    meta = _meta(step, epoch, world_size, elastic)
    state = {"step": step, "model": model.state_dict(), "optimizer": optimizer.state_dict(), "rng": rng_states,
             **meta}
    return write_atomic(directory, step, {STATE: state}, meta, save=torch.save)


def torch_load(path: Path, world_size: int, elastic=None) -> dict:
    """The state saved in `path`, if a run of `world_size` ranks (`elastic`: its elastic.Elastic)
    may continue from it (elastic.check_resume); "warning": a line to write, or None."""
    import torch

    from trainop_trainer.elastic import check_resume

    if not (path / STATE).is_file():
        raise CheckpointError(f"{path}: no {STATE} (saved by TensorFlow/Keras?); resume with the framework "
                              f"that saved it, or start without it")
    try:
        # weights_only: tensors and plain data only. A pickle may name any callable to run on
        # load (__reduce__), and a checkpoint folder is written by more than this job's code
        # (a shared claim, a Blob container others can write).
        state = torch.load(path / STATE, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        why = str(exc).splitlines()[-1][:300] if str(exc) else type(exc).__name__
        raise CheckpointError(f"{path / STATE}: refused, it holds more than tensors and plain data ({why}); "
                              f"not a checkpoint this trainer wrote: start without it") from None
    state["warning"] = check_resume(path, state["worldSize"], state.get("elastic"), world_size, elastic)
    return state


# ---- TensorFlow and Keras --------------------------------------------------------------------
TF_STATE = "state"  # the tf.train.Checkpoint prefix: state.index, state.data-00000-of-00001


def tf_save(directory: Path, step: int, epoch: int, world_size: int, state, elastic=None) -> Path:
    """`state`: a tf.train.Checkpoint (model, optimizer, step, RNG), written by rank 0; `elastic`:
    the run's elastic.Elastic (None: not elastic), recorded in COMPLETE."""
    return write_atomic(directory, step, {TF_STATE: state}, _meta(step, epoch, world_size, elastic),
                        save=lambda ckpt, path: ckpt.write(str(path)))


def tf_load(path: Path, world_size: int, state, elastic=None) -> tuple[int, str | None]:
    """Restore `state` (a tf.train.Checkpoint of the same objects) from the folder `path`;
    every object of `state` must be found there (a model of another shape is refused). Returns
    (the world size that saved it, a WARNING line to write or None): elastic.check_resume."""
    from trainop_trainer.elastic import check_resume

    marker = json.loads((path / MARKER).read_text())
    saved = marker.get("worldSize")
    warning = check_resume(path, saved, marker.get("elastic"), world_size, elastic)
    if not (path / f"{TF_STATE}.index").is_file():
        raise CheckpointError(f"{path}: no {TF_STATE}.index (saved by PyTorch?); resume with the framework "
                              f"that saved it, or start without it")
    state.read(str(path / TF_STATE)).assert_existing_objects_matched()
    return saved, warning


STOP_CHECK_STEPS = 10


def when(step: int, every: int, anyone_stopping) -> tuple[bool, bool]:
    """(save now, stop now) after global step `step`, for every framework's saver. Ranks must
    agree on a SIGTERM before saving: `anyone_stopping()` is a one-float all-reduce, which also
    waits for the device, so it runs only every STOP_CHECK_STEPS steps (and at each save), not
    every step: the GPU's queue stays full in between."""
    due = bool(every) and step % every == 0
    stopping = bool((due or step % STOP_CHECK_STEPS == 0) and anyone_stopping())
    return due or stopping, stopping



class Saver:
    """A framework's saver, the rule both share: every `checkpoint_every` steps, and at the step
    where a SIGTERM is first seen (`when`), `write(step, epoch)` saves (rank 0 writes; a write may
    gather from every rank first); after a SIGTERM save every rank waits for rank 0's write (a
    barrier), so no launcher stops rank 0 mid-write. A framework gives `sum` (the gang's sum of a
    few floats) and `write` (returns the folder written on rank 0, else None)."""

    def __init__(self, cfg, world):
        self.cfg, self.world = cfg, world
        self.stop = StopFlag()
        if cfg.checkpoint_dir is not None:
            self.stop.install()

    def sum(self, values: list[float]) -> list[float]:
        raise NotImplementedError

    def write(self, step: int, epoch: int) -> Path | None:
        raise NotImplementedError

    def after_step(self, step: int, epoch: int) -> bool:
        """Save when due; True when the run must end now (SIGTERM)."""
        if self.cfg.checkpoint_dir is None:
            return False
        save, stopping = when(step, self.cfg.checkpoint_every,
                              lambda: self.sum([1.0 if self.stop.requested else 0.0])[0] > 0)
        if not save:
            return False
        if stopping:
            self.stop.reached()
        path = self.write(step, epoch)
        if path is not None:
            print(f"trainop_trainer: checkpoint step {step} saved in {path}", file=sys.stderr, flush=True)
        if stopping:
            self.sum([0.0])
        return stopping
