"""Generate an ImageNet-like JPEG set, deterministically: the same bytes for the same arguments.

    python bench/make_jpegs.py OUT [--images 25600] [--classes 100] [--shards 64] [--seed 0]

Writes OUT/folder/train/<class>/<class>_<i>.JPEG and OUT/tar/train-NNN.tar (the same images,
members in shuffled order, as a staged sharded set should be), and prints the count, mean size
in bytes and mean pixels.

Sizes are drawn like ImageNet's training set (its mean is about 400x350 pixels and 110 kB): three
images in four have a long side of 500 px (short side 375, 333 or anywhere from 250 to 500), the
rest a log-normal long side around 400 px (100 to 2000), landscape three times in four. Content
is smooth colour fields plus texture, JPEG quality 90, 4:2:0, so the bytes per pixel and the
decode work are those of photographs rather than of flat colour or white noise.
"""

from __future__ import annotations

import argparse
import io
import os
import tarfile
from multiprocessing import Pool
from pathlib import Path

import numpy as np
from PIL import Image


def image_size(rng: np.random.Generator) -> tuple[int, int]:
    if rng.random() < 0.75:
        long = 500
        pick = rng.random()
        short = 375 if pick < 0.5 else 333 if pick < 0.65 else int(rng.integers(250, 501))
    else:
        long = int(np.clip(rng.lognormal(np.log(400), 0.4), 100, 2000))
        short = max(32, int(long * rng.uniform(0.6, 1.0)))
    return (long, short) if rng.random() < 0.75 else (short, long)


def jpeg(seed: int, index: int) -> bytes:
    rng = np.random.default_rng((seed, index))
    w, h = image_size(rng)
    coarse = rng.integers(0, 256, (max(2, h // 48), max(2, w // 48), 3), dtype=np.uint8)
    base = np.asarray(Image.fromarray(coarse).resize((w, h), Image.BICUBIC), dtype=np.int16)
    texture = rng.normal(0, 10, (h, w, 1)) + rng.normal(0, 4, (h, w, 3))
    pixels = np.clip(base + texture, 0, 255).astype(np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "JPEG", quality=90)
    return out.getvalue()


def _write_one(args) -> tuple[int, int]:
    root, seed, index, classes = args
    cls = f"n{index % classes:08d}"
    raw = jpeg(seed, index)
    path = root / "folder" / "train" / cls / f"{cls}_{index}.JPEG"
    path.write_bytes(raw)
    with Image.open(io.BytesIO(raw)) as im:
        return len(raw), im.size[0] * im.size[1]


def _write_shard(args) -> None:
    root, names, k = args
    with tarfile.open(root / "tar" / f"train-{k:03d}.tar", "w") as tar:
        for name in names:
            tar.add(root / "folder" / "train" / name, arcname=name)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out", type=Path)
    p.add_argument("--images", type=int, default=25600)
    p.add_argument("--classes", type=int, default=100)
    p.add_argument("--shards", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    for c in range(a.classes):
        (a.out / "folder" / "train" / f"n{c:08d}").mkdir(parents=True, exist_ok=True)
    (a.out / "tar").mkdir(parents=True, exist_ok=True)
    with Pool(os.cpu_count()) as pool:
        stats = pool.map(_write_one, [(a.out, a.seed, i, a.classes) for i in range(a.images)], chunksize=64)
        names = [f"n{i % a.classes:08d}/n{i % a.classes:08d}_{i}.JPEG" for i in range(a.images)]
        order = np.random.default_rng(a.seed).permutation(len(names))
        pool.map(_write_shard, [(a.out, [names[i] for i in order[k::a.shards]], k) for k in range(a.shards)])
    sizes, pixels = np.array(stats).T
    print(f"{a.images} images, {a.classes} classes, {a.shards} shards: mean {sizes.mean() / 1e3:.1f} kB, "
          f"mean {pixels.mean() / 1e3:.0f} kpixels, total {sizes.sum() / 1e9:.2f} GB")


if __name__ == "__main__":
    main()
