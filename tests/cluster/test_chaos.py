"""The control-plane faults of bench/chaos.py, each injected into a ramp of a few jobs on a
control plane of this module's own (real etcd, kube-apiserver, controller-manager, scheduler;
KWOK nodes; an audit log of every write): the same code as the bench, asserting the outcome
(every job Running again, nothing created twice, no job lost, no restart counted against a
user's backoffLimit, no pod made anew, no operator ERROR line), not the time.

The operator killed mid-ramp and the leader killed with a standby are the bench's `operator` and
`standby` faults; their tests are test_dtj.py::test_operator_restart_mid_creation_creates_no_duplicates
and test_leader.py (100 jobs)."""

from __future__ import annotations

import pytest
from kubernetes import config as kube_config

from bench.chaos import chaos_cluster, run_fault
from tests.fixtures.cluster import ClusterHandle
from trainop.devcluster.cluster import install_crds

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]

JOBS = 4
FAULTS = ["apiserver", "etcd", "freeze", "controller-manager", "progress", "upgrade"]


@pytest.fixture(scope="module")
def chaos(tmp_path_factory):
    state = tmp_path_factory.mktemp("chaos")
    dev = chaos_cluster(state, JOBS * len(FAULTS))  # each fault's namespace keeps its nodes
    try:
        dev.up(timeout=600)
        handle = ClusterHandle(dev, crd_errors=install_crds(dev.kubeconfig))
        assert not handle.crd_errors
        api = kube_config.new_client_from_config(config_file=str(dev.kubeconfig))
        api.user_agent = "trainop-test"
        yield dev, api, state
    finally:
        dev.down()


@pytest.mark.parametrize("fault", FAULTS)
def test_the_jobs_live_through(chaos, fault):
    dev, api, state = chaos
    # frozen past the operator's 30 s request timeout (every request in flight fails, every watch
    # stalls); 15 s without a controller-manager (the bench: 60 s each)
    result = run_fault(dev, api, fault, JOBS, state, down_s=3, freeze_s=35, cm_down_s=15, timeout=120)
    assert result["back"] == JOBS and not result["lost"], result
    assert result["created_twice"] == [], result
    assert result["counted_restarts"] == 0, result
    assert result["new_pods"] == [], result
    assert result["error_lines"] == [], result
