"""`trainop run JOB.yaml --local`: run a DistributedTrainingJob on this machine as real processes
(the operator's own mpirun or torchrun scripts, the same trainer), with a progress bar and a
final table. Reduced by default to finish in about a minute on 2 CPU cores; --full runs it as
written."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from trainop import config, localrun, manifests, spec

KIND = "DistributedTrainingJob"


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def register(subparsers) -> None:
    p = subparsers.add_parser("run", help="run a training job on this machine (--local)",
                              description=__doc__)
    p.add_argument("manifest", metavar="JOB.yaml", help="a DistributedTrainingJob manifest")
    p.add_argument("--local", action="store_true", required=True,
                   help="run here as local processes (required: on a cluster use `trainop submit`)")
    p.add_argument("--full", action="store_true",
                   help="no reduction: the manifest's own ranks, model, image size, batch and steps")
    p.add_argument("--epochs", type=_positive, metavar="N", help="train N epochs")
    p.add_argument("--steps", type=_positive, metavar="N", help="N steps per epoch")
    p.add_argument("--data-dir", type=Path, metavar="DIR",
                   help="train on this local folder (class sub-folders or .tar shards) instead of "
                        "the job's DataStage or synthetic data")
    p.add_argument("--config", metavar="FILE",
                   help="operator configuration to judge the job by (default: $TRAINOP_CONFIG, "
                        "else the built-in one)")
    p.add_argument("-v", "--verbose", action="store_true",
                   help="print the training output as it comes (it always goes to the run's log)")
    p.set_defaults(func=run)


def fail(message: str, code: int) -> int:
    print(f"trainop run: {message}", file=sys.stderr)
    return code


def run(args: argparse.Namespace) -> int:
    try:
        docs = manifests.load(args.manifest, kinds=(KIND,))
        if len(docs) > 1:
            return fail(f"{args.manifest}: holds {len(docs)} jobs; give one {KIND} per file", 2)
        job = spec.parse(docs[0], config.load(args.config))
    except (manifests.ManifestError, spec.SpecError, config.ConfigError) as exc:
        return fail(str(exc), 2)
    if args.data_dir is not None and not args.data_dir.is_dir():
        return fail(f"--data-dir {args.data_dir}: not a folder", 2)
    try:
        localrun.preflight(job)
    except localrun.LocalRunError as exc:
        return fail(str(exc), 1)
    opts = localrun.Options(full=args.full, epochs=args.epochs, steps_per_epoch=args.steps,
                            data_dir=args.data_dir)
    plan = localrun.plan(job, opts, localrun.new_run_dir(job.name), localrun.free_port())
    launcher = ("Horovod over mpirun" if plan.job.launcher == "mpi" else "torchrun")
    print(f"trainop run --local: {plan.job.name}: {plan.job.framework}, {launcher}, "
          f"{plan.ranks} ranks on this machine; run folder {plan.run_dir}")
    if plan.notes:
        print("  changed for a local run" + ("" if args.full else " (--full runs it as written)") + ":")
        for note in plan.notes:
            print(f"    {note}")
    sys.stdout.flush()
    progress = localrun.Progress(sys.stderr, plan.job.training.epochs)
    outcome = localrun.execute_with_restarts(
        plan, progress, echo=sys.stdout if args.verbose else None,
        deadline_seconds=plan.job.run_policy.active_deadline_seconds,
        say=lambda line: print(f"trainop run --local: {line}", flush=True))
    rows = localrun.summary(plan, outcome)
    width = max(len(k) for k, _ in rows)
    print()
    for key, value in rows:
        print(f"  {key:<{width}}  {value}")
    if not outcome.ok:
        tail = outcome.log.read_text(errors="replace").splitlines()[-20:] if outcome.log else []
        if not args.verbose and tail:
            print("\n  last lines of the log:\n" + "\n".join(f"    {t}" for t in tail), file=sys.stderr)
        return fail(f"{plan.job.name} failed: {outcome.failure} (log: {outcome.log})", 1)
    return 0
