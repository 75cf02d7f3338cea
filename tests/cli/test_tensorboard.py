"""`trainop tensorboard`: which blob names become files where, bad input, and the real TensorBoard
serving a local output folder (--dir) and `trainop run --local`'s runs (--local), read back through
its HTTP API. The Blob Storage path is tested against Azurite in tests/cluster/test_progress.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from tests.fixtures.azurite import free_port
from tests.fixtures.waiting import wait_until
from trainop.cli import tensorboard
from trainop_trainer import events, report


def test_only_an_attempts_event_folder_is_downloaded_and_never_outside_it():
    lp = tensorboard.local_path
    assert lp("0/output/tensorboard/events.out.tfevents.1.host", None) == Path("attempt-0/events.out.tfevents.1.host")
    assert lp("12/output/tensorboard/sub/events.out.tfevents.2.h", None) == Path("attempt-12/sub/events.out.tfevents.2.h")
    assert lp("1/output/tensorboard/events.out.tfevents.1.host", 0) is None  # --attempt 0
    for name in ("0/output/model.pt", "0/worker-0.log", "x/output/tensorboard/e", "0/output/tensorboard/../../e",
                 "0/output/tensorboard//e", "0/output/tensorboard/./e", "0/output/tensorboard/a\\..\\b",
                 # issue 22 L6: only event files; a projector config names files of this machine
                 "0/output/tensorboard/projector_config.pbtxt", "0/output/tensorboard/sub/projector_config.pbtxt",
                 "0/output/tensorboard/plugins/projector/projector_config.pbtxt", "0/output/tensorboard/e.tsv"):
        assert lp(name, None) is None, name


def run(*args: str, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "trainop", "tensorboard", *args], capture_output=True, text=True,
                          timeout=120, env=env)


def test_bad_input_is_one_line(tmp_path):
    for args, message in (([], "name a job (trainop tensorboard JOB) or a folder (--dir PATH)"),
                          (["--dir", str(tmp_path / "nope")], f"--dir {tmp_path / 'nope'}: not a folder"),
                          (["j", "--local"], f"no local run of j has event files under {tmp_path}/runs/j; "
                                             f"run it first: trainop run JOB.yaml --local")):
        shown = run(*args, env={**os.environ, "TRAINOP_STATE": str(tmp_path)})
        assert (shown.returncode, shown.stderr) == (1, f"trainop tensorboard: {message}\n")


def write_events(output_dir: Path) -> None:
    r = report.Reporter(output_dir / "metrics.jsonl", world_size=1, global_batch=8, chief=True, total_steps=2,
                        events=events.open_writer("pytorch", output_dir))
    r.epoch(1, 1, 2.0, total_images_per_sec=100.0, steps=1)
    r.epoch(2, 2, 1.0, total_images_per_sec=120.0, steps=1)
    r.final(2, 2, 1.0)


def projector_attack(tmp_path: Path) -> tuple[Path, bytes]:
    """A file of the user's (standing for ~/.ssh/id_rsa) and a projector config that names it
    (as the embedding's tensor and its metadata: both are read and served by the projector)."""
    secret = tmp_path / "home" / "id_rsa"
    secret.parent.mkdir(parents=True, exist_ok=True)
    secret.write_text("users-own-secret\tx\n")
    config = f'embeddings {{ tensor_name: "e" tensor_path: "{secret}" metadata_path: "{secret}" }}\n'
    return secret, config.encode()


def assert_no_projector(fetch, run: str, secret: Path) -> None:
    """Nothing of `secret` through any of the projector's routes; the plugin is not there."""
    for path in (f"/plugin/projector/metadata?run={run}&name=e", f"/plugin/projector/tensor?run={run}&name=e",
                 f"/plugin/projector/info?run={run}", "/plugin/projector/runs"):
        status, body = fetch(path)
        assert status == 404 and b"users-own-secret" not in body, (path, status, body[:200])
    assert "projector" not in json.loads(fetch("/plugins_listing")[1])


def serve_and_read(args: list[str], env: dict, log: Path, then=None) -> tuple[list, list]:
    port = free_port()
    with open(log, "w") as f:
        proc = subprocess.Popen([sys.executable, "-m", "trainop", "tensorboard", *args, "--port", str(port)],
                                stdout=f, stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{port}/data"

    def runs():
        assert proc.poll() is None, log.read_text()
        try:
            with urllib.request.urlopen(f"{base}/runs", timeout=10) as resp:
                return json.loads(resp.read()) or None
        except OSError:
            return None
    try:
        names = wait_until(runs, timeout=120, what="TensorBoard to list a run")
        query = urllib.parse.urlencode({"run": names[0], "tag": "throughput/images_per_sec"})
        with urllib.request.urlopen(f"{base}/plugin/scalars/scalars?{query}", timeout=10) as resp:
            points = json.loads(resp.read())
        if then:
            then(lambda path: _fetch(base + path), names[0])
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    return names, points


def _fetch(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


@pytest.mark.trainer
def test_serves_an_output_folder_and_local_runs(tmp_path):
    out = tmp_path / "claim"
    write_events(out)
    names, points = serve_and_read(["--dir", str(out)], dict(os.environ), tmp_path / "dir.log")
    assert names == ["tensorboard"] and [(p[1], p[2]) for p in points] == [(1, 100.0), (2, 120.0)]
    assert f"serving {out} at http://127.0.0.1:" in (tmp_path / "dir.log").read_text()

    state = tmp_path / "state"
    write_events(state / "runs" / "j" / "1" / "output")  # where `trainop run --local` puts run 1
    names, points = serve_and_read(["j", "--local"], {**os.environ, "TRAINOP_STATE": str(state)}, tmp_path / "l.log")
    assert names == ["1/output/tensorboard"] and [p[1] for p in points] == [1, 2]


@pytest.mark.trainer
def test_a_projector_config_in_a_served_folder_reads_no_local_file(tmp_path):
    """Issue 22 L6, the attack on --dir (a mounted output claim the job wrote): its projector
    config names a file of this machine; TensorBoard runs without the projector plugin."""
    out = tmp_path / "claim"
    write_events(out)
    secret, config = projector_attack(tmp_path)
    (out / "tensorboard" / "projector_config.pbtxt").write_bytes(config)
    names, points = serve_and_read(["--dir", str(out)], dict(os.environ), tmp_path / "dir.log",
                                   then=lambda fetch, run: assert_no_projector(fetch, run, secret))
    assert names == ["tensorboard"] and len(points) == 2
