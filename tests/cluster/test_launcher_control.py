"""Issue 25 on the API server and KWOK nodes: spec.mpirun shapes the launcher the operator
creates (image, resources, flags), and runLauncherAsWorker makes it a rank host: a worker's
GPUs (which the job's status and quota count), its own headless Service for its DNS name, the
first line of the hostfile."""

from __future__ import annotations

import pytest
from kubernetes import client as k8s

from tests.cluster.test_dtj import FAST, Api, manifest
from tests.fixtures.waiting import wait_until

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(180)]


def test_the_launcher_as_the_user_shapes_it_and_as_a_worker(cluster, namespace, operator_factory):
    operator_factory(config=FAST)
    api = Api(cluster, namespace)
    cluster.apply(manifest("own", workers=2, gpusPerWorker=1, mpirun={
        "image": "example/launcher:2", "resources": {"requests": {"cpu": "2", "memory": "1Gi"}},
        "extraArgs": ["--mca", "btl_tcp_if_include", "eth0"]}), namespace)
    cluster.apply(manifest("law", workers=2, gpusPerWorker=2, mpirun={"runLauncherAsWorker": True}), namespace)

    own = api.wait_running("own").spec.containers[0]
    assert own.image == "example/launcher:2" and own.resources.requests == {"cpu": "2", "memory": "1Gi"}
    assert "--mca btl_tcp_if_include eth0 python -m trainop_trainer" in own.command[2]

    pod = api.wait_running("law")
    assert (pod.spec.hostname, pod.spec.subdomain) == ("law-launcher", "law-launcher")
    assert pod.spec.containers[0].resources.limits["nvidia.com/gpu"] == "2"
    assert "mpirun -np 6 " in pod.spec.containers[0].command[2]
    hostfile = api.core.read_namespaced_config_map("law-mpi", namespace).data["hostfile"]
    assert hostfile.splitlines()[0] == f"law-launcher.law-launcher.{namespace}.svc slots=2"
    service = api.core.read_namespaced_service("law-launcher", namespace)
    assert service.spec.cluster_ip == "None" and service.spec.selector == {
        "trainop.io/job-name": "law", "trainop.io/role": "launcher"}
    assert api.status("law")["gpus"] == 6
    # a deleted Service comes back, as every child of a running job does
    api.core.delete_namespaced_service("law-launcher", namespace)

    wait_until(lambda: _exists(api, "law-launcher", namespace), timeout=30, what="the launcher's Service back")


def _exists(api, name: str, namespace: str) -> bool:
    try:
        api.core.read_namespaced_service(name, namespace)
        return True
    except k8s.exceptions.ApiException as exc:
        if exc.status == 404:
            return False
        raise
