"""2-rank training on CPU for every framework and launcher: the acceptance runs of issue 4.

Each (launcher, framework, backend) trains once (tests/trainer/conftest.py memoizes the run) and
four tests read it: ranks hold identical parameters (what catches silent non-averaging), the
learnable synthetic task's loss decreases, checkpoints/model/metrics are written, and the
reported images/sec agrees with the time the run took.
"""

import json
import re

import pytest

from tests.trainer.conftest import TINY

pytestmark = pytest.mark.trainer

LAUNCHES = [
    ("mpirun", "horovod"),
    ("mpirun", "native"),
    ("torchrun", "native"),
]
FRAMEWORKS = ["pytorch", "tensorflow", "keras"]
CASES = [pytest.param((launcher, fw, backend), id=f"{fw}-{launcher}-{backend}")
         for fw in FRAMEWORKS for launcher, backend in LAUNCHES]
EPOCHS = int(TINY[TINY.index("--epochs") + 1])
STEPS = int(TINY[TINY.index("--steps-per-epoch") + 1])
BATCH = int(TINY[TINY.index("--batch-size") + 1])
CONTRACT_KEYS = {"epoch", "step", "loss", "imagesPerSec", "imagesPerSecPerGPU", "stepTime", "worldSize", "final",
                 "totalSteps", "time"}


@pytest.fixture
def run(trainer_runs, request):
    launcher, framework, backend = request.param
    result = trainer_runs(launcher, framework, backend)
    assert result.returncode == 0, result.explain()
    return result


def assert_identical(digests: dict[int, str], ranks: int) -> None:
    """Every rank reported a digest and all are equal (exact bytes of every trainable parameter)."""
    assert sorted(digests) == list(range(ranks)), digests
    assert len(set(digests.values())) == 1, f"ranks diverged: {digests}"


@pytest.mark.parametrize("run", CASES, indirect=True)
def test_ranks_hold_identical_parameters(run):
    assert_identical(run.digests, 2)


@pytest.mark.parametrize("run", CASES, indirect=True)
def test_loss_decreases(run):
    epochs = [r for r in run.records if not r["final"]]
    assert [r["epoch"] for r in epochs] == list(range(1, EPOCHS + 1))
    assert epochs[-1]["loss"] < 0.8 * epochs[0]["loss"], epochs


@pytest.mark.parametrize("run", CASES, indirect=True)
def test_checkpoints_model_and_metrics_written(run):
    out = run.output_dir
    names = {p.name for p in out.iterdir()}
    checkpoints = {n for n in names if n.startswith("checkpoint-epoch")}
    assert len(checkpoints) == EPOCHS, names
    assert names & {"model.pt", "model.keras"}, names
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert metrics == run.records  # rank 0 alone writes: the file equals what stdout showed
    for rec in metrics:
        assert set(rec) == CONTRACT_KEYS
        assert rec["worldSize"] == 2
        assert rec["imagesPerSecPerGPU"] == pytest.approx(rec["imagesPerSec"] / 2, abs=0.01)
        assert rec["totalSteps"] == EPOCHS * STEPS
    assert [r["final"] for r in metrics] == [False] * EPOCHS + [True]
    assert [r["time"] for r in metrics] == sorted(r["time"] for r in metrics)
    # The chief alone writes TensorBoard events (one file), beside the checkpoints, so they ship with them.
    assert len(list((out / "tensorboard").glob("events.out.tfevents.*"))) == 1


@pytest.mark.parametrize("run", CASES, indirect=True)
def test_images_per_sec_consistent_with_wall_time(run):
    epoch_lines = [(t, rec) for t, line in run.lines if line.startswith("{")
                   for rec in [json.loads(line)] if not rec["final"]]
    global_batch = 2 * BATCH
    for (t0, _), (t1, rec) in zip(epoch_lines, epoch_lines[1:]):
        # Epoch N+1 was timed strictly between the lines of epochs N and N+1.
        implied = STEPS * global_batch / rec["imagesPerSec"]
        interval = t1 - t0
        assert implied <= interval * 1.05 + 0.05, (implied, interval)
        assert implied >= 0.2 * interval, (implied, interval)
        assert rec["stepTime"] == pytest.approx(implied / STEPS, rel=0.01)
    final = run.records[-1]
    total = re.search(r"^Total images/sec: ([\d.]+)$", "\n".join(text for _, text in run.lines), re.M)
    assert total and float(total.group(1)) == pytest.approx(final["imagesPerSec"], abs=0.06)
    # The whole run (start-up included) cannot have been faster than the training it reports.
    assert EPOCHS * STEPS * global_batch / run.wall <= final["imagesPerSec"]
