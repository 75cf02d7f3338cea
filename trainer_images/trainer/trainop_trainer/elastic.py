"""Elastic training (issue 26, docs/elastic.md): a run that resumes at another world size
continues the same training.

The operator sets TRAINOP_ELASTIC_MAX_WORLD (spec.elastic's maxWorkers x ranks per worker) on
every rank of an elastic job. Then:

- The global batch is `--batch-size` x TRAINOP_ELASTIC_MAX_WORLD at every world size: a step is
  that many micro-batches ("parts") of `--batch-size` images, and a world of W ranks gives each
  rank max_world / W consecutive parts, whose gradients it accumulates before the one all-reduce
  of the step. A part holds the same images at every size, so a forward pass (batch-norm's batch
  statistics included) sees what it saw in the uninterrupted run.
- The data order is global (data.GlobalPlan): one shuffle of the whole set per data epoch, the
  same at every size; step k of an epoch is samples [k x G, (k + 1) x G) of it. The position is
  the global step, so a run at any size continues the epoch's remainder, no sample twice, none
  skipped.
- The learning-rate schedule is a function of the optimizer step, with the peak scaled by
  max_world (the global batch over --batch-size), not by the ranks present: a resize leaves it as
  it was.

A world size that does not divide max_world is refused: the parts would not share out evenly.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

ENV = "TRAINOP_ELASTIC_MAX_WORLD"


class ElasticError(ValueError):
    """TRAINOP_ELASTIC_MAX_WORLD that this world cannot train with; the message names the sizes."""


@dataclass(frozen=True)
class Elastic:
    max_world: int  # parts per global batch: TRAINOP_ELASTIC_MAX_WORLD
    world: int  # ranks of this run
    batch_size: int  # images per part (--batch-size)

    @property
    def accumulation(self) -> int:
        """Parts (micro-batches) each rank trains on per optimizer step."""
        return self.max_world // self.world

    @property
    def global_batch(self) -> int:
        return self.batch_size * self.max_world

    def parts(self, rank: int) -> range:
        """The parts of every global batch that `rank` trains on: consecutive, so a rank's reads of
        a step stay together (sequential tar blocks)."""
        return range(rank * self.accumulation, (rank + 1) * self.accumulation)

    def meta(self) -> dict:
        """What a checkpoint records (COMPLETE and state.pt): the unit of its data position."""
        return {"maxWorld": self.max_world, "globalBatch": self.global_batch, "batchSize": self.batch_size}


def from_env(env, world: int, batch_size: int) -> Elastic | None:
    """The run's Elastic settings, or None when the job is not elastic (the variable unset or
    empty). Refuses a value that is no positive integer, or that `world` does not divide."""
    raw = (env.get(ENV) or "").strip()
    if not raw:
        return None
    if not raw.isdigit() or int(raw) <= 0:
        raise ElasticError(f"{ENV}={raw!r}: not a positive number of ranks")
    max_world = int(raw)
    if world > max_world:
        raise ElasticError(f"{ENV}={max_world}, but this run has {world} ranks: the world may shrink below the "
                           f"maximum, never grow above it")
    if max_world % world:
        sizes = [d for d in range(1, max_world + 1) if max_world % d == 0]
        raise ElasticError(f"{world} ranks cannot share the global batch of {max_world} parts of --batch-size "
                           f"{batch_size} ({ENV}={max_world}) evenly; run at one of {sizes} ranks")
    return Elastic(max_world, world, batch_size)


def resume_line(saved_world: int, elastic: Elastic, step: int, steps_per_epoch: int) -> str:
    """The INFO line a resume at another world size writes (rank 0)."""
    epoch, k = divmod(step, steps_per_epoch)
    return (f"trainop_trainer: INFO: elastic resume: {saved_world} ranks -> {elastic.world} ranks, "
            f"{elastic.accumulation} accumulation step(s) per optimizer step (global batch {elastic.global_batch} = "
            f"{elastic.batch_size} x {elastic.world} ranks x {elastic.accumulation}), "
            f"data position: step {step}, epoch {epoch + 1} sample {k * elastic.global_batch} of "
            f"{steps_per_epoch * elastic.global_batch}")


def check_resume(path, saved_world: int, saved: dict | None, world: int, elastic: Elastic | None) -> str | None:
    """Whether a run of `world` ranks (`elastic` its settings, None: not elastic) may continue from
    the checkpoint `path` saved by `saved_world` ranks (`saved`: its elastic record, None: saved
    without). Raises CheckpointError naming why not; returns a WARNING line to write, or None."""
    from trainop_trainer.checkpoint import CheckpointError

    if elastic is None:
        if saved:
            raise CheckpointError(f"{path}: saved by an elastic run (global batch {saved['globalBatch']} over up to "
                                  f"{saved['maxWorld']} ranks); resume it with {ENV}={saved['maxWorld']} "
                                  f"(spec.elastic), or start without it")
        if saved_world != world:
            raise CheckpointError(f"{path}: saved by {saved_world} ranks, this run has {world}; resume with the "
                                  f"same workers x slotsPerWorker, or start without it")
        return None
    if not saved:
        if saved_world != world:
            raise CheckpointError(f"{path}: saved by {saved_world} ranks without elastic training (its data "
                                  f"position is per rank), this run has {world}; resume it with {saved_world} "
                                  f"ranks, or start without it")
        return (f"trainop_trainer: WARNING: {path} was saved without elastic training: the rest of its data "
                f"epoch follows the elastic order from the same step, so samples of that epoch may repeat or "
                f"be missed; the epochs after it are exact")
    if (saved["maxWorld"], saved["globalBatch"]) != (elastic.max_world, elastic.global_batch):
        raise CheckpointError(f"{path}: saved with a global batch of {saved['globalBatch']} over up to "
                              f"{saved['maxWorld']} ranks, this run's is {elastic.global_batch} over up to "
                              f"{elastic.max_world}; resume with the same --batch-size and {ENV}, or start "
                              f"without it")
    return None


class SampleLog:
    """--sample-log: every rank appends one JSON line per optimizer step, {"step" (the global
    step it ends: 1 for the first), "epoch" (1-based), "rank", "worldSize", "samples" (the indices
    in the data set's order of the samples this rank trained on in it; absent for synthetic data),
    "loss" (this rank's share of the step's mean loss: the shares of a step sum to it; absent
    where the framework does not give it: Keras's model.fit outside an elastic run)}. One
    write() per line on a file opened for appending, so the ranks' lines do not interleave."""

    def __init__(self, path, rank: int, world: int):
        self.rank, self.world = rank, world
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def step(self, step: int, epoch: int, samples: list[int] | None, loss: float | None) -> None:
        record = {"step": step, "epoch": epoch, "rank": self.rank, "worldSize": self.world}
        if loss is not None:
            record["loss"] = loss
        if samples is not None:
            record["samples"] = samples
        os.write(self.fd, (json.dumps(record) + "\n").encode())
