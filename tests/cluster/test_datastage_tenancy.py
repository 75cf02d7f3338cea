"""Issue 15, the DataStage items: what a namespace user must not be able to do with a DataStage,
each shown refused (or harmless) on the real control plane with the operator running as
production runs it. docs/security.md ("DataStage") maps each test to the threat."""

from __future__ import annotations

import pytest
from kubernetes import client as k8s
from kubernetes.client.exceptions import ApiException

from tests.cluster.test_datastage import FAST, GROUP, SAS_REF, VERSION, Api, datastage, sas_secret
from tests.fixtures.cluster import delete_namespaces, server_disk
from tests.fixtures.waiting import wait_until

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]

ACCOUNT = "https://acct.blob.core.windows.net"


@pytest.fixture
def other_namespace(cluster, namespace):
    """A second namespace whose name makes the old PV names collide: `<ns>-a/x` and `<ns>/a-x`
    both gave `trainop-<ns>-a-x`."""
    name = f"{namespace}-a"
    cluster.kubectl("create", "namespace", name)
    wait_until(lambda: cluster.kubectl("get", "-n", name, "serviceaccount", "default", check=False).returncode == 0,
               timeout=30, what=f"ServiceAccount default in {name}")
    yield name
    delete_namespaces(cluster, name)


def test_pv_names_cannot_collide_and_a_stage_deletes_only_its_own_pv(cluster, namespace, other_namespace,
                                                                    operator_factory):
    """(1) Two DataStages whose old PV names collide each get their own PV; deleting one leaves
    the other's."""
    operator_factory(config=FAST, namespaces=[namespace, other_namespace])
    a, b = Api(cluster, namespace), Api(cluster, other_namespace)
    assert f"trainop-{namespace}-a-x" == f"trainop-{other_namespace}-x"  # the collision of old
    for api, name in ((a, "a-x"), (b, "x")):
        sas_secret(cluster, api.ns, "sv=2024&sig=abc")
        cluster.apply(datastage(name, ACCOUNT, SAS_REF), api.ns)
    for api, name in ((a, "a-x"), (b, "x")):
        api.wait_phase(name, "Copying")
    pv_a, pv_b = a.pv("a-x"), b.pv("x")
    assert pv_a.metadata.name != pv_b.metadata.name
    for api, name, pv in ((a, "a-x", pv_a), (b, "x", pv_b)):
        uid = api.get(name)["metadata"]["uid"]
        assert pv.metadata.name == f"trainop-{uid}" == api.status(name)["volumeName"]
        assert pv.metadata.labels["trainop.io/datastage-uid"] == uid
        assert pv.spec.claim_ref.namespace == api.ns
    cluster.kubectl("delete", "dstage", "a-x", "-n", namespace, "--wait=false")
    wait_until(lambda: a.pv_deleting(pv_a.metadata.name), timeout=30, what="a-x's PV deleted by its finalizer")
    wait_until(lambda: a.get("a-x") is None, timeout=30, what="DataStage a-x gone")
    other = b.core.read_persistent_volume(pv_b.metadata.name)
    assert other.metadata.deletion_timestamp is None and b.status("x")["phase"] == "Copying"


def test_a_foreign_pv_holding_the_name_is_never_changed_or_deleted(cluster, namespace, operator_factory):
    """(1) A PV of the DataStage's name without its uid label: a VolumeConflict condition, the PV
    untouched, and the finalizer leaves it."""
    operator_factory(config=FAST)
    api = Api(cluster, namespace)
    cluster.apply(datastage("held", ACCOUNT, SAS_REF), namespace)  # no Secret yet: creates nothing
    api.wait_phase("held", "Failed")
    uid = api.get("held")["metadata"]["uid"]
    foreign = f"trainop-{uid}"
    cluster.apply({"apiVersion": "v1", "kind": "PersistentVolume",
                   "metadata": {"name": foreign, "labels": {"owner": "someone-else"}},
                   "spec": {"capacity": {"storage": "1Gi"}, "accessModes": ["ReadWriteOnce"],
                            "storageClassName": "", "nfs": {"server": "10.9.9.9", "path": "/theirs"}}})
    try:
        # The PV controller writes the new PV's status (Pending → Available) once, on its own
        # schedule: read `before` after that write, so the resourceVersion compared below can
        # move only if someone else (the operator) writes the PV.
        before = wait_until(lambda: (pv := api.core.read_persistent_volume(foreign)).status.phase == "Available"
                            and pv, timeout=60, what="the PV controller marking the foreign PV Available")
        sas_secret(cluster, namespace, "sv=2024&sig=abc")
        wait_until(lambda: api.condition("held", "Ready").get("reason") == "VolumeConflict", timeout=60,
                   what=f"a VolumeConflict condition (status: {api.status('held')})")
        message = api.condition("held", "Ready")["message"]
        assert foreign in message and "trainop.io/datastage-uid" in message
        after = api.core.read_persistent_volume(foreign)
        assert after.metadata.resource_version == before.metadata.resource_version  # never patched
        assert "trainop" not in {f.manager for f in after.metadata.managed_fields or []}
        assert after.spec.nfs.server == "10.9.9.9" and not api.children("held")["pvcs"]
        cluster.kubectl("delete", "dstage", "held", "-n", namespace, "--wait=false")
        wait_until(lambda: api.get("held") is None, timeout=30, what="the DataStage gone")
        assert api.pv_exists(foreign)  # the finalizer left it alone
    finally:
        cluster.kubectl("delete", "pv", foreign, "--wait=false", check=False)


def test_a_datastage_reads_only_as_an_account_the_admin_lists(cluster, namespace, operator_factory):
    """Issue 22: the copy pod runs as source.blob.auth.serviceAccountName, with the stager's Role
    bound to it. An existing account the admin did not list is refused naming the field, and
    nothing is created; a listed one gets its copy Job, running as it."""
    operator_factory(config=FAST | {"blob": {"allowedServiceAccounts": ["reader-wi"]}})
    api = Api(cluster, namespace)
    for account in ("platform-admin", "reader-wi"):
        cluster.kubectl("create", "serviceaccount", account, "-n", namespace)
    wi = {"workloadIdentity": True}
    cluster.apply(datastage("borrowed", ACCOUNT, wi | {"serviceAccountName": "platform-admin"}), namespace)
    cluster.apply(datastage("listed", ACCOUNT, wi | {"serviceAccountName": "reader-wi"}), namespace)
    api.wait_phase("borrowed", "Failed")
    ready = api.condition("borrowed", "Ready")
    assert ready["reason"] == "InvalidSpec" and ready["message"].startswith(
        "spec.source.blob.auth.serviceAccountName: 'platform-admin' is not a ServiceAccount"), ready
    assert "blob.allowedServiceAccounts" in ready["message"]
    job = wait_until(lambda: next(iter(api.copy_jobs("listed")), None), timeout=60, what="the listed one's copy Job")
    assert job.spec.template.spec.service_account_name == "reader-wi"
    assert not any(api.children("borrowed").values())
    bindings = k8s.RbacAuthorizationV1Api(cluster.api_client()).list_namespaced_role_binding(namespace).items
    assert not [s for b in bindings for s in b.subjects or [] if s.name == "platform-admin"]


def _selector(label_selector) -> str:
    """A LabelSelector as the API server's label-selector string."""
    parts = [f"{k}={v}" for k, v in (label_selector.match_labels or {}).items()]
    for expr in label_selector.match_expressions or []:
        op = {"In": "in", "NotIn": "notin"}.get(expr.operator)
        parts.append(f"{expr.key} {op} ({','.join(expr.values)})" if op else
                     (expr.key if expr.operator == "Exists" else f"!{expr.key}"))
    return ",".join(parts)


def test_provisioned_server_network_policy_admits_exactly_the_stages_job_pods(cluster, namespace, other_namespace,
                                                                             operator_factory):
    """(2) The NetworkPolicy is applied, accepted by the API server, selects the server pod only,
    and admits only pods of this namespace that mount this DataStage (the job's workers): not
    the copy pod (it writes the disk, not over NFS), not another job's pods, not a pod in
    another namespace carrying the same labels."""
    operator_factory(config=FAST, namespaces=[namespace, other_namespace])
    api = Api(cluster, namespace)
    net = k8s.NetworkingV1Api(cluster.api_client())
    with server_disk(cluster, namespace) as sc:
        try:
            sas_secret(cluster, namespace, "sv=2024&sig=abc")
            cluster.apply(datastage("served", ACCOUNT, SAS_REF, {"provision": {"size": "8Gi", "storageClassName": sc}}),
                          namespace)
            copy_pod = wait_until(lambda: api.copy_pod("served"), timeout=90, what="the copy pod Running")
            cluster.end_pod(namespace, copy_pod.metadata.name, 0)
            api.wait_phase("served", "Ready")
            dtj = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "DistributedTrainingJob",
                   "spec": {"workers": 2, "gpusPerWorker": 1, "launcher": "torchrun"}}
            cluster.apply({**dtj, "metadata": {"name": "reader"},
                           "spec": {**dtj["spec"], "data": {"dataStageRef": {"name": "served"}}}}, namespace)
            cluster.apply({**dtj, "metadata": {"name": "bystander"}}, namespace)
            # a pod elsewhere dressed as a reader of "served"
            cluster.apply({"apiVersion": "v1", "kind": "Pod",
                           "metadata": {"name": "impostor", "labels": {"trainop.io/reads-datastage": "served",
                                                                        "trainop.io/datastage": "served"}},
                           "spec": {"containers": [{"name": "c", "image": "x"}]}}, other_namespace)

            def workers(job):
                return {p.metadata.name for p in api.core.list_namespaced_pod(
                    namespace, label_selector=f"trainop.io/job-name={job},trainop.io/role=worker").items}
            wait_until(lambda: len(workers("reader")) == 2 and len(workers("bystander")) == 2, timeout=60,
                       what="both jobs' workers")

            policy = net.read_namespaced_network_policy("served-nfs", namespace)
            assert policy.metadata.owner_references[0].kind == "DataStage"
            assert policy.spec.policy_types == ["Ingress"]
            selected = {p.metadata.name for p in api.core.list_namespaced_pod(
                namespace, label_selector=_selector(policy.spec.pod_selector)).items}
            assert selected == {"served-nfs-0"}
            (rule,) = policy.spec.ingress
            assert [(port.protocol, port.port) for port in rule.ports] == [("TCP", 2049)]
            admitted = set()
            for peer in rule._from:
                if peer.ip_block:
                    continue  # the readers' nodes (where kubelets mount from) and datastage.nfsClientCIDRs
                # no namespaceSelector: the peer is in the policy's own namespace only
                assert peer.namespace_selector is None
                admitted |= {p.metadata.name for p in api.core.list_namespaced_pod(
                    namespace, label_selector=_selector(peer.pod_selector)).items}
            assert admitted == workers("reader")
            assert not admitted & (workers("bystander") | {copy_pod.metadata.name, "served-nfs-0"})
        finally:
            cluster.kubectl("delete", "dstage", "served", "-n", namespace, "--wait=false", check=False)


@pytest.mark.parametrize("destination,field", [
    ({"nfs": {"server": "10.9.9.9", "path": "/export/imagenet"}}, "spec.destination.nfs.server"),
    ({"nfs": {"server": "10.240.0.4", "path": "/srv/other-team"}}, "spec.destination.nfs.path"),
], ids=["server", "path"])
def test_an_nfs_export_the_admin_did_not_allow_is_refused(cluster, namespace, operator_factory, destination, field):
    """(5) destination.nfs only on what datastage.allowedNfsExports lists (FAST: 10.240.0.4 /export)."""
    operator_factory(config=FAST)
    api = Api(cluster, namespace)
    sas_secret(cluster, namespace, "sv=2024&sig=abc")
    cluster.apply(datastage("mount", ACCOUNT, SAS_REF, destination), namespace)
    api.wait_phase("mount", "Failed")
    ready = api.condition("mount", "Ready")
    assert ready["reason"] == "InvalidSpec" and ready["message"].startswith(f"{field}: ")
    assert "datastage.allowedNfsExports" in ready["message"]
    assert not any(api.children("mount").values()) and api.pv("mount") is None
    # the allowed export, in the same namespace, proceeds
    cluster.apply(datastage("allowed", ACCOUNT, SAS_REF), namespace)
    api.wait_phase("allowed", "Copying")


@pytest.mark.parametrize("url", ["http://acct.blob.core.windows.net", "https://collector.example.com/acct",
                                 "https://acct.blob.core.windows.net.example.com"])
def test_an_account_url_outside_azure_storage_is_refused(cluster, namespace, operator_factory, url):
    """(8) A DataStage's accountURL and a job's output accountURL: https:// on Azure Storage, or
    what blob.allowedAccountURLs lists (the tests' Azurite on loopback)."""
    operator_factory(config=FAST)
    api = Api(cluster, namespace)
    sas_secret(cluster, namespace, "sv=2024&sig=abc")
    cluster.apply(datastage("src", url, SAS_REF), namespace)
    api.wait_phase("src", "Failed")
    ready = api.condition("src", "Ready")
    assert ready["reason"] == "InvalidSpec"
    assert ready["message"].startswith("spec.source.blob.accountURL: ") and "blob.allowedAccountURLs" in ready["message"]
    assert not any(api.children("src").values())

    cluster.apply({"apiVersion": f"{GROUP}/{VERSION}", "kind": "DistributedTrainingJob", "metadata": {"name": "out"},
                   "spec": {"workers": 1, "gpusPerWorker": 1,
                            "output": {"blob": {"accountURL": url, "container": "results", "auth": SAS_REF}}}},
                   namespace)

    def failed():
        obj = api.custom.get_namespaced_custom_object(GROUP, VERSION, namespace, "distributedtrainingjobs", "out")
        return next((c for c in (obj.get("status") or {}).get("conditions") or []
                     if c["type"] == "Failed" and c["status"] == "True"), None)
    cond = wait_until(failed, timeout=60, what="the job Failed")
    assert cond["reason"] == "InvalidSpec" and cond["message"].startswith("spec.output.blob.accountURL: ")
    assert not api.core.list_namespaced_pod(namespace, label_selector="trainop.io/job-name=out").items


def test_a_running_job_survives_its_stage_losing_its_secret_and_being_edited(cluster, namespace, operator_factory):
    """(11b) A Ready stage whose Secret is deleted stays Ready; edited, it copies again, and the
    job already running keeps its claim and runs to Succeeded, while a new job waits for Ready."""
    operator_factory(config=FAST)
    api = Api(cluster, namespace)
    sas_secret(cluster, namespace, "sv=2024&sig=abc")
    cluster.apply(datastage("data", ACCOUNT, SAS_REF), namespace)
    cluster.end_pod(namespace, wait_until(lambda: api.copy_pod("data"), timeout=60, what="copy pod").metadata.name, 0)
    api.wait_phase("data", "Ready")

    def job(name: str) -> dict:
        return {"apiVersion": f"{GROUP}/{VERSION}", "kind": "DistributedTrainingJob", "metadata": {"name": name},
                "spec": {"workers": 2, "gpusPerWorker": 1, "launcher": "torchrun",
                         "data": {"dataStageRef": {"name": "data"}}}}

    def status(name: str) -> dict:
        obj = api.custom.get_namespaced_custom_object(GROUP, VERSION, namespace, "distributedtrainingjobs", name)
        return obj.get("status") or {}

    def data_ready(name: str) -> dict:
        return next((c for c in status(name).get("conditions") or [] if c["type"] == "DataReady"), {})

    cluster.apply(job("early"), namespace)
    wait_until(lambda: status("early").get("phase") == "Running", timeout=60, what="job early Running")

    # (That a copied stage stays Ready without its Secret is the table test
    # test_a_copied_stage_stays_ready_without_its_secret: nothing here could show that a
    # reconcile happened without a change. This test is the jobs' side.)
    cluster.kubectl("delete", "secret", "storage", "-n", namespace)
    cluster.apply(datastage("data", ACCOUNT, SAS_REF, verify=False), namespace)  # an edit: a new copy
    api.wait_phase("data", "Failed")  # the new copy needs the deleted Secret: it says so
    assert api.condition("data", "Ready")["message"].startswith("spec.source.blob.auth.sasSecretRef.name: ")
    cond = wait_until(lambda: (c := data_ready("early")).get("reason") == "DataStageChanged" and c, timeout=30,
                      what=f"job early told its DataStage changed ({status('early')})")
    assert cond["status"] == "True" and "keeps claim data-data" in cond["message"]

    cluster.apply(job("late"), namespace)
    wait_until(lambda: data_ready("late").get("reason") == "DataStageFailed", timeout=30, what="job late waiting")
    assert status("late")["phase"] == "Staging"

    # the running job is reconciled as ever: its workers finish, it succeeds
    for pod in api.core.list_namespaced_pod(namespace, label_selector="trainop.io/job-name=early").items:
        cluster.end_pod(namespace, pod.metadata.name, 0)
    wait_until(lambda: status("early").get("phase") == "Succeeded", timeout=60, what="job early Succeeded")
    assert not api.core.list_namespaced_pod(namespace, label_selector="trainop.io/job-name=late").items

    sas_secret(cluster, namespace, "sv=2024&sig=abc")  # the Secret back: the new copy runs
    cluster.end_pod(namespace, wait_until(lambda: api.copy_pod("data"), timeout=60, what="new copy pod").metadata.name, 0)
    api.wait_phase("data", "Ready")
    wait_until(lambda: status("late").get("phase") in ("Starting", "Running"), timeout=60, what="job late started")


def test_the_stagers_identity_cannot_write_the_datastage_status(cluster, namespace, operator_factory):
    """Left from issue 15: the copy pod's ServiceAccount may patch its DataStage's progress
    ConfigMap and nothing else; it is refused the DataStage's status (where it could say Ready
    while the data is half there). tests/cluster/test_datastage.py shows the progress still
    reaching the status through the operator."""
    operator_factory(config=FAST)
    api = Api(cluster, namespace)
    sas_secret(cluster, namespace, "sv=2024&sig=abc")
    cluster.apply(datastage("reported", ACCOUNT, SAS_REF), namespace)
    api.wait_phase("reported", "Copying")
    # the API as the stager's ServiceAccount (impersonated: kubectl patch would GET first, which
    # the stager never does and may not)
    client = cluster.api_client()
    client.set_default_header("Impersonate-User", f"system:serviceaccount:{namespace}:reported-stager")
    custom, core = k8s.CustomObjectsApi(client), k8s.CoreV1Api(client)

    def refused(call, *args) -> bool:
        try:
            call(*args)
        except ApiException as exc:
            return exc.status == 403
        return False
    forged = {"status": {"phase": "Ready", "bytesCopied": 1}}
    assert refused(custom.patch_namespaced_custom_object_status, GROUP, VERSION, namespace, "datastages", "reported", forged)
    assert refused(custom.patch_namespaced_custom_object, GROUP, VERSION, namespace, "datastages", "reported",
                   {"spec": {"verify": False}})
    assert api.status("reported")["phase"] == "Copying" and "bytesCopied" not in api.status("reported")
    # its one right: its own progress ConfigMap (made by the operator, owned by the DataStage)
    report = {"data": {"status": "{}"}}
    core.patch_namespaced_config_map("reported-progress", namespace, report)
    cluster.kubectl("create", "configmap", "other", "-n", namespace)
    assert refused(core.patch_namespaced_config_map, "other", namespace, report)
    assert refused(core.read_namespaced_config_map, "reported-progress", namespace)


def test_another_namespaces_export_is_refused(cluster, namespace, other_namespace, operator_factory):
    """Issue 22 M4: the copy Job mounts an export read-write, so each export is one namespace's.
    A DataStage in namespace B naming A's export (A's folder of a per-namespace export, or an
    export listed for A only) is refused naming the field, and nothing is created; so is a mount
    option that would point the volume at another server. A's own export proceeds."""
    config = {"resyncSeconds": 0.5, "datastage": {"allowedNfsExports": [
        {"server": "10.240.0.4", "path": "/export/{namespace}"},
        {"server": "10.240.0.5", "path": "/teams/a", "namespaces": [namespace]}]}}
    operator_factory(config=config, namespaces=[namespace, other_namespace])
    a, b = Api(cluster, namespace), Api(cluster, other_namespace)
    for api in (a, b):
        sas_secret(cluster, api.ns, "sv=2024&sig=abc")
    attacks = {
        "folder": ({"nfs": {"server": "10.240.0.4", "path": f"/export/{namespace}/imagenet"}}, "spec.destination.nfs.path"),
        "climb": ({"nfs": {"server": "10.240.0.4", "path": f"/export/{other_namespace}/../{namespace}"}},
                  "spec.destination.nfs.path"),
        "listed": ({"nfs": {"server": "10.240.0.5", "path": "/teams/a"}}, "spec.destination.nfs.server"),
        "redirect": ({"nfs": {"server": "10.240.0.4", "path": f"/export/{other_namespace}"},
                      "mountOptions": ["nfsvers=4.1", "addr=10.240.0.5"]}, "spec.destination.mountOptions[1]"),
    }
    for name, (destination, _) in attacks.items():
        cluster.apply(datastage(name, ACCOUNT, SAS_REF, destination), other_namespace)
    for name, (_, field) in attacks.items():
        b.wait_phase(name, "Failed")
        ready = b.condition(name, "Ready")
        assert ready["reason"] == "InvalidSpec" and ready["message"].startswith(f"{field}: "), ready
        assert not any(b.children(name).values()) and b.pv(name) is None
    assert "allowed for namespace" in b.condition("listed", "Ready")["message"]
    # the owners' own exports: A's folder, A's listed export, B's own folder
    cluster.apply(datastage("mine", ACCOUNT, SAS_REF, attacks["folder"][0]), namespace)
    cluster.apply(datastage("listed", ACCOUNT, SAS_REF, attacks["listed"][0]), namespace)
    cluster.apply(datastage("own", ACCOUNT, SAS_REF, {"nfs": {"server": "10.240.0.4",
                                                              "path": f"/export/{other_namespace}/x"}}), other_namespace)
    a.wait_phase("mine", "Copying")
    a.wait_phase("listed", "Copying")
    b.wait_phase("own", "Copying")
