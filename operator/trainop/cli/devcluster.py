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
                     "its Dockerfiles, without Docker Hub; optionally load them into a containerd; "
                     "`images load ARCHIVE`, `images build DIR`: your own image onto the real nodes")
    images.add_argument("--only", nargs="+", metavar="NAME", help="these images (default: every default one)")
    images.add_argument("--containerd", metavar="ADDRESS", help="then import them into this containerd socket")
    yours = images.add_subparsers(dest="images_action", metavar="ACTION")
    load = _action(yours, "load", "import your own image archive (an OCI archive, or `docker save`'s) "
                   "into the containerd of every real node of the running dev cluster", "images load")
    load.add_argument("archive", metavar="ARCHIVE", help="the .tar file")
    load.add_argument("--tag", action="append", default=[], metavar="NAME",
                      help="also name the image NAME (repeatable), e.g. team/train:1; pods name it so, with a "
                           "tag other than latest or imagePullPolicy IfNotPresent (nothing can be pulled)")
    build = _action(yours, "build", "build your own Dockerfile folder with the project's builder (buildah, "
                    "no Docker; FROM may name debian:bookworm or debian:trixie, made from Debian's packages, "
                    "or one of the project's images such as mpioperator/openmpi:v0.8.2), cache it by content "
                    "hash and import it into every real node", "images build")
    build.add_argument("folder", metavar="DIR", help="the build context: only what COPY/ADD name is sent "
                       "(no .dockerignore is read)")
    build.add_argument("--tag", required=True, metavar="NAME",
                       help="the image's name, e.g. team/train:1 (pods name it so; see load --tag)")
    build.add_argument("-f", "--file", default="Dockerfile", metavar="FILE", help="the Dockerfile, in DIR")
    build.add_argument("--build-arg", action="append", default=[], metavar="KEY=VALUE", help="a build ARG")
    for verb in (load, build):
        verb.add_argument("--containerd", dest="into", action="append", metavar="ADDRESS",
                          help="into this containerd socket instead (repeatable)")
    parser.set_defaults(func=run)


def _action(verbs, name: str, text: str, full: str | None = None):
    """An action whose `--help` says what `trainop devcluster --help` lists beside it."""
    return verbs.add_parser(name, help=text, description=f"trainop devcluster {full or name}: {text}.")


def _cluster(pools_text: str = "", real_text: str = ""):
    from trainop.devcluster.cluster import DevCluster
    from trainop.devcluster.pools import parse_pools

    return DevCluster(paths.state_dir() / "devcluster", pools=parse_pools(pools_text, real_text))


def run(args) -> int:
    from trainop.devcluster import build
    from trainop.devcluster.cluster import ClusterError

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
        seconds = cluster.up(crds=not args.no_crds)
        refused = cluster.crd_errors
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

    if args.images_action:
        return _your_image(args)
    try:
        results = images.ensure(args.only)
        if args.containerd:
            images.load(args.containerd, args.only)
    except (ValueError, images.ImageBuildError) as err:
        print(f"trainop devcluster images: {err}", file=sys.stderr)
        return 1
    print(images.describe(results))
    return 0


def _your_image(args) -> int:
    """`images load ARCHIVE` / `images build DIR`: a user's image onto the real nodes."""
    from pathlib import Path

    from trainop.devcluster import images

    try:
        sockets = args.into or _real_node_sockets()
        if args.images_action == "build":
            build_args = dict(arg.partition("=")[::2] for arg in args.build_arg)
            result = images.ensure_image(images.user_image(Path(args.folder), args.tag, args.file, build_args))
            print(images.describe([result]))
            for socket in sockets:
                images.load_results(socket, [result])
                print(f"imported into {socket}: {' '.join(result.refs)}")
        else:
            for socket in sockets:
                names = images.import_archive(socket, Path(args.archive), args.tag)
                print(f"imported into {socket}: {' '.join(names)}")
    except (ValueError, images.ImageBuildError) as err:
        print(f"trainop devcluster images {args.images_action}: {err}", file=sys.stderr)
        return 1
    return 0


def _real_node_sockets() -> list[str]:
    """The containerd of every real node of the dev cluster that runs (`up --real-nodes`)."""
    cluster = _cluster()
    running = cluster.status()
    sockets = [str(node.containerd_socket) for node in cluster.real_nodes
               if running.get(f"containerd/{node.name}")]
    if not sockets:
        raise ValueError(f"no real node runs in the dev cluster at {cluster.state_dir}: start one with "
                         f"`trainop devcluster up --real-nodes 1`, or name a containerd with --containerd")
    return sockets
