"""`trainop tensorboard JOB`: serve a job's TensorBoard event files with the real TensorBoard.

The trainer writes them into its output folder (`<output>/tensorboard/`), which the log shipper
uploads to Blob Storage with the rest of the output once training reported its end:

- a job with `spec.output.blob`: every attempt's files (`<prefix>/<namespace>/<job>-<uid8>/<attempt>/output/
  tensorboard/`) are downloaded into a temporary folder, one TensorBoard run per attempt
  (`attempt-0`, `attempt-1`, ...; `--attempt N` for one), and served until Ctrl-C; only the
  event files (events.out.tfevents.*): the job wrote everything else there too, and the
  account URL must be Azure Storage's or one in the operator configuration's
  blob.allowedAccountURLs (--config), as the operator requires;
- `--local`: the runs of `trainop run JOB.yaml --local` (served where they are, live);
- `--dir PATH`: any folder, e.g. a job's output claim mounted here (`spec.output.pvc`).

TensorBoard runs without its projector plugin, whichever the source: a job's
`projector_config.pbtxt` names files by absolute path, which TensorBoard would read from this
machine and serve.

Needs the `tensorboard` package (`pip install 'trainop[tensorboard]'`).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from trainop import API_VERSION, blob, kube, paths
from trainop.cli import logs

KIND = "DistributedTrainingJob"
FOLDER = "tensorboard"  # the trainer's event folder inside its --output-dir (trainop_trainer/events.py)
EVENTS = "events.out.tfevents."  # how every event file's name starts (TensorFlow's and PyTorch's writers)
# Plugins that read files a run names rather than the run's own event files.
UNSAFE_PLUGINS = ("projector",)


class TensorBoardError(RuntimeError):
    """Why nothing can be served; one line, no secret."""


def register(subparsers) -> None:
    p = subparsers.add_parser("tensorboard", help="serve a training job's TensorBoard event files",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("job", nargs="?", help="DistributedTrainingJob name (not with --dir)")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--local", action="store_true", help="the job's `trainop run --local` runs on this machine")
    where.add_argument("--dir", type=Path, help="serve this folder (e.g. a mounted output claim)")
    p.add_argument("--attempt", type=int, help="only this gang attempt (default: every attempt, one run each)")
    p.add_argument("--port", type=int, default=6006, help="default 6006")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("-n", "--namespace", help="default: the kubeconfig context's namespace")
    p.add_argument("--kubeconfig", help="default: $KUBECONFIG or ~/.kube/config")
    logs.add_config_flag(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        if args.dir is None and not args.job:
            raise TensorBoardError("name a job (trainop tensorboard JOB) or a folder (--dir PATH)")
        try:
            from tensorboard import program
        except ImportError:
            raise TensorBoardError("the tensorboard package is not installed: "
                                   "pip install 'trainop[tensorboard]'") from None
        if args.dir is not None:
            if not args.dir.is_dir():
                raise TensorBoardError(f"--dir {args.dir}: not a folder")
            return serve(program, args.dir, args)
        if args.local:
            root = paths.state_dir() / "runs" / args.job
            if not any(root.glob(f"*/output/{FOLDER}")):
                raise TensorBoardError(f"no local run of {args.job} has event files under {root}; "
                                       f"run it first: trainop run JOB.yaml --local")
            return serve(program, root, args)
        namespace = logs.connect(args.kubeconfig, args.namespace)
        job = kube.get(API_VERSION, KIND, args.job, namespace)
        if job is None:
            raise TensorBoardError(f"{KIND} {namespace}/{args.job} not found")
        with tempfile.TemporaryDirectory(prefix=f"trainop-tensorboard-{args.job}-") as tmp:
            count = download(job, args.attempt, Path(tmp), logs.allowed_endpoints(args.config))
            print(f"trainop tensorboard: {count} event file(s) of {args.job} in {tmp}", file=sys.stderr)
            return serve(program, Path(tmp), args)
    except (TensorBoardError, logs.LogsError) as exc:
        print(f"trainop tensorboard: {exc}", file=sys.stderr)
        return 1


def serve(program, logdir: Path, args: argparse.Namespace) -> int:
    """The real TensorBoard on `logdir` until interrupted. The pure-Python loader (not the
    optional Rust data server): these logs are small, and it needs no extra binary."""
    tb = program.TensorBoard(plugins=safe_plugins())
    tb.configure(logdir=str(logdir), host=args.host, port=args.port, load_fast="false", reload_interval=5)
    print(f"trainop tensorboard: serving {logdir} at http://{args.host}:{args.port}/ (Ctrl-C stops)",
          file=sys.stderr, flush=True)
    return tb.main() or 0


def safe_plugins() -> list:
    """TensorBoard's own plugins but UNSAFE_PLUGINS."""
    from tensorboard import default

    return [p for p in default.get_plugins() if _plugin_name(p) not in UNSAFE_PLUGINS]


def _plugin_name(plugin) -> str:
    # a TBPlugin class has plugin_name; a loader (class or instance) is named by its module
    module = plugin.__module__ if isinstance(plugin, type) else type(plugin).__module__
    return getattr(plugin, "plugin_name", None) or module.rsplit(".", 1)[-1].removesuffix("_plugin")


def download(job: dict, attempt: int | None, dest: Path, allowed: tuple[str, ...] = ()) -> int:
    """Every attempt's event files (or `attempt`'s) from the job's Blob output into
    `dest/attempt-<n>/...`; returns how many."""
    from azure.core.exceptions import AzureError

    name = job["metadata"]["name"]
    out = (job.get("spec") or {}).get("output") or {}
    if "blob" not in out:
        claim = (out.get("pvc") or {}).get("claimName")
        if claim:
            raise TensorBoardError(f"{name} writes its output to PVC {claim}: its event files are in the "
                                   f"claim's {FOLDER}/ folder; mount the claim and run "
                                   f"`trainop tensorboard --dir <mount>/{FOLDER}`")
        raise TensorBoardError(f"{name} has no spec.output: its event files stayed in its pods")
    spec = out["blob"]
    job_folder = logs.job_folder(job)
    container, secret = logs.archive_client(job, allowed)
    count = 0
    try:
        for item in container.list_blobs(name_starts_with=f"{job_folder}/"):
            local = local_path(item.name[len(job_folder) + 1:], attempt)
            if local is None:
                continue
            target = dest / local
            target.parent.mkdir(parents=True, exist_ok=True)
            with open(target, "wb") as f:
                container.get_blob_client(item.name).download_blob().readinto(f)
            count += 1
    except AzureError as exc:
        raise TensorBoardError(f"reading {spec['container']}/{job_folder}/: {blob.explain(exc, secret)}") from None
    if not count:
        which = "any attempt" if attempt is None else f"attempt {attempt}"
        raise TensorBoardError(f"no event files of {which} under {spec['container']}/{job_folder}/<attempt>/"
                               f"output/{FOLDER}/ yet: they are uploaded with the output once training "
                               f"ends (trainop get {name} shows its progress)")
    return count


def local_path(relative: str, attempt: int | None) -> Path | None:
    """`<attempt>/output/tensorboard/<...>/events.out.tfevents.*` (a blob name under the job's
    folder) as `attempt-<attempt>/<...>/<file>`; None for anything else. A pod decided these
    names (it wrote the files), so a name that could leave the download folder is refused, and
    so is any file but an event file (a projector_config.pbtxt would make TensorBoard read
    files of this machine)."""
    parts = relative.split("/")
    if len(parts) < 4 or not parts[0].isdigit() or parts[1:3] != ["output", FOLDER]:
        return None
    if attempt is not None and int(parts[0]) != attempt:
        return None
    rest = parts[3:]
    if any(p in ("", ".", "..") or "\\" in p for p in rest) or not rest[-1].startswith(EVENTS):
        return None
    return Path(f"attempt-{int(parts[0])}", *rest)
