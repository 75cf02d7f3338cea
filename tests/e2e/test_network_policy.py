"""NetworkPolicy is enforced on the real nodes (kube-router's network policy controller): real TCP
connections between pods are admitted or refused as networking.k8s.io/v1 policies say, both across
nodes (routed through the host) and between pods on one node's bridge."""

from __future__ import annotations

import subprocess

import pytest

from tests.e2e.conftest import OPERATOR_IMAGE
from tests.fixtures.waiting import wait_until
from trainop.devcluster import nodes

pytestmark = pytest.mark.real

PORT = 8000
GPU_TOLERATION = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
# Exit status 0 only when the TCP handshake completes; a REJECT (refused) or a DROP (timeout) fail.
CONNECT = "import socket, sys; socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=3)"


def pod(name: str, labels: dict, pool: str, command: list[str], **extra) -> dict:
    spec = {"nodeSelector": {"agentpool": pool}, "terminationGracePeriodSeconds": 0,
            "containers": [{"name": "main", "image": OPERATOR_IMAGE, "imagePullPolicy": "Never",
                            "command": command, **extra}]}
    if pool == "gpu":
        spec["tolerations"] = [GPU_TOLERATION]
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": labels}, "spec": spec}


def ingress_policy(allowed_from: list[dict]) -> dict:
    """Only these peers may reach the server's port (an empty list admits nobody)."""
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy", "metadata": {"name": "server-ingress"},
            "spec": {"podSelector": {"matchLabels": {"app": "server"}}, "policyTypes": ["Ingress"],
                     "ingress": [{"from": allowed_from, "ports": [{"protocol": "TCP", "port": PORT}]}]
                     if allowed_from else []}}


def test_network_policy_admits_and_refuses_real_connections(real_cluster, real_namespace):
    ns = real_namespace
    idle = ["python", "-c", "import time; time.sleep(1e9)"]
    real_cluster.apply([
        pod("server", {"app": "server"}, "system", ["python", "-m", "http.server", str(PORT)],
            readinessProbe={"tcpSocket": {"port": PORT}, "periodSeconds": 1}),
        # One client on the other node (routed through the host), one beside the server (bridged).
        pod("trainer", {"role": "trainer"}, "gpu", idle),
        pod("intruder", {"role": "intruder"}, "system", idle),
    ], ns)
    for name in ("server", "trainer", "intruder"):
        wait_until(lambda name=name: real_cluster.kubectl("wait", "-n", ns, "--for=condition=Ready", f"pod/{name}",
                                                          "--timeout=5s", check=False).returncode == 0,
                   timeout=180, what=f"{name} Ready")
    pods = {p["metadata"]["name"]: p for p in real_cluster.get("pods", "-n", ns)["items"]}
    assert pods["trainer"]["spec"]["nodeName"] != pods["server"]["spec"]["nodeName"]
    assert pods["intruder"]["spec"]["nodeName"] == pods["server"]["spec"]["nodeName"]
    server_ip = pods["server"]["status"]["podIP"]

    def connects(client: str) -> bool:
        probe = real_cluster.kubectl("exec", "-n", ns, client, "--", "python", "-c", CONNECT, server_ip, str(PORT),
                                     check=False)
        return probe.returncode == 0

    # No policy: every pod may connect.
    assert connects("trainer") and connects("intruder")

    # A policy that admits nobody: both are refused once the controller has synced.
    real_cluster.apply(ingress_policy([]), ns)
    wait_until(lambda: not connects("trainer") and not connects("intruder"), timeout=60,
               what="both clients refused by the deny-all ingress policy")

    # The policy admits pods labelled role=trainer: that one connects again, the other stays refused.
    real_cluster.apply(ingress_policy([{"podSelector": {"matchLabels": {"role": "trainer"}}}]), ns)
    wait_until(lambda: connects("trainer"), timeout=60, what="the admitted client connecting again")
    assert not connects("intruder")
    # The kubelet's probes come from the host, which policies never block (as on any cluster).
    assert real_cluster.get("pod", "server", "-n", ns)["status"]["containerStatuses"][0]["ready"]

    # Deleting the policy restores the default: everyone admitted.
    real_cluster.kubectl("delete", "networkpolicy", "server-ingress", "-n", ns)
    wait_until(lambda: connects("intruder"), timeout=60, what="the other client admitted once the policy is gone")


def test_machine_boundary_comes_before_the_policy_controller(real_cluster):
    """kube-router ACCEPTs admitted traffic at the top of filter's FORWARD, egress off the machine
    included; the boundary (pod traffic stays among this machine's pods) must therefore be decided
    first, in mangle's FORWARD. Checked on the rules, since no test may send traffic off the machine."""
    def rules(*table: str, chain: str) -> list[str]:
        return subprocess.run(["iptables", *table, "-S", chain], capture_output=True, text=True,
                              check=True).stdout.splitlines()

    assert rules("-t", "mangle", chain="FORWARD")[1] == f"-A FORWARD -j {nodes.FORWARD_CHAIN}"
    assert rules("-t", "mangle", chain=nodes.FORWARD_CHAIN)[1:] == [
        f"-A {nodes.FORWARD_CHAIN} -s {nodes.POD_NETWORK} -d {nodes.POD_NETWORK} -j RETURN",
        f"-A {nodes.FORWARD_CHAIN} -s {nodes.POD_NETWORK} -j DROP",
        f"-A {nodes.FORWARD_CHAIN} -d {nodes.POD_NETWORK} -j DROP"]
    assert "-j KUBE-ROUTER-FORWARD" in rules(chain="FORWARD")[1]
