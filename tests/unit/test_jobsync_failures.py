"""jobsync.decide() as tables for issue 16's pools and failures: autoscaled and spot pools
(capacity at maxNodes, WaitingForNodes, schedulingTimeoutSeconds), failures classified
(exit codes, OOMKilled, evictions, lost nodes, spot evictions) and judged by
runPolicy.failurePolicy, status.restarts' two counters and status.attempt, and
nodePool.fallback. Snapshots in, status and actions out, no cluster (tests/cluster/
test_pools.py drives the real scheduler, PodGC and Eviction API)."""

from __future__ import annotations

import copy
import datetime as dt

import pytest

from tests.unit.test_jobsync_decide import (
    CREATED,
    NOW,
    RUNNING,
    T0,
    body,
    launcher,
    pod,
    reasons,
    shared,
    snap,
    summary,
    workers,
)
from trainop import admission, conditions, config, jobsync
from trainop.actions import Create, Delete
from trainop.devcluster.pools import default_pools
from trainop.jobsync import JobSnapshot, decide, model
from trainop.render import dtj as render_dtj
from trainop.spec import SpecError, capacity_error, parse

GPU = config.GPU_TOLERATION
POOLS = {**copy.deepcopy(config.DEFAULTS["nodePools"]),
         "spot": {"nodeSelector": {config.POOL_LABEL: "spot"}, "tolerations": [GPU], "spot": True,
                  "autoscale": {"minNodes": 0, "maxNodes": 4}, "gpusPerNode": 4},
         "ondemand": {"nodeSelector": {config.POOL_LABEL: "ondemand"}, "tolerations": [GPU],
                      "autoscale": {"minNodes": 0, "maxNodes": 2}}}
CFG = config.from_dict({"nodePools": POOLS, "schedulingTimeoutSeconds": 600})
NODES = [n for pool in default_pools() for n in pool.nodes()]  # no spot or ondemand node
SPOT = {"name": "spot"}


def spot_body(status=None, **spec):
    spec.setdefault("nodePool", SPOT)
    return body(status, **spec)


def decide_(s: JobSnapshot, now=NOW):
    return decide(s, CFG, now)


def unschedulable(p: dict) -> dict:
    p["status"] = {"phase": "Pending", "conditions": [
        {"type": "PodScheduled", "status": "False", "reason": "Unschedulable"}]}
    return p


def on_node(p: dict, node: str) -> dict:
    p["spec"]["nodeName"] = node
    return p


def disrupted(p: dict, reason: str, phase: str | None = None, deleting: bool = True) -> dict:
    """A pod the API server / scheduler / PodGC is ending, as they mark it."""
    p["status"]["conditions"].append({"type": "DisruptionTarget", "status": "True", "reason": reason})
    if phase:
        p["status"]["phase"] = phase
    if deleting:
        p["metadata"]["deletionTimestamp"] = T0
    return p


# ---- the configuration ------------------------------------------------------------------------

def test_spot_pool_gets_the_aks_spot_toleration_once():
    pool = CFG.node_pools["spot"]
    assert pool.tolerations == [GPU, config.SPOT_TOLERATION]
    assert config.SPOT_TOLERATION == {"key": "kubernetes.azure.com/scalesetpriority",
                                      "operator": "Equal", "value": "spot", "effect": "NoSchedule"}
    again = config.from_dict({"nodePools": {**POOLS, "spot": {**POOLS["spot"], "tolerations": [
        GPU, config.SPOT_TOLERATION]}}})
    assert again.node_pools["spot"].tolerations == [GPU, config.SPOT_TOLERATION]
    assert (pool.autoscale.min_nodes, pool.autoscale.max_nodes, pool.gpus_per_node) == (0, 4, 4)


@pytest.mark.parametrize("pool, message", [
    ({"autoscale": {"maxNodes": 0}}, "nodePools.p.autoscale.maxNodes: required, an integer >= 1"),
    ({"autoscale": {"minNodes": 3, "maxNodes": 2}}, "nodePools.p.autoscale.maxNodes"),
    ({"autoscale": {"max": 2}}, "nodePools.p.autoscale: must be {minNodes: N, maxNodes: M}"),
    ({"spot": "yes"}, "nodePools.p.spot: must be true or false"),
    ({"gpusPerNode": -1}, "nodePools.p.gpusPerNode: must be a non-negative integer"),
])
def test_bad_pool_keys_name_the_key(pool, message):
    with pytest.raises(config.ConfigError, match=message.replace("{", r"\{").replace("}", r"\}")):
        config.from_dict({"nodePools": {**POOLS, "p": {"nodeSelector": {"a": "b"}, **pool}}})


# ---- capacity: an autoscaled pool is judged at maxNodes ----------------------------------------

def test_pool_at_zero_nodes_still_fits_and_creates_its_pods():
    out = decide_(snap(spot_body(), nodes=NODES))
    created = [a.obj for a in out.actions if type(a).__name__ == "Create"]
    assert [p["metadata"]["name"] for p in created] == ["j-worker-0", "j-worker-1"]
    assert config.SPOT_TOLERATION in created[0]["spec"]["tolerations"]
    assert created[0]["spec"]["nodeSelector"][config.POOL_LABEL] == "spot"
    assert reasons(out.status)["Created"] == ("True", "ChildrenCreated")
    assert out.status["nodePool"] == "spot"


@pytest.mark.parametrize("spec, field, words", [
    ({"workers": 5, "gpusPerWorker": 4}, "spec.workers", "need 5 nodes of 4 GPUs, but node pool 'spot' grows to at most 4"),
    ({"workers": 1, "gpusPerWorker": 8}, "spec.gpusPerWorker", "the largest node of node pool 'spot' has 4"),
])
def test_only_what_cannot_fit_at_max_nodes_is_unsatisfiable(spec, field, words):
    job = parse(spot_body(**spec), CFG)
    error = capacity_error(job, NODES)
    assert isinstance(error, SpecError) and error.field == field and words in str(error)
    out = decide_(snap(spot_body(**spec)))
    assert (out.status["phase"], reasons(out.status)["Failed"][1]) == ("Failed", "Unsatisfiable")
    assert capacity_error(parse(spot_body(workers=4), CFG), NODES) is None  # exactly maxNodes


def test_pool_without_gpus_per_node_at_zero_nodes_is_not_judged_by_size():
    job = parse(body(nodePool={"name": "ondemand"}, workers=8, gpusPerWorker=8), CFG)
    assert capacity_error(job, NODES) is None  # unknown VM size: the timeout judges it
    node = copy.deepcopy(next(n for n in NODES if n["metadata"]["labels"][config.POOL_LABEL] == "gpu"))
    node["metadata"]["labels"][config.POOL_LABEL] = "ondemand"  # one 4-GPU node present
    assert "has 4" in str(capacity_error(job, [node]))


def test_admission_counts_the_pool_at_max_nodes():
    job = parse(spot_body(workers=4), CFG)
    c = admission.candidate(job, {"creationTimestamp": T0}, [])
    assert (c.max_nodes, c.gpus_per_node) == (4, 4)
    assert admission.unsatisfiable(c, [], NODES) is None  # 16 GPUs at maxNodes, none present
    big = admission.Candidate(**{**c.__dict__, "gpus": 20})
    assert "has 16 in all at maxNodes=4" in admission.unsatisfiable(big, [], NODES)
    fixed = admission.Candidate(**{**c.__dict__, "max_nodes": None})
    assert "has 0 in all" in admission.unsatisfiable(fixed, [], NODES)


# ---- WaitingForNodes and schedulingTimeoutSeconds ----------------------------------------------

STARTING = {"phase": "Starting", "startTime": T0, "attempt": 0,
            "restarts": {"failures": 0, "disruptions": 0}, "conditions": CREATED}


def test_unschedulable_workers_wait_for_nodes_with_an_exact_deadline():
    pods = [unschedulable(p) for p in workers(2, ready=False)]
    out = decide_(snap(spot_body(copy.deepcopy(STARTING)), pods=pods, **shared()))
    cond = conditions.get_condition(out.status["conditions"], "WaitingForNodes")
    assert (cond["status"], cond["reason"]) == ("True", "WaitingForNodes")
    assert cond["message"].startswith("2/2 workers wait for nodes of node pool 'spot': 2 more nodes "
                                      "needed (the pool autoscales to at most 4)")
    assert "fails at 2026-05-01T12:10:00Z" in cond["message"]
    assert out.requeue_after == 600  # the deadline's moment, no polling
    assert out.waiting == cond["message"]
    assert ("Normal", "WaitingForNodes") in [(t, r) for t, r, _ in out.events]
    assert out.status["phase"] == "Starting"
    assert not [a for a in summary(out.actions) if a.startswith(("create", "delete"))]


def test_no_count_while_the_scheduler_has_not_judged_every_worker():
    """One worker judged Unschedulable, the other not yet tried: saying "1/2 wait" now would be
    a line that the next moment's "2/2" contradicts. Nothing is said until both are judged."""
    judged, unjudged = workers(2, ready=False, phase="Pending")
    unjudged["status"]["conditions"] = []  # as the API server makes it: no verdict yet
    pods = [unschedulable(judged), unjudged]
    out = decide_(snap(spot_body(copy.deepcopy(STARTING)), pods=pods, **shared()))
    assert conditions.get_condition(out.status["conditions"], "WaitingForNodes") is None
    assert not [r for _, r, _ in out.events if r == "WaitingForNodes"]
    both = decide_(snap(spot_body(copy.deepcopy(STARTING)), pods=[unschedulable(judged), unschedulable(unjudged)],
                        **shared()))
    assert conditions.get_condition(both.status["conditions"], "WaitingForNodes")["message"].startswith("2/2 ")


def test_the_deadline_counts_from_the_schedulers_word_even_when_the_status_read_is_stale():
    """A reconcile may read a status from the cache without our last write (WaitingForNodes not
    yet there): the deadline, and so the condition's text and the one INFO line, still come out
    the same, from the pods' PodScheduled=False time."""
    pods = [unschedulable(p) for p in workers(2, ready=False)]
    for p in pods:
        p["status"]["conditions"][0]["lastTransitionTime"] = "2026-05-01T11:58:00Z"  # NOW - 2 min
    first = decide_(snap(spot_body(copy.deepcopy(STARTING)), pods=copy.deepcopy(pods), **shared()))
    assert "fails at 2026-05-01T12:08:00Z" in first.waiting and first.requeue_after == 480
    stale = decide_(snap(spot_body(copy.deepcopy(STARTING)), pods=copy.deepcopy(pods), **shared()),
                    now=NOW + dt.timedelta(seconds=5))
    assert stale.waiting == first.waiting


def test_a_launcher_without_room_waits_for_nodes_under_the_same_deadline():
    """The MPI launcher goes to the job's pool too: once created, it can be the one pod the
    scheduler cannot place (its node full of CPU work). WaitingForNodes says so, one INFO line's
    text, and schedulingTimeoutSeconds counts from the scheduler's word on it."""
    stuck = unschedulable(pod("j-launcher-abcde", role="launcher", index=None, ready=False))
    stuck["status"]["conditions"][0]["lastTransitionTime"] = "2026-05-01T11:55:00Z"  # NOW - 5 min
    running = {**copy.deepcopy(RUNNING), "attempt": 0, "restarts": {"failures": 0, "disruptions": 0}}
    pods = [on_node(p, "aks-spot-0") for p in workers(2)] + [stuck]
    out = decide_(snap(spot_body(running), pods=pods, launcher=launcher(), **shared()))
    cond = conditions.get_condition(out.status["conditions"], "WaitingForNodes")
    assert cond["status"] == "True"
    assert cond["message"].startswith("the launcher waits for room on node pool 'spot': the scheduler finds no node")
    assert "fails at 2026-05-01T12:05:00Z" in cond["message"] and out.requeue_after == 300
    assert out.waiting == cond["message"]
    # past the deadline: Failed, the gang's pods freed
    late = decide_(snap(spot_body(copy.deepcopy(out.status)), pods=pods, launcher=launcher(), **shared()),
                   now=NOW + dt.timedelta(seconds=301))
    assert reasons(late.status)["Failed"] == ("True", "SchedulingTimeout")
    # placed: the wait ends
    placed = copy.deepcopy(pods)
    placed[-1] = on_node(pod("j-launcher-abcde", role="launcher", index=None), "aks-spot-0")
    done = decide_(snap(spot_body(copy.deepcopy(out.status)), pods=placed, launcher=launcher(), **shared()))
    assert conditions.get_condition(done.status["conditions"], "WaitingForNodes")["status"] == "False"
    assert done.waiting is None


def test_half_placed_gang_counts_nodes_for_the_rest():
    pods = [on_node(workers(2)[0], "aks-spot-0"), unschedulable(workers(2, ready=False)[1])]
    out = decide_(snap(spot_body(copy.deepcopy(STARTING), workers=2), pods=pods, **shared()))
    assert "1/2 workers wait for nodes of node pool 'spot': 1 more node needed" in out.waiting


def test_nodes_that_never_come_fail_the_job_and_free_its_pods():
    status = copy.deepcopy(STARTING)
    status["conditions"] = conditions.set_condition(status["conditions"], "WaitingForNodes", True,
                                                    "WaitingForNodes", "m", timestamp=T0)  # 1h ago
    pods = [unschedulable(p) for p in workers(2, ready=False)]
    out = decide_(snap(spot_body(status), pods=pods, **shared()))
    assert out.status["phase"] == "Failed"
    assert reasons(out.status)["Failed"] == ("True", "SchedulingTimeout")
    assert "schedulingTimeoutSeconds=600" in conditions.get_condition(out.status["conditions"], "Failed")["message"]
    assert summary(out.actions)[-2:] == ["delete Pod j-worker-0", "delete Pod j-worker-1"]
    assert out.requeue_after is None


def test_nodes_arriving_end_the_wait():
    status = copy.deepcopy(STARTING)
    status["conditions"] = conditions.set_condition(status["conditions"], "WaitingForNodes", True,
                                                    "WaitingForNodes", "m", timestamp=T0)
    out = decide_(snap(spot_body(status), pods=workers(2), **shared()))
    assert reasons(out.status)["WaitingForNodes"] == ("False", "NodesAvailable")
    assert out.waiting is None  # the next step of the start: the launcher
    assert "create Job j-launcher" in summary(out.actions)


def test_fixed_pool_waits_without_deadline_unless_the_job_sets_one():
    pods = [unschedulable(p) for p in workers(2, ready=False)]
    out = decide_(snap(body(copy.deepcopy(STARTING)), pods=pods, **shared()))
    assert reasons(out.status)["WaitingForNodes"][0] == "True" and out.requeue_after is None
    own = decide_(snap(body(copy.deepcopy(STARTING), runPolicy={"schedulingTimeoutSeconds": 30}),
                       pods=copy.deepcopy(pods), **shared()))
    assert own.requeue_after == 30


# ---- failures classified -----------------------------------------------------------------------

def running(**spec) -> dict:
    return body(copy.deepcopy(RUNNING), **spec)


def failed_worker(exit_code=1, reason="Error", finished="t1", index=1, attempt=0) -> dict:
    return on_node(pod(f"j-worker-{index}", index=index, phase="Failed", exit_code=exit_code,
                       reason=reason, finished=finished, attempt=attempt), "aks-gpu-12345678-vmss000001")


EVICTED = disrupted(on_node(workers(2)[1], "aks-gpu-12345678-vmss000001"), "EvictionByEvictionAPI")
PREEMPTED = disrupted(on_node(workers(2)[1], "n1"), "PreemptionByScheduler")
# PodGC ends the pods of a node that is gone: Failed + DisruptionTarget, then deleted (the DELETED
# event's object is all that is left: the snapshot's `departed`).
LOST = disrupted(on_node(workers(2)[1], "aks-spot-0"), "DeletionByPodGC", phase="Failed")


def storage_evicted(p: dict) -> dict:
    """The kubelet's eviction of a pod past its emptyDir's sizeLimit, as it marks it
    (kubelet/eviction: Failed, reason Evicted, its message, DisruptionTarget TerminationByKubelet)."""
    p = disrupted(on_node(p, "aks-gpu-12345678-vmss000001"), "TerminationByKubelet", phase="Failed", deleting=False)
    p["status"] |= {"reason": "Evicted", "message": 'Usage of EmptyDir volume "output" exceeds the limit "20Gi". '}
    p["status"]["containerStatuses"] = [{"name": "worker", "state": {"terminated": {"exitCode": 137, "reason": "Error"}}}]
    return p


STORAGE = storage_evicted(workers(2)[1])


def sshd_refused(exit_code=126) -> dict:
    """An MPI worker whose shell could not exec sshd: its termination message says why
    (render/dtj.py's sshd script writes it)."""
    p = failed_worker(exit_code)
    p["status"]["containerStatuses"][0]["state"]["terminated"]["message"] = (
        f"{render_dtj.SSHD_EXEC_FAILED}: the kernel refused it (exit {exit_code}), most likely a file "
        "capability beyond NET_BIND_SERVICE\n")
    return p
RULES = {"failurePolicy": {"rules": [
    {"action": "FailJob", "onExitCodes": {"operator": "In", "values": [42]}},
    {"action": "RestartGangAndIgnoreBackoffLimit", "onExitCodes": {"containerName": "worker", "operator": "In", "values": [3]}},
    {"action": "RestartGang", "onFailureReasons": ["Preempted"]},
    {"action": "FailJob", "onExitCodes": {"operator": "NotIn", "values": [1, 3, 42, 137]}}]}}

FAILURES = [
    # (id, spec, pods besides worker 0, departed, phase, cause, counted or None for Failed, reason)
    ("exit code counts", {}, [failed_worker()], [], "Starting", "Error", True, "GangRestart"),
    ("OOMKilled counts", {}, [failed_worker(137, "OOMKilled")], [], "Starting", "OOMKilled", True, "GangRestart"),
    ("an eviction does not count", {}, [EVICTED], [], "Starting", "Evicted", False, "GangRestart"),
    ("a preemption does not count", {}, [PREEMPTED], [], "Starting", "Preempted", False, "GangRestart"),
    ("filling an emptyDir past its sizeLimit counts", {}, [STORAGE], [], "Starting", "StorageLimit", True, "GangRestart"),
    ("an sshd the kernel will not exec counts", {}, [sshd_refused()], [], "Starting", "SshdNotExecutable", True, "GangRestart"),
    ("rule: SshdNotExecutable fails the job", {"failurePolicy": {"rules": [
        {"action": "FailJob", "onFailureReasons": ["SshdNotExecutable"]}]}}, [sshd_refused(127)], [], "Failed",
     "SshdNotExecutable", None, "FailurePolicy"),
    ("a vanished worker without a trace is PodDeleted", {}, [], [], "Starting", "PodDeleted", False, "GangRestart"),
    ("a lost node is NodeLost, its node named", {}, [], [LOST], "Starting", "NodeLost", False, "GangRestart"),
    ("a lost node on a spot pool is a SpotEviction", {"nodePool": SPOT}, [], [LOST], "Starting", "SpotEviction", False, "GangRestart"),
    ("rule: exit 42 fails the job", RULES, [failed_worker(42)], [], "Failed", "Error", None, "FailurePolicy"),
    ("rule: exit 3 of worker does not count", RULES, [failed_worker(3)], [], "Starting", "Error", False, "GangRestart"),
    ("rule: a preemption counts", RULES, [PREEMPTED], [], "Starting", "Preempted", True, "GangRestart"),
    ("rule: NotIn matches other codes", RULES, [failed_worker(2)], [], "Failed", "Error", None, "FailurePolicy"),
    ("rule: NotIn leaves listed codes to the default", RULES, [failed_worker(1)], [], "Starting", "Error", True, "GangRestart"),
    ("onPodConditions", {"failurePolicy": {"rules": [{"action": "FailJob", "onPodConditions": [
        {"type": "DisruptionTarget", "status": "True"}]}]}}, [EVICTED], [], "Failed", "Evicted", None, "FailurePolicy"),
    ("a disruption is the cause, not the exits it caused",
     {}, [EVICTED, failed_worker(1, index=0, finished="t0")], [], "Starting", "Evicted", False, "GangRestart"),
]


@pytest.mark.parametrize("case", FAILURES, ids=[c[0] for c in FAILURES])
def test_failures_classified(case):
    _, spec, others, departed, phase, cause, counted, reason = case
    pods = [p for p in copy.deepcopy(others) if p["metadata"]["name"] == "j-worker-0"] or [workers(1)[0]]
    pods += [p for p in copy.deepcopy(others) if p["metadata"]["name"] != "j-worker-0"]
    run = {k: v for k, v in spec.items() if k != "nodePool"}
    extra = {"nodePool": spec["nodePool"]} if "nodePool" in spec else {}
    out = decide_(snap(running(runPolicy={"backoffLimit": 1, **run}, **extra), pods=pods,
                       launcher=launcher(), departed=copy.deepcopy(departed), **shared()))
    st = out.status
    assert st["phase"] == phase
    assert st["lastFailure"]["cause"] == cause
    if counted is None:
        assert reasons(st)["Failed"] == ("True", reason)
        assert "runPolicy.failurePolicy.rules[" in conditions.get_condition(st["conditions"], "Failed")["message"]
        return
    assert reasons(st)["Restarting"] == ("True", reason)
    assert st["attempt"] == 1
    assert (st["restarts"]["failures"], st["restarts"]["disruptions"]) == ((1, 0) if counted else (0, 1))
    entry = st["restarts"]["history"][-1]
    assert (entry["attempt"], entry["cause"], entry["counted"]) == (1, cause, counted)
    assert entry["pod"] == "j-worker-1" and entry["message"] == st["lastFailure"]["message"]
    message = conditions.get_condition(st["conditions"], "Restarting")["message"]
    assert message.startswith("pod j-worker-1") and "as attempt 1" in message
    if departed or entry["node"]:
        assert f"on node {entry['node']}" in message and entry["node"]
    assert st["restarts"].get("spotEvictions", 0) == (1 if cause == "SpotEviction" else 0)


def test_disruptions_never_use_up_backoff_limit():
    status = copy.deepcopy(RUNNING)
    status.update(attempt=5, restarts={"failures": 0, "disruptions": 5})
    out = decide_(snap(body(status, runPolicy={"backoffLimit": 0}), pods=[workers(1, attempt=5)[0],
                  disrupted(workers(2, attempt=5)[1], "EvictionByEvictionAPI")],
                  launcher=launcher(attempt=5), **shared()))
    assert (out.status["phase"], out.status["attempt"]) == ("Starting", 6)
    assert out.status["restarts"] == {"failures": 0, "disruptions": 6, "history": out.status["restarts"]["history"]}
    counted = decide_(snap(body(copy.deepcopy(status), runPolicy={"backoffLimit": 0}),
                           pods=[workers(1, attempt=5)[0], failed_worker(attempt=5)],
                           launcher=launcher(attempt=5), **shared()))
    assert reasons(counted.status)["Failed"] == ("True", "BackoffLimitExceeded")


def test_a_disrupted_pod_before_launch_is_recreated_not_restarted():
    pods = [workers(1, ready=False)[0], disrupted(workers(2, ready=False)[1], "PreemptionByScheduler")]
    out = decide_(snap(body({"phase": "Starting", "conditions": CREATED, "startTime": T0}), pods=pods, **shared()))
    assert out.status["attempt"] == 0 and "Restarting" not in reasons(out.status)


def test_a_disrupted_pod_that_failed_before_launch_restarts_the_gang():
    """PodGC marks a lost node's pods Failed before deleting them: a Failed pod is never reused."""
    pods = [workers(1, ready=False)[0], disrupted(workers(2, ready=False)[1], "DeletionByPodGC",
                                                  phase="Failed", deleting=False)]
    out = decide_(snap(body({"phase": "Starting", "conditions": CREATED, "startTime": T0}), pods=pods, **shared()))
    assert out.status["attempt"] == 1 and out.status["restarts"]["disruptions"] == 1


def test_history_is_bounded():
    status = copy.deepcopy(RUNNING)
    status.update(attempt=12, restarts={"failures": 0, "disruptions": 12, "history": [
        {"attempt": i, "cause": "Evicted"} for i in range(1, 13)][-jobsync.HISTORY:]})
    out = decide_(snap(body(status), pods=[workers(1, attempt=12)[0]], launcher=launcher(attempt=12),
                       **shared()))
    history = out.status["restarts"]["history"]
    assert len(history) == jobsync.HISTORY and history[-1]["attempt"] == 13
    assert history[-1]["cause"] == "PodDeleted"


# ---- status.attempt, old status.restarts ints -------------------------------------------------

def test_attempt_accessor_reads_old_and_new_status():
    assert jobsync.attempt(None) == 0
    assert jobsync.attempt({"restarts": 2}) == 2  # before status.attempt existed
    assert jobsync.attempt({"attempt": 3, "restarts": {"failures": 1, "disruptions": 2}}) == 3
    assert jobsync.restart_counts({"restarts": 2})["failures"] == 2


def test_old_int_restarts_migrate_on_the_fly_and_keep_the_attempt():
    status = copy.deepcopy(RUNNING)
    status["restarts"] = 2
    out = decide_(snap(body(status), pods=workers(2, attempt=2), launcher=launcher(attempt=2), **shared()))
    assert (out.status["attempt"], out.status["restarts"]) == (2, {"failures": 2, "disruptions": 0})
    assert out.status["phase"] == "Running" and not [a for a in summary(out.actions) if "delete" in a]


def test_restart_gang_takes_any_cause_counted_or_not():
    """The one restart path other checks call (preflight: an unhealthy node, not counted)."""
    s = snap(running(), pods=workers(2), launcher=launcher(), **shared())
    plan = model._Plan(s, CFG, NOW)
    st = model._Status(s.body["status"], 1, NOW)
    job = parse(s.body, CFG)
    failure = jobsync.Failure("j-worker-0", "worker", None, "UnhealthyNode", node="n7")
    jobsync.restart_gang(plan, job, st, failure, counted=False)
    assert (st.data["attempt"], st.data["restarts"]["failures"], st.data["restarts"]["disruptions"]) == (1, 0, 1)
    assert st.data["restarts"]["history"][-1]["cause"] == "UnhealthyNode"
    assert st.data["restarts"]["history"][-1]["counted"] is False
    assert "pod j-worker-0 on node n7 container worker (UnhealthyNode)" in \
        conditions.get_condition(st.data["conditions"], "Restarting")["message"]


# ---- nodePool.fallback --------------------------------------------------------------------------

def test_spot_evictions_move_the_next_attempt_to_the_fallback_pool():
    spec = {"nodePool": {"name": "spot", "fallback": {"name": "ondemand", "afterSpotEvictions": 1}}}
    out = decide_(snap(running(**spec), pods=workers(1), departed=[copy.deepcopy(LOST)],
                       launcher=launcher(), **shared()))
    assert out.status["restarts"]["spotEvictions"] == 1
    assert "next attempt on node pool 'ondemand'" in \
        conditions.get_condition(out.status["conditions"], "Restarting")["message"]
    again = decide_(snap(running(**spec) | {"status": out.status}, **shared()))
    assert again.status["nodePool"] == "ondemand"
    created = [a.obj for a in again.actions if type(a).__name__ == "Create"]
    assert created and all(p["spec"]["nodeSelector"][config.POOL_LABEL] == "ondemand" for p in created)
    assert config.SPOT_TOLERATION not in created[0]["spec"]["tolerations"]


@pytest.mark.parametrize("pool, field", [
    ({"name": "gpu", "fallback": {"name": "ondemand"}}, "spec.nodePool.fallback"),
    ({"name": "spot", "fallback": {"name": "nope"}}, "spec.nodePool.fallback.name"),
    ({"name": "spot", "fallback": {"name": "spot"}}, "spec.nodePool.fallback.name"),
])
def test_bad_fallback_names_the_field(pool, field):
    with pytest.raises(SpecError) as err:
        parse(body(nodePool=pool), CFG)
    assert err.value.field == field


def test_an_eviction_for_the_pods_own_storage_limit_is_the_jobs_failure():
    """Node pressure is a disruption; a pod past its own emptyDir sizeLimit (the admin's
    limits.emptyDirSizeLimit) is the job's doing: counted, the kubelet's words kept."""
    failure = jobsync.pod_failure(copy.deepcopy(STORAGE))
    assert (failure.cause, failure.disruption) == ("StorageLimit", False)
    assert failure.describe() == ("pod j-worker-1 on node aks-gpu-12345678-vmss000001 container worker exited "
                                  "with code 137 (Error): StorageLimit: Usage of EmptyDir volume \"output\" "
                                  "exceeds the limit \"20Gi\".")
    assert jobsync.action_for(failure, ())[0] == jobsync.RESTART
    pressure = copy.deepcopy(STORAGE)
    pressure["status"]["message"] = "The node was low on resource: ephemeral-storage. "
    assert jobsync.pod_failure(pressure).cause == "Evicted"


def test_a_worker_whose_sshd_cannot_be_executed_names_the_cause_and_the_fix():
    """A stock image's sshd with a file capability beyond NET_BIND_SERVICE: the worker's shell
    exits 126 and says why in its termination message; the failure names it. Exit 126 without
    that message (the job's own program) stays an Error."""
    failure = jobsync.pod_failure(sshd_refused())
    assert (failure.cause, failure.exit_code, failure.disruption) == ("SshdNotExecutable", 126, False)
    assert failure.describe().startswith(
        "pod j-worker-1 on node aks-gpu-12345678-vmss000001 container worker exited with code 126 (Error): "
        "SshdNotExecutable: trainop: the image's /usr/sbin/sshd could not be executed: the kernel refused it")
    assert jobsync.pod_failure(failed_worker(126)).cause == "Error"


def test_a_container_killed_by_an_eviction_is_still_a_disruption():
    p = disrupted(failed_worker(137), "EvictionByEvictionAPI", phase="Failed", deleting=False)
    failure = jobsync.pod_failure(p)
    assert (failure.cause, failure.exit_code, failure.disruption) == ("Evicted", 137, True)
    assert failure.describe() == ("pod j-worker-1 on node aks-gpu-12345678-vmss000001 container worker "
                                  "exited with code 137 (Error): Evicted")
    assert jobsync.action_for(failure, ())[0] == jobsync.RESTART_UNCOUNTED


# ---- a node lost under the gang (issue 24) ------------------------------------------------------

GPU_NODE = "aks-gpu-12345678-vmss000001"
LOST_NODES = {GPU_NODE: {"name": GPU_NODE, "since": "2026-11-27T10:00:00Z",
                         "message": "Kubelet stopped posting node status."}}


def node(ready: str) -> dict:
    return {"metadata": {"name": GPU_NODE}, "status": {"conditions": [
        {"type": "MemoryPressure", "status": "Unknown"},
        {"type": "Ready", "status": ready, "reason": "NodeStatusUnknown", "lastTransitionTime": T0}]}}


def test_only_a_node_the_lifecycle_controller_judged_unknown_is_lost():
    """Ready False is the kubelet's own report (a containerd restart): it still ends its pods."""
    assert jobsync.node_lost(node("Unknown"))["lastTransitionTime"] == T0
    assert jobsync.node_lost(node("False")) is None
    assert jobsync.node_lost(node("True")) is None
    assert jobsync.node_lost({"metadata": {"name": GPU_NODE}}) is None


def test_a_worker_on_a_lost_node_restarts_the_gang_at_once_uncounted():
    """The pod still says Running (nobody reports for a dead kubelet): the Node's verdict is
    enough, without waiting for the taint manager's eviction 300 s later."""
    pods = [workers(1)[0], on_node(workers(2)[1], GPU_NODE)]
    out = decide_(snap(running(runPolicy={"backoffLimit": 0}), pods=pods, launcher=launcher(),
                       lost_nodes=copy.deepcopy(LOST_NODES), **shared()))
    st = out.status
    assert (st["phase"], st["attempt"]) == ("Starting", 1)
    assert (st["restarts"]["failures"], st["restarts"]["disruptions"]) == (0, 1)
    entry = st["restarts"]["history"][-1]
    assert (entry["cause"], entry["counted"], entry["pod"], entry["node"]) == ("NodeLost", False, "j-worker-1", GPU_NODE)
    message = conditions.get_condition(st["conditions"], "Restarting")["message"]
    assert message.startswith(f"pod j-worker-1 on node {GPU_NODE} container worker: NodeLost (NodeStatusUnknown): "
                              f"the node is lost (Ready Unknown since 2026-11-27T10:00:00Z: Kubelet stopped posting "
                              f"node status.)"), message
    assert "not counted against backoffLimit (0 of 0 used)" in message


def test_a_launcher_on_a_lost_node_is_a_lost_node_too():
    launcher_pod = on_node(pod("j-launcher-x1", role="launcher", index=None), GPU_NODE)
    out = decide_(snap(running(), pods=[*workers(2), launcher_pod], launcher=launcher(),
                       lost_nodes=copy.deepcopy(LOST_NODES), **shared()))
    assert out.status["lastFailure"]["pod"] == "j-launcher-x1"
    assert out.status["lastFailure"]["cause"] == "NodeLost"


def test_a_lost_node_on_a_spot_pool_is_a_spot_eviction():
    pods = [workers(1)[0], on_node(workers(2)[1], GPU_NODE)]
    out = decide_(snap(spot_body(copy.deepcopy(RUNNING)), pods=pods, launcher=launcher(),
                       lost_nodes=copy.deepcopy(LOST_NODES), **shared()))
    assert out.status["lastFailure"]["cause"] == "SpotEviction"
    assert out.status["restarts"]["spotEvictions"] == 1


def test_a_worker_on_a_lost_node_before_launch_restarts_the_gang():
    """It would never become Ready, and its name is held until it is gone."""
    pods = [workers(1, ready=False)[0], on_node(workers(2, ready=False)[1], GPU_NODE)]
    out = decide_(snap(body({"phase": "Starting", "conditions": CREATED, "startTime": T0}), pods=pods,
                       lost_nodes=copy.deepcopy(LOST_NODES), **shared()))
    assert (out.status["attempt"], out.status["restarts"]["disruptions"]) == (1, 1)


def test_a_finished_gang_is_not_restarted_for_a_node_lost_since():
    done = decide_(snap(running(), pods=[workers(1)[0], on_node(workers(2)[1], GPU_NODE)],
                        launcher=launcher(outcome="Complete"), lost_nodes=copy.deepcopy(LOST_NODES), **shared()))
    assert done.status["phase"] == "Succeeded"
    ended = on_node(pod("j-worker-1", index=1, phase="Succeeded", exit_code=0), GPU_NODE)
    torchrun = decide_(snap(running(launcher="torchrun"), pods=[workers(1)[0], ended],
                            lost_nodes=copy.deepcopy(LOST_NODES), **shared()))
    assert "Restarting" not in reasons(torchrun.status)


def test_the_previous_attempts_pods_on_a_lost_node_are_force_deleted():
    """Terminating or not: a dead kubelet never confirms, and the next attempt needs the names.
    The rest of the old gang is deleted as usual (its grace period: the SIGTERM save)."""
    status = copy.deepcopy(RUNNING)
    status.update(attempt=1, restarts={"failures": 0, "disruptions": 1})
    stale = [on_node(workers(1)[0], "aks-gpu-12345678-vmss000000"),
             on_node(pod("j-worker-1", index=1, deleting=True), GPU_NODE),
             on_node(pod("j-launcher-x1", role="launcher", index=None), GPU_NODE)]
    out = decide_(snap(body(status), pods=stale, launcher=launcher(), lost_nodes=copy.deepcopy(LOST_NODES),
                       **shared()))
    deletes = {(a.ref.name, a.grace_seconds) for a in out.actions if isinstance(a, Delete)}
    assert deletes == {("j-launcher", None), ("j-worker-0", None), ("j-worker-1", 0), ("j-launcher-x1", 0)}
    assert out.status["phase"] == "Starting" and not any(isinstance(a, Create) for a in out.actions)
    # once the node is back (or the pods gone), a Terminating pod is simply waited for
    again = decide_(snap(body(copy.deepcopy(status)), pods=stale[1:2], **shared()))
    assert not [a for a in again.actions if isinstance(a, Delete)]
