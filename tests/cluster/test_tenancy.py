"""Multi-tenant safety of DistributedTrainingJobs (issue 15), against the real API server: each
test is the attack or the mistake, and shows it refused with the field named, or contained."""

from __future__ import annotations

import json

import pytest

from tests.cluster.test_dtj import Api, manifest
from tests.cluster.test_quota import make_quota
from tests.fixtures.waiting import wait_until

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(240)]


@pytest.fixture
def api(cluster, namespace):
    return Api(cluster, namespace)


@pytest.fixture
def op(operator_factory):
    return operator_factory()


@pytest.mark.parametrize("which, key", [("limits", "nvidia.com/gpu"), ("requests", "rdma/ib")])
def test_gpus_cannot_hide_in_resources(cluster, namespace, api, which, key):
    """100 workers with gpusPerWorker 0 and a GPU limit of 8 would hold 800 GPUs that
    status.gpus, quotas and maxGpusPerJob never count: the API server refuses the job."""
    bad = manifest("hide", workers=100, gpusPerWorker=0, resources={which: {key: 8}})
    result = cluster.kubectl("apply", "-n", namespace, "-f", "-", check=False, input=json.dumps(bad))
    assert result.returncode != 0
    assert f"spec.resources.{which}" in result.stderr and "spec.gpusPerWorker" in result.stderr
    assert api.job("hide") is None
    fine = manifest("fine", resources={which: {"cpu": "2", "memory": "4Gi", "hugepages-2Mi": "1Gi"}})
    assert cluster.kubectl("apply", "-n", namespace, "-f", "-", check=False,
                           input=json.dumps(fine)).returncode == 0


def test_a_child_the_api_server_refuses_fails_the_job_and_frees_its_quota(cluster, namespace, api, op):
    """CPU requests above the limits: the API server refuses the pods (422). The job fails naming
    spec.resources, instead of retrying forever while it holds its place in the quota."""
    make_quota(api, gpus=8)
    cluster.apply(manifest("bad", resources={"requests": {"cpu": "8"}, "limits": {"cpu": "4"}}),
                  namespace)
    status = api.wait_phase("bad", "Failed")
    cond = api.condition("bad", "Failed")
    assert cond["reason"] == "ChildRejected", status
    assert cond["message"].startswith("spec.resources: the API server refused Pod bad-worker-0")
    assert "must be less than or equal to cpu limit" in cond["message"]
    # The Event is posted after the status patch that made the job Failed: wait for it.
    wait_until(lambda: "Warning/ChildRejected" in api.event_reasons("bad"), timeout=30,
               what="the ChildRejected Warning event")
    assert not api.pods("bad")
    cluster.apply(manifest("next"), namespace)  # the same 8 GPUs: free again
    api.wait_running("next")


def test_a_job_made_again_never_adopts_the_pods_of_its_namesake(cluster, namespace, api, op):
    """Children are matched by their owner's uid, not by the job-name label: pods left by an
    earlier job of the same name (orphaned here; terminating ones look the same) are not this
    job's workers, and their names are a conflict it reports, not an adoption."""
    cluster.apply(manifest("again"), namespace)
    old_launcher = api.wait_running("again")
    old = {p.metadata.name: p.metadata.uid for p in api.pods("again")}
    cluster.kubectl("delete", "dtj", "again", "-n", namespace, "--cascade=orphan")
    wait_until(lambda: api.job("again") is None, timeout=30, what="the first job gone")
    cluster.apply(manifest("again"), namespace)
    cond = wait_until(lambda: (c := api.condition("again", "Created")) and c["reason"] == "NameConflict" and c,
                      timeout=60, what="NameConflict on the new job")
    assert "not controlled by" in cond["message"]
    status = api.status("again")
    assert status["phase"] == "Pending" and "Running" not in {
        c["type"] for c in status["conditions"] if c["status"] == "True"}
    assert {p.metadata.name: p.metadata.uid for p in api.pods("again")} == old  # untouched
    assert api.core.read_namespaced_pod(old_launcher.metadata.name, namespace).status.phase == "Running"


def _selector(match_labels: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(match_labels.items()))


def test_a_jobs_pods_admit_only_the_jobs_own_pods(cluster, namespace, api, op):
    """sshd and the torchrun rendezvous are closed to every pod but the job's own: a
    NetworkPolicy selects all of the job's pods (launcher included: Open MPI's daemons call
    mpirun back) and admits only them. Here the real API server accepts the policy and its
    selectors pick exactly the right pods; tests/e2e proves the traffic on real nodes. A
    deleted policy is put back."""
    for name, launcher in (("mine", "mpi"), ("other", "torchrun")):
        cluster.apply(manifest(name, launcher=launcher), namespace)
        api.wait_running(name) if launcher == "mpi" else api.wait_phase(name, "Running")
    policy = cluster.get("networkpolicy", "mine", "-n", namespace)
    # Egress too: by default jobNetwork.deniedEgressCIDRs holds link-local (IMDS, WireServer)
    assert policy["spec"]["policyTypes"] == ["Ingress", "Egress"]
    own, dns, rest = policy["spec"]["egress"]
    assert own["to"] == [{"podSelector": policy["spec"]["podSelector"]}] and {p["port"] for p in dns["ports"]} == {53}
    assert "169.254.0.0/16" in rest["to"][0]["ipBlock"]["except"]
    (rule,) = policy["spec"]["ingress"]
    assert "ports" not in rule  # every port between the job's pods: NCCL/Gloo rings, MPI daemons
    (peer,) = rule["from"]
    assert set(peer) == {"podSelector"}  # no namespaceSelector: this namespace only

    def picked(selector: dict) -> set[str]:
        pods = cluster.get("pods", "-n", namespace, "-l", _selector(selector["matchLabels"]))["items"]
        return {p["metadata"]["name"] for p in pods}

    mine = {p.metadata.name for p in api.pods("mine")}
    assert len(mine) == 3 and picked(policy["spec"]["podSelector"]) == mine == picked(peer["podSelector"])
    assert not picked(peer["podSelector"]) & {p.metadata.name for p in api.pods("other")}
    assert cluster.get("networkpolicy", "other", "-n", namespace)["spec"]["podSelector"] == \
        {"matchLabels": {"trainop.io/job-name": "other"}}
    cluster.kubectl("delete", "networkpolicy", "mine", "-n", namespace)
    wait_until(lambda: cluster.kubectl("get", "networkpolicy", "mine", "-n", namespace, check=False).returncode == 0,
               timeout=30, what="the NetworkPolicy put back")
