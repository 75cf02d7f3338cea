"""The stager as a process, against the real Azurite with the real azure-storage-blob SDK.

Every auth mode copies the same mixed-size data set; the workload-identity mode goes through the
real azure-identity DefaultAzureCredential and a TEST DOUBLE of Entra ID's token endpoint
(tests/fixtures/azurite.py: EntraTokenEndpointDouble), the one part of Azure that cannot run here.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import random
import signal
import subprocess
import sys
import tarfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.fixtures.waiting import wait_until
from trainop import blob

pytestmark = pytest.mark.azurite

RUN_TIMEOUT_S = 120
MODES = ["SASToken", "AccountKey", "ConnectionString", "WorkloadIdentity"]


def make_dataset(seed: int = 5) -> dict[str, bytes]:
    """~300 blobs: many tiny ones (incl. empty), some mid-size, a few above the stager's first-GET
    size so they are fetched as parallel ranges. ~30 MB in all."""
    rng = random.Random(seed)
    data = {}
    for i in range(260):
        data[f"small/{i % 7}/f{i:03d}.bin"] = rng.randbytes(rng.choice([0, 1, 100, 4096, 15000]))
    for i in range(36):
        data[f"mid/m{i:02d}.bin"] = rng.randbytes(rng.randrange(64 << 10, 512 << 10))
    for i in range(2):  # above the stager's 8 MiB first GET: the rest comes as parallel ranges
        data[f"large/l{i}.bin"] = rng.randbytes((8 << 20) + rng.randrange(1 << 20, 3 << 20))
    return data


DATASET = make_dataset()


def upload(container, data: dict[str, bytes]) -> None:
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda kv: container.upload_blob(kv[0], kv[1], overwrite=True), data.items()))


@pytest.fixture(scope="module")
def containers(azurite):
    """The data set in one container on each Azurite (HTTP for secrets, HTTPS for tokens)."""
    made = {}
    for https in (False, True):
        container = azurite.new_container(https=https, prefix="stage")
        upload(container, DATASET)
        made[https] = container.container_name
    return made


@pytest.fixture
def creds(azurite, entra_double, containers, tmp_path):
    """(account URL, env) per auth mode, as the copy Job's pod would receive them."""
    def for_mode(mode: str, *, secret: str | None = None, wi_token: str | None = None):
        base = {k: v for k, v in os.environ.items() if not k.startswith(("AZURE_", "TRAINOP_BLOB_"))}
        if mode == "WorkloadIdentity":
            env = {**base, **azurite.tls_env(), blob.METHOD_ENV: mode,
                   **entra_double.workload_identity_env(tmp_path, token=wi_token)}
            return azurite.https_url, containers[True], env
        default = {"SASToken": lambda: azurite.container_sas(containers[False]),
                   "AccountKey": lambda: azurite.account_key,
                   "ConnectionString": lambda: azurite.connection_string}[mode]
        env = {**base, blob.METHOD_ENV: mode, blob.SECRET_ENV: secret if secret is not None else default()}
        return azurite.http_url, containers[False], env
    return for_mode


def stager_cmd(url: str, container: str, dest: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "trainop.stager", "--account-url", url, "--container", container,
            "--dest", str(dest), *extra]


def run_stager(url, container, dest, env, *extra) -> subprocess.CompletedProcess:
    return subprocess.run(stager_cmd(url, container, dest, *extra), env=env, capture_output=True,
                          text=True, timeout=RUN_TIMEOUT_S)


def summary(proc: subprocess.CompletedProcess) -> dict:
    assert proc.returncode == 0, proc.stderr
    events = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert events[-1]["event"] == "done", proc.stdout[-2000:]
    return events[-1]


def local_md5s(dest: Path) -> dict[str, str]:
    return {p.relative_to(dest).as_posix(): hashlib.md5(p.read_bytes()).hexdigest()
            for p in dest.rglob("*") if p.is_file() and p.relative_to(dest).parts[0] != ".trainop"}


def expected_md5s(data: dict[str, bytes]) -> dict[str, str]:
    return {name: hashlib.md5(body).hexdigest() for name, body in data.items()}


def secret_values(env: dict) -> list[str]:
    values = [env.get(blob.SECRET_ENV)]
    if env.get("AZURE_FEDERATED_TOKEN_FILE"):
        values.append(Path(env["AZURE_FEDERATED_TOKEN_FILE"]).read_text())
    return [v for v in values if v]


@pytest.mark.parametrize("mode", MODES)
def test_copies_every_blob_with_identical_md5(creds, tmp_path, mode):
    url, container, env = creds(mode)
    dest = tmp_path / "share"
    proc = run_stager(url, container, dest, env, "--verify")
    done = summary(proc)
    assert local_md5s(dest) == expected_md5s(DATASET)
    total = sum(len(b) for b in DATASET.values())
    assert done == {"event": "done", "filesTotal": len(DATASET), "filesCopied": len(DATASET),
                    "filesDownloaded": len(DATASET), "filesSkipped": 0, "bytesTotal": total,
                    "bytesCopied": total, "bytesDownloaded": total, "skippedBlobs": 0, "skipped": []}
    for secret in secret_values(env):
        assert secret not in proc.stdout + proc.stderr
    # A second run finds everything in place and copies nothing.
    again = summary(run_stager(url, container, dest, env, "--verify"))
    assert (again["filesDownloaded"], again["filesSkipped"]) == (0, len(DATASET))
    assert not (dest / ".trainop" / "tmp").exists()


def test_sigkill_at_a_random_point_then_rerun_copies_only_the_missing(creds, tmp_path):
    url, container, env = creds("SASToken")
    dest = tmp_path / "share"
    journal = dest / ".trainop" / "manifest.jsonl"
    kill_after = random.Random().randrange(len(DATASET) // 10, len(DATASET) * 6 // 10)
    print(f"killing after {kill_after} completed files")

    def completed_lines() -> int:
        try:
            return journal.read_text().count("\n")
        except FileNotFoundError:
            return 0

    proc = subprocess.Popen(stager_cmd(url, container, dest, "--concurrency", "2"), env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_until(lambda: completed_lines() >= kill_after or proc.poll() is not None,
                   timeout=RUN_TIMEOUT_S, interval=0.01, what="the stager to be mid-copy")
        assert proc.poll() is None, "the stager finished before it could be killed"
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait(timeout=30)
    journaled = {json.loads(line)["name"] for line in journal.read_text().splitlines() if line.endswith("}")}
    assert 0 < len(journaled) < len(DATASET)

    done = summary(run_stager(url, container, dest, env))
    assert done["filesDownloaded"] == len(DATASET) - len(journaled)
    assert done["filesSkipped"] == len(journaled)
    assert local_md5s(dest) == expected_md5s(DATASET)


def test_corrupted_changed_or_deleted_local_files_are_copied_again(creds, tmp_path):
    url, container, env = creds("AccountKey")
    dest = tmp_path / "share"
    summary(run_stager(url, container, dest, env))
    grown, flipped, deleted = dest / "mid/m03.bin", dest / "large/l1.bin", dest / "small/2/f002.bin"
    with open(grown, "ab") as f:
        f.write(b"junk")
    # Same size and the old mtime: only content hashing (--verify) can see this one.
    stat = flipped.stat()
    with open(flipped, "r+b") as f:
        f.seek(stat.st_size // 2)
        byte = f.read(1)
        f.seek(stat.st_size // 2)
        f.write(bytes([byte[0] ^ 0xFF]))
    os.utime(flipped, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    deleted.unlink()

    cheap = summary(run_stager(url, container, dest, env))
    assert cheap["filesDownloaded"] == 2  # size change and deletion, without hashing
    assert local_md5s(dest) != expected_md5s(DATASET)
    verified = summary(run_stager(url, container, dest, env, "--verify"))
    assert verified["filesDownloaded"] == 1
    assert local_md5s(dest) == expected_md5s(DATASET)


@pytest.mark.parametrize("mode,bad", [
    ("SASToken", "tampered signature"),
    ("SASToken", "read-only SAS (no list permission)"),
    ("AccountKey", "wrong key"),
    ("ConnectionString", "wrong key"),
    ("WorkloadIdentity", "federated token the identity does not trust"),
])
def test_wrong_credential_fails_with_one_line_and_writes_nothing(creds, azurite, containers, tmp_path, mode, bad):
    wrong_key = "A" * 86 + "=="
    secret = {
        "tampered signature": lambda: azurite.container_sas(containers[False]).replace("sig=", "sig=AAAA"),
        "read-only SAS (no list permission)": lambda: azurite.container_sas(containers[False], permission="r"),
        "wrong key": lambda: (azurite.connection_string.replace(azurite.account_key, wrong_key)
                              if mode == "ConnectionString" else wrong_key),
        "federated token the identity does not trust": lambda: None,
    }[bad]()
    url, container, env = creds(mode, secret=secret, wi_token="some-other-service-account-token")
    dest = tmp_path / "share"
    proc = run_stager(url, container, dest, env)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("stager: authentication failed"), proc.stderr
    for value in secret_values(env):
        assert value not in proc.stdout + proc.stderr
    assert "sig=" not in proc.stdout + proc.stderr.replace("sig=<redacted>", "")
    assert not dest.exists()


def test_unreachable_endpoint_fails_with_one_network_line(creds, tmp_path):
    from tests.fixtures.azurite import free_port
    _, container, env = creds("SASToken")
    proc = run_stager(f"http://127.0.0.1:{free_port()}/devstoreaccount1", container, tmp_path / "share", env)
    assert proc.returncode == 3
    assert proc.stderr.strip().startswith("stager: network error: cannot reach the storage endpoint")
    assert len(proc.stderr.strip().splitlines()) == 1
    assert env[blob.SECRET_ENV] not in proc.stderr and "sig=" not in proc.stderr
    assert not (tmp_path / "share").exists()


def tar_bytes(files: dict[str, bytes], mode: str = "w") -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode=mode) as tar:
        for name, body in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(body)
            tar.addfile(info, io.BytesIO(body))
    return buf.getvalue()


def test_tar_and_tar_gz_archives_are_extracted_once(azurite, tmp_path):
    container = azurite.new_container(prefix="arch")
    members = {"n01440764/img_0.JPEG": b"\xff\xd8 fish", "n01443537/img_1.JPEG": b"\xff\xd8 goldfish" * 1000}
    upload(container, {"train.tar": tar_bytes(members), "val/val.tar.gz": tar_bytes(members, "w:gz"),
                       "plain.bin": b"not an archive"})
    env = {**os.environ, blob.METHOD_ENV: "AccountKey", blob.SECRET_ENV: azurite.account_key}
    dest = tmp_path / "share"
    summary(run_stager(azurite.http_url, container.container_name, dest, env, "--extract"))
    for folder in ("train.tar.d", "val/val.tar.gz.d"):
        assert {n: (dest / folder / n).read_bytes() for n in members} == members
    assert not (dest / "plain.bin.d").exists()
    marker = dest / "train.tar.d" / "marker"
    marker.write_text("a re-run must not re-extract")
    summary(run_stager(azurite.http_url, container.container_name, dest, env, "--extract"))
    assert marker.exists()
    # A new version of the archive replaces the extracted folder.
    container.upload_blob("train.tar", tar_bytes({"only/this.txt": b"v2"}), overwrite=True)
    summary(run_stager(azurite.http_url, container.container_name, dest, env, "--extract"))
    assert sorted(p.relative_to(dest / "train.tar.d").as_posix() for p in (dest / "train.tar.d").rglob("*")
                  if p.is_file()) == ["only/this.txt"]


def test_archive_escaping_the_destination_is_refused(azurite, tmp_path):
    container = azurite.new_container(prefix="evil")
    upload(container, {"evil.tar": tar_bytes({"../../escaped.txt": b"x"})})
    env = {**os.environ, blob.METHOD_ENV: "AccountKey", blob.SECRET_ENV: azurite.account_key}
    proc = run_stager(azurite.http_url, container.container_name, tmp_path / "share", env, "--extract")
    assert proc.returncode == 1
    assert proc.stderr.startswith("stager: cannot extract 'evil.tar'"), proc.stderr
    assert not list(tmp_path.rglob("escaped.txt"))


def test_prefixes_select_blobs_and_progress_is_rate_bounded(creds, tmp_path):
    url, container, env = creds("SASToken")
    dest = tmp_path / "share"
    started = time.monotonic()
    proc = run_stager(url, container, dest, env, "--prefix", "mid/", "--prefix", "large/",
                      "--progress-interval", "0.2", "--concurrency", "2")
    elapsed = time.monotonic() - started
    done = summary(proc)
    chosen = {k: v for k, v in DATASET.items() if k.startswith(("mid/", "large/"))}
    assert local_md5s(dest) == expected_md5s(chosen)
    progress = [json.loads(line) for line in proc.stdout.splitlines() if '"event": "progress"' in line]
    assert progress[0]["filesTotal"] == len(chosen) and progress[0]["bytesCopied"] == 0
    assert progress[-1] == {"event": "progress", "bytesCopied": done["bytesTotal"], "bytesTotal": done["bytesTotal"],
                            "filesCopied": len(chosen), "filesTotal": len(chosen), "skippedBlobs": 0, "skipped": []}
    assert [p["bytesCopied"] for p in progress] == sorted(p["bytesCopied"] for p in progress)
    # the first, the last, and at most one per interval in between: not one per chunk or file
    assert len(progress) <= 2 + elapsed / 0.2


def test_blobs_that_cannot_be_files_are_skipped_by_name_and_the_rest_is_copied(azurite, tmp_path):
    """issue 15 (13c): `a` next to `a/b`, a path part over 255 bytes, and two names of one file
    used to fail the whole copy. Real Azurite, real azure-storage-blob."""
    container = azurite.new_container(prefix="odd")
    long_part = "x" * 256
    upload(container, {"a": b"file a", "a/b": b"file a/b", f"d/{long_part}.jpg": b"long", "ok/1.jpg": b"one",
                       "ok//1.jpg": b"dup"})
    env = {**os.environ, blob.METHOD_ENV: "AccountKey", blob.SECRET_ENV: azurite.account_key}
    dest = tmp_path / "share"
    proc = run_stager(azurite.http_url, container.container_name, dest, env)
    done = summary(proc)
    assert local_md5s(dest) == expected_md5s({"a/b": b"file a/b", "ok/1.jpg": b"one"})
    assert (done["filesCopied"], done["filesTotal"], done["skippedBlobs"]) == (2, 2, 3)
    assert sorted(done["skipped"]) == sorted([
        "a: is also a folder (blob 'a/b')",
        f"d/{long_part}.jpg: a path part is longer than 255 bytes",
        "ok//1.jpg: maps to the same file as blob 'ok/1.jpg'"])
    for name in ("'a'", f"'d/{long_part}.jpg'", "'ok//1.jpg'"):
        assert f"WARNING trainop.stager skipped blob {name}" in proc.stdout


def test_a_file_from_an_earlier_run_makes_way_for_a_folder(azurite, tmp_path):
    container = azurite.new_container(prefix="grow")
    upload(container, {"a": b"first"})
    env = {**os.environ, blob.METHOD_ENV: "AccountKey", blob.SECRET_ENV: azurite.account_key}
    dest = tmp_path / "share"
    summary(run_stager(azurite.http_url, container.container_name, dest, env))
    upload(container, {"a/b": b"later"})
    done = summary(run_stager(azurite.http_url, container.container_name, dest, env))
    assert local_md5s(dest) == expected_md5s({"a/b": b"later"}) and done["skippedBlobs"] == 1
