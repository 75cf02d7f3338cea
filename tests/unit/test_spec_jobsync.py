"""Pure parts of the DTJ reconcile: how a failed pod is described, and which condition changes
become Events. (The reconcile itself runs against the real API server in tests/cluster.)"""

from trainop import conditions
from trainop.jobsync import Failure, pod_failure
from trainop.jobsync.model import _events


def pod(phase, terminated=None, reason=None):
    status = {"phase": phase}
    if terminated:
        status["containerStatuses"] = [{"name": "worker", "state": {"terminated": terminated}}]
    if reason:
        status["reason"] = reason
    return {"metadata": {"name": "j1-worker-1"}, "spec": {"containers": [{"name": "worker"}]},
            "status": status}


def test_pod_failure_names_container_exit_code_and_reason():
    f = pod_failure(pod("Failed", {"exitCode": 137, "reason": "OOMKilled", "finishedAt": "t"}))
    assert f == Failure("j1-worker-1", "worker", 137, "OOMKilled", "t")
    assert f.describe() == "pod j1-worker-1 container worker exited with code 137 (OOMKilled)"
    assert f.as_status() == {"pod": "j1-worker-1", "container": "worker", "exitCode": 137,
                             "reason": "OOMKilled", "cause": "OOMKilled", "message": f.describe()}


def test_evicted_pod_without_container_state():
    f = pod_failure(pod("Failed", reason="Evicted"))
    assert (f.exit_code, f.reason) == (None, "Evicted")
    assert f.describe() == "pod j1-worker-1 container worker (Evicted)"
    assert "exitCode" not in f.as_status()


def test_healthy_and_completed_pods_are_not_failures():
    assert pod_failure(pod("Running")) is None
    assert pod_failure(pod("Succeeded", {"exitCode": 0, "reason": "Completed"})) is None


def test_events_only_for_transitions():
    old = conditions.set_condition([], "Created", True, "ChildrenCreated", "made", timestamp="t0")
    new = conditions.set_condition(old, "Created", True, "ChildrenCreated", "made")
    assert new == old  # same state: lastTransitionTime kept, nothing to write
    assert _events(old, new) == []
    new = conditions.set_condition(new, "Restarting", True, "GangRestart", "pod x died")
    assert _events(old, new) == [("Warning", "GangRestart", "pod x died")]
    again = conditions.set_condition(new, "Restarting", True, "GangRestart", "pod y died")
    assert _events(new, again) == [("Warning", "GangRestart", "pod y died")]  # every failure
    ready = conditions.set_condition(new, "WorkersReady", False, "WaitingForWorkers", "0/2")
    assert _events(new, ready) == []  # a gate that was never open closing is not news
    gone = conditions.set_condition([], "DataReady", False, "DataStageNotFound", "no such stage")
    assert _events([], gone) == [("Warning", "DataStageNotFound", "no such stage")]


def test_condition_transition_time_changes_only_with_status():
    first = conditions.set_condition([], "Running", True, "A", "m", timestamp="t0")
    flipped = conditions.set_condition(first, "Running", False, "B", "m", timestamp="t1")
    assert flipped[0]["lastTransitionTime"] == "t1"
    same = conditions.set_condition(flipped, "Running", False, "C", "other", timestamp="t2")
    assert same[0]["lastTransitionTime"] == "t1" and same[0]["reason"] == "C"
