"""NetworkPolicy is enforced on the real nodes (kube-router's network policy controller): real TCP
connections between pods are admitted or refused as networking.k8s.io/v1 policies say, both across
nodes (routed through the host) and between pods on one node's bridge; and the operator's own
per-job policy (render/dtj.py) closes a job's sshd and rendezvous ports to other jobs' pods."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml

from tests.e2e.conftest import OPERATOR_IMAGE
from tests.fixtures.waiting import wait_until
from trainop import config, spec
from trainop.devcluster import nodes
from trainop.render import dtj

pytestmark = pytest.mark.real

PORT = 8000
GPU_TOLERATION = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
# Exit status 0 only when the TCP handshake completes; a REJECT (refused) or a DROP (timeout) fail.
CONNECT = "import socket, sys; socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=3)"
# Accepts TCP connections on every port given (stands in for sshd and the torchrun rendezvous).
LISTEN = """
import socket, sys, threading
def serve(port):
    sock = socket.create_server(("", port))
    while True:
        sock.accept()[0].close()
for port in sys.argv[1:]:
    threading.Thread(target=serve, args=(int(port),)).start()
"""
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


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


IDLE = ["python", "-c", "import time; time.sleep(1e9)"]


def start(cluster, namespace: str, pods: list[dict]) -> dict[str, dict]:
    """Create the pods, wait until all are Ready; return them by name."""
    cluster.apply(pods, namespace)
    for name in (p["metadata"]["name"] for p in pods):
        wait_until(lambda name=name: cluster.kubectl("wait", "-n", namespace, "--for=condition=Ready", f"pod/{name}",
                                                     "--timeout=5s", check=False).returncode == 0,
                   timeout=180, what=f"{name} Ready")
    return {p["metadata"]["name"]: p for p in cluster.get("pods", "-n", namespace)["items"]}


def can_connect(cluster, namespace: str, client: str, ip: str, port: int) -> bool:
    """A real TCP handshake from inside the client pod (kubectl exec through its kubelet)."""
    probe = cluster.kubectl("exec", "-n", namespace, client, "--", "python", "-c", CONNECT, ip, str(port), check=False)
    return probe.returncode == 0


def test_network_policy_admits_and_refuses_real_connections(real_cluster, real_namespace):
    ns = real_namespace
    pods = start(real_cluster, ns, [
        pod("server", {"app": "server"}, "system", ["python", "-m", "http.server", str(PORT)],
            readinessProbe={"tcpSocket": {"port": PORT}, "periodSeconds": 1}),
        # One client on the other node (routed through the host), one beside the server (bridged).
        pod("trainer", {"role": "trainer"}, "gpu", IDLE),
        pod("intruder", {"role": "intruder"}, "system", IDLE),
    ])
    assert pods["trainer"]["spec"]["nodeName"] != pods["server"]["spec"]["nodeName"]
    assert pods["intruder"]["spec"]["nodeName"] == pods["server"]["spec"]["nodeName"]
    server_ip = pods["server"]["status"]["podIP"]

    def connects(client: str) -> bool:
        return can_connect(real_cluster, ns, client, server_ip, PORT)

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


def test_the_operators_job_policy_admits_only_the_jobs_own_pods(real_cluster, real_namespace):
    """The NetworkPolicy the operator makes per job (render/dtj.py), applied as rendered, over pods
    labelled as two jobs' pods: job a's launcher (other node) reaches a's worker on the sshd and
    rendezvous ports, job b's worker (same node) no longer does."""
    ns = real_namespace
    manifest = yaml.safe_load((EXAMPLES / "pytorch-torchrun-synthetic.yaml").read_text())
    job_a, job_b = (spec.parse(manifest | {"metadata": {"name": name, "namespace": ns}}, config.load())
                    for name in ("a", "b"))
    ports = [dtj.SSH_PORT, dtj.RDZV_PORT]
    pods = start(real_cluster, ns, [
        pod("a-worker-0", dtj._labels(job_a, dtj.WORKER, 0), "system",
            ["python", "-c", LISTEN, *map(str, ports)],
            readinessProbe={"tcpSocket": {"port": dtj.SSH_PORT}, "periodSeconds": 1}),
        pod("a-launcher", dtj._labels(job_a, dtj.LAUNCHER), "gpu", IDLE),
        pod("b-worker-0", dtj._labels(job_b, dtj.WORKER, 0), "system", IDLE),
    ])
    worker_ip = pods["a-worker-0"]["status"]["podIP"]

    def connects(client: str, port: int) -> bool:
        return can_connect(real_cluster, ns, client, worker_ip, port)

    assert all(connects(client, port) for client in ("a-launcher", "b-worker-0") for port in ports)
    real_cluster.apply(dtj.render_network_policy(job_a), ns)
    # kube-router's enforcement is eventually consistent: one CI run saw the launcher refused right
    # after b was (its admitted-peer set not yet holding the launcher). Wait for the end state, both
    # at once, then check the other port.
    wait_until(lambda: not connects("b-worker-0", dtj.SSH_PORT) and connects("a-launcher", dtj.SSH_PORT),
               timeout=60, what="another job's pod refused and the job's launcher admitted at the sshd port")
    assert not connects("b-worker-0", dtj.RDZV_PORT)
    assert connects("a-launcher", dtj.RDZV_PORT)


IMDS = "169.254.169.254"  # Azure's Instance Metadata Service: the node's managed identity
RESOLVE = "import socket, sys; socket.getaddrinfo(sys.argv[1], 443)"


@pytest.fixture
def imds_stand_in():
    """An HTTP server on IMDS's address and port, on this machine's loopback: the real nodes'
    network namespace (they share the host's, tests/e2e/conftest.py), so a pod reaches it the way
    a pod on AKS reaches the real IMDS, through its node. Nothing leaves the machine."""
    added = IMDS not in nodes.sh("ip", "-o", "addr", "show", "dev", "lo").stdout
    if added:
        nodes.sh("ip", "addr", "add", f"{IMDS}/32", "dev", "lo")
    server = subprocess.Popen(["python3", "-m", "http.server", "80", "--bind", IMDS],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        yield IMDS
    finally:
        server.kill()
        server.wait()
        if added:
            nodes.sh("ip", "addr", "del", f"{IMDS}/32", "dev", "lo", check=False)


def test_a_jobs_pods_cannot_reach_the_node_metadata_service(real_cluster, real_namespace, imds_stand_in):
    """Issue 22 M9: the job's NetworkPolicy (render/dtj.py, the default jobNetwork.deniedEgressCIDRs)
    keeps the job's pods from IMDS, where the node's managed identity is one GET away; a pod of no
    job still reaches it (the stand-in answers), and the job's pods still resolve names and reach
    the API server (the log shipper needs it)."""
    ns = real_namespace
    manifest = yaml.safe_load((EXAMPLES / "pytorch-torchrun-synthetic.yaml").read_text())
    job = spec.parse(manifest | {"metadata": {"name": "a", "namespace": ns}}, config.load())
    assert job.denied_egress  # the default
    start(real_cluster, ns, [pod("a-worker-0", dtj._labels(job, dtj.WORKER, 0), "system", IDLE),
                             pod("bystander", {"role": "other"}, "system", IDLE)])
    api_ip = real_cluster.get("service", "kubernetes", "-n", "default")["spec"]["clusterIP"]

    def reaches(client: str, ip: str, port: int) -> bool:
        return can_connect(real_cluster, ns, client, ip, port)

    assert reaches("a-worker-0", IMDS, 80) and reaches("bystander", IMDS, 80)  # the stand-in serves
    real_cluster.apply(dtj.render_network_policy(job), ns)
    wait_until(lambda: not reaches("a-worker-0", IMDS, 80), timeout=60, what="the job's pod refused at IMDS")
    assert reaches("bystander", IMDS, 80)
    assert reaches("a-worker-0", api_ip, 443)
    resolve = real_cluster.kubectl("exec", "-n", ns, "a-worker-0", "--", "python", "-c", RESOLVE,
                                   "kubernetes.default.svc.cluster.local", check=False)
    assert resolve.returncode == 0, resolve.stderr

    # the admin's switch: jobNetwork.deniedEgressCIDRs: [] renders no Egress rule at all
    open_job = spec.parse(manifest | {"metadata": {"name": "a", "namespace": ns}},
                          config.from_dict({"jobNetwork": {"deniedEgressCIDRs": []}}))
    real_cluster.apply(dtj.render_network_policy(open_job), ns)
    wait_until(lambda: reaches("a-worker-0", IMDS, 80), timeout=60, what="IMDS open again by the admin's switch")
