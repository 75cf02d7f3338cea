"""scripts/budget.py, `.ci/run`'s verdict on issue 29's time budget: cold and warm runs are told
apart by the install's time, each phase is said within or over its budget, and only a run over
1.5x of it fails, through .ci/run's own exit status."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("budget", REPO / "scripts" / "budget.py")
budget = importlib.util.module_from_spec(spec)
spec.loader.exec_module(budget)


def test_a_warm_run_is_judged_on_its_tests_and_total():
    lines, ok = budget.verdict(99, 1730)  # the CI run after stop 43
    assert ok and lines[0].startswith("=== budget (warm run")
    assert [line.split()[0] for line in lines[1:]] == ["tests", "total"]
    assert all(line.endswith("within") for line in lines[1:])


def test_a_cold_run_is_judged_on_its_install_too_and_over_is_said_but_passes():
    lines, ok = budget.verdict(24 * 60, 37 * 60)
    assert ok and lines[0].startswith("=== budget (cold run")
    said = {line.split()[0]: line for line in lines[1:]}
    assert said["install"].endswith("within") and said["total"].endswith("OVER by 1 min 00 s")
    assert said["tests"].endswith("OVER by 2 min 00 s")


def test_a_run_over_one_and_a_half_times_its_budget_fails():
    lines, ok = budget.verdict(100, 53 * 60)  # tests: 53 > 1.5 x 35 min
    assert not ok and "a regression, this run fails" in next(x for x in lines if x.split()[0] == "tests")
    assert budget.verdict(100, 52 * 60)[1]  # 52 min: over, under the guard
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "budget.py"), "100", str(53 * 60)],
                          capture_output=True, text=True)
    assert done.returncode == 1 and "OVER 1.5x" in done.stdout


def test_ci_run_fails_a_passing_suite_over_the_guard_and_keeps_a_failing_suites_status():
    """.ci/run's own lines, run with its two phases replaced by commands of known time and status."""
    script = (REPO / ".ci" / "run").read_text()
    tail = script[script.index("declare -A took"):]
    install, test = "phase install scripts/bootstrap.sh test || exit 1", "phase test make test"
    assert "trap summary EXIT" in tail and install in tail and test in tail  # else the probe would install
    for test_rc, expect in ((0, 1), (3, 3)):
        probe = (tail.replace("trap summary EXIT", "")
                 .replace(install, "phase install true; took[install]=100")
                 .replace(test, f"phase test bash -c 'exit {test_rc}'; rc_=$?; took[test]={53 * 60}; (exit $rc_)"))
        done = subprocess.run(["bash", "-c", "set -uo pipefail\ntimings=()\nsummary() { :; }\n" + probe],
                              cwd=REPO, capture_output=True, text=True)
        assert done.returncode == expect, (done.stdout, done.stderr)
        assert "OVER 1.5x" in done.stdout
