"""bench/kopf_events.py runs (a few events, one round) and counts what it measures: every
index the operator hands the controller is one kopf index, each watched kind's event costs CPU."""

import subprocess
import sys
from pathlib import Path

from trainop.handlers import indexes

REPO = Path(__file__).resolve().parents[2]


def test_the_kopf_event_bench_measures_this_checkouts_handlers():
    done = subprocess.run([sys.executable, "bench/kopf_events.py", "--events", "50", "--rounds", "1"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    header, _, row = done.stdout.splitlines()
    assert header.startswith("| operator | index handlers | indexes | us CPU per Pod event")
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[0] == "." and int(cells[2]) == len(indexes.INDEXES)
    assert int(cells[1]) > int(cells[2])  # functions fed by several kinds count once per kind
    assert all(float(c) > 0 for c in cells[3:])
