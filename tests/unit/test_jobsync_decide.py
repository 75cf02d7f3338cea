"""jobsync.decide() as tables, in the style of mpi-operator's controller tests: a snapshot of the
job and its children goes in, the actions, status and Events that come out are asserted. Every
branch of the reconcile, in milliseconds, with no cluster (tests/cluster drives the real one)."""

from __future__ import annotations

import copy
import datetime as dt

import pytest

from trainop import admission, conditions, config
from trainop.actions import Apply, Create, CreateSSHSecret, Delete, Problem, Ref, SetFinalizers
from trainop.admission import ADMITTED, QUEUED, UNSATISFIABLE, Decision
from trainop.devcluster.pools import default_pools
from trainop.jobsync import JobSnapshot, decide
from trainop.spec import parse

CFG = config.from_dict(None)
NODES = [n for pool in default_pools() for n in pool.nodes()]  # gpu: 4x4 GPUs, ibgpu: 4x8
NOW = dt.datetime(2026, 5, 1, 12, 0, 0, tzinfo=dt.timezone.utc)
T0 = "2026-05-01T11:00:00Z"
UID = "uid-1"
FITS = Decision(ADMITTED, "QuotaReserved", "fits")


def body(status: dict | None = None, generation: int = 1, **spec) -> dict:
    spec.setdefault("workers", 2)
    spec.setdefault("gpusPerWorker", 4)
    out = {"apiVersion": "trainop.io/v1alpha1", "kind": "DistributedTrainingJob",
           "metadata": {"name": "j", "namespace": "ns", "uid": UID, "generation": generation,
                        "creationTimestamp": T0},
           "spec": spec}
    if status is not None:
        out["status"] = status
    return out


MESSAGES = {"ChildrenCreated": "Service, hostfile and SSH key created"}


def cond(*pairs) -> list[dict]:
    """cond(("Created", True, "ChildrenCreated"), ...) -> a status.conditions list."""
    out: list[dict] = []
    for type_, status, reason in pairs:
        out = conditions.set_condition(out, type_, status, reason, MESSAGES.get(reason, "m"),
                                       timestamp=T0)
    return out


def owned(obj: dict, uid: str = UID) -> dict:
    obj["metadata"]["ownerReferences"] = [{"controller": True, "uid": uid}]
    return obj


def pod(name: str, role: str = "worker", index: int | None = 0, attempt: int = 0,
        phase: str = "Running", ready: bool = True, exit_code: int | None = None,
        reason: str = "Error", deleting: bool = False, finished: str = "") -> dict:
    labels = {"trainop.io/job-name": "j", "trainop.io/role": role,
              "trainop.io/attempt": str(attempt)}
    if index is not None:
        labels["trainop.io/replica-index"] = str(index)
    status: dict = {"phase": phase,
                    "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}
    if phase == "Running" and index is not None:
        status["podIP"] = f"10.0.0.{index + 10}"
    if exit_code is not None:
        status["containerStatuses"] = [{"name": role, "state": {"terminated": {
            "exitCode": exit_code, "reason": reason, "finishedAt": finished}}}]
    meta = {"name": name, "namespace": "ns", "uid": f"uid-{name}", "labels": labels}
    if deleting:
        meta["deletionTimestamp"] = T0
    return owned({"apiVersion": "v1", "kind": "Pod", "metadata": meta,
                  "spec": {"containers": [{"name": role}]}, "status": status})


def workers(n: int = 2, attempt: int = 0, **kw) -> list[dict]:
    return [pod(f"j-worker-{i}", index=i, attempt=attempt, **kw) for i in range(n)]


def launcher(attempt: int = 0, outcome: str | None = None) -> dict:
    status = {"conditions": [{"type": outcome, "status": "True"}]} if outcome else {}
    return owned({"apiVersion": "batch/v1", "kind": "Job",
                  "metadata": {"name": "j-launcher", "namespace": "ns", "uid": "uid-launcher",
                               "labels": {"trainop.io/job-name": "j",
                                          "trainop.io/attempt": str(attempt)}},
                  "status": status})


def child(kind: str, name: str, version: str = "7", uid: str = UID) -> dict:
    api = "v1"
    return owned({"apiVersion": api, "kind": kind,
                  "metadata": {"name": name, "namespace": "ns", "resourceVersion": version,
                               "labels": {"trainop.io/job-name": "j"}}}, uid)


def shared() -> dict:
    """The NetworkPolicy, Service, hostfile and SSH Secret as they exist once created."""
    return {"network_policy": child("NetworkPolicy", "j"), "service": child("Service", "j"),
            "config_map": child("ConfigMap", "j-mpi"), "ssh_secret": True}


CREATED_TORCHRUN = conditions.set_condition(
    cond(("Admitted", True, "QuotaReserved")), "Created", True, "ChildrenCreated", "Service created",
    timestamp=T0)
CREATED = cond(("Created", True, "ChildrenCreated"), ("Admitted", True, "QuotaReserved"))
RESTARTING = {"phase": "Starting", "startTime": T0, "restarts": 1, "conditions": cond(
    ("Created", True, "ChildrenCreated"), ("Admitted", True, "QuotaReserved"),
    ("WorkersReady", False, "GangRestart"), ("Running", False, "GangRestart"),
    ("Restarting", True, "GangRestart"))}
RUNNING = {"phase": "Running", "startTime": T0, "restarts": 0, "conditions": cond(
    ("Created", True, "ChildrenCreated"), ("Admitted", True, "QuotaReserved"),
    ("WorkersReady", True, "AllWorkersReady"), ("Running", True, "LauncherCreated"))}

RUNNING_ON_DATA = {**RUNNING, "conditions": RUNNING["conditions"] + cond(("DataReady", True, "DataStageReady"))}


def mounting(worker: dict, claim: str = "imagenet-data") -> dict:
    worker["spec"]["volumes"] = [{"name": "data", "persistentVolumeClaim": {"claimName": claim}}]
    return worker


def snap(b: dict, admit: Decision | None = FITS, **kw) -> JobSnapshot:
    """`admit`: the native queue's answer, as the controller asks it before decide()."""
    kw.setdefault("nodes", NODES)
    return JobSnapshot(body=b, admission=admit, **kw)


def summary(actions: list) -> list[str]:
    """Actions as short lines: what a table row expects."""
    out = []
    for a in actions:
        if isinstance(a, Apply):
            out.append(f"apply {a.obj['kind']} {a.obj['metadata']['name']}")
        elif isinstance(a, Create):
            out.append(f"create {a.obj['kind']} {a.obj['metadata']['name']}")
        elif isinstance(a, CreateSSHSecret):
            out.append("create ssh Secret")
        elif isinstance(a, Delete):
            out.append(f"delete {a.ref.kind} {a.ref.name}")
        elif isinstance(a, SetFinalizers):
            out.append(f"set finalizers {a.ref.kind} {a.ref.name} {list(a.finalizers)}")
    return out


def reasons(status: dict) -> dict[str, tuple[str, str]]:
    return {c["type"]: (c["status"], c["reason"]) for c in status.get("conditions") or []}


# ---- the table: snapshot in, actions + phase + conditions + Events out ---------------------

CASES = [
    # (id, snapshot, actions, phase, conditions that must hold, Event reasons)
    ("new job creates Service, hostfile, key and every worker",
     snap(body()),
     ["apply NetworkPolicy j", "apply Service j", "apply ConfigMap j-mpi", "create ssh Secret",
      "create Pod j-worker-0", "create Pod j-worker-1"],
     "Starting", {"Created": ("True", "ChildrenCreated"), "Admitted": ("True", "QuotaReserved"),
                  "WorkersReady": ("False", "WaitingForWorkers")},
     ["ChildrenCreated", "QuotaReserved"]),
    ("children already there: only the missing worker is created",
     snap(body({"phase": "Starting", "conditions": CREATED}), pods=workers(1), **shared()),
     ["apply NetworkPolicy j", "apply Service j", "apply ConfigMap j-mpi", "create Pod j-worker-1"],
     "Starting", {"WorkersReady": ("False", "WaitingForWorkers")}, []),
    ("every worker Ready, one without its pod IP in the cache: no launcher yet",
     snap(body({"phase": "Starting", "conditions": CREATED}), **shared(),
          pods=[workers()[0], {**workers()[1], "status": {"phase": "Running", "conditions": [
              {"type": "Ready", "status": "True"}]}}]),
     ["apply NetworkPolicy j", "apply Service j", "apply ConfigMap j-mpi"],
     "Starting", {}, []),
    ("every worker Ready: the launcher is created (no wait for cluster DNS)",
     snap(body({"phase": "Starting", "conditions": CREATED}), pods=workers(), **shared()),
     ["apply NetworkPolicy j", "apply Service j", "apply ConfigMap j-mpi", "create Job j-launcher"],
     "Running", {"WorkersReady": ("True", "AllWorkersReady"),
                 "Running": ("True", "LauncherCreated")},
     ["AllWorkersReady", "LauncherCreated"]),
    ("operator died after creating the launcher: the status catches up, nothing is created",
     snap(body({"phase": "Starting", "conditions": CREATED}), pods=workers(),
          launcher=launcher(), **shared()),
     ["apply NetworkPolicy j", "apply Service j", "apply ConfigMap j-mpi"],
     "Running", {"Running": ("True", "LauncherCreated")}, ["AllWorkersReady", "LauncherCreated"]),
    ("a running gang: its unchanged children (skipped by apply.py: no call), no Event",
     snap(body(copy.deepcopy(RUNNING)), pods=workers(), launcher=launcher(), **shared()),
     ["apply NetworkPolicy j", "apply Service j", "apply ConfigMap j-mpi"], "Running", {"Running": ("True", "LauncherCreated")}, []),
    ("launcher completed: Succeeded, running workers deleted (cleanPodPolicy Running)",
     snap(body(copy.deepcopy(RUNNING)), pods=workers(), launcher=launcher(outcome="Complete"),
          **shared()),
     ["apply NetworkPolicy j", "apply Service j", "apply ConfigMap j-mpi", "delete Pod j-worker-0", "delete Pod j-worker-1"],
     "Succeeded", {"Succeeded": ("True", "JobSucceeded"), "Running": ("False", "JobSucceeded")},
     ["JobSucceeded", "JobSucceeded"]),  # Succeeded True, Running False: two transitions
    ("worker crashed with restarts left: attempt bumped, gang restart announced",
     snap(body(copy.deepcopy(RUNNING), runPolicy={"backoffLimit": 2}),
          pods=[pod("j-worker-0", index=0),
                pod("j-worker-1", index=1, phase="Failed", exit_code=137, reason="OOMKilled")],
          launcher=launcher(), **shared()),
     ["apply NetworkPolicy j", "apply Service j", "apply ConfigMap j-mpi"], "Starting", {"Restarting": ("True", "GangRestart"), "Running": ("False", "GangRestart"),
                      "WorkersReady": ("False", "GangRestart")},
     ["GangRestart", "GangRestart", "GangRestart"]),
    ("previous attempt's pods and launcher are deleted before names are reused",
     snap(body(copy.deepcopy(RESTARTING)), pods=workers(), launcher=launcher(), **shared()),
     ["apply NetworkPolicy j", "apply Service j", "apply ConfigMap j-mpi", "delete Pod j-worker-0",
      "delete Pod j-worker-1", "delete Job j-launcher"],
     "Starting", {}, []),
    ("previous attempt's pods already terminating: only wait",
     snap(body(copy.deepcopy(RESTARTING)), pods=workers(deleting=True), **shared()),
     ["apply NetworkPolicy j", "apply Service j", "apply ConfigMap j-mpi"], "Starting", {}, []),
    ("backoff limit used: Failed, active launcher and running workers stopped",
     snap(body(copy.deepcopy(RUNNING), runPolicy={"backoffLimit": 0}),
          pods=[pod("j-worker-0", index=0),
                pod("j-worker-1", index=1, phase="Failed", exit_code=1)],
          launcher=launcher(), **shared()),
     ["apply NetworkPolicy j", "apply Service j", "apply ConfigMap j-mpi", "delete Pod j-worker-0", "delete Job j-launcher"],
     "Failed", {"Failed": ("True", "BackoffLimitExceeded")}, ["BackoffLimitExceeded"] * 2),
    ("launcher failed: its pod is named as the cause",
     snap(body(copy.deepcopy(RUNNING), runPolicy={"backoffLimit": 0}),
          pods=workers() + [pod("j-launcher-x", role="launcher", index=None, phase="Failed",
                                exit_code=2)],
          launcher=launcher(outcome="Failed"), **shared()),
     ["apply NetworkPolicy j", "apply Service j", "apply ConfigMap j-mpi", "delete Pod j-worker-0", "delete Pod j-worker-1"],
     "Failed", {"Failed": ("True", "BackoffLimitExceeded")}, ["BackoffLimitExceeded"] * 2),
    ("a worker deleted under a running gang is a disruption: restarted, not counted",
     snap(body(copy.deepcopy(RUNNING), runPolicy={"backoffLimit": 0}), pods=workers(1),
          launcher=launcher(), **shared()),
     ["apply NetworkPolicy j", "apply Service j", "apply ConfigMap j-mpi"],
     "Starting", {"Restarting": ("True", "GangRestart")}, ["GangRestart"] * 3),
    ("an MPI worker that exits 0 while the launcher runs is a failure",
     snap(body(copy.deepcopy(RUNNING), runPolicy={"backoffLimit": 0}),
          pods=[pod("j-worker-0", index=0), pod("j-worker-1", index=1, phase="Succeeded")],
          launcher=launcher(), **shared()),
     ["apply NetworkPolicy j", "apply Service j", "apply ConfigMap j-mpi", "delete Pod j-worker-0", "delete Job j-launcher"],
     "Failed", {"Failed": ("True", "BackoffLimitExceeded")}, ["BackoffLimitExceeded"] * 2),
    ("activeDeadlineSeconds passed: Failed, everything stopped",
     snap(body(copy.deepcopy(RUNNING), runPolicy={"activeDeadlineSeconds": 60}),
          pods=workers(), launcher=launcher(), **shared()),
     ["delete Pod j-worker-0", "delete Pod j-worker-1", "delete Job j-launcher"],
     "Failed", {"Failed": ("True", "DeadlineExceeded")}, ["DeadlineExceeded"] * 2),
    ("suspended: pods and launcher deleted, quota given back",
     snap(body(copy.deepcopy(RUNNING), runPolicy={"suspend": True}), pods=workers(),
          launcher=launcher(), **shared()),
     ["delete Pod j-worker-0", "delete Pod j-worker-1", "delete Job j-launcher"],
     "Suspended", {"Suspended": ("True", "JobSuspended"), "Admitted": ("False", "JobSuspended"),
                   "Running": ("False", "JobSuspended")},
     ["JobSuspended", "JobSuspended", "JobSuspended"]),
    ("resumed: the gang starts again once admitted",
     snap(body({"phase": "Suspended", "conditions": cond(
         ("Created", True, "ChildrenCreated"), ("Admitted", False, "JobSuspended"),
         ("Suspended", True, "JobSuspended"))}), **shared()),
     ["apply NetworkPolicy j", "apply Service j", "apply ConfigMap j-mpi", "create Pod j-worker-0", "create Pod j-worker-1"],
     "Starting", {"Suspended": ("False", "JobResumed"), "Admitted": ("True", "QuotaReserved")},
     ["QuotaReserved", "JobResumed"]),
    ("its DataStage does not exist: Pending with a Warning, nothing created",
     snap(body(data={"dataStageRef": {"name": "imagenet"}})),
     [], "Pending", {"DataReady": ("False", "DataStageNotFound")}, ["DataStageNotFound"]),
    ("its DataStage is copying: Staging",
     snap(body(data={"dataStageRef": {"name": "imagenet"}}),
          stage={"metadata": {"name": "imagenet"}, "status": {"phase": "Copying"}}),
     [], "Staging", {"DataReady": ("False", "WaitingForDataStage")}, ["WaitingForDataStage"]),
    ("its DataStage is Ready: the claim is mounted and the gang starts",
     snap(body(data={"dataStageRef": {"name": "imagenet"}}),
          stage={"metadata": {"name": "imagenet"},
                 "status": {"phase": "Ready", "claimName": "imagenet-data"}}),
     ["apply NetworkPolicy j", "apply Service j", "apply ConfigMap j-mpi", "create ssh Secret",
      "create Pod j-worker-0", "create Pod j-worker-1"],
     "Starting", {"DataReady": ("True", "DataStageReady")},
     ["DataStageReady", "ChildrenCreated", "QuotaReserved"]),
    # issue 15 (11b): what happens to the DataStage later never freezes a started job
    ("running on a DataStage that is copying again (spec edited): keeps running on its claim",
     snap(body(copy.deepcopy(RUNNING_ON_DATA), data={"dataStageRef": {"name": "imagenet"}}),
          stage={"metadata": {"name": "imagenet"},
                 "status": {"phase": "Copying", "claimName": "imagenet-data"}},
          pods=workers(), launcher=launcher(), **shared()),
     ["apply NetworkPolicy j", "apply Service j", "apply ConfigMap j-mpi"], "Running", {"DataReady": ("True", "DataStageChanged"), "Running": ("True", "LauncherCreated")},
     ["DataStageChanged"]),
    ("running on a DataStage that Failed (its Secret deleted, a bad edit): keeps running",
     snap(body(copy.deepcopy(RUNNING_ON_DATA), data={"dataStageRef": {"name": "imagenet"}}),
          stage={"metadata": {"name": "imagenet"},
                 "status": {"phase": "Failed", "claimName": "imagenet-data"}},
          pods=workers(), launcher=launcher(), **shared()),
     ["apply NetworkPolicy j", "apply Service j", "apply ConfigMap j-mpi"], "Running", {"DataReady": ("True", "DataStageChanged")}, ["DataStageChanged"]),
    ("running, its DataStage deleted: keeps the claim its pods mount",
     snap(body(copy.deepcopy(RUNNING_ON_DATA), data={"dataStageRef": {"name": "imagenet"}}),
          pods=[mounting(w) for w in workers()], launcher=launcher(), **shared()),
     ["apply NetworkPolicy j", "apply Service j", "apply ConfigMap j-mpi"], "Running", {"DataReady": ("True", "DataStageChanged")}, ["DataStageChanged"]),
    ("a new job on a DataStage that is copying again waits for Ready",
     snap(body(data={"dataStageRef": {"name": "imagenet"}}),
          stage={"metadata": {"name": "imagenet"},
                 "status": {"phase": "Copying", "claimName": "imagenet-data"}}),
     [], "Staging", {"DataReady": ("False", "WaitingForDataStage")}, ["WaitingForDataStage"]),
    # issue 15 (8): the log shipper's credential goes only to Azure Storage or an allowed URL
    ("an output accountURL on another host: Failed naming the field",
     snap(body(output={"blob": {"accountURL": "https://collector.example.com/acct", "container": "c",
                                "auth": {"sasSecretRef": {"name": "s", "key": "k"}}}})),
     [], "Failed", {"Failed": ("True", "InvalidSpec")}, ["InvalidSpec"]),
    ("a malformed port in the output accountURL: Failed naming the field (issue 22 L1), not an exception",
     snap(body(output={"blob": {"accountURL": "https://acct.blob.core.windows.net:abc", "container": "logs",
                                "auth": {"sasSecretRef": {"name": "s", "key": "k"}}}})),
     [], "Failed", {"Failed": ("True", "InvalidSpec")}, ["InvalidSpec"]),
    ("no node in its pool: Pending until a node appears",
     snap(body(nodePool={"nodeSelector": {"pool": "none"}})),
     [], "Pending", {"Created": ("False", "NoMatchingNodes")}, ["NoMatchingNodes"]),
    ("more GPUs per worker than any node has: Failed",
     snap(body(gpusPerWorker=8, nodePool={"name": "gpu"})),
     [], "Failed", {"Failed": ("True", "Unsatisfiable")}, ["Unsatisfiable"]),
    ("the queue is full: Queued, one Normal Event, nothing created",
     snap(body(), admit=Decision(QUEUED, "QuotaExceeded", "needs 8 GPUs; 0 of 8 free")),
     [], "Queued", {"Admitted": ("False", "QuotaExceeded")}, ["QuotaExceeded"]),
    ("the quota can never hold it: Failed",
     snap(body(), admit=Decision(UNSATISFIABLE, "Unsatisfiable", "needs 8 but at most 4")),
     [], "Failed", {"Failed": ("True", "Unsatisfiable")}, ["Unsatisfiable"]),
    ("a spec only the operator can judge: Failed InvalidSpec",
     snap(body(nodePool={"name": "nope"})),
     [], "Failed", {"Failed": ("True", "InvalidSpec")}, ["InvalidSpec"]),
    ("a Service of that name belongs to someone else: NameConflict, nothing created",
     snap(body(), service=child("Service", "j", uid="someone-else")),
     [], "Pending", {"Created": ("False", "NameConflict")}, ["NameConflict", "QuotaReserved"]),
    ("the apply layer met a taken name: NameConflict",
     snap(body({"phase": "Starting", "conditions": CREATED}),
          problem=Problem("NameConflict", "Pod ns/j-worker-0 taken")),
     [], "Pending", {"Created": ("False", "NameConflict")}, ["NameConflict"]),
    ("the API server refused a child as invalid: Failed ChildRejected (the gate frees its GPUs)",
     snap(body({"phase": "Starting", "conditions": CREATED}),
          problem=Problem("ChildRejected", "spec.resources: the API server refused Pod j-worker-0")),
     [], "Failed", {"Failed": ("True", "ChildRejected")}, ["ChildRejected"]),
    ("finished, not yet clean: the launcher that still runs and the workers go",
     snap(body({"phase": "Failed", "completionTime": T0,
                "conditions": cond(("Failed", True, "DeadlineExceeded"))}),
          pods=workers(), launcher=launcher()),
     ["delete Pod j-worker-0", "delete Pod j-worker-1", "delete Job j-launcher"],
     "Failed", {}, []),
    ("finished and nothing left to delete: marked clean",
     snap(body({"phase": "Succeeded", "completionTime": T0,
                "conditions": cond(("Succeeded", True, "JobSucceeded"))}),
          pods=[pod("j-launcher-x", role="launcher", index=None, phase="Succeeded")],
          launcher=launcher(outcome="Complete")),
     [], "Succeeded", {}, []),
    ("torchrun: Service only, workers created, no launcher",
     snap(body(launcher="torchrun", gpusPerWorker=2)),
     ["apply NetworkPolicy j", "apply Service j", "create Pod j-worker-0", "create Pod j-worker-1"],
     "Starting", {"Created": ("True", "ChildrenCreated")}, ["ChildrenCreated", "QuotaReserved"]),
    ("torchrun: every worker Ready runs it (no DNS wait, no launcher)",
     snap(body({"phase": "Starting", "conditions": CREATED_TORCHRUN}, launcher="torchrun",
               gpusPerWorker=2), pods=workers(), service=child("Service", "j")),
     ["apply NetworkPolicy j", "apply Service j"], "Running", {"Running": ("True", "WorkersRunning")},
     ["AllWorkersReady", "WorkersRunning"]),
    ("torchrun: every worker completed: Succeeded",
     snap(body({**copy.deepcopy(RUNNING), "conditions": CREATED_TORCHRUN + cond(
         ("Running", True, "WorkersRunning"))}, launcher="torchrun", gpusPerWorker=2),
          pods=workers(phase="Succeeded", ready=False), service=child("Service", "j")),
     ["apply NetworkPolicy j", "apply Service j"], "Succeeded", {"Succeeded": ("True", "JobSucceeded")}, ["JobSucceeded"] * 2),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_decide(case):
    _, snapshot, actions, phase, conds, events = case
    out = decide(snapshot, CFG, NOW)
    assert summary(out.actions) == actions
    assert out.status["phase"] == phase
    got = reasons(out.status)
    assert {k: got.get(k) for k in conds} == conds
    assert sorted(reason for _, reason, _ in out.events) == sorted(events)
    assert out.status["observedGeneration"] == 1


# ---- details the table does not show ------------------------------------------------------

def test_the_launcher_resolves_the_workers_from_their_pod_ips():
    """hostAliases: each name in the hostfile (render.host) -> that worker's pod IP, so mpirun's
    ssh never waits for cluster DNS; the hostfile's names are exactly those."""
    s = snap(body({"phase": "Starting", "conditions": CREATED}), pods=workers(), **shared())
    launcher_job = next(a.obj for a in decide(s, CFG, NOW).actions
                        if isinstance(a, Create) and a.obj["kind"] == "Job")
    aliases = launcher_job["spec"]["template"]["spec"]["hostAliases"]
    assert aliases == [{"ip": "10.0.0.10", "hostnames": ["j-worker-0.j.ns.svc"]},
                       {"ip": "10.0.0.11", "hostnames": ["j-worker-1.j.ns.svc"]}]
    hostfile = next(a.obj for a in decide(s, CFG, NOW).actions
                    if isinstance(a, Apply) and a.obj["kind"] == "ConfigMap")["data"]
    assert [line.split()[0] for line in hostfile["hostfile"].splitlines()] == \
        [a["hostnames"][0] for a in aliases]


def test_worker_volume_mounts_the_stage_claim():
    s = snap(body(data={"dataStageRef": {"name": "imagenet"}}),
             stage={"metadata": {"name": "imagenet"},
                    "status": {"phase": "Ready", "claimName": "imagenet-data"}})
    worker = next(a.obj for a in decide(s, CFG, NOW).actions
                  if isinstance(a, Create) and a.obj["kind"] == "Pod")
    claims = [v["persistentVolumeClaim"]["claimName"] for v in worker["spec"]["volumes"]
              if "persistentVolumeClaim" in v]
    assert claims == ["imagenet-data"]


def test_apply_carries_the_live_version_so_unchanged_children_cost_nothing():
    s = snap(body({"phase": "Starting", "conditions": CREATED}), pods=workers(1), **shared())
    applies = [a for a in decide(s, CFG, NOW).actions if isinstance(a, Apply)]
    assert [(a.obj["kind"], a.live_version) for a in applies] == [
        ("NetworkPolicy", "7"), ("Service", "7"), ("ConfigMap", "7")]
    missing = [a for a in decide(snap(body()), CFG, NOW).actions if isinstance(a, Apply)]
    assert {a.live_version for a in missing} == {""}  # absent: create


def test_gang_restart_records_the_first_failure():
    s = snap(body(copy.deepcopy(RUNNING), runPolicy={"backoffLimit": 2}),
             pods=[pod("j-worker-0", index=0, phase="Failed", exit_code=1, finished="t2"),
                   pod("j-worker-1", index=1, phase="Failed", exit_code=137, reason="OOMKilled",
                       finished="t1")],
             launcher=launcher(), **shared())
    out = decide(s, CFG, NOW)
    assert (out.status["attempt"], out.status["restarts"]["failures"]) == (1, 1)
    assert out.status["lastFailure"]["pod"] == "j-worker-1"  # the first to fail is the cause
    assert ("Warning", "GangRestart") in [(t, r) for t, r, _ in out.events]


def test_start_time_and_deadline_moment():
    out = decide(snap(body(runPolicy={"activeDeadlineSeconds": 600})), CFG, NOW)
    assert out.status["startTime"] == "2026-05-01T12:00:00Z"
    assert out.requeue_after == 600  # woken at the deadline's exact moment, no polling
    running = snap(body(copy.deepcopy(RUNNING), runPolicy={"activeDeadlineSeconds": 7200}),
                   pods=workers(), launcher=launcher(), **shared())
    assert decide(running, CFG, NOW).requeue_after == 7200 - 3600


def test_waiting_jobs_name_no_deadline():
    out = decide(snap(body(), admit=Decision(QUEUED, "QuotaExceeded", "full")), CFG, NOW)
    assert out.requeue_after is None and out.waiting == "full"


def test_ttl_waits_for_its_moment_then_deletes_the_job():
    done = {"phase": "Succeeded", "completionTime": "2026-05-01T11:59:00Z", "cleanedUp": True,
            "conditions": cond(("Succeeded", True, "JobSucceeded"))}
    out = decide(snap(body(copy.deepcopy(done), runPolicy={"ttlSecondsAfterFinished": 300})),
                 CFG, NOW)
    assert (out.requeue_after, out.delete_self, out.actions) == (240, False, [])
    out = decide(snap(body(copy.deepcopy(done), runPolicy={"ttlSecondsAfterFinished": 30})),
                 CFG, NOW)
    assert out.delete_self and out.requeue_after is None


def test_finished_clean_job_is_not_even_parsed():
    done = {"phase": "Failed", "cleanedUp": True, "conditions": cond(("Failed", True, "X"))}
    s = snap(body(copy.deepcopy(done), nodePool={"name": "nope"}))  # would be InvalidSpec
    out = decide(s, CFG, NOW)
    assert out.actions == [] and out.events == [] and out.status["phase"] == "Failed"


def test_invalid_spec_is_judged_again_after_an_edit():
    failed = decide(snap(body(nodePool={"name": "nope"})), CFG, NOW).status
    fixed = body(copy.deepcopy(failed), generation=2)
    out = decide(snap(fixed), CFG, NOW)
    assert out.status["phase"] == "Starting" and "Failed" not in reasons(out.status)


def test_running_job_gets_deleted_children_back():
    s = snap(body(copy.deepcopy(RUNNING)), pods=workers(), launcher=launcher())  # all missing
    # a deleted Service takes the workers' DNS names even while the gang runs: every child is
    # kept in shape (an unchanged one costs no call: apply.py)
    assert [getattr(a, "obj", {}).get("kind", type(a).__name__) for a in decide(s, CFG, NOW).actions] == \
        ["NetworkPolicy", "Service", "ConfigMap", "CreateSSHSecret"]


def test_the_same_snapshot_gives_the_same_decision():
    s = snap(body(), pods=workers(1), **shared())
    assert decide(s, CFG, NOW) == decide(s, CFG, NOW)


def test_the_old_operators_finalizer_is_taken_off():
    b = body()
    b["metadata"] |= {"finalizers": ["trainop.io/finalizer", "example.com/keep"],
                      "resourceVersion": "41"}
    drop = [a for a in decide(snap(b), CFG, NOW).actions if isinstance(a, SetFinalizers)]
    assert drop == [SetFinalizers(Ref("trainop.io/v1alpha1", "DistributedTrainingJob", "j", "ns", UID),
                                  ("example.com/keep",), "41")]
    assert not [a for a in decide(snap(body()), CFG, NOW).actions if isinstance(a, SetFinalizers)]


# ---- the log shipper's progress: reported, never trusted ---------------------------------------

BLOB = {"blob": {"accountURL": "https://a.blob.core.windows.net", "container": "results",
                 "auth": {"sasSecretRef": {"name": "storage", "key": "sas"}}}}


def progress(metrics: str) -> dict:
    cm = child("ConfigMap", "j-progress")
    cm["metadata"]["labels"]["trainop.io/role"] = "progress"
    cm["data"] = {"metrics": metrics}
    return cm


def test_blob_output_gets_a_progress_config_map_once():
    created = summary(decide(snap(body(output=BLOB)), CFG, NOW).actions)
    assert "create ConfigMap j-progress" in created
    assert "apply Role j-logship" in created and "apply RoleBinding j-logship" in created
    again = decide(snap(body(output=BLOB), progress=progress("{}")), CFG, NOW)
    assert "create ConfigMap j-progress" not in summary(again.actions)
    assert "create ConfigMap j-progress" not in summary(decide(snap(body()), CFG, NOW).actions)


def test_progress_is_shown_in_status_and_decides_nothing():
    """What the shipper reports lands in status.metrics, checked; a report cannot finish the
    job, and its non-contract keys (`phase`) go nowhere."""
    running = snap(body(copy.deepcopy(RUNNING), output=BLOB), pods=workers(), launcher=launcher(),
                   **shared(), progress=progress('{"step": 9, "loss": NaN, "final": true, "phase": "Succeeded"}'))
    out = decide(running, CFG, NOW)
    assert out.status["metrics"] == {"step": 9, "loss": "NaN", "final": True}
    assert out.status["phase"] == "Running" and out.events == []
    # children only, each unchanged (apply skips them): nothing from the report
    assert {a.obj["kind"] for a in out.actions} == {"NetworkPolicy", "Service", "ConfigMap", "ServiceAccount",
                                                    "Role", "RoleBinding"}


def test_progress_is_shown_after_the_job_finished_and_was_cleaned():
    done = {**copy.deepcopy(RUNNING), "phase": "Succeeded", "cleanedUp": True, "metrics": {"step": 1}}
    out = decide(snap(body(done, output=BLOB), progress=progress('{"step": 2, "final": true}')), CFG, NOW)
    assert out.status["metrics"] == {"step": 2, "final": True}
    assert out.actions == []


def test_status_merge_patch_removes_what_went():
    from trainop.controller import merge_patch
    old = {"phase": "Running", "metrics": {"step": 1, "loss": 2.0}, "restarts": 0, "gpus": 8}
    new = {"phase": "Running", "metrics": {"step": 2}, "restarts": 1}
    assert merge_patch(old, new) == {"metrics": {"step": 2, "loss": None}, "restarts": 1, "gpus": None}
    assert merge_patch(old, old) == {}
    assert merge_patch({"conditions": [1, 2]}, {"conditions": [1]}) == {"conditions": [1]}


REPORT_AT = 1_779_000_000.0  # 2026-05-17T06:40:00Z


def test_progress_and_eta_come_from_the_report_and_decide_nothing():
    """status.progress: percent from step/totalSteps, the ETA from the report's own time plus
    the steps left at its pace; the same report gives the same status at any later reconcile."""
    report = ('{"step": 300, "totalSteps": 1200, "stepTime": 0.25, "imagesPerSec": 2048.0, '
              f'"time": {REPORT_AT}, "final": false}}')
    running = snap(body(copy.deepcopy(RUNNING), output=BLOB), pods=workers(), launcher=launcher(),
                   **shared(), progress=progress(report))
    out = decide(running, CFG, NOW)
    assert out.status["progress"] == {
        "step": 300, "totalSteps": 1200, "percent": 25.0, "imagesPerSec": 2048.0, "secondsPerStep": 0.25,
        "reportTime": "2026-05-17T06:40:00Z", "secondsLeft": 225, "eta": "2026-05-17T06:43:45Z"}
    assert out.status["phase"] == "Running" and out.events == []
    assert decide(running, CFG, NOW + dt.timedelta(minutes=5)).status["progress"] == out.status["progress"]


def test_a_finished_job_shows_its_progress_without_an_eta():
    done = {**copy.deepcopy(RUNNING), "phase": "Succeeded", "cleanedUp": True,
            "progress": {"percent": 50.0, "eta": "2026-05-17T06:43:45Z", "secondsLeft": 9}}
    report = f'{{"step": 1200, "totalSteps": 1200, "stepTime": 0.25, "time": {REPORT_AT}, "final": true}}'
    out = decide(snap(body(done, output=BLOB), progress=progress(report)), CFG, NOW)
    assert out.status["progress"] == {"step": 1200, "totalSteps": 1200, "percent": 100.0,
                                      "secondsPerStep": 0.25, "reportTime": "2026-05-17T06:40:00Z"}
    from trainop.controller import merge_patch
    assert merge_patch(done, out.status)["progress"]["eta"] is None  # the stale ETA is removed


def test_a_forged_report_gives_no_progress_it_cannot_support():
    """Values from a pod are checked: wrong types, negatives, NaN, a step past the total and a
    time outside any plausible clock give no percent or ETA (and break nothing)."""
    for report, expected in [
        ('{"step": "300", "totalSteps": 1200}', {"totalSteps": 1200}),
        ('{"step": 300, "totalSteps": 0}', {"step": 300}),
        ('{"step": 1300, "totalSteps": 1200, "stepTime": 1.0}', {"step": 1300, "totalSteps": 1200,
                                                                "secondsPerStep": 1.0}),
        ('{"step": 1, "totalSteps": 2, "stepTime": NaN, "imagesPerSec": -5}',
         {"step": 1, "totalSteps": 2, "percent": 50.0}),
        ('{"step": 1, "totalSteps": 2, "stepTime": 1e12, "time": 1e300}',
         {"step": 1, "totalSteps": 2, "percent": 50.0, "secondsPerStep": 1e12}),
        ('{"step": 1, "totalSteps": 2, "stepTime": 2, "time": true}',
         {"step": 1, "totalSteps": 2, "percent": 50.0, "secondsPerStep": 2.0, "secondsLeft": 2}),
    ]:
        running = snap(body(copy.deepcopy(RUNNING), output=BLOB), pods=workers(), launcher=launcher(),
                       **shared(), progress=progress(report))
        out = decide(running, CFG, NOW)
        assert out.status.get("progress") == expected, report
        assert out.status["phase"] == "Running"
def test_a_gang_scheduler_gets_the_pod_group_before_any_pod():
    cfg = config.from_dict({"gangScheduling": {"scheduler": "scheduler-plugins"}})
    actions = decide(snap(body(), gang_scheduler="scheduler-plugins"), cfg, NOW).actions
    lines = summary(actions)
    assert lines.index("apply PodGroup j") < lines.index("create Pod j-worker-0")
    worker = next(a.obj for a in actions if isinstance(a, Create) and a.obj["kind"] == "Pod")
    assert worker["spec"]["schedulerName"] == "scheduler-plugins-scheduler"
    assert "apply PodGroup j" not in summary(decide(snap(body()), cfg, NOW).actions)  # API not served


def test_an_admitted_job_whose_pod_template_grew_is_stopped_and_queued_again():
    """Issue 22 H1 for what the CRD's rule cannot compare: a podTemplate edited after admission
    (a sidecar asking for 64 CPUs) never runs on the reservation made for the old shape."""
    admitted_shape = admission.shape_digest(parse(body(), CFG))
    running = {**copy.deepcopy(RUNNING), "admittedShape": admitted_shape}
    same = decide(snap(body(copy.deepcopy(running)), pods=workers(), launcher=launcher()), CFG, NOW)
    assert same.status["phase"] == "Running" and same.status["admittedShape"] == admitted_shape
    grown = body(copy.deepcopy(running), generation=2, podTemplate={"worker": {"spec": {
        "containers": [{"name": "extra", "image": "x", "resources": {"requests": {"cpu": "64"}}}]}}})
    out = decide(snap(grown, pods=workers(), launcher=launcher()), CFG, NOW)
    assert summary(out.actions) == ["delete Pod j-worker-0", "delete Pod j-worker-1",
                                    "delete Job j-launcher"]
    assert out.status["phase"] == "Queued" and "stopping the gang" in out.waiting
    gone = decide(snap(body(out.status, generation=2, podTemplate=grown["spec"]["podTemplate"]),
                       admit=None), CFG, NOW)
    assert reasons(gone.status)["Admitted"] == ("False", "ShapeChanged")
    assert "admittedShape" not in gone.status and gone.actions == []
    # the next pass asks the queue for the new shape
    again = decide(snap(body(gone.status, generation=2, podTemplate=grown["spec"]["podTemplate"]),
                        admit=None), CFG, NOW)
    assert again.asks is not None and again.asks.pod_template == grown["spec"]["podTemplate"]


def test_an_upgrade_that_changes_the_rendered_shape_leaves_running_jobs_alone():
    """A helm upgrade with a new launcherResources changes the shape the operator renders, not
    the job's spec: the gang runs on (its pods were counted as made), the digest follows it, and
    an edit of the spec after that is still judged (found by tests/e2e/test_operator_in_cluster.py's
    upgrade test: every running job was stopped and requeued)."""
    admitted_shape = admission.shape_digest(parse(body(), CFG))
    running = {**copy.deepcopy(RUNNING), "admittedShape": admitted_shape, "admittedGeneration": 1}
    upgraded = config.from_dict({"launcherResources": {"requests": {"cpu": "750m", "memory": "768Mi"}}})
    new_shape = admission.shape_digest(parse(body(), upgraded))
    assert new_shape != admitted_shape
    out = decide(snap(body(copy.deepcopy(running)), pods=workers(), launcher=launcher(), **shared()), upgraded, NOW)
    assert not [line for line in summary(out.actions) if line.startswith(("delete", "create"))]
    assert out.status["phase"] == "Running"
    assert (out.status["admittedShape"], out.status["admittedGeneration"]) == (new_shape, 1)
    # a job admitted by an operator that did not record admittedGeneration: the generation its
    # last reconcile saw stands in
    old = {k: v for k, v in running.items() if k != "admittedGeneration"} | {"observedGeneration": 1}
    out = decide(snap(body(copy.deepcopy(old)), pods=workers(), launcher=launcher(), **shared()), upgraded, NOW)
    assert not [line for line in summary(out.actions) if line.startswith(("delete", "create"))]
    assert out.status["admittedShape"] == new_shape
    # the spec edited since admission: judged as before, whatever else changed
    grown = body(copy.deepcopy(running), generation=2, podTemplate={"worker": {"spec": {
        "containers": [{"name": "extra", "image": "x", "resources": {"requests": {"cpu": "64"}}}]}}})
    out = decide(snap(grown, pods=workers(), launcher=launcher(), **shared()), upgraded, NOW)
    assert out.status["phase"] == "Queued" and "stopping the gang" in out.waiting


def test_a_malformed_port_fails_the_job_once_and_the_next_reconcile_is_quiet():
    """Issue 22 L1: the ValueError once escaped decide(), so every retry failed again."""
    bad = body(output={"blob": {"accountURL": "https://acct.blob.core.windows.net:99999", "container": "logs",
                                "auth": {"sasSecretRef": {"name": "s", "key": "k"}}}})
    first = decide(snap(bad), CFG, NOW)
    failed = conditions.get_condition(first.status["conditions"], "Failed")
    assert failed["message"].startswith("spec.output.blob.accountURL: ")
    again = decide(snap(body(copy.deepcopy(first.status), output=bad["spec"]["output"])), CFG, NOW)
    assert again.actions == [] and again.events == [] and again.requeue_after is None
