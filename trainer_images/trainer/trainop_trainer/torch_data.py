"""PyTorch input pipeline: DataLoader workers read (and on the CPU path decode) whole batches;
the rank's own process finishes them on its device.

Decode paths, one augmentation contract (data.py):
- `cpu` (CPU jobs, or `--decode cpu`): a worker decodes (`decode_into`: torchvision's
  libjpeg-turbo decode and ATen's vectorised uint8 resize) straight into one preallocated uint8
  NHWC batch in shared memory; the rank's process copies it to the device (4x fewer bytes than
  float32) and normalises there.
- `gpu` (`--decode gpu`): a worker reads a batch's bytes (files, or tar members coalesced into
  sequential reads), parses the JPEG headers and draws each crop and flip; it returns ONE flat
  uint8 tensor of the encoded images plus small tensors of offsets, boxes, flips and labels. A
  thread of the rank's process decodes them (`DeviceDecoder`, batched), then crops, resizes, flips
  and normalises them on the device in one launch per batch (`crop_batch`: device_crop's Triton
  kernel; per image where there is no Triton), on a side stream, a couple of batches ahead of the
  training step.
- `split` (the default when the job has GPUs): the first `cpu_share` of every batch goes the `cpu`
  way, the rest the `gpu` way: the workers take what they keep up with at the rates measured on
  this host at start-up (`cpu_share`: a worker's decode rate under load, the model's training
  rate), the device the rest.
- The device decoder (`DeviceDecoder`) is torchvision's nvJPEG, or nvImageCodec (the GPU's
  hardware JPEG engines) where installed and asked for: measured, neither limits the GPU path.

Bad samples: every path reads through `data.read_batch`, in the worker: an empty, unidentifiable
or truncated file is replaced in its slot there (data.py's module docstring), so the `gpu` half
only ever gets bytes that passed `data.check`, and both halves count and warn through the one
`data.BadSamples` of the rank (the worker returns what it met; the training thread notes it).
On the `cpu` path a decoder that still refuses a sample moves its slot on to the next candidate
(`BatchReader._decode_slot`); on the device a sample that passed the check and that nvJPEG and
then the CPU decoder both refuse still fails the run (damage inside the scan data, which the
header check cannot see without decoding it on the CPU).

Why the old path stalled whatever the worker count (measured, docs/benchmarks.md): the CPU
work per image was about twice the decode's. Each worker normalised to float32 per image (three
passes over 600 kB) and copied it to CHW, then `default_collate` stacked 256 of them into a fresh
154 MB shared-memory segment per batch (first-touch page faults), which the pin thread copied
again. uint8 on the wire with normalisation on the device gave +50% for the loaders alone; whole
batches built in place in one shared uint8 tensor a further +33%. The pin thread and OpenMP
threads were not the cause.

Resuming: the batch order is `data.BatchPlan`, a pure function of (set, rank, seed); the loader's
whole state is the number of batches the training loop has taken (`state_dict()`), and
`load_state_dict()` before the first batch continues from there without reading what was skipped.
An elastic run's plan is `data.GlobalPlan` (its batches are micro-batches, `accumulation` a step).
"""

from __future__ import annotations

import functools
import os
import queue
import sys
import threading

import numpy as np
import torch

from trainop_trainer import data

MEAN255 = torch.tensor(data.MEAN * 255.0).view(1, 3, 1, 1)
STD255 = torch.tensor(data.STD * 255.0).view(1, 3, 1, 1)
AHEAD = 2  # batches the device stage prepares ahead of the training step


def _one_thread(_worker_id: int) -> None:
    """Loader processes run one thread each: they are already one per core, and libraries that
    start a thread pool per process (OpenMP, OpenCV) would oversubscribe the node."""
    torch.set_num_threads(1)
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        import cv2  # noqa: PLC0415 (only if present)

        cv2.setNumThreads(1)
    except ImportError:
        pass


def _shared_uint8(*shape: int) -> torch.Tensor:
    """An uninitialised uint8 tensor allocated in shared memory: returned from a worker, it
    travels to the rank's process as a file descriptor, not copied (as default_collate does)."""
    n = int(np.prod(shape))
    storage = torch.UntypedStorage._new_shared(n)
    return torch.empty(0, dtype=torch.uint8).set_(storage, 0, shape)


class BatchReader(torch.utils.data.Dataset):
    """One item = one whole batch, keyed by (data epoch, sample indices, how many to decode here)."""

    def __init__(self, samples, image_size: int, seed: int, rank: int, train: bool = True, pool=None):
        self.samples, self.image_size, self.seed, self.rank, self.train = samples, image_size, seed, rank, train
        # where replacements of bad samples come from (data.candidate): the rank's own samples
        self.pool = np.arange(len(samples)) if pool is None else pool

    def __len__(self):
        return 2 ** 62  # indexed by plan, never by position

    def __getitem__(self, key):
        """(uint8 NHWC images of the first `cpu_count` samples, decoded here; the encoded bytes of
        the rest as one flat uint8 tensor, their offsets, crop boxes and flips; all labels; the
        bad samples met, as (sample index, reason) pairs). A bad sample is replaced in its slot
        (data.read_batch) before either path decodes it: the GPU path gets the replacement's bytes."""
        epoch, indices, cpu_count = key
        picks, bad = data.read_batch(self.samples, self.pool, epoch, indices, self.seed, self.rank, self.train)
        size = self.image_size
        images = _shared_uint8(cpu_count, size, size, 3)
        for k in range(cpu_count):
            picks[k] = self._decode_slot(epoch, int(indices[k]), picks[k], images[k], bad)
        labels = torch.tensor([p.label for p in picks], dtype=torch.int64)
        rest = picks[cpu_count:]
        lengths = np.fromiter((len(p.raw) for p in rest), dtype=np.int64, count=len(rest))
        encoded = _shared_uint8(int(lengths.sum()))
        if rest:
            encoded.numpy()[:] = np.frombuffer(b"".join(p.raw for p in rest), dtype=np.uint8)
        offsets = torch.from_numpy(np.concatenate(([0], np.cumsum(lengths))))
        boxes = torch.tensor([(p.crop.x, p.crop.y, p.crop.w, p.crop.h) for p in rest], dtype=torch.int64).reshape(-1, 4)
        flips = torch.tensor([p.crop.flip for p in rest], dtype=torch.bool)
        return images, encoded, offsets, boxes, flips, labels, tuple(bad)

    def _decode_slot(self, epoch: int, index: int, pick: data.Pick, out: torch.Tensor, bad: list) -> data.Pick:
        """Decode `pick` into `out`; if the decoder refuses bytes that data.check passed (damage
        inside the scan data), the slot's next candidates, decoded the same way (data.resolve)."""
        try:
            decode_into(pick.raw, pick.crop, self.image_size, out)
            return pick
        except data.DECODE_ERRORS as e:
            bad.append((pick.index, data.reason(e)))
        pick, met = data.resolve(self.samples, self.pool, self.seed, self.rank, epoch, index, None, self.train,
                                 accept=lambda raw, crop: decode_into(raw, crop, self.image_size, out),
                                 first_attempt=pick.attempt + 1)
        bad.extend(met)
        return pick


def decode_into(raw: bytes, crop: data.Crop, image_size: int, out: torch.Tensor) -> None:
    """The CPU path's decode: `crop` of the image, resized to image_size² (bilinear, antialiased)
    and flipped, written into `out` (one uint8 HWC slot of a batch), as data.decode_uint8 does.

    torchvision's decode (libjpeg-turbo) and ATen's uint8 antialiased resize, which is vectorised
    for channels-last input (what the decoder returns), instead of PIL: 1.6x the images per core
    (measured, docs/benchmarks.md), and the resize is the GPU path's own. A crop at least twice
    image_size each way keeps PIL's reduced-scale JPEG decode (libjpeg's DCT scaling, `draft`),
    which torchvision does not expose; an image torchvision refuses goes to PIL too."""
    from torchvision.io import ImageReadMode, decode_image

    if min(crop.w, crop.h) >= 2 * image_size:
        data.decode_uint8(raw, crop, image_size, out.numpy())
        return
    try:
        # bytearray: torch wants a writable buffer (the copy is 1% of the decode)
        image = decode_image(torch.frombuffer(bytearray(raw), dtype=torch.uint8), mode=ImageReadMode.RGB)
    except RuntimeError:
        data.decode_uint8(raw, crop, image_size, out.numpy())
        return
    source = image[None, :, crop.y:crop.y + crop.h, crop.x:crop.x + crop.w]
    torch._C._nn._upsample_bilinear2d_aa(source, (image_size, image_size), False, out=out[None].permute(0, 3, 1, 2))
    if crop.flip:
        out.copy_(out.flip(1))


class _PlanSampler(torch.utils.data.Sampler):
    """Batches `start`, `start + 1`, ... of the plan, forever (the trainer counts steps), each
    with the number of its images the worker decodes on the CPU."""

    def __init__(self, plan: data.BatchPlan, start: int, cpu_count: int):
        self.plan, self.start, self.cpu_count = plan, start, cpu_count

    def __iter__(self):
        n = self.start
        while True:
            yield (*self.plan.batch(n), self.cpu_count)
            n += 1


def finish_uint8(images: torch.Tensor, memory_format) -> torch.Tensor:
    """uint8 NHWC batch (on its device) -> normalised float32 NCHW in `memory_format`.
    NHWC permuted is already channels_last in memory, so that format costs no copy."""
    x = images.permute(0, 3, 1, 2).float()
    x = (x - MEAN255.to(x.device)) / STD255.to(x.device)
    return x.contiguous(memory_format=memory_format)


def _nvimgcodec():
    """nvImageCodec's Python module, or None where it is not installed (the CPU-only images)."""
    try:
        from nvidia import nvimgcodec  # noqa: PLC0415 (optional: nvidia-nvimgcodec-cu13 + nvidia-nvjpeg)
    except ImportError:
        return None
    return nvimgcodec


class DeviceDecoder:
    """The GPU path's JPEG decoder: encoded views -> CHW uint8 images on `device`.

    `nvjpeg` (the default): torchvision's `decode_jpeg(device="cuda")`, one batched call per batch.
    `nvimgcodec` (TRAINOP_DEVICE_DECODER=nvimgcodec, where nvidia-nvimgcodec-cu13 and
    nvidia-nvjpeg are installed): nvImageCodec, one batched call that tries the GPU's hardware
    JPEG engines first, then the CPU; it keeps its decoder state between calls. Measured on 4x
    H100, 4 ranks decoding at once (docs/benchmarks.md, issue 27): torchvision 13,300-16,600
    images/s per GPU at 0.06-0.075 ms of the rank process's CPU per image, nvImageCodec 10,700-
    11,400 at 0.095-0.10 ms (hardware engines alone: 11,000-14,300); both 2.5-4x what ResNet-50
    trains at, so the decoder is not what limits the GPU path, and the default stays the one that
    needs no extra wheel. Either way an image the device decoder refuses (a PNG, a CMYK JPEG) is
    decoded on the CPU and moved over; on a CPU device everything is (what the CPU-only tests run).
    `kind`: auto (TRAINOP_DEVICE_DECODER, else nvjpeg), nvimgcodec, nvjpeg."""

    def __init__(self, device: torch.device, kind: str = "auto", codec_module=None):
        self.device = device
        kind = os.environ.get("TRAINOP_DEVICE_DECODER", "nvjpeg") if kind == "auto" else kind
        module = codec_module if codec_module is not None else (_nvimgcodec() if kind == "nvimgcodec" else None)
        if kind == "nvimgcodec" and module is None:
            raise RuntimeError("TRAINOP_DEVICE_DECODER=nvimgcodec but nvidia-nvimgcodec-cu13 is not installed")
        self._codec = self._params = None
        self.refused = 0  # images the device decoder refused and the CPU decoded (nvimgcodec)
        # a module given (tests: a stand-in for the GPU library) is used on any device
        if module is not None and (device.type == "cuda" or codec_module is not None):
            backends = [module.Backend(module.BackendKind.HW_GPU_ONLY), module.Backend(module.BackendKind.GPU_ONLY),
                        module.Backend(module.BackendKind.CPU_ONLY)]
            # two CPU threads: it parses and feeds the hardware engines; the rank's process is one
            # core of the node's budget (data.auto_workers), not one thread per core of the node
            self._codec = module.Decoder(device_id=device.index or 0, max_num_cpu_threads=2, backends=backends)
            # the CPU path's decode (torchvision) ignores EXIF orientation: so must this one
            self._params = module.DecodeParams(apply_exif_orientation=False, color_spec=module.ColorSpec.SRGB,
                                               sample_format=module.SampleFormat.I_RGB)
            self._module = module
        self.name = "nvimgcodec" if self._codec is not None else ("nvjpeg" if device.type == "cuda" else "cpu")

    def decode(self, views: list[torch.Tensor]) -> list[torch.Tensor]:
        if self._codec is not None:
            return self._decode_nvimgcodec(views)
        from torchvision.io import ImageReadMode, decode_jpeg

        if self.device.type != "cuda":
            return [_cpu_decode(v).to(self.device) for v in views]
        try:
            return decode_jpeg(views, mode=ImageReadMode.RGB, device=self.device)
        except RuntimeError:  # a PNG or a JPEG nvJPEG refuses (CMYK) in the batch: one at a time
            images = []
            for v in views:
                try:
                    images.append(decode_jpeg(v, mode=ImageReadMode.RGB, device=self.device))
                except RuntimeError:
                    images.append(_cpu_decode(v).to(self.device))
            return images

    def _decode_nvimgcodec(self, views):
        module = self._module
        streams = [module.CodeStream(v.numpy()) for v in views]
        stream = torch.cuda.current_stream(self.device).cuda_stream if self.device.type == "cuda" else 0
        decoded = self._codec.decode(streams, params=self._params, cuda_stream=stream)
        out = []
        for v, image in zip(views, decoded):
            if image is None:  # refused by every backend (a PNG among JPEGs, say): the CPU decode
                self.refused += 1
                out.append(_cpu_decode(v).to(self.device))
            else:  # HWC interleaved RGB on the device, ordered on `stream`
                out.append(torch.as_tensor(image, device=self.device).permute(2, 0, 1))
        return out


def _cpu_decode(view: torch.Tensor) -> torch.Tensor:
    from torchvision.io import ImageReadMode, decode_image

    return decode_image(view, mode=ImageReadMode.RGB)


def decode_batch(encoded, offsets, boxes, flips, image_size: int, device: torch.device, memory_format,
                 decoder: DeviceDecoder | None = None) -> torch.Tensor:
    """The GPU path's device half: decode (`decoder`; by default the device's, DeviceDecoder), then
    the contract's crop, bilinear antialiased resize, flip and normalisation on `device`: on a GPU
    with Triton, all in one launch per batch (device_crop); elsewhere, or on
    TRAINOP_DEVICE_CROP=per-image, a resize launch per image."""
    decoder = decoder if decoder is not None else DeviceDecoder(device)
    views = list(encoded.split(torch.diff(offsets).tolist()))  # one call, not a slice per image
    return crop_batch(decoder.decode(views), boxes, flips, image_size, device, memory_format)


def crop_batch(images: list[torch.Tensor], boxes, flips, image_size: int, device: torch.device,
               memory_format) -> torch.Tensor:
    """Decoded (3, H, W) uint8 images on `device` -> the contract's crops (`boxes`: x, y, w, h),
    resized, flipped and normalised: float32 (N, 3, image_size, image_size) in `memory_format`."""
    batched = _batched_crop(device)
    if batched is not None:
        out = torch.empty((len(images), 3, image_size, image_size), dtype=torch.float32, device=device,
                          memory_format=memory_format)
        batched.crop_resize(images, boxes, flips, out)
        return out
    out = torch.empty((len(images), 3, image_size, image_size), dtype=torch.float32, device=device)
    # One resize per image (the crops differ in size), written in place through the ATen op:
    # F.interpolate's Python checks and a copy per image would hold the GIL the training thread
    # needs. Flip and normalisation run once per batch.
    resize = torch._C._nn._upsample_bilinear2d_aa
    for k, (img, (x, y, w, h)) in enumerate(zip(images, boxes.tolist())):
        resize(img[None, :, y:y + h, x:x + w].float(), (image_size, image_size), False, out=out[k:k + 1])
    if flips.any():
        flipped = flips.to(device, non_blocking=True)
        out[flipped] = out[flipped].flip(-1)
    out.sub_(MEAN255.to(device)).div_(STD255.to(device))
    return out.contiguous(memory_format=memory_format)


def _batched_crop(device: torch.device):
    """device_crop (the one-launch crop and resize) where it runs: a CUDA device, Triton
    installed (it comes with torch's CUDA wheels), and not TRAINOP_DEVICE_CROP=per-image (the
    per-image path, kept for CPU devices and for comparison: bench/gpu_decode_probe.py)."""
    if device.type != "cuda" or os.environ.get("TRAINOP_DEVICE_CROP", "batched") == "per-image":
        return None
    return _device_crop()


def crop_way(device: torch.device) -> str:
    """How crop_batch crops on `device` (the trainer's start-up line says it)."""
    return "batched" if _batched_crop(device) is not None else "per-image"


@functools.cache
def _device_crop():
    try:
        from trainop_trainer import device_crop  # noqa: PLC0415 (needs Triton: GPU images only)
    except ImportError:
        return None
    return device_crop


def cpu_share(decode_on: str, workers: int, worker_rate: float = 0.0, appetite: float = 0.0) -> float:
    """The fraction of each batch the loader workers decode on the CPU; the device decodes the rest.

    `split` (the default with GPUs): the workers take as much of the batch as they keep up with,
    `workers` x `worker_rate` images/s against the `appetite` (images/s the model trains at), both
    measured on this host at start-up (`measure_worker_rate`, `measure_appetite`); the device
    decodes the rest. So a host with fewer cores per GPU, or slower ones, or a faster GPU, moves
    work to the GPU, and one whose cores keep up leaves the GPU to train. Why the CPU first: on 4x
    H100 (docs/benchmarks.md, issue 27) the device decode alone trained at 0.66 of synthetic, and
    a split in proportion to the two decoders' rates (about 45% on the device) at 0.79, against
    0.93-0.99 with every image on the CPU: each image the device decodes costs the rank's own
    process, the one that launches the training step, CPU time (about 0.1 ms then; 0.05-0.08 ms
    with the batched crop, nearly all of it the decode call, which slows that process's CUDA
    launches without holding the GIL: 2x H200, 2026-11-28). No rates (a CPU device, or a
    measurement that failed): all on the CPU, the path that needs nothing of the device."""
    if decode_on in ("cpu", "gpu"):
        return 1.0 if decode_on == "cpu" else 0.0
    if worker_rate <= 0 or appetite <= 0:
        return 1.0
    return min(1.0, workers * worker_rate / appetite)


_RATE_PICKS: list = []  # the images measure_worker_rate's forked processes decode (inherited, not pickled)


def _time_decodes(image_size: int) -> float:
    """In a forked measuring process: the median seconds per image of decode_into over _RATE_PICKS."""
    _one_thread(0)
    import time

    scratch = torch.empty((image_size, image_size, 3), dtype=torch.uint8)
    times = []
    for pick in _RATE_PICKS:
        start = time.perf_counter()
        decode_into(pick.raw, pick.crop, image_size, scratch)
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def measure_worker_rate(reader: BatchReader, plan: data.BatchPlan, image_size: int, workers: int,
                        images: int = 16) -> float:
    """One loader worker's images/s on this host, under the load of training: `workers` processes
    (forked, as the DataLoader's are) each decode the rank's first `images` images at once, while
    the node's other ranks do the same at start-up, so the cores are as busy as in training
    (a lone decode on an idle node ran 1.1-1.9x faster than a loaded worker: docs/benchmarks.md).
    The median over images (a page fault or preemption does not set it), then over processes."""
    import multiprocessing

    global _RATE_PICKS
    epoch, indices = plan.batch(0)
    _RATE_PICKS, _ = data.read_batch(reader.samples, reader.pool, epoch, indices[:images], reader.seed, reader.rank,
                                     reader.train)
    try:
        if workers <= 0:
            return 1.0 / max(_time_decodes(image_size), 1e-6)
        with multiprocessing.get_context("fork").Pool(workers) as pool:
            seconds = pool.map(_time_decodes, [image_size] * workers, chunksize=1)
    finally:
        _RATE_PICKS = []
    return 1.0 / max(float(np.median(seconds)), 1e-6)


def measure_appetite(model: torch.nn.Module, batch_size: int, image_size: int, device: torch.device,
                     memory_format, precision: str, steps: int = 3) -> float:
    """Images/s `model` trains at on random input: forward and backward (autocast as in training)
    after one untimed pass, timed on the device. The model comes back as it was (parameters,
    batch-norm statistics, no gradients), so the run trains the same with or without it. It leaves
    out the all-reduce and the optimizer (a few %), so it errs towards a larger appetite: more on
    the device, never a starved step. (The trainer times it on GPUs only: torch_train._appetite.)"""
    import time

    cuda = device.type == "cuda"
    saved = {k: v.detach().clone() for k, v in model.state_dict().items()}
    x = torch.randn(batch_size, 3, image_size, image_size, device=device).contiguous(memory_format=memory_format)
    y = torch.randint(0, 2, (batch_size,), device=device)
    was_training = model.training
    model.train()
    try:
        for timed in (False, True):
            if cuda:
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            for _ in range(steps if timed else 1):
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16"):
                    loss = torch.nn.functional.cross_entropy(model(x), y)
                loss.backward()
            if cuda:
                torch.cuda.synchronize(device)
        seconds = (time.perf_counter() - start) / steps
    finally:
        model.load_state_dict(saved)
        model.zero_grad(set_to_none=True)
        model.train(was_training)
    return batch_size / max(seconds, 1e-6)


class Loader:
    """This rank's training batches, (x float32 NCHW normalised, y int64) on `device`, forever.
    `bad_samples`: the rank's data.BadSamples (warned once per file, counted, limited to
    `max_bad_samples` of the set), fed by the workers' reports in the training thread."""

    def __init__(self, dataset: data.DataSet, rank: int, size: int, batch_size: int, image_size: int,
                 seed: int, workers: int, decode_on: str, read_mode: str, device: torch.device,
                 memory_format=torch.contiguous_format, max_bad_samples: float = data.MAX_BAD_SAMPLES,
                 rates: tuple[float, float] | None = None, appetite: float = 0.0, elastic=None):
        # `elastic` (elastic.Elastic): the global order of an elastic run (data.GlobalPlan)
        self.plan = data.make_plan(dataset, read_mode, rank, size, batch_size, seed, elastic)
        self.reader = BatchReader(dataset.samples, image_size, seed, self.plan.stream, pool=self.plan.pool)
        self.bad_samples = data.BadSamples(dataset.samples, max_bad_samples)
        self.decoder = DeviceDecoder(device) if decode_on != "cpu" else None
        # `split`: this host's rates, (one worker's images/s, the model's images/s), size the CPU's
        # share of each batch; the worker's is measured here before the workers start, the model's
        # (`appetite`, measure_appetite) by the caller, unless `rates` gives both (tests)
        if decode_on == "split" and rates is None and appetite > 0:
            rates = (measure_worker_rate(self.reader, self.plan, image_size, workers), appetite)
        self.rates = rates
        self.cpu_count = round(cpu_share(decode_on, workers, *(rates or (0.0, 0.0))) * batch_size)
        self.workers, self.device, self.memory_format = workers, device, memory_format
        self.image_size = image_size
        self.consumed = 0  # batches handed to the training loop: the whole resumable state
        self._queue: queue.Queue | None = None
        self._it = self._thread = None
        self._stop = threading.Event()

    def state_dict(self) -> dict:
        return {"batches": self.consumed, "batchSize": self.plan.batch_size, "seed": self.plan.seed,
                "rank": self.plan.rank}

    def load_state_dict(self, state: dict) -> None:
        if self._queue is not None:
            raise RuntimeError("load_state_dict() must come before the first batch")
        if state["batchSize"] != self.plan.batch_size or state["seed"] != self.plan.seed:
            raise ValueError(f"loader state is for batch size {state['batchSize']} and seed {state['seed']}; "
                             f"this run has {self.plan.batch_size} and {self.plan.seed}")
        self.consumed = int(state["batches"])

    def _loader(self):
        cuda = self.device.type == "cuda"
        return torch.utils.data.DataLoader(
            self.reader, batch_size=None, sampler=_PlanSampler(self.plan, self.consumed, self.cpu_count),
            num_workers=self.workers, worker_init_fn=_one_thread if self.workers else None,
            pin_memory=cuda and self.cpu_count > 0, persistent_workers=self.workers > 0,
            prefetch_factor=2 if self.workers else None)

    def _finish(self, item):
        """A worker's item -> (x, y on the device, the bad samples the worker met)."""
        images, encoded, offsets, boxes, flips, labels, bad = item
        parts = []
        if len(images):
            parts.append(finish_uint8(images.to(self.device, non_blocking=True), self.memory_format))
        if len(boxes):
            parts.append(decode_batch(encoded, offsets, boxes, flips, self.image_size, self.device, self.memory_format,
                                      self.decoder))
        x = parts[0] if len(parts) == 1 else torch.cat(parts).contiguous(memory_format=self.memory_format)
        return x, labels.to(self.device, non_blocking=True), bad

    def _stage(self, it, stream):
        """The device stage's thread: finish batches on a side stream, AHEAD of the training step."""
        try:
            with torch.cuda.stream(stream):
                for item in it:
                    x, y, bad = self._finish(item)
                    event = torch.cuda.Event()
                    event.record(stream)
                    if not self._put((x, y, bad, event)):
                        return
        except BaseException as e:  # noqa: BLE001 (handed to the training thread)
            self._put(e)

    def _put(self, item) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def close(self) -> None:
        """Stop the device stage and the workers (before the process group goes away)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        self._it = self._thread = None

    def __iter__(self):
        return self

    def __next__(self):
        if self._queue is None:
            self._queue = queue.Queue(maxsize=AHEAD)
            self._it = iter(self._loader())  # workers fork here, in the training thread
            if self.device.type == "cuda":
                # The stage thread and the training thread share the GIL; a shorter switch interval
                # (5 ms by default) keeps the training thread from waiting behind a stage burst.
                sys.setswitchinterval(0.0005)
                stream = torch.cuda.Stream(self.device)
                self._thread = threading.Thread(target=self._stage, args=(self._it, stream), daemon=True,
                                                name="trainop-device-stage")
                self._thread.start()
        if self.device.type != "cuda":
            x, y, bad = self._finish(next(self._it))
        else:
            item = self._queue.get()
            if isinstance(item, BaseException):
                raise item
            x, y, bad, event = item
            current = torch.cuda.current_stream(self.device)
            current.wait_event(event)
            x.record_stream(current)  # allocated on the side stream, freed after use on this one
            y.record_stream(current)
        self.bad_samples.note(bad)
        self.bad_samples.check()  # this rank's alone above the limit: the gang's is too
        self.consumed += 1
        return x, y

    def samples_of(self, n: int) -> list[int]:
        """The samples the plan puts in batch `n` (the slots' own: --sample-log)."""
        return [int(i) for i in self.plan.batch(n)[1]]
