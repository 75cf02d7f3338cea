"""DistributedTrainingJob end to end on the real control plane (API server, scheduler,
controller-manager with the Job controller and garbage collector, KWOK nodes shaped like AKS
pools), with the operator running as production runs it (`trainop operator`, subprocess).

KWOK makes every scheduled pod Running and Ready; a test ends a pod with cluster.end_pod()."""

from __future__ import annotations

import json

import pytest
from kubernetes import client as k8s
from kubernetes.client.exceptions import ApiException

from tests.fixtures.waiting import wait_until

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(240)]

GROUP, VERSION, PLURAL = "trainop.io", "v1alpha1", "distributedtrainingjobs"
FAST = {"resyncSeconds": 0.5}  # operator config: re-check jobs twice a second in tests


def manifest(name: str, **spec) -> dict:
    spec.setdefault("workers", 2)
    spec.setdefault("gpusPerWorker", 4)
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": "DistributedTrainingJob",
            "metadata": {"name": name}, "spec": spec}


class Api:
    """Reads through the official client (cheaper than a kubectl per poll)."""

    def __init__(self, cluster, namespace):
        self.cluster, self.ns = cluster, namespace
        api = cluster.api_client()
        self.core, self.batch = k8s.CoreV1Api(api), k8s.BatchV1Api(api)
        self.custom, self.events = k8s.CustomObjectsApi(api), k8s.CoreV1Api(api)

    def job(self, name: str) -> dict | None:
        try:
            return self.custom.get_namespaced_custom_object(GROUP, VERSION, self.ns, PLURAL, name)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def status(self, name: str) -> dict:
        return (self.job(name) or {}).get("status") or {}

    def condition(self, name: str, type_: str) -> dict | None:
        return next((c for c in self.status(name).get("conditions") or [] if c["type"] == type_), None)

    def wait_phase(self, name: str, phase: str, timeout: float = 60) -> dict:
        return wait_until(lambda: self.status(name).get("phase") == phase and self.status(name),
                          timeout=timeout, what=f"{name} phase {phase} (status: {self.status(name)})")

    def pods(self, name: str, role: str | None = None) -> list:
        sel = f"trainop.io/job-name={name}" + (f",trainop.io/role={role}" if role else "")
        return self.core.list_namespaced_pod(self.ns, label_selector=sel).items

    def launcher(self, name: str):
        try:
            return self.batch.read_namespaced_job(f"{name}-launcher", self.ns)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def launcher_pod(self, name: str, attempt: int = 0):
        pods = [p for p in self.pods(name, "launcher")
                if p.metadata.labels.get("trainop.io/attempt") == str(attempt)
                and p.status.phase == "Running" and not p.metadata.deletion_timestamp]
        return pods[0] if pods else None

    def wait_running(self, name: str, attempt: int = 0, timeout: float = 60):
        return wait_until(lambda: self.launcher_pod(name, attempt), timeout=timeout,
                          what=f"{name}'s launcher pod of attempt {attempt} Running "
                               f"(status: {self.status(name)})")

    def wait_event(self, name: str, reason: str) -> None:
        """An Event is posted after the status write that a test waited for: wait for it too."""
        wait_until(lambda: reason in self.event_reasons(name), timeout=30,
                   what=f"Event {reason} of {name} (have: {self.event_reasons(name)})")

    def event_reasons(self, name: str) -> list[str]:
        events = self.events.list_namespaced_event(
            self.ns, field_selector=f"involvedObject.name={name},involvedObject.kind=DistributedTrainingJob")
        return [f"{e.type}/{e.reason}" for e in events.items]

    def children(self, name: str) -> dict[str, list[str]]:
        sel = f"trainop.io/job-name={name}"
        return {
            "pods": [p.metadata.name for p in self.core.list_namespaced_pod(self.ns, label_selector=sel).items],
            "services": [s.metadata.name for s in self.core.list_namespaced_service(self.ns, label_selector=sel).items],
            "secrets": [s.metadata.name for s in self.core.list_namespaced_secret(self.ns, label_selector=sel).items],
            "configmaps": [c.metadata.name for c in self.core.list_namespaced_config_map(self.ns, label_selector=sel).items],
            "jobs": [j.metadata.name for j in self.batch.list_namespaced_job(self.ns, label_selector=sel).items],
        }


@pytest.fixture
def api(cluster, namespace):
    return Api(cluster, namespace)


@pytest.fixture
def op(operator_factory):
    return operator_factory(config=FAST)


def _ready_time(pod) -> str:
    return next(c.last_transition_time for c in pod.status.conditions if c.type == "Ready")


def test_job_succeeds_when_the_launcher_completes(cluster, namespace, api, op):
    cluster.apply(manifest("ok"), namespace)
    launcher_pod = api.wait_running("ok")
    workers = api.pods("ok", "worker")
    assert sorted(p.metadata.name for p in workers) == ["ok-worker-0", "ok-worker-1"]
    # the launcher exists only because every worker was Ready before it was created
    created = api.launcher("ok").metadata.creation_timestamp
    assert all(_ready_time(p) <= created for p in workers)
    for p in workers:
        assert p.spec.containers[0].resources.limits["nvidia.com/gpu"] == "4"
        assert p.spec.node_selector == {"kubernetes.azure.com/agentpool": "gpu"}
        assert p.spec.hostname == p.metadata.name and p.spec.subdomain == "ok"
    assert api.status("ok")["workers"] == {"ready": 2, "total": 2, "summary": "2/2"}
    assert api.condition("ok", "WorkersReady")["status"] == "True"
    assert api.condition("ok", "Running")["status"] == "True"

    cluster.end_pod(namespace, launcher_pod.metadata.name, 0)
    status = api.wait_phase("ok", "Succeeded")
    assert api.condition("ok", "Succeeded")["reason"] == "JobSucceeded"
    assert api.condition("ok", "Running")["status"] == "False"
    assert status["completionTime"] >= status["startTime"]
    # cleanPodPolicy Running (default): the idle sshd workers give their GPUs back
    wait_until(lambda: not api.pods("ok", "worker"), timeout=30, what="workers deleted after success")
    assert [p.status.phase for p in api.pods("ok", "launcher")] == ["Succeeded"]
    for reason in ("Normal/ChildrenCreated", "Normal/AllWorkersReady", "Normal/LauncherCreated",
                   "Normal/JobSucceeded"):
        api.wait_event("ok", reason)


def test_launcher_waits_for_every_worker(cluster, namespace, api, op):
    # 5 workers x 3 GPUs on a 4-node x 4-GPU pool: one worker per node, the fifth never
    # schedules (15 GPUs fit the pool's 16 in all, so admission does not judge it Unsatisfiable)
    cluster.apply(manifest("gate", workers=5, gpusPerWorker=3), namespace)
    cond = wait_until(lambda: (c := api.condition("gate", "WorkersReady")) and
                      c["message"] == "4/5 workers ready" and c, timeout=60,
                      what="4 of 5 workers ready")
    assert cond["status"] == "False" and cond["reason"] == "WaitingForWorkers"
    assert api.launcher("gate") is None
    assert api.status("gate")["phase"] == "Starting"
    assert api.status("gate")["workers"]["summary"] == "4/5"


def test_worker_crash_restarts_the_gang_then_succeeds(cluster, namespace, api, op):
    cluster.apply(manifest("crash", runPolicy={"backoffLimit": 2}), namespace)
    api.wait_running("crash")
    old_uids = {p.metadata.uid for p in api.pods("crash", "worker")}
    cluster.end_pod(namespace, "crash-worker-1", 137, reason="OOMKilled")
    wait_until(lambda: api.status("crash").get("attempt") == 1, timeout=30, what="attempt == 1")
    # The Restarting condition may already be False again (attempt 1 running: the operator
    # reacts to pod events within milliseconds); its Warning Event says why it restarted.
    restart = wait_until(lambda: next((e for e in api.events.list_namespaced_event(
        namespace, field_selector="involvedObject.name=crash").items
        if e.reason == "GangRestart" and e.type == "Warning"), None), timeout=10,
        what="the GangRestart Warning Event")
    assert "container worker exited with code 137 (OOMKilled)" in restart.message
    assert restart.message.startswith("pod crash-worker-1 on node aks-gpu-")
    failure = api.status("crash")["lastFailure"]
    node = failure.pop("node")
    assert node.startswith("aks-gpu-")
    assert failure == {
        "pod": "crash-worker-1", "container": "worker", "exitCode": 137, "reason": "OOMKilled",
        "cause": "OOMKilled",
        "message": f"pod crash-worker-1 on node {node} container worker exited with code 137 (OOMKilled)"}

    launcher_pod = api.wait_running("crash", attempt=1)
    workers = api.pods("crash", "worker")
    assert {p.metadata.labels["trainop.io/attempt"] for p in workers} == {"1"}
    assert not old_uids & {p.metadata.uid for p in workers}, "the whole gang was recreated"
    assert api.condition("crash", "Restarting")["status"] == "False"
    cluster.end_pod(namespace, launcher_pod.metadata.name, 0)
    status = api.wait_phase("crash", "Succeeded")
    assert (status["attempt"], status["restarts"]["failures"], status["restarts"]["disruptions"]) == (1, 1, 0)
    assert [(h["attempt"], h["cause"], h["counted"], h["pod"]) for h in status["restarts"]["history"]] == [
        (1, "OOMKilled", True, "crash-worker-1")]
    api.wait_event("crash", "Warning/GangRestart")


def test_backoff_limit_exhausted_fails_naming_the_pod(cluster, namespace, api, op):
    cluster.apply(manifest("bo", runPolicy={"backoffLimit": 1}), namespace)
    launcher_pod = api.wait_running("bo")
    cluster.end_pod(namespace, launcher_pod.metadata.name, 3)  # launcher fails: restart 1
    api.wait_running("bo", attempt=1)
    cluster.end_pod(namespace, "bo-worker-0", 137, reason="OOMKilled")  # worker fails: limit
    status = api.wait_phase("bo", "Failed")
    failed = api.condition("bo", "Failed")
    assert failed["reason"] == "BackoffLimitExceeded"
    node = status["lastFailure"]["node"]
    assert failed["message"] == (f"pod bo-worker-0 on node {node} container worker exited with code 137 "
                                 "(OOMKilled); runPolicy.backoffLimit=1 restarts used")
    assert status["restarts"]["failures"] == 1 and status["lastFailure"]["exitCode"] == 137
    api.wait_event("bo", "Warning/BackoffLimitExceeded")
    # the active launcher of the failed attempt is stopped, running workers go
    wait_until(lambda: api.launcher("bo") is None, timeout=30, what="launcher Job deleted")
    wait_until(lambda: all(p.status.phase in ("Succeeded", "Failed") for p in api.pods("bo")),
               timeout=30, what="no running pod left")


def test_launcher_failure_names_the_launcher_pod(cluster, namespace, api, op):
    cluster.apply(manifest("lf", runPolicy={"backoffLimit": 0}), namespace)
    launcher_pod = api.wait_running("lf")
    cluster.end_pod(namespace, launcher_pod.metadata.name, 2)
    api.wait_phase("lf", "Failed")
    assert api.condition("lf", "Failed")["message"] == (
        f"pod {launcher_pod.metadata.name} on node {launcher_pod.spec.node_name} container launcher "
        "exited with code 2 (Error); runPolicy.backoffLimit=0 restarts used")


def test_active_deadline(cluster, namespace, api, op):
    cluster.apply(manifest("dl", runPolicy={"activeDeadlineSeconds": 3}), namespace)
    api.wait_running("dl")
    api.wait_phase("dl", "Failed", timeout=30)
    cond = api.condition("dl", "Failed")
    assert cond["reason"] == "DeadlineExceeded" and "activeDeadlineSeconds=3" in cond["message"]
    wait_until(lambda: api.launcher("dl") is None and not api.pods("dl"), timeout=30,
               what="launcher and workers gone after the deadline")


def test_suspend_and_resume(cluster, namespace, api, op):
    cluster.apply(manifest("sus"), namespace)
    api.wait_running("sus")
    secret_uid = api.core.read_namespaced_secret("sus-ssh", namespace).metadata.uid
    cluster.kubectl("patch", "dtj", "sus", "-n", namespace, "--type=merge",
                    "-p", '{"spec":{"runPolicy":{"suspend":true}}}')
    api.wait_phase("sus", "Suspended")
    wait_until(lambda: not api.pods("sus") and api.launcher("sus") is None, timeout=30,
               what="pods and launcher gone while suspended")
    left = api.children("sus")
    assert (left["secrets"], left["configmaps"], left["services"]) == (["sus-ssh"], ["sus-mpi"], ["sus"])
    assert api.condition("sus", "Suspended")["status"] == "True"

    cluster.kubectl("patch", "dtj", "sus", "-n", namespace, "--type=merge",
                    "-p", '{"spec":{"runPolicy":{"suspend":false}}}')
    launcher_pod = api.wait_running("sus")
    assert api.condition("sus", "Suspended")["status"] == "False"
    assert api.core.read_namespaced_secret("sus-ssh", namespace).metadata.uid == secret_uid
    cluster.end_pod(namespace, launcher_pod.metadata.name, 0)
    api.wait_phase("sus", "Succeeded")


@pytest.mark.parametrize("policy,left", [("None", {"launcher", "worker"}), ("All", set())])
def test_clean_pod_policy(cluster, namespace, api, op, policy, left):
    name = f"clean-{policy.lower()}"
    cluster.apply(manifest(name, runPolicy={"cleanPodPolicy": policy}), namespace)
    cluster.end_pod(namespace, api.wait_running(name).metadata.name, 0)
    api.wait_phase(name, "Succeeded")
    wait_until(lambda: {p.metadata.labels["trainop.io/role"] for p in api.pods(name)} == left,
               timeout=30, what=f"pods left by cleanPodPolicy {policy}: {left}")
    # once clean, the operator stops looking at the finished job
    wait_until(lambda: api.status(name).get("cleanedUp"), timeout=30, what="status.cleanedUp")
    assert {p.metadata.labels["trainop.io/role"] for p in api.pods(name)} == left


def test_ttl_after_finished_deletes_job_and_children(cluster, namespace, api, op):
    cluster.apply(manifest("ttl", runPolicy={"ttlSecondsAfterFinished": 2}), namespace)
    cluster.end_pod(namespace, api.wait_running("ttl").metadata.name, 0)
    api.wait_phase("ttl", "Succeeded")
    wait_until(lambda: api.job("ttl") is None, timeout=30, what="job deleted by TTL")
    wait_until(lambda: not any(api.children("ttl").values()), timeout=60,
               what=f"children garbage-collected ({api.children('ttl')})")


def test_deleting_a_job_removes_every_child(cluster, namespace, api, op):
    cluster.apply(manifest("del"), namespace)
    api.wait_running("del")
    assert all(api.children("del").values())
    cluster.kubectl("delete", "dtj", "del", "-n", namespace, "--wait=true", "--timeout=60s")
    wait_until(lambda: not any(api.children("del").values()), timeout=60,
               what=f"children garbage-collected ({api.children('del')})")


def test_operator_restart_mid_creation_creates_no_duplicates(cluster, namespace, api, operator_factory):
    op = operator_factory(config=FAST)
    cluster.apply(manifest("rs", workers=4), namespace)
    wait_until(lambda: api.pods("rs"), timeout=30, interval=0.05, what="first worker pod")
    op.kill()  # SIGKILL in the middle of creating the gang
    before = {p.metadata.name: p.metadata.uid for p in api.pods("rs")}
    secret = api.core.read_namespaced_secret("rs-ssh", namespace)
    op.start()
    launcher_pod = api.wait_running("rs")
    pods = api.pods("rs", "worker")
    assert sorted(p.metadata.name for p in pods) == [f"rs-worker-{i}" for i in range(4)]
    assert all(before[p.metadata.name] == p.metadata.uid for p in pods if p.metadata.name in before)
    assert len(api.pods("rs", "launcher")) == 1 and len(api.children("rs")["jobs"]) == 1
    assert api.core.read_namespaced_secret("rs-ssh", namespace).data == secret.data
    # The restarted operator writes them at its first reconcile, which may come after the
    # launcher pod runs: the first one can have created the launcher just before its kill and
    # died before its status write (seen under load, when the kill came late).
    for type_ in ("Created", "WorkersReady", "Running"):
        wait_until(lambda type_=type_: (api.condition("rs", type_) or {}).get("status") == "True", timeout=30,
                   what=f"condition {type_} True (status: {api.status('rs')})")
    cluster.end_pod(namespace, launcher_pod.metadata.name, 0)
    api.wait_phase("rs", "Succeeded")


def test_schema_rejects_what_it_can(cluster, namespace):
    result = cluster.kubectl("apply", "-n", namespace, "-f", "-", check=False,
                             input=json.dumps(manifest("bad", workers=0)))
    assert result.returncode != 0 and "spec.workers" in result.stderr
    long_name = "x" * 49
    result = cluster.kubectl("apply", "-n", namespace, "-f", "-", check=False,
                             input=json.dumps(manifest(long_name)))
    assert result.returncode != 0 and "at most 48 characters" in result.stderr
    result = cluster.kubectl("apply", "-n", namespace, "-f", "-", check=False,
                             input=json.dumps(manifest("two", nodePool={"name": "gpu", "nodeSelector": {"a": "b"}})))
    assert result.returncode != 0 and "exactly one of nodePool.name and nodePool.nodeSelector" in result.stderr


def test_gang_fields_are_immutable_while_running(cluster, namespace, api, op):
    cluster.apply(manifest("imm"), namespace)
    api.wait_running("imm")
    result = cluster.kubectl("patch", "dtj", "imm", "-n", namespace, "--type=merge",
                             "-p", '{"spec":{"workers":3}}', check=False)
    assert result.returncode != 0 and "cannot change once the job is admitted (Admitted) or Starting or Running" in result.stderr


@pytest.mark.parametrize("spec,reason,message", [
    ({"nodePool": {"name": "nope"}}, "InvalidSpec",
     "spec.nodePool.name: node pool 'nope' does not exist in the operator's configuration; "
     "use one of gpu, ibgpu, spotgpu, system or set nodePool.nodeSelector"),
    ({"gpusPerWorker": 8, "nodePool": {"name": "gpu"}}, "Unsatisfiable",
     "spec.gpusPerWorker: 8 nvidia.com/gpu per worker, but the largest node of node pool 'gpu' "
     "has 4; use at most 4 and more workers"),
])
def test_operator_rejects_what_only_it_can_judge(cluster, namespace, api, op, spec, reason, message):
    cluster.apply(manifest("judge", **spec), namespace)
    api.wait_phase("judge", "Failed")
    cond = api.condition("judge", "Failed")
    assert (cond["reason"], cond["message"]) == (reason, message)
    api.wait_event("judge", f"Warning/{reason}")
    assert not any(api.children("judge").values())


def test_unknown_data_stage_waits_with_a_condition(cluster, namespace, api, op):
    cluster.apply(manifest("data", data={"dataStageRef": {"name": "imagenet"}}), namespace)
    cond = wait_until(lambda: api.condition("data", "DataReady"), timeout=30, what="DataReady condition")
    assert (cond["status"], cond["reason"]) == ("False", "DataStageNotFound")
    assert cond["message"] == ("spec.data.dataStageRef.name: DataStage 'imagenet' does not exist in "
                               f"namespace {namespace}; create it or fix the name")
    assert api.status("data")["phase"] == "Pending"
    wait_until(lambda: "Warning/DataStageNotFound" in api.event_reasons("data"), timeout=10,
               what="Warning Event")
    assert not any(api.children("data").values())


def test_kubectl_get_columns(cluster, namespace, api, op):
    cluster.apply(manifest("cols", workers=3, gpusPerWorker=2), namespace)
    api.wait_running("cols")
    out = cluster.kubectl("get", "dtj", "-n", namespace).stdout.splitlines()
    assert out[0].split() == ["NAME", "PHASE", "WORKERS", "GPUS", "PROGRESS", "ETA", "AGE"]
    assert out[1].split()[:4] == ["cols", "Running", "3/3", "6"]
    wide = cluster.kubectl("get", "dtj", "-n", namespace, "-o", "wide").stdout.splitlines()
    assert wide[0].split() == ["NAME", "PHASE", "WORKERS", "GPUS", "RESTARTS", "DISRUPTIONS",
                               "PROGRESS", "ETA", "IMAGES/S", "AGE"]
    assert wide[1].split()[4:6] == ["0", "0"]


def test_torchrun_job_succeeds_when_every_worker_completes(cluster, namespace, api, op):
    cluster.apply(manifest("tr", launcher="torchrun", workers=2, gpusPerWorker=2), namespace)
    wait_until(lambda: (c := api.condition("tr", "Running")) and c["status"] == "True", timeout=60,
               what="torchrun workers running")
    assert api.launcher("tr") is None and api.children("tr")["secrets"] == []
    pod = api.core.read_namespaced_pod("tr-worker-1", namespace)
    assert f"--rdzv-endpoint=tr-worker-0.tr.{namespace}.svc:29400" in pod.spec.containers[0].command[2]
    cluster.end_pod(namespace, "tr-worker-0", 0)
    cluster.end_pod(namespace, "tr-worker-1", 0)
    api.wait_phase("tr", "Succeeded")


def test_kubectl_explain_documents_the_fields(cluster):
    def explain(path):  # kubectl wraps descriptions: compare with whitespace collapsed
        result = cluster.kubectl("explain", path, check=False)
        return result.returncode == 0 and " ".join(result.stdout.split())
    # the API server publishes a new CRD's OpenAPI a little after it is Established
    wait_until(lambda: explain("dtj.spec"), timeout=60, what="the DTJ schema in kubectl explain")
    out = explain("dtj.spec.runPolicy")
    assert "Restarts, deadlines, cleanup and suspension of the gang" in out
    for field in ("backoffLimit", "activeDeadlineSeconds", "cleanPodPolicy", "suspend",
                  "ttlSecondsAfterFinished"):
        assert field in out
    assert "Running (default) deletes pods still running" in explain("dtj.spec.runPolicy.cleanPodPolicy")


def test_edited_children_are_restored(cluster, namespace, api, op):
    cluster.apply(manifest("drift", workers=5, gpusPerWorker=3), namespace)  # 4/5: stays Starting
    wait_until(lambda: (c := api.condition("drift", "WorkersReady")) and c["message"] == "4/5 workers ready",
               timeout=60, what="4 of 5 workers ready")
    hostfile = api.core.read_namespaced_config_map("drift-mpi", namespace).data["hostfile"]
    api.core.patch_namespaced_config_map("drift-mpi", namespace, {"data": {"hostfile": "evil slots=99\n"}})
    api.core.patch_namespaced_service("drift", namespace, {"spec": {"selector": {"trainop.io/role": "launcher"}}})
    wait_until(lambda: api.core.read_namespaced_config_map("drift-mpi", namespace).data["hostfile"] == hostfile,
               timeout=30, what="hostfile restored")
    wait_until(lambda: api.core.read_namespaced_service("drift", namespace).spec.selector ==
               {"trainop.io/job-name": "drift", "trainop.io/role": "worker"},
               timeout=30, what="Service selector restored")


def test_namespace_deletion_completes_while_the_operator_is_down(cluster, namespace, api, operator_factory):
    """No finalizer on a job: with the operator stopped, deleting a namespace that holds a
    running job (and a queued one) completes; the garbage collector removes the children."""
    op = operator_factory(config=FAST)
    cluster.apply(manifest("gone"), namespace)
    cluster.apply(manifest("waiting", data={"dataStageRef": {"name": "nothing-yet"}}), namespace)
    api.wait_running("gone")
    wait_until(lambda: api.condition("waiting", "DataReady"), timeout=30, what="waiting job judged")
    for name in ("gone", "waiting"):
        assert not api.job(name)["metadata"].get("finalizers"), api.job(name)["metadata"]
    op.stop()
    cluster.kubectl("delete", "namespace", namespace, "--wait=true", "--timeout=120s")
    result = cluster.kubectl("get", "namespace", namespace, check=False)
    assert result.returncode != 0 and "NotFound" in result.stderr


def test_waiting_is_logged_once_at_info_never_as_an_error(cluster, namespace, api, op):
    cluster.apply(manifest("patient", workers=5, gpusPerWorker=3), namespace)  # 4/5 forever
    cluster.apply(manifest("nodata", data={"dataStageRef": {"name": "later"}}), namespace)
    wait_until(lambda: (c := api.condition("patient", "WorkersReady")) and
               c["message"] == "4/5 workers ready", timeout=60, what="4 of 5 workers ready")
    wait_until(lambda: api.condition("nodata", "DataReady"), timeout=30, what="DataReady condition")
    before = api.job("patient")["metadata"]["resourceVersion"]
    waits = ("patient] DistributedTrainingJob Starting: 1/5 workers wait for room on node pool 'gpu': "
             "the scheduler finds no node for them")
    wait_until(lambda: waits in op.logs(), timeout=10, what="the wait logged")
    log = op.logs()
    # about the jobs (kopf.objects, trainop.*); a fresh cluster's 429s to kopf's first LIST are not
    ours = [line for line in log.splitlines() if "kopf.objects" in line or "] trainop." in line]
    assert not [line for line in ours if "[ERROR" in line or "[WARNING" in line], log[-3000:]
    assert log.count(waits) == 1
    assert api.condition("patient", "WaitingForNodes")["status"] == "True"
    assert log.count("nodata] DistributedTrainingJob Pending: waiting for data") == 1
    assert api.job("patient")["metadata"]["resourceVersion"] == before  # nothing rewritten
