"""`trainop operator`: run the operator against the cluster of the kubeconfig (in a pod: its
ServiceAccount), as the chart's Deployment and the tests do: kopf with the entry module
trainop.main, which imports every handler."""

from __future__ import annotations

import argparse
import logging
import os
import threading


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
    election = p.add_mutually_exclusive_group()
    election.add_argument("--lease", metavar="NAME",
                          help="leader election through the coordination.k8s.io Lease NAME: "
                               "replicas with the same Lease never act together; the others "
                               "keep their caches warm and take over within about 17 s of a "
                               "crash (at once after a clean stop)")
    election.add_argument("--standalone", action="store_true",
                          help="no election (the default): this replica always acts; run one")
    p.add_argument("--lease-namespace", metavar="NS",
                   help="the Lease's namespace (default: $POD_NAMESPACE, else the first "
                        "--namespace, else default)")
    p.add_argument("--liveness", metavar="URL",
                   help="serve kopf's health probe, e.g. http://0.0.0.0:8080/healthz")
    p.add_argument("--metrics-port", type=int, metavar="PORT",
                   help="serve Prometheus metrics at http://0.0.0.0:PORT/metrics")
    p.add_argument("--log-format", choices=["full", "json", "plain"], default="full",
                   help="json: one object per line, with the resource each line is about")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging (kopf's verbose mode)")
    p.set_defaults(func=run)


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
    from trainop import logfilter
    logfilter.install()  # kopf's per-attempt retry ERRORs: one WARNING per 30 s (logfilter.py)
    if not args.verbose:
        # kopf.objects' INFO lines are each handler's "succeeded", on every watch event of every
        # object; the handlers' filters drop them (handlers/), but only after the record was made
        # and formatted, a few % of the CPU of a 500-job ramp. Warnings and errors still show.
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)
    # kopf itself always runs standalone: its peering would pause the watches of a standby
    # (cold caches) and cannot hold back the controller's own tasks (leader.py says why)
    stop, lost = threading.Event(), threading.Event()
    # stop_flag: main.py's cleanup raises it on any stop. kopf waits for this flag in a thread of
    # asyncio's default executor, which asyncio.run joins at exit: left unset, SIGTERM would
    # leave the process hanging until the kubelet's SIGKILL.
    # namespaces: main.py watches the pods itself, in the namespaces kopf watches the rest in
    memo = kopf.Memo(stop=lambda: (lost.set(), stop.set()), stop_flag=stop,
                     namespaces=list(args.namespaces))
    if args.lease:
        from trainop import leader
        namespace = args.lease_namespace or os.environ.get("POD_NAMESPACE") or \
            next((n for n in args.namespaces if "*" not in n), None) or "default"
        memo.leadership = leader.Lease(args.lease, namespace, leader.identity())
    kopf.run(
        standalone=True,
        namespaces=args.namespaces,  # kopf wants a collection (empty with clusterwide), never None
        clusterwide=not args.namespaces,
        liveness_endpoint=args.liveness,
        stop_flag=stop,
        memo=memo,
    )
    return 1 if lost.is_set() else 0  # lost the Lease: exit non-zero, the Deployment restarts
