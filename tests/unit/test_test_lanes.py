"""scripts/test_lanes.py, `make test`'s two pytest lanes: every test directory runs in exactly
one lane, the main lane starts with the KWOK cluster tests, and a lane's failure fails the run."""

from __future__ import annotations

import importlib.util
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("test_lanes", REPO / "scripts" / "test_lanes.py")
lanes_module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(lanes_module)


def test_every_test_directory_runs_in_exactly_one_lane_the_main_one_starting_with_the_cluster_tests():
    plan = lanes_module.lanes()
    every = [d for paths in plan.values() for d in paths]
    on_disk = {f"tests/{d.relative_to(REPO / 'tests').parts[0]}" for d in (REPO / "tests").rglob("test_*.py")}
    assert sorted(every) == sorted(on_disk)  # each once, none left out
    assert plan["e2e"][0] == "tests/e2e" and plan["main"][0] == "tests/cluster"


def test_each_lane_gets_the_options_its_own_basetemp_and_junit_file():
    cmd = lanes_module.command([".venv/bin/pytest"], ["-ra", "--basetemp=/tmp/t"], "e2e", ["tests/e2e"])
    assert cmd[:3] == [".venv/bin/pytest", "-ra", "--basetemp=/tmp/t-e2e"]
    assert cmd[3].endswith("/.cache/logs/junit-e2e.xml") and cmd[-1] == "tests/e2e"


def test_a_failing_lane_fails_the_run_and_no_tests_at_all_is_pytests_5():
    assert lanes_module.outcome([0, 0]) == 0
    assert lanes_module.outcome([0, 5]) == 0  # (e.g. -m "not real": the e2e lane collects nothing)
    assert lanes_module.outcome([5, 5]) == 5
    assert lanes_module.outcome([0, 1]) == 1 and lanes_module.outcome([2, 5]) == 2
