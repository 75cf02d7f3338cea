"""The trainer's checkpoints (trainop_trainer/checkpoint.py): atomic folders, the newest complete
one, and a save on SIGTERM that every rank agrees on (2 real ranks under torchrun, CPU)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.trainer.conftest import TINY, base_env, free_port_block, launch_command
from trainop_trainer import checkpoint


def put(data: bytes, path: Path) -> None:
    path.write_bytes(data)



def sigterm_once_training(proc: subprocess.Popen) -> str:
    """SIGTERM at the first epoch report (training under way); its whole output once it ended."""
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("{"):
            break
    proc.send_signal(signal.SIGTERM)
    rest, _ = proc.communicate(timeout=120)
    return "".join(lines) + rest

def test_atomic_folders_newest_complete_and_pruning(tmp_path):
    root = tmp_path / "ck"
    for step in (2, 4, 6):
        checkpoint.write_atomic(root / "attempt-0", step, {"state.pt": b"x" * step}, {}, save=put)
    (root / "attempt-0" / ".step-8.tmp").mkdir()  # a crash mid-save
    (root / "attempt-1" / "step-9").mkdir(parents=True)  # no COMPLETE: not a checkpoint
    assert sorted(p.name for p in (root / "attempt-0").iterdir()) == [".step-8.tmp", "step-4", "step-6"]
    assert checkpoint.latest(root) == root / "attempt-0" / "step-6"
    marker = json.loads((root / "attempt-0" / "step-6" / "COMPLETE").read_text())
    assert marker["step"] == 6 and marker["files"] == ["state.pt"]
    checkpoint.write_atomic(root / "attempt-1", 6, {"state.pt": b"y"}, {}, save=put)
    assert checkpoint.latest(root) == root / "attempt-1" / "step-6"  # a tie: the later attempt
    assert checkpoint.resolve("latest", root / "attempt-2") == root / "attempt-1" / "step-6"
    with pytest.raises(checkpoint.CheckpointError, match="not a complete checkpoint"):
        checkpoint.resolve(str(root / "attempt-1" / "step-9"), None)


@pytest.mark.trainer
@pytest.mark.timeout(300)
def test_sigterm_saves_at_the_next_step_on_every_rank_then_exits(tmp_path):
    """torchrun forwards SIGTERM to its ranks (a pod's deletion reaches them so): both save
    together at one step boundary, and the run ends with 143."""
    out, ck = tmp_path / "out", tmp_path / "ck" / "attempt-0"
    args = ["--framework", "pytorch", "--backend", "native",
            *[a if a != "3" else "50" for a in TINY],  # 50 epochs: SIGTERM comes long before the end
            "--output-dir", str(out), "--checkpoint-dir", str(ck), "--checkpoint-every", "1000"]
    proc = subprocess.Popen(launch_command("torchrun", 2, args, free_port_block()), env=base_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path)
    text = sigterm_once_training(proc)
    assert proc.returncode != 0, text
    saved = checkpoint.latest(ck.parent)
    assert saved is not None, text
    step = checkpoint.step_of(saved)
    assert 4 <= step < 200, text  # after the first epoch (4 steps), before the end
    assert f"checkpoint step {step} saved" in text
    assert text.count("SIGTERM: saving a checkpoint") >= 1


def test_a_checkpoint_of_another_framework_or_world_size_is_refused_naming_it(tmp_path):
    torch_saved = checkpoint.write_atomic(tmp_path / "a", 4, {"state.pt": b"x"}, {"worldSize": 2}, save=put)
    tf_saved = checkpoint.write_atomic(tmp_path / "b", 4, {"state.index": b"x", "state.data-00000-of-00001": b"y"},
                                       {"worldSize": 2}, save=put)
    assert json.loads((tf_saved / "COMPLETE").read_text())["files"] == ["state.data-00000-of-00001", "state.index"]
    with pytest.raises(checkpoint.CheckpointError, match=r"no state.index \(saved by PyTorch\?\)"):
        checkpoint.tf_load(torch_saved, 2, state=None)
    with pytest.raises(checkpoint.CheckpointError, match=r"no state.pt \(saved by TensorFlow/Keras\?\)"):
        checkpoint.torch_load(tf_saved, 2)
    with pytest.raises(checkpoint.CheckpointError, match="saved by 2 ranks, this run has 4"):
        checkpoint.tf_load(tf_saved, 4, state=None)


@pytest.mark.trainer
@pytest.mark.timeout(400)
@pytest.mark.parametrize("framework", ["tensorflow", "keras"])
def test_tensorflow_sigterm_saves_a_state_that_the_next_run_resumes_from(tmp_path, framework):
    """One TensorFlow process (the custom loop, or model.fit from a callback): SIGTERM saves a
    tf.train.Checkpoint at the next step and exits 143; `--resume-from latest` then restores it
    and continues at that step (the multi-rank, bitwise case: tests/cli/test_local_resume.py)."""
    common = ["--framework", framework, *[a if a != "3" else "50" for a in TINY],
              "--output-dir", str(tmp_path / "out")]
    proc = subprocess.Popen(launch_command("python", 1, common + ["--checkpoint-dir", str(tmp_path / "ck" / "attempt-0"),
                                                                  "--checkpoint-every", "1000"], 0),
                            env=base_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path)
    text = sigterm_once_training(proc)
    assert proc.returncode == 143, text
    saved = checkpoint.latest(tmp_path / "ck")
    assert saved is not None, text
    step = checkpoint.step_of(saved)
    assert 4 <= step < 200 and f"checkpoint step {step} saved" in text, text
    marker = json.loads((saved / checkpoint.MARKER).read_text())
    assert marker["files"] == ["state.data-00000-of-00001", "state.index"] and marker["worldSize"] == 1

    epochs = str(step // 4 + 2)  # one epoch more than the saved step's
    resumed = subprocess.run(launch_command("python", 1, [*common, "--epochs", epochs, "--checkpoint-dir",
                                                          str(tmp_path / "ck" / "attempt-1"), "--resume-from", "latest"],
                                            0),
                             env=base_env(), capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resuming from {saved} at step {step}" in resumed.stderr
    final = [json.loads(line) for line in resumed.stdout.splitlines() if line.startswith("{")][-1]
    assert (final["final"], final["step"]) == (True, int(epochs) * 4)


def test_a_run_resumed_at_its_last_step_ends_at_once_with_its_final_report(tmp_path):
    """The last periodic checkpoint can be the last step (the gang failed after it): the next
    attempt trains nothing and reports final, instead of failing again."""
    from trainop_trainer import report

    reporter = report.Reporter(tmp_path / "m.jsonl", 2, 16, chief=True)
    reporter.final(3, 12, 0.0)
    line = json.loads((tmp_path / "m.jsonl").read_text())
    assert (line["final"], line["step"], line["imagesPerSec"]) == (True, 12, 0.0)


def test_a_rank_that_reaches_no_step_after_sigterm_still_ends(tmp_path):
    """Blocked (here: sleeping) where no step boundary comes: SIGTERM's default end, deferred."""
    import sys

    code = ("import os, signal, time; from trainop_trainer import checkpoint; "
            "checkpoint.StopFlag(deadline=0.5).install(); os.kill(os.getpid(), signal.SIGTERM); time.sleep(60)")
    start = time.monotonic()
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert result.returncode == 143, result.stderr
    assert time.monotonic() - start < 20
    assert "exiting without a checkpoint" in result.stderr


def test_a_save_under_way_is_not_cut_short_by_the_stop_deadline():
    """The deadline is for reaching a step boundary; once the gang agreed to stop there
    (`reached`), a slow save takes what it takes: only the pod's grace period, sized from the
    measured saves, ends it (tests/cli/test_local_grace.py)."""
    code = ("import os, signal, time; from trainop_trainer import checkpoint; "
            "flag = checkpoint.StopFlag(deadline=0.3); flag.install(); os.kill(os.getpid(), signal.SIGTERM); "
            "flag.reached(); time.sleep(1.5); print('saved')")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert (result.returncode, result.stdout) == (0, "saved\n"), result.stderr
    assert "exiting without a checkpoint" not in result.stderr


@pytest.mark.parametrize("extra,message", [
    (["--resume-from", "{tmp}"], "--resume-from {tmp}: not a complete checkpoint (no COMPLETE file)"),
    (["--resume-from", "latest"], "--resume-from latest needs --checkpoint-dir"),
    (["--checkpoint-every", "-1"], "--checkpoint-every must be 0 or more, got -1"),
])
def test_bad_checkpoint_options_are_refused_naming_the_option(tmp_path, extra, message):
    from trainop_trainer import cli, world

    args = ["--framework", "pytorch", "--synthetic", "--batch-size", "8", "--output-dir", str(tmp_path / "o")]
    with pytest.raises(cli.ConfigError) as exc:
        cli.parse(args + [a.format(tmp=tmp_path) for a in extra], world.detect({}))
    assert message.format(tmp=tmp_path) in str(exc.value)


MPI_RANK0_OF_2 = {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "0",
                  "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}


@pytest.mark.parametrize("framework", ["tensorflow", "keras"])
def test_tensorflow_checkpoints_need_horovod_on_several_ranks(tmp_path, framework):
    """TF/Keras save and resume under Horovod (or alone); MultiWorkerMirroredStrategy's saving
    runs collectives on every worker, which the trainer does not do: refused naming the flags."""
    from trainop_trainer import cli, world

    args = ["--framework", framework, "--synthetic", "--batch-size", "8", "--output-dir", str(tmp_path / "o"),
            "--checkpoint-dir", str(tmp_path / "ck" / "attempt-0")]
    alone = cli.parse(args + ["--resume-from", "latest"], world.detect({}))
    assert (alone.checkpoint_dir, alone.resume_from) == (tmp_path / "ck" / "attempt-0", "latest")
    with pytest.raises(cli.ConfigError) as exc:
        cli.parse(args + ["--backend", "native"], world.detect(MPI_RANK0_OF_2))
    assert f"--checkpoint-dir/--resume-from with --framework {framework} on 2 ranks needs --backend horovod" \
        in str(exc.value)


def test_checkpoint_settings_default_to_what_the_operator_renders(tmp_path, monkeypatch):
    from trainop_trainer import cli, world

    monkeypatch.setenv("TRAINOP_CHECKPOINT_DIR", str(tmp_path / "attempt-2"))
    monkeypatch.setenv("TRAINOP_CHECKPOINT_EVERY", "7")
    monkeypatch.setenv("TRAINOP_RESUME_FROM", "")  # a first attempt: rendered, empty
    cfg = cli.parse(["--framework", "pytorch", "--synthetic", "--batch-size", "8", "--output-dir", str(tmp_path)],
                    world.detect({}))
    assert (cfg.checkpoint_dir, cfg.checkpoint_every, cfg.resume_from) == (tmp_path / "attempt-2", 7, None)


@pytest.mark.trainer
@pytest.mark.timeout(300)
@pytest.mark.parametrize("framework", ["tensorflow", "keras"])
def test_tensorflow_on_an_image_folder_resumed_mid_epoch_ends_bitwise_equal(tmp_path, image_folder, framework):
    """Folder data: the tf.data pipeline of a resumed run starts its BatchPlan at the saved step
    (24 images, batch 4: 6 steps an epoch; step 8 is inside epoch 2), and the run ends with the
    parameters of the uninterrupted one (one process, TF_DETERMINISTIC_OPS=1)."""
    import re

    env = dict(base_env(), TF_DETERMINISTIC_OPS="1")
    common = ["--framework", framework, "--data-dir", str(image_folder), "--image-size", "32", "--model", "resnet18",
              "--batch-size", "4", "--epochs", "2", "--warmup-epochs", "1", "--base-lr", "0.002",
              "--checkpoint-every", "4"]

    def train(tag: str, *extra: str) -> str:
        args = [*common, "--output-dir", str(tmp_path / tag), "--checkpoint-dir", str(tmp_path / "ck" / tag), *extra]
        done = subprocess.run(launch_command("python", 1, args, 0), env=env, capture_output=True, text=True,
                              cwd=tmp_path, timeout=240)
        assert done.returncode == 0, done.stderr[-3000:]
        return done.stderr

    plain = train("attempt-0")
    saved = tmp_path / "ck" / "attempt-0" / "step-8"
    assert checkpoint.is_complete(saved), plain[-3000:]
    resumed = train("attempt-1", "--resume-from", str(saved))
    assert f"resuming from {saved} at step 8" in resumed
    digests = [re.findall(r"parameter sha256 ([0-9a-f]{64})", text) for text in (plain, resumed)]
    assert len(digests[0]) == 1 and digests[0] == digests[1], digests


class RunsCode:
    """A pickle that runs code when loaded (what `__reduce__` allows): writes `marker`."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').write('code ran')",)


@pytest.mark.trainer
def test_a_checkpoint_that_runs_code_on_load_is_refused_and_runs_nothing(tmp_path):
    """Issue 22 M3, the attack: another job that can write the checkpoint folder (a shared claim,
    a Blob container) leaves a complete step folder whose state.pt runs code on load. The real
    trainer resuming from `latest` refuses it, naming the file, and the code never runs."""
    import torch

    marker, ck = tmp_path / "marker", tmp_path / "ck"
    evil = {"step": 4, "epoch": 1, "worldSize": 1, "model": RunsCode(marker)}
    saved = checkpoint.write_atomic(ck / "attempt-0", 4, {"state.pt": evil}, {"worldSize": 1}, save=torch.save)
    run = subprocess.run([sys.executable, "-m", "trainop_trainer", "--framework", "pytorch", "--backend", "native",
                          *TINY, "--output-dir", str(tmp_path / "out"), "--checkpoint-dir", str(ck / "attempt-1"),
                          "--resume-from", "latest"], env=base_env(), capture_output=True, text=True, timeout=300,
                         cwd=tmp_path)
    assert run.returncode == 2, run.stderr[-3000:]
    assert f"trainop_trainer: error: {saved / 'state.pt'}: refused, it holds more than tensors and plain data" \
        in run.stderr
    assert not marker.exists()


@pytest.mark.trainer
def test_the_saved_state_loads_with_weights_only_and_restores_every_rng(tmp_path):
    """What torch_save writes is tensors and plain data: torch.load(weights_only=True) takes it,
    and the RNG states it restores draw what the saved ones drew."""
    import random

    import numpy as np
    import torch

    net = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    net(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    saved = checkpoint.torch_save(tmp_path / "attempt-0", 1, 0, 1, net, optimizer, [checkpoint.torch_rng_state()])
    draws = (torch.rand(3).tolist(), np.random.rand(3).tolist(), [random.random() for _ in range(3)])
    state = checkpoint.torch_load(saved, 1)
    checkpoint.set_torch_rng_state(state["rng"][0])
    assert (torch.rand(3).tolist(), np.random.rand(3).tolist(), [random.random() for _ in range(3)]) == draws
    assert torch.equal(state["model"]["weight"], net.state_dict()["weight"])
    assert torch.equal(state["optimizer"]["state"][0]["momentum_buffer"],
                       optimizer.state_dict()["state"][0]["momentum_buffer"])


def test_only_the_jobs_own_checkpoints_are_resumed_from(tmp_path):
    """Issue 22 M3: with a checkpoint folder set, --resume-from must name a folder under the
    checkpoint root or the operator's fetched copy, links resolved; `latest` follows no link."""
    root, other = tmp_path / "claim" / "job-1234abcd", tmp_path / "claim" / "other-job"
    foreign = checkpoint.write_atomic(other / "attempt-0", 9, {"state.pt": b"x"}, {}, save=put)
    own = checkpoint.write_atomic(root / "attempt-0", 4, {"state.pt": b"x"}, {}, save=put)
    here = root / "attempt-1"
    assert checkpoint.resolve(str(own), here) == own
    fetched = tmp_path / "fetched"
    copy = checkpoint.write_atomic(fetched, 4, {"state.pt": b"x"}, {}, save=put)
    assert checkpoint.resolve(str(copy), here, fetched=str(fetched)) == copy
    for path in (foreign, root / ".." / "other-job" / "attempt-0" / "step-9"):
        with pytest.raises(checkpoint.CheckpointError, match="not one of this job's own checkpoints"):
            checkpoint.resolve(str(path), here)
    (root / "attempt-0" / "step-99").symlink_to(foreign, target_is_directory=True)
    with pytest.raises(checkpoint.CheckpointError, match=f"resolves to {foreign}"):
        checkpoint.resolve(str(root / "attempt-0" / "step-99"), here)
    (root / "attempt-7").symlink_to(other / "attempt-0", target_is_directory=True)
    assert checkpoint.latest(root) == own  # neither step-99 nor attempt-7 (links) counts
    assert checkpoint.resolve(str(foreign), None) == foreign  # no checkpoint folder: a local run's own choice
    assert os.path.realpath(checkpoint.FETCHED) == checkpoint.FETCHED
