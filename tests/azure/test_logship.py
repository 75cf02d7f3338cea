"""The log shipper as real processes (`python -m trainop.logship`) against the real Azurite."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fixtures.waiting import wait_until
from trainop import blob, logship

pytestmark = pytest.mark.azurite


class Sidecar:
    """One shipper process with the env a rendered pod gives it (auth method + secret by env)."""

    def __init__(self, azurite, container: str, tmp: Path, files: dict[str, Path], *, method="AccountKey",
                 secret=None, https=False, pod_uid="uid-1", interval=0.2, extra_env=None, args=()):
        self.log = tmp / f"sidecar-{random.randrange(1 << 30)}.log"
        secret = azurite.account_key if secret is None and method == "AccountKey" else secret
        env = {**os.environ, blob.METHOD_ENV: method, "POD_UID": pod_uid, **(extra_env or {})}
        if secret:
            env[blob.SECRET_ENV] = secret
        cmd = [sys.executable, "-m", "trainop.logship", "--account-url", azurite.url(https),
               "--container", container, "--dest", "runs/job-a/0", "--interval", str(interval), *args]
        for name, path in files.items():
            cmd += ["--file", f"{path}={name}"]
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)

    def stop(self, sig=signal.SIGTERM, timeout=60) -> int:
        # A pod's sidecar starts before its training container: signal it once it is running.
        wait_until(lambda: "shipping " in self.output() or self.proc.poll() is not None, timeout=30,
                   what="the sidecar to start")
        self.proc.send_signal(sig)
        return self.proc.wait(timeout=timeout)

    def output(self) -> str:
        return self.log.read_text()


def blob_bytes(container, name="runs/job-a/0/pod.log") -> bytes:
    from azure.core.exceptions import ResourceNotFoundError
    try:
        return container.get_blob_client(name).download_blob().readall()
    except ResourceNotFoundError:
        return b""


def lines(start: int, count: int) -> bytes:
    """Numbered lines of varying length, so a duplicated or lost range shows in a diff."""
    return b"".join(b"step %06d loss=%s\n" % (i, b"x" * (i % 97)) for i in range(start, start + count))


@pytest.fixture
def container(azurite):
    return azurite.new_container()


def test_lines_appear_within_seconds(azurite, container, tmp_path):
    log = tmp_path / "train.log"
    sidecar = Sidecar(azurite, container.container_name, tmp_path, {"pod.log": log})
    try:
        with open(log, "ab", buffering=0) as f:
            f.write(b"epoch 1 started\n")
            wait_until(lambda: blob_bytes(container) == b"epoch 1 started\n", timeout=10, what="first line in the blob")
            f.write(b"epoch 1 done\n")
            wait_until(lambda: blob_bytes(container).endswith(b"epoch 1 done\n"), timeout=10, what="second line in the blob")
    finally:
        assert sidecar.stop() == 0, sidecar.output()
    assert blob_bytes(container) == b"epoch 1 started\nepoch 1 done\n"


def test_sigterm_flushes_every_byte(azurite, container, tmp_path):
    # A shipping interval far beyond the test: what is written after the sidecar's first pass over
    # pod.log (done once it moves on to metrics.jsonl) only the drain on SIGTERM can ship.
    log = tmp_path / "train.log"
    metrics = tmp_path / "metrics.jsonl"
    sidecar = Sidecar(azurite, container.container_name, tmp_path, {"pod.log": log, "metrics.jsonl": metrics},
                      interval=3600)
    wait_until(lambda: "resuming runs/job-a/0/metrics.jsonl" in sidecar.output(), timeout=30,
               what="the sidecar's first pass")
    payload = lines(0, 150_000) + b"last line without newline"  # ~10 MB: several 4 MiB blocks
    log.write_bytes(payload)
    metrics.write_bytes(b'{"step": 1, "loss": 2.5}\n')
    assert sidecar.stop() == 0, sidecar.output()
    assert len(payload) > 2 * logship.CHUNK
    assert blob_bytes(container) == payload
    assert blob_bytes(container, "runs/job-a/0/metrics.jsonl") == b'{"step": 1, "loss": 2.5}\n'


def test_sigkill_and_restart_neither_lose_nor_duplicate(azurite, container, tmp_path):
    log = tmp_path / "train.log"
    expected = b""
    with open(log, "ab", buffering=0) as f:
        for round_ in range(3):
            sidecar = Sidecar(azurite, container.container_name, tmp_path, {"pod.log": log}, interval=0.05)
            chunk = lines(round_ * 40_000, 40_000)
            f.write(chunk)
            expected += chunk
            # Kill while the blob holds part of what is written: mid-stream, no chance to flush.
            wait_until(lambda: len(blob_bytes(container)) > len(expected) - len(chunk), timeout=30,
                       what="the sidecar to ship part of this round")
            sidecar.proc.kill()
            sidecar.proc.wait()
    sidecar = Sidecar(azurite, container.container_name, tmp_path, {"pod.log": log})
    assert sidecar.stop() == 0, sidecar.output()
    assert blob_bytes(container) == expected


def test_append_that_already_landed_is_not_appended_twice(azurite, container, tmp_path):
    """The case an offset file could not handle: a block reached the blob, but this shipper's idea
    of the offset is stale (reply lost, or killed right after the append). Two shippers of the
    same pod stand in for "before" and "after"; the append-position condition makes the stale one
    re-read the blob's length instead of appending the same bytes again."""
    log = tmp_path / "train.log"
    log.write_bytes(lines(0, 1000))
    client = container.get_blob_client("runs/job-a/0/pod.log")
    stale = logship.AppendShipper(client, log, "uid-1")
    stale.resume()
    landed = logship.AppendShipper(client, log, "uid-1")
    assert landed.ship() == log.stat().st_size
    with open(log, "ab") as f:
        f.write(lines(1000, 10))
    assert stale.ship() == len(lines(1000, 10))
    assert blob_bytes(container) == log.read_bytes()


def test_recreated_pod_appends_after_the_previous_pods_log(azurite, container, tmp_path):
    first, second = tmp_path / "first.log", tmp_path / "second.log"
    first.write_bytes(b"pod incarnation 1\n")
    second.write_bytes(b"pod incarnation 2\n")
    client = container.get_blob_client("runs/job-a/0/pod.log")
    logship.AppendShipper(client, first, "uid-1").ship()
    # Same pod name, new UID, fresh emptyDir: its file starts at 0 again.
    assert logship.AppendShipper(client, second, "uid-2").ship() == len(b"pod incarnation 2\n")
    # Its own sidecar restarting resumes inside its own file, not the previous pod's.
    with open(second, "ab") as f:
        f.write(b"more\n")
    assert logship.AppendShipper(client, second, "uid-2").ship() == len(b"more\n")
    assert blob_bytes(container) == b"pod incarnation 1\npod incarnation 2\nmore\n"


def test_output_dir_uploaded_on_stop_and_not_again_after_restart(azurite, container, tmp_path):
    out = tmp_path / "out"
    (out / "checkpoints").mkdir(parents=True)
    (out / "checkpoints" / "model.pt").write_bytes(os.urandom(5 * 1024 * 1024 + 3))
    (out / "metrics.json").write_bytes(b'{"final": true}')
    log = tmp_path / "train.log"
    log.write_bytes(b"done\n")
    args = ("--output-dir", str(out))
    sidecar = Sidecar(azurite, container.container_name, tmp_path, {"pod.log": log}, args=args)
    assert sidecar.stop() == 0, sidecar.output()
    for rel in ("checkpoints/model.pt", "metrics.json"):
        assert blob_bytes(container, f"runs/job-a/0/output/{rel}") == (out / rel).read_bytes()
    sidecar = Sidecar(azurite, container.container_name, tmp_path, {"pod.log": log}, args=args)
    assert sidecar.stop() == 0, sidecar.output()
    assert "output file(s)" not in sidecar.output()
    # Rewritten with the same size (a re-saved model is): its mtime tells it changed.
    (out / "metrics.json").write_bytes(b'{"final": fals}')
    stat = (out / "metrics.json").stat()
    os.utime(out / "metrics.json", ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    sidecar = Sidecar(azurite, container.container_name, tmp_path, {"pod.log": log}, args=args)
    assert sidecar.stop() == 0, sidecar.output()
    assert "uploaded 1 output file(s)" in sidecar.output()
    assert blob_bytes(container, "runs/job-a/0/output/metrics.json") == b'{"final": fals}'


def test_output_kept_uploaded_once_the_trainer_reports_final(azurite, container, tmp_path):
    """An MPI worker's pod outlives training (sshd keeps running until the operator deletes it):
    once the trainer's report says final, the output dir is uploaded while the sidecar runs,
    including the model the trainer saves just after that report."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "metrics.jsonl").write_bytes(b'{"step": 1, "loss": 2.0}\n')
    log = tmp_path / "train.log"
    sidecar = Sidecar(azurite, container.container_name, tmp_path, {"pod.log": log},
                      args=("--output-dir", str(out), "--metrics-file", str(out / "metrics.jsonl")))
    try:
        wait_until(lambda: "shipping " in sidecar.output(), timeout=30, what="the sidecar to start")
        with open(out / "metrics.jsonl", "ab") as f:
            f.write(b'{"step": 2, "loss": 1.0, "final": true}\n')
        wait_until(lambda: blob_bytes(container, "runs/job-a/0/output/metrics.jsonl").endswith(b"true}\n"),
                   timeout=15, what="the metrics in the blob while the sidecar runs")
        (out / "model.pt").write_bytes(b"weights")
        wait_until(lambda: blob_bytes(container, "runs/job-a/0/output/model.pt") == b"weights", timeout=15,
                   what="the model saved after the final report, in the blob while the sidecar runs")
    finally:
        assert sidecar.stop() == 0, sidecar.output()


def test_workload_identity(azurite, entra_double, tmp_path):
    container = azurite.new_container(https=True)
    log = tmp_path / "train.log"
    log.write_bytes(lines(0, 100))
    env = {**entra_double.workload_identity_env(tmp_path), **azurite.tls_env()}
    sidecar = Sidecar(azurite, container.container_name, tmp_path, {"pod.log": log}, method="WorkloadIdentity",
                      https=True, extra_env=env)
    assert sidecar.stop() == 0, sidecar.output()
    assert blob_bytes(container) == lines(0, 100)
    assert any(r.get("client_assertion") == entra_double.federated_token for r in entra_double.requests)


def test_no_secret_in_logs_or_blobs(azurite, container, tmp_path):
    """Every auth mode, including refused ones, with the secret values grepped for in everything the
    sidecar printed and in everything it wrote to storage."""
    log = tmp_path / "train.log"
    log.write_bytes(b"training output\n")
    sas_write = azurite.container_sas(container.container_name, permission="racwl")
    sas_read_only = azurite.container_sas(container.container_name, permission="rl")
    wrong_key = "V3Jvbmcga2V5IG9mIGV4YWN0bHkgc2l4dHktZm91ciBieXRlcyBmb3IgdGVzdGluZyEhISE="
    runs = [("AccountKey", azurite.account_key, 0), ("SASToken", sas_write, 0),
            ("ConnectionString", azurite.connection_string, 0),
            ("SASToken", sas_read_only, 1), ("AccountKey", wrong_key, 1)]
    outputs = []
    for i, (method, secret, code) in enumerate(runs):
        sidecar = Sidecar(azurite, container.container_name, tmp_path, {f"pod-{i}.log": log}, method=method,
                          secret=secret, args=("--drain-timeout", "1"))
        if code:  # a refused credential: the sidecar keeps retrying (and says why) until stopped
            wait_until(lambda: "failed: authentication failed" in sidecar.output(), timeout=30,
                       what=f"{method} refusal in the sidecar's log")
        assert sidecar.stop() == code, sidecar.output()
        outputs.append(sidecar.output())
        if not code:
            assert blob_bytes(container, f"runs/job-a/0/pod-{i}.log") == b"training output\n"
    stored = [blob_bytes(container, b.name) for b in container.list_blobs()]
    metadata = [str(container.get_blob_client(b.name).get_blob_properties().metadata) for b in container.list_blobs()]
    secrets = [azurite.account_key, sas_write, sas_read_only, wrong_key]
    secrets += [s.split("sig=", 1)[1].split("&", 1)[0] for s in (sas_write, sas_read_only)]
    for text in outputs + [b.decode() for b in stored] + metadata:
        for secret in secrets:
            assert secret not in text


def test_without_a_container_the_sidecar_only_reports(capsys):
    """A job whose output is a claim: no Blob Storage, so --progress (and --checkpoint-dir) only;
    anything that would ship is refused, naming the flags."""
    args = logship.parse_args(["--metrics-file", "/output/metrics.jsonl", "--progress", "j-progress",
                               "--namespace", "ns", "--checkpoint-dir", "/output/checkpoints/j/attempt-0"])
    assert args.container is None and args.progress == "j-progress"
    for wrong, named in [(["--file", "/var/trainop/train.log=x.log", "--dest", "d"], "--file, --dest"),
                         (["--output-dir", "/output"], "--output-dir"), ([], "shipping nothing")]:
        with pytest.raises(SystemExit):
            logship.parse_args([*wrong, "--metrics-file", "m", "--namespace", "ns",
                                *(["--progress", "p"] if wrong else [])])
        assert f"{named}: needs --container" in capsys.readouterr().err


def test_last_metrics_reads_the_last_complete_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    assert logship.last_metrics(path) is None
    path.write_bytes(b'{"epoch": 0, "step": 10, "loss": 6.9, "imagesPerSec": 120.5, "host": "w0"}\n'
                     b'not json\n'
                     b'{"epoch": 1, "step": 20, "loss": 5.1, "final": false, "note": {"a": 1}}\n'
                     b'{"epoch": 1, "step": 3')  # being written
    assert logship.last_metrics(path) == {"epoch": 1, "step": 20, "loss": 5.1, "final": False}


def test_last_metrics_writes_nan_and_infinities_as_strings(tmp_path):
    """Python's json (the trainer's) writes a diverged loss as a bare NaN, which is not JSON:
    reported as is, it made the whole status patch invalid and no later metrics ever landed."""
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b'{"step": 5, "loss": NaN, "imagesPerSec": Infinity, "stepTime": -Infinity}\n')
    metrics = logship.last_metrics(path)
    assert metrics == {"step": 5, "loss": "NaN", "imagesPerSec": "Infinity", "stepTime": "-Infinity"}
    json.loads(json.dumps(metrics, allow_nan=False))  # valid JSON


def test_progress_reporter_patches_at_a_bounded_rate_and_only_changes(tmp_path):
    path = tmp_path / "metrics.jsonl"
    patches = []
    reporter = logship.ProgressReporter(path, interval=3600, patch=patches.append)
    reporter.tick()  # no report yet: nothing sent, and the interval not started by it
    path.write_bytes(b'{"step": 1, "loss": 3.0}\n')
    reporter.tick()  # the first report goes out at once
    path.write_bytes(b'{"step": 2, "loss": NaN}\n')
    reporter.tick()  # within the interval: nothing sent
    reporter.tick(force=True)
    reporter.tick(force=True)  # unchanged: nothing sent
    assert patches == [{"data": {"metrics": '{"loss": 3.0, "step": 1}', "history": "[]"}},
                       {"data": {"metrics": '{"loss": "NaN", "step": 2}', "history": "[]"}}]


def test_progress_reporter_sends_the_recent_throughput_beside_the_latest_report(tmp_path):
    """The `history` key: [time, step, imagesPerSec] of the last 60 per-epoch reports in the
    file's tail, for `trainop describe`'s chart (the final report, an average, left out)."""
    path = tmp_path / "metrics.jsonl"
    patches = []
    reporter = logship.ProgressReporter(path, interval=0, patch=patches.append)
    lines = [json.dumps({"step": i, "time": 1.0e9 + i, "imagesPerSec": 100.0 + i, "final": False}) for i in range(80)]
    path.write_text("\n".join([*lines, json.dumps({"step": 79, "time": 2.0e9, "imagesPerSec": 1.0, "final": True})])
                    + "\n")
    reporter.tick()
    history = json.loads(patches[-1]["data"]["history"])
    assert len(history) == 60 and history[0] == [1.0e9 + 20, 20, 120.0] and history[-1] == [1.0e9 + 79, 79, 179.0]
    assert json.loads(patches[-1]["data"]["metrics"])["final"] is True


def test_output_upload_does_not_follow_symlinks(azurite, container, tmp_path):
    """Training code controls /output: a link there to a file outside it (the sidecar's API
    token, a Secret) or to a folder outside must not be uploaded; the sidecar names what it
    skipped and uploads the rest."""
    outside = tmp_path / "outside"
    (outside / "dir").mkdir(parents=True)
    (outside / "token").write_bytes(b"secret-token")
    (outside / "dir" / "data").write_bytes(b"secret-data")
    out = tmp_path / "out"
    out.mkdir()
    (out / "model.pt").write_bytes(b"weights")
    (out / "stolen").symlink_to(outside / "token")
    (out / "stolen-dir").symlink_to(outside / "dir", target_is_directory=True)
    (out / "inner").symlink_to(out / "model.pt")  # even one that stays inside: a copy is no link
    log = tmp_path / "train.log"
    log.write_bytes(b"done\n")
    sidecar = Sidecar(azurite, container.container_name, tmp_path, {"pod.log": log}, args=("--output-dir", str(out)))
    assert sidecar.stop() == 0, sidecar.output()
    names = sorted(b.name for b in container.list_blobs(name_starts_with="runs/job-a/0/output/"))
    assert names == ["runs/job-a/0/output/model.pt"]
    for link in ("stolen", "stolen-dir", "inner"):
        assert f"not uploading {out / link}: a symbolic link" in sidecar.output()
    stored = b"".join(blob_bytes(container, b.name) for b in container.list_blobs())
    assert b"secret-token" not in stored and b"secret-data" not in stored


def test_memory_stays_bounded_whatever_the_log_size(azurite, container, tmp_path):
    """Peak RSS of a shipper that ships 1 MiB against one that ships 64 MiB, each measured alone
    (os.wait4): holding the log in memory would add >= 64 MiB; streaming adds about one block.
    (bench/logship_rss.py does the same with 1 GiB.)"""
    def peak_rss_mib(size: int, name: str) -> int:
        log = tmp_path / name
        with open(log, "wb") as f:
            for start in range(0, size, 1 << 20):
                f.write(os.urandom(min(1 << 20, size - start)))
        sidecar = Sidecar(azurite, container.container_name, tmp_path, {name: log}, interval=3600,
                          args=("--drain-timeout", "120"))
        wait_until(lambda: "resuming" in sidecar.output(), timeout=30, what="the sidecar's first pass")
        sidecar.proc.send_signal(signal.SIGTERM)
        _, status, usage = os.wait4(sidecar.proc.pid, 0)
        sidecar.proc.returncode = os.waitstatus_to_exitcode(status)
        assert sidecar.proc.returncode == 0, sidecar.output()
        assert len(blob_bytes(container, f"runs/job-a/0/{name}")) == size
        return usage.ru_maxrss // 1024

    small = peak_rss_mib(1 << 20, "small.log")
    large = peak_rss_mib(64 << 20, "large.log")
    assert large - small < 32, (small, large)


def test_appends_are_paced_to_last_within_the_block_limit(azurite, container, tmp_path):
    log = tmp_path / "train.log"
    log.write_bytes(b"a\n")
    shipper = logship.AppendShipper(container.get_blob_client("runs/job-a/0/pod.log"), log, "uid-1")
    assert shipper.ship(final=False) == 2
    assert shipper.blocks == 1
    t = shipper.last_append
    assert not shipper.due(2, t + 1.9) and shipper.due(2, t + 2)
    shipper.blocks = logship.PACE_STEP * 2  # a long run: 20,000 blocks used, appends every 8 s
    assert not shipper.due(2, t + 7.9) and shipper.due(2, t + 8)
    # Near the limit, a short block waits for the drain (or for a full 4 MiB block).
    shipper.blocks = logship.MAX_BLOCKS - logship.DRAIN_RESERVE
    with open(log, "ab") as f:
        f.write(b"b\n")
    assert shipper.ship(final=False) == 0
    assert shipper.ship(final=True) == 2
    assert blob_bytes(container) == b"a\nb\n"
    # The count survives a restart: it is the blob's own.
    resumed = logship.AppendShipper(container.get_blob_client("runs/job-a/0/pod.log"), log, "uid-1")
    resumed.resume()
    assert resumed.blocks == 2


def test_a_log_swapped_for_a_link_or_a_fifo_ships_nothing_of_the_sidecars(azurite, container, tmp_path):
    """Issue 22 M2, the attack: job code shares the log's folder with the sidecar and replaces
    the log by a link to the sidecar's own /proc/self/environ (its storage credential is there),
    by a link to a file standing for its projected token, by a fifo (which would block the
    sidecar), and replaces a log's parent folder by a link to a folder elsewhere. The real
    shipper against Azurite: it ships the log up to the swap, says once what it refused, and no
    byte of the environ or the token lands in any blob."""
    run = tmp_path / "run"
    (run / "sub").mkdir(parents=True)
    outside = tmp_path / "outside"
    outside.mkdir()
    token = outside / "token"
    token.write_bytes(b"projected-token-secret\n" * 100)
    (outside / "worker.log").write_bytes(b"outside-file-secret\n" * 100)
    log, worker, third = run / "train.log", run / "sub" / "worker.log", run / "third.log"
    for path in (log, worker, third):
        path.write_bytes(b"step 1\n")
    sidecar = Sidecar(azurite, container.container_name, tmp_path,
                      {"pod.log": log, "worker.log": worker, "third.log": third})
    for name in ("pod.log", "worker.log", "third.log"):
        wait_until(lambda name=name: blob_bytes(container, f"runs/job-a/0/{name}") == b"step 1\n", timeout=30,
                   what=f"{name} shipped before the swap")
    log.unlink()
    log.symlink_to("/proc/self/environ")
    (run / "sub").rename(run / "sub-was")
    (run / "sub").symlink_to(outside, target_is_directory=True)
    third.unlink()
    os.mkfifo(third)
    for refusal in (f"not shipping {log}: a symbolic link", f"not shipping {worker}: resolves to {outside}/worker.log",
                    f"not shipping {third}: not a regular file"):
        wait_until(lambda refusal=refusal: refusal in sidecar.output(), timeout=30, what=refusal)
    log.unlink()
    log.symlink_to(token)  # read by the drain, if at all
    assert sidecar.stop() == 0, sidecar.output()
    stored = b"".join(blob_bytes(container, b.name) for b in container.list_blobs())
    assert stored == b"step 1\n" * 3
    output = sidecar.output()
    assert output.count(f"not shipping {third}") == 1  # said once, not every pass
    for secret in (azurite.account_key, "projected-token-secret", "outside-file-secret"):
        assert secret.encode() not in stored and secret not in output
