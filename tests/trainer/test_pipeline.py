"""The input pipeline (issue 18): one augmentation contract on the CPU and GPU decode paths, the
auto worker count, sequential reads of tar shards, the resumable batch plan, and the CPU path
end to end on a small generated JPEG set."""

import os
import re
import subprocess
import sys

import numpy as np
import pytest
import torch

from tests.trainer.conftest import run_trainer
from trainop_trainer import data, torch_data

pytestmark = pytest.mark.trainer

SIZE = 32
LOW, HIGH = float(((0 - data.MEAN) / data.STD).min()), float(((1 - data.MEAN) / data.STD).max())


def _both_paths(dataset, device):
    """The same batch (epoch 0, all 24 samples) through the CPU path and the GPU path on `device`."""
    indices = np.arange(len(dataset.samples))
    reader = torch_data.BatchReader(dataset.samples, SIZE, 7, 0)
    images, _, _, _, _, labels, bad = reader[(0, indices, len(indices))]  # all decoded by the worker
    cpu = torch_data.finish_uint8(images.to(device), torch.channels_last)
    _, encoded, offsets, boxes, flips, labels2, bad2 = reader[(0, indices, 0)]  # all left to the device
    assert bad == bad2 == ()  # a healthy set: nothing replaced
    gpu = torch_data.decode_batch(encoded, offsets, boxes, flips, SIZE, device, torch.channels_last)
    return cpu, gpu, labels, labels2, flips


def _assert_agree(cpu, gpu, labels, labels2, dataset):
    assert cpu.shape == gpu.shape == (len(dataset.samples), 3, SIZE, SIZE)
    assert cpu.dtype == gpu.dtype == torch.float32
    assert cpu.is_contiguous(memory_format=torch.channels_last) and gpu.is_contiguous(memory_format=torch.channels_last)
    for x in (cpu, gpu):  # normalised from 0..255: inside the contract's range, and not constant
        assert float(x.min()) >= LOW - 1e-4 and float(x.max()) <= HIGH + 1e-4 and float(x.std()) > 0.1
    assert torch.equal(labels, labels2) and labels.tolist() == [s.label for s in dataset.samples]
    # Same crop and flip, different decoders and resizers: a grey level or so apart on average.
    diff = (cpu - gpu).abs().mean(dim=(1, 2, 3)).cpu()
    assert float(diff.max()) < 0.1, diff


def test_cpu_and_gpu_paths_follow_one_contract(image_folder):
    """The GPU path's device half runs here on the CPU (torchvision decodes with libjpeg-turbo)."""
    dataset = data.scan(image_folder)
    cpu, gpu, labels, labels2, flips = _both_paths(dataset, torch.device("cpu"))
    _assert_agree(cpu, gpu, labels, labels2, dataset)
    assert 0 < int(flips.sum()) < len(flips)  # the flip is drawn, not fixed
    # A flipped image differs from its unflipped decode: the flip was applied on both paths.
    raw = dataset.samples[int(np.flatnonzero(flips.numpy())[0])].read()
    crop = data.draw_crop(*data.image_size_of(raw), None)
    plain = data.decode_uint8(raw, crop, SIZE)
    mirrored = data.decode_uint8(raw, data.Crop(crop.x, crop.y, crop.w, crop.h, True), SIZE)
    assert np.array_equal(plain[:, ::-1], mirrored)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA-only part: nvJPEG decode on a GPU (none here)")
def test_nvjpeg_on_the_gpu_follows_the_contract(image_folder):
    dataset = data.scan(image_folder)
    cpu, gpu, labels, labels2, _ = _both_paths(dataset, torch.device("cuda"))
    assert gpu.is_cuda
    _assert_agree(cpu, gpu, labels, labels2, dataset)  # labels stay on the CPU (the reader makes them)


@pytest.mark.skipif(not torch.cuda.is_available() or torch_data._device_crop() is None,
                    reason="CUDA-only part: the batched crop (Triton) on a GPU (none here)")
@pytest.mark.parametrize("size", [SIZE, 224])
@pytest.mark.parametrize("memory_format", [torch.channels_last, torch.contiguous_format])
def test_the_batched_crop_is_the_per_image_resize(monkeypatch, size, memory_format):
    """device_crop (one launch per batch) against the per-image ATen resize it replaces, on noise
    (the hardest case for a filter): downscales up to 60x, upscales, whole-image, one-pixel-wide
    and tiny crops, flipped or not, contiguous (torchvision's) and HWC (nvImageCodec's) images."""
    device = torch.device("cuda")
    rng = np.random.default_rng(0)
    images, boxes = [], []
    for k in range(24):
        h, w = (int(v) for v in rng.integers(16, 2000, size=2))
        image = torch.from_numpy(rng.integers(0, 256, (3, h, w), dtype=np.uint8)).to(device)
        images.append(image.permute(1, 2, 0).contiguous().permute(2, 0, 1) if k % 3 == 2 else image)
        cw, ch = [(w, h), (1, h), (min(w, 3), min(h, 5)), (int(rng.integers(1, w + 1)), int(rng.integers(1, h + 1)))][k % 4]
        boxes.append((int(rng.integers(0, w - cw + 1)), int(rng.integers(0, h - ch + 1)), cw, ch))
    boxes, flips = torch.tensor(boxes, dtype=torch.int64), torch.from_numpy(rng.random(24) < 0.5)
    monkeypatch.setenv("TRAINOP_DEVICE_CROP", "per-image")
    assert torch_data.crop_way(device) == "per-image"
    reference = torch_data.crop_batch(images, boxes, flips, size, device, memory_format)
    monkeypatch.delenv("TRAINOP_DEVICE_CROP")
    assert torch_data.crop_way(device) == "batched"
    out = torch_data.crop_batch(images, boxes, flips, size, device, memory_format)
    assert out.shape == reference.shape == (24, 3, size, size) and out.is_contiguous(memory_format=memory_format)
    assert float((out - reference).abs().max()) < 1e-3  # normalised units: 0.06 of a grey level


def test_split_batches_share_the_decode_between_cpu_and_device(image_tars):
    """`split`: the worker decodes the first part of each batch, the device the rest; the batch is
    the same images, in plan order, as the all-CPU path gives (to a grey level or so)."""
    ds = data.scan(image_tars)

    def first_batch(decode_on, workers):
        # rates given: 5 workers at 100 images/s each keep up with half of a model that trains at 1,000
        loader = torch_data.Loader(ds, 0, 1, 8, SIZE, 42, workers, decode_on, "sequential", torch.device("cpu"),
                                   rates=(100.0, 1000.0))
        loader.workers = 0  # decode in this process; the share stays that of `workers` workers
        return loader.cpu_count, next(loader)

    (n_cpu, (x_cpu, y_cpu)), (n_split, (x_split, y_split)) = first_batch("cpu", 0), first_batch("split", 5)
    assert (n_cpu, n_split) == (8, 4)
    assert torch.equal(y_cpu, y_split) and x_cpu.shape == x_split.shape
    assert torch.equal(x_cpu[:4], x_split[:4])  # the same worker decode for the CPU part
    assert float((x_cpu[4:] - x_split[4:]).abs().mean()) < 0.1


def test_the_worker_decode_agrees_with_the_pil_reference(tmp_path):
    """decode_into (torchvision + ATen's uint8 resize; PIL for large crops and what torchvision
    refuses) against data.decode_uint8 (PIL): the same crop, flip and size, a grey level apart."""
    import io

    from PIL import Image

    rng = np.random.default_rng(3)
    smooth = np.asarray(Image.fromarray(rng.integers(0, 256, (12, 16, 3), dtype=np.uint8)).resize((640, 480), Image.BICUBIC))

    def encoded(mode, fmt):
        out = io.BytesIO()
        Image.fromarray(smooth).convert(mode).save(out, fmt, **({"quality": 90} if fmt == "JPEG" else {}))
        return out.getvalue()

    cases = [(encoded("RGB", "JPEG"), data.Crop(10, 20, 300, 200, False)),  # torchvision
             (encoded("RGB", "JPEG"), data.Crop(10, 20, 300, 200, True)),
             (encoded("RGB", "JPEG"), data.Crop(0, 0, 640, 480, True)),  # >= 2x: PIL's draft decode
             (encoded("L", "JPEG"), data.Crop(100, 50, 120, 90, False)),  # grey: three equal channels
             (encoded("RGBA", "PNG"), data.Crop(5, 5, 200, 300, True))]
    for raw, crop in cases:
        out = torch.full((224, 224, 3), 7, dtype=torch.uint8)[None][0]
        torch_data.decode_into(raw, crop, 224, out)
        reference = data.decode_uint8(raw, crop, 224).astype(np.int16)
        assert float(np.abs(out.numpy().astype(np.int16) - reference).mean()) < 1.0, crop
    flipped = out.clone()
    torch_data.decode_into(raw, data.Crop(5, 5, 200, 300, False), 224, out)
    assert torch.equal(flipped, out.flip(1))
    with pytest.raises(Exception):  # noqa: B017 (PIL's own error for bytes that are no image)
        torch_data.decode_into(b"not an image", data.Crop(0, 0, 4, 4, False), 224, out)


def test_random_resized_crop_stays_inside_the_contract():
    rng = np.random.default_rng(0)
    for w, h in [(500, 375), (375, 500), (40, 48), (2000, 90), (33, 33)]:
        for _ in range(200):
            c = data.draw_crop(w, h, rng)
            assert c.x >= 0 and c.x + c.w <= w and c.y >= 0 and c.y + c.h <= h and c.w > 0 and c.h > 0
        centre = data.draw_crop(w, h, None)
        assert centre.w == centre.h == min(w, h) and not centre.flip
    # Same (seed, rank, epoch, index): the same crop, in any process; another epoch: another crop.
    draw = [data.draw_crop(500, 375, data.sample_rng(1, 2, e, 3)) for e in (0, 0, 1)]
    assert draw[0] == draw[1] != draw[2]


def test_decode_scales_down_large_jpegs_to_the_crop(tmp_path):
    """A small crop of a large JPEG decodes at a reduced DCT scale and still fills image_size."""
    from PIL import Image

    path = tmp_path / "big.jpg"
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (1200, 1600, 3), dtype=np.uint8)).save(path)
    raw = path.read_bytes()
    for crop in [data.Crop(0, 0, 1600, 1200, False), data.Crop(1591, 1190, 9, 10, True), data.Crop(3, 5, 700, 300, False)]:
        assert data.decode_uint8(raw, crop, 224).shape == (224, 224, 3)


def test_auto_workers_share_the_cpus_among_local_ranks(tmp_path):
    assert data.auto_workers(4, "cpu", cpus=64) == 15  # 16 each, one left for the rank's process
    assert data.auto_workers(8, "cpu", cpus=64) == 7
    assert data.auto_workers(4, "gpu", cpus=64) == 6  # byte readers: a few suffice
    assert data.auto_workers(4, "cpu", cpus=2) == 1
    # The affinity mask counts (taskset, a CPU manager's exclusive cores)...
    one_cpu = subprocess.run([sys.executable, "-c", "import os; from trainop_trainer import data; "
                              "os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}); print(data.cpu_budget())"],
                             capture_output=True, text=True, check=True, env=dict(os.environ))
    assert one_cpu.stdout.strip() == "1"
    # ...and so does a cgroup quota (a pod's CPU limit), v2 and v1 layouts.
    v2 = tmp_path / "v2"
    v2.mkdir()
    (v2 / "cpu.max").write_text("150000 100000\n")
    assert data.cpu_budget(v2) == min(2, len(os.sched_getaffinity(0)))
    (v2 / "cpu.max").write_text("max 100000\n")
    assert data.cpu_budget(v2) == len(os.sched_getaffinity(0))
    v1 = tmp_path / "v1"
    (v1 / "cpu").mkdir(parents=True)
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("100000\n")
    (v1 / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert data.cpu_budget(v1) == 1


def test_tar_shards_are_read_in_sequential_blocks(tmp_path):
    """Sequential mode: blocks of consecutive members of one tar, dealt to ranks; one read per
    block; every image once per epoch on exactly one rank."""
    import tarfile

    from tests.trainer.conftest import make_image_folder

    folder = make_image_folder(tmp_path / "files" / "train", classes=3, per_class=20)
    shards = tmp_path / "shards"
    shards.mkdir()
    files = sorted(folder.glob("*/*.JPEG"))
    for k in range(2):
        with tarfile.open(shards / f"train-{k}.tar", "w") as tar:
            for f in files[k::2]:
                tar.add(f, arcname=f"{f.parent.name}/{f.name}")
    ds = data.scan(shards)
    assert ds.sharded and ds.read_mode() == "sequential" and data.scan(folder).read_mode() == "random"
    with pytest.raises(data.DataError, match="--read-mode sequential needs .tar shards"):
        data.scan(folder).read_mode("sequential")
    for size in (1, 2, 3):
        blocks = [ds.blocks(r, size, "sequential") for r in range(size)]
        flat = [i for rank in blocks for b in rank for i in b]
        assert sorted(flat) == list(range(len(ds.samples)))  # disjoint, covering
        for b in (b for rank in blocks for b in rank):
            members = [ds.samples[i] for i in b]
            assert len(b) <= data.BLOCK and len({s.path for s in members}) == 1
            assert all(s.offset < t.offset for s, t in zip(members, members[1:]))  # file order
        assert ds.steps_per_epoch(size, 4, "sequential") == min(sum(map(len, r)) for r in blocks) // 4
    block = [ds.samples[i] for i in ds.blocks(0, 1, "sequential")[0]]
    shuffled = block[::-1]
    assert data.read_many(shuffled) == [s.read() for s in shuffled]  # one coalesced read, sliced right
    plan = data.BatchPlan(tuple(ds.blocks(0, 1, "sequential")), 8, 0, 0)
    for epoch in (0, 1):
        seen = np.concatenate([plan.batch(epoch * plan.batches_per_epoch + k)[1] for k in range(plan.batches_per_epoch)])
        assert len(set(seen.tolist())) == len(seen) == plan.batches_per_epoch * 8
    assert not np.array_equal(plan.epoch_order(0), plan.epoch_order(1))  # reshuffled each epoch


def test_loader_resumes_at_its_position(image_tars):
    """The loader's state is its batch count: a fresh loader given it continues identically
    (the contract the checkpoint/resume work builds on)."""
    ds = data.scan(image_tars)

    def loader():
        return torch_data.Loader(ds, 0, 2, 2, SIZE, 42, 0, "cpu", "sequential", torch.device("cpu"))

    first = loader()
    seen = [next(first) for _ in range(7)]  # past the end of data epoch 0 (6 batches)
    state = first.state_dict()
    assert state == {"batches": 7, "batchSize": 2, "seed": 42, "rank": 0}
    resumed = loader()
    resumed.load_state_dict({**state, "batches": 4})
    for x, y in seen[4:]:
        x2, y2 = next(resumed)
        assert torch.equal(x, x2) and torch.equal(y, y2)
    with pytest.raises(ValueError, match="batch size 3"):
        loader().load_state_dict({**state, "batchSize": 3})


def test_cpu_path_trains_on_tar_shards_with_default_workers(image_tars, tmp_path):
    """End to end: default --loader-workers auto, --decode auto and --read-mode auto (sequential)
    on tars; on a CPU machine all of each batch is decoded on the CPU, beside a GPU as cpu_share says."""
    run = run_trainer("torchrun", ["--framework", "pytorch", "--backend", "native", "--data-dir", str(image_tars),
                                   "--image-size", "32", "--model", "resnet18", "--batch-size", "2", "--epochs", "1",
                                   "--warmup-epochs", "1"], tmp_path)
    assert run.returncode == 0, run.explain()
    if torch.cuda.is_available():  # split, sized by the rates the rank measured (printed on the same line)
        assert re.search(r"decodes [0-2] of every 2 images on the CPU .*measured: \d+ images/s per worker", run.stderr)
    else:
        assert "decodes 2 of every 2 images on the CPU" in run.stderr
    assert "sequential reads" in run.stderr
    final = run.records[-1]
    assert final["final"] and final["step"] == 24 // 2 // 2 and final["imagesPerSec"] > 0
