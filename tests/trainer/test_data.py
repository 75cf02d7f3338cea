"""ImageNet-style folder and tar data: indexed alike, sharded without overlap, trained on."""

import re

import numpy as np
import pytest

from tests.trainer.conftest import run_trainer
from trainop_trainer import data

pytestmark = pytest.mark.trainer

DATA_RUN = ["--image-size", "32", "--model", "resnet18", "--batch-size", "2", "--epochs", "2",
            "--loader-workers", "1", "--warmup-epochs", "1"]


def _key(s: data.Sample):
    return (s.path, s.offset)


def test_folder_and_tars_index_the_same_images(image_folder, image_tars):
    folder, tars = data.scan(image_folder.parent), data.scan(image_tars)  # parent: `train/` is found
    assert folder.classes == tars.classes == ("n00000000", "n00000001", "n00000002")
    assert len(folder.samples) == len(tars.samples) == 24
    by_bytes = {s.read(): s.label for s in folder.samples}
    assert {s.read(): s.label for s in tars.samples} == by_bytes  # same images, same labels


@pytest.mark.parametrize("size", [1, 2, 3, 5])
def test_shards_are_disjoint_and_cover_the_set(image_tars, size):
    ds = data.scan(image_tars)
    shards = [set(map(_key, ds.shard(r, size))) for r in range(size)]
    assert sum(len(s) for s in shards) == len(ds.samples)
    assert set().union(*shards) == set(map(_key, ds.samples))
    assert max(map(len, shards)) - min(map(len, shards)) <= 1
    assert ds.steps_per_epoch(size, 2) == len(ds.samples) // size // 2


def test_decode_gives_normalized_square_images(image_folder):
    raw = data.scan(image_folder).samples[0].read()
    img = data.decode(raw, 32, np.random.default_rng(0))
    assert img.shape == (32, 32, 3) and img.dtype == np.float32
    assert -3 < img.mean() < 3


def _shard_lines(run):
    return {int(m[1]): (int(m[3]), int(m[4])) for m in
            re.finditer(r"rank (\d+)/(\d+) reads (\d+) of (\d+) images", run.stderr)}


@pytest.mark.parametrize("launcher, framework, backend, layout", [
    ("torchrun", "pytorch", "native", "folder"),
    ("mpirun", "tensorflow", "horovod", "tar"),
])
def test_training_reads_its_shard(launcher, framework, backend, layout, image_folder, image_tars, tmp_path):
    data_dir = image_folder if layout == "folder" else image_tars
    run = run_trainer(launcher, ["--framework", framework, "--backend", backend, "--data-dir", str(data_dir),
                                 *DATA_RUN], tmp_path)
    assert run.returncode == 0, run.explain()
    shards = _shard_lines(run)
    assert sorted(shards) == [0, 1]
    assert sum(n for n, _ in shards.values()) == 24 and {total for _, total in shards.values()} == {24}
    final = run.records[-1]
    assert final["final"] and final["step"] == 2 * (24 // 2 // 2)  # epochs x full batches of a shard
    assert len(set(run.digests.values())) == 1, run.digests
