"""(f) Pod Security: a namespace labelled `pod-security.kubernetes.io/enforce=restricted` admits
and runs every pod of a job (workers, launcher, log-shipping sidecar), non-root with all
capabilities dropped. An InfiniBand job cannot be admitted there: the API server's own Pod
Security admission names the one field that blocks it (the IPC_LOCK capability RDMA needs)."""

from __future__ import annotations

import pytest
import yaml

from tests.e2e.test_real_pods import digests, reduced, wait_phase, with_blob_output
from tests.fixtures.cluster import fresh_namespace
from trainop import config, spec
from trainop.render import dtj as render_dtj

pytestmark = [pytest.mark.real, pytest.mark.azurite]

RESTRICTED = {"pod-security.kubernetes.io/enforce": "restricted", "pod-security.kubernetes.io/warn": "restricted"}


@pytest.fixture
def restricted_namespace(real_cluster, request):
    yield from fresh_namespace(real_cluster, request, labels=RESTRICTED)


@pytest.fixture
def restricted_operator(real_cluster, restricted_namespace, tmp_path):
    from tests.fixtures.cluster import OperatorProcess

    op = OperatorProcess(real_cluster, [restricted_namespace], tmp_path / "operator.log").start()
    yield op
    op.stop()


def test_job_pods_run_under_the_restricted_profile(real_cluster, restricted_namespace, restricted_operator,
                                                    pod_azurite):
    ns = restricted_namespace
    manifest = reduced("pytorch-horovod-synthetic.yaml", "strict")
    with_blob_output(manifest, real_cluster, ns, pod_azurite)
    real_cluster.apply(manifest, ns)
    wait_phase(real_cluster, ns, "strict", "Succeeded")
    pods = real_cluster.assert_ran_on_real_nodes(ns, "trainop.io/job-name=strict")
    assert {p["metadata"]["labels"]["trainop.io/role"] for p in pods} == {"launcher", "worker"}
    for pod in pods:
        assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
        for container in pod["spec"]["containers"] + pod["spec"].get("initContainers", []):
            assert container["securityContext"]["capabilities"]["drop"] == ["ALL"]
    ranks = digests(real_cluster.logs(ns, "job/strict-launcher", "-c", "launcher"))
    assert sorted(ranks) == [0, 1] and len(set(ranks.values())) == 1


def test_infiniband_worker_is_refused_naming_the_capability(real_cluster, restricted_namespace):
    manifest = yaml.safe_load((reduced.__globals__["EXAMPLES"] / "infiniband-pytorch-horovod.yaml").read_text())
    manifest["metadata"] = {"name": "ib", "namespace": restricted_namespace}
    job = spec.parse(manifest, config.load())
    pod = render_dtj.render_worker(job, 0, 0)
    out = real_cluster.kubectl("create", "--dry-run=server", "-f", "-", input=yaml.safe_dump(pod), check=False)
    assert out.returncode != 0
    assert 'violates PodSecurity "restricted:latest"' in out.stderr
    assert 'non-default capabilities (container "worker" must not include "IPC_LOCK"' in out.stderr, out.stderr
