"""Framework-neutral data: find the samples of an ImageNet-style set, shard them by rank, decode.

Two layouts on the mounted data path:
- a folder `<class>/<image>` (or `train/<class>/<image>`, as ImageNet unpacks);
- one or more `.tar` shards whose members are `<class>/<image>`: read in place by offset, never
  unpacked, so a staged archive is usable as it lies.
The frameworks wrap `Sample`s in their own loaders (PyTorch DataLoader workers, tf.data
parallel map); the decode step is this module's, so both see the same pixels.
"""

from __future__ import annotations

import io
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png")
# ImageNet channel statistics (RGB, 0..1 scale).
MEAN = np.array([0.485, 0.456, 0.406], dtype=np.float32)
STD = np.array([0.229, 0.224, 0.225], dtype=np.float32)


class DataError(ValueError):
    pass


@dataclass(frozen=True)
class Sample:
    path: str
    offset: int  # byte offset of the image in `path` (0 for a plain file)
    length: int  # bytes (-1: the whole file)
    label: int

    def read(self) -> bytes:
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            return f.read(self.length)


@dataclass(frozen=True)
class DataSet:
    classes: tuple[str, ...]
    samples: tuple[Sample, ...]  # in a fixed order, the same on every rank

    def shard(self, rank: int, size: int) -> tuple[Sample, ...]:
        """Every `size`-th sample from `rank`: disjoint across ranks, covering the whole set."""
        return self.samples[rank::size]

    def rank_shard(self, rank: int, size: int, where: Path) -> tuple[Sample, ...]:
        """`shard()`, and one stderr line saying what this rank reads."""
        shard = self.shard(rank, size)
        print(f"trainop_trainer: rank {rank}/{size} reads {len(shard)} of {len(self.samples)} images "
              f"({len(self.classes)} classes) in {where}", file=sys.stderr, flush=True)
        return shard

    def steps_per_epoch(self, size: int, batch_size: int) -> int:
        """Full batches of the smallest shard: every rank must run the same number of steps."""
        return len(self.samples) // size // batch_size


def _is_image(name: str) -> bool:
    return name.lower().endswith(IMAGE_SUFFIXES)


def _tar_members(tar_path: Path):
    with tarfile.open(tar_path) as tar:
        for m in tar:
            parts = m.name.strip("./").split("/")
            if m.isfile() and len(parts) >= 2 and _is_image(parts[-1]):
                yield parts[-2], Sample(str(tar_path), m.offset_data, m.size, -1)


def scan(data_dir: Path) -> DataSet:
    """Index the set once; class ids are the sorted class names."""
    data_dir = Path(data_dir)
    if not data_dir.is_dir():
        raise DataError(f"--data-dir {data_dir}: no such directory; mount the data set there or pass --synthetic")
    if (data_dir / "train").is_dir():
        data_dir = data_dir / "train"
    found: list[tuple[str, Sample]] = []
    tars = sorted(data_dir.glob("*.tar"))
    if tars:
        for tar_path in tars:
            try:
                found.extend(_tar_members(tar_path))
            except tarfile.TarError as e:
                raise DataError(f"--data-dir {data_dir}: {tar_path.name} is not a readable tar ({e})") from e
    else:
        for class_dir in sorted(p for p in data_dir.iterdir() if p.is_dir()):
            found.extend((class_dir.name, Sample(str(f), 0, -1, -1))
                         for f in sorted(class_dir.iterdir()) if _is_image(f.name))
    if not found:
        raise DataError(f"--data-dir {data_dir}: no images found; expected <class>/<image>.jpg folders or .tar shards of them")
    classes = tuple(sorted({name for name, _ in found}))
    index = {name: i for i, name in enumerate(classes)}
    samples = tuple(Sample(s.path, s.offset, s.length, index[name]) for name, s in found)
    return DataSet(classes, samples)


def decode(raw: bytes, image_size: int, rng: np.random.Generator | None) -> np.ndarray:
    """JPEG/PNG bytes -> normalized float32 HWC array; random crop and flip when `rng` is given."""
    from PIL import Image

    with Image.open(io.BytesIO(raw)) as im:
        im = im.convert("RGB")
        w, h = im.size
        if rng is not None:  # random-resized-crop lite: a random square of 50-100% of the short side
            side = int(min(w, h) * rng.uniform(0.5, 1.0))
            x, y = rng.integers(0, w - side + 1), rng.integers(0, h - side + 1)
        else:
            side = min(w, h)
            x, y = (w - side) // 2, (h - side) // 2
        im = im.crop((x, y, x + side, y + side)).resize((image_size, image_size), Image.BILINEAR)
        arr = np.asarray(im, dtype=np.float32) / 255.0
    if rng is not None and rng.random() < 0.5:
        arr = arr[:, ::-1]
    return (arr - MEAN) / STD


PATTERN = 8  # side of the class patterns, tiled up to the image size on the device


def synthetic_task(num_classes: int, batches: int, batch_size: int, rank: int, seed: int):
    """A learnable synthetic task: (class patterns (C, 8, 8, 3) float32, labels (batches, batch) int64).

    The framework draws the images on its device as noise plus the label's pattern tiled to the
    image size, so the model can learn the task rather than only memorize it. Patterns are shared
    by all ranks; labels (and the device noise, seeded with `seed + 1 + rank`) differ per rank, so
    ranks compute different gradients and only real averaging keeps their parameters equal.
    """
    patterns = np.random.default_rng(seed).standard_normal((num_classes, PATTERN, PATTERN, 3))
    labels = np.random.default_rng(seed + 1 + rank).integers(0, num_classes, size=(batches, batch_size))
    return patterns.astype(np.float32), labels.astype(np.int64)
