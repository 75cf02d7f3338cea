"""The background runs of tests/trainer/conftest.py yield the cores to any other work: their
processes at nice 19, and the session of their own that each run gets at nice 19 as well (the
kernel's autogroups weigh a session as one process whatever its processes' nice)."""

from __future__ import annotations

from pathlib import Path

from tests.trainer.conftest import Background


def test_a_background_run_and_its_session_run_at_the_lowest_priority():
    done = Background().run(["sh", "-c", "echo nice $(nice); cat /proc/self/autogroup 2>/dev/null; true"], 30)
    lines = done.stdout.splitlines()
    assert lines[0] == "nice 19", done
    if Path("/proc/self/autogroup").exists():  # a kernel with autogroups (this project's machine)
        group = lines[1].split()
        assert group[-2:] == ["nice", "19"], done  # "/autogroup-<n> nice 19"
        assert Path("/proc/self/autogroup").read_text().split()[0] != group[0], "not a session of its own"
