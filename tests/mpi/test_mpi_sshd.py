"""The rendered MPI wiring is real: a 2-worker job's SSH key, hostfile, sshd/ssh configs, worker
and launcher commands and environment, exactly as rendered, run Open MPI over real sshd.

Two sshd "workers" listen on 127.0.0.2 and 127.0.0.3 (the rendered worker command, plus a
ListenAddress so both can use port 2222 on one machine, and a private shared-memory folder each,
as two pods would have). The launcher command runs in a private
mount namespace whose /etc/hosts maps the workers' cluster DNS names to those addresses (the
stand-in for cluster DNS). The only other change: files mounted at /etc/trainop in a pod live in
a temporary folder here. Each rank is a small mpi4py program (until the trainer runs here) that
reports which sshd it came through and takes part in an allreduce.
"""

from __future__ import annotations

import base64
import os
import re
import shutil
import socket
import subprocess
import sys
import time

import pytest

from tests.fixtures.waiting import wait_until
from trainop import config, sshkeys
from trainop.render import common, dtj
from trainop.spec import parse

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(180)]

RANK_PROGRAM = """
import os
import re
from mpi4py import MPI
comm = MPI.COMM_WORLD
server = os.environ.get("SSH_CONNECTION", "none none local").split()[2]
total = comm.allreduce(comm.rank)
env = os.environ.get("TRAINOP_TEST")
# one write per report: mpirun interleaves the ranks' output chunk by chunk
os.write(1, f"rank {comm.rank}/{comm.size} via {server} sum {total} env {env}\\n".encode())
"""


def _accepts(address: str, port: int) -> bool:
    try:
        socket.create_connection((address, port), timeout=1).close()
        return True
    except OSError:
        return False


def _need(*tools):
    # A missing tool is a broken set-up, not a reason to skip: bootstrap installs all of them.
    missing = [t for t in tools if not shutil.which(t)]
    assert not missing, f"needs {', '.join(missing)} (scripts/bootstrap.sh installs openmpi-bin, openssh-server)"


@pytest.fixture
def rendered(tmp_path):
    cfg = config.load(None)
    job = parse({"metadata": {"name": "j1", "namespace": "mpitest"},
                 "spec": {"workers": 2, "slotsPerWorker": 2,
                          "command": [sys.executable, "-c", RANK_PROGRAM],
                          "env": [{"name": "TRAINOP_TEST", "value": "forwarded"}]}}, cfg)
    root = tmp_path / "etc-trainop"

    def remap(text: str) -> str:
        return text.replace(common.MOUNT_ROOT, str(root))

    secret = dtj.render_ssh_secret(job, *sshkeys.generate())
    config_map = dtj.render_config_map(job)
    for folder, files, mode in (("ssh", {k: base64.b64decode(v).decode() for k, v in secret["data"].items()}, 0o600),
                                ("mpi", config_map["data"], 0o444)):
        (root / folder).mkdir(parents=True)
        for name, content in files.items():
            path = root / folder / name
            path.write_text(remap(content))
            path.chmod(0o555 if name == "ssh" else mode)
    return job, root, remap


def test_launcher_runs_ranks_over_sshd_on_both_workers(rendered, tmp_path):
    _need("mpirun", "/usr/sbin/sshd", "unshare")
    import mpi4py  # noqa: F401  (the test extra installs it; a missing one must fail, not skip)
    job, root, remap = rendered
    workers = []
    try:
        for i in range(job.workers):
            pod = dtj.render_worker(job, i, attempt=0)
            (container,) = pod["spec"]["containers"]
            assert container["command"][:2] == ["sh", "-c"]
            address = f"127.0.0.{2 + i}"
            # Each pod has its own /dev/shm and /tmp; on one machine, give each worker its own,
            # or Open MPI's shared-memory files of the two "nodes" collide.
            private = tmp_path / f"worker-{i}-shm"
            private.mkdir()
            script = remap(container["command"][2]).replace(
                "sshd_config\n", f"sshd_config -o ListenAddress={address} -o 'SetEnv="
                f"OMPI_MCA_btl_vader_backing_directory={private} TMPDIR={private}'\n")
            log = (tmp_path / f"worker-{i}.log").open("w")
            workers.append(subprocess.Popen(["sh", "-c", script], stdout=log, stderr=subprocess.STDOUT))

        def listening():
            for proc in workers:
                assert proc.poll() is None, (tmp_path / "worker-0.log").read_text() + (tmp_path / "worker-1.log").read_text()
            return all(_accepts(f"127.0.0.{2 + i}", dtj.SSH_PORT) for i in range(job.workers))
        wait_until(listening, timeout=20, what="both sshd workers listening")

        hosts = tmp_path / "hosts"
        hosts.write_text("127.0.0.1 localhost\n" + "".join(
            f"127.0.0.{2 + i} {dtj.host(job, i)}\n" for i in range(job.workers)))
        launcher = dtj.render_launcher(job, attempt=0)["spec"]["template"]["spec"]["containers"][0]
        env = {e["name"]: e["value"] for e in launcher["env"] if "value" in e}
        env |= {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/root")}
        command = [remap(part) for part in launcher["command"]]
        started = time.monotonic()
        run = subprocess.run(
            ["unshare", "-m", "sh", "-c", 'mount --bind "$0" /etc/hosts && exec "$@"', str(hosts), *command],
            env=env, capture_output=True, text=True, timeout=120)
        elapsed = time.monotonic() - started
    finally:
        for proc in workers:
            proc.terminate()
            proc.wait(10)

    assert run.returncode == 0, f"launcher failed ({run.returncode}):\n{run.stdout}\n{run.stderr}"
    lines = sorted(re.findall(r"rank \d+/\d+ via \S+ sum \d+ env \S+", run.stdout))
    # every rank came through the sshd of its worker (hostfile order, 2 slots each), reached
    # every other rank (allreduce), and got the job's env (mpirun -x) despite sshd's clean env
    assert lines == [f"rank {r}/4 via 127.0.0.{2 + r // 2} sum 6 env forwarded" for r in range(4)], \
        run.stdout + run.stderr
    print(f"mpirun over sshd: 4 ranks on 2 workers in {elapsed:.1f}s")
