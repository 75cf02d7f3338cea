"""The rendered MPI wiring is real: a 2-worker job's SSH key, hostfile, sshd/ssh configs, worker
and launcher commands and environment, exactly as rendered, run Open MPI over real sshd, as the
non-root user of the rendered pods' securityContext.

Two sshd "workers" listen on 127.0.0.2 and 127.0.0.3 (the rendered worker command, plus a
ListenAddress so both can use port 2222 on one machine, and a private shared-memory folder each,
as two pods would have). The launcher command runs in a private
mount namespace whose /etc/hosts maps the workers' cluster DNS names to those addresses (the
stand-in for cluster DNS). Files mounted at /etc/trainop in a pod live in a temporary folder
here, laid out the way the kubelet lays out the Secret and ConfigMap volumes of the rendered pod
(root-owned, group fsGroup, defaultMode | 0440, behind ..data symlinks). sshd and mpirun run as
a test user (`trainop-test`, created if missing) with the pod's uid, gid and fsGroup, no new
privileges and no capabilities, as the container's securityContext says. Each rank is a small
mpi4py program (until the trainer runs here) that reports which sshd it came through and as
which uid, and takes part in an allreduce.
"""

from __future__ import annotations

import base64
import os
import pwd
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

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
worker = os.environ.get("WORKER_ONLY")
# one write per report: mpirun interleaves the ranks' output chunk by chunk
os.write(1, f"rank {comm.rank}/{comm.size} via {server} uid {os.getuid()} sum {total} env {env} worker {worker}\\n".encode())
"""
TEST_USER = "trainop-test"


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


def _test_user() -> pwd.struct_passwd:
    """A non-root user with a POSIX login shell (sshd runs commands through it) and no home:
    nothing of the operator's may depend on ~/.ssh."""
    try:
        return pwd.getpwnam(TEST_USER)
    except KeyError:
        _need("useradd")
        made = subprocess.run(["useradd", "--system", "--user-group", "--no-create-home",
                               "--home-dir", "/nonexistent", "--shell", "/bin/sh", TEST_USER],
                              capture_output=True, text=True)
        assert made.returncode in (0, 9), made.stderr  # 9: a concurrent run made it first
        return pwd.getpwnam(TEST_USER)


def _as_pod_user(pod: dict) -> list[str]:
    """A command prefix that runs what follows as the pod's securityContext says: its uid and
    gid, fsGroup as supplementary group, no_new_privs, no capabilities but those added to the
    bounding set (an MPI worker's NET_BIND_SERVICE)."""
    ctx = pod["spec"]["securityContext"]
    (container,) = pod["spec"]["containers"]
    added = container["securityContext"]["capabilities"].get("add", [])
    assert ctx["runAsNonRoot"] and added in ([], ["NET_BIND_SERVICE"])
    assert container["securityContext"] == common.container_security_context() | (
        {"capabilities": {"drop": ["ALL"], "add": added}} if added else {})
    bounding = ",".join(["-all", *(f"+{cap.lower()}" for cap in added)])
    return ["setpriv", f"--reuid={ctx['runAsUser']}", f"--regid={ctx['runAsGroup']}",
            f"--groups={ctx['fsGroup']}", "--no-new-privs", "--inh-caps=-all", f"--bounding-set={bounding}", "--"]


def _lay_out_volume(folder: Path, volume: dict, files: dict[str, str], fs_group: int) -> None:
    """What the kubelet makes of a Secret or ConfigMap volume: files written by root with their
    mode (item mode, else defaultMode) in a timestamped folder behind a ..data symlink, then, for
    the pod's fsGroup, group fsGroup on everything and 0440 ORed into every file's mode (both
    volume types are read-only), setgid on folders."""
    source = volume.get("secret") or volume["configMap"]
    modes = {item["key"]: item.get("mode", source["defaultMode"]) for item in source.get("items", [])}
    data = folder / "..2026_01_01_00_00_00.000000001"
    data.mkdir(parents=True)
    for name, content in files.items():
        if modes and name not in modes:
            continue
        (data / name).write_text(content)
        os.chown(data / name, 0, fs_group)
        (data / name).chmod(modes.get(name, source["defaultMode"]) | 0o440)
        (folder / name).symlink_to(Path("..data") / name)
    (folder / "..data").symlink_to(data.name)
    for path in (folder, data):
        os.chown(path, 0, fs_group)
        path.chmod(0o2755)


def _rank_python(user: pwd.struct_passwd) -> tuple[str, str]:
    """An interpreter the test user may run, and the PYTHONPATH that gives it this venv's
    mpi4py. The venv's own base interpreter may live where only root can reach (pyenv under
    /root); the system one of the same version then runs the same compiled mpi4py."""
    import mpi4py  # noqa: F401  (the test extra installs it; a missing one must fail, not skip)
    site = str(Path(mpi4py.__file__).parents[1])
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    as_user = ["setpriv", f"--reuid={user.pw_uid}", f"--regid={user.pw_gid}", "--clear-groups"]
    for python in (sys.executable, f"/usr/bin/{version}", f"/usr/local/bin/{version}"):
        # through sh: setpriv's own exec may still resolve the path with root's capabilities
        if subprocess.run([*as_user, "sh", "-c", 'exec "$0" -c "import mpi4py"', python],
                          env={"PYTHONPATH": site}, capture_output=True).returncode == 0:
            return python, site
    raise AssertionError(f"no {version} that {user.pw_name} may run imports mpi4py from {site} "
                         f"(scripts/bootstrap.sh installs python3)")


@pytest.fixture
def render():
    """render(program): the 2-worker job whose ranks run `program` (python source), its files
    laid out as the kubelet would; returns (job, base, root, remap, user)."""
    _need("setpriv")
    user = _test_user()
    python, site = _rank_python(user)
    cfg = config.load(None)
    made = []

    def make(program: str, **extra):
        # not under pytest's tmp_path: its parents are root-only (0700)
        base = Path(tempfile.mkdtemp(prefix="trainop-mpi-"))
        made.append(base)
        base.chmod(0o755)
        root = base / "etc-trainop"
        shm = base / "shm"  # the pod's /dev/shm (an emptyDir the user can write in)
        shm.mkdir(mode=0o1777)
        shm.chmod(0o1777)
        job = parse({"metadata": {"name": "j1", "namespace": "mpitest"},
                     "spec": {"workers": 2, "slotsPerWorker": 2,
                              "command": [python, "-c", program],
                              "env": [{"name": "TRAINOP_TEST", "value": "forwarded"},
                                      {"name": "PYTHONPATH", "value": site},
                                      {"name": "SAVED", "value": str(shm / "saved")}],
                              "securityContext": {"runAsUser": user.pw_uid, "runAsGroup": user.pw_gid},
                              **extra}}, cfg)

        def remap(text: str) -> str:  # the pod's paths, in this test's folder
            return text.replace(common.MOUNT_ROOT, str(root)).replace(dtj.WORKER_ENV, str(shm / "worker-env"))

        pod = dtj.render_worker(job, 0, attempt=0)
        volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
        mounts = {m["name"]: m["mountPath"] for m in pod["spec"]["containers"][0]["volumeMounts"]}
        secret = dtj.render_ssh_secret(job, *sshkeys.generate())
        config_map = dtj.render_config_map(job)
        fs_group = pod["spec"]["securityContext"]["fsGroup"]
        for name, files in (("ssh", {k: base64.b64decode(v).decode() for k, v in secret["data"].items()}),
                            ("mpi", config_map["data"])):
            _lay_out_volume(Path(remap(mounts[name])), volumes[name],
                            {k: remap(v) for k, v in files.items()}, fs_group)
        return job, base, root, remap, user

    yield make
    for base in made:
        shutil.rmtree(base)


@pytest.fixture
def rendered(render):
    return render(RANK_PROGRAM)


def test_ssh_key_is_readable_by_the_pods_user_only(rendered):
    job, _, root, _, user = rendered
    key = root / "ssh" / dtj.SSH_KEY
    st = key.stat()
    assert (st.st_uid, st.st_gid, st.st_mode & 0o7777) == (0, user.pw_gid, 0o440)
    as_user = _as_pod_user(dtj.render_worker(job, 0, attempt=0))
    assert subprocess.run([*as_user, "cat", str(key)], capture_output=True).returncode == 0
    other = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "cat", str(key)],
                           capture_output=True, text=True)
    assert other.returncode != 0 and "Permission denied" in other.stderr
    # the check ssh makes of its IdentityFile (and sshd of its HostKey), as the pod's user
    check = subprocess.run([*as_user, "ssh-keygen", "-y", "-f", str(key)], capture_output=True, text=True)
    assert check.returncode == 0 and check.stdout.startswith("ssh-ed25519 "), check.stderr
    # ...which refuses the same mode on a key the user owns: root's ownership is what makes 0440 fine
    own = root.parent / "own-key"
    shutil.copy(key, own)
    os.chown(own, user.pw_uid, user.pw_gid)
    own.chmod(0o440)
    refused = subprocess.run([*as_user, "ssh-keygen", "-y", "-f", str(own)], capture_output=True, text=True)
    assert refused.returncode != 0 and "UNPROTECTED PRIVATE KEY FILE" in refused.stderr, refused.stderr


def _worker_logs(base: Path) -> str:
    return "".join(f"--- {p.name}\n{p.read_text()}" for p in sorted(base.glob("worker-*.log")))


# Each "pod" runs in its own PID namespace, its shell the namespace's first process as in a
# container: its exit ends every process in it, and a SIGTERM reaches it only through a handler.
POD = ["unshare", "--pid", "--fork", "--mount-proc"]


def _start_workers(job, base: Path, remap, user) -> list[subprocess.Popen]:
    """The rendered worker command of each worker, as its pod's user, listening on 127.0.0.(2+i)."""
    workers = []
    for i in range(job.workers):
        pod = dtj.render_worker(job, i, attempt=0)
        (container,) = pod["spec"]["containers"]
        assert container["command"][:2] == ["sh", "-c"]
        address = f"127.0.0.{2 + i}"
        # Each pod has its own /dev/shm and /tmp; on one machine, give each worker its own,
        # or Open MPI's shared-memory files of the two "nodes" collide.
        private = base / f"worker-{i}-shm"
        private.mkdir(mode=0o700)
        os.chown(private, user.pw_uid, user.pw_gid)
        options = (f"-o ListenAddress={address} -o 'SetEnv="
                   f"OMPI_MCA_btl_vader_backing_directory={private} TMPDIR={private}'")
        script = re.sub(r"sshd_config( &)?\n", lambda m: f"sshd_config {options}{m[1] or ''}\n",
                        remap(container["command"][2]))
        log = (base / f"worker-{i}.log").open("w")
        # The container's environment as the kubelet gives it, plus what spec.podTemplate
        # could add: one variable of the worker's own, and one that spec.env sets too.
        env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
        env |= {"PATH": os.environ["PATH"], "HOME": user.pw_dir, "WORKER_ONLY": "from the worker",
                "TRAINOP_TEST": "the worker's own"}
        try:
            workers.append(_pod([*_as_pod_user(pod), "sh", "-c", script], env=env,
                                stdout=log, stderr=subprocess.STDOUT))
        except BaseException:
            _stop(workers)  # the ones already started: left running, they hold the next test's ports
            raise

    def listening():
        for proc in workers:
            assert proc.poll() is None, _worker_logs(base)
        return all(_accepts(f"127.0.0.{2 + i}", dtj.SSH_PORT) for i in range(job.workers))
    wait_until(listening, timeout=20, what="both sshd workers listening")
    return workers


def _launcher(job, base: Path, remap, user, **popen) -> subprocess.Popen:
    """The rendered launcher command, as the pod's user, in a private mount namespace whose
    /etc/hosts maps the workers' DNS names to their addresses."""
    hosts = base / "hosts"
    # a launcher that runs ranks (runLauncherAsWorker) is itself: 127.0.0.1
    hosts.write_text("127.0.0.1 localhost\n" + "".join(
        f"127.0.0.{2 + i} {dtj.host(job, i)}\n" for i in range(job.workers)) + "".join(
        f"127.0.0.1 {name}\n" for name in dtj.rank_hosts(job)[:job.launcher_as_worker]))
    launcher_pod = dtj.render_launcher(job, attempt=0)["spec"]["template"]
    launcher = launcher_pod["spec"]["containers"][0]
    env = {e["name"]: e["value"] for e in launcher["env"] if "value" in e}
    env |= {"PATH": os.environ["PATH"], "HOME": user.pw_dir}  # HOME: what the runtime sets
    # the pod's own /tmp (mpirun's session folder), as the workers have theirs: not the host's
    private = base / "launcher-tmp"
    private.mkdir(mode=0o700, exist_ok=True)
    os.chown(private, user.pw_uid, user.pw_gid)
    env["TMPDIR"] = str(private)
    command = [remap(part) for part in launcher["command"]]
    # root only for the private /etc/hosts; mpirun and ssh run as the pod's user
    return _pod(["sh", "-c", 'mount --bind "$0" /etc/hosts && exec "$@"', str(hosts),
                 *_as_pod_user(launcher_pod), *command], env=env, text=True, **popen)


def _first_process(pod: subprocess.Popen) -> int:
    """The host's pid of the pod's first process (unshare's child)."""
    def child():
        with open(f"/proc/{pod.pid}/task/{pod.pid}/children") as f:
            return (f.read().split() or [None])[0]
    return int(wait_until(child, timeout=10, what="the pod's first process"))


def _stop(pods: list[subprocess.Popen]) -> None:
    """SIGKILL to each pod's first process ends its namespace (unshare's --kill-child does not
    outlive setpriv's change of user), then unshare ends."""
    for pod in pods:
        if pod.poll() is None:
            try:
                os.kill(pod.first, signal.SIGKILL)
            except ProcessLookupError:
                pass
        pod.wait(10)


def _pod(command: list[str], **popen) -> subprocess.Popen:
    pod = subprocess.Popen([*POD, *command], **popen)
    pod.first = _first_process(pod)
    return pod


def test_launcher_runs_ranks_over_sshd_on_both_workers(rendered):
    _need("mpirun", "/usr/sbin/sshd", "unshare")
    job, base, root, remap, user = rendered
    workers = _start_workers(job, base, remap, user)
    try:
        started = time.monotonic()
        launcher = _launcher(job, base, remap, user, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        stdout, stderr = launcher.communicate(timeout=120)
        elapsed = time.monotonic() - started
    finally:
        _stop(workers)

    assert launcher.returncode == 0, f"launcher failed ({launcher.returncode}):\n{stdout}\n{stderr}\n{_worker_logs(base)}"
    lines = sorted(re.findall(r"rank \d+/\d+ via \S+ uid \d+ sum \d+ env \S+ worker .*", stdout))
    # every rank came through the sshd of its worker (hostfile order, 2 slots each) as the pod's
    # user, reached every other rank (allreduce), got the job's env (mpirun -x) despite sshd's
    # clean env, and the worker container's own env too (ssh_session), the job's winning
    assert lines == [f"rank {r}/4 via 127.0.0.{2 + r // 2} uid {user.pw_uid} sum 6 env forwarded worker from the worker"
                     for r in range(4)], stdout + stderr
    assert (base / "shm" / "worker-env").stat().st_mode & 0o077 == 0  # the job's user's alone
    print(f"mpirun over sshd: 4 ranks on 2 workers in {elapsed:.1f}s")


@pytest.mark.parametrize("mpirun", [
    # flags of the user's own, one of them replacing the operator's --map-by
    {"extraArgs": ["--map-by", "ppr:2:node", "--mca", "btl_tcp_if_include", "lo", "-x", "EXTRA"]},
    # the whole launcher command: the user's own mpirun, given the operator's hostfile, rank
    # count and ssh through $(VAR) (Kubernetes' spelling), and forwarding by itself
    {"command": ["mpirun", "-np", "$(TRAINOP_NUM_RANKS)", "--hostfile", "$(TRAINOP_HOSTFILE)",
                 "--mca", "plm_rsh_agent", "$(TRAINOP_SSH)", "--mca", "orte_keep_fqdn_hostnames", "1",
                 "--bind-to", "none", "-x", "PATH", "-x", "PYTHONPATH", "-x", "TRAINOP_TEST", "-x", "EXTRA"]},
], ids=["extra-args", "own-command"])
def test_the_users_mpirun_flags_and_launcher_command_run_over_sshd(render, mpirun):
    """Issue 25: spec.mpirun as rendered, on real Open MPI and sshd."""
    _need("mpirun", "/usr/sbin/sshd", "unshare")
    user = _test_user()
    python, _ = _rank_python(user)
    if "command" in mpirun:
        mpirun = {"command": [*mpirun["command"], python, "-c", RANK_PROGRAM]}
    job, base, root, remap, user = render(RANK_PROGRAM, mpirun=mpirun,
                                          env=[{"name": "TRAINOP_TEST", "value": "forwarded"},
                                               {"name": "PYTHONPATH", "value": _rank_python(user)[1]},
                                               {"name": "EXTRA", "value": "x"}])
    stdout, stderr, lines = _run_gang(job, base, remap, user)
    assert lines == [f"rank {r}/4 via 127.0.0.{2 + r // 2} uid {user.pw_uid} sum 6 env forwarded"
                     for r in range(4)], stdout + stderr


def _run_gang(job, base: Path, remap, user) -> tuple[str, str, list[str]]:
    """The rendered workers' sshd and launcher run to the end: (stdout, stderr, the ranks'
    report lines sorted); the launcher must succeed."""
    workers = _start_workers(job, base, remap, user)
    try:
        launcher = _launcher(job, base, remap, user, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        stdout, stderr = launcher.communicate(timeout=120)
    finally:
        _stop(workers)
    assert launcher.returncode == 0, f"launcher failed ({launcher.returncode}):\n{stdout}\n{stderr}\n{_worker_logs(base)}"
    return stdout, stderr, sorted(re.findall(r"rank \d+/\d+ via \S+ uid \d+ sum \d+ env \S+", stdout))


def test_a_launcher_that_runs_ranks_starts_its_own_locally_and_the_workers_over_sshd(render):
    """Issue 25, runLauncherAsWorker: the launcher is the hostfile's first host; Open MPI knows
    it as itself (its name resolves to its own address) and starts those ranks, rank 0 among
    them, directly; the workers' over their sshd."""
    _need("mpirun", "/usr/sbin/sshd", "unshare")
    job, base, root, remap, user = render(RANK_PROGRAM, mpirun={"runLauncherAsWorker": True})
    assert job.total_slots == 6
    stdout, stderr, lines = _run_gang(job, base, remap, user)
    via = ["local", "local", "127.0.0.2", "127.0.0.2", "127.0.0.3", "127.0.0.3"]
    assert lines == [f"rank {r}/6 via {via[r]} uid {user.pw_uid} sum 15 env forwarded" for r in range(6)], \
        stdout + stderr


# Ranks that save on SIGTERM as the trainer does: every rank learns of a stop through an
# allreduce, rank 0 writes (slowly), a barrier, then all end with 143.
STOPPING_PROGRAM = """
import os, signal, sys, time
from mpi4py import MPI
comm = MPI.COMM_WORLD
stop = []
signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
os.write(1, f"rank {comm.rank} running\\n".encode())
i = 0
while not comm.allreduce(len(stop)):
    i += 1
    time.sleep(0.02)
if comm.rank == 0:
    time.sleep(2)
    with open(os.environ["SAVED"], "w") as f:
        f.write(str(i))
comm.barrier()
os.write(1, f"rank {comm.rank} stopped at {i} by {len(stop)}\\n".encode())
sys.exit(143)
"""


def test_a_stopping_gang_lets_its_ranks_save_before_they_end(render):
    """The kubelet stops every pod of the gang at once (the operator deleted them: an eviction,
    a preemption): SIGTERM to each pod's first process only. The workers' shells hand it to
    their ranks (not to sshd, whose exit would end the pod at once; not to orted, which would
    kill its ranks), the launcher's shell lets mpirun run on: the ranks agree, rank 0 saves,
    and everything ends on its own, well inside a grace period."""
    _need("mpirun", "/usr/sbin/sshd", "unshare")
    job, base, root, remap, user = render(STOPPING_PROGRAM)
    workers = _start_workers(job, base, remap, user)
    log = base / "launcher.log"
    with log.open("w") as out:
        launcher = _launcher(job, base, remap, user, stdout=out, stderr=subprocess.STDOUT)
    pods = [launcher, *workers]
    try:
        wait_until(lambda: log.read_text().count("running") == 4 or launcher.poll() is not None,
                   timeout=60, what="four ranks running")
        assert launcher.poll() is None, log.read_text()
        stopped_at = time.monotonic()
        for pod in pods:
            os.kill(pod.first, signal.SIGTERM)
        for pod in pods:
            pod.wait(timeout=30)
        took = time.monotonic() - stopped_at
    finally:
        _stop(pods)
    text = log.read_text()
    saved = (base / "shm" / "saved").read_text()
    # every rank stopped at the iteration rank 0 saved, each told by its own worker's shell
    assert sorted(re.findall(r"rank \d stopped at \d+ by \d", text)) == \
        [f"rank {r} stopped at {saved} by 1" for r in range(4)], text + _worker_logs(base)
    assert "trainop: stopping: the ranks save and end, mpirun with them" in text
    assert [w.returncode for w in workers] == [143, 143], _worker_logs(base)
    print(f"a stopping gang: saved and ended in {took:.1f}s")
