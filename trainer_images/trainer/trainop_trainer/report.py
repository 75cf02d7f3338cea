"""What a run reports: JSON-lines metrics (rank 0), the same reports as TensorBoard scalars
(events.py), the reference's "Total images/sec" line, and each rank's parameter digest; plus the
learning-rate schedule every framework shares.

Metric keys are the trainer contract (docs/DEVELOPING.md) and go straight into the job's
status.metrics, so they are camelCase and fixed (the operator copies only the keys it knows:
render/logship.METRIC_KEYS). `totalSteps` and `time` (Unix seconds of the
report) let the operator show percent done and an ETA (status.progress).
"""

from __future__ import annotations

import faulthandler
import hashlib
import io
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from trainop_trainer import events as events_mod


def learning_rate(step: int, steps_per_epoch: int, base_lr: float, world_size: int, warmup_epochs: float) -> float:
    """Goyal et al.: the rate grows linearly from base_lr to base_lr * world_size over the warm-up."""
    peak = base_lr * world_size
    warmup_steps = warmup_epochs * steps_per_epoch
    if step >= warmup_steps:
        return peak
    return base_lr + (peak - base_lr) * step / warmup_steps


@dataclass
class Reporter:
    metrics_file: Path
    world_size: int
    global_batch: int
    chief: bool
    total_steps: int | None = None  # steps of the whole run (epochs x steps per epoch)
    events: Any = None  # events.open_writer(...) on the chief: the reports as TensorBoard scalars
    transport: str | None = None  # "IB" | "Socket": the network NCCL chose (nccl.py); None: no NCCL
    report_seconds: float = 0.0  # rank 0 also reports within an epoch, at most this often (0: never)
    # runPolicy.stallTimeoutSeconds ($TRAINOP_STALL_SECONDS): every rank writes its Python stacks
    # to stderr (its log) when no step ends for half of it (0: no watchdog). Half: the operator
    # counts from the last report, at most a quarter (report_seconds) before the last step, and
    # must find the stacks written when it stops the gang. faulthandler, not py-spy: it needs no
    # ptrace capability (the pods have none), and its C watchdog thread dumps every thread even
    # while the main thread is blocked inside a collective.
    stall_seconds: float = 0.0
    # Bad samples the gang skipped (data.BadSamples), as of the last epoch's collective (reports
    # within an epoch repeat it: they gather nothing); None: synthetic data, no key reported.
    bad_samples: int | None = None
    # --min-step-seconds: alive() sleeps what is left of it after each step. Every rank holds its
    # own steps alike, so the ranks still meet in each collective together.
    min_step_seconds: float = 0.0
    _held_until: float = 0.0  # perf_counter() before which the current step may not end
    _tick: tuple[float, int] | None = None  # (time, global step) of the last report within the epoch
    # (seconds, steps) per epoch, seconds derived from the gathered throughput. Epochs after the
    # first (which holds compilation and warm-up) make the final figure, as in the reference.
    _epochs: list[tuple[float, int]] = field(default_factory=list)

    def epoch(self, epoch: int, step: int, loss: float, total_images_per_sec: float, steps: int) -> None:
        """`total_images_per_sec`: the sum of every rank's own throughput over this epoch's steps."""
        seconds = steps * self.global_batch / total_images_per_sec
        self._epochs.append((seconds, steps))
        self._emit(epoch, step, loss, total_images_per_sec, seconds / steps, final=False)

    def start_epoch(self, step: int) -> None:
        """An epoch begins at global step `step`: the clock of the reports within it starts."""
        self._tick = (time.perf_counter(), step)

    def alive(self) -> None:
        """A step ended (every rank calls it): held to --min-step-seconds (the first step of the
        run is not: it holds the warm-up), then the stall watchdog starts its count again."""
        if self.min_step_seconds:
            time.sleep(max(0.0, self._held_until - time.perf_counter()))
            self._held_until = time.perf_counter() + self.min_step_seconds
        if self.stall_seconds:
            faulthandler.dump_traceback_later(self.stall_seconds / 2, exit=False)

    def due(self) -> bool:
        """A report within the epoch is due (rank 0, at most every `report_seconds`)."""
        return bool(self.chief and self.report_seconds and self._tick is not None
                    and time.perf_counter() - self._tick[0] >= self.report_seconds)

    def between(self, epoch: int, step: int, loss: float) -> None:
        """A report within an epoch, from the chief's own view (no collective: no rank waits for
        it): its throughput since the last report times the ranks. An ImageNet epoch is many
        minutes, and status.progress's ETA moves only when a report comes. Not part of the
        final figure, which the epochs' gathered throughput makes."""
        began, since = self._tick
        now, done = time.perf_counter(), max(1, step - since)
        self._emit(epoch, step, loss, done * self.global_batch / (now - began), (now - began) / done, final=False)
        self._tick = (now, step)

    def final(self, epoch: int, step: int, loss: float) -> None:
        faulthandler.cancel_dump_traceback_later()
        timed = self._epochs[1:] or self._epochs
        seconds = sum(s for s, _ in timed)
        steps = sum(n for _, n in timed)
        # no epoch ran: a run resumed from a checkpoint of its last step has nothing left to time
        total = steps * self.global_batch / seconds if steps else 0.0
        self._emit(epoch, step, loss, total, seconds / steps if steps else 0.0, final=True)
        if self.chief:
            write_line(sys.stdout, f"Total images/sec: {total:.1f}")
        if self.events is not None:
            self.events.close()

    def _emit(self, epoch, step, loss, total, step_time, final):
        if not self.chief:
            return
        record = {
            "epoch": epoch,
            "step": step,
            "loss": round(float(loss), 6),
            "imagesPerSec": round(total, 2),
            "imagesPerSecPerGPU": round(total / self.world_size, 2),
            "stepTime": round(step_time, 6),
            "worldSize": self.world_size,
            "final": final,
            "time": round(time.time(), 3),
        }
        if self.total_steps:
            record["totalSteps"] = self.total_steps
        if self.transport:
            record["transport"] = self.transport
        if self.bad_samples is not None:
            record["badSamples"] = self.bad_samples
        line = json.dumps(record)
        write_line(sys.stdout, line)
        with open(self.metrics_file, "a") as f:
            f.write(line + "\n")
        if self.events is not None and not final:  # the final report repeats the last epoch's step
            self.events.scalars(step, events_mod.scalars_of(record))


def parameter_digest(arrays) -> str:
    """sha256 over the exact bytes of every trainable parameter, in model order."""
    h = hashlib.sha256()
    for a in arrays:
        h.update(np.ascontiguousarray(a, dtype=np.float32).tobytes())
    return h.hexdigest()


def log_digest(rank: int, size: int, digest: str) -> None:
    # stderr, one line per rank: lets anyone compare ranks after a run (they must be equal).
    write_line(sys.stderr, f"trainop_trainer: rank {rank}/{size} parameter sha256 {digest}")


def write_line(stream, line: str) -> None:
    """`line` and its newline in ONE write(). Every rank shares the launcher's stdout and stderr
    pipes, and print() under PYTHONUNBUFFERED (what the images and the tests set) writes the text
    and the newline in two calls: ranks that finish together (the last collective releases
    them at once) could then write "rank 0 ... <d0>rank 1 ... <d1>\n\n", one line holding two
    reports, and a reader that takes one report per line loses one (a rank that exited 0 with
    no digest). POSIX makes a write of at most PIPE_BUF (4096) bytes to a pipe atomic."""
    data = (line + "\n").encode()
    try:
        fd = stream.fileno()
    except (AttributeError, OSError, io.UnsupportedOperation):  # an in-memory stream (tests)
        stream.write(line + "\n")
        stream.flush()
        return
    stream.flush()  # whatever was written before goes first
    while data:
        data = data[os.write(fd, data):]
