"""The GPU path's device half alone, no model: images/s and the rank process's CPU per image.

    torchrun --standalone --nproc-per-node R bench/gpu_decode_probe.py DATA [--batches 6 --rounds 4]

Each rank reads its first --batches batches of the trainer's plan (encoded bytes, crops, flips,
as the loader workers hand them over) into memory, then, for each decoder, after one untimed
batch and a barrier of all ranks (so the R GPUs decode at once, as in training), times --rounds
passes over them. Parts:
  decode               the decoder alone
  crop:<way>           crop, resize, flip, normalise of batches decoded beforehand
  device_half:<way>    the whole of `torch_data.decode_batch` (decode, then crop and the rest)
  beside:<way>         the device half (or the decode alone) running in a thread while this
                       thread launches small CUDA ops as fast as it can (a stand-in for the
                       training step's launches): the launches per second it keeps, as a fraction
                       of its rate alone; `:python`, the same with a pure-Python loop (the GIL alone)
<way>: `per-image` (a slice, a conversion and a resize launch per image) and `batched`
(device_crop: one launch per batch), side by side (--crops). Prints one JSON line per rank and
decoder: wall images/s and the process's CPU ms per image (all its threads: what the device half
takes from the rank's process, which also has to launch the training step). Decoders:
  nvjpeg          torchvision's decode_jpeg(device="cuda"), batched (issue 18's path)
  nvimgcodec      torch_data.DeviceDecoder: nvImageCodec, hardware engines first, then CUDA
  nvimgcodec-hw   nvImageCodec with the hardware backend alone (how many it refuses, how fast)
  nvimgcodec-cuda nvImageCodec with nvJPEG's CUDA backend alone
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time

import torch
import torch.distributed as dist

from trainop_trainer import data, torch_data

SIZE = 224


def _launch_rate(seconds: float, launcher: str) -> float:
    """Loop turns per second of this thread: `cuda`, each launches a small CUDA op (as the
    training step's launches); `python`, pure Python (needs nothing but the GIL)."""
    x = torch.zeros(16, device="cuda")
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        for _ in range(100):
            if launcher == "cuda":
                x.add_(1.0)
            else:
                n += 0
        n += 100
    torch.cuda.synchronize()
    return n / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("data_dir")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--batches", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--decoders", default="nvjpeg nvimgcodec nvimgcodec-hw nvimgcodec-cuda")
    ap.add_argument("--crops", default="per-image batched")
    args = ap.parse_args()
    sys.setswitchinterval(0.0005)  # as the trainer sets it (torch_data.Loader)
    rank, size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    dist.init_process_group("gloo")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    torch.cuda.set_device(device)
    ds = data.scan(args.data_dir)
    mode = ds.read_mode("auto")
    ds.rank_shard(rank, size, args.data_dir, mode)
    plan = data.BatchPlan(tuple(ds.blocks(rank, size, mode)), args.batch, 42, rank)
    reader = torch_data.BatchReader(ds.samples, SIZE, 42, rank, pool=plan.pool)
    batches = [reader[(*plan.batch(n), 0)][1:5] for n in range(args.batches)]
    n_images = sum(len(b[2]) for b in batches)
    # the CPU path's decode of the first batch (the workers' decode_into), to compare the ways to
    cpu_first = torch_data.finish_uint8(reader[(*plan.batch(0), args.batch)][0].to(device), torch.channels_last)
    for name in args.decoders.split():
        try:
            decoder = torch_data.DeviceDecoder(device, "nvjpeg" if name == "nvjpeg" else "nvimgcodec")
            if name in ("nvimgcodec-hw", "nvimgcodec-cuda"):
                m = torch_data._nvimgcodec()
                kind = m.BackendKind.HW_GPU_ONLY if name.endswith("hw") else m.BackendKind.GPU_ONLY
                decoder._codec = m.Decoder(device_id=device.index, max_num_cpu_threads=2, backends=[m.Backend(kind)])
        except Exception as e:  # noqa: BLE001 (a probe: report and go on)
            print(json.dumps({"probe": name, "rank": rank, "error": repr(e)}), flush=True)
            dist.barrier()
            continue
        row = {"probe": name, "rank": rank, "ranks": size, "decoder": decoder.name, "images": n_images * args.rounds}

        def decode(b):
            encoded, offsets, _, _ = b
            return decoder.decode(list(encoded.split(torch.diff(offsets).tolist())))

        decoded = []
        parts = [("decode", decode)]
        for way in args.crops.split():
            def crop(k, way=way):
                _, _, boxes, flips = batches[k]
                with _crop_way(way):
                    return torch_data.crop_batch(decoded[k], boxes, flips, SIZE, device, torch.channels_last)

            def half(b, way=way):
                with _crop_way(way):
                    return torch_data.decode_batch(*b, SIZE, device, torch.channels_last, decoder)
            parts += [(f"crop:{way}", crop), (f"device_half:{way}", half)]
            try:  # grey levels (0-255) apart from the CPU path, per image: the mean and the largest
                grey = ((half(batches[0]) - cpu_first) * torch_data.STD255.to(device)).abs().mean(dim=(1, 2, 3))
                row[f"vs_cpu:{way}_grey_mean"] = round(float(grey.mean()), 3)
                row[f"vs_cpu:{way}_grey_max"] = round(float(grey.max()), 3)
            except Exception as e:  # noqa: BLE001
                row[f"vs_cpu:{way}_error"] = repr(e)[:300]
        for part, one in parts:
            items = range(len(batches)) if part.startswith("crop") else batches
            try:
                if part.startswith("crop") and not decoded:
                    decoded.extend(decode(b) for b in batches)
                one(items[0])
                if part == "decode":  # images the device decoder refused (decoded on the CPU instead)
                    row["refused_first_batch"] = decoder.refused
                torch.cuda.synchronize()
                dist.barrier()
                wall, cpu = time.perf_counter(), time.process_time()
                for _ in range(args.rounds):
                    for b in items:
                        one(b)
                torch.cuda.synchronize()
                wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
                row[f"{part}_images_per_s"] = round(n_images * args.rounds / wall, 1)
                row[f"{part}_cpu_ms_per_image"] = round(1000 * cpu / (n_images * args.rounds), 4)
            except Exception as e:  # noqa: BLE001
                row[f"{part}_error"] = repr(e)[:300]
                dist.barrier()
        # The device half beside a launching thread, as in training (the stage thread and the
        # training thread share the process's GIL), and the decode alone beside it.
        alone = {launcher: _launch_rate(2.0, launcher) for launcher in ("cuda", "python")}
        row["launches_per_s_alone"] = round(alone["cuda"])
        for (part, one), launcher in [(p, launcher) for p in parts for launcher in ("cuda", "python")]:
            if not part.startswith(("device_half", "decode")):
                continue
            stop, done = threading.Event(), []

            def stage(one=one):
                with torch.cuda.device(device):  # a new thread starts on device 0
                    while not stop.is_set():
                        for b in batches:
                            one(b)
                            done.append(len(b[2]))
                    torch.cuda.synchronize(device)
            dist.barrier()
            thread = threading.Thread(target=stage)
            start = time.perf_counter()
            thread.start()
            rate = _launch_rate(3.0, launcher)
            stop.set()
            thread.join()
            way = part.split(":")[-1] + ("" if launcher == "cuda" else ":python")
            row[f"beside:{way}_launch_fraction"] = round(rate / alone[launcher], 3)
            row[f"beside:{way}_images_per_s"] = round(sum(done) / (time.perf_counter() - start), 1)
        print(json.dumps(row), flush=True)
        decoded.clear()
    dist.destroy_process_group()


class _crop_way:
    """TRAINOP_DEVICE_CROP set to `way` inside the block (torch_data reads it per batch)."""

    def __init__(self, way: str):
        self.way = way

    def __enter__(self):
        self.old = os.environ.get("TRAINOP_DEVICE_CROP")
        os.environ["TRAINOP_DEVICE_CROP"] = self.way

    def __exit__(self, *exc):
        if self.old is None:
            os.environ.pop("TRAINOP_DEVICE_CROP", None)
        else:
            os.environ["TRAINOP_DEVICE_CROP"] = self.old


if __name__ == "__main__":
    main()
