"""Bench: the log shipper moves a large log (default 1 GiB) to an Append Blob with bounded memory.

Runs against a private Azurite on loopback (node_modules/.bin/azurite-blob, as the tests do).
Three child processes, each measured alone (peak RSS from os.wait4, wall time):
  1. baseline  - the shipper shipping a 1 MiB log (its fixed cost: interpreter + Azure SDK);
  2. shipper   - the shipper shipping the large log (all of it in the SIGTERM drain);
  3. sdk       - plain azure-storage-blob `upload_blob` of the same file as a block blob, one
                 connection (the throughput a single stream gets from this Azurite).
Prints peak RSS of (2) against (1), and throughput of (2) against (3); checks the blob is
byte-exact (MD5, computed streaming).

    .venv/bin/python bench/logship_rss.py [--size-mb 1024]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from tests.fixtures.azurite import ACCOUNT, ACCOUNT_KEY, AZURITE_BIN, _ready, free_port  # noqa: E402
from tests.fixtures.waiting import wait_until  # noqa: E402

SDK_UPLOAD = """
import sys
from azure.core.credentials import AzureNamedKeyCredential
from azure.storage.blob import BlobClient
url, key, container, name, path = sys.argv[1:]
client = BlobClient(url, container, name, credential=AzureNamedKeyCredential("devstoreaccount1", key),
                    max_single_put_size=4 << 20, max_block_size=4 << 20)
with open(path, "rb") as f:
    client.upload_blob(f, overwrite=True, max_concurrency=1)
"""


def write_log(path: Path, size: int) -> None:
    line = b"epoch 1 step 000000 loss=6.912 images/sec=1234.5 " + b"x" * 60 + b"\n"
    with open(path, "wb") as f:
        block = line * ((1 << 20) // len(line))
        written = 0
        while written < size:
            piece = block[: size - written]
            f.write(piece)
            written += len(piece)


def md5_file(path: Path) -> str:
    h = hashlib.md5()
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            h.update(chunk)
    return h.hexdigest()


def md5_blob(client) -> str:
    h = hashlib.md5()
    for chunk in client.download_blob(max_concurrency=1).chunks():
        h.update(chunk)
    return h.hexdigest()


def measure(cmd: list[str], env: dict, stop_when=None) -> tuple[float, int, int]:
    """(seconds, peak RSS in MiB, exit code) of one child process. `stop_when`: a predicate on the
    child's output file after which it gets SIGTERM."""
    out = tempfile.NamedTemporaryFile(delete=False, suffix=".log")
    start = time.monotonic()
    proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
    if stop_when:
        wait_until(lambda: stop_when(Path(out.name).read_text()), timeout=60, what="the shipper to start")
        proc.send_signal(signal.SIGTERM)
    _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.monotonic() - start
    code = os.waitstatus_to_exitcode(status)
    if code:
        sys.exit(f"{cmd[:3]} exited {code}: {Path(out.name).read_text()[-2000:]}")
    return seconds, usage.ru_maxrss // 1024, code


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size-mb", type=int, default=1024)
    args = ap.parse_args()
    from azure.storage.blob import BlobServiceClient

    with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR")) as tmp:
        tmp = Path(tmp)
        port = free_port()
        url = f"http://127.0.0.1:{port}/{ACCOUNT}"
        azurite = subprocess.Popen([str(AZURITE_BIN), "--blobHost", "127.0.0.1", "--blobPort", str(port),
                                    "--location", str(tmp / "azurite"), "--loose", "--skipApiVersionCheck",
                                    "--disableTelemetry", "--silent"], stdout=subprocess.DEVNULL,
                                   stderr=subprocess.DEVNULL, start_new_session=True)
        try:
            wait_until(lambda: _ready(url, None), timeout=60, what="azurite")
            from azure.core.credentials import AzureNamedKeyCredential
            service = BlobServiceClient(url, AzureNamedKeyCredential(ACCOUNT, ACCOUNT_KEY))
            container = service.create_container("bench")
            small, big = tmp / "small.log", tmp / "big.log"
            write_log(small, 1 << 20)
            write_log(big, args.size_mb << 20)
            env = {**os.environ, "TRAINOP_BLOB_AUTH_METHOD": "AccountKey", "TRAINOP_BLOB_SECRET": ACCOUNT_KEY,
                   "POD_UID": "bench"}

            def ship(path: Path, name: str):
                cmd = [sys.executable, "-m", "trainop.logship", "--account-url", url, "--container", "bench",
                       "--dest", "bench", "--file", f"{path}={name}", "--interval", "3600", "--drain-timeout", "600"]
                return measure(cmd, env, stop_when=lambda text: "resuming" in text)

            base_s, base_rss, _ = ship(small, "small.log")
            ship_s, ship_rss, _ = ship(big, "big.log")
            sdk_s, sdk_rss, _ = measure([sys.executable, "-c", SDK_UPLOAD, url, ACCOUNT_KEY, "bench", "sdk.bin",
                                         str(big)], env)
            exact = md5_blob(container.get_blob_client("bench/big.log")) == md5_file(big)
        finally:
            azurite.terminate()
            azurite.wait()

    size = args.size_mb << 20
    print(f"logship bench  {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC  {platform.node()}  "
          f"{os.cpu_count()} CPUs  log {args.size_mb} MiB  byte-exact: {exact}")
    print(f"  baseline (1 MiB log)    peak RSS {base_rss:5d} MiB  {base_s:6.1f} s")
    print(f"  shipper ({args.size_mb} MiB log)  peak RSS {ship_rss:5d} MiB  {ship_s:6.1f} s  "
          f"{size / ship_s / 2**20:6.1f} MiB/s")
    print(f"  sdk upload_blob         peak RSS {sdk_rss:5d} MiB  {sdk_s:6.1f} s  {size / sdk_s / 2**20:6.1f} MiB/s")
    print(f"  RSS growth over baseline: {ship_rss - base_rss} MiB ({ship_rss / base_rss:.2f}x) for a "
          f"{args.size_mb} MiB log; throughput {sdk_s / ship_s:.2f}x of the SDK's single-stream upload")
    if not exact:
        sys.exit("blob differs from the log")


if __name__ == "__main__":
    main()
