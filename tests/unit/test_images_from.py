"""How the image builder gives an unchanged Dockerfile the images its FROM lines name
(devcluster/images.py): the MPI Operator's own files (tests/fixtures/peers/mpi-operator) and a
user's folder (`trainop devcluster images build`). Only hashing and parsing: no build (the
builds run in tests/e2e/test_peer_images.py and test_user_images.py)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from trainop.devcluster import images

PEER = Path(images.REPO_ROOT) / images.PEER_DIR
PI = PEER / "examples" / "v2beta1" / "pi"


def test_from_names_substitutes_args_and_skips_the_dockerfiles_own_stages():
    text = (PI / "Dockerfile").read_text()
    assert images.from_names(text, {"BASE_LABEL": "v0.8.2"}) == [
        "mpioperator/openmpi-builder:v0.8.2", "mpioperator/openmpi:v0.8.2"]
    own = "ARG BASE=debian:trixie\nFROM ${BASE} AS build\nRUN true\nFROM build\nFROM --platform=x $BASE\n"
    assert images.from_names(own, {}) == ["debian:trixie"]
    assert images.from_names(own, {"BASE": "debian:bookworm-slim"}) == ["debian:bookworm-slim"]


def test_the_mpi_operator_images_are_built_from_their_own_files_as_its_makefile_builds_them():
    base = images.IMAGES["mpi-operator-base"]
    assert (base.base, base.base_as, base.refs) == ("trixie", "debian:trixie", ("mpioperator/base:v0.8.2",))
    pi = images.IMAGES["mpi-operator-pi-openmpi"]
    assert pi.refs == ("mpioperator/mpi-pi:openmpi",)  # as the MPI Operator's pi.yaml names it
    assert pi.parents == (("mpioperator/openmpi-builder:v0.8.2", "mpi-operator-openmpi-builder"),
                          ("mpioperator/openmpi:v0.8.2", "mpi-operator-openmpi"))
    assert dict(pi.build_args) == {"BASE_LABEL": "v0.8.2"}
    # every FROM of every file is given: the base, or a parent under the name it uses
    for name, image in images.IMAGES.items():
        if name.startswith("mpi-operator-"):
            text = (images.REPO_ROOT / image.dockerfile).read_text()
            given = {image.base_as} | {from_name for from_name, _ in image.parents}
            assert set(images.from_names(text, dict(image.build_args))) == given - {None}, name
            assert not image.default, name


def test_a_parents_change_changes_every_child_hash(monkeypatch):
    """The content hash of the pi image covers its parents' (and theirs: the base's)."""
    before = {name: images.plan(name).hash for name in ("mpi-operator-pi-openmpi", "mpi-operator-openmpi-builder")}
    base = images.IMAGES["mpi-operator-base"]
    monkeypatch.setitem(images.IMAGES, "mpi-operator-base",
                        dataclasses.replace(base, build_args=(("port", "2223"),)))
    assert images.plan("mpi-operator-pi-openmpi").hash != before["mpi-operator-pi-openmpi"]
    # a sibling not built on the base keeps its hash (and its cached archive)
    assert images.plan("mpi-operator-openmpi-builder").hash == before["mpi-operator-openmpi-builder"]


def test_a_users_folder_names_its_bases_and_parents_by_the_names_they_carry():
    pi = images.user_image(PI, "team/pi:1", build_args={"BASE_LABEL": "v0.8.2"})
    assert (pi.name, pi.refs, pi.base) == ("user-team-pi-1", ("team/pi:1",), None)
    assert [parent for _, parent in pi.parents] == ["mpi-operator-openmpi-builder", "mpi-operator-openmpi"]
    base = images.user_image(PEER / "build" / "base", "team/base")
    assert (base.base, base.base_as, base.refs) == ("trixie", "debian:trixie", ("team/base:latest",))
    assert images.plan(base).files[0][0] == "sshd_config"  # what its COPY names, nothing more


def test_a_from_this_builder_cannot_make_is_refused_with_what_it_can():
    with pytest.raises(images.ImageBuildError) as err:  # Intel's: `FROM bash` (Docker Hub)
        images.user_image(PEER / "build" / "base", "team/intel:1", "intel.Dockerfile", {"BASE_LABEL": "v0.8.2"})
    assert "FROM bash: not an image this builder makes" in str(err.value)
    assert "debian:trixie" in str(err.value) and "mpioperator/openmpi:v0.8.2" in str(err.value)
    assert "trainop devcluster images load" in str(err.value)
    with pytest.raises(images.ImageBuildError, match="no Dockerfile in"):
        images.user_image(PEER, "team/x:1")


def test_references_are_named_as_the_kubelet_looks_them_up():
    assert images.split_reference("team/x:1") == ("team/x", "1")
    assert images.split_reference("localhost:5000/team/x") == ("localhost:5000/team/x", "latest")
    assert images.cri_name("localhost/team/x:2") == "localhost/team/x:2"
    assert images.cri_name("team/x:1") == images.containerd_refs("mpi-pi")[1].replace("trainop/mpi-pi:0.1.0", "team/x:1")


def test_loading_one_pi_image_leaves_the_other_under_its_sibling_tag():
    """The two pi images share a repository (mpioperator/mpi-pi:openmpi, :mpich), so their
    content-hash names do too: loading one removes its own older builds only."""
    repo = "docker.io/mpioperator/mpi-pi"
    present = {f"{repo}:1111111111111111": "sha256:o", f"{repo}:openmpi": "sha256:o", "sha256:oid": "sha256:o",
               f"{repo}:2222222222222222": "sha256:m-old", f"{repo}:mpich": "sha256:m-old",
               f"{repo}:3333333333333333": "sha256:m-older", "sha256:molderid": "sha256:m-older"}
    refs = [f"{repo}:4444444444444444", f"{repo}:mpich"]
    assert images._older_builds(present, refs, "sha256:m") == {
        f"{repo}:2222222222222222", f"{repo}:mpich",  # still named as this image: the build before
        f"{repo}:3333333333333333", "sha256:molderid"}  # only a content-hash name and an ID left
