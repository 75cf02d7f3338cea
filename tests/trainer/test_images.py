"""The trainer images' build inputs: hadolint on the Dockerfile, and the one install script that
the Dockerfile, CI and the GPU benchmark share."""

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.trainer

IMAGES = Path(__file__).resolve().parents[2] / "trainer_images"
HADOLINT = Path(sys.executable).parent / "hadolint"


def test_dockerfile_passes_hadolint():
    proc = subprocess.run([str(HADOLINT), "--failure-threshold", "info", str(IMAGES / "Dockerfile")],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_dockerfile_targets_one_image_per_framework():
    targets = [line.split()[-1] for line in (IMAGES / "Dockerfile").read_text().splitlines()
               if line.startswith("FROM ")]
    assert targets[1:] == ["pytorch", "tensorflow", "keras"]


def test_install_script_is_a_no_op_when_everything_is_installed():
    # The environment these tests run in was installed by this script: a second run only checks.
    proc = subprocess.run(["bash", str(IMAGES / "install.sh")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == "" and proc.stdout == ""


def test_install_script_refuses_unknown_steps():
    proc = subprocess.run(["bash", str(IMAGES / "install.sh"), "everything"], capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.strip() == "install.sh: unknown step 'everything': use all, system, frameworks, horovod, trainer or pins"
