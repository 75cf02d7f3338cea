"""trainer_images/nfs-server/entrypoint.sh run by a real `sh`: the Ganesha export it writes from
the clients file, how it follows that file (rewrite, then SIGHUP) and how it stops (SIGTERM to
the server, its exit status passed on). Ganesha itself is a test double here, a shell script
that records its configuration and the signals it gets, because the real one needs
CAP_DAC_READ_SEARCH and a served disk: tests/e2e/test_nfs_ganesha.py runs the real server in a
real pod (its reload for a new and a departed reader, its exit status on SIGTERM)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
from pathlib import Path

import pytest

from tests.fixtures.waiting import wait_until
from trainop.paths import REPO_ROOT

ENTRYPOINT = REPO_ROOT / "trainer_images" / "nfs-server" / "entrypoint.sh"
# The double: on start and on every SIGHUP it appends the CLIENT line of the configuration it was
# given (or "none"); SIGTERM makes it exit with $FAKE_EXIT.
FAKE_GANESHA = """#!/bin/sh
while [ $# -gt 0 ]; do [ "$1" = -f ] && conf=$2; shift; done
record() { echo "$1 $(grep -o 'CLIENT {.*}' "$conf" || echo none)" >> "$FAKE_LOG"; }
record start
trap 'record hup' HUP
trap 'echo term >> "$FAKE_LOG"; exit "${FAKE_EXIT:-0}"' TERM
while :; do sleep 0.05; done
"""


def default_hup() -> None:
    """SIGHUP back to its default, as a container's processes start. A pytest started under
    `nohup` (as the clean-clone checks were) hands SIGHUP ignored to its children, and a shell
    cannot trap a signal ignored when it started (POSIX): the double's `trap ... HUP` did
    nothing and no reload was recorded (both reload tests failed so on 2026-12-05)."""
    signal.signal(signal.SIGHUP, signal.SIG_DFL)


class Server:
    def __init__(self, tmp_path: Path, clients: str | None, fake_exit: int = 0):
        self.log, self.clients = tmp_path / "ganesha.log", tmp_path / "clients"
        fake = tmp_path / "ganesha.nfsd"
        fake.write_text(FAKE_GANESHA)
        fake.chmod(0o755)
        if clients is not None:
            self.clients.write_text(clients)
        env = {**os.environ, "EXPORT_DIR": str(tmp_path), "RUN_DIR": str(tmp_path / "run"),
               "CLIENTS_FILE": str(self.clients), "GANESHA": str(fake), "FAKE_LOG": str(self.log),
               "POLL_SECONDS": "0.1", "FAKE_EXIT": str(fake_exit)}
        # a group of its own: the teardown kills the double with it (a SIGKILL to the
        # entrypoint alone left its child looping for good)
        self.proc = subprocess.Popen(["sh", str(ENTRYPOINT)], env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, preexec_fn=default_hup,
                                     process_group=0)
        wait_until(lambda: self.records(), timeout=10, what="the server started")

    def records(self) -> list[str]:
        return self.log.read_text().splitlines() if self.log.exists() else []

    def replace(self, text: str) -> None:
        """As the kubelet updates a downward API volume: a new file swapped in at once."""
        new = self.clients.with_suffix(".new")
        new.write_text(text)
        new.rename(self.clients)

    def stop(self) -> tuple[int, str]:
        self.proc.send_signal(signal.SIGTERM)
        out, _ = self.proc.communicate(timeout=10)
        return self.proc.returncode, out


@pytest.fixture
def servers():
    started: list[Server] = []
    yield started
    for server in started:
        try:
            os.killpg(server.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass  # the entrypoint and the double are gone already
        server.proc.wait()


def test_the_export_serves_the_listed_clients_and_follows_the_file(tmp_path, servers):
    server = Server(tmp_path, "10.224.0.5,10.244.1.7,fd00::5,10.225.0.0/16")  # as the annotation has it
    servers.append(server)
    assert server.records() == ["start CLIENT { Clients = 10.224.0.5, 10.244.1.7, fd00::5, 10.225.0.0/16; Access_Type = RO; }"]
    conf = (tmp_path / "run" / "ganesha.conf").read_text()
    assert "Squash = root_squash;" in conf and "Access_Type = None;" in conf
    server.replace("10.224.0.6")  # a reader left, another came: rewritten, then SIGHUP
    wait_until(lambda: len(server.records()) == 2, timeout=10, what="the reload")
    assert server.records()[1] == "hup CLIENT { Clients = 10.224.0.6; Access_Type = RO; }"
    server.replace("")  # the last reader gone: nobody
    wait_until(lambda: len(server.records()) == 3, timeout=10, what="the second reload")
    assert server.records()[2] == "hup none"
    assert "# no client listed: nobody may mount" in (tmp_path / "run" / "ganesha.conf").read_text()
    rc, out = server.stop()
    assert rc == 0 and server.records()[-1] == "term", out
    assert "nfs-server: exporting" in out and out.rstrip().endswith("ganesha.nfsd exited with status 0")


def test_no_file_or_an_empty_one_serves_nobody(tmp_path, servers):
    server = Server(tmp_path, None)
    servers.append(server)
    assert server.records() == ["start none"]
    server.replace("10.224.0.5")  # the operator annotates the new pod: served from then on
    wait_until(lambda: len(server.records()) == 2, timeout=10, what="the reload")
    assert server.records()[1] == "hup CLIENT { Clients = 10.224.0.5; Access_Type = RO; }"


def test_what_is_not_an_address_never_reaches_the_configuration(tmp_path, servers):
    """The file is an annotation of a pod in the tenant's namespace: someone who may edit it must
    not write Ganesha configuration through it (a second export of /, read-write access, a
    wildcard)."""
    hostile = ("10.224.0.5,}\nEXPORT { Export_Id = 2; Path = /; Pseudo = /x; Access_Type = RW;\n"
               "*\n10.0.0.1;Access_Type=RW\n@netgroup\nlocalhost\n1.2.3\n")
    server = Server(tmp_path, hostile)
    servers.append(server)
    assert server.records() == ["start CLIENT { Clients = 10.224.0.5; Access_Type = RO; }"]
    conf = (tmp_path / "run" / "ganesha.conf").read_text()
    assert conf.count("EXPORT {") == 1 and "RW" not in conf and "Path = /;" not in conf
    _, out = server.stop()
    for entry in ("}", "EXPORT", "*", "10.0.0.1;Access_Type=RW", "@netgroup", "localhost", "1.2.3"):
        assert re.search(rf"client entry '{re.escape(entry)}' left out: not an address or CIDR", out), (entry, out)


def test_sigterm_passes_the_servers_own_exit_status_on(tmp_path, servers):
    server = Server(tmp_path, "10.224.0.5\n", fake_exit=3)
    servers.append(server)
    rc, out = server.stop()
    assert rc == 3 and server.records()[-1] == "term", out
