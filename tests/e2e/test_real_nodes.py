"""The real nodes themselves: AKS-shaped, GPUs advertised through the kubelet's device-plugin API,
pod networking across nodes, Services through kube-proxy, cluster DNS (also a headless Service's
per-pod names, which the launcher resolves), and `kubectl logs` through the kubelet."""

from __future__ import annotations

import pytest

from tests.e2e.conftest import OPERATOR_IMAGE
from tests.fixtures.waiting import wait_until

pytestmark = pytest.mark.real

# CoreDNS serves a pod's name once it has seen the EndpointSlice that lists it ready: the test
# waits for that slice, and the probe still retries for a while (CoreDNS's own watch lags it).
PROBE = """
import os, socket, time, urllib.request
print("gpus", os.environ.get("NVIDIA_VISIBLE_DEVICES"))
deadline = time.monotonic() + 30
while True:
    try:
        print("peer", socket.gethostbyname("server-0.peers.{ns}.svc.cluster.local"))
        break
    except socket.gaierror:
        if time.monotonic() > deadline:
            raise
        time.sleep(0.5)
print("service", urllib.request.urlopen("http://web.{ns}.svc.cluster.local/", timeout=10).status)
socket.create_connection(("kubernetes.default.svc.cluster.local", 443), timeout=10)
print("apiserver ok")
"""


def test_nodes_are_aks_shaped_and_advertise_gpus(real_cluster):
    nodes = {n["metadata"]["labels"]["agentpool"]: n for n in real_cluster.get("nodes")["items"]}
    assert set(nodes) == {"system", "gpu"}
    gpu = nodes["gpu"]
    assert gpu["metadata"]["labels"]["node.kubernetes.io/instance-type"] == "Standard_NC96ads_A100_v4"
    assert gpu["metadata"]["labels"]["kubernetes.azure.com/accelerator"] == "nvidia"
    assert {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"} in gpu["spec"]["taints"]
    assert gpu["status"]["allocatable"]["nvidia.com/gpu"] == "4"
    assert "nvidia.com/gpu" not in nodes["system"]["status"]["allocatable"]
    for node in nodes.values():
        assert "kwok.x-k8s.io/node" not in node["metadata"].get("annotations", {})
        assert node["status"]["nodeInfo"]["containerRuntimeVersion"].startswith("containerd://")


def test_pod_network_dns_services_and_devices(real_cluster, real_namespace):
    ns = real_namespace
    server = {"apiVersion": "v1", "kind": "Pod",
              "metadata": {"name": "server-0", "labels": {"app": "web"}},
              "spec": {"hostname": "server-0", "subdomain": "peers",
                       "nodeSelector": {"agentpool": "system"},
                       "containers": [{"name": "web", "image": OPERATOR_IMAGE, "imagePullPolicy": "Never",
                                       "command": ["python", "-m", "http.server", "8000"],
                                       "readinessProbe": {"tcpSocket": {"port": 8000}, "periodSeconds": 1}}]}}
    services = [{"apiVersion": "v1", "kind": "Service", "metadata": {"name": "peers"},
                 "spec": {"clusterIP": "None", "selector": {"app": "web"}, "ports": [{"port": 8000}]}},
                {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "web"},
                 "spec": {"selector": {"app": "web"}, "ports": [{"port": 80, "targetPort": 8000}]}}]
    real_cluster.apply([server, *services], ns)
    wait_until(lambda: real_cluster.kubectl("wait", "-n", ns, "--for=condition=Ready", "pod/server-0",
                                            "--timeout=5s", check=False).returncode == 0,
               timeout=180, what="server-0 Ready")

    def published():
        slices = real_cluster.get("endpointslices", "-n", ns, "-l", "kubernetes.io/service-name=peers")["items"]
        return any(ep.get("hostname") == "server-0" and (ep.get("conditions") or {}).get("ready")
                   for sl in slices for ep in sl.get("endpoints") or [])
    wait_until(published, timeout=60, what="server-0 in the headless Service's EndpointSlice")
    client = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "client"},
              "spec": {"restartPolicy": "Never", "nodeSelector": {"agentpool": "gpu"},
                       "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
                       "containers": [{"name": "probe", "image": OPERATOR_IMAGE, "imagePullPolicy": "Never",
                                       "command": ["python", "-c", PROBE.format(ns=ns)],
                                       "resources": {"limits": {"nvidia.com/gpu": 2}}}]}}
    real_cluster.apply(client, ns)
    phase = wait_until(lambda: real_cluster.get("pod", "client", "-n", ns)["status"].get("phase")
                       in ("Succeeded", "Failed") and real_cluster.get("pod", "client", "-n", ns)["status"]["phase"],
                       timeout=180, what="the probe pod to finish")
    log = real_cluster.logs(ns, "client")
    assert phase == "Succeeded", log
    server_ip = real_cluster.get("pod", "server-0", "-n", ns)["status"]["podIP"]
    lines = dict(line.split(" ", 1) for line in log.splitlines())
    assert len(lines["gpus"].split(",")) == 2 and lines["gpus"].startswith("nvidia-com-gpu-")
    assert lines["peer"] == server_ip
    assert lines["service"] == "200"
    assert lines["apiserver"] == "ok"
    real_cluster.assert_ran_on_real_nodes(ns, "app=web")
