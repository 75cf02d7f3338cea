"""Validation before training: parse() judges the options against the world and the data set."""

import pytest

from trainop_trainer import cli, data, world

pytestmark = pytest.mark.trainer

TWO = world.World("mpirun", 0, 2, 0, 2, "127.0.0.1", 29500, ("127.0.0.1",) * 2)
BASE = ["--framework", "pytorch", "--output-dir", "/tmp/x", "--backend", "native"]


def test_global_batch_is_split_over_the_world():
    cfg = cli.parse([*BASE, "--synthetic", "--global-batch-size", "64"], TWO)
    assert cfg.batch_size == 32
    assert cfg.metrics_file.name == "metrics.jsonl"


@pytest.mark.parametrize("args, message", [
    (["--synthetic", "--global-batch-size", "5"], "--global-batch-size 5 is not divisible by the world size 2"),
    (["--synthetic", "--batch-size", "0"], "--batch-size must be a positive integer"),
    (["--synthetic", "--batch-size", "4", "--image-size", "16"], "--image-size must be at least 32"),
    (["--batch-size", "4"], "one of the arguments --synthetic --data-dir is required"),
    (["--synthetic", "--batch-size", "4", "--precision", "fp8"], "argument --precision: invalid choice"),
])
def test_bad_options(args, message):
    with pytest.raises(cli.ConfigError) as e:
        cli.parse([*BASE, *args], TWO)
    assert message in str(e.value)


def test_max_bad_samples_is_a_fraction():
    assert cli.parse([*BASE, "--synthetic", "--batch-size", "2"], TWO).max_bad_samples == data.MAX_BAD_SAMPLES == 0.001
    assert cli.parse([*BASE, "--synthetic", "--batch-size", "2", "--max-bad-samples", "0"], TWO).max_bad_samples == 0
    for value in ("-0.1", "1", "5", "nan"):
        with pytest.raises(cli.ConfigError, match=f"--max-bad-samples is a fraction of the data set, 0 or more and "
                                                  f"below 1, got {float(value):g}"):
            cli.parse([*BASE, "--synthetic", "--batch-size", "2", "--max-bad-samples", value], TWO)


def test_data_dir_without_images(tmp_path):
    (tmp_path / "class-a").mkdir()
    with pytest.raises(data.DataError, match="no images found"):
        cli.parse([*BASE, "--data-dir", str(tmp_path), "--batch-size", "1"], TWO)


def test_batch_larger_than_a_shard(image_folder):
    with pytest.raises(cli.ConfigError, match="more than each of the 2 ranks' share"):
        cli.parse([*BASE, "--data-dir", str(image_folder), "--batch-size", "100"], TWO)


def test_horovod_is_refused_under_torchrun():
    torchrun = world.World("torchrun", 0, 2, 0, 2, "127.0.0.1", 29500, ("127.0.0.1",) * 2)
    with pytest.raises(cli.ConfigError, match="needs mpirun"):
        cli.parse(["--framework", "pytorch", "--output-dir", "/tmp/x", "--backend", "horovod", "--synthetic",
                   "--batch-size", "2"], torchrun)


def test_auto_backend_is_native_outside_mpirun():
    single = world.World("single", 0, 1, 0, 1, "127.0.0.1", 29500, ("127.0.0.1",))
    cfg = cli.parse(["--framework", "keras", "--output-dir", "/tmp/x", "--synthetic", "--batch-size", "2"], single)
    assert cfg.backend == "native"


def test_min_step_seconds_defaults_to_the_environment(monkeypatch):
    assert cli.parse([*BASE, "--synthetic", "--batch-size", "2"], TWO).min_step_seconds == 0
    monkeypatch.setenv("TRAINOP_MIN_STEP_SECONDS", "0.25")
    assert cli.parse([*BASE, "--synthetic", "--batch-size", "2"], TWO).min_step_seconds == 0.25
    assert cli.parse([*BASE, "--synthetic", "--batch-size", "2", "--min-step-seconds", "0"], TWO).min_step_seconds == 0
