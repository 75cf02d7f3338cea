"""Command line of the trainer: parse, validate everything that can be judged before training, run.

Bad input ends the process with exit code 2 and one line on stderr naming the option and the fix,
before any framework is imported or any rank is contacted.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from pathlib import Path

from trainop_trainer import checkpoint, data, elastic, report
from trainop_trainer import world as world_mod
from trainop_trainer.config import Config

FRAMEWORKS = ("pytorch", "tensorflow", "keras")
MODELS = ("resnet50", "resnet18")


class ConfigError(ValueError):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, not argparse's usage block
        raise ConfigError(message)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m trainop_trainer", description=__doc__)
    p.add_argument("--framework", required=True, choices=FRAMEWORKS)
    p.add_argument("--backend", default="auto", choices=("auto", "horovod", "native"),
                   help="auto: Horovod when it is installed and mpirun launched the job, else native")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--synthetic", action="store_true", help="random images generated on the device")
    src.add_argument("--data-dir", type=Path, help="ImageNet-style folder (class sub-folders) or .tar shards")
    batch = p.add_mutually_exclusive_group(required=True)
    batch.add_argument("--batch-size", type=int, help="images per worker per step (elastic: per micro-batch; the "
                       "global batch is this x $TRAINOP_ELASTIC_MAX_WORLD at every world size)")
    batch.add_argument("--global-batch-size", type=int, help="images per step over all workers")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--steps-per-epoch", type=int, help="default: the shard's length (data) or 100 (synthetic)")
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--model", choices=MODELS, default="resnet50")
    p.add_argument("--num-classes", type=int, default=1000, help="synthetic data only; folders count theirs")
    p.add_argument("--synthetic-batches", type=int, default=4, help="distinct synthetic batches, reused")
    p.add_argument("--precision", choices=("fp32", "bf16", "fp64"), default="fp32",
                   help="fp64: float64 parameters and arithmetic (slow; for checking numerics, such as an "
                        "elastic resume against an uninterrupted run)")
    p.add_argument("--channels-last", action="store_true", help="PyTorch memory format (TF is always NHWC)")
    p.add_argument("--compile", action="store_true", help="torch.compile; XLA jit_compile for TensorFlow/Keras")
    p.add_argument("--output-dir", type=Path, required=True)
    p.add_argument("--metrics-file", type=Path, help="default: <output-dir>/metrics.jsonl")
    p.add_argument("--base-lr", type=float, default=0.0125, help="per worker; scaled by the world size")
    p.add_argument("--warmup-epochs", type=float, default=5.0)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--weight-decay", type=float, default=5e-5)
    p.add_argument("--loader-workers", default="auto",
                   help="loader processes per rank; auto: the CPUs the job may use (affinity, cgroup quota) "
                        "divided by the ranks on the node, less one (at most 6 when decoding on the GPU)")
    p.add_argument("--decode", choices=("auto", "split", "cpu", "gpu"), default="auto",
                   help="PyTorch JPEG decode: cpu (PIL in the loader workers), gpu (nvJPEG, augmentation on the "
                        "device), split (each batch shared between the two by the workers' capacity); "
                        "auto: split when the job has a GPU, else cpu")
    p.add_argument("--read-mode", choices=data.READ_MODES, default="auto",
                   help="sequential: blocks of consecutive .tar members (the default for shards); "
                        "random: one read per image (the default for folders)")
    p.add_argument("--max-bad-samples", type=float, default=data.MAX_BAD_SAMPLES, metavar="FRACTION",
                   help="images that are empty, truncated or unreadable are skipped (a WARNING names each once, "
                        "the reports count them as badSamples) and another image of the set stands in; above "
                        "this fraction of the data set the run fails (0: none allowed; default %(default)s)")
    p.add_argument("--seed", type=int, default=42)
    env = os.environ
    stall = float(env.get("TRAINOP_STALL_SECONDS") or 0)
    p.add_argument("--stall-seconds", type=float, default=stall,
                   help="the job's hang timeout (default: $TRAINOP_STALL_SECONDS, its "
                        "runPolicy.stallTimeoutSeconds; 0: off): every rank writes its Python stacks to "
                        "stderr when no step ends for half of it")
    p.add_argument("--report-seconds", type=float, default=min(60.0, stall / 4) if stall else 60.0,
                   help="rank 0 also reports within an epoch at most this often (its own throughput "
                        "times the ranks), for progress and the ETA; 0: once per epoch (default 60, or a "
                        "quarter of --stall-seconds: the operator judges a stall by these reports)")
    p.add_argument("--min-step-seconds", type=float, default=float(env.get("TRAINOP_MIN_STEP_SECONDS") or 0),
                   help="hold every step to at least this wall time, sleeping the rest (default: "
                        "$TRAINOP_MIN_STEP_SECONDS; 0: off). For rehearsals of the platform on CPU (fault "
                        "tests, demos): a run lasts long enough for a fault to land mid-run without the "
                        "compute of a bigger model or image")
    p.add_argument("--checkpoint-dir", type=Path, default=env.get("TRAINOP_CHECKPOINT_DIR") or None,
                   help="this attempt's checkpoint folder, <root>/attempt-<n> (default: $TRAINOP_CHECKPOINT_DIR; "
                        "unset: no checkpoints)")
    p.add_argument("--checkpoint-every", type=int, default=env.get("TRAINOP_CHECKPOINT_EVERY") or 0,
                   help="save every N steps (default: $TRAINOP_CHECKPOINT_EVERY; 0: only on SIGTERM)")
    p.add_argument("--resume-from", default=env.get("TRAINOP_RESUME_FROM") or None,
                   help="a step-<k> checkpoint folder, or `latest` (the newest complete one under the "
                        "checkpoint root) (default: $TRAINOP_RESUME_FROM); an elastic job "
                        "($TRAINOP_ELASTIC_MAX_WORLD) may resume one saved at another world size")
    p.add_argument("--sample-log", type=Path, default=env.get("TRAINOP_SAMPLE_LOG") or None,
                   help="every rank appends one JSON line per optimizer step to this file: the step, its "
                        "epoch, the rank, the samples it trained on (their indices in the data set's order) "
                        "and its share of the step's loss; audits the data order (default: "
                        "$TRAINOP_SAMPLE_LOG; unset: none)")
    return p


def _positive(name: str, value: int | None) -> None:
    if value is not None and value <= 0:
        raise ConfigError(f"{name} must be a positive integer, got {value}")


def _loader_workers(value: str) -> int | None:
    if value == "auto":
        return None
    if not value.isdigit():
        raise ConfigError(f"--loader-workers must be 'auto' or a number of processes (0: load in the rank's own "
                          f"process), got {value!r}")
    return int(value)


def resolve_backend(requested: str, framework: str, launcher: str) -> str:
    module = "horovod.torch" if framework == "pytorch" else "horovod.tensorflow"
    installed = importlib.util.find_spec("horovod") is not None and importlib.util.find_spec(module) is not None
    if requested == "auto":
        return "horovod" if installed and launcher == "mpirun" else "native"
    if requested == "horovod":
        if launcher == "torchrun":
            raise ConfigError("--backend horovod needs mpirun (Open MPI); torchrun starts only --backend native")
        if not installed:
            raise ConfigError(f"--backend horovod: {module} is not installed; run trainer_images/install.sh or use --backend native")
    return requested


def parse(argv: list[str], world: world_mod.World) -> Config:
    args = build_parser().parse_args(argv)
    for name in ("batch_size", "global_batch_size", "epochs", "steps_per_epoch", "image_size",
                 "num_classes", "synthetic_batches"):
        _positive("--" + name.replace("_", "-"), getattr(args, name))
    if not 0 <= args.max_bad_samples < 1:
        raise ConfigError(f"--max-bad-samples is a fraction of the data set, 0 or more and below 1, "
                          f"got {args.max_bad_samples:g}")
    if args.checkpoint_every < 0:
        raise ConfigError(f"--checkpoint-every must be 0 or more, got {args.checkpoint_every}")
    if world.is_chief:  # only rank 0 reads it (and only its host may have it): the rest get it from rank 0
        try:
            checkpoint.resolve(args.resume_from, args.checkpoint_dir)
        except checkpoint.CheckpointError as e:
            raise ConfigError(str(e)) from None
    max_world = _max_world(world)
    if args.global_batch_size is not None:
        if args.global_batch_size % max_world:
            raise ConfigError(
                f"--global-batch-size {args.global_batch_size} is not divisible by the world size {max_world}"
                + (f" ({elastic.ENV})" if max_world != world.size else "")
                + f"; use a multiple of {max_world} or --batch-size per worker")
        batch_size = args.global_batch_size // max_world
    else:
        batch_size = args.batch_size
    try:
        elastic_cfg = elastic.from_env(os.environ, world.size, batch_size)
    except elastic.ElasticError as e:
        raise ConfigError(str(e)) from None
    if args.image_size < 32:
        raise ConfigError(f"--image-size must be at least 32 (ResNet downsamples 32x), got {args.image_size}")
    workers = _loader_workers(args.loader_workers)
    num_classes = args.num_classes
    if args.data_dir is not None:
        dataset = data.scan(args.data_dir)  # raises DataError naming the path
        num_classes = len(dataset.classes)
        mode = dataset.read_mode(args.read_mode)  # raises DataError naming the option
        if elastic_cfg is not None and len(dataset.samples) < elastic_cfg.global_batch:
            raise ConfigError(
                f"the global batch of {elastic_cfg.global_batch} (--batch-size {batch_size} x {elastic.ENV} "
                f"{elastic_cfg.max_world}) is more than the {len(dataset.samples)} images in {args.data_dir}; "
                f"use a smaller batch")
        if elastic_cfg is None and dataset.steps_per_epoch(world.size, batch_size, mode) == 0:
            raise ConfigError(
                f"--batch-size {batch_size} is more than each of the {world.size} ranks' share of the "
                f"{len(dataset.samples)} images in {args.data_dir}; use a smaller batch")
    if world.launcher == "torchrun" and not world.hosts and args.framework != "pytorch":
        raise ConfigError("tensorflow/keras under torchrun need all ranks on one host; launch with mpirun instead")
    backend = resolve_backend(args.backend, args.framework, world.launcher)
    if (args.checkpoint_dir or args.resume_from) and args.framework != "pytorch" and backend == "native" \
            and world.size > 1:
        # MultiWorkerMirroredStrategy saves with collectives on every worker: not implemented.
        raise ConfigError(f"--checkpoint-dir/--resume-from with --framework {args.framework} on "
                          f"{world.size} ranks needs --backend horovod (mpirun); drop them or use Horovod")
    if elastic_cfg is not None and args.framework != "pytorch" and backend == "native" and world.size > 1:
        raise ConfigError(f"elastic training ({elastic.ENV}) with --framework {args.framework} on {world.size} "
                          f"ranks needs --backend horovod (mpirun): it resumes from checkpoints, which "
                          f"MultiWorkerMirroredStrategy does not save here")
    if args.compile and backend == "horovod" and args.framework == "keras":
        raise ConfigError("--compile with Keras and Horovod: model.fit would XLA-compile Horovod's all-reduce, "
                          "which has no XLA kernel; drop --compile or use --backend native")
    return Config(
        framework=args.framework,
        backend=backend,
        synthetic=args.synthetic,
        data_dir=args.data_dir,
        batch_size=batch_size,
        epochs=args.epochs,
        steps_per_epoch=args.steps_per_epoch,
        image_size=args.image_size,
        model=args.model,
        num_classes=num_classes,
        synthetic_batches=args.synthetic_batches,
        precision=args.precision,
        channels_last=args.channels_last,
        compile=args.compile,
        output_dir=args.output_dir,
        metrics_file=args.metrics_file or args.output_dir / "metrics.jsonl",
        base_lr=args.base_lr,
        warmup_epochs=args.warmup_epochs,
        momentum=args.momentum,
        weight_decay=args.weight_decay,
        loader_workers=workers,
        decode=args.decode,
        read_mode=args.read_mode,
        seed=args.seed,
        checkpoint_dir=args.checkpoint_dir,
        checkpoint_every=int(args.checkpoint_every),
        report_seconds=max(0.0, args.report_seconds),
        stall_seconds=max(0.0, args.stall_seconds),
        min_step_seconds=max(0.0, args.min_step_seconds),
        resume_from=args.resume_from,
        max_bad_samples=args.max_bad_samples,
        elastic=elastic_cfg,
        sample_log=args.sample_log,
    )


def _max_world(world: world_mod.World) -> int:
    """The ranks a global batch is shared by: the elastic maximum when set and valid (from_env
    judges it later, naming the problem), else this run's."""
    raw = (os.environ.get(elastic.ENV) or "").strip()
    return int(raw) if raw.isdigit() and int(raw) > 0 else world.size


def main(argv: list[str] | None = None) -> int:
    try:
        world = world_mod.detect()
        config = parse(sys.argv[1:] if argv is None else argv, world)
    except (ConfigError, data.DataError, world_mod.WorldError) as e:
        report.write_line(sys.stderr, f"trainop_trainer: error: {e}")  # one write: ranks share the pipe
        return 2
    config.output_dir.mkdir(parents=True, exist_ok=True)
    if config.framework == "pytorch":
        from trainop_trainer import torch_train as impl
    else:
        from trainop_trainer import tf_train as impl
    try:
        impl.train(config, world)
    except (checkpoint.CheckpointError, data.DataError) as e:  # one line naming the checkpoint or the data
        report.write_line(sys.stderr, f"trainop_trainer: error: {e}")  # one write: ranks share the pipe
        return 2
    return 0
