"""`python -m trainop.logship`: the log sidecar. Ships a pod's log (and the trainer's metrics file)
to Append Blobs while the job runs, flushes everything on SIGTERM, uploads the job's output
directory at the end, and reports the trainer's latest metrics into the job's progress ConfigMap
(which the operator copies into the job's status for display).

The training container tees its stdout/stderr into a file on an emptyDir shared with this
sidecar. The sidecar runs as a native sidecar (an init container with restartPolicy Always), so
the kubelet stops it only after the training container has exited: when SIGTERM arrives the log
file is complete, and a final drain ships every byte.

Resume without duplicates or losses: the offset is not kept in a local file. The Append Blob's
own committed length is the truth: on (re)start the shipper reads the blob's length and continues
reading the local file from there, and every Append Block carries an append-position condition
(the offset it expects the blob to have), so a retry of a block that did land (reply lost, crash
right after the append) is refused by the service instead of appended twice; the shipper then
re-reads the length and moves on. An offset written beside the append could never be made
atomic with it; the blob's length is.

A pod recreated under the same name (a worker) gets a fresh emptyDir whose file starts at byte 0,
while the blob already holds the previous pod's bytes. The blob's metadata records which pod UID
owns it and at which blob offset that pod's file begins (`base`); a new pod takes the blob over
(one conditional metadata write) and appends after the old content.
"""

from __future__ import annotations

import argparse
import errno
import json
import logging
import os
import signal
import stat
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainop import blob
from trainop.render.logship import HISTORY_KEY, PROGRESS_KEY, history_samples, safe_metrics
from trainop.resume import CHECKPOINT_KEY

log = logging.getLogger("trainop.logship")

# Largest Append Block every service version accepts; also the most the shipper holds in memory.
CHUNK = 4 * 1024 * 1024
# How much of the metrics file's tail is read to find its last complete line.
METRICS_TAIL = 64 * 1024
# An Append Blob takes at most 50,000 blocks. Shipping every 2 s would use them up in 28 hours of
# training; instead the pause between appends doubles every PACE_STEP blocks (2 s, 4 s, ... 32 s:
# about a week), and the last DRAIN_RESERVE blocks are kept for full 4 MiB blocks and the drain.
MAX_BLOCKS = 50_000
PACE_STEP = 10_000
DRAIN_RESERVE = 1_000
POD_UID_META = "trainoppoduid"
BASE_META = "trainopbase"
SOURCE_META = "trainopsource"  # an uploaded output file's "<size>:<mtime_ns>"
LINK = "symlink"  # upload_dir's `seen` value for a link it skipped


class Refused(OSError):
    """A file job code may have swapped for something else (a link, a fifo, a file elsewhere):
    not read."""


def open_regular(path: Path, inside: str):
    """`path` opened for reading, but only a regular file whose real path lies under `inside`.

    Job code shares the folders the sidecar reads (the log's emptyDir, /output) and may replace
    a file by a link to what only the sidecar can read (/proc/self/environ with the storage
    credential, the projected API or workload-identity token), which would then be shipped into
    the job's own blob. So: O_NOFOLLOW refuses a link as the file itself; the real path of the
    opened descriptor refuses a parent folder replaced by a link (`inside` is resolved by the
    caller from what it trusts, e.g. before job code ran); fstat refuses a fifo or a device
    (O_NONBLOCK: opening a fifo does not hang). Every check is made on the descriptor that is
    then read, so a swap after the checks changes nothing."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise Refused(f"{path}: a symbolic link (links are never followed)") from None
        raise
    try:
        real = os.readlink(f"/proc/self/fd/{fd}")
        if not real.startswith(inside.rstrip("/") + "/"):
            raise Refused(f"{path}: resolves to {real}, outside {inside} (a folder replaced by a link)")
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise Refused(f"{path}: not a regular file")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


class AppendShipper:
    """Appends what is new in `path` to the Append Blob behind `client` (a BlobClient)."""

    def __init__(self, client, path: Path, pod_uid: str):
        self.client = client
        self.path = Path(path)
        self.pod_uid = pod_uid
        # Resolved now: the sidecar starts before the training container (a native sidecar), so
        # no job code has touched the folder yet (open_regular).
        self.inside = os.path.realpath(self.path.parent)
        self.refused: str | None = None  # the last refusal, said once
        self.base: int | None = None  # blob offset of this file's byte 0; None until resumed
        self.shipped = 0  # bytes of the file the blob holds
        self.blocks = 0  # the blob's committed block count
        self.last_append = float("-inf")  # time.monotonic() of the last append

    def resume(self) -> None:
        """Learn from the blob how much of the file it already holds (create it if missing)."""
        from azure.core import MatchConditions
        from azure.core.exceptions import ResourceExistsError, ResourceModifiedError, ResourceNotFoundError

        while True:
            try:
                props = self.client.get_blob_properties()
            except ResourceNotFoundError:
                try:
                    self.client.create_append_blob(
                        metadata={POD_UID_META: self.pod_uid, BASE_META: "0"}, if_none_match="*")
                except ResourceExistsError:
                    pass  # another incarnation created it first: read what it wrote
                continue
            if props.blob_type != "AppendBlob":
                raise blob.BlobConfigError(
                    f"blob {self.client.blob_name}: is a {props.blob_type}, not an append blob; delete it or use another output prefix")
            meta = props.metadata or {}
            self.blocks = props.append_blob_committed_block_count or 0
            if meta.get(POD_UID_META) != self.pod_uid:
                # A new pod under the same name: append after the previous pod's bytes.
                try:
                    self.client.set_blob_metadata(
                        {POD_UID_META: self.pod_uid, BASE_META: str(props.size)},
                        etag=props.etag, match_condition=MatchConditions.IfNotModified)
                except ResourceModifiedError:
                    continue
                self.base, self.shipped = props.size, 0
            else:
                self.base = int(meta.get(BASE_META, "0"))
                self.shipped = props.size - self.base
            log.info("resuming %s at byte %d", self.client.blob_name, self.shipped)
            return

    def due(self, interval: float, now: float) -> bool:
        """Whether a pass at `now` may append, pacing appends by the blocks used (MAX_BLOCKS)."""
        return now - self.last_append >= interval * 2 ** (self.blocks // PACE_STEP)

    def ship(self, final: bool = True) -> int:
        """Append everything the file holds beyond what the blob has; returns bytes appended.
        Streams in CHUNK-sized blocks: memory stays bounded whatever the file's size. Once the
        blob is near its block limit, only `final` (the drain) appends a block shorter than CHUNK."""
        from azure.core.exceptions import HttpResponseError

        if self.base is None:
            self.resume()
        try:
            f = open_regular(self.path, self.inside)
        except FileNotFoundError:
            return 0  # the training container has not written anything yet
        except Refused as exc:
            if str(exc) != self.refused:
                log.warning("not shipping %s", exc)
                self.refused = str(exc)
            return 0
        appended = 0
        with f:
            while True:
                f.seek(self.shipped)
                data = f.read(CHUNK)
                if not data or (len(data) < CHUNK and not final and self.blocks >= MAX_BLOCKS - DRAIN_RESERVE):
                    return appended
                try:
                    self.client.append_block(data, appendpos_condition=self.base + self.shipped)
                except HttpResponseError as exc:
                    if exc.error_code != "AppendPositionConditionNotMet":
                        raise
                    # An earlier try of this block landed (or another writer appended): the
                    # blob's length is the truth, re-read it and continue from there.
                    self.resume()
                    continue
                self.shipped += len(data)
                self.blocks += 1
                self.last_append = time.monotonic()
                appended += len(data)


def last_reports(path: Path) -> list[dict[str, Any]]:
    """The complete JSON lines of the metrics file's tail, oldest first, each reduced to the
    contract's keys (reads only the tail); NaN and infinities (Python's json writes them as bare
    NaN, Infinity) become strings, so a report stays valid JSON."""
    try:
        with open_regular(path, os.path.realpath(Path(path).parent)) as f:
            size = f.seek(0, os.SEEK_END)
            f.seek(max(0, size - METRICS_TAIL))
            tail = f.read()
    except (FileNotFoundError, Refused):
        return []
    reports = []
    for line in tail.split(b"\n")[:-1]:  # the part after the last newline is incomplete
        try:
            obj = json.loads(line)
        except ValueError:
            continue  # also the first line, when the tail starts inside it
        metrics = safe_metrics(obj) if isinstance(obj, dict) else None
        if metrics:
            reports.append(metrics)
    return reports


def last_metrics(path: Path) -> dict[str, Any] | None:
    """The metrics file's last report (see `last_reports`), None without one."""
    reports = last_reports(path)
    return reports[-1] if reports else None


class ProgressReporter:
    """Puts the trainer's latest metrics into this job's progress ConfigMap, at most once per
    `interval` seconds and only when they changed. The interval counts from the last patch, not
    the last look: the first report, or a new one after a quiet spell, goes out at the next pass
    (the stall clock, jobsync/stall.py, starts at the second distinct step it sees).

    Least privilege: the operator gives each job a Role that allows only `patch` on that
    one ConfigMap (resourceNames), bound to the pod's ServiceAccount, whose token is projected
    into this container alone (render/logship.py). The sidecar can change neither the job nor
    its status: the operator copies the metrics into `status.metrics` for display and never
    acts on them."""

    def __init__(self, path: Path, interval: float, patch: Callable[[dict], Any]):
        self.path, self.interval, self.patch = Path(path), interval, patch
        self.sent: dict[str, Any] | None = None
        self.last_patch = float("-inf")

    def tick(self, force: bool = False) -> None:
        if not force and time.monotonic() - self.last_patch < self.interval:
            return
        reports = last_reports(self.path)
        metrics = reports[-1] if reports else None
        if metrics is None or metrics == self.sent:
            return
        # the whole report as one string value: the latest report, never a blend of old ones;
        # beside it the recent throughput, for `trainop describe`'s chart
        self.patch({"data": {PROGRESS_KEY: json.dumps(metrics, allow_nan=False, sort_keys=True),
                             HISTORY_KEY: json.dumps(history_samples(reports), allow_nan=False)}})
        self.sent, self.last_patch = metrics, time.monotonic()


def kube_progress_patcher(name: str, namespace: str) -> Callable[[dict], Any]:
    """A function that merge-patches ConfigMap `name` (the job's progress ConfigMap)."""
    import kubernetes

    from trainop import kube

    # the token projected into this container in a cluster; $KUBECONFIG outside one (tests)
    api = kubernetes.client.CoreV1Api(kube.connect()[0])

    def patch(body: dict) -> Any:
        return api.patch_namespaced_config_map(name, namespace, body)
    return patch


def upload_dir(container, src: Path, dest: str, seen: dict[str, str] | None = None,
               skip: tuple[str, ...] = ()) -> int:
    """Upload every file under `src` to block blobs under `dest/`; returns how many were uploaded.
    Symbolic links are skipped, with a warning naming them, and never followed: training code
    could otherwise point one at any file the sidecar can read (its projected API token, say)
    and have it uploaded. Each blob records its file's size and mtime (metadata SOURCE_META): a file whose blob already
    says the same is skipped, so a restarted sidecar uploads only what changed; `seen` remembers
    the same locally between passes, so an unchanged file costs no request at all."""
    from azure.core.exceptions import ResourceNotFoundError

    seen = {} if seen is None else seen
    uploaded = 0
    for path, link in _walk(Path(src)):
        if path.relative_to(src).as_posix() in skip:
            continue
        name = f"{dest}/{path.relative_to(src).as_posix()}"
        if link:
            if seen.get(name) != LINK:  # once per link, not on every pass
                log.warning("not uploading %s: a symbolic link (links are never followed)", path)
                seen[name] = LINK
            continue
        stat = path.stat(follow_symlinks=False)
        source = f"{stat.st_size}:{stat.st_mtime_ns}"
        if seen.get(name) == source:
            continue
        client = container.get_blob_client(name)
        try:
            stored = (client.get_blob_properties().metadata or {}).get(SOURCE_META)
        except ResourceNotFoundError:
            stored = None
        if stored != source:
            with _open_inside(path, Path(src)) as f:
                client.upload_blob(f, length=stat.st_size, overwrite=True, max_concurrency=1,
                                   metadata={SOURCE_META: source})
            uploaded += 1
        seen[name] = source
    return uploaded


def _open_inside(path: Path, src: Path):
    """`path` opened for reading, refusing a link swapped in since the walk (open_regular)."""
    return open_regular(path, os.path.realpath(src))


def _walk(src: Path) -> list[tuple[Path, bool]]:
    """(path, is a symbolic link) of every regular file and every link under `src`, sorted;
    links, to files or folders, are neither followed nor entered."""
    found = []
    for root, dirs, files in os.walk(src, followlinks=False):
        for name in dirs + files:
            path = Path(root) / name
            if path.is_symlink():
                found.append((path, True))
            elif name in files and path.is_file():  # not a fifo or socket
                found.append((path, False))
    return sorted(found)


CHECKPOINT_MARKER = "COMPLETE"  # the trainer's (trainop_trainer/checkpoint.py): written last
MAX_MARKER = 64 * 1024  # more than any COMPLETE the trainer writes


def complete_checkpoints(directory: Path) -> list[tuple[int, Path]]:
    """(step, folder) of every complete `step-<k>` folder in one attempt's checkpoint folder,
    by step. The trainer renames a folder into place only once it is whole."""
    out = []
    try:
        entries = list(Path(directory).iterdir())
    except FileNotFoundError:
        return []
    for path in entries:
        name = path.name
        if name.startswith("step-") and name[5:].isdigit() and not path.is_symlink() and \
                (path / CHECKPOINT_MARKER).is_file():
            out.append((int(name[5:]), path))
    return sorted(out)


class CheckpointReporter:
    """Reports the trainer's newest complete checkpoint into the progress ConfigMap (key
    `checkpoint`: {"step", "time", "path", "saveSeconds"}: its COMPLETE's time and save
    duration), after uploading it when `upload` is set: every file
    first, COMPLETE last, so a copy with COMPLETE is whole. The operator checks the path
    (trainop.resume.accept) and passes it to the next attempt."""

    def __init__(self, directory: Path, patch: Callable[[dict], Any],
                 upload: tuple[Any, str] | None = None):
        self.directory, self.patch, self.upload = Path(directory), patch, upload
        self.reported: int | None = None

    def tick(self) -> None:
        found = complete_checkpoints(self.directory)
        if not found or found[-1][0] == self.reported:
            return
        step, folder = found[-1]
        where = str(folder)
        if self.upload:
            container, dest = self.upload
            where = f"{dest}/{self.directory.name}/{folder.name}"
            marker = folder / CHECKPOINT_MARKER
            upload_dir(container, folder, where, skip=(CHECKPOINT_MARKER,))
            with _open_inside(marker, folder) as f:
                container.get_blob_client(f"{where}/{CHECKPOINT_MARKER}").upload_blob(f, overwrite=True)
            log.info("uploaded checkpoint step %d to %s/", step, where)
        try:
            with _open_inside(folder / CHECKPOINT_MARKER, folder) as f:
                marker = json.loads(f.read(MAX_MARKER))
        except (ValueError, Refused):
            marker = None
        marker = marker if isinstance(marker, dict) else {}
        report = {"step": step, "path": where}
        if isinstance(marker.get("time"), str):
            report["time"] = marker["time"]
        if isinstance(marker.get("saveSeconds"), (int, float)) and not isinstance(marker["saveSeconds"], bool):
            report["saveSeconds"] = marker["saveSeconds"]
        self.patch({"data": {CHECKPOINT_KEY: json.dumps(report, sort_keys=True)}})
        self.reported = step


def fetch_dir(container, src: str, dest: Path) -> int:
    """Download the blob folder `src` into `dest` (the checkpoint to resume from). Refuses a
    folder without COMPLETE (not a whole checkpoint) and names outside `src/`; COMPLETE is
    written last, so the trainer never sees a partial copy as complete. Returns files fetched."""
    src = src.strip("/")
    names = [b.name for b in container.list_blobs(name_starts_with=src + "/")]
    if f"{src}/{CHECKPOINT_MARKER}" not in names:
        raise blob.BlobConfigError(f"--fetch {src}: no {CHECKPOINT_MARKER} blob there; not a complete checkpoint")
    dest.mkdir(parents=True, exist_ok=True)
    rel_names = sorted((n[len(src) + 1:] for n in names), key=lambda r: r == CHECKPOINT_MARKER)
    for rel in rel_names:
        parts = rel.split("/")
        if any(part in ("", ".", "..") for part in parts):
            raise blob.BlobConfigError(f"--fetch {src}: blob name {rel!r} is not a plain relative path")
        target = dest.joinpath(*parts)
        target.parent.mkdir(parents=True, exist_ok=True)
        with open(target, "wb") as f:
            container.get_blob_client(f"{src}/{rel}").download_blob(max_concurrency=4).readinto(f)
    log.info("fetched %d file(s) of %s into %s", len(rel_names), src, dest)
    return len(rel_names)


class Stop:
    """Set by SIGTERM/SIGINT. A plain flag polled in short slices: a threading.Event set from a
    signal handler can deadlock if the signal lands while the main thread holds its lock."""

    requested = False

    def wait(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while not self.requested and time.monotonic() < deadline:
            time.sleep(min(0.1, max(0.0, deadline - time.monotonic())))


@dataclass
class Shipper:
    """One sidecar's work: files to append, an optional output dir, an optional status reporter."""
    appenders: list[AppendShipper]
    interval: float
    output: tuple[Any, Path, str] | None = None  # (container client, local dir, blob prefix)
    metrics_file: Path | None = None
    reporter: ProgressReporter | None = None
    output_live: bool = False  # the trainer reported final: keep the output dir uploaded
    checkpoints: CheckpointReporter | None = None
    uploaded: dict[str, str] = field(default_factory=dict)  # upload_dir's `seen`

    def run(self, stop: Stop, drain_timeout: float) -> int:
        while not stop.requested:
            self._step(final=False)
            stop.wait(self.interval)
        return self.drain(drain_timeout)

    def _step(self, final: bool) -> bool:
        ok, now = True, time.monotonic()
        for appender in self.appenders:
            if final or appender.due(self.interval, now):
                ok &= _attempt(f"shipping {appender.path}", lambda: appender.ship(final))
        if self.reporter:
            ok &= _attempt("reporting metrics", lambda: self.reporter.tick(force=final))
        if self.checkpoints:  # on the drain too: the trainer saves one on SIGTERM
            ok &= _attempt("reporting the checkpoint", self.checkpoints.tick)
        # Once the trainer's report says final, the output dir is kept uploaded on every pass
        # (the model may be saved just after that report): an MPI worker's pod, and this sidecar,
        # may live on long after training, until the operator deletes it.
        if self.output and not final and self.metrics_file:
            self.output_live = self.output_live or bool((last_metrics(self.metrics_file) or {}).get("final"))
            if self.output_live:
                ok = _attempt("uploading output", self._upload_output) and ok
        return ok

    def _upload_output(self) -> None:
        count = upload_dir(*self.output, seen=self.uploaded)
        if count:
            log.info("uploaded %d output file(s) to %s/", count, self.output[2])

    def drain(self, timeout: float) -> int:
        """Ship everything left, then the output dir (again: only what changed since); retry
        failures until `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            ok = self._step(final=True)
            if ok and self.output:
                ok = _attempt("uploading output", self._upload_output)
            if ok:
                log.info("drained: %s", ", ".join(f"{a.path} {a.shipped} bytes" for a in self.appenders))
                return 0
            if time.monotonic() >= deadline:
                log.error("giving up: not everything reached Blob Storage within %ss", timeout)
                return 1
            time.sleep(1)


_secret: str | None = None  # the credential, to be redacted from any message


def _attempt(what: str, fn: Callable[[], Any]) -> bool:
    """Run `fn`; a failure is logged in one line without secrets and retried on the next pass."""
    try:
        fn()
        return True
    except Exception as exc:  # the sidecar must outlive transient storage/API faults
        log.warning("%s failed: %s", what, blob.explain(exc, _secret))
        return False


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m trainop.logship", description=__doc__.splitlines()[0])
    p.add_argument("--account-url", help="Blob endpoint, e.g. https://acct.blob.core.windows.net (not used with a connection string)")
    p.add_argument("--container", help="Blob container; without it the sidecar only reports (--progress): "
                                        "a job whose output is a claim")
    p.add_argument("--dest", help="blob folder of this run: <prefix>/<namespace>/<job>-<uid8>/<attempt>")
    p.add_argument("--file", action="append", default=[], metavar="PATH=BLOB",
                   help="append PATH to the Append Blob <dest>/BLOB (repeatable)")
    p.add_argument("--output-dir", type=Path, help="uploaded to <dest>/output/ when the sidecar stops")
    p.add_argument("--metrics-file", type=Path,
                   help="the trainer's JSON-lines metrics: reported to the job's progress ConfigMap "
                        "(with --progress); a report with final: true uploads --output-dir right away")
    p.add_argument("--progress", metavar="CONFIGMAP",
                   help="the job's progress ConfigMap, patched with the latest metrics (needs --metrics-file)")
    p.add_argument("--namespace", default=os.environ.get("POD_NAMESPACE"))
    p.add_argument("--pod-uid", default=os.environ.get("POD_UID", ""),
                   help="this pod's UID (downward API); tells a recreated pod from a restarted sidecar")
    p.add_argument("--interval", type=float, default=2.0, help="seconds between shipping passes")
    p.add_argument("--metrics-interval", type=float, default=15.0, help="least seconds between status patches")
    p.add_argument("--drain-timeout", type=float, default=25.0,
                   help="seconds to keep retrying the final flush after SIGTERM (keep below the pod's grace period)")
    p.add_argument("--checkpoint-dir", type=Path,
                   help="this attempt's checkpoint folder: each new complete step-<k> is reported to --progress")
    p.add_argument("--checkpoint-upload", action="store_true",
                   help="upload each checkpoint to <dest>/output/checkpoints/<attempt-n>/ before reporting it")
    p.add_argument("--fetch", metavar="BLOB_FOLDER",
                   help="fetch mode: download this checkpoint folder into --fetch-to and exit")
    p.add_argument("--fetch-to", type=Path, metavar="DIR")
    args = p.parse_args(argv)
    if args.fetch and not args.fetch_to:
        p.error("--fetch: needs --fetch-to DIR")
    if not args.container:
        shipping = [flag for flag, value in (("--file", args.file), ("--output-dir", args.output_dir),
                                             ("--checkpoint-upload", args.checkpoint_upload),
                                             ("--fetch", args.fetch), ("--dest", args.dest)) if value]
        if shipping or not args.progress:
            p.error(f"{', '.join(shipping) or 'shipping nothing'}: needs --container (only --progress "
                    f"reporting works without Blob Storage)")
    elif not args.fetch and not args.dest:
        p.error("--dest is required (except with --fetch)")
    if args.checkpoint_dir and not args.progress:
        p.error("--checkpoint-dir: needs --progress (the ConfigMap it reports to)")
    for spec in args.file:
        if "=" not in spec or not spec.split("=", 1)[1]:
            p.error(f"--file {spec!r}: expected PATH=BLOB, e.g. /var/log/trainop/train.log=launcher.log")
    if args.progress and not (args.metrics_file and args.namespace):
        p.error("--progress: needs --metrics-file and --namespace (or $POD_NAMESPACE)")
    return args


def main(argv: list[str] | None = None) -> int:
    global _secret
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s logship: %(message)s")
    logging.getLogger("azure").setLevel(logging.WARNING)  # the SDK's request logs are not ours to print
    args = parse_args(argv)
    stop = Stop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: setattr(stop, "requested", True))
    if not args.container:  # a claim's job: report the metrics and checkpoints, ship nothing
        patch = kube_progress_patcher(args.progress, args.namespace)
        checkpoints = CheckpointReporter(args.checkpoint_dir, patch) if args.checkpoint_dir else None
        log.info("reporting %s to ConfigMap %s every %ss", args.metrics_file, args.progress, args.interval)
        return Shipper([], args.interval, None, args.metrics_file,
                       ProgressReporter(args.metrics_file, args.metrics_interval, patch),
                       checkpoints=checkpoints).run(stop, args.drain_timeout)
    try:
        method, _secret = blob.auth_from_env()
        url = args.account_url if method == "ConnectionString" else blob.check_account_url(args.account_url, "--account-url")
        service = blob.service_client(url, method, _secret, max_single_put_size=CHUNK, max_block_size=CHUNK)
    except blob.BlobConfigError as exc:
        log.error("%s", exc)
        return 2
    container = service.get_container_client(args.container)
    if args.fetch:
        try:
            fetch_dir(container, args.fetch, args.fetch_to)
        except Exception as exc:  # one line, no secret: the pod's init container fails with it
            log.error("fetching %s failed: %s", args.fetch, blob.explain(exc, _secret))
            return 1
        return 0
    dest = args.dest.strip("/")
    appenders = []
    for spec in args.file:
        path, name = spec.split("=", 1)
        appenders.append(AppendShipper(container.get_blob_client(f"{dest}/{name}"), Path(path), args.pod_uid))
    reporter = checkpoints = None
    if args.progress:
        patch = kube_progress_patcher(args.progress, args.namespace)
        reporter = ProgressReporter(args.metrics_file, args.metrics_interval, patch)
        if args.checkpoint_dir:
            upload = (container, f"{dest}/output/checkpoints") if args.checkpoint_upload else None
            checkpoints = CheckpointReporter(args.checkpoint_dir, patch, upload)
    output = (container, args.output_dir, f"{dest}/output") if args.output_dir else None
    log.info("shipping %d file(s) to %s/%s every %ss", len(appenders), args.container, dest, args.interval)
    return Shipper(appenders, args.interval, output, args.metrics_file, reporter,
                   checkpoints=checkpoints).run(stop, args.drain_timeout)


if __name__ == "__main__":
    sys.exit(main())
