"""The fabric check before training: `python -m trainop_trainer.preflight`, one process per GPU
(or one per worker on CPUs) under torchrun, whose node rank is the worker index.

1. A timed all-reduce across the whole gang (NCCL on GPUs, Gloo on CPUs): bus bandwidth
   busbw = bytes x 2(n-1)/n / seconds, the figure nccl-tests prints, so results compare across
   gang sizes. The slowest rank's time counts (all ranks agree on the verdict).
2. Below --min-busbw, the same test between pairs of workers around a ring (i, i+1): a worker
   slow in both its pairs while other pairs pass is the suspect. The operator draws that
   conclusion (trainop/preflight.py); this program only measures.
3. Which network NCCL chose: NCCL_DEBUG=INFO with NCCL_DEBUG_SUBSYS=INIT,NET written to a file
   (NCCL_DEBUG_FILE) and read back ("Using network IB" or "NET/IB" vs "Socket"). Gloo is TCP:
   Socket. If any rank uses sockets, the gang's transport is Socket.

The first process of every worker writes the result as one JSON line to --result-file (the
operator points it at the container's termination message, at most 4096 bytes) and prints it
prefixed by "trainop-preflight: ". Every rank exits with --exit-code-slow when the gang is
below the threshold, else 0.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import socket
import sys
import time

from trainop_trainer.nccl import transport_from_log  # the parser training uses too

RESULT_MAX = 4096  # bytes the kubelet keeps of a termination message
NCCL_LOG = "/tmp/trainop-nccl.%h.%p.log"


def bus_bandwidth(size_bytes: int, seconds: float, ranks: int) -> float:
    """GB/s (10^9 bytes) of an all-reduce, as nccl-tests reports it."""
    if ranks < 2 or seconds <= 0:
        return 0.0
    return size_bytes * 2 * (ranks - 1) / ranks / seconds / 1e9


def ring_pairs(workers: int) -> list[tuple[int, int]]:
    """Every worker in two pairs (one with 2 workers, none with 1)."""
    if workers < 2:
        return []
    pairs = [(i, (i + 1) % workers) for i in range(workers)]
    return [tuple(sorted(p)) for p in pairs[: 1 if workers == 2 else workers]]


def _read_nccl_log() -> str:
    pattern = NCCL_LOG.replace("%h", socket.gethostname()).replace("%p", str(os.getpid()))
    out = []
    for path in glob.glob(pattern):
        with open(path, errors="replace") as f:
            out.append(f.read())
    return "\n".join(out)


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m trainop_trainer.preflight", description=__doc__.split("\n\n")[0])
    p.add_argument("--min-busbw", type=float, default=0.0, help="GB/s; below it the gang fails the check (0: report only)")
    p.add_argument("--size-mb", type=int, default=64, help="MiB all-reduced per iteration")
    p.add_argument("--iterations", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--workers", type=int, default=0, help="workers (nodes) in the gang; default WORLD_SIZE / LOCAL_WORLD_SIZE")
    p.add_argument("--result-file", default="", help="where the first process of each worker writes the result JSON")
    p.add_argument("--exit-code-slow", type=int, default=3)
    args = p.parse_args(argv)
    if args.size_mb < 1 or args.iterations < 1 or args.warmup < 0 or args.min_busbw < 0:
        p.error("--size-mb and --iterations must be positive, --warmup and --min-busbw >= 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    # NCCL reads these when the first communicator is made: its INFO lines go to a file of this
    # process, not to the job's log.
    os.environ.update({"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,NET", "NCCL_DEBUG_FILE": NCCL_LOG})
    import torch
    import torch.distributed as dist

    cuda = torch.cuda.is_available()
    backend = "nccl" if cuda else "gloo"
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if cuda:
        torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    per_worker = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    workers = args.workers or max(world // per_worker, 1)
    numel = args.size_mb * 2**20 // 4
    size_bytes = numel * 4
    data = torch.ones(numel, dtype=torch.float32, device=device)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(device)

    def timed(group=None) -> float:
        """Seconds per all-reduce in `group` (this rank's view)."""
        for _ in range(args.warmup):
            dist.all_reduce(data, group=group)
        sync()
        start = time.perf_counter()
        for _ in range(args.iterations):
            dist.all_reduce(data, group=group)
        sync()
        return (time.perf_counter() - start) / args.iterations

    def slowest(values: list[float]) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.tolist()

    seconds = slowest([timed()])[0]
    busbw = bus_bandwidth(size_bytes, seconds, world)
    if backend == "gloo":
        transport = "Socket"
    else:
        transport = transport_from_log(_read_nccl_log()) or "unknown"
    socket_anywhere = slowest([1.0 if transport == "Socket" else 0.0])[0] > 0
    result = {"busBandwidthGBps": round(busbw, 3), "minBusBandwidthGBps": args.min_busbw,
              "passed": busbw >= args.min_busbw, "sizeBytes": size_bytes, "worldSize": world,
              "workers": workers, "backend": backend,
              "transport": "Socket" if socket_anywhere else transport}
    if not result["passed"] and workers >= 2:
        pairs = ring_pairs(workers)
        times = [0.0] * len(pairs)
        for n, (a, b) in enumerate(pairs):
            ranks = [r for w in (a, b) for r in range(w * per_worker, (w + 1) * per_worker)]
            group = dist.new_group(ranks)  # every rank makes every group, in the same order
            if rank in ranks:
                times[n] = timed(group)
            dist.barrier()
        times = slowest(times)
        result["pairs"] = [{"workers": [a, b], "busBandwidthGBps": round(bus_bandwidth(size_bytes, t, 2 * per_worker), 3)}
                           for (a, b), t in zip(pairs, times)]
    text = json.dumps(result, separators=(",", ":"))
    while len(text.encode()) > RESULT_MAX and result.get("pairs"):
        result["pairs"].pop()  # a termination message keeps 4096 bytes
        text = json.dumps(result, separators=(",", ":"))
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
        print(f"trainop-preflight: {text}", flush=True)
        if args.result_file:
            with open(args.result_file, "w") as f:
                f.write(text)
    dist.destroy_process_group()
    return 0 if result["passed"] else args.exit_code_slow


if __name__ == "__main__":
    sys.exit(main())
