"""Fixture modules shared by every test folder (see docs/DEVELOPING.md), and how `make test`
shares the suite between its two pytest-xdist workers (`-n 2 --dist loadgroup`).

A session fixture lives once per worker, so the tests of one expensive fixture must stay together:
- "real-nodes": every test on the real-node dev cluster (`real_cluster`; one per machine, it owns
  the host's iptables chains and network namespaces);
- "kwok": every test on the KWOK dev cluster (`cluster`), and the trainer's tests, whose session
  memo (`trainer_runs`) trains each configuration once. The two groups took about as long each
  (serial run of 2026-11-28: e2e 26 min; cluster + trainer 32 min), so each worker gets one.
Everything else (unit, CLI, Azurite, chart, MPI tests) is handed out one test at a time to
whichever worker is free. The groups go first: xdist hands a worker its first two units at the
start, and a group queued behind another would wait for it.

Without `-n`, the marks do nothing and the order is pytest's own.
"""

from __future__ import annotations

import pytest

pytest_plugins = [
    "tests.fixtures.cluster",
    "tests.fixtures.azurite",
]

GROUPS = ("real-nodes", "kwok")


def pytest_configure(config):
    """xdist 3.8 tells its scheduler a test's group by renaming the test (`<id>@<group>`), which
    pytest 9.2's node ids no longer take (pytest-dev/pytest-xdist#1386): the groups would be lost
    without a word, and both workers would start a real-node cluster on one machine."""
    if config.getoption("dist", "no") != "loadgroup":
        return
    from importlib.metadata import version

    from packaging.version import Version

    if Version(version("pytest")) >= Version("9.2") and Version(version("pytest-xdist")) <= Version("3.8"):
        raise pytest.UsageError(f"--dist loadgroup groups nothing with pytest {version('pytest')} and pytest-xdist "
                                f"{version('pytest-xdist')} (pytest-dev/pytest-xdist#1386): install the pytest that "
                                f"pyproject.toml's extra `test` pins")


def _group(item: pytest.Item) -> str | None:
    fixtures = set(getattr(item, "fixturenames", ()))
    if "real_cluster" in fixtures:
        return "real-nodes"
    if "cluster" in fixtures or item.nodeid.startswith("tests/trainer/"):
        return "kwok"
    return None


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the marks
def pytest_collection_modifyitems(config, items):
    # Workers collect; xdist gives them `dist` "no" and this flag instead (xdist/remote.py).
    if not getattr(config.option, "loadgroup", False):
        return
    groups = {item.nodeid: _group(item) for item in items}
    for item in items:
        if groups[item.nodeid]:
            item.add_marker(pytest.mark.xdist_group(groups[item.nodeid]))
    # Stable: within a group, and among the rest, pytest's order is kept.
    rank = {name: i for i, name in enumerate(GROUPS)}
    items.sort(key=lambda item: rank.get(groups[item.nodeid], len(GROUPS)))
