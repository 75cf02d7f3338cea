"""Bad samples do not kill the job (issue 27): an empty or truncated image is skipped, named once
in a WARNING, counted in the reports (`badSamples`), and replaced by another sample of the set,
deterministically, so batch shapes, step counts and bitwise resume stay; above --max-bad-samples
the run fails with one clear line. CMYK, greyscale and PNG-in-a-.JPEG files are no bad samples.

Real files throughout: JPEGs written by PIL, then emptied or cut in half on disk, read by the real
torch DataLoader (with worker processes), the real tf.data pipeline and the real entry point."""

import io
import re

import numpy as np
import pytest
import torch

from tests.trainer.conftest import make_image_folder, run_trainer
from trainop_trainer import data, torch_data

pytestmark = pytest.mark.trainer

SIZE = 32
BATCH = 8
EMPTY, TRUNCATED = 5, 10  # set indices of the damaged files: one on each rank of two (random reads)
LENIENT = 0.05  # --max-bad-samples for the runs that must go on: 4 of 80 allowed


def _damage(root):
    """Empty one file and cut another in half, on disk; returns their paths (EMPTY, TRUNCATED)."""
    samples = data.scan(root).samples
    empty, truncated = samples[EMPTY].path, samples[TRUNCATED].path
    open(empty, "wb").close()
    raw = open(truncated, "rb").read()
    with open(truncated, "wb") as f:
        f.write(raw[:len(raw) // 2])
    return empty, truncated


@pytest.fixture(scope="module")
def bad_set(tmp_path_factory):
    """80 generated JPEGs in 4 classes, one of them empty and one truncated."""
    root = make_image_folder(tmp_path_factory.mktemp("bad") / "train", classes=4, per_class=20)
    empty, truncated = _damage(root)
    return root, empty, truncated


def _encoded(mode: str, fmt: str, **options) -> bytes:
    pixels = np.random.default_rng(1).integers(0, 256, (6, 8, 3), dtype=np.uint8)
    from PIL import Image

    out = io.BytesIO()
    Image.fromarray(pixels).resize((64, 48), Image.BICUBIC).convert(mode).save(out, fmt, **options)
    return out.getvalue()


def _warnings(stderr: str, path: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith(f"trainop_trainer: WARNING: bad sample {path}:")]


# ---- the check: which bytes are bad ----

def test_check_tells_damaged_bytes_from_whole_images():
    jpeg = _encoded("RGB", "JPEG", quality=90)
    progressive = _encoded("RGB", "JPEG", progressive=True)
    # an FFD9 inside a marker segment before the scan (as an EXIF thumbnail has) is not the end
    comment = jpeg[:2] + b"\xff\xfe\x00\x06\xff\xd9\xff\xd9" + jpeg[2:]
    whole = {"rgb": jpeg, "cmyk": _encoded("CMYK", "JPEG"), "grey": _encoded("L", "JPEG"),
             "png": _encoded("RGB", "PNG"), "progressive": progressive, "comment": comment,
             "trailing bytes": jpeg + b"\x00\x00padding"}
    for name, raw in whole.items():
        assert data.check(raw) == (64, 48), name
    bad = {"": "empty file",
           b"not an image": "UnidentifiedImageError: cannot identify image file",
           jpeg[:len(jpeg) // 2]: "truncated JPEG (the data ends before the end-of-image marker)",
           progressive[:len(progressive) // 2]: "truncated JPEG (the data ends before the end-of-image marker)",
           comment[:len(comment) // 2]: "truncated JPEG (the data ends before the end-of-image marker)",
           whole["png"][:len(whole["png"]) // 2]: "truncated PNG (no IEND chunk)"}
    for raw, why in bad.items():
        with pytest.raises(data.DECODE_ERRORS) as e:
            data.check(bytes(raw, "ascii") if isinstance(raw, str) else raw)
        assert data.reason(e.value) == why


def test_the_limit_is_a_fraction_of_the_set_rounded_up():
    assert data.bad_sample_limit(1_281_167, data.MAX_BAD_SAMPLES) == 1282  # ImageNet-1k at the default
    assert data.bad_sample_limit(80, data.MAX_BAD_SAMPLES) == 1  # a small set still tolerates one
    assert data.bad_sample_limit(30, 0.1) == 3  # not 4 (0.1 * 30 is 3.0000000000000004)
    assert data.bad_sample_limit(80, 0.0) == 0


# ---- the shared skip/replace helper ----

def test_a_bad_sample_is_replaced_by_the_same_sample_for_the_same_seed(bad_set):
    root, empty, truncated = bad_set
    ds = data.scan(root)
    pool = data.BatchPlan(tuple(ds.blocks(0, 2)), BATCH, 42, 0).pool  # rank 0 of 2: the even indices
    indices = np.array([TRUNCATED, 0, 2, 4])
    picks, bad = data.read_batch(ds.samples, pool, 3, indices, 42, 0)
    assert [i for i, _ in bad] == [TRUNCATED] and "truncated JPEG" in bad[0][1]
    replaced = picks[0]
    assert replaced.attempt >= 1 and replaced.index != TRUNCATED and replaced.index in pool.tolist()
    assert replaced.label == ds.samples[replaced.index].label and replaced.raw == ds.samples[replaced.index].read()
    assert [p.index for p in picks[1:]] == [0, 2, 4] and all(p.attempt == 0 for p in picks[1:])
    # a pure function of (seed, rank, epoch, index): again, the same pick, bytes and crop
    assert data.read_batch(ds.samples, pool, 3, indices, 42, 0) == (picks, bad)
    # the replacement's augmentation is the slot's, not that sample's own in this epoch
    own = data.draw_crop(*data.check(replaced.raw), data.sample_rng(42, 0, 3, replaced.index))
    assert replaced.crop != own
    # another epoch draws again (the file is bad in every epoch; only its first meeting warns)
    other, _ = data.read_batch(ds.samples, pool, 4, indices, 42, 0)
    assert (other[0].index, other[0].crop) != (replaced.index, replaced.crop)


def test_a_bad_tar_member_is_named_by_its_tar_and_member(bad_set, tmp_path, capfd):
    """Shards read in sequential blocks: the same replacement, the WARNING names `<tar>:<member>`."""
    import tarfile

    root, empty, truncated = bad_set
    with tarfile.open(tmp_path / "train-0.tar", "w") as tar:
        for f in sorted(root.glob("*/*.JPEG")):
            tar.add(f, arcname=f"{f.parent.name}/{f.name}")
    ds = data.scan(tmp_path)
    loader = torch_data.Loader(ds, 0, 1, BATCH, SIZE, 42, 0, "cpu", "sequential", torch.device("cpu"),
                               max_bad_samples=LENIENT)
    assert all(next(loader)[0].shape == (BATCH, 3, SIZE, SIZE) for _ in range(loader.plan.batches_per_epoch))
    err = capfd.readouterr().err
    for path in (empty, truncated):
        member = "/".join(path.split("/")[-2:])
        assert len(_warnings(err, f"{tmp_path / 'train-0.tar'}:{member}")) == 1
    assert loader.bad_samples.count == 2


def _loader(ds, decode_on: str, workers: int, max_bad: float = LENIENT):
    # `split`'s rates given, as a GPU rank measures them at start-up: `workers` workers at 100
    # images/s each against a model that trains at 1,000 (5 workers: half of each batch on the CPU)
    loader = torch_data.Loader(ds, 0, 1, BATCH, SIZE, 42, workers, decode_on, "random", torch.device("cpu"),
                               max_bad_samples=max_bad, rates=(100.0, 1000.0) if decode_on == "split" else None)
    return loader


def test_torch_loader_with_workers_skips_warns_once_and_counts(bad_set, capfd):
    """Two epochs through the real DataLoader with two worker processes: every batch full, the
    step count the plan's, each bad file named in one WARNING line (not once per epoch), counted."""
    root, empty, truncated = bad_set
    ds = data.scan(root)
    loader = _loader(ds, "cpu", 2)
    steps = ds.steps_per_epoch(1, BATCH)
    assert steps == loader.plan.batches_per_epoch == 10  # unchanged by the bad files
    batches = [next(loader) for _ in range(2 * steps)]
    loader.close()
    assert all(x.shape == (BATCH, 3, SIZE, SIZE) and y.shape == (BATCH,) for x, y in batches)
    err = capfd.readouterr().err
    assert _warnings(err, empty) == [f"trainop_trainer: WARNING: bad sample {empty}: empty file; "
                                     f"skipped, another sample of the set stands in"]
    assert len(_warnings(err, truncated)) == 1 and "truncated JPEG" in _warnings(err, truncated)[0]
    assert loader.bad_samples.count == 2 and set(loader.bad_samples.found) == {EMPTY, TRUNCATED}
    # Deterministic by construction: no workers, and resumed mid-way (past the first epoch's
    # replacements), the same batches bit for bit.
    resumed = _loader(ds, "cpu", 0)
    resumed.load_state_dict({**loader.state_dict(), "batches": 7})
    for x, y in batches[7:]:
        x2, y2 = next(resumed)
        assert torch.equal(x, x2) and torch.equal(y, y2)


@pytest.mark.parametrize("decode_on, workers", [("gpu", 0), ("split", 5)])
def test_the_gpu_decode_path_gets_the_same_replacements(bad_set, decode_on, workers, capfd):
    """The GPU path reads through the same data.read_batch in the worker: the device half only
    sees the replacement's bytes. Its device half (torch_data.decode_batch) runs here on the CPU
    (torchvision decodes with libjpeg-turbo); nvJPEG on CUDA itself cannot run here (no GPU), so
    what stays untested is only that CUDA decode of bytes that passed data.check, the same bytes
    this test decodes. `split` puts half of each batch on each path."""
    root, empty, truncated = bad_set
    ds = data.scan(root)
    reference = _loader(ds, "cpu", 0)
    loader = _loader(ds, decode_on, workers)
    loader.workers = 0  # decode in this process; the split stays that of `workers` workers
    assert loader.cpu_count == (0 if decode_on == "gpu" else BATCH // 2)
    for _ in range(2 * loader.plan.batches_per_epoch):
        (x, y), (x_ref, y_ref) = next(loader), next(reference)
        assert x.shape == x_ref.shape == (BATCH, 3, SIZE, SIZE)
        assert torch.equal(y, y_ref)  # the same replacements, in the same slots
        assert float((x - x_ref).abs().mean()) < 0.1  # different decoders, the same images
    err = capfd.readouterr().err
    assert len(_warnings(err, empty)) == 2 and len(_warnings(err, truncated)) == 2  # one per loader
    assert loader.bad_samples.count == reference.bad_samples.count == 2


def test_above_the_limit_the_loader_fails_naming_count_limit_flag_and_files(bad_set):
    root, empty, truncated = bad_set
    ds = data.scan(root)
    loader = _loader(ds, "cpu", 0, max_bad=0.01)  # 0.8 of 80 images: 1 allowed
    with pytest.raises(data.BadSamplesError) as e:
        for _ in range(loader.plan.batches_per_epoch):
            next(loader)
    first, second = sorted(loader.bad_samples.found, key=list(loader.bad_samples.found).index)
    names = f"{ds.samples[first].name}, {ds.samples[second].name}"
    assert str(e.value) == (f"2 bad samples (empty, truncated or unreadable images): more than --max-bad-samples 0.01 "
                            f"of the 80 images allows (1): {names} (every rank's WARNING lines name its own); "
                            f"repair or remove them, or raise --max-bad-samples")


# ---- image kinds that are not bad ----

@pytest.fixture(scope="module")
def odd_kinds(tmp_path_factory):
    """A set of ordinary JPEGs plus a CMYK JPEG, a greyscale JPEG and a PNG named .JPEG (as
    ImageNet has), and one empty file."""
    root = make_image_folder(tmp_path_factory.mktemp("kinds") / "train", classes=2, per_class=6)
    cls = root / "n00000000"
    (cls / "z_cmyk.JPEG").write_bytes(_encoded("CMYK", "JPEG"))
    (cls / "z_grey.JPEG").write_bytes(_encoded("L", "JPEG"))
    (cls / "z_png.JPEG").write_bytes(_encoded("RGB", "PNG"))
    (root / "n00000001" / "z_empty.JPEG").write_bytes(b"")
    return root


def test_cmyk_grey_and_png_named_jpeg_are_no_bad_samples_on_cpu_and_gpu_paths(odd_kinds):
    ds = data.scan(odd_kinds)
    kinds = [i for i, s in enumerate(ds.samples) if "/z_" in s.path and "empty" not in s.path]
    assert len(kinds) == 3
    reader = torch_data.BatchReader(ds.samples, SIZE, 7, 0)
    indices = np.array(kinds)
    images, _, _, _, _, labels, bad = reader[(0, indices, len(indices))]  # the worker decodes
    _, encoded, offsets, boxes, flips, _, bad2 = reader[(0, indices, 0)]  # the device decodes
    assert bad == bad2 == ()
    cpu = torch_data.finish_uint8(images, torch.contiguous_format)
    gpu = torch_data.decode_batch(encoded, offsets, boxes, flips, SIZE, torch.device("cpu"), torch.contiguous_format)
    assert cpu.shape == gpu.shape == (3, 3, SIZE, SIZE)
    for k in range(3):  # the picture, not a blank: contrast, and the two paths agree
        assert float(cpu[k].std()) > 0.1 and float((cpu[k] - gpu[k]).abs().mean()) < 0.15, ds.samples[kinds[k]].path
    grey = cpu[1]
    assert torch.allclose(grey[0] * data.STD[0] + data.MEAN[0], grey[1] * data.STD[1] + data.MEAN[1], atol=1e-5)


def _tf_setup(root, max_bad: float = LENIENT):
    from trainop_trainer import cli, tf_train, world

    single = world.World("single", 0, 1, 0, 1, "127.0.0.1", 29500, ("127.0.0.1",))
    cfg = cli.parse(["--framework", "tensorflow", "--backend", "native", "--output-dir", "/tmp/unused",
                     "--data-dir", str(root), "--batch-size", str(BATCH), "--image-size", str(SIZE),
                     "--max-bad-samples", str(max_bad)], single)
    import tensorflow as tf

    return tf, tf_train, cfg, single


def test_tf_data_skips_replaces_and_keeps_cmyk_grey_and_png(odd_kinds, bad_set, capfd):
    """The real tf.data pipeline (tf_train._image_dataset): CMYK, grey and PNG-in-.JPEG decode
    (TensorFlow's own decoders) and are not counted; the empty and the truncated file are replaced,
    warned about once, counted; batches full, and a pipeline started at batch k (a resume) gives
    the same batches bit for bit."""
    tf, tf_train, cfg, single = _tf_setup(odd_kinds)
    ds = data.scan(odd_kinds)
    make, steps, tracker, _ = tf_train._dataset(tf, cfg, single)
    assert steps == len(ds.samples) // BATCH == 2  # one epoch: every sample once
    batches = [(x.numpy(), y.numpy()) for x, y in make(0).take(steps)]
    assert all(x.shape == (BATCH, SIZE, SIZE, 3) and y.shape == (BATCH,) for x, y in batches)
    assert list(tracker.found) == [i for i, s in enumerate(ds.samples) if s.path.endswith("z_empty.JPEG")]
    kinds = {i for i, s in enumerate(ds.samples) if "/z_" in s.path and "empty" not in s.path}
    plan = data.BatchPlan(tuple(ds.blocks(0, 1)), BATCH, cfg.seed, 0)
    decoded = [batches[n][0][k] for n in range(steps) for k, i in enumerate(plan.batch(n)[1]) if i in kinds]
    assert len(decoded) == 3 and all(float(x.std()) > 0.1 for x in decoded)  # pictures, not blanks

    tf, tf_train, cfg, single = _tf_setup(bad_set[0])
    make, steps, tracker, _ = tf_train._dataset(tf, cfg, single)
    batches = [(x.numpy(), y.numpy()) for x, y in make(0).take(2 * steps)]
    assert len(batches) == 2 * steps == 20
    assert all(x.shape == (BATCH, SIZE, SIZE, 3) and np.isfinite(x).all() for x, _ in batches)
    err = capfd.readouterr().err
    assert len(_warnings(err, bad_set[1])) == len(_warnings(err, bad_set[2])) == 1
    assert tracker.count == 2
    for (x, y), (x2, y2) in zip(batches[13:], make(13).take(7)):
        assert np.array_equal(x, x2.numpy()) and np.array_equal(y, y2.numpy())
    # the torch loader put the same samples in the same slots (labels alike, batch by batch)
    loader = _loader(data.scan(bad_set[0]), "cpu", 0)
    assert all(np.array_equal(y, next(loader)[1].numpy()) for _, y in batches)


# ---- end to end, through the real entry point ----

RUN = ["--image-size", str(SIZE), "--model", "resnet18", "--epochs", "2", "--warmup-epochs", "1",
       "--loader-workers", "1", "--report-seconds", "0"]


def test_torchrun_two_ranks_train_on_through_bad_samples(bad_set, tmp_path):
    """2 ranks, one bad file in each rank's shard: the run succeeds with the usual step count,
    each file is warned about once in the whole run, and every report counts the gang's 2."""
    root, empty, truncated = bad_set
    run = run_trainer("torchrun", ["--framework", "pytorch", "--backend", "native", "--data-dir", str(root),
                                   "--batch-size", "4", "--max-bad-samples", str(LENIENT), *RUN], tmp_path)
    assert run.returncode == 0, run.explain()
    assert [r["step"] for r in run.records] == [10, 20, 20]  # 80 images / 2 ranks / 4 per batch, 2 epochs
    assert [r["badSamples"] for r in run.records] == [2, 2, 2]
    assert len(_warnings(run.stderr, empty)) == len(_warnings(run.stderr, truncated)) == 1
    assert len(set(run.digests.values())) == 1, run.digests


def test_tensorflow_trains_on_through_bad_samples(bad_set, tmp_path):
    root, empty, truncated = bad_set
    run = run_trainer("single", ["--framework", "tensorflow", "--backend", "native", "--data-dir", str(root),
                                 "--batch-size", str(BATCH), "--max-bad-samples", str(LENIENT), *RUN], tmp_path, ranks=1)
    assert run.returncode == 0, run.explain()
    assert [(r["step"], r["badSamples"]) for r in run.records] == [(10, 2), (20, 2), (20, 2)]
    assert len(_warnings(run.stderr, empty)) == len(_warnings(run.stderr, truncated)) == 1


@pytest.mark.parametrize("framework", ["pytorch", "keras"])
def test_above_the_limit_the_run_ends_with_one_clear_line(bad_set, tmp_path, framework):
    """--max-bad-samples 0: the bad file ends the run, exit 2, one error line naming the count,
    the limit, the flag and the file (after that file's WARNING line); no traceback."""
    root = make_image_folder(tmp_path / "data" / "train", classes=4, per_class=20)
    empty = data.scan(root).samples[EMPTY].path
    open(empty, "wb").close()  # one bad file: the count at the failure is 1 whatever tf.data prefetched
    run = run_trainer("single", ["--framework", framework, "--backend", "native", "--data-dir", str(root),
                                 "--batch-size", str(BATCH), "--max-bad-samples", "0", *RUN], tmp_path / "out", ranks=1)
    assert run.returncode == 2, run.explain()
    assert "Traceback" not in run.stderr
    errors = [line for line in run.stderr.splitlines() if line.startswith("trainop_trainer: error:")]
    assert len(errors) == 1, run.stderr
    match = re.fullmatch(r"trainop_trainer: error: 1 bad sample \(empty, truncated or unreadable images\): more than "
                         r"--max-bad-samples 0 of the 80 images allows \(0\): (\S+) \(every rank's WARNING lines "
                         r"name its own\); repair or remove them, or raise --max-bad-samples", errors[0])
    assert match and match[1] == empty, errors
    assert len(_warnings(run.stderr, empty)) == 1
    assert not [r for r in run.records if r.get("final")]
