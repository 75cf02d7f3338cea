"""Reporting pieces shared by every framework: learning-rate warm-up, throughput over the timed
epochs, and the parameter digest the identical-parameters test compares."""

import json
import time

import numpy as np
import pytest

from tests.trainer.conftest import TINY
from tests.trainer.test_distributed import assert_identical
from trainop_trainer import report

pytestmark = pytest.mark.trainer


def test_learning_rate_warms_up_to_the_scaled_rate():
    lr = [report.learning_rate(s, steps_per_epoch=10, base_lr=0.1, world_size=4, warmup_epochs=2) for s in range(25)]
    assert lr[0] == pytest.approx(0.1)
    assert lr[10] == pytest.approx(0.1 + 0.3 * 10 / 20)
    assert lr[20:] == [pytest.approx(0.4)] * 5
    assert all(a <= b for a, b in zip(lr, lr[1:]))


def test_final_throughput_leaves_out_the_first_epoch(tmp_path, capsys):
    r = report.Reporter(tmp_path / "m.jsonl", world_size=2, global_batch=8, chief=True)
    r.epoch(1, 10, 2.0, total_images_per_sec=10.0, steps=10)  # 8 s: compilation
    r.epoch(2, 20, 1.0, total_images_per_sec=80.0, steps=10)  # 1 s
    r.epoch(3, 30, 0.5, total_images_per_sec=40.0, steps=10)  # 2 s
    r.final(3, 30, 0.5)
    lines = capsys.readouterr().out.splitlines()
    final = json.loads(lines[-2])
    assert final.pop("time") == pytest.approx(time.time(), abs=60)  # when it was reported
    assert final == {"epoch": 3, "step": 30, "loss": 0.5, "imagesPerSec": pytest.approx(160 / 3, abs=0.01),
                     "imagesPerSecPerGPU": pytest.approx(80 / 3, abs=0.01), "stepTime": 0.15,
                     "worldSize": 2, "final": True}
    assert lines[-1] == "Total images/sec: 53.3"
    assert (tmp_path / "m.jsonl").read_text().splitlines() == lines[:-1]


def test_bad_samples_are_reported_on_data_runs_only(tmp_path, capsys):
    for bad, expected in ((None, None), (0, 0), (3, 3)):  # None: synthetic data, no key
        r = report.Reporter(tmp_path / f"m{bad}.jsonl", world_size=1, global_batch=8, chief=True, bad_samples=bad)
        r.epoch(1, 1, 1.0, 8.0, 1)
        r.final(1, 1, 1.0)
        records = [json.loads(line) for line in (tmp_path / f"m{bad}.jsonl").read_text().splitlines()]
        assert [rec.get("badSamples") for rec in records] == [expected] * 2
    capsys.readouterr()


def test_only_the_chief_reports(tmp_path, capsys):
    r = report.Reporter(tmp_path / "m.jsonl", world_size=2, global_batch=8, chief=False)
    r.epoch(1, 1, 1.0, 8.0, 1)
    r.final(1, 1, 1.0)
    assert capsys.readouterr().out == "" and not (tmp_path / "m.jsonl").exists()


def test_identity_check_catches_a_one_ulp_difference():
    params = [np.linspace(-1, 1, 1000, dtype=np.float32), np.ones((3, 3), np.float32)]
    drifted = [params[0].copy(), params[1]]
    drifted[0][500] = np.nextafter(drifted[0][500], np.float32(2))
    same = report.parameter_digest(params)
    assert_identical({0: same, 1: report.parameter_digest([p.copy() for p in params])}, 2)
    with pytest.raises(AssertionError, match="ranks diverged"):
        assert_identical({0: same, 1: report.parameter_digest(drifted)}, 2)
    with pytest.raises(AssertionError):
        assert_identical({0: same}, 2)  # a rank that reported nothing


def test_ranks_digest_reports_sharing_a_line_are_both_read():
    from tests.trainer.conftest import parse_digests
    d0, d1 = "a" * 64, "b" * 64
    # what two ranks' print() calls produced once: text, text, newline, newline
    interleaved = (f"trainop_trainer: rank 0/2 parameter sha256 {d0}"
                   f"trainop_trainer: rank 1/2 parameter sha256 {d1}\n\n"
                   f"2026-01-01 W tensorflow/core/x.cc:1] a C++ log line\n")
    assert parse_digests(interleaved) == {0: d0, 1: d1}


def test_a_report_is_one_write(monkeypatch, tmp_path):
    writes = []
    monkeypatch.setattr(report.os, "write", lambda fd, data: writes.append(data) or len(data))
    with open(tmp_path / "err", "w") as stream:
        report.write_line(stream, "trainop_trainer: rank 1/2 parameter sha256 " + "c" * 64)
    assert writes == [("trainop_trainer: rank 1/2 parameter sha256 " + "c" * 64 + "\n").encode()]


@pytest.mark.parametrize("framework", ["pytorch", "tensorflow", "keras"])
def test_rank_0_reports_within_an_epoch_at_most_every_report_seconds(trainer_runs, framework):
    """--report-seconds: between the epochs' reports rank 0 reports its own throughput times the
    ranks, so that status.progress's ETA moves within a long epoch (an ImageNet epoch is many
    minutes). With an interval shorter than a step, every step reports: PyTorch's loop,
    TensorFlow's custom loop and Keras's model.fit (a callback) alike.
    The same runs hold each step to --min-step-seconds, which each of the three loops honours:
    every step's report but an epoch's first (timed from the epoch's start) shows at least it."""
    held = 0.3  # the tiny model's step takes ~0.05 s here: no step time would reach it unheld
    run = trainer_runs("torchrun", framework, "native", ("--report-seconds", "1e-9", "--min-step-seconds", str(held)))
    assert run.returncode == 0, run.explain()
    steps, epochs = int(TINY[TINY.index("--steps-per-epoch") + 1]), int(TINY[TINY.index("--epochs") + 1])
    records = [r for r in run.records if not r["final"]]
    # each step's own report, and the epoch's (gathered) report after its last step
    assert [r["step"] for r in records] == [s for e in range(epochs) for s in
                                            [*range(e * steps + 1, (e + 1) * steps + 1), (e + 1) * steps]]
    assert all(r["imagesPerSec"] > 0 and r["stepTime"] > 0 and r["totalSteps"] == steps * epochs for r in records)
    assert [r["time"] for r in run.records] == sorted(r["time"] for r in run.records)
    assert run.records[-1]["final"]
    # per epoch: its steps' own reports, then the epoch's; an epoch's first step is timed from its start
    within = [r for e in range(epochs) for r in records[e * (steps + 1) + 1:e * (steps + 1) + steps]]
    assert [r["step"] % steps for r in within] == [*range(2, steps), 0] * epochs
    # (a hold counts from the end of the previous one, a moment before that step's report)
    assert all(r["stepTime"] >= held * 0.98 for r in within), [(r["step"], r["stepTime"]) for r in records]
