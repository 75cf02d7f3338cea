"""Stager throughput against Azurite vs a plain sequential download with the same SDK, same run.

    .venv/bin/python bench/stager_bench.py [--large-mib 192] [--small-count 1500] [--repeat 3]

Two data sets, each copied by both methods into fresh temp folders, alternating, `--repeat`
times; the best time of each is reported (MB/s and the ratio stager/baseline). The baseline is
what a script would do without the stager: list, then `download_blob(name).readinto(file)` one
blob after another with the SDK's default settings. The stager runs in-process with its CLI
defaults (16 blobs in flight, 4 ranges per large blob, no MD5 verify, then once more with
--verify for the cost of hashing).

Azurite (one Node.js process) serves both sides, so the figures describe the stager's overhead
and concurrency on loopback, not Azure's limits. azcopy is not compared: the Go module proxy
refuses github.com/Azure/azure-storage-azcopy/v10 (403 "not available", 2026-11-26).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # for tests.fixtures (trainop is installed)

from tests.fixtures import azurite as azurite_mod  # noqa: E402
from trainop import blob, stager  # noqa: E402


def populate(container, sizes: dict[str, int]) -> int:
    rng = random.Random(1)
    blocks = [rng.randbytes(1 << 20) for _ in range(4)]

    def body(size: int) -> bytes:
        whole, rest = divmod(size, 1 << 20)
        return b"".join(blocks[i % 4] for i in range(whole)) + blocks[0][:rest]

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda kv: container.upload_blob(kv[0], body(kv[1]), overwrite=True), sizes.items()))
    return sum(sizes.values())


def baseline(container, dest: Path) -> None:
    for props in container.list_blobs():
        path = dest / props.name
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "wb") as f:
            container.download_blob(props.name).readinto(f)


def staged(container, dest: Path, verify: bool) -> None:
    progress = stager.Progress(lambda _: None, interval=3600)
    stager.Stager(container, dest, concurrency=16, range_concurrency=4, verify=verify,
                  extract=False, progress=progress).run([""])


def timed(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--large-mib", type=int, default=192, help="total MiB of 32 MiB blobs")
    p.add_argument("--small-count", type=int, default=1500, help="number of 64 KiB blobs")
    p.add_argument("--repeat", type=int, default=3)
    args = p.parse_args()
    sets = {
        "large (32 MiB blobs)": {f"large/{i}.bin": 32 << 20 for i in range(args.large_mib // 32)},
        "small (64 KiB blobs)": {f"small/{i // 100}/{i}.bin": 64 << 10 for i in range(args.small_count)},
    }
    results = {"host": platform.node(), "cpus": os.cpu_count(), "loadavg": os.getloadavg(),
               "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "sets": {}}
    with tempfile.TemporaryDirectory() as tmp, azurite_mod.running(Path(tmp), https=False) as server:
        service = blob.service_client(server.http_url, "AccountKey", server.account_key,
                                      max_single_get_size=stager.FIRST_GET, max_chunk_get_size=stager.CHUNK_GET)
        plain_service = blob.service_client(server.http_url, "AccountKey", server.account_key)  # SDK defaults
        for label, sizes in sets.items():
            name = f"bench-{len(results['sets'])}"
            server.service().create_container(name)
            total = populate(server.service().get_container_client(name), sizes)
            best = {"baseline": float("inf"), "stager": float("inf"), "stager --verify": float("inf")}
            for run in range(args.repeat):
                for method, fn in (("baseline", lambda d: baseline(plain_service.get_container_client(name), d)),
                                   ("stager", lambda d: staged(service.get_container_client(name), d, False)),
                                   ("stager --verify", lambda d: staged(service.get_container_client(name), d, True))):
                    dest = Path(tmp) / f"out-{label[:5]}-{method[:8]}-{run}"
                    dest.mkdir()
                    best[method] = min(best[method], timed(lambda: fn(dest)))
            mbs = {m: round(total / 1e6 / t, 1) for m, t in best.items()}
            results["sets"][label] = {
                "blobs": len(sizes), "MB": round(total / 1e6, 1), "MB/s": mbs,
                "stager/baseline": round(mbs["stager"] / mbs["baseline"], 2),
                "stager --verify/baseline": round(mbs["stager --verify"] / mbs["baseline"], 2)}
            print(json.dumps({label: results["sets"][label]}), flush=True)
    print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
