#!/usr/bin/env python3
"""`make test`'s pytest: the whole suite as two pytest processes at once (lanes).

    scripts/test_lanes.py PYTEST [OPTION...]      (make test: .venv/bin/pytest -ra --durations=20)

Why: on this project's 2-core machine one pytest left the cores idle a third of the time. The
real-node tests (tests/e2e, ~20 min) keep them about 70 % busy, the KWOK cluster tests
(tests/cluster, ~14 min) about 40 %: the rest is waiting on a cluster (docs/DEVELOPING.md, "Where
the suite's time goes"). So tests/e2e runs in a lane of its own, beside the main lane, which
starts with tests/cluster and then runs the CPU-bound directories (cli, trainer) alone once e2e is
done; the e2e lane then runs the short directories that need no cluster (azure, mpi, unit). Each
lane is one pytest session with its own session-scoped cluster: the real-node one in the e2e
lane, the KWOK one in the main lane, as before. (pytest-xdist's `--dist loadgroup` would
be the library for this, but under pytest 9.2 it groups nothing, pytest-dev/pytest-xdist#1386,
and every worker would start each session cluster it touches.)

Every lane gets the same OPTIONs (options only: the lanes choose the paths; a --basetemp gets the
lane's name appended). The main lane prints as it runs; the e2e lane writes
.cache/logs/pytest-e2e.log, printed whole when it ends. Each lane writes JUnit XML next to it
(.cache/logs/junit-<lane>.xml), and the run ends with each lane's minutes and the minutes per test
directory. Exit status: 0 when every lane passed; pytest's 5 ("no tests ran") counts as a pass for
a lane only if another lane ran tests; otherwise the first failing lane's status.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LOGS = REPO / ".cache" / "logs"
# lane -> its directories, run beside the main lane. After tests/e2e, the lane takes the short
# directories that need no KWOK cluster (the 2026-12-07 run: main lane 41.6 min, e2e 31.7; azure,
# mpi and unit 2.1 min of the main lane's).
BESIDE = {"e2e": ["tests/e2e", "tests/azure", "tests/mpi", "tests/unit"]}
FIRST = ["tests/cluster"]  # the main lane's first directories: mostly waiting, while e2e computes
NO_TESTS = 5  # pytest's exit status when it collected nothing


def test_dirs() -> list[str]:
    """Every directory under tests/ that holds a test module, as pytest's `testpaths = ["tests"]`
    would collect it (so a new one is never left out)."""
    return sorted(f"tests/{d.name}" for d in (REPO / "tests").iterdir()
                  if d.is_dir() and next(d.rglob("test_*.py"), None) is not None)


def lanes() -> dict[str, list[str]]:
    beside = {d for dirs in BESIDE.values() for d in dirs}
    rest = [d for d in test_dirs() if d not in beside]
    return {"main": [d for d in FIRST if d in rest] + [d for d in rest if d not in FIRST], **BESIDE}


def command(pytest: list[str], options: list[str], lane: str, paths: list[str]) -> list[str]:
    own = [f"{o}-{lane}" if o.startswith("--basetemp=") else o for o in options]
    return [*pytest, *own, f"--junitxml={LOGS / f'junit-{lane}.xml'}", *paths]


def junit(lane: str) -> ET.Element:
    try:
        return ET.parse(LOGS / f"junit-{lane}.xml").getroot()
    except (OSError, ET.ParseError):
        return ET.Element("testsuites")


def session_minutes(lane: str) -> float:
    return sum(float(s.get("time") or 0) for s in junit(lane).iter("testsuite")) / 60


def minutes_per_directory(lane: str) -> Counter:
    seconds: Counter = Counter()
    for case in junit(lane).iter("testcase"):
        parts = (case.get("classname") or "").split(".")
        seconds[parts[1] if len(parts) > 1 else "?"] += float(case.get("time") or 0)
    return Counter({d: s / 60 for d, s in seconds.items()})


def outcome(codes: list[int]) -> int:
    """The run's exit status from the lanes' (see the module's docstring)."""
    if all(code == NO_TESTS for code in codes):
        return NO_TESTS  # (make test says so, and fails)
    return next((code for code in codes if code not in (0, NO_TESTS)), 0)


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    pytest, options = argv[:1], argv[1:]
    if any(not o.startswith("-") and (REPO / o).exists() for o in options):
        print("test_lanes.py: give options only; the lanes choose the test paths", file=sys.stderr)
        return 2
    LOGS.mkdir(parents=True, exist_ok=True)
    plan = lanes()
    procs: dict[str, subprocess.Popen] = {}
    for lane in [name for name in plan if name != "main"]:
        with (LOGS / f"pytest-{lane}.log").open("w") as log:
            procs[lane] = subprocess.Popen(command(pytest, options, lane, plan[lane]), cwd=REPO, stdout=log,
                                           stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    main_lane = subprocess.Popen(command(pytest, options, "main", plan["main"]), cwd=REPO,
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
    procs = {"main": main_lane, **procs}

    def forward(signum, _frame):  # a stop sent to this process: every pytest tears its clusters down
        for proc in procs.values():
            if proc.poll() is None:
                proc.send_signal(signum)
    signal.signal(signal.SIGTERM, forward)
    # Ctrl-C reaches every lane from the terminal (one process group): the lanes' own teardown,
    # and their output, are what to wait for.
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    shown: set[str] = set()

    def show_ended(wait: bool = False) -> None:
        for lane, proc in procs.items():
            if lane == "main" or lane in shown or (proc.poll() is None and not wait):
                continue
            proc.wait()
            shown.add(lane)
            print(f"\n=== lane {lane} ({' '.join(plan[lane])}) ended: exit {proc.returncode}; its output:", flush=True)
            print((LOGS / f"pytest-{lane}.log").read_text(errors="replace"), flush=True)
            print(f"=== end of lane {lane}\n", flush=True)

    for line in main_lane.stdout:  # (a lane's whole output goes between two lines of the main lane's)
        show_ended()
        sys.stdout.write(line)
        sys.stdout.flush()
    main_lane.wait()
    show_ended(wait=True)

    print("=== lanes")
    for lane in procs:
        per_dir = minutes_per_directory(lane)
        dirs = ", ".join(f"{d} {m:.1f}" for d, m in per_dir.most_common())
        print(f"  {lane:5} exit {procs[lane].returncode}  {session_minutes(lane):5.1f} min  per directory (min): {dirs}")
    return outcome([proc.returncode for proc in procs.values()])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
