"""DataStage end to end on the real control plane (API server, controller-manager with the PV
binder, Job, StatefulSet controllers and garbage collector, KWOK nodes), the operator running as
production runs it.

KWOK runs the copy Job's pod without executing it; where a test needs the copy's real effect on
the DataStage, it runs the real stager as a plain process against Azurite, with the pod's own
arguments and a token of the pod's own ServiceAccount (so the stager's RBAC is what is tested),
then ends the pod with the stager's exit code."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from kubernetes import client as k8s
from kubernetes.client.exceptions import ApiException

from tests.fixtures.cluster import server_disk
from tests.fixtures.waiting import wait_until
from trainop import blob

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(240)]

GROUP, VERSION, PLURAL = "trainop.io", "v1alpha1", "datastages"
# The admin allows the exports these tests and examples/datastage-nfs-sas.yaml name (to every
# namespace: each test has its own), and provisioned servers.
FAST = {"resyncSeconds": 0.5, "datastage": {
    "allowedNfsExports": [{"server": "10.240.0.4", "path": "/export", "namespaces": ["*"]},
                          {"server": "10.240.0.4", "path": "/datasets", "namespaces": ["*"]}],
    "allowProvisionedServers": True, "nfsClientCIDRs": ["10.224.0.0/16"],
    "progressIntervalSeconds": 1},  # how often the stager reports and a copying stage is looked at
    # dataset-reader: what examples/datastage-imagenet.yaml asks the admin to list; nobody:
    # allowed and never created, for "not found"
    "blob": {"allowedServiceAccounts": ["dataset-reader", "nobody"]}}
BLOBS = {f"train/n{i:02d}/img{i}.JPEG": os.urandom(1000 + 37 * i) for i in range(12)}


def datastage(name: str, account_url: str, auth: dict | None, destination: dict | None = None, **spec) -> dict:
    source = {"accountURL": account_url, "container": "imagenet"}
    if auth is not None:
        source["auth"] = auth
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": "DataStage", "metadata": {"name": name},
            "spec": {"source": {"blob": source},
                     "destination": destination or {"nfs": {"server": "10.240.0.4", "path": "/export/imagenet"}},
                     **spec}}


SAS_REF = {"sasSecretRef": {"name": "storage", "key": "sas"}}


class Api:
    def __init__(self, cluster, namespace):
        self.cluster, self.ns = cluster, namespace
        api = cluster.api_client()
        self.core, self.batch, self.rbac = k8s.CoreV1Api(api), k8s.BatchV1Api(api), k8s.RbacAuthorizationV1Api(api)
        self.apps, self.custom, self.storage = k8s.AppsV1Api(api), k8s.CustomObjectsApi(api), k8s.StorageV1Api(api)

    def get(self, name: str) -> dict | None:
        try:
            return self.custom.get_namespaced_custom_object(GROUP, VERSION, self.ns, PLURAL, name)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def status(self, name: str) -> dict:
        return (self.get(name) or {}).get("status") or {}

    def condition(self, name: str, type_: str) -> dict:
        return next((c for c in self.status(name).get("conditions") or [] if c["type"] == type_), {})

    def wait_phase(self, name: str, phase: str, timeout: float = 60) -> dict:
        return wait_until(lambda: self.status(name).get("phase") == phase and self.status(name),
                          timeout=timeout, what=f"{name} phase {phase} (status: {self.status(name)})")

    def pv(self, name: str):
        """The DataStage's PV (named from its uid), None when it or the PV is gone."""
        obj = self.get(name)
        if obj is None:
            return None
        try:
            return self.core.read_persistent_volume(f"trainop-{obj['metadata']['uid']}")
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def pv_exists(self, pv_name: str) -> bool:
        try:
            self.core.read_persistent_volume(pv_name)
            return True
        except ApiException as exc:
            if exc.status == 404:
                return False
            raise

    def pv_deleting(self, pv_name: str) -> bool:
        """Gone, or deleted and waiting for its claim to go (kubernetes.io/pv-protection)."""
        try:
            return self.core.read_persistent_volume(pv_name).metadata.deletion_timestamp is not None
        except ApiException as exc:
            if exc.status == 404:
                return True
            raise

    def copy_jobs(self, name: str) -> list:
        return self.batch.list_namespaced_job(self.ns, label_selector=f"trainop.io/datastage={name},trainop.io/role=copy").items

    def copy_pod(self, name: str):
        pods = [p for p in self.core.list_namespaced_pod(self.ns, label_selector=f"trainop.io/datastage={name},trainop.io/role=copy").items
                if p.status.phase == "Running"]
        return pods[0] if pods else None

    def children(self, name: str) -> dict[str, list[str]]:
        sel = f"trainop.io/datastage={name}"
        return {
            "jobs": [j.metadata.name for j in self.batch.list_namespaced_job(self.ns, label_selector=sel).items],
            "pvcs": [c.metadata.name for c in self.core.list_namespaced_persistent_volume_claim(self.ns, label_selector=sel).items],
            "pvs": [v.metadata.name for v in self.core.list_persistent_volume(label_selector=f"{sel},trainop.io/datastage-namespace={self.ns}").items],
            "roles": [r.metadata.name for r in self.rbac.list_namespaced_role(self.ns, label_selector=sel).items],
            "serviceaccounts": [s.metadata.name for s in self.core.list_namespaced_service_account(self.ns, label_selector=sel).items],
            "statefulsets": [s.metadata.name for s in self.apps.list_namespaced_stateful_set(self.ns, label_selector=sel).items],
            "services": [s.metadata.name for s in self.core.list_namespaced_service(self.ns, label_selector=sel).items],
        }

    def events(self, name: str) -> list[str]:
        items = self.core.list_namespaced_event(
            self.ns, field_selector=f"involvedObject.name={name},involvedObject.kind=DataStage").items
        return [f"{e.type}/{e.reason}" for e in items]


@pytest.fixture
def api(cluster, namespace):
    return Api(cluster, namespace)


@pytest.fixture
def op(operator_factory):
    return operator_factory(config=FAST)


@pytest.fixture
def source(azurite):
    """BLOBS in a fresh container (tests share the session's Azurite)."""
    container = azurite.new_container(prefix="imagenet")
    for name, data in BLOBS.items():
        container.upload_blob(name, data)
    return container


def sas_secret(cluster, namespace, sas: str) -> None:
    cluster.kubectl("create", "secret", "generic", "storage", "-n", namespace, f"--from-literal=sas={sas}")


def pod_kubeconfig(cluster, namespace: str, service_account: str, path) -> str:
    """A kubeconfig that authenticates as the copy pod's ServiceAccount (a real bound token)."""
    token = cluster.kubectl("create", "token", service_account, "-n", namespace).stdout.strip()
    config = yaml.safe_load(cluster.kubeconfig.read_text())
    config["users"] = [{"name": "pod", "user": {"token": token}}]
    for ctx in config["contexts"]:
        ctx["context"]["user"] = "pod"
    path.write_text(yaml.safe_dump(config))
    return str(path)


def run_pod_process(cluster, api, name: str, secret: str, share, tmp_path) -> subprocess.CompletedProcess:
    """The copy pod's process, for real: its own args (with --dest on a temp dir instead of the
    NFS mount) and env, authenticated to the API server as its ServiceAccount."""
    pod = wait_until(lambda: api.copy_pod(name), timeout=60, what="the copy pod Running")
    container = pod.spec.containers[0]
    args = list(container.args)
    args[args.index("--dest") + 1] = str(share)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AZURE_", "TRAINOP_BLOB_"))}
    env |= {e.name: e.value for e in container.env if e.value is not None}
    env[blob.SECRET_ENV] = secret  # what the secretKeyRef resolves to in the pod
    env["KUBECONFIG"] = pod_kubeconfig(cluster, api.ns, pod.spec.service_account_name, tmp_path / "pod.kubeconfig")
    return subprocess.run([sys.executable, *container.command[1:], *args], env=env, capture_output=True,
                          text=True, timeout=120)


def test_copy_reports_progress_then_ready_and_deletion_removes_the_pv(cluster, namespace, api, op, azurite, source, tmp_path):
    sas = azurite.container_sas(source.container_name)
    sas_secret(cluster, namespace, sas)
    ds = datastage("imagenet", azurite.http_url, SAS_REF, extract=False, verify=True)
    ds["spec"]["source"]["blob"]["container"] = source.container_name
    cluster.apply(ds, namespace)
    api.wait_phase("imagenet", "Copying")
    (job,) = api.copy_jobs("imagenet")
    assert api.status("imagenet")["copyJobName"] == job.metadata.name
    pod_spec = job.spec.template.spec
    assert pod_spec.volumes[0].nfs.server == "10.240.0.4" and pod_spec.volumes[0].nfs.path == "/export/imagenet"
    assert not pod_spec.volumes[0].nfs.read_only  # the copy writes the share
    assert [e.value_from.secret_key_ref.name for e in pod_spec.containers[0].env if e.value_from] == ["storage"]
    pv = api.pv("imagenet")
    assert pv.spec.nfs.server == "10.240.0.4" and pv.spec.nfs.read_only
    assert pv.spec.access_modes == ["ReadOnlyMany"] and not pv.metadata.owner_references
    assert pv.spec.persistent_volume_reclaim_policy == "Retain"
    wait_until(lambda: api.core.read_namespaced_persistent_volume_claim("imagenet-data", namespace).status.phase == "Bound",
               timeout=60, what="the claim bound to the NFS volume")
    assert api.core.read_namespaced_persistent_volume_claim("imagenet-data", namespace).spec.volume_name == pv.metadata.name
    assert "Ready" not in {c["type"] for c in api.status("imagenet")["conditions"] if c["status"] == "True"}

    share = tmp_path / "share"
    proc = run_pod_process(cluster, api, "imagenet", sas, share, tmp_path)
    assert proc.returncode == 0, proc.stderr
    total = sum(len(b) for b in BLOBS.values())
    # the stager reported into its progress ConfigMap; the operator checked it into the status
    status = wait_until(lambda: (s := api.status("imagenet")).get("bytesCopied") == total and s, timeout=30,
                        what=f"the stager's report in the status ({api.status('imagenet')})")
    assert (status["bytesCopied"], status["bytesTotal"], status["filesCopied"], status["filesTotal"]) == \
        (total, total, len(BLOBS), len(BLOBS))
    assert status["progress"] == f"{len(BLOBS)}/{len(BLOBS)} files, 100%"
    assert status["phase"] == "Copying"  # the pod has not exited yet
    assert sorted(p.relative_to(share).as_posix() for p in share.rglob("*.JPEG")) == sorted(BLOBS)

    cluster.end_pod(namespace, api.copy_pod("imagenet").metadata.name, 0)
    status = api.wait_phase("imagenet", "Ready")
    assert status["claimName"] == "imagenet-data" and status["bytesCopied"] == total  # progress kept
    assert api.condition("imagenet", "Ready")["reason"] == "CopyComplete"
    assert api.condition("imagenet", "Copied")["status"] == "True"
    for reason in ("Normal/Copying", "Normal/CopyComplete"):  # posted after the status write
        wait_until(lambda: reason in api.events("imagenet"), timeout=30, what=f"Event {reason}")
    cols = cluster.kubectl("get", "dstage", "-n", namespace).stdout.splitlines()
    assert cols[0].split() == ["NAME", "PHASE", "PROGRESS", "CLAIM", "AGE"]
    assert cols[1].split()[:6] == ["imagenet", "Ready", f"{len(BLOBS)}/{len(BLOBS)}", "files,", "100%", "imagenet-data"]
    assert sas not in str(api.get("imagenet")) and sas not in op.logs()

    cluster.kubectl("delete", "dstage", "imagenet", "-n", namespace, "--wait=false")
    # the finalizer deletes the PV; Kubernetes removes it once the claim (garbage-collected after
    # the DataStage) no longer binds it (pv-protection)
    wait_until(lambda: api.pv_deleting(pv.metadata.name), timeout=20, what="the PV deleted by the finalizer")
    wait_until(lambda: api.get("imagenet") is None, timeout=30, what="the DataStage gone")
    wait_until(lambda: not any(api.children("imagenet").values()), timeout=60,
               what=f"every child garbage-collected ({api.children('imagenet')})")
    wait_until(lambda: not api.pv_exists(pv.metadata.name), timeout=60, what="the PV gone")


def test_training_job_waits_then_mounts_the_claim_read_only(cluster, namespace, api, op, azurite, source):
    sas_secret(cluster, namespace, azurite.container_sas(source.container_name))
    ds = datastage("imagenet", azurite.http_url, SAS_REF)
    ds["spec"]["source"]["blob"]["container"] = source.container_name
    cluster.apply(ds, namespace)
    cluster.apply({"apiVersion": f"{GROUP}/{VERSION}", "kind": "DistributedTrainingJob", "metadata": {"name": "resnet"},
                   "spec": {"workers": 2, "gpusPerWorker": 1, "data": {"dataStageRef": {"name": "imagenet"},
                                                                        "mountPath": "/data"}}}, namespace)

    def dtj_data_cond():
        obj = api.custom.get_namespaced_custom_object(GROUP, VERSION, namespace, "distributedtrainingjobs", "resnet")
        return next((c for c in (obj.get("status") or {}).get("conditions") or [] if c["type"] == "DataReady"), None)

    cond = wait_until(lambda: (c := dtj_data_cond()) and c["reason"] == "WaitingForDataStage" and c,
                      timeout=60, what="the training job waiting for the DataStage")
    assert cond["status"] == "False"
    assert not api.core.list_namespaced_pod(namespace, label_selector="trainop.io/job-name=resnet").items

    pod = wait_until(lambda: api.copy_pod("imagenet"), timeout=60, what="the copy pod Running")
    cluster.end_pod(namespace, pod.metadata.name, 0)
    api.wait_phase("imagenet", "Ready")
    workers = wait_until(lambda: (p := api.core.list_namespaced_pod(
        namespace, label_selector="trainop.io/job-name=resnet,trainop.io/role=worker").items) and len(p) == 2 and p,
        timeout=60, what="the training job's workers")
    for worker in workers:
        (vol,) = [v for v in worker.spec.volumes if v.persistent_volume_claim]
        assert (vol.persistent_volume_claim.claim_name, vol.persistent_volume_claim.read_only) == ("imagenet-data", True)
        (mount,) = [m for m in worker.spec.containers[0].volume_mounts if m.name == vol.name]
        assert (mount.mount_path, mount.read_only) == ("/data", True)
    # the job writes its status after creating the pods
    wait_until(lambda: dtj_data_cond()["status"] == "True", timeout=30, what="the job's DataReady condition True")


@pytest.mark.parametrize("mutate,field", [
    (lambda ds: None, "spec.source.blob.auth.sasSecretRef.name"),  # no Secret created
    (lambda ds: ds["spec"]["source"]["blob"]["auth"]["sasSecretRef"].update(key="token"),
     "spec.source.blob.auth.sasSecretRef.key"),
    (lambda ds: ds["spec"]["source"]["blob"].update(accountURL="https://acct.blob.core.windows.net/?sv=2024&sig=leaked"),
     "spec.source.blob.accountURL"),
    (lambda ds: ds["spec"]["source"]["blob"].update(auth={"workloadIdentity": True, "serviceAccountName": "nobody"}),
     "spec.source.blob.auth.serviceAccountName"),
])
def test_bad_reference_or_url_fails_naming_the_field_and_creates_nothing(cluster, namespace, api, op, mutate, field):
    ds = datastage("bad", "https://acct.blob.core.windows.net", copy.deepcopy(SAS_REF))
    mutate(ds)
    if field != "spec.source.blob.auth.sasSecretRef.name":
        sas_secret(cluster, namespace, "sv=2024&sig=abc")
    cluster.apply(ds, namespace)
    status = api.wait_phase("bad", "Failed")
    ready = api.condition("bad", "Ready")
    assert (ready["status"], ready["reason"]) == ("False", "InvalidSpec")
    assert ready["message"].startswith(f"{field}: ")
    assert "leaked" not in str(status)
    wait_until(lambda: "Warning/InvalidSpec" in api.events("bad"), timeout=15, what="a Warning Event")
    assert not any(api.children("bad").values())
    assert api.pv("bad") is None


def test_creating_the_missing_secret_lets_it_proceed(cluster, namespace, api, op):
    cluster.apply(datastage("late", "https://acct.blob.core.windows.net", SAS_REF), namespace)
    api.wait_phase("late", "Failed")
    sas_secret(cluster, namespace, "sv=2024&sig=abc")
    api.wait_phase("late", "Copying")
    assert len(api.copy_jobs("late")) == 1 and api.pv("late") is not None


@pytest.mark.parametrize("change,words", [
    ({"accountURL": "ftp://acct"}, "accountURL must start with https://"),
    ({"container": "Bad_Name"}, "spec.source.blob.container"),
    ({"prefixes": ["a/"], "prefix": "b/"}, "set prefix or prefixes, not both"),
    ({"auth": {"sasSecretRef": {"name": "s", "key": "k"}, "accountKeySecretRef": {"name": "s", "key": "k"}}},
     "set exactly one of auth.workloadIdentity"),
])
def test_schema_rejects_what_it_can(cluster, namespace, change, words):
    ds = datastage("rejected", "https://acct.blob.core.windows.net", SAS_REF)
    ds["spec"]["source"]["blob"].update(change)
    proc = cluster.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(ds), check=False)
    assert proc.returncode != 0 and words in proc.stderr, proc.stderr


def test_destination_is_exactly_one_and_immutable(cluster, namespace):
    both = datastage("dest", "https://acct.blob.core.windows.net", SAS_REF,
                     {"nfs": {"server": "10.0.0.1", "path": "/x"}, "provision": {"size": "1Gi"}})
    proc = cluster.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(both), check=False)
    assert "set exactly one of destination.nfs" in proc.stderr
    cluster.apply(datastage("dest", "https://acct.blob.core.windows.net", SAS_REF), namespace)
    moved = datastage("dest", "https://acct.blob.core.windows.net", SAS_REF, {"nfs": {"server": "10.0.0.9", "path": "/x"}})
    proc = cluster.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(moved), check=False)
    assert "destination cannot change" in proc.stderr


def test_copy_failure_reports_the_stagers_line(cluster, namespace, api, op, azurite, source, tmp_path):
    good = azurite.container_sas(source.container_name)
    wrong = good.replace("sig=", "sig=AAAA")
    sas_secret(cluster, namespace, wrong)
    ds = datastage("denied", azurite.http_url, SAS_REF, copy={"backoffLimit": 0})
    ds["spec"]["source"]["blob"]["container"] = source.container_name
    cluster.apply(ds, namespace)
    api.wait_phase("denied", "Copying")
    proc = run_pod_process(cluster, api, "denied", wrong, tmp_path / "share", tmp_path)
    assert proc.returncode == 2 and not (tmp_path / "share").exists()
    cluster.end_pod(namespace, api.copy_pod("denied").metadata.name, proc.returncode)
    status = api.wait_phase("denied", "Failed")
    assert status["lastError"].startswith("authentication failed (403")
    ready = api.condition("denied", "Ready")
    assert ready["reason"] == "CopyFailed" and status["lastError"] in ready["message"]
    assert wrong not in str(status) and "AAAA" not in str(status)
    wait_until(lambda: "Warning/CopyFailed" in api.events("denied"), timeout=15, what="a Warning Event")

    # As the message says: fix the cause, delete the Job, and the copy runs again.
    cluster.kubectl("delete", "secret", "storage", "-n", namespace)
    sas_secret(cluster, namespace, good)
    cluster.kubectl("delete", "job", status["copyJobName"], "-n", namespace)
    api.wait_phase("denied", "Copying")
    proc = run_pod_process(cluster, api, "denied", good, tmp_path / "share", tmp_path)
    assert proc.returncode == 0, proc.stderr
    cluster.end_pod(namespace, api.copy_pod("denied").metadata.name, 0)
    assert "lastError" not in api.wait_phase("denied", "Ready")


def test_provisioned_nfs_server_backs_the_volume_with_its_cluster_ip(cluster, namespace, api, op):
    with server_disk(cluster, namespace) as sc:
        cluster.kubectl("create", "secret", "generic", "storage", "-n", namespace, "--from-literal=key=abc")
        cluster.apply(datastage("served", "https://acct.blob.core.windows.net", {"accountKeySecretRef": {"name": "storage", "key": "key"}},
                                {"provision": {"size": "8Gi", "storageClassName": sc}}), namespace)
        status = api.wait_phase("served", "Copying", timeout=90)
        svc = api.core.read_namespaced_service("served-nfs", namespace)
        assert status["server"] == svc.spec.cluster_ip and svc.spec.ports[0].port == 2049
        assert api.pv("served").spec.nfs.server == svc.spec.cluster_ip
        assert api.pv("served").spec.nfs.path == "/"
        (job,) = api.copy_jobs("served")
        # the server exports read-only; the copy writes its disk (claim) on its node
        assert job.spec.template.spec.volumes[0].persistent_volume_claim.claim_name == "export-served-nfs-0"
        sts = api.apps.read_namespaced_stateful_set("served-nfs", namespace)
        assert sts.status.ready_replicas == 1
        # NFS-Ganesha, serving its readers (none yet) and the configured node subnet: the list
        # goes onto the running server pod as an annotation, which the server reads through the
        # downward API. What the server refuses, and how it follows its readers, is carried out
        # against the real server in tests/e2e/test_nfs_ganesha.py
        (server,) = sts.spec.template.spec.containers
        assert {e.name: e.value for e in server.env}["CLIENTS_FILE"] == "/etc/trainop/nfs-clients/clients"
        wait_until(lambda: (api.core.read_namespaced_pod("served-nfs-0", namespace).metadata.annotations or {})
                   .get("trainop.io/nfs-clients") == "10.224.0.0/16", timeout=30, what="the client list on the server pod")
        assert not server.security_context.privileged and server.security_context.capabilities.add == ["DAC_READ_SEARCH"]
        assert api.condition("served", "ServerReady")["status"] == "True"
        pv_name = api.pv("served").metadata.name
        cluster.kubectl("delete", "dstage", "served", "-n", namespace, "--wait=false")
        wait_until(lambda: api.pv_deleting(pv_name), timeout=60, what="the NFS PV deleted by the finalizer")
        wait_until(lambda: not api.core.list_namespaced_persistent_volume_claim(
            namespace, label_selector="trainop.io/datastage=served").items, timeout=60,
            what="the server's disk claim deleted with the StatefulSet")


EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "examples").glob("datastage*.yaml"))


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_reaches_ready(cluster, namespace, api, op, path):
    """Every DataStage example, with the prerequisites its comments name, is accepted, copies
    (KWOK ends the copy pod) and becomes Ready."""
    ds = yaml.safe_load(path.read_text())
    name, spec = ds["metadata"]["name"], ds["spec"]
    auth = spec["source"]["blob"]["auth"]
    cleanup = []
    if "sasSecretRef" in auth:
        ref = auth["sasSecretRef"]
        cluster.kubectl("create", "secret", "generic", ref["name"], "-n", namespace, f"--from-literal={ref['key']}=sv=1&sig=x")
    else:
        cluster.kubectl("create", "serviceaccount", auth["serviceAccountName"], "-n", namespace)
    provision = spec["destination"].get("provision")
    if provision:  # the class and a volume for the server's disk, as an AKS cluster would provide
        sc = provision["storageClassName"]
        if cluster.kubectl("get", "storageclass", sc, check=False).returncode != 0:
            cluster.apply({"apiVersion": "storage.k8s.io/v1", "kind": "StorageClass", "metadata": {"name": sc},
                           "provisioner": "kubernetes.io/no-provisioner", "volumeBindingMode": "Immediate"})
            cleanup.append(("storageclass", sc))
        disk = f"disk-{namespace}"[:60]
        cluster.apply({"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": disk},
                       "spec": {"capacity": {"storage": provision["size"]}, "accessModes": ["ReadWriteOnce"],
                                "storageClassName": sc, "hostPath": {"path": "/tmp/nfs-disk"}}})
        cleanup.append(("pv", disk))
    try:
        cluster.kubectl("apply", "-n", namespace, "-f", str(path))
        pod = wait_until(lambda: api.copy_pod(name), timeout=90, what=f"{name}'s copy pod (status: {api.status(name)})")
        cluster.end_pod(namespace, pod.metadata.name, 0)
        assert api.wait_phase(name, "Ready")["claimName"] == f"{name}-data"
    finally:
        cluster.kubectl("delete", "dstage", name, "-n", namespace, "--wait=true", "--timeout=60s", check=False)
        for kind, obj in cleanup:
            cluster.kubectl("delete", kind, obj, "--wait=false", check=False)
