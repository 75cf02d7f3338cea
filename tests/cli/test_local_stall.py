"""Issue 24, a rank that hangs, with real processes: `trainop run --local` of a job with
runPolicy.stallTimeoutSeconds and a checkpoint volume. Rank 1 is frozen (SIGSTOP) once a
checkpoint is complete and a report has come: rank 0 then waits in its next allreduce forever,
as behind a dead NCCL peer. Its watchdog writes its Python stacks into the log, the run sees
the step stand still for the timeout, stops the gang as the operator would, and the next
attempt resumes from the checkpoint and finishes."""

from __future__ import annotations

import os
import signal

import pytest

from tests.cli.test_local_resume import manifest, rank_pid, start, wait_for

STALL = 20  # the CRD's floor: reports every 5 s, the watchdog's stacks after 10 s


@pytest.mark.trainer
@pytest.mark.mpi
@pytest.mark.timeout(600)
def test_a_hung_rank_is_dumped_then_the_gang_restarts_and_resumes(tmp_path):
    path = manifest(tmp_path, "hang", "pytorch", "mpi", runPolicy={"backoffLimit": 2, "stallTimeoutSeconds": STALL})
    state = tmp_path / "state"
    run_dir = state / "runs" / "hang" / "1"
    run = start(path, state, epochs=4)
    wait_for("a complete checkpoint", lambda: list(run_dir.glob("checkpoints/*/attempt-0/step-*/COMPLETE")), run)
    metrics = run_dir / "output" / "metrics.jsonl"  # rank 0's reports, as the run reads them
    wait_for("a report", lambda: metrics.exists() and metrics.read_text().strip(), run)
    frozen = wait_for("rank 1", lambda: rank_pid(run_dir, 1), run)
    os.kill(frozen, signal.SIGSTOP)
    try:
        out, _ = run.communicate(timeout=300)
    finally:
        try:
            os.kill(frozen, signal.SIGCONT)  # a frozen process takes no SIGTERM (already killed: gone)
        except ProcessLookupError:
            pass
    first = (run_dir / "train.log").read_text()
    assert run.returncode == 0, out + first[-3000:]
    assert "Stall: no step past" in out and f"{STALL}s (runPolicy.stallTimeoutSeconds" in out, out
    # rank 0's stacks, written by its own watchdog while it waited for rank 1
    assert "Timeout (0:00:10)!" in first and "most recent call first" in first, first[-3000:]
    assert "torch_train.py" in first.split("Timeout (0:00:10)!", 1)[1]
    second = (run_dir / "train-attempt-1.log").read_text()
    assert "resuming from" in second and '"final": true' in second, second[-3000:]
