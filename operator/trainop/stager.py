"""`python -m trainop.stager`: copy a Blob Storage container (prefix) onto a share, resumably.

Run by a DataStage's copy Job with the NFS share mounted read-write; tests run it as a plain
process against Azurite and a temp dir. Auth comes from the env (trainop.blob: the method and a
Secret-backed value, or the AKS workload-identity env).

Layout on the share, under `--dest`:
  <blob name>                   the copied files (full blob names, so several prefixes never clash)
  <archive>.d/                  what `--extract` unpacked from <archive> (.tar, .tar.gz, .tgz)
  .trainop/manifest.jsonl       journal: one line per completed file/extraction (size, ETag, MD5,
                                local mtime); a line is appended only after the file is renamed
                                into place, so a SIGKILL loses at most the files in flight
  .trainop/tmp/                 downloads in progress (same filesystem, so rename is atomic)

Blobs that cannot become files are skipped, each with a WARNING line naming it, and counted
(`skippedBlobs`, the first SKIPPED_LISTED in `skipped`): a name that escapes the destination, a
path part longer than NAME_MAX (255 bytes), a name that is also another blob's folder (`a` next
to `a/b`: `a` is skipped), or one that maps to the same file as an earlier name (`a//b`, `a/b`).
One odd blob never fails the whole copy.

A re-run skips a blob whose journal entry matches its current ETag and size and whose local file
still has the recorded size and mtime (with `--verify`, also the recorded MD5, recomputed): what
is missing, changed in Blob Storage or changed on the share is copied again.

Output: JSON progress lines on stdout (at most one per `--progress-interval`, plus the first and
the last), and, with `--progress-configmap ns/name`, the same counters as one JSON report in that
ConfigMap (the DataStage's progress ConfigMap: its only right; the operator checks the report and
writes the DataStage's status, render/datastage.progress_report). A failure prints ONE line to
stderr (no secret, no traceback), is reported as `lastError`, and exits non-zero: 2 for
configuration/auth, 3 for network, 1 otherwise. Nothing is written to the share before the
listing has succeeded.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import shutil
import sys
import tarfile
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass
from pathlib import Path, PurePosixPath

from azure.core import MatchConditions
from azure.core.exceptions import ServiceRequestError, ServiceResponseError

from trainop import blob

log = logging.getLogger("trainop.stager")

STATE_DIR = ".trainop"
ARCHIVE_SUFFIXES = (".tar.gz", ".tgz", ".tar")
EXTRACT_SUFFIX = ".d"
# Range-level transfer sizes: the first GET fetches up to 8 MiB; the rest of a bigger blob comes
# in 8 MiB ranges, `--range-concurrency` at a time. (The SDK's defaults, a 32 MiB first GET, leave
# every blob below 32 MiB single-threaded; 4 MiB ranges doubled the request count for nothing.)
FIRST_GET = 8 << 20
CHUNK_GET = 8 << 20
HASH_BLOCK = 1 << 20
NAME_MAX = 255         # bytes of one path part (Linux, NFS)
PATH_MAX = 4095        # bytes of the whole path below --dest
SKIPPED_LISTED = 20    # names written to status.skipped (all are logged)
EXIT_CONFIG, EXIT_NETWORK, EXIT_OTHER = 2, 3, 1


class StageError(RuntimeError):
    """A failure that ends the run with one line (already free of secrets)."""


@dataclass(frozen=True)
class Item:
    """One blob as listed."""
    name: str
    size: int
    etag: str
    md5: str | None  # hex Content-MD5 if the uploader set it (block uploads often don't)


@dataclass(frozen=True)
class Entry:
    """One manifest line: a blob copied (or an archive extracted) and the local file's state."""
    name: str
    etag: str
    size: int
    md5: str | None
    mtime_ns: int
    kind: str = "file"  # or "extracted"


class Manifest:
    """The journal on the share. Appends are serialised and flushed; the last line for a name wins;
    a torn last line (killed mid-write) is ignored."""

    def __init__(self, dest: Path):
        self.path = dest / STATE_DIR / "manifest.jsonl"
        self.entries: dict[tuple[str, str], Entry] = {}
        self._lock = threading.Lock()
        self._out = None

    def load(self) -> None:
        if not self.path.exists():
            return
        for line in self.path.read_text(encoding="utf-8", errors="replace").splitlines():
            try:
                entry = Entry(**json.loads(line))
            except (ValueError, TypeError):
                continue
            self.entries[(entry.kind, entry.name)] = entry

    def get(self, name: str, kind: str = "file") -> Entry | None:
        return self.entries.get((kind, name))

    def record(self, entry: Entry) -> None:
        with self._lock:
            if self._out is None:
                self._out = open(self.path, "a", encoding="utf-8")
            self._out.write(json.dumps(asdict(entry)) + "\n")
            self._out.flush()
            self.entries[(entry.kind, entry.name)] = entry

    def compact(self) -> None:
        """Rewrite with one line per entry (atomically), so the journal does not grow per run."""
        with self._lock:
            if self._out is not None:
                self._out.close()
                self._out = None
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text("".join(json.dumps(asdict(e)) + "\n" for e in self.entries.values()), encoding="utf-8")
            os.replace(tmp, self.path)


class Progress:
    """Thread-safe counters, reported to `sink` at most once per `interval` seconds."""

    def __init__(self, sink: Callable[[dict], None], interval: float):
        self.sink, self.interval = sink, interval
        self.bytes_total = self.files_total = self.bytes_copied = self.files_copied = 0
        self.files_downloaded = self.bytes_downloaded = 0
        self.skipped: list[tuple[str, str]] = []
        self._lock = threading.Lock()
        self._last = 0.0

    def snapshot(self) -> dict:
        return {"bytesCopied": self.bytes_copied, "bytesTotal": self.bytes_total,
                "filesCopied": self.files_copied, "filesTotal": self.files_total,
                "skippedBlobs": len(self.skipped),
                "skipped": [f"{name}: {why}" for name, why in self.skipped[:SKIPPED_LISTED]]}

    def add(self, nbytes: int = 0, files: int = 0, downloaded: bool = False) -> None:
        with self._lock:
            self.bytes_copied += nbytes
            self.files_copied += files
            if downloaded:
                self.bytes_downloaded += nbytes
                self.files_downloaded += files
            due = time.monotonic() - self._last >= self.interval
            if due:
                self._last = time.monotonic()
                snap = self.snapshot()
        if due:
            self.sink(snap)

    def report(self) -> None:
        with self._lock:
            self._last = time.monotonic()
            snap = self.snapshot()
        self.sink(snap)


def md5_of(path: Path) -> str:
    digest = hashlib.md5(usedforsecurity=False)
    with open(path, "rb") as f:
        while block := f.read(HASH_BLOCK):
            digest.update(block)
    return digest.hexdigest()


def local_path(dest: Path, name: str) -> Path:
    """Where blob `name` lands; refuses names that would escape `dest` or hit the state folder."""
    parts = PurePosixPath(name).parts
    if not parts or name.startswith("/") or ".." in parts or parts[0] == STATE_DIR:
        raise StageError(f"blob name {name!r} cannot be stored safely under the destination; rename the blob")
    return dest.joinpath(*parts)


def storable(items: list[Item], extract: bool) -> tuple[list[Item], list[tuple[str, str]]]:
    """The items that can become files, and (name, why) for those that cannot. Pure."""
    kept: dict[tuple[str, ...], Item] = {}
    skipped: list[tuple[str, str]] = []
    # a name already in normal form (ok/1.jpg) wins over its variants (ok//1.jpg, ok/./1.jpg)
    for item in sorted(items, key=lambda i: ("/".join(PurePosixPath(i.name).parts) != i.name, i.name)):
        parts = PurePosixPath(item.name).parts
        if not parts or item.name.startswith("/") or ".." in parts or parts[0] == STATE_DIR:
            skipped.append((item.name, "cannot be stored safely under the destination"))
        elif any(len(part.encode()) > NAME_MAX for part in parts):
            skipped.append((item.name, f"a path part is longer than {NAME_MAX} bytes"))
        elif len("/".join(parts).encode()) > PATH_MAX:
            skipped.append((item.name, f"the path is longer than {PATH_MAX} bytes"))
        elif parts in kept:
            skipped.append((item.name, f"maps to the same file as blob {kept[parts].name!r}"))
        else:
            kept[parts] = item
    # folders the kept files need (and the .d folders extraction makes): a file there must go
    folders = {parts[:i]: item.name for parts, item in kept.items() for i in range(1, len(parts))}
    if extract:
        folders |= {parts[:-1] + (parts[-1] + EXTRACT_SUFFIX,): item.name
                    for parts, item in kept.items() if item.name.endswith(ARCHIVE_SUFFIXES)}
    for parts in [p for p in kept if p in folders]:
        skipped.append((kept.pop(parts).name, f"is also a folder (blob {folders[parts]!r})"))
    return sorted(kept.values(), key=lambda i: i.name), skipped


def list_items(container, prefixes: Iterable[str]) -> list[Item]:
    items: dict[str, Item] = {}
    for prefix in prefixes:
        for props in container.list_blobs(name_starts_with=prefix or None):
            if props.name.endswith("/"):  # folder markers (hierarchical namespace)
                continue
            md5 = props.content_settings.content_md5
            items[props.name] = Item(props.name, props.size, props.etag, bytes(md5).hex() if md5 else None)
    return sorted(items.values(), key=lambda i: i.name)


def is_complete(item: Item, entry: Entry | None, path: Path, verify: bool) -> bool:
    if entry is None or entry.etag != item.etag or entry.size != item.size:
        return False
    try:
        stat = path.stat()
    except FileNotFoundError:
        return False
    if stat.st_size != item.size or stat.st_mtime_ns != entry.mtime_ns:
        return False
    if not verify:
        return True
    expected = entry.md5 or item.md5
    return expected is not None and md5_of(path) == expected  # unverifiable: copy again


class Stager:
    def __init__(self, container, dest: Path, *, concurrency: int, range_concurrency: int,
                 verify: bool, extract: bool, progress: Progress):
        self.container, self.dest = container, dest
        self.concurrency, self.range_concurrency = concurrency, range_concurrency
        self.verify, self.extract = verify, extract
        self.progress = progress
        self.manifest = Manifest(dest)
        self.tmp = dest / STATE_DIR / "tmp"

    def run(self, prefixes: list[str]) -> dict:
        items = list_items(self.container, prefixes)  # fails before anything is written
        items, skipped = storable(items, self.extract)
        for name, why in skipped:
            log.warning("skipped blob %r: %s", name, why)
        (self.dest / STATE_DIR).mkdir(parents=True, exist_ok=True)
        shutil.rmtree(self.tmp, ignore_errors=True)  # leftovers of a killed run
        self.tmp.mkdir()
        self.manifest.load()
        self._clear_old_files_in_the_way(items)
        self.progress.skipped = skipped
        self.progress.files_total = len(items)
        self.progress.bytes_total = sum(i.size for i in items)
        todo = []
        for item in items:
            if is_complete(item, self.manifest.get(item.name), local_path(self.dest, item.name), self.verify):
                self.progress.add(item.size, 1)
            else:
                todo.append(item)
        self.progress.report()
        self._parallel(self._copy, todo)
        if self.extract:
            archives = [i for i in items if i.name.endswith(ARCHIVE_SUFFIXES)]
            self._parallel(self._extract, archives)
        self.manifest.compact()
        shutil.rmtree(self.tmp, ignore_errors=True)
        self.progress.report()
        return {**self.progress.snapshot(), "filesDownloaded": self.progress.files_downloaded,
                "bytesDownloaded": self.progress.bytes_downloaded, "filesSkipped": len(items) - len(todo)}

    def _clear_old_files_in_the_way(self, items: list[Item]) -> None:
        """A file an earlier run copied (journalled) where a folder is now needed: `a` was
        copied, then `a/b` appeared and `a` is now skipped."""
        for name in {str(PurePosixPath(*PurePosixPath(i.name).parts[:n]))
                     for i in items for n in range(1, len(PurePosixPath(i.name).parts))}:
            path = self.dest / name
            if self.manifest.get(name) is not None and path.is_file() and not path.is_symlink():
                path.unlink()

    def _parallel(self, fn, items: list[Item]) -> None:
        """Run fn over items; the first failure cancels what has not started and is raised."""
        if not items:
            return
        with ThreadPoolExecutor(self.concurrency, thread_name_prefix="stage") as pool:
            futures = [pool.submit(fn, item) for item in items]
            done, _ = wait(futures, return_when=FIRST_EXCEPTION)
            failed = [f for f in done if f.exception()]
            if failed:
                for f in futures:
                    f.cancel()
                raise failed[0].exception()

    def _copy(self, item: Item) -> None:
        target = local_path(self.dest, item.name)
        tmp = self.tmp / f"{hashlib.sha1(item.name.encode()).hexdigest()}.part"
        reported = 0

        def on_progress(current: int, total: int | None) -> None:
            nonlocal reported
            self.progress.add(current - reported, downloaded=True)
            reported = current

        # The ETag condition makes a blob overwritten mid-copy fail instead of mixing versions.
        downloader = self.container.get_blob_client(item.name).download_blob(
            max_concurrency=self.range_concurrency, etag=item.etag, match_condition=MatchConditions.IfNotModified,
            progress_hook=on_progress)
        with open(tmp, "wb") as f:
            downloader.readinto(f)
            f.flush()
            os.fsync(f.fileno())
        md5 = md5_of(tmp) if self.verify else None
        if md5 and item.md5 and md5 != item.md5:
            tmp.unlink()
            raise StageError(f"MD5 mismatch for blob {item.name!r} (Content-MD5 {item.md5}, downloaded {md5}); the blob or the transfer is corrupt")
        target.parent.mkdir(parents=True, exist_ok=True)
        os.replace(tmp, target)
        self.manifest.record(Entry(item.name, item.etag, item.size, md5, target.stat().st_mtime_ns))
        self.progress.add(item.size - reported, 1, downloaded=True)

    def _extract(self, item: Item) -> None:
        """Unpack into <archive>.d/ once per archive version: into a temp folder, then rename."""
        archive = local_path(self.dest, item.name)
        target = archive.with_name(archive.name + EXTRACT_SUFFIX)
        done = self.manifest.get(item.name, "extracted")
        if done and done.etag == item.etag and target.is_dir():
            return
        tmp = self.tmp / f"{hashlib.sha1(item.name.encode()).hexdigest()}.extract"
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            with tarfile.open(archive) as tar:
                tar.extractall(tmp, filter="data")  # refuses absolute paths, .., device files
        except (tarfile.TarError, OSError) as exc:
            raise StageError(f"cannot extract {item.name!r}: {exc}") from None
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
        self.manifest.record(Entry(item.name, item.etag, item.size, None, target.stat().st_mtime_ns, "extracted"))


class ProgressSink:
    """Reports into the DataStage's progress ConfigMap (in-cluster, or via $KUBECONFIG for tests):
    the whole latest report under one key, merged with what was reported before (counters, then
    lastError), so the operator always reads one complete JSON object."""

    KEY = "status"  # render/datastage.PROGRESS_KEY (the stager's image need not import render/)

    def __init__(self, ref: str):
        from kubernetes import client, config
        try:
            self.namespace, self.name = ref.split("/", 1)
        except ValueError:
            raise blob.BlobConfigError(f"--progress-configmap: {ref!r} is not NAMESPACE/NAME") from None
        config.load_config()
        self.api = client.CoreV1Api()
        self.report: dict = {}
        self._lock = threading.Lock()
        self._warned = False

    def __call__(self, status: dict) -> None:
        with self._lock:
            self.report |= status
            body = {"data": {self.KEY: json.dumps(self.report, sort_keys=True)}}
        try:
            self.api.patch_namespaced_config_map(self.name, self.namespace, body)
        except Exception as exc:  # progress is best effort: the copy must not fail on it
            if not self._warned:
                log.warning("cannot report progress to ConfigMap %s/%s: %s", self.namespace, self.name,
                            getattr(exc, "reason", None) or type(exc).__name__)
                self._warned = True


def stdout_sink(status: dict) -> None:
    print(json.dumps({"event": "progress", **status}), flush=True)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m trainop.stager", description=__doc__.splitlines()[0])
    p.add_argument("--account-url", required=True, help="https://<account>.blob.core.windows.net (with a connection string, its own endpoint is used)")
    p.add_argument("--container", required=True)
    p.add_argument("--prefix", action="append", default=[], help="copy blobs whose names start with this; repeatable (default: all)")
    p.add_argument("--dest", required=True, type=Path, help="the share's mount point")
    p.add_argument("--concurrency", type=int, default=16, help="blobs in flight")
    p.add_argument("--range-concurrency", type=int, default=4, help="ranges in flight per large blob")
    p.add_argument("--verify", action="store_true", help="check MD5s: downloaded against Content-MD5, and local files on re-runs")
    p.add_argument("--extract", action="store_true", help="unpack .tar/.tar.gz/.tgz blobs into <name>.d/")
    p.add_argument("--progress-configmap", metavar="NAMESPACE/NAME",
                   help="report progress to this ConfigMap (the DataStage's, render/datastage.py)")
    p.add_argument("--progress-interval", type=float, default=5.0, help="seconds between progress reports")
    args = p.parse_args(argv)
    if args.concurrency < 1 or args.range_concurrency < 1:
        p.error("--concurrency and --range-concurrency must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    # The SDK logs retries and headers; the stager reports failures itself, in one line.
    logging.getLogger("azure").setLevel(logging.CRITICAL)
    secret = None
    status_sink = None
    try:
        if args.progress_configmap:
            status_sink = ProgressSink(args.progress_configmap)
        sinks = [stdout_sink] + ([status_sink] if status_sink else [])
        progress = Progress(lambda s: [sink(s) for sink in sinks], args.progress_interval)
        method, secret = blob.auth_from_env()
        url = args.account_url if method == "ConnectionString" else blob.check_account_url(args.account_url, "--account-url")
        service = blob.service_client(url, method, secret, max_single_get_size=FIRST_GET, max_chunk_get_size=CHUNK_GET)
        stager = Stager(service.get_container_client(args.container), args.dest,
                        concurrency=args.concurrency, range_concurrency=args.range_concurrency,
                        verify=args.verify, extract=args.extract, progress=progress)
        summary = stager.run(args.prefix or [""])
    except Exception as exc:
        line, code = _failure(exc, secret)
        print(f"stager: {line}", file=sys.stderr, flush=True)
        if status_sink:
            status_sink({"lastError": line})
        return code
    print(json.dumps({"event": "done", **summary}), flush=True)
    if status_sink:
        status_sink({"lastError": None})
    return 0


def _failure(exc: BaseException, secret: str | None) -> tuple[str, int]:
    if isinstance(exc, StageError):
        return str(exc), EXIT_OTHER
    if isinstance(exc, OSError):
        return blob.redact(f"cannot write the destination: {exc}", secret), EXIT_OTHER
    line = blob.explain(exc, secret)
    if isinstance(exc, (ServiceRequestError, ServiceResponseError)):
        return line, EXIT_NETWORK
    if isinstance(exc, blob.BlobConfigError) or line.startswith(("authentication failed", "not found")):
        return line, EXIT_CONFIG
    return line, EXIT_OTHER


if __name__ == "__main__":
    sys.exit(main())
