"""TensorBoard event files (trainop_trainer/events.py): each framework's own writer turns the
chief's reports into scalars that the real TensorBoard reads back; reports carry totalSteps and
their time (what status.progress is computed from)."""

from __future__ import annotations

import json

import pytest

from trainop_trainer import events, report

pytestmark = pytest.mark.trainer


def scalars(logdir) -> dict[str, list[tuple[int, float]]]:
    """What TensorBoard's own loader reads from `logdir`: tag -> [(step, value)]."""
    from tensorboard.backend.event_processing import event_accumulator
    from tensorboard.util import tensor_util

    acc = event_accumulator.EventAccumulator(str(logdir), size_guidance={"tensors": 0, "scalars": 0})
    acc.Reload()
    out = {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
    for tag in acc.Tags()["tensors"]:  # tf.summary writes tensor-valued summaries
        out[tag] = [(e.step, float(tensor_util.make_ndarray(e.tensor_proto))) for e in acc.Tensors(tag)]
    return out


@pytest.mark.parametrize("framework", ["pytorch", "tensorflow"])
def test_reports_become_scalars_that_tensorboard_reads(tmp_path, framework, capsys):
    writer = events.open_writer(framework, tmp_path / "out")
    r = report.Reporter(tmp_path / "m.jsonl", world_size=2, global_batch=8, chief=True, total_steps=20,
                        events=writer)
    r.epoch(1, 10, 2.0, total_images_per_sec=40.0, steps=10)
    r.epoch(2, 20, 1.5, total_images_per_sec=80.0, steps=10)
    r.final(2, 20, 1.5)
    records = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [rec["totalSteps"] for rec in records] == [20, 20, 20]
    assert all(isinstance(rec["time"], float) for rec in records)
    files = list((tmp_path / "out" / events.FOLDER).glob("events.out.tfevents.*"))
    assert len(files) == 1
    got = scalars(tmp_path / "out" / events.FOLDER)
    assert got["throughput/images_per_sec"] == [(10, 40.0), (20, 80.0)]  # the final average is not a step
    assert got["train/loss"] == [(10, 2.0), (20, 1.5)]
    assert got["throughput/step_time_s"] == [(10, pytest.approx(0.2)), (20, pytest.approx(0.1))]


def test_without_a_writer_the_run_goes_on_and_says_so(tmp_path, monkeypatch, capsys):
    import builtins

    real_import = builtins.__import__

    def no_tensorboard(name, *args, **kwargs):
        if name.startswith("torch.utils.tensorboard"):
            raise ImportError("No module named 'tensorboard'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_tensorboard)  # the package missing (an old image)
    assert events.open_writer("pytorch", tmp_path) is None
    assert "no TensorBoard event files" in capsys.readouterr().err
    r = report.Reporter(tmp_path / "m.jsonl", world_size=1, global_batch=8, chief=True, events=None)
    r.epoch(1, 1, 1.0, 8.0, 1)
    assert "totalSteps" not in json.loads((tmp_path / "m.jsonl").read_text())  # unknown: left out


def test_a_pytorch_chiefs_writer_leaves_tensorflow_unloaded(tmp_path):
    """TensorFlow is installed here beside PyTorch, as in a venv with both: the PyTorch writer
    still goes through tensorboard's own stub, not an import of TensorFlow (3 CPU-seconds of
    every PyTorch chief's start on 2 cores), and TensorBoard reads what it wrote."""
    import subprocess
    import sys

    code = ("import sys; from trainop_trainer import events; w = events.open_writer('pytorch', sys.argv[1]); "
            "w.scalars(1, {'train/loss': 0.5}); w.close(); "
            "print('tensorflow' in sys.modules, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "True"], out.stdout + out.stderr
    assert scalars(tmp_path / events.FOLDER) == {"train/loss": [(1, 0.5)]}
