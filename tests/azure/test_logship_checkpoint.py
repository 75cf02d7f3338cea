"""Checkpoints through Blob Storage (real Azurite, the real Azure SDK): the shipper uploads each
complete checkpoint the trainer wrote (trainop_trainer.checkpoint, its own atomic writer), COMPLETE
last, and reports it; the next attempt's init container (`python -m trainop.logship --fetch`, a
real process) brings it back, and the trainer accepts the copy as complete. The progress
ConfigMap patch is recorded here (the patch itself is the API server's, proven in
tests/cluster); everything else is real."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from trainop import blob, logship
from trainop_trainer import checkpoint

pytestmark = pytest.mark.azurite
DEST = "runs/job-a/0/output/checkpoints"


def write(path: Path, data: bytes) -> None:
    path.write_bytes(data)


def save(attempt_dir: Path, step: int) -> Path:
    payload = {"state.pt": os.urandom(3 * 1024 * 1024 + step), "rng.bin": os.urandom(100)}
    return checkpoint.write_atomic(attempt_dir, step, payload, {"epoch": 1, "worldSize": 2},
                                   save=lambda data, path: write(path, data))


@pytest.fixture
def container(azurite):
    return azurite.new_container()


def names(container) -> list[str]:
    return sorted(b.name for b in container.list_blobs(name_starts_with=DEST))


def test_each_complete_checkpoint_is_uploaded_then_reported_once(container, tmp_path):
    attempt_dir = tmp_path / "checkpoints" / "attempt-0"
    patches: list[dict] = []
    reporter = logship.CheckpointReporter(attempt_dir, patches.append, upload=(container, DEST))
    reporter.tick()
    assert patches == []  # nothing saved yet
    (attempt_dir / ".step-3.tmp").mkdir(parents=True)  # a save in progress is not a checkpoint
    reporter.tick()
    assert patches == [] and names(container) == []

    folder = save(attempt_dir, 3)
    reporter.tick()
    reporter.tick()  # the same one again: no second upload or report
    assert names(container) == [f"{DEST}/attempt-0/step-3/{n}" for n in ("COMPLETE", "rng.bin", "state.pt")]
    assert len(patches) == 1
    report = json.loads(patches[0]["data"]["checkpoint"])
    assert report["step"] == 3 and report["path"] == f"{DEST}/attempt-0/step-3"
    assert report["time"] == json.loads((folder / "COMPLETE").read_text())["time"]
    # COMPLETE went last: every other blob of the folder was there before it
    created = {b.name: b.creation_time for b in container.list_blobs(name_starts_with=DEST)}
    assert max(t for n, t in created.items() if not n.endswith("COMPLETE")) <= created[f"{DEST}/attempt-0/step-3/COMPLETE"]

    save(attempt_dir, 6)
    reporter.tick()
    assert json.loads(patches[-1]["data"]["checkpoint"])["step"] == 6


def fetch(azurite, container, src: str, to: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, blob.METHOD_ENV: "AccountKey", blob.SECRET_ENV: azurite.account_key}
    return subprocess.run([sys.executable, "-m", "trainop.logship", "--account-url", azurite.url(False),
                           "--container", container.container_name, "--fetch", src, "--fetch-to", str(to)],
                          env=env, capture_output=True, text=True, timeout=60)


def test_the_next_attempt_fetches_the_checkpoint_and_the_trainer_accepts_it(azurite, container, tmp_path):
    folder = save(tmp_path / "attempt-0", 5)
    logship.CheckpointReporter(folder.parent, lambda _: None, upload=(container, DEST)).tick()
    to = tmp_path / "resume" / "step-5"
    result = fetch(azurite, container, f"{DEST}/attempt-0/step-5", to)
    assert result.returncode == 0, result.stderr
    for name in ("state.pt", "rng.bin", "COMPLETE"):
        assert (to / name).read_bytes() == (folder / name).read_bytes()
    assert checkpoint.resolve(str(to), None) == to


def test_a_folder_without_complete_is_refused_and_nothing_is_written(azurite, container, tmp_path):
    container.get_blob_client(f"{DEST}/attempt-0/step-9/state.pt").upload_blob(b"half")
    to = tmp_path / "resume" / "step-9"
    result = fetch(azurite, container, f"{DEST}/attempt-0/step-9", to)
    assert result.returncode == 1
    assert "no COMPLETE blob there; not a complete checkpoint" in result.stderr
    assert azurite.account_key not in result.stderr
    assert not to.exists()
