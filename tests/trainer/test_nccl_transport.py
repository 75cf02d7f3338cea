"""The network NCCL chose, read by the trainer during training (trainop_trainer/nccl.py) and
reported in its metrics line, up to what the operator accepts from the log shipper.

NCCL runs only on CUDA: here (no GPU) the probe reads NCCL's INFO lines as NCCL 2.28.9 wrote them
on the device machine (2026-11-26), appended to the probe's file in pieces the way NCCL writes
them while a communicator is made. `test_a_real_nccl_run_reports_its_transport` is the CUDA-only
part: two ranks on two GPUs; it is skipped without them."""

from __future__ import annotations

import io
import json
import os
import subprocess

import pytest

from tests.trainer.conftest import TINY, VENV_BIN, free_port_block
from tests.trainer.test_preflight import NO_HCA, WITH_HCA
from trainop.render import logship as operator_side
from trainop_trainer import nccl, report

pytestmark = pytest.mark.trainer

WARNING = "h:1:9 [0] NCCL WARN NET/Socket : peer 10.0.0.5<43124> shutdown\n"


def test_the_probe_sends_nccls_info_lines_to_a_private_file_unless_the_user_set_nccl_debug(tmp_path):
    env: dict = {}
    probe = nccl.TransportProbe(env, directory=str(tmp_path))
    assert env == {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,NET",
                   "NCCL_DEBUG_FILE": str(tmp_path / "trainop-nccl.%p.log")}  # NCCL: %p = its pid
    assert probe.path == tmp_path / f"trainop-nccl.{os.getpid()}.log"
    assert probe.poll() is None  # no communicator yet: no file

    mine = {"NCCL_DEBUG": "WARN"}
    probe = nccl.TransportProbe(mine, directory=str(tmp_path))
    assert mine == {"NCCL_DEBUG": "WARN"} and probe.poll() is None  # theirs, untouched


def test_the_transport_is_read_as_nccl_writes_and_its_warnings_reach_the_log(tmp_path):
    env: dict = {}
    probe = nccl.TransportProbe(env, directory=str(tmp_path))
    log = open(probe.path, "a")  # as NCCL opens NCCL_DEBUG_FILE in this process
    stderr = io.StringIO()
    lines = NO_HCA.splitlines(keepends=True)
    log.write("".join(lines[:3]))   # up to "NET/IB : Using [RO]": no HCA, not IB
    log.write(lines[3][:20])        # half a line: NCCL is writing it
    log.flush()
    assert probe.poll(stderr) is None
    log.write(lines[3][20:] + WARNING + lines[4])
    log.flush()
    assert probe.poll(stderr) == "Socket"
    assert stderr.getvalue() == WARNING  # only the warning; INFO lines stay in the file
    log.write(WITH_HCA)  # a later communicator on IB: one on sockets still slows the ring
    log.flush()
    assert probe.poll(stderr) == "Socket"


def test_an_ib_run_and_another_network_plugin():
    assert nccl.transport_from_log(WITH_HCA) == "IB"
    assert nccl.gang_transport(0, 2) == "IB" and nccl.gang_transport(1, 1) == "Socket"
    assert nccl.gang_transport(0, 0) is None


def test_plugin_names_are_not_reported(tmp_path):
    env: dict = {}
    probe = nccl.TransportProbe(env, directory=str(tmp_path))
    with open(probe.path, "w") as f:
        f.write("h:1:1 [0] NCCL INFO Using network AWS Libfabric\n")
    assert probe.poll(io.StringIO()) is None  # the contract knows IB and Socket only


def test_the_report_line_carries_the_transport_and_the_shipper_passes_it_on(tmp_path, capsys):
    r = report.Reporter(tmp_path / "m.jsonl", world_size=2, global_batch=8, chief=True)
    r.epoch(1, 4, 1.0, 8.0, 4)
    r.transport = "IB"
    r.epoch(2, 8, 0.5, 8.0, 4)
    first, second = (json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines())
    assert "transport" not in first and second["transport"] == "IB"  # no key until NCCL says
    # what the log shipper and then the operator keep of it (trainop/render/logship.py)
    assert operator_side.safe_metrics(second)["transport"] == "IB"
    assert "transport" not in operator_side.safe_metrics(dict(second, transport="RDMA!"))


def test_a_real_nccl_run_reports_its_transport(tmp_path):
    """CUDA-only: two ranks on two GPUs under torchrun, DDP over NCCL."""
    import torch  # noqa: PLC0415 (installed with the trainer: a missing torch is a broken set-up, not a skip)

    if torch.cuda.device_count() < 2:
        pytest.skip("CUDA-only: needs 2 GPUs (NCCL); the parse and report path is tested above")
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("NCCL_DEBUG", None)
    port = free_port_block(1)
    done = subprocess.run([str(VENV_BIN / "torchrun"), "--standalone", "--nproc-per-node=2",
                           f"--master-port={port}", "-m", "trainop_trainer", "--framework", "pytorch",
                           "--backend", "native", *TINY, "--output-dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    reports = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert {r.get("transport") for r in reports} <= {"IB", "Socket"} and reports[-1]["transport"]
    assert "NCCL INFO" not in done.stdout + done.stderr  # in the probe's file, not the log
