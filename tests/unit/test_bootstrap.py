"""scripts/bootstrap.sh: what each Makefile target installs (`--plan`, computed by the same code
that installs), and its output: one line per phase on stdout, the compilers' output in the log."""

import os
import shutil
import subprocess
import tomllib
from pathlib import Path

from tests.e2e import test_peer_images
from tests.fixtures.waiting import wait_until

REPO = Path(__file__).resolve().parents[2]
TRAINER_EXTRAS = tomllib.loads((REPO / "trainer_images/trainer/pyproject.toml").read_text())[
    "project"]["optional-dependencies"]


def fresh_clone(tmp_path: Path) -> Path:
    """The files `bootstrap.sh --plan` reads, as a fresh clone has them: no .venv, no .cache."""
    root = tmp_path / "clone"
    for rel in ("scripts/bootstrap.sh", "scripts/progress.sh", "trainer_images/install.sh",
                "trainer_images/trainer/pyproject.toml", "pyproject.toml"):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / rel, root / rel)
    return root


def plan(root: Path, target: str, tmp_path: Path) -> dict[str, str]:
    proc = subprocess.run(["bash", str(root / "scripts/bootstrap.sh"), "--plan", target], capture_output=True,
                          text=True, timeout=60, env=dict(os.environ, TRAINOP_CACHE=str(tmp_path / "cache")))
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    header, *lines = proc.stdout.splitlines()
    assert header == f"scripts/bootstrap.sh {target} installs, phase by phase:"
    # "  <phase name, 32 wide> <what it installs>"
    return {line[2:34].strip(): line[35:] for line in lines}


def test_demo_installs_pytorch_and_horovod_and_no_tensorflow(tmp_path):
    root = fresh_clone(tmp_path)
    phases = plan(root, "demo", tmp_path)
    assert list(phases) == ["apt", "pip: trainop", "frameworks: pytorch", "horovod build"]
    assert "tensorflow" not in "".join(phases).lower() + "".join(phases.values()).lower()
    assert phases["frameworks: pytorch"].startswith(" ".join(TRAINER_EXTRAS["pytorch"]) + " ")
    assert phases["horovod build"].startswith("Horovod from source for pytorch ")
    # No test tools (pytest, mpi4py, ruff: pyproject.toml's extra `test`).
    assert phases["pip: trainop"] == "into .venv: pip install -e . -e trainer_images/trainer"
    assert "openmpi-bin" in phases["apt"].split() and "containerd" not in phases["apt"].split()
    # A plan installs nothing.
    assert sorted(p.name for p in root.iterdir()) == ["pyproject.toml", "scripts", "trainer_images"]
    assert not (tmp_path / "cache").exists()


def test_test_installs_everything_demo_does_and_the_rest(tmp_path):
    root = fresh_clone(tmp_path)
    demo, test = plan(root, "demo", tmp_path), plan(root, "test", tmp_path)
    assert list(test) == ["apt", "pip: trainop", "frameworks: pytorch,tensorflow", "horovod build",
                          "images", "npm: azurite", "go: control plane", "go: kueue", "helm"]
    # the images need the Horovod wheel only: built beside the Go builds
    assert test["images"].endswith(" (beside the next phases)")
    assert [name for name, what in test.items() if "beside" in what] == ["images"]
    # with the MPI Operator's images that test_peer_images runs, which a cold run built inside it
    peers = [build for _, build, _ in test_peer_images.EXAMPLES.values()]
    assert f"the MPI Operator's {' '.join(peers)} (cached" in test["images"]
    assert set(demo["apt"].split()) < set(test["apt"].split())
    assert test["pip: trainop"] == "into .venv: pip install -e .[test,tensorboard] -e trainer_images/trainer"
    pins = " ".join(TRAINER_EXTRAS["pytorch"] + TRAINER_EXTRAS["tensorflow"])
    assert test["frameworks: pytorch,tensorflow"].startswith(pins + " ")
    assert test["horovod build"].startswith("Horovod from source for pytorch,tensorflow ")


def test_demo_after_test_keeps_tensorflow(tmp_path):
    # The suite runs in the .venv that `bootstrap.sh test` made: a `make demo` now must not rebuild
    # Horovod without TensorFlow.
    phases = plan(REPO, "demo", tmp_path)
    assert "frameworks: pytorch,tensorflow" in phases
    assert phases["frameworks: pytorch,tensorflow"].endswith("; tensorflow kept: .venv has it")
    assert phases["horovod build"].startswith("Horovod from source for pytorch,tensorflow ")


def run_phases(tmp_path: Path, body: str) -> subprocess.CompletedProcess:
    (tmp_path / "warn.c").write_text("int main(void) { int unused; return 0; }\n")
    (tmp_path / "bad.c").write_text("int main(void) { return undeclared_name; }\n")
    script = f"set -euo pipefail\nsource {REPO}/scripts/progress.sh\nprogress_log {tmp_path}/logs/b.log\n{body}"
    return subprocess.run(["bash", "-c", script], capture_output=True, text=True, cwd=tmp_path, timeout=120,
                          env=dict(os.environ, LC_ALL="C", TRAINOP_TIMINGS=str(tmp_path / "timings")))


def test_stdout_gets_one_line_per_phase_and_the_log_the_compiler_output(tmp_path):
    proc = run_phases(tmp_path, 'phase "compile" cc -Wall -c warn.c -o warn.o\n'
                                'phase "link" cc warn.o -o warn\n')
    assert proc.returncode == 0, proc.stderr
    log = tmp_path / "logs/b.log"
    lines = proc.stdout.splitlines()
    assert lines[0] == f"full output (apt, pip, compilers, npm, go): {log}"
    assert [line.split()[0] for line in lines[1:]] == ["compile", "link"]
    assert all(line.endswith(" s") for line in lines[1:])
    assert "warning" not in proc.stdout + proc.stderr
    assert "warning: unused variable 'unused'" in log.read_text()
    assert [line.split()[0] for line in (tmp_path / "timings").read_text().splitlines()] == ["compile", "link"]


def test_a_failing_phase_stops_the_script_and_shows_the_log_and_its_last_lines(tmp_path):
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs/b.log").write_text("the previous run\n")
    proc = run_phases(tmp_path, 'build() { echo building; cc -c bad.c -o bad.o; echo after-the-compiler; }\n'
                                'phase "compile" build\nphase "never" true\n')
    assert proc.returncode == 1
    log = tmp_path / "logs/b.log"
    assert proc.stdout.splitlines()[-1].split()[:3] == ["compile", "FAILED", "after"]
    assert "never" not in proc.stdout
    # Errexit holds inside the phase's function: nothing after the failed command ran.
    assert "after-the-compiler" not in log.read_text()
    stderr = proc.stderr.splitlines()
    assert stderr[:2] == ["compile failed (exit status 1)", "its first errors:"]
    assert "error: 'undeclared_name' undeclared" in stderr[2]
    assert f"the last 40 lines of {log}:" in stderr
    assert "    building" in stderr
    assert proc.stderr.splitlines()[-1] == f"the whole output: {log}"
    assert (tmp_path / "logs/b.log.1").read_text() == "the previous run\n"
    assert any(line.startswith("free disk: ") and line[-1] in "KMGT" for line in stderr)


def test_a_phase_beside_runs_while_the_next_ones_do_and_is_joined_at_the_end(tmp_path):
    # `wait_for` returns once the phase beside has written its mark: it ran at the same time
    proc = run_phases(tmp_path, 'mark() { echo beside-ran > mark; echo building images; }\n'
                                'wait_for() { for _ in $(seq 200); do [[ -f mark ]] && return 0; sleep 0.05; done; return 1; }\n'
                                'phase_beside "images" mark\nphase "go" wait_for\nphases_joined\necho joined\n')
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()[1:]
    assert lines[0].split() == ["images", "started,", "beside", "the", "next", "phases"]
    assert lines[1].split()[0] == "go" and lines[2].split()[0] == "images" and lines[2].endswith(" s (beside)")
    assert lines[3] == "joined"
    log = (tmp_path / "logs/b.log").read_text()
    assert log.index("=== go:") < log.index("=== images: mark") < log.index("building images")  # its own log, appended
    timings = [line.split() for line in (tmp_path / "timings").read_text().splitlines()]
    assert [t[0] for t in timings] == ["go", "images"] and timings[1][2:] == ["beside"]


def test_a_failing_phase_beside_fails_the_script_with_its_report_when_joined(tmp_path):
    proc = run_phases(tmp_path, 'build() { echo building; cc -c bad.c -o bad.o; echo after-the-compiler; }\n'
                                'phase_beside "images" build\nphase "go" true\nphases_joined\necho never\n')
    assert proc.returncode == 1
    assert proc.stdout.splitlines()[-1].split()[:3] == ["images", "FAILED", "after"]
    assert "never" not in proc.stdout
    assert "after-the-compiler" not in (tmp_path / "logs/b.log").read_text()
    stderr = proc.stderr.splitlines()
    assert stderr[:2] == ["images failed (exit status 1)", "its first errors:"]
    assert "error: 'undeclared_name' undeclared" in stderr[2]
    assert "    building" in stderr


def test_a_failing_phase_stops_the_phases_beside_it(tmp_path):
    proc = run_phases(tmp_path, 'phase_beside "images" sleep 123.456\nphase "go" false\n')
    assert proc.returncode == 1 and proc.stdout.splitlines()[-1].split()[:3] == ["go", "FAILED", "after"]
    def gone() -> bool:
        return subprocess.run(["pgrep", "-f", "^sleep 123.456$"], capture_output=True).stdout == b""
    wait_until(gone, timeout=10, interval=0.05, what="the phase beside stopped")


def test_a_full_disk_under_npm_is_named_in_the_first_errors(tmp_path):
    # npm's errors have no colon after "error" (seen in CI: a full disk while unpacking Azurite).
    proc = run_phases(tmp_path, 'fill() { echo "npm warn tar TAR_ENTRY_ERROR ENOSPC: no space left on device, write"; '
                                'echo "npm error code ENOSPC"; for i in $(seq 50); do echo "npm error log $i"; done; '
                                'return 1; }\nphase "npm: azurite" fill\n')
    assert proc.returncode == 1
    stderr = proc.stderr.splitlines()
    first = stderr[stderr.index("its first errors:") + 1:stderr.index("its first errors:") + 3]
    assert first == ["    npm warn tar TAR_ENTRY_ERROR ENOSPC: no space left on device, write",
                     "    npm error code ENOSPC"]


def test_the_readme_shows_the_demo_phases_as_they_are(tmp_path):
    quickstart = (REPO / "README.md").read_text().split("## Quickstart")[1].split("\n## ")[0]
    assert "`scripts/bootstrap.sh --plan demo`" in quickstart
    shown = quickstart.split("A cold `make demo`:\n\n```\n")[1].split("```")[0].splitlines()
    assert shown[0] == "scripts/bootstrap.sh demo: 4 phases (later runs only check)"
    assert shown[1].startswith("full output (apt, pip, compilers, npm, go): ")
    assert shown[1].endswith("/.cache/logs/bootstrap-demo.log")
    assert [line[2:34].strip() for line in shown[2:-1]] == list(plan(fresh_clone(tmp_path), "demo", tmp_path))
    assert shown[-1].startswith("scripts/bootstrap.sh demo: ready in ")
