#!/usr/bin/env python3
"""`.ci/run`'s time budget (issue 29): a cold run (empty caches) within 60 minutes, its install
within 25 and its tests within 35; a warm run (every cache filled) within 40.

    scripts/budget.py INSTALL_SECONDS TEST_SECONDS

Prints each phase against its budget. Exits 1 when a phase takes more than GUARD times its
budget: the same commit's runs on this project's 2-core machine moved by up to 1.4x within one
hour (docs/DEVELOPING.md, "Where the suite's time goes"), so a limit at the budget itself would
fail commits at random, while 1.5x still stops a regression of the size issue 30 found in the
control plane (2-4x) before it lands. Over the budget but under the guard is said, not failed.
"""

from __future__ import annotations

import sys

# A warm install (caches filled, bootstrap only checks) takes 1.5-3.5 minutes here, a cold one
# 20-27 (the Go, Horovod and image builds): anything from 5 minutes on built something.
COLD_INSTALL_S = 5 * 60
BUDGET_MIN = {"cold": {"install": 25, "tests": 35, "total": 60},
              "warm": {"tests": 35, "total": 40}}
GUARD = 1.5
KIND_SAID = {"cold": "the install built what the caches lacked", "warm": "the install found every cache filled"}


def _minutes(seconds: float) -> str:
    return f"{int(seconds // 60)} min {int(seconds % 60):02d} s"


def verdict(install_s: float, test_s: float) -> tuple[list[str], bool]:
    """The report's lines, and whether the run stays under the guard."""
    kind = "cold" if install_s >= COLD_INSTALL_S else "warm"
    took = {"install": install_s, "tests": test_s, "total": install_s + test_s}
    lines = [f"=== budget ({kind} run: {KIND_SAID[kind]})"]
    ok = True
    for part, budget in BUDGET_MIN[kind].items():
        seconds = took[part]
        if seconds <= budget * 60:
            said = "within"
        elif seconds <= GUARD * budget * 60:
            said = f"OVER by {_minutes(seconds - budget * 60)}"
        else:
            said = f"OVER {GUARD}x the budget: a regression, this run fails"
            ok = False
        lines.append(f"  {part:8} {_minutes(seconds):>14}   budget {budget} min   {said}")
    return lines, ok


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    lines, ok = verdict(float(argv[0]), float(argv[1]))
    print("\n".join(lines))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
