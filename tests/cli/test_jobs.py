"""`trainop submit | get | describe | delete` against the real local control plane, with the
operator running as production runs it; connection flags as kubectl's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.fixtures.waiting import wait_until

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(240)]

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "pytorch-horovod-synthetic.yaml"
FAST = {"resyncSeconds": 0.5}


def trainop(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "trainop", *args], capture_output=True, text=True,
                          timeout=120, cwd=REPO, env=dict(os.environ, **(env or {})))


def connect(cluster, namespace) -> list[str]:
    return ["--kubeconfig", str(cluster.kubeconfig), "-n", namespace]


def dtj(cluster, namespace, name):
    result = cluster.kubectl("get", "dtj", name, "-n", namespace, "-o", "json", check=False)
    return json.loads(result.stdout) if result.returncode == 0 else None


def phase(cluster, namespace, name):
    return ((dtj(cluster, namespace, name) or {}).get("status") or {}).get("phase")


def test_submit_get_describe_delete_a_job_through_its_life(cluster, namespace, operator_factory):
    operator_factory(config=FAST)
    result = trainop("submit", str(EXAMPLE), *connect(cluster, namespace))
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[0] == "distributedtrainingjob.trainop.io/resnet50-horovod created"
    assert f"trainop logs resnet50-horovod -n {namespace} -f" in result.stdout

    launcher = wait_until(lambda: next((p["metadata"]["name"] for p in cluster.get(
        "pods", "-n", namespace, "-l", "trainop.io/role=launcher")["items"]
        if p["status"].get("phase") == "Running"), None), timeout=90, what="the launcher pod Running")
    table = trainop("get", *connect(cluster, namespace)).stdout.splitlines()
    assert table[0].split() == ["NAME", "PHASE", "WORKERS", "GPUS", "RESTARTS", "IMAGES/SEC", "PROGRESS", "ETA",
                                "AGE"]
    assert table[1].split()[:8] == ["resnet50-horovod", "Running", "2/2", "8", "0", "-", "-", "-"]

    # The trainer's report reaches status.metrics (as the launcher's log shipper writes it).
    cluster.kubectl("patch", "dtj", "resnet50-horovod", "-n", namespace, "--subresource=status", "--type=merge",
                    "-p", json.dumps({"status": {"metrics": {"epoch": 1, "imagesPerSec": 1234.5, "loss": 2.5}}}))
    assert trainop("get", "resnet50-horovod", *connect(cluster, namespace)).stdout.splitlines()[1].split()[5] == "1234.5"

    text = trainop("describe", "resnet50-horovod", *connect(cluster, namespace)).stdout
    assert "Phase:" in text and "Running" in text
    assert "pytorch, launcher mpi (OpenMPI)" in text
    assert "2/2 ready, 4 GPUs each (8 in all)" in text
    assert "imagesPerSec 1234.5" in text
    pods_section = text.split("Pods:")[1].split("Events:")[0]
    for pod in ("resnet50-horovod-worker-0", "resnet50-horovod-worker-1", launcher):
        assert pod in pods_section
    assert "aks-gpu-" in pods_section  # scheduled onto the GPU pool
    conditions = text.split("Conditions:")[1].split("Pods:")[0]
    assert "WorkersReady" in conditions and "True" in conditions
    assert "Events:" in text and "<none>" not in text.split("Events:")[1]

    cluster.end_pod(namespace, launcher, 0)
    wait_until(lambda: phase(cluster, namespace, "resnet50-horovod") == "Succeeded", timeout=60, what="Succeeded")
    wide = trainop("get", "-o", "wide", *connect(cluster, namespace)).stdout.splitlines()
    assert wide[1].split()[1] == "Succeeded" and wide[1].split()[9:12] == ["pytorch", "mpi", "default"]

    result = trainop("delete", "resnet50-horovod", *connect(cluster, namespace))
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "distributedtrainingjob.trainop.io/resnet50-horovod deleted"
    assert dtj(cluster, namespace, "resnet50-horovod") is None  # --wait is the default
    wait_until(lambda: not cluster.get("pods", "-n", namespace, "-l", "trainop.io/job-name=resnet50-horovod")["items"],
               timeout=60, what="the job's pods garbage-collected")


def test_get_yaml_json_all_namespaces_and_an_empty_namespace(cluster, namespace):
    assert trainop("submit", str(EXAMPLE), *connect(cluster, namespace)).returncode == 0
    as_yaml = yaml.safe_load(trainop("get", "resnet50-horovod", "-o", "yaml", *connect(cluster, namespace)).stdout)
    assert as_yaml["kind"] == "DistributedTrainingJob" and as_yaml["spec"]["workers"] == 2
    as_json = json.loads(trainop("get", "-o", "json", *connect(cluster, namespace)).stdout)
    assert [i["metadata"]["name"] for i in as_json["items"]] == ["resnet50-horovod"]
    everywhere = trainop("get", "-A", "--kubeconfig", str(cluster.kubeconfig)).stdout.splitlines()
    assert everywhere[0].split()[:2] == ["NAMESPACE", "NAME"]
    assert any(line.split()[:2] == [namespace, "resnet50-horovod"] for line in everywhere)
    empty = f"{namespace}-none"
    result = trainop("get", *connect(cluster, empty))
    assert result.returncode == 0 and result.stdout == "" and f"No training jobs in namespace {empty}." in result.stderr


def test_kubeconfig_from_the_environment_and_the_contexts_namespace(cluster, namespace, tmp_path):
    assert trainop("submit", str(EXAMPLE), *connect(cluster, namespace)).returncode == 0
    config = yaml.safe_load(cluster.kubeconfig.read_text())
    base = config["contexts"][0]
    config["contexts"].append({"name": "team", "context": {**base["context"], "namespace": namespace}})
    path = tmp_path / "kubeconfig"
    path.write_text(yaml.safe_dump(config))
    by_context = trainop("get", "--kubeconfig", str(path), "--context", "team")
    assert by_context.stdout.splitlines()[1].split()[0] == "resnet50-horovod", by_context.stderr
    config["current-context"] = "team"
    path.write_text(yaml.safe_dump(config))
    by_env = trainop("describe", "resnet50-horovod", env={"KUBECONFIG": str(path)})
    assert by_env.returncode == 0 and f"Namespace: {namespace}" in " ".join(by_env.stdout.split()), by_env.stderr


def test_submit_refuses_bad_input_and_creates_nothing(cluster, namespace, tmp_path):
    base = yaml.safe_load(EXAMPLE.read_text())
    schema_bad = {**base, "spec": {**base["spec"], "workers": 0}}
    (tmp_path / "schema.yaml").write_text(yaml.safe_dump(schema_bad))
    result = trainop("submit", str(tmp_path / "schema.yaml"), *connect(cluster, namespace))
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        f"trainop submit: {tmp_path}/schema.yaml: spec.workers: 0 is less than the minimum of 1"]

    # A rule only the API server checks (CEL: the name must make valid pod hostnames), in the
    # second document: the first, valid one is not created either.
    good = {**base, "metadata": {"name": "first"}}
    cel_bad = {**base, "metadata": {"name": "x" * 60}}
    (tmp_path / "two.yaml").write_text(yaml.safe_dump_all([good, cel_bad]))
    result = trainop("submit", str(tmp_path / "two.yaml"), *connect(cluster, namespace))
    assert result.returncode == 1
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith(f"trainop submit: distributedtrainingjob.trainop.io/{'x' * 60}: the API server refused it:")
    assert "metadata.name must be at most 48 characters" in line
    assert cluster.get("dtj", "-n", namespace)["items"] == []

    result = trainop("submit", str(tmp_path / "missing.yaml"), *connect(cluster, namespace))
    assert result.returncode == 1 and result.stderr.strip() == f"trainop submit: {tmp_path}/missing.yaml: no such file"


def test_submit_twice_delete_missing_and_unreachable_cluster(cluster, namespace, tmp_path):
    assert trainop("submit", str(EXAMPLE), *connect(cluster, namespace)).returncode == 0
    again = trainop("submit", str(EXAMPLE), *connect(cluster, namespace))
    assert again.returncode == 1
    assert again.stderr.strip() == (f"trainop submit: distributedtrainingjob.trainop.io/resnet50-horovod already "
                                    f"exists in namespace {namespace}; delete it first (trainop delete) or rename it")
    missing = trainop("delete", "ghost", *connect(cluster, namespace))
    assert missing.returncode == 1
    assert missing.stderr.strip() == f"trainop delete: distributedtrainingjob.trainop.io ghost not found in namespace {namespace}"
    assert trainop("delete", "ghost", "--ignore-not-found", *connect(cluster, namespace)).returncode == 0
    assert trainop("describe", "ghost", *connect(cluster, namespace)).returncode == 1

    config = yaml.safe_load(cluster.kubeconfig.read_text())
    config["clusters"][0]["cluster"]["server"] = "https://127.0.0.1:1"
    (tmp_path / "down").write_text(yaml.safe_dump(config))
    down = trainop("get", "--kubeconfig", str(tmp_path / "down"))
    assert down.returncode == 1
    assert down.stderr.strip().splitlines() == [
        "trainop get: cannot reach the API server (MaxRetryError); is the cluster up?"]
