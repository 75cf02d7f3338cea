"""Issue 22 H2, L6, L7: what `trainop logs` and `trainop tensorboard` do with a job that someone
else may have edited, on the real API server and the real Azurite.

The attack (H2): whoever may edit a DistributedTrainingJob sets its accountURL to a host they
run, keeps the auth block naming a Secret of the namespace, and waits for a colleague to inspect
the job: the CLI reads the Secret with the colleague's rights and sends it along. Here that host
is a listener on loopback that records every request; the CLI must refuse before any request,
naming the field, while a job on the endpoint the operator configuration allows still works.
L6: a projector_config.pbtxt among the job's event files names a file of the user's machine.
L7: a log with terminal escape sequences, shown on a terminal."""

from __future__ import annotations

import json
import os
import pty
import signal
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml

from tests.cli.test_tensorboard import assert_no_projector
from tests.fixtures.azurite import free_port
from tests.fixtures.waiting import wait_until
from trainop.cli.logs import job_folder

pytestmark = [pytest.mark.cluster, pytest.mark.azurite]

SECRET = "storage"
# A log as job code may write it: clear the screen, set the title, put text in the clipboard
# (OSC 52), a C1 CSI, a carriage return that would overwrite the line before it.
HOSTILE_LOG = (b"step 1 loss 2.0\n\x1b[2J\x1b]0;pwned\x07\x1b]52;c;cm0gLXJmIH4=\x07"
               b"\xc2\x9b31m red\tok\r\nhidden\rshown\n")
SHOWN_ON_A_TERMINAL = (b"step 1 loss 2.0\n^[[2J^[]0;pwned^G^[]52;c;cm0gLXJmIH4=^G"
                       b"\\u009b31m red\tok\nhidden\nshown\n")


class Listener:
    """An HTTP server on loopback standing for the attacker's host: records each request's
    path, query and headers, answers 403."""

    def __init__(self):
        self.requests: list[dict] = []
        seen = self.requests

        class Handler(BaseHTTPRequestHandler):
            def _any(self):
                seen.append({"path": self.path, "headers": dict(self.headers)})
                self.send_response(403)
                self.send_header("Content-Length", "0")
                self.end_headers()

            do_GET = do_HEAD = do_PUT = do_POST = _any

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/devstoreaccount1"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def credentials(self) -> list[str]:
        """Whatever arrived that carries a credential: an Authorization header, a SAS."""
        return [json.dumps(r) for r in self.requests
                if "sig=" in r["path"] or any(k.lower() == "authorization" for k in r["headers"])]

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def dtj(name: str, url: str, container: str) -> dict:
    return {"apiVersion": "trainop.io/v1alpha1", "kind": "DistributedTrainingJob", "metadata": {"name": name},
            "spec": {"workers": 1, "gpusPerWorker": 1,
                     "output": {"blob": {"accountURL": url, "container": container, "prefix": "runs",
                                         "auth": {"sasSecretRef": {"name": SECRET, "key": "sas"}}}}}}


def trainop(cluster, namespace: str, *args: str, config: Path | None) -> list[str]:
    extra = ["--config", str(config)] if config else []
    return [sys.executable, "-m", "trainop", *args, "-n", namespace, "--kubeconfig", str(cluster.kubeconfig), *extra]


def on_a_terminal(cmd: list[str], env: dict) -> tuple[int, bytes]:
    """Run `cmd` with its stdout on a pseudo-terminal; returns (exit code, what the terminal got)."""
    leader, follower = pty.openpty()
    proc = subprocess.Popen(cmd, stdout=follower, stderr=subprocess.PIPE, env=env)
    os.close(follower)
    got = b""
    while True:
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # EIO: the process closed the terminal
            break
        if not chunk:
            break
        got += chunk
    os.close(leader)
    return proc.wait(timeout=60), got


@pytest.fixture
def listener():
    server = Listener()
    yield server
    server.close()


def test_the_cli_sends_no_credential_to_a_host_the_job_names(cluster, namespace, azurite, listener, tmp_path):
    container = azurite.new_container()
    sas = azurite.container_sas(container.container_name, permission="rl")
    cluster.kubectl("create", "secret", "generic", SECRET, "-n", namespace, f"--from-literal=sas={sas}")
    # The admin's configuration allows exactly Azurite's endpoint (port included); the listener
    # is on the same loopback address, another port.
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({"blob": {"allowedAccountURLs": [azurite.http_url]}}))
    cluster.apply(dtj("legit", azurite.http_url, container.container_name), namespace)
    cluster.apply(dtj("evil", listener.url, container.container_name), namespace)
    folder = job_folder(cluster.get("dtj", "legit", "-n", namespace))
    container.get_blob_client(f"{folder}/0/legit-launcher-x1.log").upload_blob(HOSTILE_LOG)

    # The attack: both verbs, with and without a configuration. Refused before any request.
    refusal = ("spec.output.blob.accountURL: http://127.0.0.1 is not an allowed Blob endpoint; use "
               "https://<account>.blob.core.windows.net (or another Azure cloud's), or ask the cluster admin "
               "to add it to blob.allowedAccountURLs in the operator configuration; no credential was sent")
    for verb in ("logs", "tensorboard"):
        for cfg in (config, None):
            shown = subprocess.run(trainop(cluster, namespace, verb, "evil", config=cfg), capture_output=True,
                                   text=True, timeout=120)
            assert shown.returncode == 1, shown.stderr
            assert shown.stderr.startswith(f"trainop {verb}: {refusal}"), shown.stderr
            assert sas not in shown.stderr
    assert listener.credentials() == [] and listener.requests == []

    # Azurite, the same loopback address, is not Azure Storage: allowed only where configured.
    plain = subprocess.run(trainop(cluster, namespace, "logs", "legit", config=None), capture_output=True,
                           text=True, timeout=60, env={k: v for k, v in os.environ.items() if k != "TRAINOP_CONFIG"})
    assert plain.returncode == 1 and "is not an allowed Blob endpoint" in plain.stderr

    # The legit job: its log, byte for byte into a pipe (L7: and shown, not acted on, on a terminal).
    shown = subprocess.run(trainop(cluster, namespace, "logs", "legit", config=config), capture_output=True, timeout=60)
    assert (shown.returncode, shown.stdout) == (0, HOSTILE_LOG), shown.stderr
    code, seen = on_a_terminal(trainop(cluster, namespace, "logs", "legit", config=config), dict(os.environ))
    # the terminal's line discipline turns each \n into \r\n
    assert code == 0 and seen.replace(b"\r\n", b"\n") == SHOWN_ON_A_TERMINAL
    assert b"\x1b" not in seen and b"\x07" not in seen and b"\xc2\x9b" not in seen


@pytest.mark.trainer
def test_tensorboard_fetches_only_event_files_and_reads_no_local_file(cluster, namespace, azurite, tmp_path):
    """L6: the job wrote a projector config naming a file of this machine beside its events."""
    from tests.cli.test_tensorboard import projector_attack, write_events

    container = azurite.new_container()
    sas = azurite.container_sas(container.container_name, permission="rl")
    cluster.kubectl("create", "secret", "generic", SECRET, "-n", namespace, f"--from-literal=sas={sas}")
    cluster.apply(dtj("legit", azurite.http_url, container.container_name), namespace)
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({"blob": {"allowedAccountURLs": [azurite.http_url]}}))
    out = tmp_path / "run"
    write_events(out)
    secret_file, projector = projector_attack(tmp_path)
    tb = f"{job_folder(cluster.get('dtj', 'legit', '-n', namespace))}/0/output/tensorboard"
    for f in (out / "tensorboard").iterdir():
        container.get_blob_client(f"{tb}/{f.name}").upload_blob(f.read_bytes())
    container.get_blob_client(f"{tb}/projector_config.pbtxt").upload_blob(projector)
    port = free_port()
    log = tmp_path / "tensorboard.log"
    with open(log, "w") as f:
        served = subprocess.Popen([*trainop(cluster, namespace, "tensorboard", "legit", config=config),
                                   "--port", str(port)], stdout=f, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}/data"

    def fetch(path: str) -> tuple[int, bytes]:
        try:
            with urllib.request.urlopen(base + path, timeout=10) as resp:
                return resp.status, resp.read()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read()

    def runs():
        assert served.poll() is None, log.read_text()
        try:
            return json.loads(fetch("/runs")[1]) == ["attempt-0"]
        except OSError:
            return False
    try:
        wait_until(runs, timeout=120, what="TensorBoard to serve the legit job's attempt")
        assert "1 event file(s) of legit" in log.read_text()
        assert_no_projector(fetch, "attempt-0", secret_file)
    finally:
        served.send_signal(signal.SIGTERM)
        served.wait(timeout=30)
