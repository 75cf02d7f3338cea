"""The real trainer under the rendered tee wrapper, with the log sidecar beside it, against Azurite:
what the container prints is what the archive holds, byte for byte, and the trainer's model and
metrics reach the output folder."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.azure.test_logship import Sidecar, blob_bytes
from trainop import logship
from trainop.render import logship as render

pytestmark = [pytest.mark.azurite, pytest.mark.trainer]

TINY = ["--framework", "pytorch", "--backend", "native", "--synthetic", "--image-size", "32", "--model", "resnet18",
        "--num-classes", "4", "--synthetic-batches", "2", "--batch-size", "2", "--epochs", "1",
        "--steps-per-epoch", "2", "--loader-workers", "1"]


def test_trainer_output_is_archived_byte_exact(azurite, tmp_path):
    container = azurite.new_container()
    run_dir, out = tmp_path / "run", tmp_path / "output"
    log = run_dir / "train.log"
    sidecar = Sidecar(azurite, container.container_name, tmp_path, {"pod.log": log},
                      args=("--output-dir", str(out), "--metrics-file", str(out / render.METRICS_NAME)))
    trainer = [sys.executable, "-m", "trainop_trainer", *TINY, "--output-dir", str(out),
               "--metrics-file", str(out / render.METRICS_NAME)]
    # The training container's command as rendered: the tee wrapper around the trainer.
    container_stdout = subprocess.run(["/bin/sh", "-c", render.TEE_SCRIPT, "trainop-tee", str(log), *trainer],
                                      stdout=subprocess.PIPE, timeout=600, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert container_stdout.returncode == 0, container_stdout.stdout.decode()[-3000:]
    # The training container has exited: the kubelet now stops the native sidecar.
    assert sidecar.stop() == 0, sidecar.output()

    assert blob_bytes(container) == container_stdout.stdout == log.read_bytes()
    final = logship.last_metrics(out / render.METRICS_NAME)
    assert final["final"] is True and final["worldSize"] == 1 and final["imagesPerSec"] > 0
    files = sorted(p for p in out.rglob("*") if p.is_file())
    for path in files:
        blob = container.get_blob_client(f"runs/job-a/0/output/{path.relative_to(out).as_posix()}")
        assert blob.get_blob_properties().size == path.stat().st_size, path.name
    assert {p.name for p in out.iterdir()} >= {"model.pt", render.METRICS_NAME, "tensorboard"}
    assert [p for p in files if p.parent.name == "tensorboard" and p.name.startswith("events.out.tfevents.")]
    assert blob_bytes(container, f"runs/job-a/0/output/{render.METRICS_NAME}") == (out / render.METRICS_NAME).read_bytes()
