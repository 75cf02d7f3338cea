"""The all-reduce run by hand that the preflight's figure is compared with (docs/benchmarks.md):
a plain torch.distributed loop, no trainop code, bus bandwidth by nccl-tests' formula
busbw = bytes x 2(n-1)/n / seconds. One process per GPU under torchrun:

    torchrun --standalone --nproc-per-node=4 bench/allreduce.py --size-mb 64 1024 --iterations 20
"""

import argparse
import json
import os
import time

import torch
import torch.distributed as dist


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--size-mb", type=int, nargs="+", default=[64])
    p.add_argument("--iterations", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    args = p.parse_args()
    cuda = torch.cuda.is_available()
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if cuda:
        torch.cuda.set_device(local)
    dist.init_process_group("nccl" if cuda else "gloo")
    n = dist.get_world_size()
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    for size_mb in args.size_mb:
        data = torch.ones(size_mb * 2**20 // 4, dtype=torch.float32, device=device)
        for _ in range(args.warmup):
            dist.all_reduce(data)
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(args.iterations):
            dist.all_reduce(data)
        if cuda:
            torch.cuda.synchronize()
        t = torch.tensor([(time.perf_counter() - start) / args.iterations], dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the slowest rank's time, as the preflight
        seconds = t.item()
        size = data.numel() * 4
        if dist.get_rank() == 0:
            print("allreduce-by-hand: " + json.dumps({
                "ranks": n, "sizeBytes": size, "iterations": args.iterations,
                "secondsPerIteration": seconds,
                "busBandwidthGBps": round(size * 2 * (n - 1) / n / seconds / 1e9, 3)}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
