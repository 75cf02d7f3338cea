"""Issue 24 item 4, with real processes: a save on SIGTERM slower than Kubernetes' 30 s default
grace period fits the grace period the operator sizes from the measured save.

The worker's own shell, as the operator renders it for a torchrun job (localized as
`trainop run --local` does), is run as a pod's first process and sent the kubelet's SIGTERM.
The disk is slow: a sitecustomize.py on the processes' path makes every fsync of a file over
1 MB take SLOW seconds, as a network disk's commit of a large state file does (nothing in the
trainer or the operator knows of it). The rank saves at its next step boundary, the save takes
longer than 30 s (torchrun alone would have SIGKILLed the rank 30 s after passing it the
SIGTERM), the run ends by itself with the checkpoint complete, COMPLETE says how long the save
took, and the grace period the operator renders from that measure is longer than the stop took."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from trainop import config, localrun, spec
from trainop.render import dtj

SLOW = 31  # seconds per fsync of the state file: one save slower than Kubernetes' 30 s

SLOW_DISK = f'''\
"""Test only: a slow disk for tests/cli/test_local_grace.py (fsync of a large file takes {SLOW} s)."""
import os
import time

_fsync = os.fsync


def _slow_fsync(fd):
    if os.fstat(fd).st_size > 1_000_000:
        time.sleep({SLOW})
    _fsync(fd)


os.fsync = _slow_fsync
'''


def job() -> spec.Job:
    body = {"apiVersion": "trainop.io/v1alpha1", "kind": "DistributedTrainingJob",
            "metadata": {"name": "grace", "namespace": "default", "uid": "0123456789ab"},
            "spec": {"framework": "pytorch", "launcher": "torchrun", "workers": 1, "gpusPerWorker": 0,
                     "data": {"synthetic": True}, "training": {"batchSize": 4, "imageSize": 32},
                     "checkpoint": {"everySteps": 100000, "volume": {"claimName": "checkpoints"}},
                     # the ranks' share of the grace period, which the worker's shell enforces
                     # (render/dtj.py stop_ranks): room for the slow save, as a measure would give
                     "terminationGracePeriodSeconds": 120}}
    return spec.parse(body, config.from_dict(None))


@pytest.mark.trainer
@pytest.mark.timeout(300)
def test_a_sigterm_save_slower_than_30s_ends_within_the_grace_sized_from_it(tmp_path):
    j = job()
    plan = localrun.plan(j, localrun.Options(epochs=50, steps_per_epoch=4), tmp_path / "run", localrun.free_port())
    localrun.write_files(plan)
    (tmp_path / "slowdisk").mkdir()
    (tmp_path / "slowdisk" / "sitecustomize.py").write_text(SLOW_DISK)
    env = dict(os.environ) | plan.env | {
        "TRAINOP_CHECKPOINT_EVERY": "100000",  # the one slow save is the SIGTERM's (the local run saves each epoch)
        "PYTHONPATH": os.pathsep.join([str(tmp_path / "slowdisk"), *sys.path]),
        "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    (script,) = plan.scripts.values()
    pod = subprocess.Popen(["sh", "-c", script], env=env, cwd=plan.run_dir, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        lines = []
        for line in pod.stdout:  # training is under way at its first report
            lines.append(line)
            if line.startswith("{"):
                break
        pod.send_signal(signal.SIGTERM)  # to the pod's first process only, as the kubelet does
        sent = time.monotonic()
        rest, _ = pod.communicate(timeout=j.max_checkpoint_grace_seconds)
        took = time.monotonic() - sent
    finally:
        if pod.poll() is None:
            os.killpg(pod.pid, signal.SIGKILL)
    text = "".join(lines) + rest
    saved = localrun.newest_checkpoint(plan.checkpoint_root)
    assert saved is not None, text[-3000:]
    assert f"checkpoint step {saved.name.removeprefix('step-')} saved" in text, text[-3000:]
    measured = json.loads((saved / "COMPLETE").read_text())["saveSeconds"]
    assert measured >= SLOW, measured
    assert took > 30, took  # longer than Kubernetes' default grace period
    grace = dtj.save_grace(dataclasses.replace(j, save_seconds=measured))
    assert took < grace, (took, grace)  # the pods made after this measure would have let it end
    assert pod.returncode != 0  # stopped, not finished (torchrun reports its rank's 143)
