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
An elastic run (elastic.py) reads with `GlobalPlan` instead: one order of the whole set's blocks
per epoch, the same at every world size, cut into the global batch's parts, so a run resumed at
another size continues the epoch where it stopped.

Augmentation contract (`draw_crop`, `decode_uint8`, `normalise`): a random-resized crop (area
8-100%, aspect 3/4-4/3, torchvision's algorithm; eval: the centred square of the short side),
a horizontal flip with probability 1/2, a bilinear antialiased resize to `image_size` square,
RGB uint8, then (x/255 - MEAN)/STD as float32. The crop and flip of sample `i` in data epoch
`e` come from `sample_rng(seed, rank, e, i)`, so the CPU path (PIL), the GPU path (nvJPEG via
torchvision) and tf.data draw the same boxes; only the decoders' rounding differs.

Bad samples (`read_batch`, `BadSamples`): every path reads a batch through `read_batch`, which
checks each sample's bytes (`check`: empty, no image PIL can identify, a JPEG or PNG cut short)
before any decoder sees them, and puts a replacement in the place of a bad one: another sample
of the set drawn from (seed, rank, epoch, index), with its own label and crop. So batch shapes
and step counts stay, and a resumed run (same seed) meets the same replacement in the same
place. The rank's `BadSamples` warns once per file, counts them for the reports, and ends the
run with a clear message above `--max-bad-samples` (a fraction of the set).
"""

from __future__ import annotations

import io
import math
import os
import struct
import sys
import tarfile
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from trainop_trainer import report

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
    member: str = ""  # its name inside the tar ("" for a plain file)

    @property
    def name(self) -> str:
        """What a person looks for: the file, or `<tar>:<member>`."""
        return f"{self.path}:{self.member}" if self.member else self.path

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
                yield parts[-2], Sample(str(tar_path), m.offset_data, m.size, -1, m.name)


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
    samples = tuple(Sample(s.path, s.offset, s.length, index[name], s.member) for name, s in found)
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


# ---- bad samples (module docstring) ----

# Default of --max-bad-samples: the fraction of the set that may be bad before the run fails.
# A healthy copy of ImageNet-1k (1,281,167 images) has no undecodable file (its 22 CMYK JPEGs and
# one PNG named .JPEG decode), so 0.1% (about 1,300 images there) leaves room for a few damaged
# files, while a broken copy or staging (a tar cut short, a half-synced folder) damages far more
# and fails instead of training quietly on replacements. Costs nothing to accuracy: 0.1% of an
# epoch's images are other images of the set, augmented differently.
MAX_BAD_SAMPLES = 0.001
# A slot's own sample, then up to this many replacements less one, before the run gives up: at
# a bad fraction f, all of them bad has probability f**16 (f = 0.5: 2e-5 per slot).
MAX_TRIES = 16
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
# What decoders raise for bytes that are no usable image: PIL (UnidentifiedImageError is an
# OSError; "image file is truncated"), torchvision (RuntimeError), header parsers (struct.error,
# SyntaxError, EOFError, ValueError); `check`'s own BadImage is a ValueError.
DECODE_ERRORS = (OSError, ValueError, RuntimeError, SyntaxError, EOFError, struct.error)


class BadImage(ValueError):
    """A sample's bytes are no usable image (`check`)."""


class BadSamplesError(DataError):
    """More bad samples than --max-bad-samples allows: the run ends with this message."""


def _jpeg_truncated(raw: bytes) -> bool:
    """True when the JPEG's data ends before its end-of-image marker (FFD9). Decoders disagree on
    such a file: PIL raises "image file is truncated", libjpeg-turbo (torchvision, TensorFlow)
    may fill the rest grey with a warning; this check makes every path call it bad alike. The
    marker segments are walked to the first start-of-scan (SOS), so an FFD9 inside them (an EXIF
    thumbnail) is not taken for the end; inside the scan data FFD9 can only be the end (a 0xFF
    byte there is stuffed as FF00). Cheap: one memchr-speed search, usually a look at the tail."""
    if raw.endswith(b"\xff\xd9"):
        return False
    i = 2
    while i + 4 <= len(raw):
        if raw[i] != 0xFF:
            return False  # not a marker where one should be: leave the verdict to the decoder
        marker = raw[i + 1]
        if marker == 0xFF or 0xD0 <= marker <= 0xD8 or marker == 0x01:  # fill byte, standalone markers
            i += 1 if marker == 0xFF else 2
            continue
        if marker == 0xDA:
            return raw.find(b"\xff\xd9", i) < 0
        i += 2 + int.from_bytes(raw[i + 2:i + 4], "big")
    return True  # the data ends inside the header


def check(raw: bytes) -> tuple[int, int]:
    """(width, height) of an image whose bytes are whole, or BadImage / the header parser's own
    error saying why not. Header-only: the decode itself happens where each path decodes."""
    if not raw:
        raise BadImage("empty file")
    size = image_size_of(raw)  # PIL's header parse: UnidentifiedImageError for no image
    if raw[:2] == b"\xff\xd8" and _jpeg_truncated(raw):
        raise BadImage("truncated JPEG (the data ends before the end-of-image marker)")
    if raw[:8] == PNG_SIGNATURE and raw.rfind(b"IEND") < 0:
        raise BadImage("truncated PNG (no IEND chunk)")
    return size


def reason(error: BaseException) -> str:
    """One line for a WARNING: the error's class and text, without PIL's object address."""
    text = str(error).split(" <_io.BytesIO object")[0].rstrip() or "no message"
    return text if isinstance(error, BadImage) else f"{type(error).__name__}: {text}"


def candidate(pool, seed: int, rank: int, epoch: int, index: int, attempt: int) -> int:
    """The sample in slot (epoch, index) of this rank at its `attempt`-th try: the slot's own
    sample, then replacements drawn from `pool` (the rank's own samples, so the ranks' bad files
    stay disjoint and their counts add up) by (seed, rank, epoch, index, attempt). A pure
    function: the same seed gives the same replacement in the same place (bitwise resume)."""
    if attempt == 0:
        return index
    return int(pool[np.random.default_rng((seed, rank, epoch, index, attempt, 0)).integers(len(pool))])


def candidate_rng(seed: int, rank: int, epoch: int, index: int, attempt: int) -> np.random.Generator:
    """The augmentation of the slot's `attempt`-th candidate: `sample_rng` for its own sample (the
    contract), a generator of the slot for a replacement (so it is not a copy of the same image
    wherever that sample itself appears in the epoch)."""
    if attempt == 0:
        return sample_rng(seed, rank, epoch, index)
    return np.random.default_rng((seed, rank, epoch, index, attempt, 1))


@dataclass(frozen=True)
class Pick:
    """What fills one slot of a batch: sample `index` (the slot's own, or at `attempt` > 0 a
    replacement), its bytes, its crop and label."""
    index: int
    raw: bytes
    crop: Crop
    label: int
    attempt: int


def resolve(samples, pool, seed: int, rank: int, epoch: int, index: int, raw: bytes | None, train: bool = True,
            accept=None, first_attempt: int = 0) -> tuple[Pick, list[tuple[int, str]]]:
    """The first usable candidate of slot (epoch, index), from `first_attempt` on, and the bad
    ones met before it as (sample index, reason). `pool`: the rank's sample indices (`candidate`);
    `raw`: the first candidate's bytes if already read. Usable: `check` passes and `accept(raw, crop)` (a decode, on the CPU path) raises none
    of DECODE_ERRORS. Raises BadSamplesError when MAX_TRIES candidates in a row are bad."""
    bad: list[tuple[int, str]] = []
    for attempt in range(first_attempt, MAX_TRIES):
        i = candidate(pool, seed, rank, epoch, index, attempt)
        try:
            data = raw if attempt == first_attempt and raw is not None else samples[i].read()
            crop = draw_crop(*check(data), candidate_rng(seed, rank, epoch, index, attempt) if train else None)
            if accept is not None:
                accept(data, crop)
        except DECODE_ERRORS as e:
            bad.append((i, reason(e)))
            continue
        return Pick(i, data, crop, samples[i].label, attempt), bad
    names = ", ".join(samples[i].name for i, _ in bad[:3])
    raise BadSamplesError(f"{MAX_TRIES} samples in a row are bad (empty, truncated or unreadable images: {names}, ...); "
                          f"the data set is damaged: repair or re-stage it")


def read_batch(samples, pool, epoch: int, indices, seed: int, rank: int,
               train: bool = True) -> tuple[list[Pick], list[tuple[int, str]]]:
    """One batch's picks, in slot order (tar blocks read as one request, `read_many`), a bad
    sample replaced (`resolve`), and the bad samples met as (sample index, reason). What every
    decode path reads through: the CPU and GPU paths of torch_data and tf.data alike."""
    raws = read_many([samples[int(i)] for i in indices])
    picks, bad = [], []
    for i, raw in zip(indices, raws):
        pick, met = resolve(samples, pool, seed, rank, epoch, int(i), raw, train)
        picks.append(pick)
        bad.extend(met)
    return picks, bad


def bad_sample_limit(total: int, fraction: float) -> int:
    """Bad samples allowed in a set of `total`: `fraction` of it, rounded up, so that any fraction
    above 0 tolerates one bad file even in a small set (0: none at all)."""
    return math.ceil(total * fraction - 1e-9)  # 1e-9: 0.1 * 30 is 3.0000000000000004 in binary


def too_many_message(count: int, limit: int, fraction: float, total: int, names: list[str]) -> str:
    """The run's last line when `count` bad samples are above `limit`."""
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    where = f"{shown} (every rank's WARNING lines name its own)" if shown else "the ranks' WARNING lines name them"
    plural = "s" if count != 1 else ""
    return (f"{count} bad sample{plural} (empty, truncated or unreadable images): more than --max-bad-samples "
            f"{fraction:g} of the {total} images allows ({limit}): {where}; repair or remove them, "
            f"or raise --max-bad-samples")


class BadSamples:
    """This rank's bad samples: one WARNING line per file the first time it turns up (later
    epochs meet it again silently), the count the reports carry, and the limit. `note` may be
    called from several threads (tf.data's); the training thread calls `check`."""

    def __init__(self, samples, fraction: float = MAX_BAD_SAMPLES):
        self.samples, self.fraction = samples, fraction
        self.limit = bad_sample_limit(len(samples), fraction)
        self.found: dict[int, str] = {}  # sample index -> reason, in the order they turned up
        self._lock = threading.Lock()

    @property
    def count(self) -> int:
        return len(self.found)

    def note(self, bad) -> None:
        with self._lock:
            for index, why in bad:
                if index not in self.found:
                    self.found[index] = why
                    report.write_line(sys.stderr, f"trainop_trainer: WARNING: bad sample {self.samples[index].name}: {why}; "
                                           f"skipped, another sample of the set stands in")

    def check(self, count: int | None = None) -> None:
        """BadSamplesError when `count` (the gang's, summed; default this rank's) is above the limit."""
        count = self.count if count is None else count
        if count > self.limit:
            with self._lock:
                names = [self.samples[i].name for i in self.found]
            raise BadSamplesError(too_many_message(count, self.limit, self.fraction, len(self.samples), names))


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
    def pool(self) -> np.ndarray:
        """This rank's sample indices, in set order: where its replacements come from."""
        return np.sort(np.fromiter((i for b in self.blocks for i in b), dtype=np.int64))

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

    @property
    def stream(self) -> int:
        """The `rank` of the augmentation and replacement draws (sample_rng, candidate)."""
        return self.rank


@dataclass(frozen=True)
class GlobalPlan:
    """An elastic run's batches (elastic.py): one order of the whole set per data epoch, the same
    at every world size (`blocks` shuffled with (seed, epoch)); optimizer step k of an epoch takes
    samples [k x G, (k + 1) x G) of it, G = `batch_size` x `parts`, cut into `parts` micro-batches
    of `batch_size`; this rank trains on `accumulation` consecutive ones from part
    `rank` x `accumulation`. Batch n of this rank is micro-batch n % accumulation of step
    n // accumulation: as BatchPlan, `n` is the whole state. The last len(set) % G samples of an
    epoch's order are left out (at every size alike; the next epoch's shuffle differs). The
    augmentation and replacement draws use stream 0 on every rank: a sample's crop is a function
    of (seed, epoch, sample), whichever rank decodes it."""
    blocks: tuple[tuple[int, ...], ...]  # every block of the set: DataSet.blocks(0, 1, mode)
    batch_size: int
    parts: int
    accumulation: int
    rank: int
    seed: int
    shuffle: bool = True
    stream = 0

    @property
    def pool(self) -> np.ndarray:
        """Every sample: where a bad one's replacement comes from."""
        return np.sort(np.fromiter((i for b in self.blocks for i in b), dtype=np.int64))

    @property
    def global_batch(self) -> int:
        return self.batch_size * self.parts

    @property
    def steps_per_epoch(self) -> int:
        return sum(map(len, self.blocks)) // self.global_batch

    @property
    def batches_per_epoch(self) -> int:
        return self.steps_per_epoch * self.accumulation

    def epoch_order(self, epoch: int) -> np.ndarray:
        cached = self.__dict__.get("_cached_order")
        if cached is not None and cached[0] == epoch:
            return cached[1]
        order = np.arange(len(self.blocks))
        if self.shuffle:
            np.random.default_rng((self.seed, epoch)).shuffle(order)
        indices = np.fromiter((i for b in order for i in self.blocks[b]), dtype=np.int64)
        object.__setattr__(self, "_cached_order", (epoch, indices))  # a cache on a frozen value, not state
        return indices

    def batch(self, n: int) -> tuple[int, np.ndarray]:
        """(data epoch, sample indices) of this rank's micro-batch n."""
        step, a = divmod(n, self.accumulation)
        epoch, k = divmod(step, self.steps_per_epoch)
        start = k * self.global_batch + (self.rank * self.accumulation + a) * self.batch_size
        return epoch, self.epoch_order(epoch)[start:start + self.batch_size]


def describe_shard(dataset: DataSet, rank: int, size: int, where: Path, mode: str, elastic=None) -> None:
    """One stderr line saying what this rank reads: its shard (`DataSet.rank_shard`), or in an
    elastic run its parts of every global batch."""
    if elastic is None:
        dataset.rank_shard(rank, size, where, mode)
        return
    parts = elastic.parts(rank)
    report.write_line(sys.stderr, f"trainop_trainer: rank {rank}/{size} reads parts {parts.start}-{parts.stop - 1} of "
                                  f"{elastic.max_world} of every global batch of {elastic.global_batch} images "
                                  f"({len(dataset.samples)} images, {len(dataset.classes)} classes, in {where}; one "
                                  f"order of the whole set per epoch: elastic), {mode} reads")


def make_plan(dataset: DataSet, mode: str, rank: int, size: int, batch_size: int, seed: int, elastic=None):
    """This rank's plan: BatchPlan (its own shard), or GlobalPlan for an elastic run
    (`elastic`: elastic.Elastic)."""
    if elastic is None:
        return BatchPlan(tuple(dataset.blocks(rank, size, mode)), batch_size, seed, rank)
    return GlobalPlan(tuple(dataset.blocks(0, 1, mode)), batch_size, elastic.max_world, elastic.accumulation,
                      rank, seed)


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
