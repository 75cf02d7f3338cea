"""Progress and ETA (issue 17, item 2) on the real local control plane (KWOK runs no containers):
reports written into the progress ConfigMap the way worker 0's shipper writes them (its own
code, ProgressReporter, with a token of the pod's ServiceAccount) become status.progress; kubectl's
printer columns, `trainop get`, `trainop get -w` and `trainop describe` show them. Then the real
trainer's TensorBoard event files, uploaded by the shipper's own upload code into Azurite, are
served by `trainop tensorboard JOB` with the real TensorBoard, read back through its HTTP API."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import kubernetes.client as k8s
import pytest

from tests.cluster.test_logs import launcher_pod, setup_job, token_kubeconfig
from tests.fixtures.azurite import free_port
from tests.fixtures.cluster import cli_config
from tests.fixtures.waiting import wait_until
from trainop import kube, logship, progress
from trainop.cli.logs import job_folder
from trainop.render import logship as render

pytestmark = [pytest.mark.cluster, pytest.mark.azurite]


def status(cluster, namespace: str, name: str) -> dict:
    return cluster.get("dtj", name, "-n", namespace).get("status") or {}


def report(step: int, at: float, rate: float, final: bool = False) -> str:
    return json.dumps({"epoch": step // 100, "step": step, "totalSteps": 1200, "loss": 2.0, "imagesPerSec": rate,
                       "stepTime": 0.25, "worldSize": 2, "time": at, "final": final}) + "\n"


def columns(text: str) -> dict[str, str]:
    """kubectl's table (one row) as {column: value}, by the header's positions."""
    header, row = text.splitlines()[:2]
    starts = [m.start() for m in re.finditer(r"\S+", header)]
    names = header.split()
    return {n: row[s:e].strip() for n, s, e in zip(names, starts, [*starts[1:], None])}


def test_progress_columns_watch_and_chart(cluster, namespace, operator, azurite, tmp_path):
    setup_job(cluster, namespace, azurite, "prog")
    launcher_pod(cluster, namespace, "prog")
    wait_until(lambda: status(cluster, namespace, "prog").get("phase") == "Running", timeout=120,
               what="the job to run")
    worker0 = cluster.get("pod", "prog-worker-0", "-n", namespace)
    shipper_config = token_kubeconfig(cluster, namespace, worker0["spec"]["serviceAccountName"], tmp_path / "shipper")
    api = k8s.CoreV1Api(kube.connect(str(shipper_config))[0])
    metrics = tmp_path / "metrics.jsonl"
    shipper = logship.ProgressReporter(
        metrics, 0, lambda body: api.patch_namespaced_config_map("prog-progress", namespace, body))

    t0 = time.time()
    metrics.write_text(report(100, t0 - 50, 900.0) + report(200, t0 - 25, 1000.0) + report(300, t0, 1100.0))
    shipper.tick(force=True)
    wait_until(lambda: status(cluster, namespace, "prog").get("progress", {}).get("percent") == 25.0,
               timeout=60, what="status.progress from the shipper's report")
    shown = status(cluster, namespace, "prog")["progress"]
    assert shown == {"step": 300, "totalSteps": 1200, "percent": 25.0, "imagesPerSec": 1100.0,
                     "secondsPerStep": 0.25, "secondsLeft": 225, "reportTime": progress.timestamp(t0),
                     "eta": progress.timestamp(t0 + 225)}

    # kubectl's own printer columns (additionalPrinterColumns), wide adds Images/s.
    table = columns(cluster.kubectl("get", "dtj", "prog", "-n", namespace, "-o", "wide").stdout)
    assert (table["PROGRESS"], table["ETA"], table["IMAGES/S"]) == ("25", shown["eta"], "1100")

    trainop = [sys.executable, "-m", "trainop", "--kubeconfig", str(cluster.kubeconfig), "-n", namespace]
    got = subprocess.run([sys.executable, "-m", "trainop", "get", "prog", "--kubeconfig", str(cluster.kubeconfig),
                          "-n", namespace], capture_output=True, text=True, timeout=60)
    assert got.returncode == 0, got.stderr
    row = dict(zip(got.stdout.splitlines()[0].split(), got.stdout.splitlines()[1].split()))
    assert row["PROGRESS"] == "25%" and row["IMAGES/SEC"] == "1100.0"
    assert re.fullmatch(r"\d+m\d\ds|\d+s|due", row["ETA"]), row  # about 3m45s from the report

    # get -w: the table, then a row per change, from a watch.
    watched = tmp_path / "watch.out"
    with open(watched, "w") as out:
        # Ctrl-C as from a terminal: a test session started in the background (`make test &`)
        # ignores SIGINT, and a child inherits that, so Python would install no handler for it.
        watcher = subprocess.Popen([*trainop[:3], "get", "-w", *trainop[3:]], stdout=out, stderr=subprocess.STDOUT,
                                   preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        wait_until(lambda: "25%" in watched.read_text(), timeout=60, what="get -w's table")
        with open(metrics, "a") as f:
            f.write(report(600, t0 + 75, 1200.0))
        shipper.tick(force=True)
        wait_until(lambda: re.search(r"^prog\s+Running\s.*\s50%\s", watched.read_text(), re.M), timeout=60,
                   what="get -w to print the new progress")

        # describe: the progress line and the chart of the shipper's history (4 reports).
        described = subprocess.run([*trainop[:3], "describe", "prog", *trainop[3:]], capture_output=True,
                                   text=True, timeout=60)
        assert described.returncode == 0, described.stderr
        assert "Progress:" in described.stdout and "50.0% (step 600 of 1200)" in described.stdout, described.stdout
        chart = described.stdout.split("Throughput:\n")[1].split("\n\n")[0].splitlines()
        assert chart[0].strip() == "images/sec over the last 4 report(s): latest 1200.0 at step 600, peak 1200.0"
        assert chart[1].strip() == "1200.0 ┤" + progress.chart(render.progress_history(
            cluster.get("configmap", "prog-progress", "-n", namespace)))[1].split("┤")[1]
        assert chart[6].strip() == "0 ┤████"  # every sample's bar reaches the bottom row
        assert len(chart) == 6 + 3  # heading, 6 rows, axis, times

        # Over: no ETA any more, in the status, kubectl's column and the watch.
        cluster.end_pod(namespace, launcher_pod(cluster, namespace, "prog")["metadata"]["name"], exit_code=0)
        wait_until(lambda: status(cluster, namespace, "prog").get("phase") == "Succeeded", timeout=120,
                   what="the job to succeed")
        wait_until(lambda: "eta" not in status(cluster, namespace, "prog")["progress"], timeout=60,
                   what="the ETA to go")
        assert columns(cluster.kubectl("get", "dtj", "prog", "-n", namespace).stdout)["ETA"] == ""  # blank: no value
        wait_until(lambda: re.search(r"^prog\s+Succeeded\s.*\s50%\s+-\s", watched.read_text(), re.M), timeout=60,
                   what="get -w to print the finished job")
    finally:
        watcher.send_signal(signal.SIGINT)
        assert watcher.wait(timeout=30) == 130
    lines = watched.read_text().splitlines()
    assert lines[0].split()[:9] == ["NAME", "PHASE", "WORKERS", "GPUS", "RESTARTS", "IMAGES/SEC", "PROGRESS", "ETA",
                                    "AGE"]
    assert "Traceback" not in watched.read_text()


TINY = ["--framework", "pytorch", "--backend", "native", "--synthetic", "--image-size", "32", "--model", "resnet18",
        "--num-classes", "4", "--synthetic-batches", "2", "--batch-size", "2", "--epochs", "2",
        "--steps-per-epoch", "2", "--loader-workers", "1"]


def get_json(url: str):
    with urllib.request.urlopen(url, timeout=10) as resp:
        return json.loads(resp.read())


@pytest.mark.trainer
def test_trainer_event_files_are_shipped_and_served_by_tensorboard(cluster, namespace, azurite, tmp_path):
    out = tmp_path / "output"
    trained = subprocess.run([sys.executable, "-m", "trainop_trainer", *TINY, "--output-dir", str(out)],
                             capture_output=True, text=True, timeout=600)
    assert trained.returncode == 0, trained.stderr[-3000:]
    reports = [json.loads(line) for line in (out / render.METRICS_NAME).read_text().splitlines()]
    assert [r["totalSteps"] for r in reports] == [4, 4, 4] and reports[-1]["final"]
    assert list((out / "tensorboard").glob("events.out.tfevents.*"))

    # The shipper's own upload, as at the end of two attempts (a restart), under the job's folder.
    _, container = setup_job(cluster, namespace, azurite, "tb")
    job_dir = job_folder(cluster.get("dtj", "tb", "-n", namespace))  # runs/<namespace>/tb-<uid8>
    for attempt in (0, 1):
        assert logship.upload_dir(container, out, f"{job_dir}/{attempt}/output") >= 3

    port = free_port()
    log = tmp_path / "tensorboard.log"
    cmd = [sys.executable, "-m", "trainop", "tensorboard", "tb", "-n", namespace, "--kubeconfig",
           str(cluster.kubeconfig), "--port", str(port), "--config", str(cli_config(tmp_path / "cli-config.yaml"))]
    with open(log, "w") as f:
        served = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}/data"
    try:
        def runs():
            assert served.poll() is None, log.read_text()
            try:
                return sorted(get_json(f"{base}/runs")) == ["attempt-0", "attempt-1"]
            except OSError:
                return False
        wait_until(runs, timeout=120, what="TensorBoard to serve both attempts")
        tags = get_json(f"{base}/plugin/scalars/tags")
        assert {"train/loss", "throughput/images_per_sec", "throughput/step_time_s"} <= set(tags["attempt-0"])
        points = get_json(f"{base}/plugin/scalars/scalars?run=attempt-1&tag=throughput/images_per_sec")
        epochs = [r for r in reports if not r["final"]]
        assert [p[1] for p in points] == [r["step"] for r in epochs]
        assert [p[2] for p in points] == [pytest.approx(r["imagesPerSec"], rel=1e-3) for r in epochs]
    finally:
        served.send_signal(signal.SIGTERM)
        served.wait(timeout=30)
    folder = re.search(r"event file\(s\) of tb in (\S+)", log.read_text()).group(1)
    assert not Path(folder).exists()  # the download is removed when TensorBoard stops

    # Nothing yet for an attempt that has not ended: one line saying where it looked and why.
    missing = subprocess.run([*cmd, "--attempt", "2"], capture_output=True, text=True, timeout=120)
    assert missing.returncode == 1
    assert missing.stderr.strip().endswith(
        "no event files of attempt 2 under " + container.container_name + f"/{job_dir}/<attempt>/output/tensorboard/ "
        "yet: they are uploaded with the output once training ends (trainop get tb shows its progress)")
