"""InfiniBand pod shaping and the preflight fabric check (issue 17, items 3 and 4): the renderer
(render/fabric.py), the configuration, the report as untrusted input and the pairwise search
(preflight.py), and jobsync's decisions on a report: a slow node found, tainted, and an
uncounted restart. Tables, no cluster: tests/e2e/test_preflight.py runs the check on real pods."""

from __future__ import annotations

import copy
import datetime as dt
import json

import pytest

from tests.unit.test_jobsync_decide import NOW, RUNNING, T0, body, cond, launcher, pod, progress, shared, snap
from trainop import config, preflight
from trainop.actions import TaintNode
from trainop.config import ConfigError
from trainop.jobsync import decide
from trainop.render import dtj, fabric
from trainop.spec import parse

IB_POOL = {"nodeSelector": {"kubernetes.azure.com/agentpool": "ndv5"}, "infiniband": True,
           "instanceType": "Standard_ND96isr_H100_v5", "preflightMinBusBandwidthGBps": 150}


BLOB = {"blob": {"accountURL": "https://a.blob.core.windows.net", "container": "results",
                 "auth": {"sasSecretRef": {"name": "s", "key": "sas"}}}}


def cfg(**sections) -> config.Config:
    return config.from_dict({"nodePools": {"ndv5": IB_POOL, "system": {"nodeSelector": {"kubernetes.azure.com/agentpool": "system"}}},
                             "defaultNodePools": {"cpu": "system", "gpu": "ndv5", "infiniband": "ndv5"},
                             **sections})


def job(c: config.Config | None = None, **spec):
    spec.setdefault("workers", 2)
    b = {"apiVersion": "trainop.io/v1alpha1", "kind": "DistributedTrainingJob",
         "metadata": {"name": "j", "namespace": "ns"}, "spec": spec}
    return parse(b, c or cfg())


def container(pod_spec: dict, name: str, init: bool = False) -> dict:
    return next(c for c in pod_spec["initContainers" if init else "containers"] if c["name"] == name)


def env(c: dict) -> dict:
    return {e["name"]: e.get("value") for e in c["env"]}


# ---- InfiniBand -------------------------------------------------------------------------------

def test_infiniband_pods_get_the_topology_file_of_the_pools_vm_size_one_fabric_and_memlock():
    j = job(gpusPerWorker=8, infiniband=True, launcher="mpi")
    worker = dtj.render_worker(j, 1, attempt=0)["spec"]
    main = container(worker, "worker")
    # NCCL_TOPO_FILE from infiniband.topologyFiles, read from the node, only nodes of that size
    assert env(main)["NCCL_TOPO_FILE"] == "/opt/microsoft/ndv5-topo.xml"
    assert {"name": "nccl-topology", "hostPath": {"path": "/opt/microsoft/ndv5-topo.xml", "type": "File"}} in worker["volumes"]
    assert {"name": "nccl-topology", "mountPath": "/opt/microsoft/ndv5-topo.xml", "readOnly": True} in main["volumeMounts"]
    assert worker["nodeSelector"] == {"kubernetes.azure.com/agentpool": "ndv5",
                                      "node.kubernetes.io/instance-type": "Standard_ND96isr_H100_v5"}
    # every worker on one value of the fabric label
    (term,) = worker["affinity"]["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert term == {"labelSelector": {"matchLabels": {"trainop.io/job-name": "j", "trainop.io/role": "worker"}},
                    "topologyKey": "kubernetes.azure.com/agentpool"}
    # sshd (whose children are the ranks) and the launcher start after the memlock raise
    assert main["command"][2].startswith(fabric.MEMLOCK_PREAMBLE)
    launch = dtj.render_launcher(j, attempt=0)["spec"]["template"]["spec"]
    assert container(launch, "launcher")["command"][2].startswith(fabric.MEMLOCK_PREAMBLE)
    assert "affinity" not in launch  # the launcher needs no fabric
    # no IPC_LOCK by default: a non-root rank could not use it (docs/security.md); the MPI
    # worker's NET_BIND_SERVICE (for a stock image's setcap sshd) stays
    assert main["securityContext"] == {"allowPrivilegeEscalation": False,
                                       "capabilities": {"drop": ["ALL"], "add": ["NET_BIND_SERVICE"]}}


def test_ipc_lock_only_where_the_admin_asks_and_never_on_the_log_shipper():
    j = job(cfg(infiniband={"ipcLock": True}), gpusPerWorker=8, infiniband=True, output=BLOB)
    worker = dtj.render_worker(j, 0, attempt=0)["spec"]
    assert container(worker, "worker")["securityContext"]["capabilities"] == {
        "drop": ["ALL"], "add": ["NET_BIND_SERVICE", "IPC_LOCK"]}
    assert container(worker, "logship", init=True)["securityContext"]["capabilities"] == {"drop": ["ALL"]}


def test_jobs_without_infiniband_get_none_of_it():
    j = job(cfg(), gpusPerWorker=0, nodePool={"name": "system"})
    worker = dtj.render_worker(j, 0, attempt=0)["spec"]
    main = container(worker, "worker")
    assert "NCCL_TOPO_FILE" not in env(main) and "affinity" not in worker
    assert not main["command"][2].startswith(fabric.MEMLOCK_PREAMBLE)
    assert "initContainers" not in worker
    assert "publishNotReadyAddresses" not in dtj.render_service(j)["spec"]


def test_a_topology_file_from_the_image_needs_no_mount():
    """No hostPath: the job's namespace can stay baseline or restricted."""
    j = job(cfg(infiniband={"topologyFilesFrom": "image"}), gpusPerWorker=8, infiniband=True,
            preflight={"enabled": True})
    worker = dtj.render_worker(j, 0, attempt=0)["spec"]
    assert env(container(worker, "worker"))["NCCL_TOPO_FILE"] == "/opt/microsoft/ndv5-topo.xml"
    assert not [v for v in worker["volumes"] if "hostPath" in v]
    assert [m["name"] for m in container(worker, "preflight", init=True)["volumeMounts"]] == ["shm"]


def test_an_unknown_vm_size_gets_no_topology_file():
    c = config.from_dict({"nodePools": {"ib": {**IB_POOL, "instanceType": "Standard_ND40rs_v2"}},
                          "defaultNodePools": {"cpu": None, "gpu": "ib", "infiniband": "ib"}})
    j = job(c, gpusPerWorker=8, infiniband=True)
    assert j.topology_file is None
    assert "NCCL_TOPO_FILE" not in env(container(dtj.render_worker(j, 0, 0)["spec"], "worker"))


@pytest.mark.parametrize("section, message", [
    ({"infiniband": {"topologyFiles": {"Standard_ND96asr_v4": "ndv4-topo.xml"}}}, "infiniband.topologyFiles"),
    ({"infiniband": {"socketTransport": "ignore"}}, "infiniband.socketTransport: must be warn or fail"),
    ({"infiniband": {"topologyFilesFrom": "blob"}}, "infiniband.topologyFilesFrom"),
    ({"preflight": {"sizeMB": 0}}, "preflight.sizeMB"),
    ({"nodePools": {"ib": {**IB_POOL, "preflightMinBusBandwidthGBps": -1}}}, "nodePools.ib.preflightMinBusBandwidthGBps"),
])
def test_configuration_errors_name_the_key(section, message):
    with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
        config.from_dict(section)


# ---- the preflight container ------------------------------------------------------------------

def test_preflight_runs_in_every_worker_before_training_with_the_workers_gpus():
    j = job(gpusPerWorker=8, infiniband=True, preflight={"enabled": True})
    assert j.preflight.min_busbw == 150  # the pool's threshold
    for i in range(2):
        worker = dtj.render_worker(j, i, attempt=0)["spec"]
        pre = container(worker, "preflight", init=True)
        main = container(worker, "worker")
        assert pre["resources"] == main["resources"] == {"limits": {"nvidia.com/gpu": 8, "rdma/ib": 1}}
        assert pre["image"] == "trainop/trainer-pytorch:0.1.0"  # images.pytorch, whatever spec.image is
        script = pre["command"][2]
        assert f"--node-rank={i}" in script and "--nproc-per-node=8" in script
        assert f"--master-addr={dtj.host(j, 0)}" in script and "--master-port=29401" in script
        assert "--min-busbw 150.0" in script and "--result-file /dev/termination-log" in script
        assert env(pre)["NCCL_TOPO_FILE"] == "/opt/microsoft/ndv5-topo.xml"
    # worker 0 resolves while no worker is Ready yet
    assert dtj.render_service(j)["spec"]["publishNotReadyAddresses"] is True


def test_the_specs_threshold_wins_and_the_admin_picks_the_image():
    j = job(cfg(preflight={"image": "registry.example/preflight:1"}), gpusPerWorker=8,
            preflight={"enabled": True, "minBusBandwidthGBps": 40})
    pre = container(dtj.render_worker(j, 0, 0)["spec"], "preflight", init=True)
    assert "--min-busbw 40.0" in pre["command"][2] and pre["image"] == "registry.example/preflight:1"


def test_the_preflight_comes_after_the_log_shipper():
    j = job(gpusPerWorker=8, preflight={"enabled": True}, output=BLOB)
    worker = dtj.render_worker(j, 0, attempt=0)["spec"]
    assert [c["name"] for c in worker["initContainers"]] == ["logship", "preflight"]


# ---- the report, checked as untrusted input ---------------------------------------------------

GOOD = {"busBandwidthGBps": 12.5, "minBusBandwidthGBps": 150, "passed": False, "sizeBytes": 67108864,
        "worldSize": 32, "workers": 4, "backend": "nccl", "transport": "IB",
        "pairs": [{"workers": [0, 1], "busBandwidthGBps": 180.0}, {"workers": [1, 2], "busBandwidthGBps": 9.0},
                  {"workers": [2, 3], "busBandwidthGBps": 8.5}, {"workers": [0, 3], "busBandwidthGBps": 175.0}]}


def test_a_report_parses_and_junk_does_not():
    rep = preflight.parse(json.dumps(GOOD), workers=4)
    assert rep.busbw == 12.5 and rep.transport == "IB" and len(rep.pairs) == 4
    for bad in ["", "not json", "[1]", json.dumps({**GOOD, "passed": "yes"}),
                json.dumps({**GOOD, "busBandwidthGBps": float("nan")}),
                json.dumps({**GOOD, "pairs": [{"workers": [0, 7], "busBandwidthGBps": 1}]}),  # not a worker of the gang
                json.dumps({**GOOD, "pairs": [{"workers": [1, 1], "busBandwidthGBps": 1}]}),
                "x" * 5000]:
        assert preflight.parse(bad, workers=4) is None, bad
    assert preflight.parse(json.dumps({**GOOD, "transport": "rm -rf"}), 4).transport == "unknown"


@pytest.mark.parametrize("pairs, expected", [
    ({(0, 1): 180, (1, 2): 9, (2, 3): 8.5, (0, 3): 175}, 2),      # worker 2 slow in both its pairs
    ({(0, 1): 180, (1, 2): 170, (2, 3): 160, (0, 3): 5}, None),   # a link, not a node: 0 and 3 each pass once
    ({(0, 1): 1, (1, 2): 2, (2, 3): 3, (0, 3): 4}, None),         # everything slow: the fabric or the threshold
    ({(0, 1): 5}, None),                                          # two workers: cannot tell which
    ({(0, 1): 5, (1, 2): 5, (0, 2): 200}, 1),                     # three workers
    ({}, None),
])
def test_the_pairwise_search_names_the_one_worker_slow_in_every_pair(pairs, expected):
    found = preflight.suspect(tuple(preflight.Pair(k, v) for k, v in pairs.items()), threshold=150)
    assert found == expected


# ---- decisions: a slow node found -> taint + uncounted restart --------------------------------

def preflight_pods(report: dict, n: int = 4, exit_code: int = 1, attempt: int = 0) -> list[dict]:
    """n workers stuck in Init whose preflight ended: worker 0 carries the report."""
    out = []
    for i in range(n):
        p = pod(f"j-worker-{i}", index=i, attempt=attempt, phase="Failed" if exit_code else "Running",
                ready=not exit_code)
        p["spec"]["nodeName"] = f"aks-ndv5-{i}"
        term = {"exitCode": exit_code, "reason": "Error" if exit_code else "Completed", "finishedAt": T0}
        if i == 0:
            term["message"] = json.dumps(report)
        p["status"]["initContainerStatuses"] = [{"name": "preflight", "state": {"terminated": term}}]
        out.append(p)
    return out


def fabric_job(status=None, backoff=0, **spec):
    spec = {"workers": 4, "gpusPerWorker": 8, "infiniband": True, "launcher": "torchrun",
            "preflight": {"enabled": True}, "runPolicy": {"backoffLimit": backoff}, **spec}
    return body(copy.deepcopy(status if status is not None else STARTING), **spec)


STARTING = {"phase": "Starting", "startTime": T0, "restarts": 0, "conditions": cond(
    ("Created", True, "ChildrenCreated"), ("Admitted", True, "QuotaReserved"),
    ("WorkersReady", False, "WaitingForWorkers"))}
TAINTING = cfg(preflight={"taintUnhealthyNodes": True})


def test_a_slow_node_is_tainted_and_the_restart_is_not_counted():
    out = decide(snap(fabric_job(), pods=preflight_pods(GOOD), **shared()), TAINTING, NOW)
    assert TaintNode("aks-ndv5-2", preflight.TAINT, limit=2) in out.actions  # preflight.maxTaintedNodes
    assert preflight.TAINT == {"key": "trainop.io/unhealthy", "value": "preflight", "effect": "NoSchedule"}
    st = out.status
    assert (st["attempt"], st["restarts"]["disruptions"], st["restarts"]["unhealthyNodes"], st["phase"]) == \
        (1, 1, 1, "Starting")  # backoffLimit 0, still restarts
    assert st["restarts"]["history"][-1]["cause"] == "UnhealthyNode"
    pre = st["preflight"]
    assert (pre["passed"], pre["suspectWorker"], pre["suspectNode"], pre["tainted"]) == (False, 2, "aks-ndv5-2", True)
    assert pre["busBandwidthGBps"] == 12.5 and pre["minBusBandwidthGBps"] == 150 and len(pre["pairs"]) == 4
    restarting = next(c for c in st["conditions"] if c["type"] == "Restarting")
    assert "not counted against backoffLimit" in restarting["message"]
    assert "worker 2 (node aks-ndv5-2) was slow in every pair" in restarting["message"]
    assert st["lastFailure"]["container"] == "preflight" and st["lastFailure"]["reason"] == "FabricCheckFailed"


def test_the_next_attempt_counts_again_from_what_was_counted():
    """Two counted restarts used plus one uncounted: a backoffLimit of 2 is used up."""
    status = {**copy.deepcopy(STARTING), "attempt": 3,
              "restarts": {"failures": 2, "disruptions": 1, "unhealthyNodes": 1}}
    pods = preflight_pods(GOOD, attempt=3)
    for p in pods:
        p["status"]["initContainerStatuses"] = []  # the preflight passed; a worker failed later
    pods[1]["status"]["containerStatuses"] = [{"name": "worker", "state": {"terminated": {"exitCode": 1, "reason": "Error"}}}]
    out = decide(snap(fabric_job(status, backoff=2), pods=pods, **shared()), TAINTING, NOW)
    assert out.status["phase"] == "Failed"
    assert "runPolicy.backoffLimit=2 restarts used" in next(
        c["message"] for c in out.status["conditions"] if c["type"] == "Failed")


def test_without_tainting_the_restart_counts_and_names_the_node():
    out = decide(snap(fabric_job(), pods=preflight_pods(GOOD), **shared()), cfg(), NOW)
    assert not [a for a in out.actions if isinstance(a, TaintNode)]
    assert out.status["phase"] == "Failed"  # backoffLimit 0: a counted restart is not left
    failed = next(c for c in out.status["conditions"] if c["type"] == "Failed")
    assert failed["reason"] == "BackoffLimitExceeded"
    assert "node aks-ndv5-2" in failed["message"] and "preflight.taintUnhealthyNodes is false" in failed["message"]
    assert out.status["preflight"]["tainted"] is False


def test_at_the_clusters_cap_the_slow_node_is_not_tainted_and_status_says_so():
    """Issue 22 M5: preflight.maxTaintedNodes (2) nodes carry the taint already (counted from
    the nodes, the snapshot's tainted_nodes): no TaintNode, a counted restart, and
    status.preflight.tainted false with the cap's words. A suspect already tainted is no new
    taint: the uncounted restart stays."""
    full = ("aks-ndv5-7", "aks-ndv5-9")
    out = decide(snap(fabric_job(), pods=preflight_pods(GOOD), tainted_nodes=full, **shared()), TAINTING, NOW)
    assert not [a for a in out.actions if isinstance(a, TaintNode)]
    assert out.status["phase"] == "Failed"  # backoffLimit 0: the restart counts
    failed = next(c for c in out.status["conditions"] if c["type"] == "Failed")
    assert "node not tainted (2 node(s) already carry trainop.io/unhealthy (aks-ndv5-7, aks-ndv5-9), " \
           "the cluster's cap preflight.maxTaintedNodes=2" in failed["message"]
    assert out.status["preflight"]["tainted"] is False
    again = decide(snap(fabric_job(), pods=preflight_pods(GOOD), tainted_nodes=("aks-ndv5-2", "aks-ndv5-9"),
                        **shared()), TAINTING, NOW)
    assert again.status["preflight"]["tainted"] is True and again.status["restarts"]["unhealthyNodes"] == 1


def test_no_single_slow_worker_means_a_counted_restart_and_no_taint():
    report = {**GOOD, "pairs": [{"workers": [0, 1], "busBandwidthGBps": 9.0}, {"workers": [1, 2], "busBandwidthGBps": 9.0},
                                {"workers": [2, 3], "busBandwidthGBps": 9.0}, {"workers": [0, 3], "busBandwidthGBps": 9.0}]}
    out = decide(snap(fabric_job(backoff=1), pods=preflight_pods(report), **shared()), TAINTING, NOW)
    assert not [a for a in out.actions if isinstance(a, TaintNode)]
    assert (out.status["attempt"], out.status["restarts"]["failures"],
            out.status["restarts"].get("unhealthyNodes")) == (1, 1, None)
    assert "no single worker was slow in every pair" in out.status["preflight"]["message"]


def test_uncounted_restarts_stop_after_one_per_worker():
    status = {**copy.deepcopy(STARTING), "attempt": 4,
              "restarts": {"failures": 0, "disruptions": 4, "unhealthyNodes": 4}}
    out = decide(snap(fabric_job(status, backoff=0), pods=preflight_pods(GOOD, attempt=4), **shared()), TAINTING, NOW)
    assert not [a for a in out.actions if isinstance(a, TaintNode)]
    assert out.status["phase"] == "Failed"
    assert out.status["preflight"]["message"].endswith("node not tainted (4 uncounted restarts were used)")
    assert out.status["preflight"]["tainted"] is False


def test_a_report_naming_no_worker_of_the_gang_taints_nothing():
    """The node comes from the operator's own pod, never from the report: a report that names
    a worker outside the gang is refused as a whole."""
    report = {**GOOD, "pairs": [{"workers": [0, 9], "busBandwidthGBps": 1.0}], "suspectNode": "kube-system-node"}
    out = decide(snap(fabric_job(backoff=1), pods=preflight_pods(report), **shared()), TAINTING, NOW)
    assert not [a for a in out.actions if isinstance(a, TaintNode)]
    assert "preflight" not in out.status  # not a report: an ordinary (counted) failure
    assert (out.status["attempt"], out.status["restarts"]["failures"]) == (1, 1)
    assert out.status["lastFailure"]["container"] == "preflight"


def test_a_worker_whose_preflight_ended_first_waits_for_worker_0s_verdict():
    """Seen on real pods: worker 1's container ended a moment before worker 0's, whose report
    carries the verdict. The operator waits for it (bounded), then judges it as usual."""
    pods = preflight_pods(GOOD, exit_code=1)
    just_now = "2026-05-01T11:59:50Z"  # NOW - 10 s
    for p in pods[1:]:
        p["status"]["initContainerStatuses"][0]["state"]["terminated"]["finishedAt"] = just_now
    pods[0]["status"] = {"phase": "Pending", "initContainerStatuses": [{"name": "preflight", "state": {"running": {}}}]}
    out = decide(snap(fabric_job(), pods=pods, **shared()), TAINTING, NOW)
    assert not [a for a in out.actions if isinstance(a, TaintNode)]
    assert (out.status.get("attempt", 0), out.status["phase"]) == (0, "Starting") and "lastFailure" not in out.status
    assert out.requeue_after == 50 and "waiting up to 50s for worker 0's" in out.waiting

    pods[0] = preflight_pods(GOOD, exit_code=1)[0]  # worker 0 ends: its verdict decides
    out = decide(snap(fabric_job(), pods=pods, **shared()), TAINTING, NOW)
    assert TaintNode("aks-ndv5-2", preflight.TAINT, limit=2) in out.actions  # preflight.maxTaintedNodes and out.status["restarts"]["unhealthyNodes"] == 1

    late = dt.datetime(2026, 5, 1, 12, 1, 0, tzinfo=dt.timezone.utc)  # 70 s on, still no report
    pods[0] = {**pods[0], "status": {"phase": "Pending", "initContainerStatuses": [{"name": "preflight", "state": {"running": {}}}]}}
    out = decide(snap(fabric_job(), pods=pods, **shared()), TAINTING, late)
    assert out.status["phase"] == "Failed" and out.status["lastFailure"]["pod"] == "j-worker-1"  # ordinary, counted


# ---- decisions: a passing check, the transport -----------------------------------------------

PASSED = {**GOOD, "busBandwidthGBps": 182.0, "passed": True}
PASSED.pop("pairs")


def test_a_passing_check_is_shown_and_training_goes_on():
    out = decide(snap(fabric_job(), pods=preflight_pods(PASSED, exit_code=0), **shared()), TAINTING, NOW)
    assert out.status["preflight"]["passed"] is True and out.status["preflight"]["busBandwidthGBps"] == 182.0
    assert out.status["phase"] == "Running" and out.status.get("attempt", 0) == 0
    transport = next(c for c in out.status["conditions"] if c["type"] == "Transport")
    assert (transport["status"], transport["reason"]) == ("True", "IB")
    assert not [a for a in out.actions if isinstance(a, TaintNode)]


def test_sockets_on_an_infiniband_job_warn_once_or_fail_if_the_admin_says_so():
    socket = {**PASSED, "transport": "Socket"}
    s = snap(fabric_job(), pods=preflight_pods(socket, exit_code=0), **shared())
    out = decide(s, cfg(), NOW)
    transport = next(c for c in out.status["conditions"] if c["type"] == "Transport")
    assert (transport["status"], transport["reason"]) == ("False", "Socket")
    assert [e for e in out.events if e[:2] == ("Warning", "Socket")]
    again = decide(snap(fabric_job(out.status), pods=preflight_pods(socket, exit_code=0), **shared()), cfg(), NOW)
    assert not [e for e in again.events if e[1] == "Socket"]  # once per transition
    failed = decide(s, cfg(infiniband={"socketTransport": "fail"}), NOW)
    assert failed.status["phase"] == "Failed"
    assert next(c for c in failed.status["conditions"] if c["type"] == "Failed")["reason"] == "SocketTransport"


def test_gloo_on_a_cpu_job_is_the_expected_socket_transport():
    report = {**PASSED, "backend": "gloo", "transport": "Socket"}
    b = body(copy.deepcopy(STARTING), workers=4, gpusPerWorker=0, launcher="torchrun",
             nodePool={"name": "system"}, preflight={"enabled": True})
    out = decide(snap(b, pods=preflight_pods(report, exit_code=0), **shared()), cfg(), NOW)
    transport = next(c for c in out.status["conditions"] if c["type"] == "Transport")
    assert (transport["status"], transport["reason"]) == ("True", "Socket")
    assert "Gloo uses TCP sockets" in transport["message"]


def test_running_jobs_without_preflight_are_untouched():
    out = decide(snap(body(copy.deepcopy(RUNNING)), pods=[pod("j-worker-0", index=0), pod("j-worker-1", index=1)],
                      launcher=launcher(), **shared()), TAINTING, NOW)
    assert "preflight" not in out.status and not any(c["type"] == "Transport" for c in out.status["conditions"])


# ---- decisions: the transport the trainer reports during training --------------------------

def training(progress_text: str, status: dict | None = None, c=None, launcher_=None, **spec):
    """A running IB job (torchrun, Blob output) whose log shipper reported `progress_text`."""
    spec = {"workers": 2, "gpusPerWorker": 8, "infiniband": True, "launcher": "torchrun", "output": BLOB,
            "runPolicy": {"backoffLimit": 2}, **spec}
    b = body(copy.deepcopy(status if status is not None else RUNNING), **spec)
    workers = [pod(f"j-worker-{i}", index=i) for i in range(2)]
    return decide(snap(b, pods=workers, launcher=launcher_, **shared(), progress=progress(progress_text)),
                  c or cfg(), NOW)


def transport_condition(status: dict) -> dict | None:
    return next((c for c in status["conditions"] if c["type"] == "Transport"), None)


def test_the_trainers_transport_sets_the_condition_while_training():
    out = training('{"step": 100, "transport": "IB"}')
    cond_ = transport_condition(out.status)
    assert (cond_["status"], cond_["reason"]) == ("True", "IB") and "the trainer's report" in cond_["message"]
    assert out.status["metrics"] == {"step": 100, "transport": "IB"} and out.status["phase"] == "Running"


def test_sockets_reported_by_the_trainer_warn_once_or_fail_this_job():
    out = training('{"step": 100, "transport": "Socket"}')
    cond_ = transport_condition(out.status)
    assert (cond_["status"], cond_["reason"]) == ("False", "Socket") and out.status["phase"] == "Running"
    assert [e for e in out.events if e[:2] == ("Warning", "Socket")]
    again = training('{"step": 200, "transport": "Socket"}', status=out.status)
    assert not [e for e in again.events if e[1] == "Socket"]  # once per transition
    failed = training('{"step": 100, "transport": "Socket"}', c=cfg(infiniband={"socketTransport": "fail"}))
    assert failed.status["phase"] == "Failed"
    assert next(c for c in failed.status["conditions"] if c["type"] == "Failed")["reason"] == "SocketTransport"
    assert [a for a in failed.actions if getattr(a, "ref", None) is not None]  # the gang is stopped


def test_the_trainers_word_overrides_the_preflights_and_junk_is_ignored():
    """The preflight saw IB; training itself runs on sockets: what training uses wins."""
    passed = {**PASSED, "transport": "IB"}
    b = fabric_job(copy.deepcopy(RUNNING), workers=2, output=BLOB)
    s = snap(b, pods=preflight_pods(passed, n=2, exit_code=0), **shared(),
             progress=progress('{"step": 1, "transport": "Socket"}'))
    assert transport_condition(decide(s, cfg(), NOW).status)["reason"] == "Socket"
    for junk in ('{"transport": "RDMA"}', '{"transport": ["IB"]}', '{"transport": "Socket", "x": NaN'):
        assert transport_condition(training(junk).status) is None  # no valid word: no condition


def test_a_finished_job_is_not_failed_for_its_transport():
    fail = cfg(infiniband={"socketTransport": "fail"})
    done = training('{"final": true, "transport": "Socket"}', c=fail, launcher="mpi",
                    launcher_=launcher(outcome="Complete"))
    assert done.status["phase"] == "Succeeded"
    running = training('{"step": 1, "transport": "Socket"}', c=fail, launcher="mpi", launcher_=launcher())
    assert running.status["phase"] == "Failed"  # the same report while it runs


def test_the_memlock_preamble_raises_the_soft_limit_to_the_hard_one_and_says_when_it_is_not_unlimited():
    """Run by /bin/sh (dash on the trainer images), as a rank's shell runs it: no capability is
    needed to raise the soft limit up to the hard one."""
    import subprocess

    script = f"ulimit -S -l 64\n{fabric.MEMLOCK_PREAMBLE}echo $(ulimit -S -l) $(ulimit -H -l)\n"
    done = subprocess.run(["/bin/sh", "-c", script], capture_output=True, text=True, check=True)
    soft, hard = done.stdout.split()
    assert soft == hard
    assert ("LimitMEMLOCK=infinity" in done.stderr) == (hard != "unlimited")


def preflight_shell(tmp_path, torchrun_body: str) -> tuple[list[str], dict, object]:
    """The rendered preflight script under /bin/sh, with stand-ins for what the image and the
    cluster provide (torchrun, getent) and a file in place of /dev/termination-log."""
    import os

    bin_ = tmp_path / "bin"
    bin_.mkdir()
    for name, text in (("torchrun", torchrun_body), ("getent", "exit 0")):
        (bin_ / name).write_text("#!/bin/sh\n" + text + "\n")
        (bin_ / name).chmod(0o755)
    result = tmp_path / "termination-log"
    result.write_text("")  # the kubelet creates it empty
    script = fabric.preflight_script(job(preflight={"enabled": True}), 1, "j-worker-0.j") \
        .replace(fabric.TERMINATION_LOG, str(result))
    env = dict(os.environ, PATH=f"{bin_}:{os.environ['PATH']}", RESULT=str(result))
    return ["/bin/sh", "-c", script], env, result


@pytest.mark.parametrize("body, code", [
    ("""printf '{"busBandwidthGBps":0.4,"passed":false}' > "$RESULT"; exit 1""", fabric.PREFLIGHT_EXIT_SLOW),
    ("""printf '{"busBandwidthGBps":9.5,"passed":true}' > "$RESULT"; exit 0""", 0),
    ("exit 1", 1),  # the rendezvous failed: no verdict, torchrun's own code
])
def test_the_preflight_container_exits_with_the_slow_code_although_torchrun_says_1(tmp_path, body, code):
    """torchrun exits 1 whatever its ranks return (seen in real pods: tests/e2e/test_preflight.py),
    so the container's code comes from the verdict its first process wrote."""
    import subprocess

    cmd, env, _ = preflight_shell(tmp_path, body)
    assert subprocess.run(cmd, env=env, timeout=30).returncode == code


def test_the_preflight_container_passes_sigterm_on_to_torchrun(tmp_path):
    import signal
    import subprocess
    import time

    started, mark = tmp_path / "started", tmp_path / "got-term"
    cmd, env, _ = preflight_shell(tmp_path, f"trap 'touch {mark}; exit 143' TERM\ntouch {started}\nsleep 30 & wait")
    proc = subprocess.Popen(cmd, env=env)
    deadline = time.monotonic() + 10
    while not started.exists():  # the stand-in runs, its trap set
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=10) == 143
    assert mark.exists()


# issue 22 M5: the cluster's cap on tainted nodes, counted from the nodes themselves
def test_taint_is_refused_once_the_cap_of_tainted_nodes_is_reached():
    from trainop import preflight

    def node(name, *keys):
        return {"metadata": {"name": name}, "spec": {"taints": [{"key": k, "effect": "NoSchedule"} for k in keys]}}
    key = preflight.TAINT["key"]
    nodes = [node("a", key), node("b", "other"), node("c")]
    assert preflight.carrying(nodes, key) == ["a"]
    assert preflight.taint_refused(preflight.carrying(nodes, key), key, 2) is None
    why = preflight.taint_refused(preflight.carrying(nodes + [node("d", key)], key), key, 2)
    assert why.startswith(f"2 node(s) already carry {key} (a, d), the cluster's cap preflight.maxTaintedNodes=2")
