"""`python -m trainop_trainer.preflight`: the measuring half of the fabric check. Three workers
on CPU with Gloo, each its own torchrun with a static rendezvous (node rank = worker index), as
render/fabric.py starts them in the workers' init containers; the operator's parser reads what
they wrote (the contract between the two halves). The GPU figures: docs/benchmarks.md."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.trainer.conftest import VENV_BIN, free_port_block
from trainop import preflight as operator_side
from trainop_trainer.preflight import bus_bandwidth, ring_pairs, transport_from_log

pytestmark = pytest.mark.trainer

# NCCL 2.28.9's INFO lines (NCCL_DEBUG_SUBSYS=INIT,NET) on an H100 host without an HCA, as the
# device run of 2026-11-26 wrote them: "NET/IB : Using [RO]" appears although no IB is used.
NO_HCA = """\
h:1:1 [0] NCCL INFO NET/Plugin: Could not find: libnccl-net.so
h:1:1 [0] NCCL INFO NET/IB : No device found.
h:1:1 [0] NCCL INFO NET/IB : Using [RO]; OOB eth0:192.0.2.2<0>
h:1:1 [0] NCCL INFO NET/Socket : Using [0]eth0:192.0.2.2<0>
h:1:1 [0] NCCL INFO Using network Socket
"""
WITH_HCA = """\
h:1:1 [0] NCCL INFO NET/IB : Using [0]mlx5_ib0:1/IB [1]mlx5_ib1:1/IB ; OOB eth0:10.0.0.4<0>
h:1:1 [0] NCCL INFO Using network IB
"""


def test_transport_is_read_from_nccls_own_words():
    assert transport_from_log(NO_HCA) == "Socket"
    assert transport_from_log(WITH_HCA) == "IB"
    assert transport_from_log(WITH_HCA.replace("Using network IB\n", "")) == "IB"  # older NCCL
    assert transport_from_log(WITH_HCA + "h:1:2 [1] NCCL INFO Using network Socket\n") == "Socket"
    assert transport_from_log("nothing from NCCL") is None


def test_bus_bandwidth_is_nccl_tests_formula_and_pairs_make_a_ring():
    assert bus_bandwidth(10**9, 1.0, 4) == pytest.approx(1.5)  # 2(n-1)/n
    assert bus_bandwidth(10**9, 1.0, 1) == 0.0
    assert ring_pairs(1) == [] and ring_pairs(2) == [(0, 1)]
    assert ring_pairs(4) == [(0, 1), (1, 2), (2, 3), (0, 3)]


def run_gang(tmp_path: Path, workers: int, min_busbw: float) -> list[subprocess.CompletedProcess]:
    port = free_port_block(1)
    procs = []
    for i in range(workers):
        cmd = [str(VENV_BIN / "torchrun"), f"--nnodes={workers}", "--nproc-per-node=1", f"--node-rank={i}",
               "--master-addr=127.0.0.1", f"--master-port={port}", "--max-restarts=0",
               "-m", "trainop_trainer.preflight", "--min-busbw", str(min_busbw), "--size-mb", "2",
               "--iterations", "3", "--result-file", str(tmp_path / f"result-{i}")]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    return [subprocess.CompletedProcess(p.args, p.wait(timeout=240), p.stdout.read()) for p in procs]


def test_a_gang_below_the_threshold_times_every_pair_and_every_rank_exits_non_zero(tmp_path):
    done = run_gang(tmp_path, workers=3, min_busbw=1e6)
    assert all(p.returncode != 0 for p in done), [p.stdout[-500:] for p in done]
    text = (tmp_path / "result-0").read_text()
    report = operator_side.parse(text, workers=3)  # what the operator reads from worker 0
    assert report is not None, text
    assert (report.passed, report.world_size, report.backend, report.transport) == (False, 3, "gloo", "Socket")
    assert [p.workers for p in report.pairs] == [(0, 1), (1, 2), (0, 2)]
    assert all(p.busbw > 0 for p in report.pairs) and report.busbw > 0
    assert json.loads((tmp_path / "result-1").read_text())["passed"] is False  # every worker knows


def test_a_gang_above_the_threshold_passes_without_pairs(tmp_path):
    done = run_gang(tmp_path, workers=2, min_busbw=0)
    assert all(p.returncode == 0 for p in done), [p.stdout[-500:] for p in done]
    report = operator_side.parse((tmp_path / "result-0").read_text(), workers=2)
    assert report.passed and not report.pairs
    assert "trainop-preflight: " in done[0].stdout


if __name__ == "__main__":
    sys.exit(pytest.main([__file__]))
