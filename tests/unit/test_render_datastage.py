"""render/datastage.py and blob.py's spec side: DataStage spec -> manifests, explicit values."""

from __future__ import annotations

import copy

import pytest

from trainop import blob, config, crds
from trainop.render import datastage as render
from trainop.spec import SpecError, parse_stage

ACCOUNT = "https://acct.blob.core.windows.net"
CFG = config.from_dict(None)
SAS = {"sasSecretRef": {"name": "storage", "key": "sas"}}
WI = {"workloadIdentity": True, "serviceAccountName": "reader-wi"}
UID = "0b6c3a1e-2f0d-4c55-9a43-6f1f2d7c9e10"
SYSTEM_POOL = {"nodeSelector": {"kubernetes.azure.com/agentpool": "system"}}


def body(destination: dict | None = None, auth: dict | None = SAS, **spec) -> dict:
    source = {"accountURL": ACCOUNT, "container": "imagenet", "prefix": "train/"}
    if auth is not None:
        source["auth"] = auth
    return {"apiVersion": "trainop.io/v1alpha1", "kind": "DataStage",
            "metadata": {"name": "imagenet", "namespace": "team-a", "uid": UID},
            "spec": {"source": {"blob": source},
                     "destination": destination or {"nfs": {"server": "10.1.2.3", "path": "/export/data"}},
                     **spec}}


def test_parse_fills_schema_defaults():
    stage = parse_stage(body())
    assert (stage.prefixes, stage.capacity, stage.mount_options) == (("train/",), "1Ti", ("nfsvers=4.1", "hard"))
    assert (stage.verify, stage.extract, stage.concurrency, stage.range_concurrency, stage.backoff_limit) == \
        (True, False, 16, 4, 2)
    assert stage.auth == blob.BlobAuth("SASToken", secret_name="storage", secret_key="sas")
    assert crds.validate(crds.default(body())) == []


@pytest.mark.parametrize("url,field,words", [
    (ACCOUNT + "/?sv=2024&sig=abc", "spec.source.blob.accountURL", "must not carry a query string"),
    ("https://", "spec.source.blob.accountURL", "is not an http(s) URL"),
    ("http://127.0.0.1:10000/", "spec.source.blob.accountURL", "cannot tell the storage account"),
])
def test_bad_account_url_names_the_field(url, field, words):
    obj = body()
    obj["spec"]["source"]["blob"]["accountURL"] = url
    with pytest.raises(SpecError) as err:
        parse_stage(obj)
    assert err.value.field == field and words in str(err.value)
    assert "abc" not in str(err.value)  # a pasted SAS signature is not echoed back


@pytest.mark.parametrize("auth,field", [
    ({"workloadIdentity": True, "sasSecretRef": {"name": "s", "key": "k"}}, "spec.source.blob.auth"),
    ({"workloadIdentity": False}, "spec.source.blob.auth"),
    ({"accountKeySecretRef": {"name": "s"}}, "spec.source.blob.auth.accountKeySecretRef.key"),
])
def test_bad_auth_names_the_field(auth, field):
    with pytest.raises(SpecError) as err:
        parse_stage(body(auth=auth))
    assert err.value.field == field


def test_auth_defaults_to_workload_identity_and_env_never_holds_a_value():
    assert parse_stage(body(auth=None)).auth == blob.BlobAuth("WorkloadIdentity")
    assert blob.BlobAuth("WorkloadIdentity", service_account_name="x").container_env() == \
        [{"name": "TRAINOP_BLOB_AUTH_METHOD", "value": "WorkloadIdentity"}]
    env = blob.parse_auth({"connectionStringSecretRef": {"name": "cs", "key": "conn"}}, "a").container_env()
    assert env == [{"name": "TRAINOP_BLOB_AUTH_METHOD", "value": "ConnectionString"},
                   {"name": "TRAINOP_BLOB_SECRET", "valueFrom": {"secretKeyRef": {"name": "cs", "key": "conn"}}}]


def test_redact_removes_signatures_and_secret_values():
    line = blob.redact("GET /c?sv=1&sig=s3cr3t%3D&se=2 AccountKey=abc==;x my-token", "my-token")
    assert line == "GET /c?sv=1&sig=<redacted>&se=2 AccountKey=<redacted>;x <redacted>"


def test_existing_export_volume_is_read_only_and_prebound():
    pv, pvc = render.volume_objects(parse_stage(body()), "10.1.2.3")
    assert pv == {
        "apiVersion": "v1", "kind": "PersistentVolume",
        # named from the uid: team-a/x and team/a-x can no longer share a PV name
        "metadata": {"name": f"trainop-{UID}",
                     "labels": {"trainop.io/datastage": "imagenet", "trainop.io/role": "volume",
                                "trainop.io/datastage-namespace": "team-a", "trainop.io/datastage-uid": UID}},
        "spec": {"capacity": {"storage": "1Ti"}, "accessModes": ["ReadOnlyMany"],
                 "persistentVolumeReclaimPolicy": "Retain", "storageClassName": "",
                 "nfs": {"server": "10.1.2.3", "path": "/export/data", "readOnly": True},
                 "claimRef": {"apiVersion": "v1", "kind": "PersistentVolumeClaim",
                              "namespace": "team-a", "name": "imagenet-data"},
                 "mountOptions": ["nfsvers=4.1", "hard"]},
    }
    assert pvc == {
        "apiVersion": "v1", "kind": "PersistentVolumeClaim",
        "metadata": {"name": "imagenet-data", "namespace": "team-a",
                     "labels": {"trainop.io/datastage": "imagenet", "trainop.io/role": "volume"}},
        "spec": {"accessModes": ["ReadOnlyMany"], "storageClassName": "", "volumeName": f"trainop-{UID}",
                 "resources": {"requests": {"storage": "1Ti"}}},
    }


def test_copy_job_mounts_the_export_read_write_and_gets_the_secret_by_reference():
    stage = parse_stage(body(extract=True))
    job = render.copy_job(stage, "10.1.2.3", CFG)
    assert job["metadata"]["name"] == f"imagenet-copy-{stage.spec_digest}"
    pod = job["spec"]["template"]["spec"]
    assert job["spec"]["backoffLimit"] == 2
    assert pod["restartPolicy"] == "Never" and pod["serviceAccountName"] == "imagenet-stager"
    assert pod["securityContext"] == {"runAsUser": 10001, "runAsGroup": 10001, "runAsNonRoot": True,
                                      "seccompProfile": {"type": "RuntimeDefault"}}
    assert pod["nodeSelector"] == SYSTEM_POOL["nodeSelector"]
    assert pod["volumes"] == [{"name": "share", "nfs": {"server": "10.1.2.3", "path": "/export/data"}}]
    (container,) = pod["containers"]
    assert container["command"] == ["python", "-m", "trainop.stager"]
    assert container["args"] == [
        "--account-url", ACCOUNT, "--container", "imagenet", "--dest", "/share", "--concurrency", "16",
        "--range-concurrency", "4", "--progress-configmap", "team-a/imagenet-progress", "--progress-interval", "5",
        "--prefix", "train/", "--verify", "--extract"]
    assert container["env"] == [
        {"name": "TRAINOP_BLOB_AUTH_METHOD", "value": "SASToken"},
        {"name": "TRAINOP_BLOB_SECRET", "valueFrom": {"secretKeyRef": {"name": "storage", "key": "sas"}}}]
    assert container["volumeMounts"] == [{"name": "share", "mountPath": "/share"}]
    assert container["terminationMessagePolicy"] == "FallbackToLogsOnError"
    assert job["spec"]["template"]["metadata"]["labels"] == {"trainop.io/datastage": "imagenet", "trainop.io/role": "copy"}


def test_a_spec_change_renames_the_copy_job_and_metadata_does_not():
    first = parse_stage(body())
    relabelled = body()
    relabelled["metadata"]["labels"] = {"team": "vision"}
    assert render.copy_job_name(parse_stage(relabelled)) == render.copy_job_name(first)
    assert render.copy_job_name(parse_stage(body(verify=False))) != render.copy_job_name(first)


def test_stager_identity_may_patch_only_its_progress_config_map():
    """Issue 15/22: never the DataStage's status (tests/cluster/test_datastage_tenancy.py tries it)."""
    sa, role, binding = render.rbac_objects(parse_stage(body()))
    assert sa == {"apiVersion": "v1", "kind": "ServiceAccount",
                  "metadata": {"name": "imagenet-stager", "namespace": "team-a",
                               "labels": {"trainop.io/datastage": "imagenet", "trainop.io/role": "copy"}}}
    assert role["rules"] == [{"apiGroups": [""], "resources": ["configmaps"],
                              "resourceNames": ["imagenet-progress"], "verbs": ["patch"]}]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "imagenet-stager", "namespace": "team-a"}]


def test_workload_identity_uses_the_federated_account_and_label():
    stage = parse_stage(body(auth=WI))
    objs = render.rbac_objects(stage)
    assert [o["kind"] for o in objs] == ["Role", "RoleBinding"]  # the user owns the ServiceAccount
    assert objs[1]["subjects"][0]["name"] == "reader-wi"
    pod = render.copy_job(stage, "10.1.2.3", CFG)["spec"]["template"]
    assert pod["spec"]["serviceAccountName"] == "reader-wi"
    assert pod["metadata"]["labels"]["azure.workload.identity/use"] == "true"
    assert pod["spec"]["containers"][0]["env"] == [{"name": "TRAINOP_BLOB_AUTH_METHOD", "value": "WorkloadIdentity"}]


def test_provisioned_server_statefulset_service_and_volume_on_cluster_ip():
    stage = parse_stage(body({"provision": {"size": "512Gi", "storageClassName": "managed-csi-premium"}}))
    assert render.server_objects(parse_stage(body()), CFG) == []
    cfg = config.from_dict({"datastage": {"nfsClientCIDRs": ["10.224.0.0/16", "10.225.1.0/24"]}})
    service, sts = render.server_objects(stage, cfg)
    lbl = {"trainop.io/datastage": "imagenet", "trainop.io/role": "nfs-server"}
    assert service["metadata"]["name"] == "imagenet-nfs"
    assert service["spec"] == {"type": "ClusterIP", "selector": lbl,
                               "ports": [{"name": "nfs", "port": 2049, "targetPort": 2049, "protocol": "TCP"}]}
    # once the PV exists (status.server), a Service made again asks for the PV's address
    again, _ = render.server_objects(stage, CFG, "10.96.7.7")
    assert again["spec"] == {**service["spec"], "clusterIP": "10.96.7.7"}
    spec = sts["spec"]
    assert (spec["replicas"], spec["serviceName"], spec["selector"]) == (1, "imagenet-nfs", {"matchLabels": lbl})
    assert spec["persistentVolumeClaimRetentionPolicy"] == {"whenDeleted": "Delete", "whenScaled": "Retain"}
    assert spec["volumeClaimTemplates"] == [{
        "metadata": {"name": "export", "labels": lbl},
        "spec": {"accessModes": ["ReadWriteOnce"], "storageClassName": "managed-csi-premium",
                 "resources": {"requests": {"storage": "512Gi"}}}}]
    pod = spec["template"]["spec"]
    (container,) = pod["containers"]
    # NFS-Ganesha by default: non-root, one capability, read-only root filesystem
    assert container["image"] == "trainop/nfs-server:0.2.0"
    assert container["volumeMounts"] == [{"name": "export", "mountPath": "/exports"},
                                         {"name": "run", "mountPath": "/run/ganesha"},
                                         {"name": "tmp", "mountPath": "/tmp"},
                                         {"name": "clients", "mountPath": "/etc/trainop/nfs-clients", "readOnly": True}]
    assert container["securityContext"] == {
        "runAsUser": 10002, "runAsGroup": 10002, "runAsNonRoot": True, "allowPrivilegeEscalation": True,
        "readOnlyRootFilesystem": True, "capabilities": {"drop": ["ALL"], "add": ["DAC_READ_SEARCH"]},
        # containerd's RuntimeDefault refuses open_by_handle_at (tests/e2e/test_nfs_ganesha.py)
        "seccompProfile": {"type": "Unconfined"}}
    assert pod["securityContext"] == {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}}
    assert pod["volumes"] == [*({"name": n, "emptyDir": {"medium": "Memory", "sizeLimit": "16Mi"}} for n in ("run", "tmp")),
                              # the pod's own annotation, not an env var: a new list reaches the
                              # running server (the kubelet rewrites the file on a pod update)
                              {"name": "clients", "downwardAPI": {"items": [{
                                  "path": "clients", "fieldRef": {"fieldPath": "metadata.annotations['trainop.io/nfs-clients']"}}]}}]
    local = {"type": "Localhost", "localhostProfile": "profiles/ganesha.json"}
    cfg_local = config.from_dict({"datastage": {"nfsClientCIDRs": ["10.224.0.0/16"], "nfsServerSeccompProfile": local}})
    local_sts = render.server_objects(stage, cfg_local)[1]
    assert local_sts["spec"]["template"]["spec"]["containers"][0]["securityContext"]["seccompProfile"] == local
    assert container["env"] == [{"name": "EXPORT_DIR", "value": "/exports"},
                                {"name": "CLIENTS_FILE", "value": "/etc/trainop/nfs-clients/clients"},
                                {"name": "RUN_DIR", "value": "/run/ganesha"}]
    # the template does not change with the clients: a new reader never restarts the server
    assert render.server_objects(stage, CFG)[1]["spec"]["template"] == sts["spec"]["template"]
    assert render.server_address(stage, {"spec": {"clusterIP": "10.96.0.77"}}) == "10.96.0.77"
    assert render.server_address(stage, {"spec": {}}) is None
    pv, _ = render.volume_objects(stage, "10.96.0.77")
    assert pv["spec"]["nfs"] == {"server": "10.96.0.77", "path": "/", "readOnly": True}
    assert pv["spec"]["capacity"] == {"storage": "512Gi"}
    # what the kubelet's mount needs from our own server: NFSv4.1 (docs/datastage.md), the CRD's
    # default; a DataStage that drops the version still gets it, one that names its own keeps it
    assert pv["spec"]["mountOptions"] == ["nfsvers=4.1", "hard"]
    bare = parse_stage(body({"provision": {"size": "1Gi"}, "mountOptions": ["hard"]}))
    assert render.volume_objects(bare, "10.96.0.77")[0]["spec"]["mountOptions"] == ["nfsvers=4.1", "hard"]
    own = parse_stage(body({"provision": {"size": "1Gi"}, "mountOptions": ["vers=4.2", "hard"]}))
    assert render.volume_objects(own, "10.96.0.77")[0]["spec"]["mountOptions"] == ["vers=4.2", "hard"]


def test_kernel_server_only_where_the_admin_chooses_it():
    stage = parse_stage(body({"provision": {"size": "1Gi"}}))
    cfg = config.from_dict({"datastage": {"server": "kernel"}})
    (container,) = render.server_objects(stage, cfg)[1]["spec"]["template"]["spec"]["containers"]
    assert container["image"] == "trainop/nfs-server-kernel:0.1.0"
    assert container["securityContext"] == {"privileged": True}
    assert container["env"] == [{"name": "EXPORT_OWNER", "value": "10001:10001"},  # the copy's user
                                {"name": "EXPORT_OPTIONS", "value": "ro,fsid=0,sync,no_subtree_check,root_squash"}]
    with pytest.raises(config.ConfigError, match=r"datastage.server: 'nfsd' is not one of ganesha, kernel"):
        config.from_dict({"datastage": {"server": "nfsd"}})


def test_copy_pod_gets_the_provisioned_disk_through_its_fs_group_only():
    """Ganesha runs as non-root and cannot chown the fresh disk: the copy pod's fsGroup makes it
    writable. Never on an existing claim or export (it would regroup someone else's data)."""
    provisioned = render.copy_job(parse_stage(body({"provision": {"size": "1Gi"}})), "10.96.0.1", CFG)
    assert provisioned["spec"]["template"]["spec"]["securityContext"] == {
        "runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}, "runAsUser": 10001,
        "runAsGroup": 10001, "fsGroup": 10001, "fsGroupChangePolicy": "OnRootMismatch"}
    claim = render.copy_job(parse_stage(body({"volumeClaim": {"claimName": "c"}})), None, CFG)
    assert "fsGroup" not in claim["spec"]["template"]["spec"]["securityContext"]


def test_operator_configuration_overrides_images():
    cfg = config.from_dict({"datastage": {"image": "registry.example/trainop:9", "nfsServerImage": "registry.example/nfs:9",
                                          "securityContext": {"runAsUser": 2000}}})
    stage = parse_stage(body({"provision": {"size": "1Gi"}}))
    assert render.copy_job(stage, "10.0.0.1", cfg)["spec"]["template"]["spec"]["containers"][0]["image"] == "registry.example/trainop:9"
    sts = render.server_objects(stage, cfg)[1]
    assert sts["spec"]["template"]["spec"]["containers"][0]["image"] == "registry.example/nfs:9"
    assert "storageClassName" not in sts["spec"]["volumeClaimTemplates"][0]["spec"]
    copy_pod = render.copy_job(stage, "10.0.0.1", cfg)["spec"]["template"]["spec"]
    assert copy_pod["securityContext"]["fsGroup"] == 2000


def test_render_is_pure():
    obj = body()
    before = copy.deepcopy(obj)
    stage = parse_stage(obj)
    assert render.copy_objects(stage, "10.1.2.3", CFG) == render.copy_objects(parse_stage(obj), "10.1.2.3", CFG)
    assert obj == before


def test_provisioned_copy_writes_the_servers_disk_on_its_node():
    """The server exports read-only; the copy pod mounts the server's own disk claim (RWO: so it
    runs where the server runs), which also keeps it inside the `restricted` profile."""
    stage = parse_stage(body({"provision": {"size": "1Gi"}}))
    pod = render.copy_job(stage, "10.96.0.77", CFG)["spec"]["template"]["spec"]
    assert pod["volumes"] == [{"name": "share", "persistentVolumeClaim": {"claimName": "export-imagenet-nfs-0"}}]
    assert pod["affinity"] == {"podAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [{
        "labelSelector": {"matchLabels": {"trainop.io/datastage": "imagenet", "trainop.io/role": "nfs-server"}},
        "topologyKey": "kubernetes.io/hostname"}]}}
    assert "affinity" not in render.copy_job(parse_stage(body()), "10.1.2.3", CFG)["spec"]["template"]["spec"]


def test_export_clients_are_the_readers_pods_and_nodes_and_the_configured_subnets():
    """Issue 28: the Ganesha export serves the readers' pod addresses (a client in the pod), their
    nodes' addresses (the kubelet mounts the PV from its node) and datastage.nfsClientCIDRs;
    sorted and without repeats, so the server pod's annotation changes only when the set does."""
    cfg = config.from_dict({"datastage": {"nfsClientCIDRs": ["10.224.0.0/16"]}})
    readers = [("10.244.1.7", "10.224.0.5"), ("10.244.1.8", "10.224.0.5"), ("", "10.224.0.6"), ("", "")]
    clients = render.export_clients(cfg, readers)
    assert clients == ["10.224.0.0/16", "10.224.0.5", "10.224.0.6", "10.244.1.7", "10.244.1.8"]
    assert render.export_clients(CFG, []) == []  # no reader, no subnet: nobody may mount
    assert render.clients_annotation(clients) == "10.224.0.0/16,10.224.0.5,10.224.0.6,10.244.1.7,10.244.1.8"
    assert render.clients_annotation([]) == ""


def test_network_policy_admits_the_stages_job_pods_their_nodes_and_the_configured_node_subnets():
    stage = parse_stage(body({"provision": {"size": "1Gi"}}))
    assert render.network_policy(parse_stage(body()), CFG) is None  # an existing export: not ours
    cfg = config.from_dict({"datastage": {"nfsClientCIDRs": ["10.224.0.0/16"]}})
    with_nodes = render.network_policy(stage, cfg, [("10.244.1.7", "10.224.0.9"), ("", "fd00::5"), ("10.244.1.8", "")])
    assert with_nodes["spec"]["ingress"][0]["from"][1:] == [
        {"ipBlock": {"cidr": "10.224.0.0/16"}}, {"ipBlock": {"cidr": "10.224.0.9/32"}}, {"ipBlock": {"cidr": "fd00::5/128"}}]
    policy = render.network_policy(stage, cfg)
    assert policy["metadata"] == {"name": "imagenet-nfs", "namespace": "team-a",
                                  "labels": {"trainop.io/datastage": "imagenet", "trainop.io/role": "nfs-server"}}
    assert policy["spec"] == {
        "podSelector": {"matchLabels": {"trainop.io/datastage": "imagenet", "trainop.io/role": "nfs-server"}},
        "policyTypes": ["Ingress"],
        "ingress": [{"from": [{"podSelector": {"matchLabels": {"trainop.io/reads-datastage": "imagenet"}}},
                              {"ipBlock": {"cidr": "10.224.0.0/16"}}],
                     "ports": [{"protocol": "TCP", "port": 2049}]}]}
