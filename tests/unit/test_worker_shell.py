"""The workers' SIGTERM handling (render/dtj.py stop_ranks) run by a real `sh` over real
processes: a fake MPI daemon named `orted` (a shell script: the kernel names the process after
the script) whose child is the rank. A rank that ends on SIGTERM ends the shell at once; a hung
rank (SIGSTOPped: a stalled gang) is SIGKILLed when the ranks' share of the grace period is
over, and the shell ends, where it used to wait for the kubelet's SIGKILL at the end of the
whole grace period (drain included)."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest

from tests.fixtures.waiting import wait_until
from trainop.render import dtj

HUNG_DEADLINE = 1       # the ranks' share in the hung case: the shell must end after it
NEVER = 600             # ... in the other cases: a shell that waited for it would fail the test


def _children(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return True
    return state == "Z"  # a zombie has ended: its parent has not reaped it yet


def _parent(tmp_path: Path, name: str, rank_traps_term: bool) -> Path:
    """A script `name` whose one child is the rank: one that ends on SIGTERM, or one that would
    (a sleep) were it not frozen."""
    rank = tmp_path / "rank"
    rank.write_text("#!/bin/sh\ntrap 'exit 0' TERM\nwhile :; do sleep 0.1; done\n" if rank_traps_term
                    else "#!/bin/sh\nexec sleep 600\n")
    parent = tmp_path / name
    parent.write_text(f"#!/bin/sh\n{rank} &\nwait\n")
    for f in (rank, parent):
        f.chmod(0o755)
    return parent


def _start_mpi_worker(tmp_path: Path, deadline: int, rank_traps_term: bool) -> tuple[subprocess.Popen, int]:
    """The sshd worker shell's stop logic over an `orted` with one rank; returns the shell and
    the rank's pid."""
    orted = _parent(tmp_path, "orted", rank_traps_term)
    script = dtj._RANKS + dtj.stop_ranks(deadline, "exit 143") + \
        f"{orted} &\ntrap stop TERM\nwhile :; do sleep 0.1; done\n"
    shell = subprocess.Popen(["sh", "-c", script], start_new_session=True)
    ranks = wait_until(lambda: [c for o in _children(shell.pid) for c in _children(o)], timeout=30,
                       interval=0.05, what="the rank under orted")
    return shell, ranks[0]


def _cleanup(shell: subprocess.Popen) -> None:
    if shell.poll() is None:
        os.killpg(shell.pid, signal.SIGKILL)
        shell.wait()


def test_ranks_that_end_on_sigterm_end_the_worker_shell_at_once(tmp_path):
    shell, rank = _start_mpi_worker(tmp_path, NEVER, rank_traps_term=True)
    try:
        shell.send_signal(signal.SIGTERM)
        assert shell.wait(timeout=60) == 143
        assert _gone(rank)
    finally:
        _cleanup(shell)


def test_a_hung_rank_is_killed_when_its_share_of_the_grace_period_is_over(tmp_path):
    shell, rank = _start_mpi_worker(tmp_path, HUNG_DEADLINE, rank_traps_term=False)
    try:
        os.kill(rank, signal.SIGSTOP)  # frozen: the SIGTERM stays pending, as in a stalled gang
        shell.send_signal(signal.SIGTERM)
        assert shell.wait(timeout=60) == 143
        wait_until(lambda: _gone(rank), timeout=30, interval=0.05, what="the hung rank killed")
    finally:
        _cleanup(shell)


@pytest.mark.parametrize("hung", [False, True])
def test_torchruns_shell_stops_its_ranks_the_same_way(tmp_path, hung):
    """torchrun_script's stop, with a stand-in torchrun (a shell whose child is the rank)."""
    torchrun = _parent(tmp_path, "torchrun", rank_traps_term=not hung)
    script = dtj._TORCHRUN_RANKS + dtj.stop_ranks(HUNG_DEADLINE if hung else NEVER, ":") + (
        f"{torchrun} &\ntorchrun=$!\ntrap stop TERM\n"
        'while :; do wait "$torchrun"; status=$?; kill -0 "$torchrun" 2>/dev/null || exit "$status"; done\n')
    shell = subprocess.Popen(["sh", "-c", script], start_new_session=True)
    try:
        ranks = wait_until(lambda: [c for t in _children(shell.pid) for c in _children(t)], timeout=30,
                           interval=0.05, what="the rank under torchrun")
        if hung:
            os.kill(ranks[0], signal.SIGSTOP)
        shell.send_signal(signal.SIGTERM)
        shell.wait(timeout=60)
        wait_until(lambda: _gone(ranks[0]), timeout=30, interval=0.05, what="the rank ended")
    finally:
        _cleanup(shell)


def test_the_rendered_deadline_is_the_ranks_share():
    """sshd_script and torchrun_script carry rank_deadline: the user's grace when set, else
    the save's share."""
    from tests.unit.test_render_dtj import job
    plain = job()
    assert f'-lt {dtj.save_grace(plain)} ]' in dtj.sshd_script(plain)
    user = job(terminationGracePeriodSeconds=90, launcher="torchrun")
    assert dtj.rank_deadline(user) == 90 and '-lt 90 ]' in dtj.torchrun_script(user)
