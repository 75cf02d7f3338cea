"""The pure parts of `trainop get/describe`: ages and the describe text."""

import datetime as dt

from trainop.cli import jobs

NOW = dt.datetime(2026, 11, 26, 12, 0, 0, tzinfo=dt.timezone.utc)


def test_age_reads_like_kubectls():
    def ago(seconds):
        return jobs.age((NOW - dt.timedelta(seconds=seconds)).isoformat().replace("+00:00", "Z"), NOW)

    assert [ago(s) for s in (5, 119, 120, 7199, 7200, 172799, 172800)] == \
        ["5s", "119s", "2m", "119m", "2h", "47h", "2d"]
    assert jobs.age(None, NOW) == "<unknown>"


def test_describe_names_data_output_failure_and_lists_children():
    job = {"metadata": {"name": "j", "namespace": "team", "creationTimestamp": "2026-11-26T11:00:00Z"},
           "spec": {"framework": "tensorflow", "launcher": "mpi", "workers": 2, "gpusPerWorker": 8,
                    "infiniband": True, "nodePool": {"name": "ibgpu"},
                    "data": {"dataStageRef": {"name": "imagenet"}, "mountPath": "/data"},
                    "output": {"blob": {"accountURL": "https://acct.blob.core.windows.net/", "container": "results",
                                        "prefix": "rn50", "auth": {"sasSecretRef": {"name": "s", "key": "sas"}}}}},
           "status": {"phase": "Failed", "restarts": 3,
                      "lastFailure": {"message": "pod j-worker-1 container worker exited 137 (OOMKilled)"},
                      "conditions": [{"type": "Failed", "status": "True", "reason": "BackoffLimitExceeded",
                                      "message": "3 restarts"}]}}
    text = jobs.describe_text(job, [], [])
    lines = {line.split(":", 1)[0]: line.split(":", 1)[1].strip() for line in text.split("\n\n")[0].splitlines()}
    assert lines["Framework"] == "tensorflow, launcher mpi (OpenMPI)"
    assert lines["Last failure"] == "pod j-worker-1 container worker exited 137 (OOMKilled)"
    assert lines["Output"] == "Blob https://acct.blob.core.windows.net/results/rn50"
    assert "0/2 ready, 8 GPUs each (16 in all)" in text
    assert "ibgpu, InfiniBand" in text
    assert "DataStage imagenet, mounted read-only at /data" in text
    assert "BackoffLimitExceeded" in text.split("Conditions:")[1]
    assert text.split("Pods:")[1].split("Events:")[0].strip() == "<none>"
    assert "sasSecretRef" not in text  # the auth block is never printed


def test_row_shows_a_non_finite_rate_as_reported():
    job = {"metadata": {"name": "j", "namespace": "team", "creationTimestamp": "2026-11-26T11:00:00Z"},
           "spec": {"workers": 1}, "status": {"metrics": {"imagesPerSec": "NaN"}}}
    assert jobs.row(job, wide=False, with_namespace=False)[5] == "NaN"
    job["status"]["metrics"] = {"imagesPerSec": 812.54}
    assert jobs.row(job, wide=False, with_namespace=False)[5] == "812.5"
    job["status"]["metrics"] = {}
    assert jobs.row(job, wide=False, with_namespace=False)[5] == "-"


def test_row_shows_progress_and_the_time_left_until_the_eta():
    job = {"metadata": {"name": "j", "namespace": "team", "creationTimestamp": "2026-11-26T11:00:00Z"},
           "spec": {"workers": 1}, "status": {"phase": "Running", "progress": {"percent": 41.7,
                                                                              "eta": "2026-11-26T13:02:05Z"}}}
    assert jobs.row(job, wide=False, with_namespace=False, now=NOW)[6:] == ["42%", "1h02m", "60m"]
    job["status"]["progress"] = {"percent": 100.0}
    assert jobs.row(job, wide=False, with_namespace=False, now=NOW)[6:8] == ["100%", "-"]
    del job["status"]["progress"]
    assert jobs.row(job, wide=False, with_namespace=False, now=NOW)[6:8] == ["-", "-"]
    assert len(jobs.HEADER) == len(jobs.row(job, wide=False, with_namespace=False, now=NOW))


def test_describe_shows_progress_and_the_throughput_chart():
    job = {"metadata": {"name": "j", "namespace": "team", "creationTimestamp": "2026-11-26T11:00:00Z"},
           "spec": {"workers": 2},
           "status": {"phase": "Running", "progress": {
               "percent": 25.0, "step": 300, "totalSteps": 1200, "imagesPerSec": 1100.0, "secondsPerStep": 0.25,
               "eta": "2026-11-26T12:03:45Z", "reportTime": "2026-11-26T12:00:00Z", "secondsLeft": 225}}}
    t = NOW.timestamp()
    text = jobs.describe_text(job, [], [], history=[[t - 50, 100, 900.0], [t - 25, 200, 1000.0], [t, 300, 1100.0]],
                              now=NOW)
    assert ("Progress:  25.0% (step 300 of 1200), 1100.0 images/sec, 0.25 s/step, "
            "ETA 2026-11-26T12:03:45Z (in 3m45s), reported 2026-11-26T12:00:00Z") in text
    chart = text.split("Throughput:\n")[1].split("\n\n")[0].splitlines()
    assert chart[0] == "  images/sec over the last 3 report(s): latest 1100.0 at step 300, peak 1100.0"
    assert chart[-1] == "          11:59:10 … 12:00:00 UTC"
    assert "Throughput:" not in jobs.describe_text(job, [], [], history=[], now=NOW)
def test_restarts_show_failures_disruptions_and_their_causes():
    status = {"phase": "Running", "attempt": 3, "nodePool": "gpu",
              "restarts": {"failures": 1, "disruptions": 2, "spotEvictions": 2, "history": [
                  {"attempt": 3, "time": "2026-11-26T11:30:00Z", "cause": "SpotEviction", "counted": False,
                   "message": "pod j-worker-0 on node aks-spotgpu-1 container worker: SpotEviction (DeletionByPodGC)"}]}}
    job = {"metadata": {"name": "j", "namespace": "team", "creationTimestamp": "2026-11-26T11:00:00Z"},
           "spec": {"workers": 2, "gpusPerWorker": 4, "nodePool": {"name": "spotgpu"}}, "status": status}
    assert jobs.row(job, wide=False, with_namespace=False)[4] == "1+2d"
    text = jobs.describe_text(job, [], [])
    assert ("Restarts:    1 failures (backoffLimit 3), 2 disruptions (not counted; 2 spot evictions); "
            "attempt 3") in text
    assert ("attempt 3: 2026-11-26T11:30:00Z SpotEviction (not counted): pod j-worker-0 on node "
            "aks-spotgpu-1 container worker: SpotEviction (DeletionByPodGC)") in text
    assert "spotgpu; this attempt on gpu" in text
    old = dict(job, status={"phase": "Failed", "restarts": 3})  # written before restarts had two counters
    assert jobs.row(old, wide=False, with_namespace=False)[4] == "3"
