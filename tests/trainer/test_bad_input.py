"""Bad input, end to end: the real entry point exits non-zero with one clear line on stderr and
creates nothing (no output folder, no metrics), before any framework trains."""

import subprocess

import pytest

from tests.trainer.conftest import base_env, free_port_block, launch_command

pytestmark = pytest.mark.trainer


def _run(launcher: str, ranks: int, args: list[str], out):
    cmd = launch_command(launcher, ranks, [*args, "--output-dir", str(out)], free_port_block())
    return subprocess.run(cmd, capture_output=True, text=True, env=base_env(), timeout=120)


@pytest.mark.parametrize("args, message", [
    (["--framework", "mxnet", "--synthetic", "--batch-size", "2"],
     "argument --framework: invalid choice: 'mxnet' (choose from 'pytorch', 'tensorflow', 'keras')"),
    (["--framework", "pytorch", "--data-dir", "/nonexistent/imagenet", "--batch-size", "2"],
     "--data-dir /nonexistent/imagenet: no such directory; mount the data set there or pass --synthetic"),
    (["--framework", "pytorch", "--synthetic", "--batch-size", "2", "--loader-workers", "many"],
     "--loader-workers must be 'auto' or a number of processes (0: load in the rank's own process), got 'many'"),
    (["--framework", "pytorch", "--data-dir", "{folder}", "--batch-size", "2", "--read-mode", "sequential"],
     "--read-mode sequential needs .tar shards; a folder of files is read with --read-mode random"),
])
def test_one_line_and_nothing_created(args, message, tmp_path, image_folder):
    args = [a.format(folder=image_folder) for a in args]
    out = tmp_path / "out"
    proc = _run("single", 1, args, out)
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [f"trainop_trainer: error: {message}"]
    assert proc.stdout == ""
    assert not out.exists()


def test_world_size_must_divide_the_global_batch(tmp_path):
    out = tmp_path / "out"
    proc = _run("mpirun", 2, ["--framework", "pytorch", "--synthetic", "--global-batch-size", "5"], out)
    assert proc.returncode != 0
    expected = ("trainop_trainer: error: --global-batch-size 5 is not divisible by the world size 2; "
                "use a multiple of 2 or --batch-size per worker")
    ours = [line for line in proc.stderr.splitlines() if line.startswith("trainop_trainer")]
    assert ours == [expected] * 2  # each rank says it once; the rest is mpirun's own summary
    assert "Traceback" not in proc.stderr and proc.stdout == ""
    assert not out.exists()
