"""`trainop devcluster images`: the project's container images, built on this machine from the
project's own Dockerfiles without Docker Hub or a Docker engine, cached by content hash, and
loaded into a containerd (the dev cluster's real nodes, or a test's private containerd).

    from trainop.devcluster import images
    archives = images.ensure_images()                  # {name: OCI archive}, builds what is missing
    images.load("/run/x/containerd.sock")              # imports them into namespace k8s.io
    images.sandbox_image()                             # containerd's sandbox_image

How an image comes to be:
- The base is Debian's own packages: `mmdebstrap --variant=minbase bookworm` (from the apt mirror
  this machine's apt uses, read from its sources at run time) → `podman import` as
  `localhost/trainop-base:bookworm-<base>-<key>`. Its tar is cached by the hash of the arguments.
- Every Dockerfile takes its base as a build ARG (PYTHON_IMAGE, CUDA_IMAGE, DEBIAN_IMAGE); the
  public default stays, so `docker build` and `az acr build` build the same files unchanged.
- `buildah bud` builds from a staged context that holds exactly what the Dockerfile's COPY lines
  name (less __pycache__/egg-info), which is also exactly what the content hash covers: the
  Dockerfile, those files, the target, the build args, the base's key (and, for the trainer, the
  Horovod wheel it installs). RUN steps use the host's network (no NAT of build traffic).
- The trainer and operator builds see $TRAINOP_CACHE (pip downloads, wheelhouse, the Horovod wheel
  that install.sh built for the host's .venv: same Debian 12 and CPython 3.11, so ABI-compatible)
  as an overlay at /mnt during RUN steps (`buildah bud -v CACHE:/mnt:O`; the Dockerfiles'
  BUILD_CACHE/HOROVOD_WHEEL args): readable, writable, every write thrown away with the step, so
  nothing is downloaded twice, nothing of it stays in an image, and nothing can change or delete
  the host's cache. Where the host's pip trusts its own CA bundle (a TLS-inspecting proxy), a
  copy of it goes there too and the build's pip gets it as PIP_CERT.
- The result is saved as an OCI archive (zstd layers) at `$TRAINOP_CACHE/images/<name>-<hash>.tar`
  with a `.json` beside it (digest, sizes, build time), and removed from podman's storage. A warm
  run only hashes files and finds the archives. Disk: building the trainer (5.3 GB unpacked) takes
  about 17 GB for a while (build container, buildah's commit copy, the layer, the archive).

Names: the archives and containerd carry `docker.io/<repo>:<content hash>` and the names the
operator renders (`trainop/operator:0.1.0`, `trainop/trainer-pytorch:0.1.0`, ...), in the form
containerd's CRI looks them up: `docker.io/trainop/operator:0.1.0`. The pause image is
`localhost/trainop/pause:<hash>` (see reference()).
"""

from __future__ import annotations

import contextlib
import fnmatch
import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

from trainop import config
from trainop.devcluster.build import build_lock
from trainop.paths import REPO_ROOT, cache_dir
from trainop.render import datastage

# Bump to rebuild every image (a change of how images are built that no hashed input shows).
RECIPE = "2"
# Another content hash of an image (or another base) is deleted after a build only once nobody
# has used it for this long: sessions running older code share the cache.
STALE_SECONDS = 3600
# Where RUN steps see $TRAINOP_CACHE (an overlay: writes vanish with the step). An existing empty
# folder of every base, so that no mount point is left behind in an image.
CACHE_IN_BUILD = "/mnt"
NAMESPACE = "k8s.io"  # containerd namespace of the CRI plugin
PAUSE_DIR = Path(__file__).resolve().parent / "pause"
PAUSE_CFLAGS = ("-Os", "-Wall", "-Werror", "-static", "-s")
# Never part of a context (hash or build): caches of tools that ran in the source tree.
IGNORED = ("__pycache__", "*.pyc", "*.egg-info", ".pytest_cache", ".mypy_cache")
# Debian tools the builds need, and the packages that bring them.
TOOLS = {"buildah": "buildah", "podman": "podman", "mmdebstrap": "mmdebstrap", "gcc": "gcc"}
LOAD_TOOLS = {"ctr": "containerd"}


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class ImageBuildError(RuntimeError):
    """A build step failed; the message names the image, the step and the log file."""


def images_dir() -> Path:
    path = cache_dir() / "images"
    path.mkdir(parents=True, exist_ok=True)
    return path


# ---- base images from Debian's packages --------------------------------------------------------
@dataclass(frozen=True)
class Base:
    name: str
    include: tuple[str, ...] = ()
    suite: str = "bookworm"
    variant: str = "minbase"
    # Like Debian's slim images: no manual pages, documentation or translations (kept for later
    # apt-get installs too: mmdebstrap writes these into the image's dpkg configuration).
    dpkgopts: tuple[str, ...] = ("path-exclude=/usr/share/man/*", "path-exclude=/usr/share/doc/*",
                                 "path-include=/usr/share/doc/*/copyright", "path-exclude=/usr/share/info/*",
                                 "path-exclude=/usr/share/locale/*", "path-include=/usr/share/locale/locale.alias")
    # Written into the image (not used while mmdebstrap runs), like Debian's docker-clean: apt
    # keeps neither the packages it downloads nor its binary caches, else every image's
    # apt-get install would leave its .debs behind.
    apt_conf: tuple[str, ...] = ('APT::Keep-Downloaded-Packages "false";', 'Dir::Cache::pkgcache "";',
                                 'Dir::Cache::srcpkgcache "";')
    # Merged /usr without the usrmerge package (which would pull Perl into every image).
    hooks: tuple[str, ...] = ("merged-usr",)
    env: tuple[str, ...] = ("PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "LANG=C.UTF-8")

    def options(self) -> list[str]:
        """mmdebstrap's options (all but the suite, the output and the mirrors)."""
        apt_conf = " ".join(shlex.quote(line) for line in self.apt_conf)
        return [f"--variant={self.variant}", "--format=tar",
                *(f"--dpkgopt={opt}" for opt in self.dpkgopts),
                *(f"--hook-dir=/usr/share/mmdebstrap/hooks/{hook}" for hook in self.hooks),
                f"--customize-hook=printf '%s\\n' {apt_conf} > \"$1/etc/apt/apt.conf.d/docker-clean\"",
                # (after the hooks: mmdebstrap's own cleanup would not find them with that configuration)
                '--customize-hook=rm -f "$1"/var/cache/apt/*.bin',
                *(["--include=" + ",".join(self.include)] if self.include else [])]

    @property
    def key(self) -> str:
        """Hash of what defines the base (the mirror is transport, not content: not in it)."""
        spec = [RECIPE, self.suite, self.options(), list(self.env)]
        return hashlib.sha256(json.dumps(spec).encode()).hexdigest()[:16]

    @property
    def ref(self) -> str:
        return f"localhost/trainop-base:{self.suite}-{self.name}-{self.key[:12]}"

    @property
    def tar(self) -> Path:
        return images_dir() / f"base-{self.suite}-{self.name}-{self.key}.tar"


BASES = {
    # The operator and the trainer: Python from Debian (bookworm: CPython 3.11, like the host .venv).
    "python": Base("python", ("ca-certificates", "passwd", "python3", "python3-venv", "python-is-python3")),
    "debian": Base("debian"),
    # The MPI Operator's images: `FROM debian:trixie` (Open MPI 5, OpenSSH 10).
    "trixie": Base("debian", suite="trixie"),
}


def apt_sources(suite: str = "bookworm") -> list[str]:
    """One-line `deb URI SUITE main` entries for mmdebstrap: the Debian mirror this machine's apt
    uses (its main, -updates and -security suites), read from /etc/apt at run time. Empty when apt
    has none for `suite` (mmdebstrap then picks its default mirror)."""
    stanzas: list[dict[str, str]] = []
    apt = Path("/etc/apt")
    for path in sorted(apt.glob("sources.list.d/*.sources")):
        for block in re.split(r"\n\s*\n", path.read_text(errors="replace")):
            fields: dict[str, str] = {}
            for line in block.splitlines():
                if line.startswith(("#", " ", "\t")) or ":" not in line:
                    continue
                key, value = line.split(":", 1)
                fields[key.strip().lower()] = value.strip()
            if fields.get("enabled", "yes").lower() != "no":
                stanzas.append(fields)
    for path in [apt / "sources.list", *sorted(apt.glob("sources.list.d/*.list"))]:
        if not path.is_file():
            continue
        for line in path.read_text(errors="replace").splitlines():
            words = re.sub(r"\[[^]]*\]", "", line.split("#", 1)[0]).split()
            if len(words) >= 4 and words[0] == "deb":
                stanzas.append({"types": "deb", "uris": words[1], "suites": words[2],
                                "components": " ".join(words[3:])})
    entries = [(uri, s) for fields in stanzas
               if "deb" in fields.get("types", "").split() and "main" in fields.get("components", "").split()
               for uri in fields.get("uris", "").split()[:1] for s in fields.get("suites", "").split()]
    own = {s for _, s in entries if "-" not in s}
    if suite not in own and len(own) == 1:
        # Another release than the host's (trixie on a bookworm host): the same mirror serves it.
        host_suite = own.pop()
        entries = [(uri, suite + s.removeprefix(host_suite)) for uri, s in entries if s.startswith(host_suite)]
    wanted = {suite, f"{suite}-updates", f"{suite}-security"}
    lines = list(dict.fromkeys(f"deb {uri} {s} main" for uri, s in entries if s in wanted))
    return lines if any(line.split()[2] == suite for line in lines) else []


def _touch(path: Path) -> None:
    with contextlib.suppress(OSError):
        os.utime(path)


def _unused(path: Path) -> bool:
    try:
        return time.time() - path.stat().st_mtime > STALE_SECONDS
    except OSError:
        return False


def ensure_base(base: Base, log=_log) -> str:
    """The base in podman's storage (from its cached tar, else mmdebstrap); returns its name."""
    _touch(base.tar)  # (in use: see STALE_SECONDS)
    if _podman_has(base.ref):
        return base.ref
    with build_lock(f"image-base-{base.name}"):
        if _podman_has(base.ref):
            return base.ref
        if not base.tar.is_file():
            _need_tools({"mmdebstrap": "mmdebstrap"}, log)
            log(f"images: base {base.ref}: mmdebstrap --variant={base.variant} {base.suite} (about a minute)")
            started = time.monotonic()
            partial = base.tar.with_suffix(".partial.tar")
            cmd = ["mmdebstrap", *base.options(), base.suite, str(partial), *apt_sources(base.suite)]
            _run(cmd, f"base-{base.name}", "mmdebstrap")
            partial.replace(base.tar)
            log(f"images: base {base.name} made in {time.monotonic() - started:.0f}s "
                f"({base.tar.stat().st_size / 1e6:.0f} MB)")
        changes = [f"ENV {kv}" for kv in base.env] + ['CMD ["/bin/bash"]']
        _run(["podman", "import", *(a for c in changes for a in ("--change", c)), str(base.tar), base.ref],
             f"base-{base.name}", "podman import")
        # Other versions of this base (another key) go, tar and image, once unused for a while
        # (podman's storage is shared with other caches: only the images of tars removed here).
        prefix = f"base-{base.suite}-{base.name}-"
        stale = []
        for other in images_dir().glob(f"{prefix}*.tar"):
            if other != base.tar and re.fullmatch(rf"{re.escape(prefix)}[0-9a-f]{{16}}\.tar", other.name) \
                    and _unused(other):
                other.unlink(missing_ok=True)
                stale.append(f"localhost/trainop-base:{base.suite}-{base.name}-{other.stem.removeprefix(prefix)[:12]}")
        if stale:  # (an image still used by another build stays: podman refuses)
            subprocess.run(["podman", "rmi", *stale], capture_output=True)
    return base.ref


# ---- the project's images --------------------------------------------------------------------
def _split(reference: str) -> tuple[str, str]:
    repo, _, tag = reference.rpartition(":")
    return repo, tag


@dataclass(frozen=True)
class Image:
    name: str
    repo: str                       # e.g. trainop/operator (containerd: docker.io/trainop/operator)
    dockerfile: str                 # relative to the repository
    context: str                    # relative to the repository
    tags: tuple[str, ...] = ()      # besides the content hash: the tags the operator renders
    target: str | None = None
    base: str | None = None         # key of BASES, passed as build ARG `base_arg`
    base_arg: str | None = None
    # Or the name the Dockerfile's FROM gives that base (`debian:trixie`), for a Dockerfile built
    # unchanged: the base is tagged under it for the build (see _from_names).
    base_as: str | None = None
    # (a name a FROM line gives, the IMAGES entry that is built as it), e.g. the MPI Operator's
    # `mpioperator/base:${BASE_LABEL}`: built first, and given that name for the build.
    parents: tuple[tuple[str, str], ...] = ()
    build_args: tuple[tuple[str, str], ...] = ()
    mount_cache: bool = False       # $TRAINOP_CACHE as an overlay at CACHE_IN_BUILD during RUN
    pip: bool = False               # RUN steps use pip (PIP_CERT, when the host needs one)
    default: bool = True            # built by `trainop devcluster images` without --only
    sources: tuple[str, ...] = ()   # hashed instead of the COPY sources (generated contexts)

    @property
    def refs(self) -> tuple[str, ...]:
        """The fixed names (as pods name them), e.g. trainop/operator:0.1.0."""
        return tuple(f"{self.repo}:{tag}" for tag in self.tags)


def _image(name: str, reference: str, **kw) -> Image:
    repo, tag = _split(reference)
    return Image(name, repo, tags=(tag,), **kw)


# Kubeflow's MPI Operator images (v0.8.2), built from its own files, unchanged
# (tests/fixtures/peers/mpi-operator): FROM debian:trixie, or FROM mpioperator/<parent>:${BASE_LABEL}
# as its Makefile builds them. Intel's are not built: their packages come from Intel's servers.
PEER_DIR = "tests/fixtures/peers/mpi-operator"
PEER_LABEL = "v0.8.2"


def _peer(name: str, dockerfile: str, parents: tuple[str, ...]) -> Image:
    """`mpi-operator-<name>`, named as the MPI Operator publishes it: mpioperator/<name>:v0.8.2,
    and the pi example mpioperator/mpi-pi:openmpi (or :mpich), as its examples' pods name it."""
    reference = f"mpioperator/mpi-pi:{name.removeprefix('pi-')}" if name.startswith("pi-") \
        else f"mpioperator/{name}:{PEER_LABEL}"
    path = f"{PEER_DIR}/{dockerfile}"
    return _image(f"mpi-operator-{name}", reference, dockerfile=path, context=path.rpartition("/")[0],
                  default=False, build_args=(("BASE_LABEL", PEER_LABEL),) if parents else (),
                  base=None if parents else "trixie", base_as=None if parents else "debian:trixie",
                  parents=tuple((f"mpioperator/{p}:{PEER_LABEL}", f"mpi-operator-{p}") for p in parents))


_TRAINER_ARGS = (("PYTHON", "python3.11"), ("TRAINOP_GPU", "0"), ("BUILD_CACHE", CACHE_IN_BUILD))
# The definitions. Names come from the code that renders them, so a pod's image is what was built.
IMAGES: dict[str, Image] = {image.name: image for image in (
    Image("pause", "localhost/trainop/pause", "operator/trainop/devcluster/pause/Dockerfile",
          "operator/trainop/devcluster/pause", sources=("pause.c",)),
    _image("operator", datastage.DEFAULTS["image"], dockerfile="operator/Dockerfile", context=".",
           base="python", base_arg="PYTHON_IMAGE", mount_cache=True, pip=True),
    _image("nfs-server", datastage.DEFAULTS["nfsServerImage"], dockerfile="trainer_images/nfs-server/Dockerfile",
           context="trainer_images/nfs-server", base="debian", base_arg="DEBIAN_IMAGE"),
    # `datastage.server: kernel`: needs the node's nfsd module, which this machine's kernel lacks,
    # so no dev cluster runs it; built on request only.
    _image("nfs-server-kernel", datastage.DEFAULTS["nfsKernelServerImage"],
           dockerfile="trainer_images/nfs-server-kernel/Dockerfile", context="trainer_images/nfs-server-kernel",
           base="debian", base_arg="DEBIAN_IMAGE", default=False),
    # The CPU variant of the trainer images (same Dockerfile, build args): what the tests run.
    _image("trainer-pytorch", config.DEFAULTS["images"]["pytorch"], dockerfile="trainer_images/Dockerfile",
           context="trainer_images", target="pytorch", base="python", base_arg="CUDA_IMAGE",
           build_args=_TRAINER_ARGS, mount_cache=True, pip=True),
    _image("trainer-tensorflow", config.DEFAULTS["images"]["tensorflow"], dockerfile="trainer_images/Dockerfile",
           context="trainer_images", target="tensorflow", base="python", base_arg="CUDA_IMAGE",
           build_args=_TRAINER_ARGS, mount_cache=True, pip=True, default=False),
    _image("trainer-keras", config.DEFAULTS["images"]["keras"], dockerfile="trainer_images/Dockerfile",
           context="trainer_images", target="keras", base="python", base_arg="CUDA_IMAGE",
           build_args=_TRAINER_ARGS, mount_cache=True, pip=True, default=False),
    # A user's own MPI image with its own non-root user, as in the MPI Operator's examples (tests).
    _image("mpi-pi", "trainop/mpi-pi:0.1.0", dockerfile="tests/e2e/images/mpi-pi/Dockerfile",
           context="tests/e2e/images/mpi-pi", base="debian", base_arg="BASE"),
    *(_peer(*entry) for entry in (
        ("base", "build/base/Dockerfile", ()),
        ("openmpi", "build/base/openmpi.Dockerfile", ("base",)),
        ("openmpi-builder", "build/base/openmpi-builder.Dockerfile", ()),
        ("mpich", "build/base/mpich.Dockerfile", ("base",)),
        ("mpich-builder", "build/base/mpich-builder.Dockerfile", ()),
        ("pi-openmpi", "examples/v2beta1/pi/Dockerfile", ("openmpi-builder", "openmpi")),
        ("pi-mpich", "examples/v2beta1/pi/mpich.Dockerfile", ("mpich-builder", "mpich")))),
)}


# FROM names a user's Dockerfile may give the Debian bases (key of BASES): Docker Hub's names for
# them, made here from Debian's packages.
DEBIAN_NAMES = {f"debian:{name}{slim}": key for key, names in (("debian", ("bookworm", "12")),
                                                               ("trixie", ("trixie", "13")))
                for name in names for slim in ("", "-slim")}


def from_names(dockerfile_text: str, build_args: dict[str, str]) -> list[str]:
    """The images a Dockerfile's FROM lines name (not its own earlier stages), with ARGs
    (given, else their defaults) substituted."""
    text = re.sub(r"\\\n", " ", dockerfile_text)
    args, stages, out = {}, set(), []
    for line in text.splitlines():
        words = line.split()
        if len(words) >= 2 and words[0].upper() == "ARG" and not stages and not out:
            key, _, default = words[1].partition("=")
            args[key] = build_args.get(key, default)
        elif len(words) >= 2 and words[0].upper() == "FROM":
            rest = [w for w in words[1:] if not w.startswith("--")]
            name = re.sub(r"\$\{?(\w+)\}?", lambda m: args.get(m[1], ""), rest[0])
            if name not in stages and name not in out:
                out.append(name)
            if len(rest) >= 3 and rest[1].upper() == "AS":
                stages.add(rest[2])
    return out


def user_image(folder: Path, tag: str, dockerfile: str = "Dockerfile", build_args: dict | None = None) -> Image:
    """A user's Dockerfile folder as an Image (`trainop devcluster images build`). Its FROM lines
    may name Debian's bases (DEBIAN_NAMES, made by mmdebstrap) and the project's images by the
    names they carry (mpioperator/openmpi:v0.8.2, trainop/trainer-pytorch:0.1.0, ...): nothing
    is pulled. Only what its COPY/ADD lines name is sent (no .dockerignore is read)."""
    folder = folder.resolve()
    path = folder / dockerfile
    if not path.is_file():
        raise ImageBuildError(f"no {dockerfile} in {folder}")
    args = dict(build_args or {})
    built = {ref: name for name, image in IMAGES.items() for ref in image.refs}
    bases, parents = [], []
    for name in from_names(path.read_text(), args):
        if name in DEBIAN_NAMES:
            bases.append(name)
        elif name in built:
            parents.append((name, built[name]))
        else:
            raise ImageBuildError(
                f"{path}: FROM {name}: not an image this builder makes (nothing is pulled from a "
                f"registry). It makes {', '.join(sorted(DEBIAN_NAMES))} from Debian's packages, and "
                f"{', '.join(sorted(built))}; an image built elsewhere: `trainop devcluster images load`")
    if len(bases) > 1:
        raise ImageBuildError(f"{path}: FROM {' and '.join(bases)}: one Debian base per Dockerfile")
    repo, version = split_reference(tag)
    safe = re.sub(r"[^a-z0-9_.-]+", "-", f"{repo}-{version}".lower())
    return Image(f"user-{safe}", repo, str(path), str(folder), tags=(version,),
                 base=DEBIAN_NAMES[bases[0]] if bases else None, base_as=bases[0] if bases else None,
                 build_args=tuple(sorted(args.items())), parents=tuple(parents), default=False)


def copy_sources(dockerfile_text: str) -> list[str]:
    """The context paths a Dockerfile's COPY/ADD lines read (not those --from another stage)."""
    text = re.sub(r"\\\n", " ", dockerfile_text)
    out: list[str] = []
    for line in text.splitlines():
        words = line.strip()
        if not re.match(r"(?i)(copy|add)\s", words):
            continue
        rest = words.split(None, 1)[1].strip()
        args = json.loads(rest) if rest.startswith("[") else shlex.split(rest)
        if any(a.startswith("--from") for a in args):
            continue
        args = [a for a in args if not a.startswith("--")]
        out += [a for a in args[:-1] if a not in out]
    return out


def _ignored(name: str) -> bool:
    return any(fnmatch.fnmatch(name, pattern) for pattern in IGNORED)


def _context_files(root: Path, sources) -> list[tuple[str, Path]]:
    """(relative path, file) for every file under the given sources, sorted, ignores applied."""
    files: dict[str, Path] = {}
    for source in sources:
        matches = sorted(root.glob(source.lstrip("/"))) if any(c in source for c in "*?[") \
            else [root / source.lstrip("/")]
        for path in matches:
            if not path.exists() and not path.is_symlink():
                raise ImageBuildError(f"the Dockerfile copies {source}, which is not in {root}")
            if path.is_dir() and not path.is_symlink():
                for dirpath, dirnames, filenames in os.walk(path):
                    dirnames[:] = sorted(d for d in dirnames if not _ignored(d))
                    for f in filenames:
                        if not _ignored(f):
                            full = Path(dirpath) / f
                            files[full.relative_to(root).as_posix()] = full
            else:
                files[path.relative_to(root).as_posix()] = path
    return sorted(files.items())


# The extension a Horovod wheel must hold to serve a framework.
_HOROVOD_EXTENSION = {"pytorch": "horovod/torch/mpi_lib_v2", "tensorflow": "horovod/tensorflow/mpi_lib"}


def horovod_wheel(framework: str = "pytorch") -> Path | None:
    """The Horovod wheel install.sh built for, and installed into, the host's .venv (its marker
    names the build key) if it was built with `framework`, or None: the trainer image then
    builds Horovod itself."""
    for marker in sorted((REPO_ROOT / ".venv").glob(".trainop-horovod-*")):
        key = marker.name.removeprefix(".trainop-horovod-")
        for wheel in sorted((cache_dir() / "horovod" / "wheels" / key).glob("horovod-*.whl")):
            with zipfile.ZipFile(wheel) as archive:
                if any(n.startswith(_HOROVOD_EXTENSION[framework]) for n in archive.namelist()):
                    return wheel
    return None


@dataclass
class Plan:
    """One image as it would be built now: its inputs and their hash."""
    image: Image
    dockerfile_text: str
    files: list[tuple[str, Path]]
    build_args: dict[str, str]
    extra: dict[str, Path]  # more inputs: name in the hash -> file (the Horovod wheel)
    hash: str

    @property
    def hash_ref(self) -> str:
        return f"{_containerd_name(self.image.repo)}:{self.hash}"

    @property
    def archive(self) -> Path:
        return images_dir() / f"{self.image.name}-{self.hash}.tar"

    @property
    def meta_path(self) -> Path:
        return self.archive.with_suffix(".json")


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def plan(name: str | Image) -> Plan:
    """Hash an image's inputs (cheap: reads the files its Dockerfile copies)."""
    image = IMAGES[name] if isinstance(name, str) else name
    dockerfile = REPO_ROOT / image.dockerfile
    text = dockerfile.read_text()
    root = REPO_ROOT / image.context
    files = _context_files(root, image.sources or copy_sources(text))
    args = dict(image.build_args)
    extra: dict[str, Path] = {}
    framework = "pytorch" if image.target == "pytorch" else "tensorflow"
    if image.name.startswith("trainer-") and (wheel := horovod_wheel(framework)) is not None:
        rel = wheel.relative_to(cache_dir()).as_posix()
        args["HOROVOD_WHEEL"] = f"{CACHE_IN_BUILD}/{rel}"
        extra["horovod-wheel"] = wheel
    digest = hashlib.sha256()

    def feed(*parts: str) -> None:
        for part in parts:
            digest.update(part.encode() + b"\0")

    feed("recipe", RECIPE, "dockerfile", text, "target", image.target or "")
    feed("base", BASES[image.base].key if image.base else "")
    if image.base_as:
        feed("base-as", image.base_as)
    for from_name, parent in image.parents:
        feed("parent", from_name, plan(parent).hash)
    if image.name == "pause":
        feed("cflags", *PAUSE_CFLAGS)
    for key, value in sorted(args.items()):
        feed("arg", key, value)
    for rel, path in files:
        if path.is_symlink():
            feed("link", rel, os.readlink(path))
        else:
            feed("file", rel, str(os.stat(path).st_mode & 0o111 != 0), _sha256_file(path))
    for key, path in sorted(extra.items()):
        feed("extra", key, _sha256_file(path))
    return Plan(image, text, files, args, extra, digest.hexdigest()[:16])


def _containerd_name(repo: str) -> str:
    """How containerd's CRI names a reference: `trainop/x` → `docker.io/trainop/x`."""
    first = repo.split("/", 1)[0]
    if "/" in repo and ("." in first or ":" in first or first == "localhost"):
        return repo
    return f"docker.io/{repo}" if "/" in repo else f"docker.io/library/{repo}"


def split_reference(reference: str) -> tuple[str, str]:
    """`team/x:1` -> (team/x, 1); a reference without a tag is :latest (a registry's port is no tag)."""
    if ":" in reference.rsplit("/", 1)[-1]:
        repo, _, tag = reference.rpartition(":")
        return repo, tag
    return reference, "latest"


def cri_name(reference: str) -> str:
    """The name containerd's CRI looks a pod's image up by (`team/x:1` gets the default registry)."""
    repo, tag = split_reference(reference)
    return f"{_containerd_name(repo)}:{tag}"


def containerd_refs(name: str) -> list[str]:
    """Every name an image carries in containerd: content hash first, then the rendered names."""
    p = plan(name)
    return [p.hash_ref] + [_containerd_name(ref.rpartition(":")[0]) + ":" + ref.rpartition(":")[2]
                           for ref in p.image.refs]


def reference(name: str) -> str:
    """The image's content-hash name, as containerd knows it after load() (for the pause image:
    containerd's `sandbox_image`)."""
    return plan(name).hash_ref


def sandbox_image() -> str:
    """containerd's `sandbox_image` (CRI plugin): the pause image, by its content-hash name."""
    return reference("pause")


# ---- building ----------------------------------------------------------------------------------
@dataclass
class Result:
    name: str
    archive: Path
    built: bool          # False: found in the cache
    seconds: float       # this run's time for the image (hashing only, when cached)
    meta: dict

    @property
    def refs(self) -> list[str]:
        return self.meta["refs"]


_HOST_IN_URL = re.compile(r"(?<=://)[^/\s'\"]+")


def _run(cmd: list[str], name: str, step: str, log_file: Path | None = None) -> None:
    """Run a build step, its output appended to the log file, with the host names in URLs (the
    package mirrors and indexes) left out; raise ImageBuildError with the log's tail."""
    log_file = log_file or images_dir() / "logs" / f"{name}.log"
    log_file.parent.mkdir(parents=True, exist_ok=True)
    with log_file.open("a") as out:
        out.write("\n$ " + _HOST_IN_URL.sub("HOST", shlex.join(cmd)) + "\n")
        out.flush()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                text=True, errors="replace")
        for line in proc.stdout:
            out.write(_HOST_IN_URL.sub("HOST", line))
        returncode = proc.wait()
    if returncode != 0:
        tail = "".join(log_file.read_text(errors="replace").splitlines(keepends=True)[-30:])
        raise ImageBuildError(f"{name}: {step} failed (exit {returncode}); log {log_file}:\n{tail}")


def _podman_has(ref: str) -> bool:
    return subprocess.run(["podman", "image", "exists", ref], capture_output=True).returncode == 0 \
        if shutil.which("podman") else False


def _need_tools(tools: dict[str, str], log=_log) -> None:
    """Install the Debian packages of missing tools (as install.sh does for its own), as root."""
    missing = sorted({pkg for tool, pkg in tools.items() if shutil.which(tool) is None})
    if "gcc" in tools and shutil.which("gcc") and \
            not Path(subprocess.run(["gcc", "-print-file-name=libc.a"], capture_output=True,
                                    text=True).stdout.strip()).is_absolute():
        missing.append("libc6-dev")  # the static C library, for the pause binary
    if not missing:
        return
    if os.geteuid() != 0:
        raise ImageBuildError(f"building images needs {', '.join(missing)}: apt-get install them (as root)")
    log(f"images: apt-get install {' '.join(missing)}")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    subprocess.run(["apt-get", "update", "-qq"], check=True, env=env)
    subprocess.run(["apt-get", "install", "-y", "-qq", "--no-install-recommends", *missing], check=True, env=env)


def _stage(p: Plan, where: Path) -> Path:
    """A build context with exactly the hashed files; returns it (the Dockerfile lies beside it)."""
    context = where / "context"
    context.mkdir(parents=True)
    for rel, path in p.files:
        dest = context / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        if path.is_symlink():
            dest.symlink_to(os.readlink(path))
        else:
            shutil.copy2(path, dest)
    (where / "Dockerfile").write_text(p.dockerfile_text)
    if p.image.name == "pause":
        _run(["gcc", *PAUSE_CFLAGS, "-o", str(context / "pause"), str(context / "pause.c")], "pause", "gcc")
    return context


def _host_pip_cert() -> Path | None:
    """A copy, in the cache, of the CA bundle the host's pip is told to trust (PIP_CERT, the
    requests/OpenSSL variables, or `cert` in the site pip.conf), or None: pip's own is fine."""
    found = [os.environ.get(var) for var in ("PIP_CERT", "REQUESTS_CA_BUNDLE", "SSL_CERT_FILE")]
    for conf in (Path("/etc/pip.conf"), Path("/etc/xdg/pip/pip.conf")):
        if conf.is_file():
            found += re.findall(r"(?m)^\s*cert\s*=\s*(\S+)", conf.read_text(errors="replace"))
    source = next((Path(f) for f in found if f and Path(f).is_file()), None)
    if source is None:
        return None
    copy = images_dir() / "build-ca.pem"
    data = source.read_bytes()
    if not copy.is_file() or copy.read_bytes() != data:
        copy.write_bytes(data)
    return copy


def _build(p: Plan, log) -> dict:
    image = p.image
    log_file = images_dir() / "logs" / f"{image.name}-{p.hash}.log"
    log_file.parent.mkdir(parents=True, exist_ok=True)
    log_file.write_text("")
    started = time.monotonic()
    # Only the holder of this image's lock writes its partial archives: any there are left over.
    for partial in images_dir().glob(f"{image.name}-*.partial.tar"):
        partial.unlink(missing_ok=True)
    args = dict(p.build_args)
    if image.base and image.base_arg:
        args[image.base_arg] = ensure_base(BASES[image.base], log)
    # Every name it will have in containerd; podman's storage (shared with other caches' builds)
    # gets only the content-hash one, so that no build removes another's image by a shared tag.
    refs = [p.hash_ref] + [f"{_containerd_name(image.repo)}:{tag}" for tag in image.tags]
    log(f"images: building {image.name} ({image.dockerfile}"
        f"{', target ' + image.target if image.target else ''}); log {log_file}")
    with tempfile.TemporaryDirectory(prefix=f"{image.name}-", dir=images_dir()) as tmp:
        context = _stage(p, Path(tmp))
        # --force-rm: a failed build leaves no working container (gigabytes, for the trainer) behind
        # (buildah 1.28 takes it only beside --layers or --no-cache; there is no layer cache anyway).
        cmd = ["buildah", "bud", "--network", "host", "--pull=never", "--no-cache", "--force-rm",
               "-f", str(Path(tmp) / "Dockerfile")]
        cmd += ["-t", p.hash_ref]
        if image.target:
            cmd += ["--target", image.target]
        for key, value in sorted(args.items()):
            cmd += ["--build-arg", f"{key}={value}"]
        if image.mount_cache:
            # O: an overlay over the host's cache; writes vanish with each RUN step.
            cmd += ["-v", f"{cache_dir()}:{CACHE_IN_BUILD}:O"]
            if image.pip and (cert := _host_pip_cert()) is not None:
                cmd += ["--build-arg", f"PIP_CERT={CACHE_IN_BUILD}/{cert.relative_to(cache_dir()).as_posix()}"]
        cmd.append(str(context))
        with _from_names(image, log, log_file):
            _run(cmd, image.name, "buildah bud", log_file)
    built = time.monotonic() - started
    size = int(subprocess.run(["podman", "image", "inspect", "--format", "{{.Size}}", p.hash_ref],
                              capture_output=True, text=True, check=True).stdout.strip())
    partial = p.archive.with_suffix(".partial.tar")
    partial.unlink(missing_ok=True)
    # zstd: fast on 2 cores and half the trainer's size (in the cache and in each containerd,
    # which unpacks it since 1.5); gzip would take minutes.
    _run(["buildah", "push", "--quiet", "--compression-format", "zstd", "--compression-level", "3",
          p.hash_ref, f"oci-archive:{partial}:{p.hash_ref}"], image.name, "buildah push", log_file)
    digest = _archive_digest(partial)
    partial.replace(p.archive)
    # The archive is the cache: podman's copy would only pile up, one per content hash.
    subprocess.run(["podman", "rmi", p.hash_ref], capture_output=True)
    meta = {"name": image.name, "hash": p.hash, "digest": digest, "refs": refs,
            "image_bytes": size, "archive_bytes": p.archive.stat().st_size,
            "build_seconds": round(built, 1), "save_seconds": round(time.monotonic() - started - built, 1),
            "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    p.meta_path.write_text(json.dumps(meta, indent=1) + "\n")
    for other in images_dir().glob(f"{image.name}-*.json"):  # other builds of this image, once unused
        if other != p.meta_path and re.fullmatch(rf"{re.escape(image.name)}-[0-9a-f]{{16}}\.json", other.name) \
                and _unused(other):
            other.with_suffix(".tar").unlink(missing_ok=True)
            other.unlink(missing_ok=True)
    log(f"images: {image.name} built in {built:.0f}s, saved in {meta['save_seconds']:.0f}s "
        f"({size / 1e6:.0f} MB)")
    return meta


def _local_name(name: str) -> str:
    """Where buildah looks a FROM name up first in local storage: localhost/<name> for a name
    without a registry."""
    first = name.split("/", 1)[0]
    return name if "/" in name and ("." in first or ":" in first or first == "localhost") else f"localhost/{name}"


@contextlib.contextmanager
def _from_names(image: Image, log, log_file: Path):
    """The images the Dockerfile's FROM lines name, in podman's storage under those names while
    it builds (buildah runs with --pull=never: nothing is fetched from a registry): the base
    (`base_as`), and each parent loaded from its archive. One such build at a time: the names
    are shared, and a multi-stage build looks its later FROM up only when it gets there."""
    if not image.base_as and not image.parents:
        yield
        return
    with build_lock("image-from-names"):
        tagged: list[tuple[str, str]] = []  # (image, the name it has for the build)
        loaded: list[str] = []
        try:
            if image.base_as:
                tagged.append((ensure_base(BASES[image.base], log), _local_name(image.base_as)))
            for from_name, parent in image.parents:
                archive = plan(parent).archive
                pulled = subprocess.run(["podman", "pull", "--quiet", f"oci-archive:{archive}"],
                                        capture_output=True, text=True)
                if pulled.returncode != 0:
                    raise ImageBuildError(f"{image.name}: podman pull {archive}: {pulled.stderr.strip()}")
                loaded.append(pulled.stdout.split()[-1])
                tagged.append((loaded[-1], _local_name(from_name)))
            for ref, name in tagged:
                _run(["podman", "tag", ref, name], image.name, "podman tag", log_file)
            yield
        finally:
            for ref, name in tagged:  # (untag with the name: alone, it removes every name)
                subprocess.run(["podman", "untag", ref, name], capture_output=True)
            if loaded:
                subprocess.run(["podman", "rmi", *loaded], capture_output=True)


def _archive_digest(archive: Path) -> str:
    with tarfile.open(archive) as tar:
        index = json.load(tar.extractfile("index.json"))
    return index["manifests"][0]["digest"]


def _cached_meta(p: Plan) -> dict | None:
    try:
        meta = json.loads(p.meta_path.read_text())
    except (OSError, ValueError):
        return None
    if meta.get("hash") != p.hash or not p.archive.is_file():
        return None
    _touch(p.meta_path)  # (in use: see STALE_SECONDS)
    return meta


def _names(names) -> list[str]:
    if names is None:
        return [name for name, image in IMAGES.items() if image.default]
    unknown = [name for name in names if name not in IMAGES]
    if unknown:
        raise ValueError(f"unknown image {', '.join(unknown)}: known are {', '.join(IMAGES)}")
    return list(dict.fromkeys(names))


def ensure(names=None, log=_log) -> list[Result]:
    """Build (or find cached) each image; names=None: every default image."""
    return [ensure_image(IMAGES[name], log) for name in _names(names)]


def ensure_image(image: Image, log=_log) -> Result:
    """Build (or find cached) one image, its parents first."""
    for _, parent in image.parents:
        ensure_image(IMAGES[parent], log)
    started = time.monotonic()
    p = plan(image)
    meta = _cached_meta(p)
    if meta is None:
        _need_tools(TOOLS, log)
        with build_lock(f"image-{image.name}"):
            meta = _cached_meta(p)  # another process may have built it while we waited
            if meta is None:
                meta = _build(p, log)
                return Result(image.name, p.archive, True, time.monotonic() - started, meta)
    return Result(image.name, p.archive, False, time.monotonic() - started, meta)


def ensure_images(names=None, log=_log) -> dict[str, Path]:
    """Build what is missing; returns the OCI archive per image name."""
    return {r.name: r.archive for r in ensure(names, log)}


# ---- containerd --------------------------------------------------------------------------------
def _ctr(address: str, *args: str, timeout: float = 900) -> str:
    proc = subprocess.run(["ctr", "--address", address, "--namespace", NAMESPACE, *args],
                          capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise ImageBuildError(f"ctr {' '.join(args)}: {proc.stderr.strip() or proc.stdout.strip()}")
    return proc.stdout


def containerd_images(address: str) -> dict[str, str]:
    """{name: manifest digest} of the images in that containerd's k8s.io namespace."""
    out = {}
    for line in _ctr(address, "images", "ls").splitlines()[1:]:
        cols = line.split()
        if len(cols) >= 3:
            out[cols[0]] = cols[2]
    return out


def load(containerd_address: str, names=None, log=_log, snapshotter: str = "overlayfs") -> dict[str, bool]:
    """Import each image (built first if missing; names: image names, or ensure_images()'s dict)
    into the containerd at that address, namespace k8s.io, unpacked for `snapshotter` (the CRI
    plugin's, overlayfs by default), under all its names, after removing its older builds. An
    image whose every name already points at the same digest is skipped, so a second load only
    lists. Returns {name: True if imported, False if it was there}."""
    return load_results(containerd_address, ensure(names, log), log, snapshotter)


def load_results(containerd_address: str, results: list[Result], log=_log,
                 snapshotter: str = "overlayfs") -> dict[str, bool]:
    """load() of images already built (ensure()'s or ensure_image()'s results)."""
    _need_tools(LOAD_TOOLS, log)
    present = containerd_images(containerd_address)
    done = {}
    for result in results:
        digest, refs = result.meta["digest"], result.meta["refs"]
        # Older builds of this image go first: a trainer is gigabytes twice over (content and
        # unpacked snapshot), and a disk that holds one copy may not hold two.
        _remove(containerd_address, present, _older_builds(present, refs, digest))
        if all(present.get(ref) == digest for ref in refs):
            done[result.name] = False
            continue
        started = time.monotonic()
        # The archive names the image by its content-hash name (refs[0]); the others are tags.
        _ctr(containerd_address, "images", "import", "--snapshotter", snapshotter, str(result.archive))
        for ref in refs[1:]:
            _ctr(containerd_address, "images", "tag", "--force", refs[0], ref)
        log(f"images: {result.name} imported into {containerd_address} in {time.monotonic() - started:.0f}s")
        done[result.name] = True
    return done


HASH_TAG = re.compile(r"[0-9a-f]{16}")  # a content-hash name's tag (Plan.hash)


def _older_builds(present: dict[str, str], refs: list[str], digest: str) -> set[str]:
    """Every name of the images in `present` that are older builds of the image named `refs`
    (content-hash name first) at `digest`: those one of its names still points at (before the
    new build is tagged), and those only content-hash names of its repository and image IDs
    name (a build whose names moved on). Another tag of the repository is another image: the
    MPI Operator's pi examples are mpioperator/mpi-pi:openmpi and :mpich."""
    repository = refs[0].rpartition(":")[0]
    names: dict[str, set[str]] = {}
    for ref, d in present.items():
        names.setdefault(d, set()).add(ref)

    def hash_name(ref: str) -> bool:
        repo, _, tag = ref.rpartition(":")
        return repo == repository and HASH_TAG.fullmatch(tag) is not None

    old = {d for d, named in names.items() if d != digest and (
        named & set(refs) or (any(map(hash_name, named)) and all(hash_name(n) or n.startswith("sha256:")
                                                                 for n in named)))}
    return {ref for d in old for ref in names[d]}


def import_archive(containerd_address: str, archive: Path, tags=(), snapshotter: str = "overlayfs") -> list[str]:
    """Import a user's image archive (OCI, or `docker save`'s) into that containerd's k8s.io
    namespace, and name it `tags` too, as the kubelet looks them up (cri_name). Returns every
    name it has there. An archive without names gets
    containerd's `import-<date>@sha256:...`, so `tags` can still name it."""
    _need_tools(LOAD_TOOLS)
    out = _ctr(containerd_address, "images", "import", "--digests", "--snapshotter", snapshotter, str(archive))
    names = re.findall(r"^unpacking (\S+) \(sha256:", out, flags=re.M)
    if not names:
        raise ImageBuildError(f"ctr images import {archive}: no image in it ({out.strip()[-300:]})")
    for tag in tags:
        names.append(cri_name(tag))
        _ctr(containerd_address, "images", "tag", "--force", names[0], names[-1])
    return names


def prune(containerd_address: str, keep: set[str]) -> None:
    """Remove the project's images but those named in `keep` from that containerd (a real
    node's root is kept in the cache: every rebuilt trainer would otherwise stay)."""
    present = containerd_images(containerd_address)
    _remove(containerd_address, present, {ref for ref in present if "/trainop" in ref and ref not in keep})


def _remove(address: str, present: dict[str, str], stale: set[str]) -> None:
    """Remove the `stale` names and every other name of the same images, unless a name that
    stays points at one: the CRI plugin names each image by its ID too (`sha256:...`), and that
    name alone keeps all its layers. --sync waits for containerd to free them."""
    if not stale:
        return
    staying = {d for ref, d in present.items() if ref not in stale and not ref.startswith("sha256:")}
    gone = {present[ref] for ref in stale} - staying
    names = sorted(stale | {ref for ref, d in present.items() if d in gone})
    _ctr(address, "images", "rm", "--sync", *names)


def describe(results: list[Result]) -> str:
    """The table `trainop devcluster images` prints."""
    rows = [("IMAGE", "NAMES", "SIZE", "ARCHIVE", "STATE", "TIME")]
    for r in results:
        rows.append((r.name, " ".join(r.refs), f"{r.meta['image_bytes'] / 1e6:.0f} MB",
                     str(r.archive), "built" if r.built else "cached", f"{r.seconds:.1f}s"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows)


__all__ = ["IMAGES", "BASES", "Image", "Base", "Result", "ImageBuildError", "ensure", "ensure_images",
           "load", "prune", "reference", "sandbox_image", "containerd_refs", "containerd_images", "plan", "describe"]
