"""`trainop convert` against the real API server and the operator: every peer example in
tests/fixtures/peers (the MPI Operator's and the Training Operator's own, copied) is translated
by the CLI as a user runs it, created through the API server with the project's CRDs, and run by
the operator on the KWOK nodes until its gang is up: the workers and, for MPI, the launcher
Running, the job's phase Running."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.cluster.test_dtj import FAST, Api
from tests.fixtures.waiting import wait_until
from tests.unit.test_convert import FULL, PEERS

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(240)]


def trainop_convert(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    """`python -m trainop convert ...`, this checkout's code, in a process of its own."""
    operator_dir = str(Path(__file__).resolve().parents[2] / "operator")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [operator_dir, os.environ.get("PYTHONPATH")])))
    return subprocess.run([sys.executable, "-m", "trainop", "convert", *args], input=stdin,
                          capture_output=True, text=True, env=env, timeout=120)


@pytest.fixture
def api(cluster, namespace):
    return Api(cluster, namespace)


@pytest.mark.parametrize("example", sorted(p.name for p in PEERS.glob("*.yaml")))
def test_each_translated_peer_example_runs(example, cluster, namespace, api, operator_factory):
    result = trainop_convert(str(PEERS / example))
    assert result.returncode == 0, result.stderr
    assert "warning: " in result.stderr  # every example differs somewhere (the defaults at least)
    job = yaml.safe_load(result.stdout)
    job["metadata"]["namespace"] = namespace  # the Training Operator's examples name `kubeflow`
    name, spec = job["metadata"]["name"], job["spec"]
    cluster.apply(job, namespace)  # the real API server judges it against the project's CRDs
    operator_factory(config=FAST)

    workers = wait_until(lambda: [p for p in api.pods(name, "worker") if p.status.phase == "Running"]
                         if len([p for p in api.pods(name, "worker") if p.status.phase == "Running"])
                         == spec["workers"] else None,
                         timeout=90, what=f"{spec['workers']} Running workers of {name} (status: {api.status(name)})")
    if spec["launcher"] == "mpi":
        launcher = api.wait_running(name, timeout=90)
        script = launcher.spec.containers[0].command[-1]
        program = " ".join(spec.get("command") or ["python", "-m", "trainop_trainer"])
        assert program in script, script  # mpirun starts the translated program
    else:
        script = workers[0].spec.containers[0].command[-1]
        assert "torchrun" in script and " ".join(spec.get("command") or ["trainop_trainer"]) in script
    api.wait_phase(name, "Running", timeout=90)
    for pod in workers:
        main = pod.spec.containers[0]
        assert main.image == spec["image"]
        if "securityContext" in spec:
            assert pod.spec.security_context.run_as_user == spec["securityContext"]["runAsUser"]
        gpus = (main.resources.limits or {}).get("nvidia.com/gpu")
        assert gpus == (str(spec["gpusPerWorker"]) if spec.get("gpusPerWorker") else None)


def test_a_job_using_every_field_is_accepted_by_the_api_server(cluster, namespace):
    """The translation of an MPIJob with volumes, sidecars, affinity, env from ConfigMaps and
    placement (tests/unit/test_convert.py's FULL): the API server's own validation of the CRD,
    its core/v1 schemas and its CEL rules accepts it (server dry run: its claim does not exist)."""
    source = copy.deepcopy(FULL)
    source["metadata"]["namespace"] = namespace
    result = trainop_convert(stdin=yaml.safe_dump(source))
    assert result.returncode == 0, result.stderr
    job = yaml.safe_load(result.stdout)
    assert job["spec"]["podTemplate"]["worker"]["spec"]["volumes"]
    applied = cluster.kubectl("apply", "--dry-run=server", "-n", namespace, "-f", "-", input=result.stdout,
                              check=False)
    assert applied.returncode == 0, applied.stderr
