"""`trainop convert [FILE] [-o OUT]`: translate Kubeflow MPIJobs (kubeflow.org/v2beta1),
PyTorchJobs and TFJobs (kubeflow.org/v1) into DistributedTrainingJobs. Reads FILE (or stdin;
several YAML documents allowed) and writes the jobs as YAML to stdout or OUT. Every source field
that is not carried over, and every default that differs, is printed to stderr as a warning
naming the source field. Exits 2, saying why, for a kind it does not read or broken YAML. The
whole map: docs/migrating.md.
"""

from __future__ import annotations

import argparse
import sys

import yaml

from trainop import config, convert


def register(subparsers) -> None:
    p = subparsers.add_parser("convert", help="translate an MPIJob, PyTorchJob or TFJob into a "
                              "DistributedTrainingJob", description=__doc__)
    p.add_argument("file", nargs="?", default="-", metavar="FILE",
                   help="the Kubeflow job's YAML (default, or -: stdin)")
    p.add_argument("-o", "--output", metavar="OUT", help="write the result here instead of stdout")
    p.add_argument("--config", metavar="FILE",
                   help="operator configuration to judge the result by (what podTemplate.allow "
                        "lets through; default: $TRAINOP_CONFIG, else the built-in one)")
    p.set_defaults(func=run)


def fail(message: str) -> int:
    print(f"trainop convert: {message}", file=sys.stderr)
    return 2


def run(args: argparse.Namespace) -> int:
    where = "stdin" if args.file == "-" else args.file
    try:
        text = sys.stdin.read() if args.file == "-" else open(args.file).read()
        docs = [d for d in yaml.safe_load_all(text) if d is not None]
        cfg = config.load(args.config)
    except OSError as exc:
        return fail(f"{where}: cannot read it ({exc.strerror})")
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        return fail(f"{where}: not valid YAML{f' at line {mark.line + 1}' if mark else ''}: "
                    f"{getattr(exc, 'problem', None) or exc}")
    except config.ConfigError as exc:
        return fail(str(exc))
    if not docs:
        return fail(f"{where}: no document to convert")
    jobs = []
    for i, doc in enumerate(docs):
        label = where if len(docs) == 1 else f"{where} (document {i + 1})"
        try:
            job, warnings = convert.convert(doc, cfg)
        except convert.ConvertError as exc:
            return fail(f"{label}: {exc}")
        for warning in warnings:
            print(f"warning: {job['metadata']['name']}: {warning}", file=sys.stderr)
        jobs.append(job)
    text = yaml.safe_dump_all(jobs, sort_keys=False)
    if args.output:
        with open(args.output, "w") as out:
            out.write(text)
    else:
        sys.stdout.write(text)
    return 0
