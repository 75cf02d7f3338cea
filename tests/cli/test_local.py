"""`trainop run JOB.yaml --local`: bad input is refused in one line before anything runs; the
plan is the operator's own render mapped onto this machine; the gang stops on the first failure
and on the job's deadline. (Real training runs are in tests/examples/test_examples.py.)"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from trainop import cli, config, localrun, spec
from trainop.render import dtj

REPO = Path(__file__).resolve().parents[2]


def trainop(*args: str, state: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ, TRAINOP_STATE=str(state))
    return subprocess.run([sys.executable, "-m", "trainop", *args], capture_output=True, text=True,
                          env=env, timeout=timeout, cwd=REPO)


def write(tmp_path: Path, doc, name: str = "job.yaml") -> Path:
    path = tmp_path / name
    path.write_text(doc if isinstance(doc, str) else yaml.safe_dump_all(doc if isinstance(doc, list) else [doc]))
    return path


def job(name: str = "j", **spec_) -> dict:
    return {"apiVersion": "trainop.io/v1alpha1", "kind": "DistributedTrainingJob",
            "metadata": {"name": name}, "spec": spec_}


@pytest.mark.parametrize("content,words", [
    (None, ["nope.yaml: no such file"]),
    ("a: [1, 2\n", ["not valid YAML at line"]),
    ("", ["no manifest in the file"]),
    ({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "x"}},
     ["ConfigMap (v1) is not a DistributedTrainingJob"]),
    ({"apiVersion": "trainop.io/v1alpha1", "kind": "DataStage", "metadata": {"name": "x"}, "spec": {}},
     ["DataStage (trainop.io/v1alpha1) is not a DistributedTrainingJob"]),
    (job(workers=0), ["spec.workers: 0 is less than the minimum of 1"]),
    (job(framework="mxnet"), ["spec.framework: 'mxnet' is not one of"]),
    (job(training={"batchSize": "big"}), ["spec.training.batchSize: 'big' is not of type 'integer'"]),
    ({"apiVersion": "trainop.io/v1alpha1", "kind": "DistributedTrainingJob", "spec": {}},
     ["metadata.name: required"]),
    (job(framework="tensorflow", launcher="torchrun"), ["spec.launcher: torchrun runs PyTorch only"]),
    (job(nodePool={"name": "tpu"}), ["spec.nodePool.name: node pool 'tpu' does not exist"]),
    ([job("a"), job("b")], ["holds 2 jobs; give one DistributedTrainingJob per file"]),
])
def test_bad_input_exits_non_zero_with_one_line_naming_the_problem(tmp_path, monkeypatch, capsys, content, words):
    monkeypatch.setenv("TRAINOP_STATE", str(tmp_path / "state"))
    path = tmp_path / "nope.yaml" if content is None else write(tmp_path, content)
    assert cli.main(["run", str(path), "--local"]) == 2
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("trainop run: "), err
    for word in words:
        assert word in lines[0]
    assert out == ""
    assert not (tmp_path / "state" / "runs").exists()  # nothing started, no run folder


def test_local_flag_is_required(tmp_path):
    result = trainop("run", str(REPO / "examples/pytorch-horovod-synthetic.yaml"), state=tmp_path)
    assert result.returncode == 2 and "--local" in result.stderr


# ---- the plan: the operator's render, localized -----------------------------------------------
# the imagenet example uploads as `dataset-reader`, which its admin lists
CFG = config.from_dict({"blob": {"allowedServiceAccounts": ["dataset-reader"]}})


def parse(body: dict):
    return spec.parse(body, CFG)


def example(name: str):
    return parse(yaml.safe_load((REPO / "examples" / name).read_text()))


def test_mpi_plan_runs_the_rendered_launcher_script_over_a_local_hostfile(tmp_path):
    j = example("pytorch-horovod-synthetic.yaml")
    plan = localrun.plan(j, localrun.Options(cpus=2), tmp_path, rdzv_port=1234)
    assert list(plan.scripts) == ["launcher"]
    script = plan.scripts["launcher"]
    conf = f"{tmp_path}/etc-trainop/mpi"
    # The operator's own script, with only the pod's paths and host names mapped.
    rendered = dtj.launcher_script(plan.job).replace(dtj.CONF_DIR, conf).replace(dtj.OUTPUT_DIR, f"{tmp_path}/output")
    for i in range(plan.job.workers):
        rendered = rendered.replace(dtj.host(plan.job, i), "127.0.0.1")
    assert script == rendered
    assert f"--hostfile {conf}/hostfile" in script and "/etc/trainop" not in script
    assert plan.files["etc-trainop/mpi/hostfile"] == "127.0.0.1 slots=2\n"
    assert plan.files["etc-trainop/mpi/hosts"] == "127.0.0.1\n127.0.0.1\n"
    assert "-np 2" in script and "--backend horovod" in script
    assert f"--output-dir {tmp_path}/output --metrics-file {tmp_path}/output/metrics.jsonl" in script
    assert "--model resnet18 &\n" in script  # in the background: the shell takes a SIGTERM
    assert plan.env["NCCL_IB_DISABLE"] == "1" and plan.env["OMPI_MCA_btl"] == "self,vader,tcp"
    assert plan.env["TRAINOP_JOB_NAME"] == "resnet50-horovod"
    assert plan.env["PATH"].startswith(str(Path(sys.executable).parent))
    assert plan.trainer
    # Horovod's negotiation cycle, lengthened for ranks that share a few cores; the job's own wins
    assert plan.env["HOROVOD_CYCLE_TIME"] == localrun.HOROVOD_CYCLE_TIME == "50"
    own = replace(j, env=({"name": "HOROVOD_CYCLE_TIME", "value": "5"},))
    assert localrun.plan(own, localrun.Options(cpus=2), tmp_path, rdzv_port=1234).env["HOROVOD_CYCLE_TIME"] == "5"


def test_reduction_is_listed_and_full_keeps_the_manifests_sizes(tmp_path):
    j = example("infiniband-pytorch-horovod.yaml")
    reduced = localrun.plan(j, localrun.Options(cpus=2), tmp_path, 1)
    assert reduced.notes == (
        "infiniband: none on this machine, so the TCP settings (NCCL_IB_DISABLE=1)",
        "ranks: 2 workers x 8 ranks -> 2 x 1",
        "model: ResNet-50 -> ResNet-18",
        "batch size per rank: 256 -> 8",
        "image size: 224 -> 64",
        "steps per epoch: 200 -> 5",
        "precision: bf16 -> fp32",
    )
    assert reduced.env["NCCL_IB_DISABLE"] == "1" and "UCX_TLS" not in reduced.env
    assert reduced.env.get("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS")) is not None
    full = localrun.plan(j, localrun.Options(full=True, cpus=2), tmp_path, 1)
    assert full.ranks == 16 and full.job.training == j.training
    assert "--model" not in full.scripts["launcher"] and "--batch-size 256" in full.scripts["launcher"]
    assert full.notes == ("infiniband: none on this machine, so the TCP settings (NCCL_IB_DISABLE=1)",)
    steps = localrun.plan(j, localrun.Options(epochs=1, steps_per_epoch=3, cpus=2), tmp_path, 1)
    assert "epochs: 2 -> 1" in steps.notes and "steps per epoch: 200 -> 3" in steps.notes


def test_torchrun_plan_runs_every_workers_rendered_script_with_a_local_rendezvous(tmp_path):
    plan = localrun.plan(example("pytorch-torchrun-synthetic.yaml"), localrun.Options(cpus=2), tmp_path, 4567)
    assert list(plan.scripts) == ["worker-0", "worker-1"]
    for script in plan.scripts.values():
        assert "--rdzv-endpoint=127.0.0.1:4567" in script
        assert "--nnodes=2 --nproc-per-node=1" in script
        assert ".svc" not in script and " /output" not in script
        assert f"--output-dir {tmp_path}/output" in script
    assert plan.files == {}
    assert "HOROVOD_CYCLE_TIME" not in plan.env  # no Horovod under torchrun


def test_data_stage_becomes_synthetic_or_the_local_folder(tmp_path):
    j = example("imagenet-pytorch-horovod.yaml")
    synthetic = localrun.plan(j, localrun.Options(cpus=2), tmp_path, 1)
    assert "--synthetic" in synthetic.scripts["launcher"]
    assert any("synthetic in place of DataStage 'imagenet'" in n for n in synthetic.notes)
    data = tmp_path / "data"
    local = localrun.plan(j, localrun.Options(data_dir=data, cpus=2), tmp_path, 1)
    assert f"--data-dir {data}" in local.scripts["launcher"]


def test_remap_rewrites_whole_paths_only():
    text = "a /data b /data/x c=/data d /database '/data'"
    assert localrun._remap(text, {"/data": "/L"}) == "a /L b /L/x c=/L d /database '/L'"


def test_metric_lines_are_parsed_and_others_ignored():
    assert localrun.parse_report('{"epoch": 1, "step": 3, "loss": 1.0, "imagesPerSec": 9.5}\n')["step"] == 3
    for line in ("Total images/sec: 4.8", "{not json", '{"other": 1}', "[1, 2]"):
        assert localrun.parse_report(line) is None


# ---- running: gang semantics, deadline, environment -------------------------------------------
def test_rank_environment_is_the_rendered_one(tmp_path):
    body = job("envjob", launcher="mpi", workers=2, env=[{"name": "MY_SETTING", "value": "42"}],
               command=["sh", "-c", 'echo "rank=$OMPI_COMM_WORLD_RANK ib=$NCCL_IB_DISABLE job=$TRAINOP_JOB_NAME my=$MY_SETTING"'])
    result = trainop("run", str(write(tmp_path, body)), "--local", "-v", state=tmp_path / "state")
    assert result.returncode == 0, result.stderr
    for rank in (0, 1):
        assert f"rank={rank} ib=1 job=envjob my=42" in result.stdout
    assert "spec.command/args: run as written" in result.stdout
    run_dir = tmp_path / "state/runs/envjob/1"
    assert "rank=1" in (run_dir / "train.log").read_text()
    assert (run_dir / "launcher.sh").read_text().startswith("set -eu")


@pytest.mark.parametrize("launcher", ["mpi", "torchrun"])
def test_one_failing_rank_stops_the_gang_and_names_the_process(tmp_path, launcher):
    rank = "$OMPI_COMM_WORLD_RANK" if launcher == "mpi" else "$RANK"
    body = job("crash", launcher=launcher, workers=2,
               command=["sh", "-c", f'if [ "{rank}" = 1 ]; then echo dying; exit 3; fi; sleep 300'])
    start = time.monotonic()
    result = trainop("run", str(write(tmp_path, body)), "--local", state=tmp_path / "state")
    assert time.monotonic() - start < 90
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()[-1]
    process = "launcher" if launcher == "mpi" else "worker-1"
    assert last.startswith(f"trainop run: crash failed: {process} exited with code"), result.stderr
    assert "last lines of the log:" in result.stderr
    assert "dying" in (tmp_path / "state/runs/crash/1/train.log").read_text()


def test_active_deadline_stops_the_job(tmp_path):
    body = job("slow", launcher="torchrun", command=["sleep", "300"], runPolicy={"activeDeadlineSeconds": 2})
    start = time.monotonic()
    result = trainop("run", str(write(tmp_path, body)), "--local", state=tmp_path / "state")
    assert time.monotonic() - start < 60
    assert result.returncode == 1
    assert "spec.runPolicy.activeDeadlineSeconds (2s) exceeded" in result.stderr.splitlines()[-1]


def test_missing_launcher_tool_is_named(tmp_path):
    body = job("nompi", launcher="mpi", command=["true"])
    env_path = tmp_path / "bin"
    env_path.mkdir()
    result = subprocess.run([sys.executable, "-m", "trainop", "run", str(write(tmp_path, body)), "--local"],
                            capture_output=True, text=True, cwd=REPO, timeout=60,
                            env=dict(os.environ, PATH=str(env_path), TRAINOP_STATE=str(tmp_path / "s")))
    if (Path(sys.executable).parent / "mpirun").exists():
        pytest.skip("this interpreter's folder holds an mpirun")
    assert result.returncode == 1
    assert result.stderr.strip() == ("trainop run: spec.launcher mpi: mpirun is not installed; "
                                     "run scripts/bootstrap.sh demo (or trainer_images/install.sh)")
