"""The `trainop` command. Each verb lives in its own module that exposes
`register(subparsers)`; the parser it adds sets `func=callable(args) -> int`."""

from __future__ import annotations

import argparse
import importlib
import sys

# What `trainop --help` says (the docstring above is for developers).
DESCRIPTION = ("Run distributed training on Kubernetes: DistributedTrainingJobs (a gang of workers "
               "started by mpirun or torchrun) and DataStages (Blob Storage copied onto NFS), on a "
               "cluster or, with `trainop run JOB.yaml --local`, on this machine. "
               "`trainop VERB --help` says more about each verb.")

# Modules that add verbs, in the order `trainop --help` lists them.
VERB_MODULES = [
    "trainop.cli.local",
    "trainop.cli.jobs",
    "trainop.cli.devcluster",
    "trainop.cli.operator",
    "trainop.cli.logs",
    "trainop.cli.tensorboard",
    "trainop.cli.quota",
    "trainop.cli.convert",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="trainop", description=DESCRIPTION)
    subparsers = parser.add_subparsers(dest="verb", required=True, metavar="VERB")
    for name in VERB_MODULES:
        importlib.import_module(name).register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
