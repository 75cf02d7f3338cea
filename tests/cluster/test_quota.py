"""Gang admission on the real control plane: the API server enforces real ResourceQuotas (its
quota admission plugin and the controller-manager's quota controller), the operator runs as
production runs it, KWOK runs the pods. A watch on pods proves a queued job never has any."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
import urllib.request

import pytest
from kubernetes import client as k8s
from kubernetes import watch

from tests.cluster.test_dtj import FAST, Api, manifest
from tests.fixtures.cluster import _free_port
from tests.fixtures.waiting import wait_until

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(180)]


@pytest.fixture
def api(cluster, namespace):
    return Api(cluster, namespace)


@pytest.fixture
def op(operator_factory):
    return operator_factory(config=FAST)


def make_quota(api: Api, gpus: int, name: str = "gpu") -> None:
    api.core.create_namespaced_resource_quota(api.ns, k8s.V1ResourceQuota(
        metadata=k8s.V1ObjectMeta(name=name),
        spec=k8s.V1ResourceQuotaSpec(hard={"requests.nvidia.com/gpu": str(gpus)})))
    # The API server refuses pods until the quota controller has counted the namespace.
    wait_until(lambda: (api.core.read_namespaced_resource_quota(name, api.ns).status.hard or {})
               .get("requests.nvidia.com/gpu") == str(gpus), timeout=30, what=f"quota {name} counted")


class PodWatch:
    """Every pod ADDED in the namespace, with its job label and the moment it was seen."""

    def __init__(self, api: Api):
        self.api, self.added, self._stop = api, [], watch.Watch()
        self._ready = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        assert self._ready.wait(10), "pod watch did not start"

    def _run(self):
        version = self.api.core.list_namespaced_pod(self.api.ns).metadata.resource_version
        self._ready.set()
        try:
            for ev in self._stop.stream(self.api.core.list_namespaced_pod, self.api.ns,
                                        resource_version=version):
                if ev["type"] == "ADDED":
                    labels = ev["object"].metadata.labels or {}
                    self.added.append((time.monotonic(), labels.get("trainop.io/job-name"),
                                       ev["object"].metadata.name))
        except Exception:  # the cluster going away at the end of the session
            pass

    def pods_of(self, job: str) -> list[tuple[float, str]]:
        # A watch that ended could have missed pods: "none seen" must mean none existed.
        assert self.thread.is_alive(), "the pod watch ended early"
        return [(t, name) for t, j, name in self.added if j == job]

    def stop(self):
        self._stop.stop()


@pytest.fixture
def pod_watch(api):
    w = PodWatch(api)
    yield w
    w.stop()


def admitted_at(api: Api, name: str) -> float:
    """Wait until the job is Admitted; the monotonic time it was first seen so."""
    wait_until(lambda: (api.condition(name, "Admitted") or {}).get("status") == "True",
               timeout=60, what=f"{name} admitted (status: {api.status(name)})")
    return time.monotonic()


def end_job(cluster, api: Api, name: str) -> None:
    cluster.end_pod(api.ns, api.wait_running(name).metadata.name, 0)
    api.wait_phase(name, "Succeeded")


def test_second_job_waits_with_no_pod_and_runs_when_the_first_ends(cluster, namespace, api, op,
                                                                  pod_watch):
    make_quota(api, 8)
    cluster.apply(manifest("first"), namespace)  # 2 workers x 4 GPUs: the whole quota
    api.wait_running("first")
    cluster.apply(manifest("second"), namespace)
    status = api.wait_phase("second", "Queued")
    cond = api.condition("second", "Admitted")
    assert (cond["status"], cond["reason"]) == ("False", "QuotaExceeded")
    assert cond["message"] == f"needs 8 nvidia.com/gpu; 0 of 8 free in ResourceQuota {namespace}/gpu"
    api.wait_event("second", "Normal/QuotaExceeded")
    assert status["gpus"] == 8 and api.children("second") == {
        "pods": [], "services": [], "secrets": [], "configmaps": [], "jobs": []}

    ending = time.monotonic()  # the second job was Queued all along until now
    end_job(cluster, api, "first")
    api.wait_running("second")
    seen = pod_watch.pods_of("second")  # watched since before the second job existed
    assert len(seen) == 3 and min(t for t, _ in seen) > ending  # 2 workers + the launcher
    api.wait_event("second", "Normal/QuotaReserved")


def metric(port: int, name: str, namespace: str) -> float | None:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    for line in text.splitlines():
        if line.startswith(f'{name}{{namespace="{namespace}"}} '):
            return float(line.split()[-1])
    return None


def test_priority_beats_arrival_order(cluster, namespace, api, operator_factory, pod_watch,
                                      priority_classes):
    port = _free_port()
    operator_factory(config=FAST, extra_args=[f"--metrics-port={port}"])
    low, high = priority_classes("low", 0), priority_classes("high", 10)
    make_quota(api, 8)
    cluster.apply(manifest("blocker"), namespace)
    api.wait_running("blocker")
    cluster.apply(manifest("low", priorityClassName=low), namespace)
    api.wait_phase("low", "Queued")
    cluster.apply(manifest("high", priorityClassName=high), namespace)
    api.wait_phase("high", "Queued")
    wait_until(lambda: metric(port, "trainop_queued_jobs", namespace) == 2, timeout=20,
               what="trainop_queued_jobs 2")
    assert metric(port, "trainop_queued_gpus", namespace) == 16
    end_job(cluster, api, "blocker")
    api.wait_running("high")
    status = api.status("low")
    assert status["phase"] == "Queued" and not pod_watch.pods_of("low")
    assert api.condition("low", "Admitted")["message"] == \
        f"needs 8 nvidia.com/gpu; 0 of 8 free in ResourceQuota {namespace}/gpu"
    assert metric(port, "trainop_queued_jobs", namespace) == 1
    assert metric(port, "trainop_admitted_gpus", namespace) == 8
    # The scheduler gets the same order: the API server resolved the class on every pod.
    pods = api.pods("high")
    assert len(pods) == 3 and {(p.spec.priority_class_name, p.spec.priority) for p in pods} == \
        {(high, 10)}


NOTHING = {"pods": [], "services": [], "secrets": [], "configmaps": [], "jobs": []}


def failed_because(api: Api, name: str) -> str:
    api.wait_phase(name, "Failed")
    cond = api.condition(name, "Failed")
    assert cond["reason"] == "InvalidSpec"
    wait_until(lambda: "Warning/InvalidSpec" in api.event_reasons(name), timeout=10,
               what=f"{name}'s InvalidSpec Event")
    return cond["message"]


def test_a_class_nobody_created_fails_the_job_and_nothing_is_created(
        cluster, namespace, api, op, pod_watch, priority_classes):
    """A namespace user cannot invent a priority: the class must exist, and by default
    (limits.maxPriority 1e9) the system-critical classes every cluster has are off limits."""
    normal = priority_classes("normal", 100)
    cluster.apply(manifest("typo", priorityClassName=f"{namespace}-nomral"), namespace)
    cluster.apply(manifest("sneaky", priorityClassName="system-cluster-critical"), namespace)
    message = failed_because(api, "typo")
    assert message.startswith(f"spec.priorityClassName: no PriorityClass '{namespace}-nomral' "
                              f"exists; use one of ") and f"{normal} (100)" in message
    assert failed_because(api, "sneaky").startswith(
        "spec.priorityClassName: PriorityClass 'system-cluster-critical' (value 2000000000) is "
        "above limits.maxPriority=1000000000, the highest priority the cluster admin allows jobs")
    for name in ("typo", "sneaky"):
        assert api.children(name) == NOTHING and not pod_watch.pods_of(name)
    # The class named right runs, its pods at its priority.
    cluster.apply(manifest("fixed", priorityClassName=normal), namespace)
    api.wait_running("fixed")
    pods = api.pods("fixed")  # the workers and the launcher Job's pod
    assert len(pods) == 3 and {(p.spec.priority_class_name, p.spec.priority) for p in pods} == \
        {(normal, 100)}


def test_a_class_above_the_admins_cap_is_refused_naming_the_field_and_the_cap(
        cluster, namespace, api, operator_factory, pod_watch, priority_classes):
    operator_factory(config={**FAST, "limits": {"maxPriority": 1000}})
    normal, vip = priority_classes("normal", 1000), priority_classes("vip", 1001)
    cluster.apply(manifest("greedy", priorityClassName=vip), namespace)
    message = failed_because(api, "greedy")
    assert message.startswith(
        f"spec.priorityClassName: PriorityClass '{vip}' (value 1001) is above "
        f"limits.maxPriority=1000, the highest priority the cluster admin allows jobs; use one "
        f"of ")
    assert f"{normal} (1000)" in message and f"{vip} (" not in message.partition("use one")[2]
    assert api.children("greedy") == NOTHING and not pod_watch.pods_of("greedy")


def test_a_large_job_is_not_starved_by_small_ones(cluster, namespace, api, op, pod_watch):
    """Policy: queued jobs reserve their demand in queue order, so small jobs that would fit
    the free room wait behind the large one instead of taking what it waits for."""
    make_quota(api, 16)
    cluster.apply(manifest("blocker"), namespace)                      # 8 GPUs
    api.wait_running("blocker")
    cluster.apply(manifest("large", workers=4), namespace)             # 16 GPUs: 8 free
    api.wait_phase("large", "Queued")
    for i in range(3):                                                 # 4 GPUs each: would fit
        cluster.apply(manifest(f"small{i}", workers=1), namespace)
    for i in range(3):
        api.wait_phase(f"small{i}", "Queued")
    assert api.condition("small0", "Admitted")["message"] == (
        f"needs 4 nvidia.com/gpu; 8 of 16 free in ResourceQuota {namespace}/gpu, 16 of it held "
        f"for jobs ahead in the queue (large)")
    end_job(cluster, api, "blocker")
    api.wait_running("large")
    for i in range(3):
        assert api.status(f"small{i}")["phase"] == "Queued"
        assert not pod_watch.pods_of(f"small{i}")


def test_raising_the_quota_admits_a_queued_job_within_seconds(cluster, namespace, api, op):
    make_quota(api, 8)
    cluster.apply(manifest("first"), namespace)
    api.wait_running("first")
    cluster.apply(manifest("second"), namespace)
    api.wait_phase("second", "Queued")
    pid = op.proc.pid
    raised = time.monotonic()
    api.core.patch_namespaced_resource_quota("gpu", namespace,
                                             {"spec": {"hard": {"requests.nvidia.com/gpu": "16"}}})
    took = admitted_at(api, "second") - raised
    assert took < 10, f"admitted {took:.1f}s after the quota was raised"
    api.wait_running("second")
    assert op.proc.pid == pid and op.proc.poll() is None  # the same operator, never restarted


def test_unsatisfiable_jobs_fail_at_once(cluster, namespace, api, op, pod_watch):
    make_quota(api, 8)
    cluster.apply(manifest("huge", workers=4), namespace)  # 16 GPUs > the quota's 8
    api.wait_phase("huge", "Failed", timeout=20)
    cond = api.condition("huge", "Failed")
    assert cond["reason"] == "Unsatisfiable"
    assert cond["message"] == (f"needs 16 nvidia.com/gpu but ResourceQuota {namespace}/gpu allows "
                               f"at most 8; reduce workers or per-worker resources, or ask for a "
                               f"larger quota")
    api.core.delete_namespaced_resource_quota("gpu", namespace)
    cluster.apply(manifest("wide", workers=5, nodePool={"name": "gpu"}), namespace)  # 20 > 16
    api.wait_phase("wide", "Failed", timeout=20)
    assert api.condition("wide", "Failed")["message"].startswith(
        "needs 20 nvidia.com/gpu but node pool 'gpu' has 16 in all")
    assert not pod_watch.pods_of("huge") and not pod_watch.pods_of("wide")


def test_namespace_gpu_cap_without_a_quota(cluster, namespace, api, operator_factory, pod_watch):
    operator_factory(config={**FAST, "limits": {"namespaceGpus": 8}})
    cluster.apply(manifest("first"), namespace)
    api.wait_running("first")
    cluster.apply(manifest("second"), namespace)
    api.wait_phase("second", "Queued")
    assert api.condition("second", "Admitted")["message"] == \
        "needs 8 nvidia.com/gpu; 0 of 8 free in the operator's limits.namespaceGpus"
    api.custom.delete_namespaced_custom_object("trainop.io", "v1alpha1", namespace,
                                               "distributedtrainingjobs", "first")
    api.wait_running("second")  # admitted once the first job's pods are gone


def test_trainop_quota_shows_quota_used_and_queued_demand(cluster, namespace, api, op):
    make_quota(api, 8)
    cluster.apply(manifest("first"), namespace)
    api.wait_running("first")
    cluster.apply(manifest("second", workers=1), namespace)
    api.wait_phase("second", "Queued")
    out = subprocess.run([sys.executable, "-m", "trainop", "quota", "-n", namespace],
                         capture_output=True, text=True, check=True,
                         env={"KUBECONFIG": str(cluster.kubeconfig), "PATH": "/usr/bin:/bin"})
    lines = out.stdout.splitlines()
    assert lines[0].split() == ["NAMESPACE", "QUOTA", "GPU-HARD", "GPU-USED", "ADMITTED",
                                "QUEUED", "QUEUED-GPUS"]
    assert lines[1].split() == [namespace, "gpu", "8", "8", "1", "1", "4"]


def test_suspending_gives_the_quota_back_and_resuming_queues_again(cluster, namespace, api, op):
    make_quota(api, 8)
    cluster.apply(manifest("first"), namespace)
    api.wait_running("first")
    cluster.apply(manifest("second"), namespace)
    api.wait_phase("second", "Queued")
    suspend = {"spec": {"runPolicy": {"suspend": True}}}
    api.custom.patch_namespaced_custom_object("trainop.io", "v1alpha1", namespace,
                                              "distributedtrainingjobs", "first", suspend)
    api.wait_running("second")
    assert api.condition("first", "Admitted")["reason"] == "JobSuspended"
    suspend["spec"]["runPolicy"]["suspend"] = False
    api.custom.patch_namespaced_custom_object("trainop.io", "v1alpha1", namespace,
                                              "distributedtrainingjobs", "first", suspend)
    api.wait_phase("first", "Queued")
    assert api.condition("first", "Admitted")["message"] == \
        f"needs 8 nvidia.com/gpu; 0 of 8 free in ResourceQuota {namespace}/gpu"
    wait_until(lambda: not api.pods("first"), timeout=20, what="the suspended gang's pods gone")
