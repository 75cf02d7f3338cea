"""The GPU path's decoders alone, no model: images/s and the rank process's CPU per image.

    torchrun --standalone --nproc-per-node R bench/gpu_decode_probe.py DATA [--batches 6 --rounds 4]

Each rank reads its first --batches batches of the trainer's plan (encoded bytes, crops, flips,
as the loader workers hand them over) into memory, then, for each decoder, after one untimed
batch and a barrier of all ranks (so the R GPUs decode at once, as in training), times --rounds
passes over them: the decode alone and the whole device half (`torch_data.decode_batch`: decode,
crop, resize, flip, normalise). Prints one JSON line per rank and decoder: wall images/s and the
process's CPU ms per image (all its threads: what the decode takes from the rank's process,
which also has to launch the training step). Decoders:
  nvjpeg          torchvision's decode_jpeg(device="cuda"), batched (issue 18's path)
  nvimgcodec      torch_data.DeviceDecoder: nvImageCodec, hardware engines first, then CUDA
  nvimgcodec-hw   nvImageCodec with the hardware backend alone (how many it refuses, how fast)
  nvimgcodec-cuda nvImageCodec with nvJPEG's CUDA backend alone
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist

from trainop_trainer import data, torch_data


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("data_dir")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--batches", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--decoders", default="nvjpeg nvimgcodec nvimgcodec-hw nvimgcodec-cuda")
    args = ap.parse_args()
    rank, size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    dist.init_process_group("gloo")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    torch.cuda.set_device(device)
    ds = data.scan(args.data_dir)
    mode = ds.read_mode("auto")
    ds.rank_shard(rank, size, args.data_dir, mode)
    plan = data.BatchPlan(tuple(ds.blocks(rank, size, mode)), args.batch, 42, rank)
    reader = torch_data.BatchReader(ds.samples, 224, 42, rank, pool=plan.pool)
    batches = [reader[(*plan.batch(n), 0)][1:5] for n in range(args.batches)]
    n_images = sum(len(b[2]) for b in batches)
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
        for part in ("decode", "device_half"):
            def one(b):
                encoded, offsets, boxes, flips = b
                if part == "decode":
                    bounds = offsets.tolist()
                    return decoder.decode([encoded[bounds[k]:bounds[k + 1]] for k in range(len(bounds) - 1)])
                return torch_data.decode_batch(encoded, offsets, boxes, flips, 224, device, torch.channels_last, decoder)
            try:
                one(batches[0])
                if part == "decode":  # images the device decoder refused (decoded on the CPU instead)
                    row["refused_first_batch"] = decoder.refused
                torch.cuda.synchronize()
                dist.barrier()
                wall, cpu = time.perf_counter(), time.process_time()
                for _ in range(args.rounds):
                    for b in batches:
                        one(b)
                torch.cuda.synchronize()
                wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
                row[f"{part}_images_per_s"] = round(n_images * args.rounds / wall, 1)
                row[f"{part}_cpu_ms_per_image"] = round(1000 * cpu / (n_images * args.rounds), 3)
            except Exception as e:  # noqa: BLE001
                row[f"{part}_error"] = repr(e)[:300]
                dist.barrier()
        print(json.dumps(row), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
