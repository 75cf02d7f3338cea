"""Elastic training, the trainer's half (issue 26, docs/elastic.md): a run resumed at another world
size continues the same training. Real ranks on CPU (torchrun with gloo; mpirun with Horovod),
real checkpoints on disk, the trainer's own CLI.

Every case trains 4 ranks -> checkpoint -> 2 ranks -> checkpoint -> 4 ranks against an
uninterrupted 4-rank run, all with TRAINOP_ELASTIC_MAX_WORLD=4 and --batch-size 2 (a global batch
of 8: at 2 ranks each rank accumulates 2 micro-batches per step) on a 34-image folder (4 steps an
epoch, the last 2 images of each epoch's order left out), 2 epochs, ResNet-18 in float64:

- U, the uninterrupted run, 4 ranks, steps 1-8, `--checkpoint-every 5`: its step-5 checkpoint is
  the first segment's ("4 ranks -> checkpoint"; what it trains after step 5 is not used);
- S2, 2 ranks resumed from U's step 5 (one step into epoch 2), `--checkpoint-every 7`: steps 6-8,
  its step-7 checkpoint is the second ("-> 2 ranks -> checkpoint");
- S3, 4 ranks resumed from S2's step 7: step 8 ("-> 4 ranks").
So epoch 2 is trained by three world sizes: steps 5 (4 ranks), 6-7 (2 ranks), 8 (4 ranks). Each
(framework, launcher) trains once; the three tests read the same runs (`chained`). Every rank
writes --sample-log: per step, the samples it trained on and its share of the step's loss.
"""

from __future__ import annotations

import io
import json
import subprocess
import zipfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from tests.trainer.conftest import BACKGROUND, base_env, free_port_block, launch_command, make_image_folder
from trainop_trainer import checkpoint, data, elastic

pytestmark = pytest.mark.trainer

MAX_WORLD, BATCH, IMAGES, EPOCHS = 4, 2, 34, 2
STEPS = IMAGES // (MAX_WORLD * BATCH)  # 4 a data epoch
FIRST, SECOND = 5, 7  # U's checkpoint (S2 resumes from it), S2's (S3 resumes from it)
CASES = [pytest.param(("pytorch", "torchrun", "native"), id="pytorch-ddp"),
         pytest.param(("pytorch", "mpirun", "horovod"), id="pytorch-horovod"),
         pytest.param(("tensorflow", "mpirun", "horovod"), id="tensorflow-horovod"),
         pytest.param(("keras", "mpirun", "horovod"), id="keras-horovod")]
# Loss of a step: the ranks' shares summed, against the uninterrupted run's. Parameters: see
# test_parameters_equal_an_uninterrupted_run.
LOSS_TOLERANCE = 1e-9  # relative
# Absolute. Measured here: PyTorch DDP (gloo) 7e-11; PyTorch, TensorFlow and Keras with Horovod 0
# (bitwise equal). See the test's docstring.
PARAMETER_TOLERANCE = 1e-8
RUN_TIMEOUT = 1200  # one segment; alone, the slowest (TensorFlow's U) takes about 40 s here


@dataclass
class Segment:
    ranks: int
    output: str  # stderr and stdout
    out: Path  # --output-dir
    log: list[dict]  # --sample-log lines
    returncode: int


def train(tmp: Path, name: str, case: tuple, ranks: int, images: Path, *extra: str) -> Segment:
    framework, launcher, backend = case
    out = tmp / name
    out.mkdir()
    args = ["--framework", framework, "--backend", backend, "--data-dir", str(images), "--image-size", "32",
            "--model", "resnet18", "--batch-size", str(BATCH), "--epochs", str(EPOCHS), "--warmup-epochs", "1",
            "--base-lr", "0.002", "--precision", "fp64", "--loader-workers", "0", "--report-seconds", "0",
            "--output-dir", str(out), "--sample-log", str(out / "samples.jsonl"), *extra]
    env = dict(base_env(), TRAINOP_ELASTIC_MAX_WORLD=str(MAX_WORLD), TF_DETERMINISTIC_OPS="1")
    # (at nice 19, the other tests' idle cores: RUN_TIMEOUT leaves room for their busy ones)
    done = BACKGROUND.run(launch_command(launcher, ranks, args, free_port_block()), RUN_TIMEOUT, env=env, cwd=out)
    log = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()] \
        if (out / "samples.jsonl").exists() else []
    return Segment(ranks, done.stderr + done.stdout, out, log, done.returncode)


@dataclass
class Chained:
    uninterrupted: Segment
    second: Segment  # 2 ranks from U's step FIRST
    third: Segment  # 4 ranks from S2's step SECOND

    def steps(self) -> dict[int, list[dict]]:
        """Step -> the sample-log lines of the chained run: U's up to FIRST, S2's to SECOND, S3's after."""
        out: dict[int, list[dict]] = {}
        for seg, first, last in ((self.uninterrupted, 1, FIRST), (self.second, FIRST + 1, SECOND),
                                 (self.third, SECOND + 1, EPOCHS * STEPS)):
            for line in seg.log:
                if first <= line["step"] <= last:
                    out.setdefault(line["step"], []).append(line)
        return out


def run_chain(case: tuple, images: Path, tmp: Path) -> Chained | str:
    """The case's three runs, or why they failed (its tests all fail with it; it is not run again)."""
    ck = tmp / "ck"
    tmp.mkdir()
    try:
        u = train(tmp, "u", case, 4, images, "--checkpoint-dir", str(ck / "attempt-0"),
                  "--checkpoint-every", str(FIRST))
        assert u.returncode == 0, u.output[-4000:]
        first = ck / "attempt-0" / f"step-{FIRST}"
        assert checkpoint.is_complete(first), u.output[-4000:]
        s2 = train(tmp, "s2", case, 2, images, "--checkpoint-dir", str(ck / "attempt-1"),
                   "--checkpoint-every", str(SECOND), "--resume-from", str(first))
        assert s2.returncode == 0, s2.output[-4000:]
        second = ck / "attempt-1" / f"step-{SECOND}"
        assert checkpoint.is_complete(second), s2.output[-4000:]
        s3 = train(tmp, "s3", case, 4, images, "--checkpoint-dir", str(ck / "attempt-2"), "--resume-from", str(second))
        assert s3.returncode == 0, s3.output[-4000:]
    except (AssertionError, subprocess.TimeoutExpired) as e:
        return f"the runs of {case} failed: {e}"
    return Chained(u, s2, s3)


def start_chains(cases: list[tuple], factory) -> None:
    """Every case's chain, in the background (tests/trainer/conftest.py's BACKGROUND): from the
    session's start, so that the tests below find them done."""
    root = factory.mktemp("elastic")
    images = make_image_folder(root / "images" / "train", classes=2, per_class=IMAGES // 2)
    for case in cases:
        BACKGROUND.submit(("elastic", case), run_chain, case, images, root / "-".join(case))


@pytest.fixture
def chained(request, tmp_path_factory) -> Chained:
    case = request.param
    if ("elastic", case) not in BACKGROUND.futures:  # collected without the conftest's hook
        start_chains([case], tmp_path_factory)
    runs = BACKGROUND.futures[("elastic", case)].result()
    if isinstance(runs, str):
        pytest.fail(runs)
    return runs


@pytest.mark.timeout(900)
@pytest.mark.parametrize("chained", CASES, indirect=True)
def test_the_samples_of_each_epoch_are_those_of_an_uninterrupted_run(chained):
    """Exact: in every step of the chained run the gang trained on the same set of samples as the
    uninterrupted run in that step (so per epoch too), no sample twice within an epoch, none of
    the epoch's skipped; each resize wrote its INFO line (old size -> new size, accumulation,
    position); the 2-rank segment accumulated 2 micro-batches per rank and step."""
    u, steps = chained.uninterrupted, chained.steps()
    assert sorted(steps) == list(range(1, EPOCHS * STEPS + 1))
    for step, lines in steps.items():
        ranks = 2 if FIRST < step <= SECOND else 4
        assert sorted(line["rank"] for line in lines) == list(range(ranks)), (step, lines)
        assert all(len(line["samples"]) == BATCH * MAX_WORLD // ranks for line in lines), (step, lines)
        ref = [line for line in u.log if line["step"] == step]
        assert Counter(i for line in lines for i in line["samples"]) == \
            Counter(i for line in ref for i in line["samples"]), step
    for epoch in range(1, EPOCHS + 1):
        seen = Counter(i for lines in steps.values() for line in lines if line["epoch"] == epoch
                       for i in line["samples"])
        assert max(seen.values()) == 1, seen  # none twice
        assert len(seen) == STEPS * BATCH * MAX_WORLD  # none of the epoch's skipped: all but the order's last 2
        assert set(seen) <= set(range(IMAGES))
    position = f"data position: step {FIRST}, epoch 2 sample {(FIRST - STEPS) * BATCH * MAX_WORLD} of 32"
    assert ("elastic resume: 4 ranks -> 2 ranks, 2 accumulation step(s) per optimizer step (global batch 8 = "
            f"2 x 2 ranks x 2), {position}") in chained.second.output
    assert "elastic resume: 2 ranks -> 4 ranks, 1 accumulation step(s)" in chained.third.output
    assert "elastic resume" not in u.output


@pytest.mark.timeout(900)
@pytest.mark.parametrize("chained", CASES, indirect=True)
def test_the_loss_curve_follows_the_uninterrupted_run(chained):
    """Every step's loss (the mean over the global batch: the ranks' shares summed) is within
    LOSS_TOLERANCE (relative) of the uninterrupted run's at that step. The micro-batches hold the
    same images at every size and the parameters stay equal to float64 rounding (next test), so
    the losses do too; a step that trained on other samples, or at another learning rate, misses
    by orders of magnitude more. The epoch reports' losses of the last segment, which ran all of
    epoch 2's last step only, are not compared: they average other steps."""
    u, steps = chained.uninterrupted, chained.steps()
    ours = {step: sum(line["loss"] for line in lines) for step, lines in steps.items()}
    ref = {step: sum(line["loss"] for line in u.log if line["step"] == step) for step in ours}
    assert sorted(ours) == list(range(1, EPOCHS * STEPS + 1))
    for step in ours:
        assert ours[step] == pytest.approx(ref[step], rel=LOSS_TOLERANCE), (step, ours, ref)
    assert len(set(np.round(list(ref.values()), 6))) > 1  # a curve, not a constant


def trainable_parameters(segment: Segment, framework: str) -> dict[str, np.ndarray]:
    """The final model's trainable parameters (rank 0 saves it): batch-norm running statistics
    left out (docs/elastic.md: not kept across sizes)."""
    if framework == "pytorch":
        import torch

        state = torch.load(segment.out / "model.pt", map_location="cpu", weights_only=True)
        return {k: v.numpy() for k, v in state.items()
                if not k.endswith(("running_mean", "running_var", "num_batches_tracked"))}
    import h5py

    with zipfile.ZipFile(segment.out / "model.keras") as z, \
            h5py.File(io.BytesIO(z.read("model.weights.h5"))) as f:
        out = {}
        f.visititems(lambda name, obj: out.__setitem__(name, obj[()]) if isinstance(obj, h5py.Dataset) else None)
    # BatchNormalization's vars: gamma, beta, moving mean, moving variance
    return {k: v for k, v in out.items() if k.startswith("layers/")
            and not ("batch_normalization" in k and k.endswith(("/2", "/3")))}


@pytest.mark.timeout(900)
@pytest.mark.parametrize("chained", CASES, indirect=True)
def test_parameters_equal_an_uninterrupted_run(chained, request):
    """With gradient accumulation, the chained run ends with the uninterrupted run's parameters,
    within PARAMETER_TOLERANCE (absolute) on every trainable parameter, in float64.

    Why not bitwise: a step's gradient is the mean of the same 4 micro-batch gradients at every
    size, and each micro-batch's gradient is bitwise the same (the same images in the same
    forward pass, batch-norm's batch statistics included; deterministic CPU kernels, one thread,
    TF_DETERMINISTIC_OPS); scaling by 1/2 and 1/4 is exact in binary. What differs is only the
    order of the additions: at 4 ranks the all-reduce adds 4 gradients, at 2 ranks each rank adds
    its 2 first, then the all-reduce adds 2 sums. Floating-point addition is not associative, so
    the steps at 2 ranks may differ by a rounding (~1e-16 relative in float64), which later steps
    carry on and amplify: ResNet-18's last stage sees 1x1 feature maps at 32 px, so its batch
    norm normalises 2 values per channel, a badly conditioned division. Measured: up to 7e-11
    with DDP (gloo adds in ring order), 0 with Horovod for PyTorch, TensorFlow and Keras (bitwise
    equal: its all-reduce of 4 adds in pairs, as the 2-rank run does). PARAMETER_TOLERANCE
    leaves room for other CPUs' kernels and stays far below what a wrong step makes: one sample
    more or less, or a gradient not divided by the accumulation, changes the step's update,
    and the updates of steps 6-8 move the median parameter tensor by ~1 (the control below, on
    PyTorch's checkpoint; TensorFlow's names its variables otherwise)."""
    framework = request.node.callspec.params["chained"][0]
    ours = trainable_parameters(chained.third, framework)
    ref = trainable_parameters(chained.uninterrupted, framework)
    assert sorted(ours) == sorted(ref) and len(ours) > 40
    worst = max(float(np.max(np.abs(ours[k] - ref[k]))) for k in ref)
    assert worst <= PARAMETER_TOLERANCE, worst
    assert all(v.dtype == np.float64 for v in ref.values())
    # control: the tolerance is small against what the steps at 2 ranks change
    at_first = checkpoint_parameters(chained, framework)
    if at_first is not None:
        moved = np.median([float(np.max(np.abs(ref[k] - at_first[k]))) for k in at_first])
        assert moved > 1e4 * PARAMETER_TOLERANCE, moved


def checkpoint_parameters(chained: Chained, framework: str) -> dict[str, np.ndarray] | None:
    """The model at U's step FIRST (PyTorch's state.pt; None for TensorFlow, whose checkpoint
    names differ from the saved model's)."""
    if framework != "pytorch":
        return None
    import torch

    path = chained.uninterrupted.out.parent / "ck" / "attempt-0" / f"step-{FIRST}" / checkpoint.STATE
    state = torch.load(path, map_location="cpu", weights_only=True)["model"]
    return {k: v.numpy() for k, v in state.items()
            if not k.endswith(("running_mean", "running_var", "num_batches_tracked"))}


# ---- the rules, without training ------------------------------------------------------------

def test_every_world_size_that_divides_the_maximum_trains_the_same_parts():
    """data.GlobalPlan: at 1, 2 and 4 ranks, step k of an epoch is samples [8k, 8k + 8) of one
    order of the set, and part j holds the same 2 samples whichever rank trains on it."""
    ds = data.DataSet(("a",), tuple(data.Sample(f"/x/{i}", 0, -1, 0) for i in range(IMAGES)))
    parts_at = {}
    for world in (1, 2, 4):
        e = elastic.Elastic(MAX_WORLD, world, BATCH)
        plans = [data.make_plan(ds, "random", r, world, BATCH, 42, e) for r in range(world)]
        assert {p.steps_per_epoch for p in plans} == {STEPS}
        parts = {}
        for r, plan in enumerate(plans):
            for n in range(EPOCHS * STEPS * e.accumulation):
                epoch, indices = plan.batch(n)
                step, a = divmod(n, e.accumulation)
                parts[(step, e.parts(r)[a])] = (epoch, tuple(indices))
        parts_at[world] = parts
    assert parts_at[1] == parts_at[2] == parts_at[4]
    order = data.make_plan(ds, "random", 0, 1, BATCH, 42, elastic.Elastic(MAX_WORLD, 1, BATCH)).epoch_order(1)
    assert [i for j in range(MAX_WORLD) for i in parts_at[2][(STEPS, j)][1]] == list(order[:8])
    assert sorted(order) == list(range(IMAGES))


@pytest.mark.parametrize("value,world,message", [
    ("4", 3, "3 ranks cannot share the global batch of 4 parts of --batch-size 2 (TRAINOP_ELASTIC_MAX_WORLD=4) "
             "evenly; run at one of [1, 2, 4] ranks"),
    ("2", 4, "TRAINOP_ELASTIC_MAX_WORLD=2, but this run has 4 ranks"),
    ("four", 1, "TRAINOP_ELASTIC_MAX_WORLD='four': not a positive number of ranks"),
])
def test_a_world_that_cannot_share_the_global_batch_is_refused_naming_the_sizes(value, world, message):
    with pytest.raises(elastic.ElasticError) as exc:
        elastic.from_env({elastic.ENV: value}, world, BATCH)
    assert message in str(exc.value)
    assert elastic.from_env({}, world, BATCH) is None  # not elastic: as before
    assert elastic.from_env({elastic.ENV: "8"}, 2, BATCH).accumulation == 4


def put(obj, path: Path) -> None:
    path.write_bytes(b"x")


def test_which_checkpoints_an_elastic_run_resumes_from(tmp_path):
    """check_resume, through tf_load (its COMPLETE): an elastic checkpoint at any size that shares
    the global batch; a checkpoint saved without elastic training only at its own size, with a
    WARNING; an elastic checkpoint never without elastic training, or at another global batch."""
    def saved(name: str, world: int, e: elastic.Elastic | None) -> Path:
        meta = {"worldSize": world} | ({"elastic": e.meta()} if e else {})
        return checkpoint.write_atomic(tmp_path / name, 4, {"state.index": None}, meta, save=put)

    four = elastic.Elastic(4, 4, 2)
    two = elastic.Elastic(4, 2, 2)
    el, plain = saved("el", 4, four), saved("plain", 2, None)

    class Restores:
        def read(self, path):
            return self

        def assert_existing_objects_matched(self):
            pass

    assert checkpoint.tf_load(el, 2, Restores(), two) == (4, None)
    assert checkpoint.tf_load(plain, 2, Restores(), None) == (2, None)  # as before
    _, warning = checkpoint.tf_load(plain, 2, Restores(), two)
    assert "WARNING" in warning and "saved without elastic training" in warning
    for path, world, e, message in [
        (plain, 4, four, "saved by 2 ranks without elastic training (its data position is per rank), this run "
                         "has 4; resume it with 2 ranks"),
        (el, 4, None, "saved by an elastic run (global batch 8 over up to 4 ranks); resume it with "
                      "TRAINOP_ELASTIC_MAX_WORLD=4"),
        (el, 2, elastic.Elastic(4, 2, 4), "saved with a global batch of 8 over up to 4 ranks, this run's is 16 "
                                          "over up to 4"),
        (plain, 4, None, "saved by 2 ranks, this run has 4"),
    ]:
        with pytest.raises(checkpoint.CheckpointError) as exc:
            checkpoint.tf_load(path, world, Restores(), e)
        assert message in str(exc.value)


def test_an_elastic_checkpoint_records_the_global_position(tmp_path):
    import torch

    net = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    e = elastic.Elastic(4, 2, 2)
    path = checkpoint.torch_save(tmp_path, 6, 2, 2, net, optimizer, [checkpoint.torch_rng_state()] * 2, e)
    marker = json.loads((path / checkpoint.MARKER).read_text())
    assert (marker["elastic"], marker["samples"], marker["worldSize"]) == (
        {"maxWorld": 4, "globalBatch": 8, "batchSize": 2}, 48, 2)
    state = checkpoint.torch_load(path, 4, elastic.Elastic(4, 4, 2))
    assert (state["worldSize"], state["warning"], state["elastic"]["globalBatch"]) == (2, None, 8)
    line = elastic.resume_line(2, elastic.Elastic(4, 4, 2), 6, 4)
    assert line == ("trainop_trainer: INFO: elastic resume: 2 ranks -> 4 ranks, 1 accumulation step(s) per "
                    "optimizer step (global batch 8 = 2 x 4 ranks x 1), data position: step 6, epoch 2 sample 16 "
                    "of 32")


def test_the_cli_reads_the_elastic_maximum_and_refuses_a_world_that_does_not_divide_it(tmp_path, monkeypatch):
    from trainop_trainer import cli, world

    args = ["--framework", "pytorch", "--synthetic", "--batch-size", "8", "--output-dir", str(tmp_path)]
    three = {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "3", "OMPI_COMM_WORLD_LOCAL_RANK": "0",
             "OMPI_COMM_WORLD_LOCAL_SIZE": "3"}
    monkeypatch.delenv(elastic.ENV, raising=False)
    assert cli.parse(args, world.detect({})).elastic is None
    monkeypatch.setenv(elastic.ENV, "4")
    cfg = cli.parse(args, world.detect({}))
    assert (cfg.elastic, cfg.scale(1)) == (elastic.Elastic(4, 1, 8), 4)
    with pytest.raises(cli.ConfigError, match="3 ranks cannot share the global batch of 4 parts"):
        cli.parse(args, world.detect(three))
    by_global = ["--framework", "pytorch", "--synthetic", "--global-batch-size", "32", "--output-dir", str(tmp_path)]
    assert cli.parse(by_global, world.detect({})).batch_size == 8  # 32 over the 4 parts, at any world size
