"""Faults of the control plane on a control plane of this module's own (real etcd,
kube-apiserver, controller-manager, scheduler; KWOK capacity; an audit log of every write,
WRITES_ONLY, each counted by the user agent that sent it):

- test_the_jobs_live_through: bench/chaos.py's faults, each injected into a ramp of a few jobs
  (the same code as the bench), asserting the outcome (every job Running again, nothing created
  twice, no job lost, no restart counted against a user's backoffLimit, no pod made anew, no
  operator ERROR line), not the time;
- test_standby_takes_over_a_ramp_when_the_leader_is_killed: two replicas, one Lease (leader.py):
  only the leader writes, the standby keeps its caches warm and takes over when the leader is
  killed in the middle of a ramp of 100 jobs (the control-plane benchmark's shape), and no child
  is made twice (`trainop/<POD_ID>_<suffix>` user agents, kube.configure). Its figures are
  printed (`-s`) and recorded in docs/benchmarks.md, "Leader election".

The operator killed mid-ramp with one replica is test_dtj.py::test_operator_restart_mid_creation_creates_no_duplicates.
"""

from __future__ import annotations

import datetime as dt
import json
import signal
import time
from collections import Counter
from pathlib import Path

import pytest
from kubernetes import client as k8s
from kubernetes import config as kube_config
from kubernetes.client.exceptions import ApiException

from bench.chaos import chaos_cluster, run_fault
from tests.fixtures.cluster import ClusterHandle, OperatorProcess
from tests.fixtures.waiting import wait_until
from trainop.jobsync.failures import attempt

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(600)]

JOBS = 4  # per fault
FAULTS = ["apiserver", "etcd", "freeze", "controller-manager", "progress", "upgrade"]
LEADER_JOBS = 100
GROUP, VERSION, PLURAL = "trainop.io", "v1alpha1", "distributedtrainingjobs"
WRITES = {"create", "update", "patch", "delete", "deletecollection"}


@pytest.fixture(scope="module")
def chaos(tmp_path_factory):
    state = tmp_path_factory.mktemp("chaos")
    # every fault's namespace and the leader's ramp keep their nodes
    dev = chaos_cluster(state, JOBS * len(FAULTS) + LEADER_JOBS)
    try:
        dev.up(timeout=600, crds=True)
        handle = ClusterHandle(dev)
        assert not handle.crd_errors
        yield handle
    finally:
        dev.down()


@pytest.mark.parametrize("fault", FAULTS)
def test_the_jobs_live_through(chaos, fault, tmp_path):
    api = kube_config.new_client_from_config(config_file=str(chaos.kubeconfig))
    api.user_agent = "trainop-test"
    # frozen past the operator's 30 s request timeout (every request in flight fails, every watch
    # stalls); 15 s without a controller-manager (the bench: 60 s each)
    result = run_fault(chaos.dev, api, fault, JOBS, tmp_path, down_s=3, freeze_s=35, cm_down_s=15, timeout=120)
    assert result["back"] == JOBS and not result["lost"], result
    assert result["created_twice"] == [], result
    assert result["counted_restarts"] == 0, result
    assert result["new_pods"] == [], result
    assert result["error_lines"] == [], result


def _when(stamp: str) -> float:
    return dt.datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


def writes(audit_log: Path) -> list[dict]:
    out = []
    with audit_log.open() as f:
        for line in f:
            event = json.loads(line)
            if event.get("verb") in WRITES and event.get("stage") == "ResponseComplete":
                event.setdefault("objectRef", {})
                event.setdefault("userAgent", "")
                out.append(event)
    return out


def lease(custom_api: k8s.CoordinationV1Api, namespace: str) -> dict:
    try:
        return custom_api.read_namespaced_lease("trainop", namespace).spec.to_dict()
    except ApiException as exc:
        if exc.status == 404:
            return {}
        raise


def test_standby_takes_over_a_ramp_when_the_leader_is_killed(chaos, tmp_path):
    cluster = chaos
    api = cluster.api_client()
    api.user_agent = "trainop-test"  # not either replica's
    core, custom, coord = k8s.CoreV1Api(api), k8s.CustomObjectsApi(api), k8s.CoordinationV1Api(api)
    ns = "ramp"
    core.create_namespace({"metadata": {"name": ns}})
    wait_until(lambda: core.list_namespaced_service_account(ns, field_selector="metadata.name=default").items,
               timeout=30, what="ServiceAccount default")

    def replica(name: str) -> OperatorProcess:
        return OperatorProcess(cluster, [ns], tmp_path / f"{name}.log",
                               extra_args=["--lease", "trainop", "--lease-namespace", ns],
                               env={"POD_ID": name}).start()

    first = replica("replica-a")
    holder = wait_until(lambda: lease(coord, ns).get("holder_identity"), timeout=60,
                        what="replica-a holding the Lease")
    assert holder.startswith("replica-a_")
    second = replica("replica-b")  # healthy: its caches are filled, it stands by
    try:
        started = time.time()
        for i in range(LEADER_JOBS):
            custom.create_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, {
                "apiVersion": f"{GROUP}/{VERSION}", "kind": "DistributedTrainingJob",
                "metadata": {"name": f"j{i:03d}"}, "spec": {"workers": 2, "gpusPerWorker": 4}})

        def phases() -> Counter:
            items = custom.list_namespaced_custom_object(GROUP, VERSION, ns, PLURAL)["items"]
            return Counter((j.get("status") or {}).get("phase") for j in items)

        # mid-ramp: a quarter of the jobs Running, the rest still on their way
        at_kill = wait_until(lambda: (c := phases())["Running"] >= LEADER_JOBS // 4 and c, timeout=240,
                             what="a quarter of the jobs Running")
        first.stop(signal.SIGKILL)
        killed = time.time()
        new = wait_until(lambda: (spec := lease(coord, ns)).get("holder_identity", "").startswith("replica-b_")
                         and spec, timeout=60, what="replica-b holding the Lease")
        wait_until(lambda: phases()["Running"] == LEADER_JOBS, timeout=300, what=f"all {LEADER_JOBS} jobs Running")
        done = time.time()

        # duplicates: each job has exactly its own children, each child was created once
        pods = core.list_namespaced_pod(ns, label_selector="trainop.io/job-name").items
        per_job = Counter((p.metadata.labels["trainop.io/job-name"], p.metadata.labels.get("trainop.io/role"))
                          for p in pods)
        launcher_jobs = k8s.BatchV1Api(api).list_namespaced_job(ns).items
        items = custom.list_namespaced_custom_object(GROUP, VERSION, ns, PLURAL)["items"]
        events = writes(cluster.dev.audit_log)
        created = Counter((e["objectRef"].get("resource"), e["objectRef"].get("name"))
                          for e in events if e["verb"] == "create" and e["objectRef"].get("namespace") == ns
                          and e["objectRef"].get("resource") != "events"  # (generateName: named by the server)
                          and (e.get("responseStatus") or {}).get("code") == 201
                          and e["userAgent"].startswith("trainop/"))
        agent_a = f"trainop/{holder}"
        agent_b = f"trainop/{new['holder_identity']}"
        takeover = min(_when(e["requestReceivedTimestamp"]) for e in events
                       if e["userAgent"] == agent_b and e["objectRef"].get("resource") != "leases")
        standby_writes = [e for e in events if e["userAgent"] == agent_b
                          and _when(e["requestReceivedTimestamp"]) < new["acquire_time"].timestamp()]
        kopf_writes = [e for e in events if e["userAgent"].startswith("kopf/")]
        by_a = sum(e["userAgent"] == agent_a for e in events)
        by_b = sum(e["userAgent"] == agent_b for e in events)
        figures = {
            "jobs_running_at_kill": at_kill["Running"], "kill_after_s": round(killed - started, 1),
            "lease_acquired_after_kill_s": round(new["acquire_time"].timestamp() - killed, 1),
            "first_write_after_kill_s": round(takeover - killed, 1),
            "all_running_after_kill_s": round(done - killed, 1),
            "writes_by_leader_a": by_a, "writes_by_b_after_takeover": by_b,
            "writes_by_b_while_standby": len(standby_writes), "writes_by_kopf": len(kopf_writes),
            "children_created_twice": sum(n > 1 for n in created.values()),
            "gang_restarts": sum(attempt(j.get("status")) for j in items),
        }
        print("\nleader figures:", json.dumps(figures))
        (Path(__file__).parent.parent.parent / ".cache").mkdir(exist_ok=True)
        (Path(__file__).parent.parent.parent / ".cache" / "leader-figures.json").write_text(json.dumps(figures))

        assert standby_writes == [], standby_writes[:3]
        assert kopf_writes == [], kopf_writes[:3]
        assert [k for k, n in created.items() if n > 1] == []
        # each job: its 2 workers, once each (the launcher Job's pod is the Job controller's)
        assert {n for (_, role), n in per_job.items() if role == "worker"} == {2}
        assert len({job for job, _ in per_job}) == LEADER_JOBS
        assert len(launcher_jobs) == LEADER_JOBS
        assert figures["gang_restarts"] == 0
        assert by_a > 0 and by_b > 0  # both led in turn
        assert figures["lease_acquired_after_kill_s"] < 15 + 2 + 2  # expiry + a retry + slack
    finally:
        second.stop()
        first.stop()
