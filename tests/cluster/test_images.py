"""The project's images (trainop.devcluster.images), built here from its own Dockerfiles and loaded
into a real containerd: what can be proven without a kubelet. The containerd is the test's own
(socket and state in a temporary folder, CRI plugin off); its root (content store and overlayfs
snapshots) is kept under $TRAINOP_CACHE/images so that a warm run imports nothing."""

from __future__ import annotations

import subprocess
import uuid

import pytest

from tests.fixtures.waiting import wait_until
from trainop.devcluster import images
from trainop.devcluster.build import build_lock
from trainop.paths import REPO_ROOT

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(3600)]  # cold: the trainer build takes minutes

LOADED = ["pause", "operator", "trainer-pytorch"]


@pytest.fixture(scope="module")
def built():
    """Every image the tests load, built once (bootstrap already did, in CI)."""
    return {r.name: r for r in images.ensure(LOADED)}


@pytest.fixture(scope="module")
def containerd(built, tmp_path_factory):
    """A private containerd; yields its socket address. Stopped (and its state removed) after."""
    images._need_tools({"containerd": "containerd", "ctr": "containerd", "runc": "runc"})
    tmp = tmp_path_factory.mktemp("containerd")
    root = images.images_dir() / "containerd-test"
    address = str(tmp / "containerd.sock")
    config = tmp / "config.toml"
    config.write_text(f"""version = 2
root = "{root}"
state = "{tmp / 'state'}"
disabled_plugins = ["io.containerd.grpc.v1.cri"]
[grpc]
  address = "{address}"
[ttrpc]
  address = "{address}.ttrpc"
[plugins."io.containerd.internal.v1.opt"]
  path = "{tmp / 'opt'}"
""")
    with build_lock("containerd-test"):  # one session at a time on the shared root
        log = (tmp / "containerd.log").open("w")
        proc = subprocess.Popen(["containerd", "--config", str(config)], stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_until(lambda: proc.poll() is not None or ctr(address, "version").returncode == 0,
                       timeout=60, what="containerd to answer")
            assert proc.poll() is None, (tmp / "containerd.log").read_text()
            yield address  # images.load removes older builds before it imports (the root is kept)
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            log.close()


def ctr(address: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(["ctr", "--address", address, "--namespace", images.NAMESPACE, *args],
                          capture_output=True, text=True, timeout=timeout)


def run_in(address: str, image: str, *command: str) -> subprocess.CompletedProcess:
    """`ctr run --rm` a command in the image (as the image's USER), and return how it went."""
    return ctr(address, "run", "--rm", image, f"test-{uuid.uuid4().hex[:10]}", *command)


@pytest.fixture(scope="module")
def loaded(containerd, built):
    images.load(containerd, LOADED)
    return containerd


def test_images_are_named_as_the_operator_renders_them():
    from trainop import config
    from trainop.render import datastage

    refs = {name: images.containerd_refs(name) for name in images.IMAGES}
    assert f"docker.io/{datastage.DEFAULTS['image']}" in refs["operator"]
    assert f"docker.io/{datastage.DEFAULTS['nfsServerImage']}" in refs["nfs-server"]
    for framework, image in config.DEFAULTS["images"].items():
        assert f"docker.io/{image}" in refs[f"trainer-{framework}"]
    # The content hash names each image too; the pause image has no other name.
    assert refs["pause"] == [images.reference("pause")]
    assert images.reference("pause").startswith("localhost/trainop/pause:")


def test_content_hash_covers_what_the_dockerfile_copies(tmp_path, monkeypatch):
    text = (REPO_ROOT / "operator" / "Dockerfile").read_text()
    assert images.copy_sources(text) == ["operator/requirements.lock", "pyproject.toml", "README.md",
                                         "operator", "crds"]
    assert images.copy_sources((REPO_ROOT / "trainer_images" / "Dockerfile").read_text()) == \
        ["install.sh", "trainer"]
    # A copied file changes the hash, an ignored one (bytecode) does not.
    context = tmp_path / "nfs"
    context.mkdir()
    (context / "Dockerfile").write_text("ARG DEBIAN_IMAGE=x\nFROM ${DEBIAN_IMAGE}\nCOPY entrypoint.sh /e\n")
    (context / "entrypoint.sh").write_text("#!/bin/sh\n")
    monkeypatch.setattr(images, "REPO_ROOT", tmp_path)
    monkeypatch.setitem(images.IMAGES, "probe", images.Image("probe", "trainop/probe", "nfs/Dockerfile", "nfs"))
    first = images.plan("probe").hash
    (context / "__pycache__").mkdir()
    (context / "__pycache__" / "x.pyc").write_bytes(b"\0")
    assert images.plan("probe").hash == first
    (context / "entrypoint.sh").write_text("#!/bin/sh\nexit 0\n")
    assert images.plan("probe").hash != first


def test_trainer_build_reads_the_mounted_cache_and_leaves_none_in_the_image():
    text = (REPO_ROOT / "trainer_images" / "Dockerfile").read_text()
    # Without BUILD_CACHE (docker build, az acr build) the step downloads into $TRAINOP_CACHE and
    # deletes it; with it, the step reads the mounted cache and the image never holds it.
    assert text.count('TRAINOP_CACHE="${BUILD_CACHE:-$TRAINOP_CACHE}"') == 2
    assert text.count('rm -rf /var/lib/apt/lists/* "$TRAINOP_CACHE"') == 2
    assert images.plan("trainer-pytorch").build_args["BUILD_CACHE"] == images.CACHE_IN_BUILD
    # The wheel the host's tests exercised goes into the image (when bootstrap built one).
    wheel = images.horovod_wheel()
    if wheel is not None:
        assert images.plan("trainer-pytorch").build_args["HOROVOD_WHEEL"].endswith(wheel.name)


def test_warm_run_builds_nothing(built):
    # (ensure first: others may have changed a hashed file since the fixture ran.)
    first = {r.name: r.archive for r in images.ensure(LOADED)}
    again = images.ensure(LOADED)
    assert [r.built for r in again] == [False] * len(LOADED)
    assert all(r.seconds < 10 for r in again), [(r.name, r.seconds) for r in again]
    assert {r.name: r.archive for r in again} == first


def test_load_names_every_image_and_a_second_load_imports_nothing(loaded):
    images.load(loaded, LOADED)  # (the tree may have changed since the fixture loaded)
    present = images.containerd_images(loaded)
    for result in images.ensure(LOADED):
        assert result.refs[1:] == images.containerd_refs(result.name)[1:]  # the rendered names
        for ref in result.refs:
            assert present.get(ref) == result.meta["digest"], (result.name, ref)
    assert images.load(loaded, LOADED) == {name: False for name in LOADED}


def test_load_removes_an_images_older_builds_by_every_name(loaded):
    """An older build of the operator image (here: the mpi-pi image under an older content-hash
    tag of the operator's repository, and under the image-ID name the CRI plugin gives every
    image, which alone would keep its layers) is removed when the operator is loaded; another
    image that shares no name with it stays, and so does another image under another tag of the
    operator's repository (as the MPI Operator's pi images share mpioperator/mpi-pi)."""
    mpi_pi = images.ensure(["mpi-pi"])[0]
    images.load(loaded, ["mpi-pi"])
    operator = images.ensure(["operator"])[0]
    older = operator.refs[0].rpartition(":")[0] + ":0123456789abcdef"
    alias = "sha256:" + "0" * 64
    for name in (older, alias):
        ctr(loaded, "images", "tag", "--force", mpi_pi.refs[0], name)
    sibling = operator.refs[-1].rpartition(":")[0] + ":another-image"
    ctr(loaded, "images", "tag", "--force", images.reference("pause"), sibling)
    for ref in mpi_pi.refs:  # the old build's own names gone, as after a rebuild
        ctr(loaded, "images", "rm", ref)
    assert images.containerd_images(loaded)[alias] == mpi_pi.meta["digest"]
    assert images.load(loaded, ["operator"]) == {"operator": False}  # current already: only the old goes
    present = images.containerd_images(loaded)
    assert older not in present and alias not in present
    assert present[operator.refs[0]] == operator.meta["digest"]
    assert present[sibling] == present[images.reference("pause")]
    ctr(loaded, "images", "rm", sibling)


def test_pause_runs_until_sigterm_and_exits_0(loaded):
    task = f"pause-{uuid.uuid4().hex[:10]}"
    proc = subprocess.Popen(["ctr", "--address", loaded, "--namespace", images.NAMESPACE, "run", "--rm",
                             images.reference("pause"), task], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        wait_until(lambda: f"{task} " in ctr(loaded, "task", "ls").stdout and
                   "RUNNING" in ctr(loaded, "task", "ls").stdout, timeout=60, what="the pause task to run")
        assert ctr(loaded, "task", "kill", "--signal", "SIGTERM", task).returncode == 0
        assert proc.wait(timeout=60) == 0  # ctr run exits with the task's status: pause's own 0
    finally:
        if proc.poll() is None:
            ctr(loaded, "task", "kill", "--signal", "SIGKILL", task)
            proc.wait(timeout=60)


def test_operator_image_runs_trainop_as_uid_10001(loaded):
    image = "docker.io/" + images.IMAGES["operator"].refs[0]
    ids = run_in(loaded, image, "id")
    assert ids.returncode == 0 and ids.stdout.startswith("uid=10001(trainop) gid=10001(trainop)"), ids
    help_ = run_in(loaded, image, "trainop", "--help")
    assert help_.returncode == 0 and "operator" in help_.stdout, help_


def test_trainer_image_imports_torch_horovod_and_the_trainer(loaded):
    image = "docker.io/" + images.IMAGES["trainer-pytorch"].refs[0]
    imports = run_in(loaded, image, "python", "-c",
                     "import torch, horovod.torch, trainop_trainer; print(torch.__version__)")
    assert imports.returncode == 0 and imports.stdout.startswith("2."), imports
    user = run_in(loaded, image, "sh", "-c",
                  "id trainop && getent passwd trainop && stat -c %u:%g:%a /home/trainop "
                  "&& command -v mpirun sshd ssh && env")
    assert user.returncode == 0, user
    lines = user.stdout.splitlines()
    assert lines[0] == "uid=10001(trainop) gid=10001(trainop) groups=10001(trainop)"
    assert lines[1] == "trainop:x:10001:10001::/home/trainop:/bin/sh"
    assert lines[2].startswith("10001:10001:")
    assert "OMPI_ALLOW_RUN_AS_ROOT=1" in lines and "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1" in lines
    # No compiler and no baked-in sshd host key reach the image (keys come from the job's Secret).
    leftovers = run_in(loaded, image, "sh", "-c", "for c in gcc cc c++ cmake make; do command -v $c; done; "
                       "ls /etc/ssh/ssh_host_* /var/cache/apt/archives/*.deb 2>/dev/null")
    assert leftovers.stdout == "", leftovers


def test_a_pod_user_can_run_sshd_and_ssh(loaded, tmp_path):
    """As uid 10001, sshd accepts a config on port 2222 and the ssh client finds its user."""
    image = "docker.io/" + images.IMAGES["trainer-pytorch"].refs[0]
    script = ("set -e; cd /tmp; ssh-keygen -q -t ed25519 -N '' -f key; "
              "printf 'Port 2222\\nHostKey /tmp/key\\nPidFile none\\nUsePAM no\\n' > sshd_config; "
              "/usr/sbin/sshd -t -f sshd_config; ssh -G localhost | grep -E '^user '")
    proc = run_in(loaded, image, "setpriv", "--reuid=10001", "--regid=10001", "--clear-groups",
                  "sh", "-c", script)
    assert proc.returncode == 0, proc
    assert proc.stdout.strip().endswith("user trainop"), proc
