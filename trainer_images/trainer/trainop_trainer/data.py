"""Framework-neutral data: find the samples of an ImageNet-style set, plan their batches, and
the augmentation contract every decode path follows.

Two layouts on the mounted data path:
- a folder `<class>/<image>` (or `train/<class>/<image>`, as ImageNet unpacks);
- one or more `.tar` shards whose members are `<class>/<image>`: read in place by offset, never
  unpacked, so a staged archive is usable as it lies.

Read modes (`BatchPlan`): `random` gives each rank every `size`-th sample and shuffles samples;
`sequential` (the default for tar shards) cuts the shards into blocks of `BLOCK` consecutive
members, deals blocks to ranks and shuffles blocks, so a batch is a few long sequential reads
(`read_many` coalesces them) instead of one small random read per image: what an NFS server
serves fastest. Write shards in shuffled order (as WebDataset does) so a block mixes classes.

Augmentation contract (`draw_crop`, `decode_uint8`, `normalise`): a random-resized crop (area
8-100%, aspect 3/4-4/3, torchvision's algorithm; eval: the centred square of the short side),
a horizontal flip with probability 1/2, a bilinear antialiased resize to `image_size` square,
RGB uint8, then (x/255 - MEAN)/STD as float32. The crop and flip of sample `i` in data epoch
`e` come from `sample_rng(seed, rank, e, i)`, so the CPU path (PIL), the GPU path (nvJPEG via
torchvision) and tf.data draw the same boxes; only the decoders' rounding differs.
"""

from __future__ import annotations

import io
import math
import os
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png")
# ImageNet channel statistics (RGB, 0..1 scale).
MEAN = np.array([0.485, 0.456, 0.406], dtype=np.float32)
STD = np.array([0.229, 0.224, 0.225], dtype=np.float32)
SCALE = (0.08, 1.0)  # random-resized-crop area, as a fraction of the image
RATIO = (3 / 4, 4 / 3)  # and its aspect ratio (w/h)
BLOCK = 16  # consecutive tar members read as one sequential block (~1.8 MB of ImageNet JPEGs)
COALESCE_GAP = 64 * 1024  # reads closer than this in one file become one read
READ_MODES = ("auto", "sequential", "random")


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

    @property
    def sharded(self) -> bool:
        return self.samples[0].length >= 0  # tar members have a length; plain files read whole

    def read_mode(self, requested: str = "auto") -> str:
        if requested == "auto":
            return "sequential" if self.sharded else "random"
        if requested == "sequential" and not self.sharded:
            raise DataError("--read-mode sequential needs .tar shards; a folder of files is read with --read-mode random")
        return requested

    def blocks(self, rank: int, size: int, mode: str = "random") -> list[tuple[int, ...]]:
        """This rank's sample indices, in blocks that stay together in every epoch: one index per
        block in `random` mode (every `size`-th sample), `BLOCK` consecutive members of one tar
        in `sequential` mode (every `size`-th block). Disjoint across ranks, covering the set."""
        if mode == "random":
            return [(i,) for i in range(rank, len(self.samples), size)]
        return self._runs()[rank::size]

    def _runs(self) -> list[tuple[int, ...]]:
        """The sequential blocks, cut at BLOCK members or a tar boundary; computed once (a set of
        1.28 M images is one pass, and every rank's plan and step count reads it)."""
        runs = self.__dict__.get("_cached_runs")
        if runs is None:
            runs, start = [], 0
            for i in range(1, len(self.samples) + 1):
                if i == len(self.samples) or i - start == BLOCK or self.samples[i].path != self.samples[start].path:
                    runs.append(tuple(range(start, i)))
                    start = i
            object.__setattr__(self, "_cached_runs", runs)  # a cache on a frozen value, not state
        return runs

    def shard(self, rank: int, size: int, mode: str = "random") -> tuple[Sample, ...]:
        """This rank's samples: disjoint across ranks, covering the whole set."""
        return tuple(self.samples[i] for block in self.blocks(rank, size, mode) for i in block)

    def rank_shard(self, rank: int, size: int, where: Path, mode: str = "random") -> tuple[Sample, ...]:
        """`shard()`, and one stderr line saying what this rank reads."""
        shard = self.shard(rank, size, mode)
        print(f"trainop_trainer: rank {rank}/{size} reads {len(shard)} of {len(self.samples)} images "
              f"({len(self.classes)} classes) in {where}, {mode} reads", file=sys.stderr, flush=True)
        return shard

    def steps_per_epoch(self, size: int, batch_size: int, mode: str = "random") -> int:
        """Full batches of the smallest shard: every rank must run the same number of steps."""
        if mode == "random":
            return len(self.samples) // size // batch_size
        lengths = [len(run) for run in self._runs()]
        return min(sum(lengths[r::size]) for r in range(size)) // batch_size


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


def read_many(samples) -> list[bytes]:
    """The samples' bytes, in order, with neighbouring members of one file read as one request:
    a `sequential` block of a tar is one read instead of `BLOCK`."""
    order = sorted(range(len(samples)), key=lambda k: (samples[k].path, samples[k].offset))
    out: list[bytes] = [b""] * len(samples)
    k = 0
    while k < len(order):
        first = samples[order[k]]
        if first.length < 0:  # a whole file
            out[order[k]] = first.read()
            k += 1
            continue
        end = k + 1  # extend the run while the next member starts close to where this one ends
        while (end < len(order) and samples[order[end]].path == first.path
               and samples[order[end]].offset - (samples[order[end - 1]].offset + samples[order[end - 1]].length)
               <= COALESCE_GAP):
            end += 1
        last = samples[order[end - 1]]
        with open(first.path, "rb") as f:
            f.seek(first.offset)
            blob = f.read(last.offset + last.length - first.offset)
        for j in order[k:end]:
            s = samples[j]
            out[j] = blob[s.offset - first.offset: s.offset - first.offset + s.length]
        k = end
    return out


# ---- the augmentation contract (module docstring) ----

@dataclass(frozen=True)
class Crop:
    x: int
    y: int
    w: int
    h: int
    flip: bool


def sample_rng(seed: int, rank: int, epoch: int, index: int) -> np.random.Generator:
    """The generator of one sample's augmentation: the same wherever and whenever it is decoded."""
    return np.random.default_rng((seed, rank, epoch, index))


def image_size_of(raw: bytes) -> tuple[int, int]:
    """(width, height) from the header alone (PIL reads no pixels until asked)."""
    from PIL import Image

    with Image.open(io.BytesIO(raw)) as im:
        return im.size


def draw_crop(width: int, height: int, rng: np.random.Generator | None) -> Crop:
    """torchvision's RandomResizedCrop.get_params (10 tries, then the centred crop clamped to
    RATIO) and a coin for the flip; `rng` None: evaluation, the centred square, no flip."""
    if rng is not None:
        area = width * height
        for _ in range(10):
            target = area * rng.uniform(*SCALE)
            aspect = math.exp(rng.uniform(math.log(RATIO[0]), math.log(RATIO[1])))
            w = int(round(math.sqrt(target * aspect)))
            h = int(round(math.sqrt(target / aspect)))
            if 0 < w <= width and 0 < h <= height:
                x, y = int(rng.integers(0, width - w + 1)), int(rng.integers(0, height - h + 1))
                return Crop(x, y, w, h, bool(rng.random() < 0.5))
        aspect = width / height
        if aspect < RATIO[0]:
            w, h = width, int(round(width / RATIO[0]))
        elif aspect > RATIO[1]:
            h, w = height, int(round(height * RATIO[1]))
        else:
            w, h = width, height
        return Crop((width - w) // 2, (height - h) // 2, w, h, bool(rng.random() < 0.5))
    side = min(width, height)
    return Crop((width - side) // 2, (height - side) // 2, side, side, False)


def decode_uint8(raw: bytes, crop: Crop, image_size: int, out: np.ndarray | None = None) -> np.ndarray:
    """The CPU decode: JPEG/PNG bytes -> `crop` resized to image_size² RGB uint8 HWC, written into
    `out` (a slot of a preallocated batch) when given. A JPEG is decoded at a reduced scale
    (libjpeg's DCT scaling, `Image.draft`) when the crop still covers `image_size` pixels there."""
    from PIL import Image

    with Image.open(io.BytesIO(raw)) as im:
        full_w, full_h = im.size
        im.draft("RGB", (math.ceil(full_w * image_size / crop.w), math.ceil(full_h * image_size / crop.h)))
        sx, sy = im.size[0] / full_w, im.size[1] / full_h  # 1, or libjpeg's 1/2, 1/4, 1/8 rounded up
        im = im.convert("RGB")
        box = (crop.x * sx, crop.y * sy, min(im.size[0], (crop.x + crop.w) * sx), min(im.size[1], (crop.y + crop.h) * sy))
        im = im.resize((image_size, image_size), Image.BILINEAR, box=box)
        if crop.flip:
            im = im.transpose(Image.FLIP_LEFT_RIGHT)
        arr = np.asarray(im)
    if out is None:
        return arr
    out[...] = arr
    return out


def normalise(images: np.ndarray) -> np.ndarray:
    """uint8 RGB (..., 3) -> the network's float32 input."""
    return (images.astype(np.float32) / 255.0 - MEAN) / STD


def decode(raw: bytes, image_size: int, rng: np.random.Generator | None) -> np.ndarray:
    """JPEG/PNG bytes -> normalized float32 HWC array; random crop and flip when `rng` is given."""
    crop = draw_crop(*image_size_of(raw), rng)
    return normalise(decode_uint8(raw, crop, image_size))


@dataclass(frozen=True)
class BatchPlan:
    """Which samples make batch `n` of this rank, for any n: a pure function of (set, rank, seed),
    so a resumed run continues exactly where it stopped (`n` is the only state). Data epoch
    `e = n // batches_per_epoch` reshuffles this rank's blocks with `(seed, rank, e)`."""
    blocks: tuple[tuple[int, ...], ...]
    batch_size: int
    seed: int
    rank: int
    shuffle: bool = True

    @property
    def batches_per_epoch(self) -> int:
        return sum(map(len, self.blocks)) // self.batch_size

    def epoch_order(self, epoch: int) -> np.ndarray:
        """This rank's sample indices in data epoch `epoch`; the last epoch's is kept (the loader
        asks for every batch of an epoch in turn)."""
        cached = self.__dict__.get("_cached_order")
        if cached is not None and cached[0] == epoch:
            return cached[1]
        order = np.arange(len(self.blocks))
        if self.shuffle:
            np.random.default_rng((self.seed, self.rank, epoch)).shuffle(order)
        indices = np.fromiter((i for b in order for i in self.blocks[b]), dtype=np.int64)
        object.__setattr__(self, "_cached_order", (epoch, indices))  # a cache on a frozen value, not state
        return indices

    def batch(self, n: int) -> tuple[int, np.ndarray]:
        """(data epoch, sample indices) of batch n."""
        epoch, k = divmod(n, self.batches_per_epoch)
        return epoch, self.epoch_order(epoch)[k * self.batch_size:(k + 1) * self.batch_size]


def cpu_budget(cgroup: Path = Path("/sys/fs/cgroup")) -> int:
    """CPUs this process may use: its affinity mask, capped by a cgroup CPU quota (cgroup v2
    cpu.max or v1 cfs quota), which os.cpu_count() ignores: a pod limited to 16 CPUs on a
    96-core node must not start 95 loader processes."""
    cpus = len(os.sched_getaffinity(0))
    for quota_file, period_file in (("cpu.max", None), ("cpu/cpu.cfs_quota_us", "cpu/cpu.cfs_period_us")):
        try:
            fields = (cgroup / quota_file).read_text().split()
            quota, period = fields[0], (fields[1] if period_file is None else (cgroup / period_file).read_text().strip())
        except (OSError, IndexError):
            continue
        if quota not in ("max", "-1"):
            cpus = min(cpus, max(1, math.ceil(int(quota) / int(period))))
        break
    return cpus


def auto_workers(local_ranks: int, decode_on: str, cpus: int | None = None) -> int:
    """Loader processes per rank for `--loader-workers auto`: the node's CPUs shared by its ranks,
    less one for the rank's own process (it launches the GPU work and pins batches). The GPU
    path's workers only read bytes and JPEG headers: a few per rank keep up with nvJPEG."""
    share = (cpu_budget() if cpus is None else cpus) // max(1, local_ranks)
    workers = max(1, share - 1)
    return min(workers, 6) if decode_on == "gpu" else workers


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
