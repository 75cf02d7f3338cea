"""Where the CPU input pipeline's time goes: loaders alone (no model), one process per rank.

    torchrun --standalone --nproc-per-node R bench/loader_probe.py DATA --variant V [--workers W]

Each rank iterates its loader for --seconds after a warm-up and prints one JSON line with its
images/sec; run it under torchrun with as many ranks as GPUs to load the node as training does.
Variants isolate one suspect each (issue 18's hypotheses):
  pil        PIL decode in a multiprocessing.Pool, no torch: the decode ceiling of W processes
  old        the trainer before issue 18: per-image float32 normalise + CHW copy in the worker,
             default_collate of 256 images into a fresh shared-memory batch, pin_memory thread,
             float32 H2D copy (prefetch_factor 4)
  old-nopin  `old` without the pin-memory thread
  old-uint8  `old` with uint8 images (normalised on the device): the float32 bytes' share
  new-cpu    torch_data.Loader, decode cpu: whole uint8 batches built in place in shared memory
  new-gpu    torch_data.Loader, decode gpu: workers read bytes, nvJPEG decodes on the device
"""

from __future__ import annotations

import argparse
import json
import os
import time
from multiprocessing import Pool
from pathlib import Path

import numpy as np
import torch

from trainop_trainer import data, torch_data


def _decode_one(args):
    raw, i = args
    crop = data.draw_crop(*data.image_size_of(raw), np.random.default_rng(i))
    return data.normalise(data.decode_uint8(raw, crop, 224)).shape


class _PerImage(torch.utils.data.Dataset):
    """The pre-issue-18 dataset: one image per item, collated by DataLoader."""

    def __init__(self, samples, as_float: bool):
        self.samples, self.as_float = samples, as_float

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, i):
        s = self.samples[i]
        raw = s.read()
        crop = data.draw_crop(*data.image_size_of(raw), np.random.default_rng(i))
        img = data.decode_uint8(raw, crop, 224)
        if self.as_float:
            return torch.from_numpy(data.normalise(img).transpose(2, 0, 1).copy()), s.label
        return torch.from_numpy(img.copy()), s.label


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("data", type=Path)
    p.add_argument("--variant", required=True)
    p.add_argument("--workers", type=int, default=15)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--seconds", type=float, default=12)
    a = p.parse_args()
    rank, size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    ds = data.scan(a.data)
    mode = ds.read_mode("auto")
    shard = ds.shard(rank, size, mode)
    count = 0

    if a.variant == "pil":
        raws = [(s.read(), i) for i, s in enumerate(shard[:2000])]
        with Pool(a.workers) as pool:
            pool.map(_decode_one, raws[:a.workers * 4])
            start = time.perf_counter()
            while time.perf_counter() - start < a.seconds:
                count += len(pool.map(_decode_one, raws, chunksize=16))
            rate = count / (time.perf_counter() - start)
    else:
        if a.variant.startswith("old"):
            loader = torch.utils.data.DataLoader(
                _PerImage(shard, a.variant != "old-uint8"), batch_size=a.batch, shuffle=True, drop_last=True,
                num_workers=a.workers, pin_memory=a.variant != "old-nopin" and device.type == "cuda",
                persistent_workers=True, prefetch_factor=4)

            def batches():
                while True:
                    for x, y in loader:
                        x = x.to(device, non_blocking=True)
                        if x.dtype == torch.uint8:
                            x = torch_data.finish_uint8(x, torch.channels_last)
                        yield x, y.to(device, non_blocking=True)
            it = batches()
        else:
            it = torch_data.Loader(ds, rank, size, a.batch, 224, 0, a.workers, a.variant.split("-")[1], mode,
                                   device, torch.channels_last)
        for _ in range(3):
            next(it)
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        while time.perf_counter() - start < a.seconds:
            x, _ = next(it)
            count += x.shape[0]
        if device.type == "cuda":
            torch.cuda.synchronize()
        rate = count / (time.perf_counter() - start)
    print(json.dumps({"probe": a.variant, "rank": rank, "ranks": size, "workers": a.workers,
                      "imagesPerSec": round(rate, 1)}), flush=True)
    os._exit(0)  # skip the loaders' orderly shutdown: the figure is printed


if __name__ == "__main__":
    main()
