"""`trainop operator`: run the operator against the cluster of the kubeconfig (in a pod: its
ServiceAccount), as the chart's Deployment and the tests do: kopf with the entry module
trainop.main, which imports every handler."""

from __future__ import annotations

import argparse
import os
import random


def register(subparsers) -> None:
    p = subparsers.add_parser("operator", help="run the operator against the current cluster",
                              description=__doc__)
    scope = p.add_mutually_exclusive_group()
    scope.add_argument("-n", "--namespace", action="append", dest="namespaces", default=[],
                       metavar="NS", help="watch this namespace (repeatable; globs allowed)")
    scope.add_argument("-A", "--all-namespaces", action="store_true",
                       help="watch every namespace (the default when no -n is given)")
    p.add_argument("--config", metavar="FILE",
                   help="operator configuration YAML (default: $TRAINOP_CONFIG, else the built-in one)")
    p.add_argument("--peering", metavar="NAME",
                   help="kopf peering object: kopf pauses the handlers of every replica of that name "
                        "but the highest-priority one (trainop's own work queue does not honour the "
                        "pause yet: run one replica)")
    p.add_argument("--standalone", action="store_true",
                   help="no peering at all (a single replica, e.g. tests and local runs)")
    p.add_argument("--liveness", metavar="URL",
                   help="serve kopf's health probe, e.g. http://0.0.0.0:8080/healthz")
    p.add_argument("--priority", type=_priority, default=0,
                   help="peering priority of this replica, or 'random': kopf pauses every "
                        "replica when two share the highest priority, so replicas of one "
                        "Deployment need distinct ones")
    p.add_argument("--metrics-port", type=int, metavar="PORT",
                   help="serve Prometheus metrics at http://0.0.0.0:PORT/metrics")
    p.add_argument("--log-format", choices=["full", "json", "plain"], default="full",
                   help="json: one object per line, with the resource each line is about")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging (kopf's verbose mode)")
    p.set_defaults(func=run)


def _priority(value: str) -> int:
    if value == "random":
        return random.SystemRandom().randint(1, 2**31 - 1)
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r}: an integer or 'random'") from None


def run(args: argparse.Namespace) -> int:
    import kopf  # heavy import only for this verb

    if args.config:
        os.environ["TRAINOP_CONFIG"] = args.config
    # Fail before connecting if the configuration is wrong: one line, naming the key.
    from trainop import config
    try:
        config.load()
    except config.ConfigError as exc:
        raise SystemExit(f"trainop operator: {exc}") from None

    import trainop.main  # noqa: F401  (registers every handler)
    if args.metrics_port:
        from trainop import metrics
        metrics.serve(args.metrics_port)
    # log_prefix: "[namespace/name]" before each line about an object in text; JSON lines carry
    # it as `object` instead
    kopf.configure(verbose=args.verbose, log_format=kopf.LogFormat[args.log_format.upper()],
                   log_prefix=args.log_format != "json")
    kopf.run(
        standalone=args.standalone,
        peering_name=None if args.standalone else args.peering,
        priority=args.priority,
        namespaces=args.namespaces,  # kopf wants a collection (empty with clusterwide), never None
        clusterwide=not args.namespaces,
        liveness_endpoint=args.liveness,
    )
    return 0
