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


def _group(item: pytest.Item) -> str | None:
    fixtures = set(getattr(item, "fixturenames", ()))
    if "real_cluster" in fixtures:
        return "real-nodes"
    if "cluster" in fixtures or item.nodeid.startswith("tests/trainer/"):
        return "kwok"
    return None


def pytest_collection_modifyitems(config, items):
    if not config.pluginmanager.hasplugin("xdist") or config.getoption("dist", "no") != "loadgroup":
        return
    groups = {item.nodeid: _group(item) for item in items}
    for item in items:
        if groups[item.nodeid]:
            item.add_marker(pytest.mark.xdist_group(groups[item.nodeid]))
    # Stable: within a group, and among the rest, pytest's order is kept.
    rank = {name: i for i, name in enumerate(GROUPS)}
    items.sort(key=lambda item: rank.get(groups[item.nodeid], len(GROUPS)))
