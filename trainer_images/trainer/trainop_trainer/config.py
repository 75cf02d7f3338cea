"""One run's settings, as cli.parse() resolved them. Its own module so that the training
modules (torch_train, tf_train) and cli.py, which imports them, do not import each other."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from trainop_trainer.data import MAX_BAD_SAMPLES
from trainop_trainer.elastic import Elastic


@dataclass(frozen=True)
class Config:
    framework: str
    backend: str  # "horovod" or "native" once resolved
    synthetic: bool
    data_dir: Path | None
    batch_size: int  # per worker (an elastic run: per micro-batch, elastic.py)
    epochs: int
    steps_per_epoch: int | None
    image_size: int
    model: str
    num_classes: int
    synthetic_batches: int
    precision: str  # fp32 | bf16 | fp64
    channels_last: bool
    compile: bool
    output_dir: Path
    metrics_file: Path
    base_lr: float
    warmup_epochs: float
    momentum: float
    weight_decay: float
    loader_workers: int | None  # None: auto (data.auto_workers)
    decode: str  # auto | cpu | gpu (PyTorch)
    read_mode: str  # auto | sequential | random
    seed: int
    # checkpoint.py: this attempt's folder (None: off), steps between saves, where to resume
    checkpoint_dir: Path | None = None
    checkpoint_every: int = 0
    resume_from: str | None = None
    report_seconds: float = 60.0  # rank 0 also reports within an epoch, at most this often (0: never)
    stall_seconds: float = 0.0  # the hang timeout: every rank's stacks to stderr after half of it (0: off)
    min_step_seconds: float = 0.0  # every step held to at least this wall time (report.Reporter.alive)
    max_bad_samples: float = MAX_BAD_SAMPLES  # fraction of the set that may be bad (data.BadSamples)
    elastic: Elastic | None = None  # $TRAINOP_ELASTIC_MAX_WORLD (elastic.py); None: not elastic
    sample_log: Path | None = None  # every rank appends a JSON line per step: its samples and loss share

    @property
    def accumulation(self) -> int:
        """Micro-batches each rank trains on per optimizer step: 1 unless elastic below its maximum."""
        return self.elastic.accumulation if self.elastic else 1

    def scale(self, world_size: int) -> int:
        """The global batch over --batch-size: what the peak learning rate scales base_lr by. An
        elastic run's is its maximum world at every size (the schedule does not move on a resize)."""
        return self.elastic.max_world if self.elastic else world_size
