"""Jobs on real pods: sshd, mpirun over ssh through cluster DNS, torchrun, the log sidecar and a
gang restart, each in a container on a real kubelet (the trainer image, PyTorch CPU build).

The jobs are the examples reduced to finish in about a minute on 2 cores: ResNet-18 with 10
classes, 32-pixel images, batch 8, 2 workers x 1 rank, a few steps, each held to HOLD seconds.
"""

from __future__ import annotations

import ipaddress
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.fixtures.cluster import OperatorProcess, cli_config
from tests.fixtures.waiting import wait_until
from trainop import config, localrun, spec
from trainop.render import dtj as render_dtj

pytestmark = [pytest.mark.real, pytest.mark.azurite]

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
DIGEST = re.compile(r"rank (\d+)/(\d+) parameter sha256 ([0-9a-f]{64})")
MPI_PI_IMAGE = "trainop/mpi-pi:0.1.0"  # built by devcluster/images.py from tests/e2e/images/mpi-pi
RUN_TIMEOUT = 600  # seconds for a reduced job on a loaded 2-core machine, cold page cache
# Every step of a reduced job lasts at least this (the trainer's --min-step-seconds): a fault test
# sizes its run in steps so that its fault lands mid-run, and the hold keeps that length on an idle
# machine as on a loaded one, with the ranks asleep rather than computing (a step's compute here
# is ~0.1 s a rank).
HOLD = 0.5
# Reports within the epoch every 2 s (the trainer's default: 60, or a quarter of the stall
# timeout): a test that waits for the first step report before its fault sees one mid-run.
REPORT_SECONDS = 2


def reduced(example: str, name: str, steps: int = 5, image_size: int = 32, paced: bool = True,
            **spec_changes) -> dict:
    """The example with 2 workers x 1 GPU and a small model (10 classes), as `trainop run --local`
    reduces it; `paced`: each step held to HOLD seconds, reports every REPORT_SECONDS."""
    manifest = yaml.safe_load((EXAMPLES / example).read_text())
    manifest["metadata"] = {"name": name}
    body = manifest["spec"]
    body |= {"workers": 2, "gpusPerWorker": 1}
    body["training"] = dict(body.get("training", {}), batchSize=8, epochs=1, stepsPerEpoch=steps,
                            imageSize=image_size, channelsLast=False)
    body["resources"] = {"requests": {"cpu": "100m", "memory": "256Mi"}}
    body.update(spec_changes)
    for key in [k for k, v in spec_changes.items() if v is None]:
        del body[key]
    job = spec.parse(manifest | {"metadata": {"name": name, "namespace": "x"}}, config.load())
    # (--num-classes: synthetic data only; a folder's own classes win)
    body["args"] = [*render_dtj.trainer_args(job), "--model", "resnet18", "--num-classes", "10"]
    if paced:
        body["args"] += ["--min-step-seconds", str(HOLD), "--report-seconds", str(REPORT_SECONDS)]
    # The ranks of both real nodes share this machine's 2 cores, as `trainop run --local`'s do, so
    # they get its settings: one intra-op thread each (PyTorch's default is a thread per core, and
    # threads beyond the cores spin) and Horovod's 50 ms cycle (localrun.HOROVOD_CYCLE_TIME: its
    # 1 ms cycle spins while a rank waits for its peer). A 2-rank, 60-step run of this model here
    # (2026-12-07): 42-56 CPU-s and 0.26-0.32 s a step without them, 33-37 CPU-s and 0.19-0.21 s with.
    body["env"] = [*body.get("env", []), {"name": "HOROVOD_CYCLE_TIME", "value": localrun.HOROVOD_CYCLE_TIME},
                   {"name": "OMP_NUM_THREADS", "value": "1"}]
    return manifest


def digests(log: str) -> dict[int, str]:
    return {int(rank): digest for rank, _, digest in DIGEST.findall(log)}


def wait_phase(cluster, namespace: str, name: str, phase: str, timeout: float = RUN_TIMEOUT) -> dict:
    def status():
        current = cluster.get("dtj", name, "-n", namespace).get("status", {})
        if current.get("phase") == "Failed" and phase != "Failed":
            raise AssertionError(f"{name} failed: {current}")
        return current if current.get("phase") == phase else None
    return wait_until(status, timeout=timeout, interval=1, what=f"{name} phase {phase}")


def with_blob_output(manifest: dict, cluster, namespace: str, azurite) -> None:
    container = azurite.new_container()
    sas = azurite.container_sas(container.container_name, permission="racwl")
    cluster.kubectl("create", "secret", "generic", "storage", "-n", namespace, f"--from-literal=sas={sas}")
    manifest["spec"]["output"] = {"blob": {"accountURL": azurite.http_url, "container": container.container_name,
                                           "prefix": "runs", "auth": {"sasSecretRef": {"name": "storage", "key": "sas"}}}}


def test_horovod_over_ssh_on_real_pods(real_cluster, real_namespace, real_operator, pod_azurite, tmp_path):
    """(a) The PyTorch + Horovod example: workers run sshd, the launcher's mpirun reaches them over
    ssh by their hostfile names (the launcher's hostAliases: their pod IPs, no cluster DNS), every
    rank ends with identical parameters, the job Succeeds, the log sidecar ships the log, status.metrics is filled, and `trainop logs` works after the pods go."""
    ns = real_namespace
    manifest = reduced("pytorch-horovod-synthetic.yaml", "hvd")
    with_blob_output(manifest, real_cluster, ns, pod_azurite)
    real_cluster.apply(manifest, ns)

    status = wait_phase(real_cluster, ns, "hvd", "Succeeded")
    real_cluster.assert_ran_on_real_nodes(ns, "trainop.io/job-name=hvd")
    launcher_log = real_cluster.logs(ns, "job/hvd-launcher", "-c", "launcher")
    ranks = digests(launcher_log)
    assert sorted(ranks) == [0, 1] and len(set(ranks.values())) == 1, launcher_log[-3000:]
    aliases = real_cluster.get("job", "hvd-launcher", "-n", ns)["spec"]["template"]["spec"]["hostAliases"]
    hostfile = real_cluster.get("configmap", "hvd-mpi", "-n", ns)["data"]["hostfile"]
    assert [a["hostnames"] for a in aliases] == [[line.split()[0]] for line in hostfile.splitlines()]
    assert len({ipaddress.ip_address(a["ip"]) for a in aliases}) == 2  # (the ranks met over them)
    metrics = wait_until(lambda: (real_cluster.get("dtj", "hvd", "-n", ns)["status"].get("metrics") or {})
                         .get("final") and real_cluster.get("dtj", "hvd", "-n", ns)["status"]["metrics"],
                         timeout=120, what="final metrics in the status")
    assert metrics["worldSize"] == 2 and metrics["step"] >= 5
    # status.progress from the real trainer's final report: done, and no ETA on a finished job.
    shown = real_cluster.get("dtj", "hvd", "-n", ns)["status"]["progress"]
    assert shown["percent"] == 100 and shown["step"] == shown["totalSteps"] == metrics["step"], shown
    assert "eta" not in shown

    # The log outlives the pods: delete the job's pods, then read it from Blob Storage.
    real_cluster.kubectl("delete", "pods", "-n", ns, "-l", "trainop.io/job-name=hvd", "--wait=true")
    shown = subprocess.run([sys.executable, "-m", "trainop", "logs", "hvd", "-n", ns,
                            "--kubeconfig", str(real_cluster.kubeconfig),
                            "--config", str(cli_config(tmp_path / "cli-config.yaml"))],
                           capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0, shown.stderr
    assert digests(shown.stdout) == ranks
    assert status["phase"] == "Succeeded"


def test_torchrun_on_real_pods(real_cluster, real_namespace, real_operator):
    """(b) The torchrun example: rendezvous on worker 0 through its DNS name, DDP over gloo."""
    ns = real_namespace
    real_cluster.apply(reduced("pytorch-torchrun-synthetic.yaml", "ddp"), ns)
    wait_phase(real_cluster, ns, "ddp", "Succeeded")
    real_cluster.assert_ran_on_real_nodes(ns, "trainop.io/job-name=ddp")
    logs = real_cluster.logs(ns, "ddp-worker-0", "-c", "worker") + real_cluster.logs(ns, "ddp-worker-1", "-c", "worker")
    ranks = digests(logs)
    assert sorted(ranks) == [0, 1] and len(set(ranks.values())) == 1, logs[-3000:]


def test_killed_worker_restarts_the_gang_then_succeeds(real_cluster, real_namespace, real_operator):
    """(c) SIGKILL of a worker's container mid-run (from the host, as the OOM killer would): the
    gang restarts with a reason naming the pod, the container and the real exit code (137), and
    the second attempt succeeds."""
    ns = real_namespace
    manifest = reduced("pytorch-horovod-synthetic.yaml", "crash", steps=40)
    manifest["spec"]["runPolicy"] = {"backoffLimit": 2, "cleanPodPolicy": "None"}
    real_cluster.apply(manifest, ns)

    def training():  # a step report in the launcher's log: mpirun runs the ranks right now
        pods = real_cluster.get("pods", "-n", ns, "-l", "trainop.io/job-name=crash,trainop.io/role=launcher")["items"]
        running = [p for p in pods if p["status"].get("phase") == "Running"]
        return running and '"step"' in real_cluster.logs(ns, running[0]["metadata"]["name"], "-c", "launcher")
    wait_until(training, timeout=RUN_TIMEOUT, interval=1, what="the first attempt's training steps")
    worker = real_cluster.get("pod", "crash-worker-1", "-n", ns)
    container_id = next(c["containerID"] for c in worker["status"]["containerStatuses"] if c["name"] == "worker")
    real_cluster.dev.kill_container(worker["spec"]["nodeName"], container_id)

    status = wait_phase(real_cluster, ns, "crash", "Succeeded")
    assert (status["attempt"], status["restarts"]["failures"]) == (1, 1)
    failure = status["lastFailure"]
    assert (failure["pod"], failure["container"], failure["exitCode"]) == ("crash-worker-1", "worker", 137), failure
    assert f"pod crash-worker-1 on node {failure['node']} container worker exited with code 137" in failure["message"]


def test_a_job_that_fills_its_output_emptydir_is_evicted_and_counted(real_cluster, real_namespace, tmp_path):
    """Review L7, the attack carried out: job code writes past the emptyDir trainop gives it
    (/output without a claim, capped by the admin's limits.emptyDirSizeLimit, here 16Mi). The
    real kubelet evicts the pod before the node's disk fills, and the eviction counts against
    backoffLimit as the job's own StorageLimit failure (node pressure would not count)."""
    ns = real_namespace
    op = OperatorProcess(real_cluster, [ns], tmp_path / "operator.log",
                         config={"limits": {"emptyDirSizeLimit": "16Mi"}}).start()
    try:
        manifest = {"apiVersion": "trainop.io/v1alpha1", "kind": "DistributedTrainingJob",
                    "metadata": {"name": "fill"},
                    "spec": {"framework": "pytorch", "launcher": "torchrun", "workers": 1, "gpusPerWorker": 1,
                             "resources": {"requests": {"cpu": "50m", "memory": "64Mi"}},
                             "command": ["sh", "-c", "dd if=/dev/zero of=/output/fill bs=1M count=64 && sleep 600"],
                             "runPolicy": {"backoffLimit": 0}}}
        real_cluster.apply(manifest, ns)
        wait_until(lambda: [p for p in real_cluster.get("pods", "-n", ns, "-l", "trainop.io/job-name=fill")["items"]
                            if p["spec"].get("nodeName")], timeout=120, what="the worker bound to a node")
        (pod,) = real_cluster.assert_ran_on_real_nodes(ns, "trainop.io/job-name=fill")
        assert {v["name"]: v for v in pod["spec"]["volumes"]}["output"]["emptyDir"] == {"sizeLimit": "16Mi"}
        status = wait_phase(real_cluster, ns, "fill", "Failed", timeout=180)
        failure = status["lastFailure"]
        assert failure["cause"] == "StorageLimit", failure
        assert 'Usage of EmptyDir volume "output" exceeds the limit "16Mi"' in failure["message"], failure
        failed = next(c for c in status["conditions"] if c["type"] == "Failed")
        assert failed["reason"] == "BackoffLimitExceeded", failed
    finally:
        op.stop()


def test_custom_image_with_its_own_non_root_user(real_cluster, real_namespace, real_operator):
    """A user's own MPI image in the MPI Operator's style (tests/e2e/images/mpi-pi: user mpiuser,
    uid 1000, its own ~/.ssh) runs unchanged as that user: sshd and mpirun use trainop's files
    under /etc/trainop, and the image's ~/.ssh is left as it was."""
    ns = real_namespace
    real_cluster.apply({
        "apiVersion": "trainop.io/v1alpha1", "kind": "DistributedTrainingJob", "metadata": {"name": "pi"},
        "spec": {"workers": 2, "gpusPerWorker": 1, "image": MPI_PI_IMAGE, "command": ["mpi-pi"],
                 "securityContext": {"runAsUser": 1000, "runAsGroup": 1000},
                 "resources": {"requests": {"cpu": "100m", "memory": "64Mi"}},
                 "runPolicy": {"cleanPodPolicy": "None"}}}, ns)
    wait_phase(real_cluster, ns, "pi", "Succeeded")
    real_cluster.assert_ran_on_real_nodes(ns, "trainop.io/job-name=pi")
    log = real_cluster.logs(ns, "job/pi-launcher", "-c", "launcher")
    assert "rank 0/2 on pi-worker-0 as uid 1000" in log and "rank 1/2 on pi-worker-1 as uid 1000" in log, log
    assert "pi is approximately 3.14159265" in log
    # `kubectl exec` through the kubelet: the worker runs as the image's user, its ~/.ssh untouched.
    shown = real_cluster.kubectl("exec", "-n", ns, "pi-worker-0", "-c", "worker", "--",
                                 "sh", "-c", "id -u; cat ~/.ssh/config").stdout
    assert shown == "1000\nHost *\n  StrictHostKeyChecking no\n"
