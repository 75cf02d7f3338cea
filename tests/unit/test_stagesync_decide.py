"""stagesync.decide() as a table: a DataStage snapshot in, actions + phase + Events out."""

from __future__ import annotations

import copy
import json

import pytest

from trainop import config
from trainop.actions import Apply, Create, Delete, Patch, Ref, SetFinalizers
from trainop.handlers import indexes
from trainop.spec import parse_stage
from trainop.stagesync import FINALIZER, SECRET_RECHECK_SECONDS, StageSnapshot, decide

CFG = config.from_dict({"datastage": {"allowedNfsExports": [
    {"server": "10.1.2.3", "path": "/export", "namespaces": ["team-a"]},
    {"server": "10.1.2.4", "path": "/tenants/{namespace}"}], "allowProvisionedServers": True,
    "nfsClientCIDRs": ["10.224.0.0/16"]},
    "blob": {"allowedServiceAccounts": ["reader-wi"]}})
NOW = "2026-05-01T12:00:00Z"
UID = "stage-uid"
SAS = {"sasSecretRef": {"name": "storage", "key": "sas"}}
WI = {"workloadIdentity": True, "serviceAccountName": "reader-wi"}
EXISTING = {"nfs": {"server": "10.1.2.3", "path": "/export/data"}}
PROVISION = {"provision": {"size": "100Gi"}}


def body(destination=None, auth=SAS, status=None, deleting=False,
         url="https://acct.blob.core.windows.net", finalizers=(FINALIZER,),
         namespace="team-a") -> dict:
    meta = {"name": "imagenet", "namespace": namespace, "uid": UID, "generation": 1,
            "resourceVersion": "5", "finalizers": list(finalizers)}
    if deleting:
        meta["deletionTimestamp"] = NOW
    out = {"apiVersion": "trainop.io/v1alpha1", "kind": "DataStage", "metadata": meta,
           "spec": {"source": {"blob": {"accountURL": url,
                                        "container": "imagenet", "prefix": "train/",
                                        "auth": auth}},
                    "destination": destination or EXISTING}}
    if status:
        out["status"] = status
    return out


def copy_job(name: str, outcome: str | None = None, uid: str = UID) -> dict:
    status = {"conditions": [{"type": outcome, "status": "True", "message": "BackoffLimit"}]} \
        if outcome else {}
    return {"apiVersion": "batch/v1", "kind": "Job",
            "metadata": {"name": name, "namespace": "team-a", "uid": f"uid-{name}",
                         "ownerReferences": [{"controller": True, "uid": uid}]},
            "status": status}


def snap(b, secrets=None, **kw) -> StageSnapshot:
    return StageSnapshot(body=b, secret_keys={"storage": ("sas",)} if secrets is None else secrets,
                         **kw)


def summary(actions) -> list[str]:
    kinds = {Apply: "apply", Create: "create", Delete: "delete"}
    return [f"{kinds[type(a)]} {a.ref.kind if isinstance(a, Delete) else a.obj['kind']}"
            for a in actions]


COPY = ["apply PersistentVolume", "apply PersistentVolumeClaim", "apply ServiceAccount",
        "apply Role", "apply RoleBinding", "apply ConfigMap"]


def _job_name() -> str:
    from trainop.render import datastage
    return datastage.copy_job_name(parse_stage(body()))


CASES = [
    ("a missing Secret fails naming the field, nothing created",
     snap(body(), secrets={}), [], "Failed", "InvalidSpec",
     "spec.source.blob.auth.sasSecretRef.name: Secret 'storage' not found"),
    ("a Secret without the key fails naming the key",
     snap(body(), secrets={"storage": ("other",)}), [], "Failed", "InvalidSpec",
     "spec.source.blob.auth.sasSecretRef.key: Secret 'storage' has no key 'sas'"),
    ("workload identity needs its ServiceAccount",
     snap(body(auth=WI), secrets={}), [], "Failed", "InvalidSpec",
     "spec.source.blob.auth.serviceAccountName: ServiceAccount 'reader-wi' not found"),
    ("an existing export: volume, stager identity and the copy Job",
     snap(body()), COPY + ["create Job"], "Copying", "Copying", "copy Job"),
    ("workload identity: the user's ServiceAccount, not ours",
     snap(body(auth=WI), secrets={}, service_accounts={"reader-wi"}),
     [a for a in COPY if a != "apply ServiceAccount"] + ["create Job"], "Copying", "Copying", ""),
    ("provisioned: its NetworkPolicy, then the server, waiting until it serves",
     snap(body(PROVISION)), ["apply NetworkPolicy", "apply Service", "apply StatefulSet"], "Provisioning",
     "ServerStarting", "waiting for NFS server imagenet-nfs"),
    # issue 15 (5): an existing export must be one the admin allows
    ("an NFS server the admin did not allow is refused naming the field and the config key",
     snap(body({"nfs": {"server": "10.9.9.9", "path": "/export/data"}})), [], "Failed", "InvalidSpec",
     "spec.destination.nfs.server: NFS server '10.9.9.9' is not an allowed export server; ask the "
     "cluster admin to add it to datastage.allowedNfsExports"),
    ("a path outside the allowed prefix is refused naming the path",
     snap(body({"nfs": {"server": "10.1.2.3", "path": "/exports-of-others/x"}})), [], "Failed", "InvalidSpec",
     "spec.destination.nfs.path: '/exports-of-others/x' on 10.1.2.3 is not under an export path allowed "
     "for namespace team-a (/export)"),
    (".. cannot climb out of the allowed prefix",
     snap(body({"nfs": {"server": "10.1.2.3", "path": "/export/../etc"}})), [], "Failed", "InvalidSpec",
     "spec.destination.nfs.path"),
    # issue 15 (8): credentials only to Azure Storage or what the admin lists
    ("a plain http:// account URL is refused",
     snap(body(url="http://acct.blob.core.windows.net")), [], "Failed", "InvalidSpec",
     "spec.source.blob.accountURL: http://acct.blob.core.windows.net is not an allowed Blob endpoint"),
    ("a host that merely contains an Azure suffix is refused",
     snap(body(url="https://acct.blob.core.windows.net.evil.example")), [], "Failed", "InvalidSpec",
     "ask the cluster admin to add it to blob.allowedAccountURLs"),
    # issue 15 (1): a PV of our name that is not ours is never applied over
    ("a foreign PV holding the name is a conflict, nothing is created",
     snap(body(), volume={"metadata": {"name": f"trainop-{UID}", "resourceVersion": "7",
                                       "labels": {"trainop.io/datastage-uid": "someone-else"}}}),
     [], "Failed", "VolumeConflict", "its label trainop.io/datastage-uid is 'someone-else'"),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_decide(case):
    _, snapshot, actions, phase, reason, words = case
    out = decide(snapshot, CFG, NOW)
    assert summary(out.actions) == actions
    assert out.status["phase"] == phase
    ready = next(c for c in out.status["conditions"] if c["type"] == "Ready")
    assert ready["reason"] == reason and words in ready["message"]
    assert [r for _, r, _ in out.events] == [reason]  # the phase changed: one Event
    assert [t for t, _, _ in out.events] == ["Warning" if phase == "Failed" else "Normal"]
    # Secrets and PVs are not watched: a missing Secret (or key) or a foreign PV makes it look
    # again by itself
    # the stager's report is read, not watched: a copying stage looks again at its interval
    assert out.requeue_after == (SECRET_RECHECK_SECONDS if "Secret '" in words or "PersistentVolume" in words
                                 or reason == "VolumeConflict" else 5.0 if phase == "Copying" else None)


def test_provisioned_server_ready_gives_its_address_to_the_volume():
    b = body(PROVISION)
    svc = {"metadata": {"name": "imagenet-nfs", "resourceVersion": "3"},
           "spec": {"clusterIP": "10.96.0.9"}}
    sts = {"metadata": {"name": "imagenet-nfs", "resourceVersion": "4"},
           "status": {"readyReplicas": 1}}
    out = decide(snap(b, service=svc, statefulset=sts), CFG, NOW)
    assert summary(out.actions) == ["apply NetworkPolicy", "apply Service", "apply StatefulSet"] + COPY + ["create Job"]
    assert [a.live_version for a in out.actions[1:3]] == ["3", "4"]
    assert out.status["server"] == "10.96.0.9"
    pv = next(a.obj for a in out.actions if a.obj.get("kind") == "PersistentVolume")
    assert pv["spec"]["nfs"]["server"] == "10.96.0.9"
    assert next(a for a in out.actions if a.obj.get("kind") == "PersistentVolume").owner is None


def test_copy_complete_is_ready_with_one_event():
    name = _job_name()
    out = decide(snap(body(), copy_jobs=[copy_job(name, "Complete")]), CFG, NOW)
    assert summary(out.actions) == COPY  # the Job exists: not created again
    assert out.status["phase"] == "Ready" and out.status["claimName"] == "imagenet-data"
    assert [r for _, r, _ in out.events] == ["CopyComplete"]
    again = decide(snap(body(status=copy.deepcopy(out.status)),
                        copy_jobs=[copy_job(name, "Complete")]), CFG, NOW)
    assert again.events == [] and again.status == out.status  # nothing new: nothing to write


def test_copy_failed_says_the_stagers_last_error():
    name = _job_name()
    out = decide(snap(body(status={"lastError": "403 AuthorizationFailure"}),
                      copy_jobs=[copy_job(name, "Failed")]), CFG, NOW)
    assert out.status["phase"] == "Failed"
    assert "403 AuthorizationFailure" in out.events[0][2] and out.events[0][0] == "Warning"


def test_an_earlier_specs_copy_job_is_deleted():
    out = decide(snap(body(), copy_jobs=[copy_job("imagenet-copy-old")]), CFG, NOW)
    assert summary(out.actions)[-2:] == ["delete Job", "create Job"]


STAGE_REF = Ref("trainop.io/v1alpha1", "DataStage", "imagenet", "team-a", UID)


def test_the_finalizer_goes_on_before_any_child():
    """The reconcile's, not kopf's (a standby's kopf would act too: leader.py)."""
    out = decide(snap(body(finalizers=("example.com/keep",))), CFG, NOW)
    assert out.actions == [SetFinalizers(STAGE_REF, ("example.com/keep", FINALIZER), "5")]
    assert out.status is None


def test_deleting_stage_creates_nothing_deletes_its_pv_and_lets_go():
    out = decide(snap(body(deleting=True, finalizers=(FINALIZER, "example.com/keep"))), CFG, NOW)
    assert out.actions == [SetFinalizers(STAGE_REF, ("example.com/keep",), "5")]
    assert out.status is None
    ours = {"apiVersion": "v1", "kind": "PersistentVolume",
            "metadata": {"name": f"trainop-{UID}", "uid": "pv-uid", "labels": {"trainop.io/datastage-uid": UID}}}
    out = decide(snap(body(deleting=True), volume=ours), CFG, NOW)
    assert out.actions == [Delete(Ref("v1", "PersistentVolume", f"trainop-{UID}", None, "pv-uid")),
                           SetFinalizers(STAGE_REF, (), "5")]
    foreign = copy.deepcopy(ours)
    foreign["metadata"]["labels"] = {"trainop.io/datastage-uid": "someone-else"}
    out = decide(snap(body(deleting=True), volume=foreign), CFG, NOW)
    assert out.actions == [SetFinalizers(STAGE_REF, (), "5")]  # left alone
    assert decide(snap(body(deleting=True, finalizers=())), CFG, NOW).actions == []


def test_an_existing_claim_is_waited_for_then_copied_into():
    b = body({"volumeClaim": {"claimName": "team-data"}})
    out = decide(snap(b), CFG, NOW)
    assert (out.status["phase"], out.events[0][1], out.actions) == ("Pending", "ClaimMissing", [])
    out = decide(snap(b, claims={"team-data"}), CFG, NOW)
    assert summary(out.actions) == ["apply ServiceAccount", "apply Role", "apply RoleBinding",
                                    "apply ConfigMap", "create Job"]  # no NFS, no PV: the user's claim
    assert out.status["claimName"] == "team-data" and "volumeName" not in out.status


def test_the_pv_is_applied_only_with_our_uid_label_as_guard():
    out = decide(snap(body()), CFG, NOW)
    pv = next(a for a in out.actions if a.obj["kind"] == "PersistentVolume")
    assert pv.obj["metadata"]["name"] == f"trainop-{UID}" and pv.live_version == ""  # absent: POST
    assert pv.guard == ("trainop.io/datastage-uid", UID)
    ours = {"metadata": {"name": f"trainop-{UID}", "resourceVersion": "9",
                         "labels": {"trainop.io/datastage-uid": UID}}}
    again = decide(snap(body(), volume=ours), CFG, NOW)
    assert next(a for a in again.actions if a.obj["kind"] == "PersistentVolume").live_version == "9"
    assert again.status["phase"] == "Copying"


def test_admin_lists_open_other_endpoints_and_exports():
    cfg = config.from_dict({"blob": {"allowedAccountURLs": ["http://127.0.0.1:10000"]},
                            "datastage": {"allowedNfsExports": [{"server": "10.9.9.9", "path": "/",
                                                                 "namespaces": ["*"]}]}})
    b = body({"nfs": {"server": "10.9.9.9", "path": "/anything"}}, url="http://127.0.0.1:10000/devstoreaccount1")
    assert decide(snap(b), cfg, NOW).status["phase"] == "Copying"
    b = body(url="http://127.0.0.1:10001/devstoreaccount1")  # another port is another endpoint
    assert decide(snap(b), cfg, NOW).status["phase"] == "Failed"
    # provisioned servers are the admin's choice too (a server pod in the namespace): off
    out = decide(snap(body(PROVISION)), cfg, NOW)
    assert out.status["phase"] == "Failed" and out.actions == []
    assert out.status["conditions"][0]["message"].startswith(
        "spec.destination.provision: provisioned NFS servers are off in this cluster")
    assert "datastage.allowProvisionedServers" in out.status["conditions"][0]["message"]


def test_a_ganesha_servers_clients_follow_its_readers():
    """Issue 28: the export's client list is the readers' addresses (and datastage.nfsClientCIDRs,
    now optional), put on the running server pod as an annotation (the server reads it through the
    downward API), only when the pod says otherwise. A server without readers or subnets serves
    nobody, and is no error; the NetworkPolicy admits the readers' nodes too."""
    on = config.from_dict({"datastage": {"allowProvisionedServers": True}})
    b = body(PROVISION)
    readers = [("10.244.1.7", "10.224.0.5"), ("", "10.224.0.6")]
    out = decide(snap(b, readers=readers), on, NOW)  # no server pod yet: nothing to annotate
    assert out.status["phase"] == "Provisioning" and not [a for a in out.actions if isinstance(a, Patch)]
    (policy,) = [a.obj for a in out.actions if a.ref.kind == "NetworkPolicy"]
    assert policy["spec"]["ingress"][0]["from"][1:] == [{"ipBlock": {"cidr": "10.224.0.5/32"}},
                                                        {"ipBlock": {"cidr": "10.224.0.6/32"}}]
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "imagenet-nfs-0", "namespace": "team-a",
                                                           "uid": "pod-uid", "annotations": {}}}
    (patch,) = [a for a in decide(snap(b, readers=readers, server_pod=pod), on, NOW).actions if isinstance(a, Patch)]
    assert patch == Patch(Ref("v1", "Pod", "imagenet-nfs-0", "team-a", "pod-uid"),
                          {"metadata": {"annotations": {"trainop.io/nfs-clients": "10.224.0.5,10.224.0.6,10.244.1.7"}}})
    pod["metadata"]["annotations"] = {"trainop.io/nfs-clients": "10.224.0.5,10.224.0.6,10.244.1.7"}
    assert not [a for a in decide(snap(b, readers=readers, server_pod=pod), on, NOW).actions if isinstance(a, Patch)]
    # the readers go: nobody (an empty value, not a missing one)
    (patch,) = [a for a in decide(snap(b, readers=[], server_pod=pod), on, NOW).actions if isinstance(a, Patch)]
    assert patch.patch == {"metadata": {"annotations": {"trainop.io/nfs-clients": ""}}}
    going = {**pod, "metadata": {**pod["metadata"], "deletionTimestamp": NOW}}
    assert not [a for a in decide(snap(b, readers=[], server_pod=going), on, NOW).actions if isinstance(a, Patch)]
    # the kernel server has no client list to keep
    kernel = decide(snap(b, readers=readers, server_pod=pod),
                    config.from_dict({"datastage": {"allowProvisionedServers": True, "server": "kernel"}}), NOW)
    assert not [a for a in kernel.actions if isinstance(a, Patch)]


@pytest.mark.parametrize("account,namespace", [("platform-admin", "team-a"), ("default", "team-a"),
                                               ("reader-wi", "team-a")])
def test_the_copy_pod_runs_only_as_an_account_the_admin_lists(account, namespace):
    """Issue 22 (H3's DataStage twin): the copy pod runs as the named ServiceAccount and the
    stager's Role is bound to it, so only blob.allowedServiceAccounts may be named."""
    cfg = config.from_dict({"datastage": {"allowedNfsExports": [{"server": "10.1.2.3", "path": "/export",
                                                                 "namespaces": ["*"]}]},
                            "blob": {"allowedServiceAccounts": ["team-b/reader-wi"]}})
    auth = {"workloadIdentity": True, "serviceAccountName": account}
    out = decide(snap(body(auth=auth, namespace=namespace), service_accounts={account}), cfg, NOW)
    assert out.status["phase"] == "Failed" and out.actions == []
    message = out.status["conditions"][0]["message"]
    assert message.startswith("spec.source.blob.auth.serviceAccountName: ") and "blob.allowedServiceAccounts" in message
    allowed = decide(snap(body(auth=auth, namespace="team-b"), service_accounts={account}), cfg, NOW)
    assert allowed.status["phase"] == ("Copying" if account == "reader-wi" else "Failed")


# issue 22 M4: an export is whose the admin says (the copy Job mounts it read-write)
@pytest.mark.parametrize("namespace,destination,field", [
    ("team-b", {"nfs": {"server": "10.1.2.3", "path": "/export/data"}}, "spec.destination.nfs.server"),
    ("team-b", {"nfs": {"server": "10.1.2.4", "path": "/tenants/team-a/data"}}, "spec.destination.nfs.path"),
    ("team-b", {"nfs": {"server": "10.1.2.4", "path": "/tenants/team-b/../team-a"}}, "spec.destination.nfs.path"),
    ("team", {"nfs": {"server": "10.1.2.4", "path": "/tenants/team-a"}}, "spec.destination.nfs.path"),
], ids=["listed-for-another", "another's-folder", "dotdot", "name-prefix"])
def test_another_namespaces_export_is_refused(namespace, destination, field):
    out = decide(snap(body(destination, namespace=namespace)), CFG, NOW)
    assert out.status["phase"] == "Failed" and out.actions == []
    assert out.status["conditions"][0]["message"].startswith(f"{field}: ")
    ok = body({"nfs": {"server": "10.1.2.4", "path": f"/tenants/{namespace}/data"}}, namespace=namespace)
    assert decide(snap(ok), CFG, NOW).status["phase"] == "Copying"


@pytest.mark.parametrize("option", ["addr=10.9.9.9", "mountaddr=10.9.9.9", "port=2050", "rw", "suid",
                                    "context=system_u:object_r:container_file_t:s0", "nfsvers"])
def test_mount_options_outside_the_allow_list_are_refused(option):
    b = body()
    b["spec"]["destination"]["mountOptions"] = ["nfsvers=4.1", "hard", option]
    out = decide(snap(b), CFG, NOW)
    assert out.status["phase"] == "Failed" and out.actions == []
    assert out.status["conditions"][0]["message"].startswith(
        f"spec.destination.mountOptions[2]: {option!r} is not an allowed NFS mount option")
    b["spec"]["destination"]["mountOptions"] = ["nfsvers=4.1", "hard", "nconnect=8", "noatime", "ro"]
    assert decide(snap(b), CFG, NOW).status["phase"] == "Copying"


def test_an_export_without_an_owner_is_a_config_error():
    with pytest.raises(config.ConfigError, match=r"datastage.allowedNfsExports\[0\]: say which namespaces"):
        config.from_dict({"datastage": {"allowedNfsExports": [{"server": "10.1.2.3", "path": "/export"}]}})


# issue 15 (11b): the Secret is needed only while there is copying to do
@pytest.mark.parametrize("secrets", [{}, {"storage": ("other",)}], ids=["Secret deleted", "key removed"])
def test_a_copied_stage_stays_ready_without_its_secret(secrets):
    out = decide(snap(body(), secrets=secrets, copy_jobs=[copy_job(_job_name(), "Complete")]), CFG, NOW)
    assert out.status["phase"] == "Ready" and out.requeue_after is None
    # ... but a new copy (the Job deleted to retry) needs it again
    out = decide(snap(body(), secrets=secrets), CFG, NOW)
    assert out.status["phase"] == "Failed" and out.actions == []


def test_ready_says_how_many_blobs_were_skipped():
    out = decide(snap(body(status={"skippedBlobs": 2}), copy_jobs=[copy_job(_job_name(), "Complete")]), CFG, NOW)
    assert out.status["phase"] == "Ready" and "2 blob(s) skipped, see status.skipped" in out.events[0][2]


def test_a_released_pv_of_ours_is_freed_for_its_claim_made_again():
    """Someone deleted the claim; Apply made it again; the PV still names the old claim's uid
    (the binder's), so it would stay Released: the uid goes, and the binder binds them."""
    released = {"apiVersion": "v1", "kind": "PersistentVolume", "status": {"phase": "Released"},
                "metadata": {"name": f"trainop-{UID}", "uid": "pv-uid", "resourceVersion": "9",
                             "labels": {"trainop.io/datastage-uid": UID}}}
    out = decide(snap(body(), volume=released), CFG, NOW)
    patch = [a for a in out.actions if isinstance(a, Patch)]
    assert patch == [Patch(Ref("v1", "PersistentVolume", f"trainop-{UID}", None, "pv-uid"),
                           {"spec": {"claimRef": {"uid": None, "resourceVersion": None}}})]
    bound = {**released, "status": {"phase": "Bound"}}
    assert not [a for a in decide(snap(body(), volume=bound), CFG, NOW).actions if isinstance(a, Patch)]


def report(**status) -> dict:
    return {"metadata": {"name": "imagenet-progress", "ownerReferences": [{"controller": True, "uid": UID}]},
            "data": {"status": json.dumps(status)}}


def test_the_stagers_report_becomes_the_status_checked():
    """Left from issue 15: the stager reports into a ConfigMap; the operator checks it and writes
    the status (the stager's identity has no right on the DataStage)."""
    out = decide(snap(body(), progress=report(bytesCopied=50, bytesTotal=200, filesCopied=1, filesTotal=4,
                                              skippedBlobs=1, skipped=["a//b: maps to the same file"])), CFG, NOW)
    assert out.status["phase"] == "Copying"
    assert {k: out.status[k] for k in ("bytesCopied", "bytesTotal", "filesCopied", "filesTotal", "progress")} == \
        {"bytesCopied": 50, "bytesTotal": 200, "filesCopied": 1, "filesTotal": 4, "progress": "1/4 files, 25%"}
    name = _job_name()
    failed = decide(snap(body(), copy_jobs=[copy_job(name, "Failed")],
                         progress=report(lastError="authentication failed (403)\nmore")), CFG, NOW)
    assert failed.status["lastError"] == "authentication failed (403)"
    assert "failed: authentication failed (403); fix the cause" in failed.status["conditions"][-1]["message"]
    ok = decide(snap(body(status={"lastError": "old"}), copy_jobs=[copy_job(name, "Complete")],
                     progress=report(lastError=None, skippedBlobs=2)), CFG, NOW)
    assert ok.status["lastError"] is None and "2 blob(s) skipped" in ok.events[0][2]


@pytest.mark.parametrize("forged", [
    {"phase": "Ready", "bytesCopied": -1, "filesTotal": True, "conditions": [], "claimName": "other"},
    "not an object", {"skipped": "x" * 20000},
], ids=["keys", "shape", "size"])
def test_a_forged_report_cannot_set_what_the_operator_decides(forged):
    cm = report()
    cm["data"]["status"] = json.dumps(forged)
    out = decide(snap(body(), progress=cm), CFG, NOW)
    assert out.status["phase"] == "Copying" and out.status["claimName"] == "imagenet-data"
    assert not {"bytesCopied", "filesTotal", "skipped"} & set(out.status)


def test_a_look_alike_config_map_not_owned_by_the_stage_is_not_read():
    cm = report(bytesCopied=5, bytesTotal=5, filesCopied=1, filesTotal=1)
    cm["metadata"]["ownerReferences"] = [{"controller": True, "uid": "someone-else"}]
    assert "bytesCopied" not in decide(snap(body(), progress=cm), CFG, NOW).status


def test_a_stage_spec_too_large_for_the_shared_operator_fails_naming_spec():
    """Issue 22 M7: the caches keep a DataStage spec above spec.MAX_SPEC_BYTES as its size only
    (handlers/indexes.slim_owner); decide fails it, creating nothing."""
    b = body()
    b["spec"]["source"]["blob"]["prefixes"] = [f"{i:06d}/" + "p" * 200 for i in range(1000)]
    del b["spec"]["source"]["blob"]["prefix"]
    for held in (b, indexes.slim_owner(b)):
        out = decide(snap(held), CFG, NOW)
        assert out.status["phase"] == "Failed" and out.actions == []
        assert out.status["conditions"][0]["message"].startswith("spec: is 205 KiB of JSON")
    assert len(repr(indexes.slim_owner(b))) < 2048
