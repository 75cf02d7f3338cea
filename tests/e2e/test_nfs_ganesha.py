"""A DataStage's provisioned NFS server (NFS-Ganesha, `datastage.server: ganesha`, the default)
serving real bytes to real pods: staged from Blob (Azurite) by the copy Job onto the server's
disk, read back over NFSv4 by pods with libnfs's user-space client (`nfs-ls`, `nfs-cat`, `nfs-cp`
from Debian's libnfs-utils, in the server's image), because this kernel has no NFS client and no
pod here can mount the PV the way a kubelet does (docs/datastage.md says what that mount needs).

Every security property is an attack carried out against the real server: a write through NFS,
a read from another namespace past the NetworkPolicy, and the same read once the policy is gone
(as on a cluster whose CNI enforces none), which the export's own client list must refuse. That
list is the DataStage's readers' addresses (no datastage.nfsClientCIDRs here): a pod that becomes
a reader is served once the running server has reloaded it, and one that stops being a reader is
refused again, without a restart of the server.

One DataStage serves the whole module (staging it is the slow part). The server's disk is a
hostPath PersistentVolume pre-bound to the StatefulSet's claim: this dev cluster has no disk
provisioner (on AKS it is an Azure Disk of the DataStage's storage class).

The throughput of the same server is a bench, not a test: bench/nfs_readers.py.
"""

from __future__ import annotations

import hashlib
import io
import os
import re
import threading

import pytest
from PIL import Image

from tests.e2e.test_datastage import CLASSES, PER_CLASS
from tests.fixtures.cluster import OperatorProcess, fresh_namespace
from tests.fixtures.waiting import wait_until
from trainop.render import datastage

pytestmark = [pytest.mark.real, pytest.mark.azurite]

STAGE = "pets"
COPY_UID = 10001  # the stager runs as the operator image's user
CLIENT_IMAGE = datastage.DEFAULTS["nfsServerImage"]  # carries libnfs-utils
CLASS = "trainop-e2e-hostpath"  # no provisioner: only our pre-bound PV has it
BIG = "train/big/random.bin"  # several NFS READs per file, not just one
SHA = re.compile(r"^(\S+) ([0-9a-f]{64})$", re.M)


def client_pod(name: str, labels: dict) -> dict:
    """An idle pod with the NFS client, as a `restricted` pod: non-root, no capability. On the
    system node, the one whose containerd has the server's image."""
    spec = {"nodeSelector": {"agentpool": "system"}, "terminationGracePeriodSeconds": 0,
            "securityContext": {"runAsNonRoot": True, "runAsUser": COPY_UID, "runAsGroup": COPY_UID,
                                "seccompProfile": {"type": "RuntimeDefault"}},
            "containers": [{"name": "main", "image": CLIENT_IMAGE, "imagePullPolicy": "Never",
                            "command": ["sleep", "infinity"],
                            # nfs-cp's destination (it refuses /dev/null): memory, not this disk
                            "volumeMounts": [{"name": "scratch", "mountPath": "/scratch"}],
                            "securityContext": {"allowPrivilegeEscalation": False,
                                                "capabilities": {"drop": ["ALL"]}}}],
            "volumes": [{"name": "scratch", "emptyDir": {"medium": "Memory", "sizeLimit": "1Gi"}}]}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": labels}, "spec": spec}


def run_pods(cluster, namespace: str, pods: list[dict]) -> None:
    cluster.apply(pods, namespace)
    for pod in pods:
        cluster.kubectl("wait", "-n", namespace, "--for=condition=Ready", f"pod/{pod['metadata']['name']}",
                        "--timeout=180s")


def sh(cluster, namespace: str, pod: str, script: str, *args: str):
    """`sh -c script` in the pod (kubectl exec through its real kubelet): (rc, stdout + stderr)."""
    out = cluster.kubectl("exec", "-n", namespace, pod, "--", "sh", "-c", script, "sh", *args, check=False)
    return out.returncode, out.stdout + out.stderr


def url(server: str, path: str = "") -> str:
    # version=4: libnfs 4.0 speaks NFSv4.0 (kubelets mount 4.1; the server offers both)
    return f"nfs://{server}/{path}?version=4"


# Lists the export and prints `path sha256` of every file, all read over NFS.
READ_ALL = """
set -e
timeout 20 nfs-ls -R "nfs://$1/?version=4" > /tmp/listing
awk '$1 ~ /^-/ {print $NF}' /tmp/listing | while read -r f; do
    printf '%s %s\\n' "$f" "$(nfs-cat "nfs://$1/$f?version=4" | sha256sum | cut -d' ' -f1)"
done
cat /tmp/listing
"""


def read_all(cluster, namespace: str, pod: str, server: str) -> tuple[int, str, dict[str, str]]:
    rc, out = sh(cluster, namespace, pod, READ_ALL, server)
    # .trainop/: the stager's own state (its manifest), beside the staged files
    return rc, out, {k: v for k, v in SHA.findall(out) if not k.startswith(".trainop/")}


def server_pod(cluster, ns: str) -> dict:
    (pod,) = cluster.get("pods", "-n", ns, "-l", "trainop.io/role=nfs-server")["items"]
    return pod


def exported_to(cluster, ns: str) -> list[str]:
    """The client list of the server's last (re)load, from its log."""
    log = cluster.logs(ns, server_pod(cluster, ns)["metadata"]["name"])
    return re.findall(r"^nfs-server: exporting \S+ read-only to: (.*)$", log, re.M)[-1].split(", ")


@pytest.fixture(scope="module")
def staged(real_cluster, pod_azurite, tmp_path_factory, request):
    """One provisioned DataStage, Ready: its files, their Blob checksums, and the server."""
    cluster = real_cluster
    gen = fresh_namespace(cluster, request)
    ns = next(gen)
    # The export's clients: the readers' addresses, the pod's and its node's (where a kubelet
    # mounts from), and no configured subnet. Every other pod, the intruder beside it on the same
    # node included, is outside.
    run_pods(cluster, ns, [client_pod("reader", {datastage.LABEL_READS_STAGE: STAGE})])
    operator = OperatorProcess(cluster, [ns], tmp_path_factory.mktemp("ganesha-op") / "operator.log", config={
        "datastage": {"allowProvisionedServers": True}}).start()

    container = pod_azurite.new_container()
    blobs: dict[str, bytes] = {}
    for label, name in enumerate(CLASSES):
        for i in range(PER_CLASS):
            buf = io.BytesIO()
            Image.new("RGB", (48, 40), (40 + 100 * label, 10 * i, 90)).save(buf, "JPEG", quality=90)
            blobs[f"train/{name}/{i:03d}.jpg"] = buf.getvalue()
    blobs[BIG] = os.urandom(3 * 1024 * 1024 + 12345)
    for name, data in blobs.items():
        container.upload_blob(name, data)
    # The Blob's own checksums: what the service returns, not what we meant to upload.
    expected = {name: hashlib.sha256(container.download_blob(name).readall()).hexdigest() for name in blobs}
    sas = pod_azurite.container_sas(container.container_name, permission="rl")
    cluster.kubectl("create", "secret", "generic", "reader", "-n", ns, f"--from-literal=sas={sas}")

    disk = tmp_path_factory.mktemp("ganesha-disk")
    # What the copy pod's fsGroup makes of a fresh disk's root (hostPath has no fsGroup): the
    # copy's group may write, everyone may read (the server runs as another uid).
    os.chown(disk, 0, COPY_UID)
    os.chmod(disk, 0o2775)
    claim = f"export-{STAGE}-nfs-0"
    cluster.apply({
        "apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": f"{ns}-export"},
        "spec": {"capacity": {"storage": "1Gi"}, "accessModes": ["ReadWriteOnce"], "storageClassName": CLASS,
                 "persistentVolumeReclaimPolicy": "Retain", "hostPath": {"path": str(disk)},
                 "claimRef": {"namespace": ns, "name": claim}}})
    cluster.apply({
        "apiVersion": "trainop.io/v1alpha1", "kind": "DataStage", "metadata": {"name": STAGE},
        "spec": {"source": {"blob": {"accountURL": pod_azurite.http_url, "container": container.container_name,
                                     "prefix": "train/", "auth": {"sasSecretRef": {"name": "reader", "key": "sas"}}}},
                 "destination": {"provision": {"size": "1Gi", "storageClassName": CLASS}}}}, ns)
    try:
        status = wait_until(lambda: (s := cluster.get("datastage", STAGE, "-n", ns).get("status", {}))
                            .get("phase") in ("Ready", "Failed") and s, timeout=300, interval=1,
                            what=f"DataStage {STAGE} Ready")
        assert status["phase"] == "Ready", status
        cluster.assert_ran_on_real_nodes(ns, f"trainop.io/datastage={STAGE}")
        # the reader in the running server's list (the operator annotates the new server pod)
        reader_ip = cluster.get("pod", "reader", "-n", ns)["status"]["podIP"]
        wait_until(lambda: reader_ip in exported_to(cluster, ns), timeout=60, interval=1,
                   what="the reader in the server's client list")
        yield {"ns": ns, "server": status["server"], "expected": expected, "disk": disk,
               "operator": operator, "cluster": cluster}
    finally:
        operator.stop()
        cluster.kubectl("delete", "datastage", STAGE, "-n", ns, "--wait=false", check=False)
        try:
            next(gen)
        except StopIteration:
            pass
        cluster.kubectl("delete", "pv", f"{ns}-export", "--wait=false", check=False)


def test_reader_lists_and_reads_the_blobs_bytes_through_the_server(staged):
    cluster, ns = staged["cluster"], staged["ns"]
    # The server: NFS-Ganesha, non-root, holding CAP_DAC_READ_SEARCH and nothing else.
    log = cluster.logs(ns, server_pod(cluster, ns)["metadata"]["name"])
    assert "NFS SERVER INITIALIZED" in log and "Could not create export" not in log, log[-3000:]
    assert "currently set capabilities are: cap_dac_read_search=ep" in log, log[-3000:]
    rc, out, files = read_all(cluster, ns, "reader", staged["server"])
    assert rc == 0, (out, log[-3000:])
    assert files == staged["expected"], out


def test_a_write_through_nfs_is_refused(staged):
    cluster, ns = staged["cluster"], staged["ns"]
    # As the uid that owns every staged file: only the export's read-only rule stands in the way.
    rc, out = sh(cluster, ns, "reader", 'echo overwritten > /tmp/w && nfs-cp /tmp/w "$1"',
                 url(staged["server"], "train/cat/000.jpg"))
    assert rc != 0 and "NFS4ERR_ROFS" in out, out
    rc, out = sh(cluster, ns, "reader", 'echo new > /tmp/w && nfs-cp /tmp/w "$1"', url(staged["server"], "train/new.txt"))
    assert rc != 0 and "NFS4ERR_ROFS" in out, out
    assert not (staged["disk"] / "train" / "new.txt").exists()
    digest = hashlib.sha256((staged["disk"] / "train/cat/000.jpg").read_bytes()).hexdigest()
    assert digest == staged["expected"]["train/cat/000.jpg"]


def test_root_is_squashed(staged):
    """AUTH_SYS lets a client claim any uid. A file only its owner may read (0600): the owner's
    uid reads it, a client claiming root does not, because root is mapped to the anonymous user
    (without root squash, Ganesha lets root read anything)."""
    cluster, ns = staged["cluster"], staged["ns"]
    private = staged["disk"] / "train" / "private.bin"
    private.write_bytes(b"only the owner")
    os.chown(private, COPY_UID, COPY_UID)
    os.chmod(private, 0o600)
    try:
        as_owner = url(staged["server"], "train/private.bin") + f"&uid={COPY_UID}&gid={COPY_UID}"
        rc, out = sh(cluster, ns, "reader", 'nfs-cat "$1"', as_owner)
        assert rc == 0 and out == "only the owner", out
        rc, out = sh(cluster, ns, "reader", 'nfs-cat "$1"', url(staged["server"], "train/private.bin") + "&uid=0&gid=0")
        assert rc != 0 and "NFS4ERR_ACCESS" in out and "only the owner" not in out, out
    finally:
        private.unlink()


@pytest.fixture(scope="module")
def intruder(staged, request):
    """A pod in another namespace that claims to read the DataStage (the label is its own to set),
    on the server's and the reader's node: outside both the policy's namespace and the export's client list."""
    cluster = staged["cluster"]
    gen = fresh_namespace(cluster, request)
    ns = next(gen)
    run_pods(cluster, ns, [client_pod("intruder", {datastage.LABEL_READS_STAGE: STAGE})])
    yield ns
    try:
        next(gen)
    except StopIteration:
        pass


def test_another_namespace_is_refused_by_the_network_policy(staged, intruder):
    cluster = staged["cluster"]
    assert cluster.get("networkpolicy", f"{STAGE}-nfs", "-n", staged["ns"])
    rc, out = sh(cluster, intruder, "intruder", 'timeout 20 nfs-ls "$1"', url(staged["server"]))
    assert rc != 0, out
    assert "train" not in out and "NFS4ERR" not in out, out  # no NFS reply at all: TCP never got through


def test_the_client_list_follows_the_readers_without_a_restart(staged):
    """A pod of the namespace that is no reader is refused; labelled as one, it reads once the
    running server has reloaded its list (the server pod's annotation, the kubelet's downward API
    file, SIGHUP); unlabelled, its address leaves the list again (the last test sees Ganesha
    refuse it)."""
    cluster, ns = staged["cluster"], staged["ns"]
    before = server_pod(cluster, ns)
    run_pods(cluster, ns, [client_pod("late", {})])
    late_ip = cluster.get("pod", "late", "-n", ns)["status"]["podIP"]
    assert late_ip not in exported_to(cluster, ns)
    rc, out = sh(cluster, ns, "late", 'timeout 5 nfs-ls "$1"', url(staged["server"]))
    assert rc != 0 and "train" not in out, out
    cluster.kubectl("label", "pod", "late", "-n", ns, f"{datastage.LABEL_READS_STAGE}={STAGE}")
    wait_until(lambda: read_all(cluster, ns, "late", staged["server"])[2] == staged["expected"],
               timeout=90, interval=1, what="the new reader reading through the reloaded server")
    after = server_pod(cluster, ns)
    assert after["metadata"]["uid"] == before["metadata"]["uid"]
    assert after["status"]["containerStatuses"][0]["restartCount"] == 0
    assert late_ip in exported_to(cluster, ns)
    clients = after["metadata"]["annotations"][datastage.CLIENTS_ANNOTATION].split(",")
    reader = cluster.get("pod", "reader", "-n", ns)
    node = cluster.get("node", reader["spec"]["nodeName"])
    node_ip = next(a["address"] for a in node["status"]["addresses"] if a["type"] == "InternalIP")
    assert sorted(clients) == sorted({reader["status"]["podIP"], late_ip, node_ip})
    cluster.kubectl("label", "pod", "late", "-n", ns, f"{datastage.LABEL_READS_STAGE}-")
    wait_until(lambda: late_ip not in exported_to(cluster, ns), timeout=90, interval=1,
               what="the server reloaded without the former reader")


def watch_exit_codes(cluster, pod: dict) -> tuple[threading.Thread, list[int]]:
    """The exit codes the pod's container reports until the pod is gone, from a watch started
    now (a deleted pod's last status is only ever seen on the watch)."""
    from kubernetes import client, watch

    core, codes, meta = client.CoreV1Api(cluster.api_client()), [], pod["metadata"]
    stream = watch.Watch()

    def run():
        for event in stream.stream(core.list_namespaced_pod, meta["namespace"], timeout_seconds=120,
                                   field_selector=f"metadata.name={meta['name']}",
                                   resource_version=meta["resourceVersion"]):
            obj = event["object"]
            if obj.metadata.uid != meta["uid"]:
                continue
            codes.extend(cs.state.terminated.exit_code for cs in obj.status.container_statuses or []
                         if cs.state.terminated)
            if event["type"] == "DELETED":
                stream.stop()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, codes


def test_the_server_pod_deleted_comes_back_with_the_same_data(staged):
    cluster, ns = staged["cluster"], staged["ns"]
    old = server_pod(cluster, ns)
    # SIGTERM: Ganesha stops cleanly and the container exits 0, well within the grace period.
    watching, codes = watch_exit_codes(cluster, old)
    cluster.kubectl("delete", "pod", "-n", ns, old["metadata"]["name"], "--timeout=60s")
    watching.join(timeout=60)
    assert codes and codes[-1] == 0, codes

    def back():
        pods = cluster.get("pods", "-n", ns, "-l", "trainop.io/role=nfs-server")["items"]
        return [p for p in pods if p["metadata"]["uid"] != old["metadata"]["uid"]
                and any(c["type"] == "Ready" and c["status"] == "True" for c in p["status"].get("conditions", []))]
    wait_until(back, timeout=120, interval=1, what="the server pod back and Ready")
    # The Service's ClusterIP (the PV's address) is unchanged; the reader sees the same bytes.
    wait_until(lambda: read_all(cluster, ns, "reader", staged["server"])[2] == staged["expected"],
               timeout=60, interval=1, what="the reader reading the same data from the new server pod")


def test_another_namespace_is_refused_by_the_exports_client_list(staged, intruder):
    """Last: the operator stops, so that the NetworkPolicy stays deleted, as on a cluster whose CNI
    enforces none. The NFS requests of the intruder, and of the pod that was a reader until the
    list dropped it, now reach Ganesha, which refuses both addresses."""
    cluster, ns = staged["cluster"], staged["ns"]
    staged["operator"].stop()
    cluster.kubectl("delete", "networkpolicy", f"{STAGE}-nfs", "-n", ns)
    for namespace, pod in ((intruder, "intruder"), (ns, "late")):
        outcome = {}

        def answered():
            outcome["rc"], outcome["out"] = sh(cluster, namespace, pod, 'timeout 20 nfs-ls "$1"', url(staged["server"]))
            return "NFS4ERR" in outcome["out"] or outcome["rc"] == 0
        wait_until(answered, timeout=90, interval=1, what=f"{pod}'s requests reaching the server")
        assert outcome["rc"] != 0 and "NFS4ERR_ACCESS" in outcome["out"], (pod, outcome)
        assert "train" not in outcome["out"]
    # The reader, inside the list, still reads.
    assert read_all(cluster, ns, "reader", staged["server"])[2] == staged["expected"]
