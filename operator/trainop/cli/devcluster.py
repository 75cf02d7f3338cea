"""`trainop devcluster up|down|status|build|images`: a local API server with simulated AKS GPU pools."""

from __future__ import annotations

import sys

from trainop import paths


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "devcluster", help="run a local Kubernetes control plane with simulated GPU/InfiniBand node pools",
        description=__doc__,
    )
    verbs = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    up = _action(verbs, "up", "start the local control plane (building its binaries on first use) "
                 "and write a kubeconfig")
    up.add_argument("--pools", default="", metavar="system=N,gpu=N,ibgpu=N",
                    help="node counts per pool (default system=2,gpu=4,ibgpu=4)")
    up.add_argument("--real-nodes", default="", metavar="N | POOL=N,...",
                    help="make pools real: their nodes are kubelets on containerd that run pods (on the CPU), "
                         "e.g. 1 (gpu=1) or system=1,gpu=1; needs root")
    up.add_argument("--no-crds", action="store_true", help="do not install trainop's CRDs")
    _action(verbs, "down", "stop the local control plane and throw its state away")
    _action(verbs, "status", "show which of its components run and where the kubeconfig is")
    _action(verbs, "build", "only build (or find cached) the control plane and real-node binaries")
    images = _action(verbs, "images", "build (or find cached) the project's container images from "
                     "its Dockerfiles, without Docker Hub; optionally load them into a containerd")
    images.add_argument("--only", nargs="+", metavar="NAME", help="these images (default: every default one)")
    images.add_argument("--containerd", metavar="ADDRESS", help="then import them into this containerd socket")
    parser.set_defaults(func=run)


def _action(verbs, name: str, text: str):
    """An action whose `--help` says what `trainop devcluster --help` lists beside it."""
    return verbs.add_parser(name, help=text, description=f"trainop devcluster {name}: {text}.")


def _cluster(pools_text: str = "", real_text: str = ""):
    from trainop.devcluster.cluster import DevCluster
    from trainop.devcluster.pools import parse_pools

    return DevCluster(paths.state_dir() / "devcluster", pools=parse_pools(pools_text, real_text))


def run(args) -> int:
    from trainop.devcluster import build
    from trainop.devcluster.cluster import ClusterError, install_crds

    if args.action == "images":
        return _images(args)
    if args.action == "build":
        for name, folder in build.ensure_all().items():
            print(f"{name:12s} {folder}")
        return 0
    try:
        cluster = _cluster(getattr(args, "pools", ""), getattr(args, "real_nodes", ""))
    except ValueError as err:
        print(f"trainop devcluster: {err}", file=sys.stderr)
        return 2
    if args.action == "down":
        cluster.down()
        print("devcluster stopped")
        return 0
    if args.action == "status":
        states = cluster.status()
        for name, alive in states.items():
            print(f"{name:26s} {'running' if alive else 'stopped'}")
        up = all(states.values()) and cluster.is_up()
        print(f"\nAPI server {'ready' if up else 'not ready'}; kubeconfig: {cluster.kubeconfig}")
        return 0 if up else 1
    try:
        seconds = cluster.up()
        refused = {} if args.no_crds else install_crds(cluster.kubeconfig)
    except (ClusterError, RuntimeError) as err:
        print(f"trainop devcluster up: {err}", file=sys.stderr)
        return 1
    for name, error in refused.items():
        print(f"trainop devcluster up: the API server refused {name}: {error}", file=sys.stderr)
    print(f"devcluster up in {seconds:.1f}s: node pools "
          f"{', '.join(f'{p.name}={p.count}' + (' (real)' if p.real else '') for p in cluster.pools)}")
    print(f"\n  export KUBECONFIG={cluster.kubeconfig}\n  kubectl get nodes -L kubernetes.azure.com/agentpool\n"
          f"  trainop operator --all-namespaces   # in another shell\n\nStop it with: trainop devcluster down")
    return 1 if refused else 0


def _images(args) -> int:
    from trainop.devcluster import images

    try:
        results = images.ensure(args.only)
        if args.containerd:
            images.load(args.containerd, args.only)
    except (ValueError, images.ImageBuildError) as err:
        print(f"trainop devcluster images: {err}", file=sys.stderr)
        return 1
    print(images.describe(results))
    return 0
