"""spec.podTemplate: the merge into rendered pods (render/overrides.py) and what spec.parse
refuses (the admin's podTemplate.allow, conflicts with the operator's own fields)."""

import copy

import pytest

from trainop import config
from trainop.render import common, dtj
from trainop.spec import SpecError, parse

# the Secrets WORKER references: an admin's list (podTemplate.allow.secrets)
CFG = config.from_dict({"podTemplate": {"allow": {"secrets": ["registry", "t"]}}})
NO_GPUS = {"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"}
GPU_TOL = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}

WORKER = {
    "metadata": {"labels": {"team": "vision"}, "annotations": {"example.com/owner": "ana"}},
    "spec": {
        "volumes": [{"name": "datasets", "persistentVolumeClaim": {"claimName": "imagenet"}},
                    {"name": "settings", "configMap": {"name": "train-settings"}}],
        "imagePullSecrets": [{"name": "registry"}],
        "nodeSelector": {"example.com/zone": "1"},
        "affinity": {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
            {"weight": 1, "podAffinityTerm": {"topologyKey": "kubernetes.io/hostname",
                                              "labelSelector": {"matchLabels": {"team": "vision"}}}}]}},
        "tolerations": [{"key": "example.com/dedicated", "operator": "Exists"}, GPU_TOL],
        "initContainers": [{"name": "fetch", "image": "busybox", "command": ["true"]}],
        "containers": [
            {"name": "worker",
             "env": [{"name": "API_TOKEN", "valueFrom": {"secretKeyRef": {"name": "t", "key": "k"}}}],
             "envFrom": [{"configMapRef": {"name": "train-settings"}, "prefix": "SETTINGS_"}],
             "volumeMounts": [{"name": "settings", "mountPath": "/settings"}],
             "securityContext": {"readOnlyRootFilesystem": True}},
            {"name": "exporter", "image": "exporter:1", "resources": {"requests": {"cpu": "10m"}},
             "volumeMounts": [{"name": "settings", "mountPath": "/settings"}]},
        ],
    },
}


def job(cfg=CFG, **spec):
    return parse({"metadata": {"name": "j1", "namespace": "team-a"}, "spec": spec}, cfg)


def refused(field, cfg=CFG, **spec):
    with pytest.raises(SpecError) as err:
        job(cfg, **spec)
    assert err.value.field == field, str(err.value)
    return str(err.value)


def test_worker_override_merges_every_field():
    j = job(workers=2, gpusPerWorker=1, podTemplate={"worker": WORKER})
    pod = dtj.render_worker(j, 1, 0)
    plain = dtj.render_worker(job(workers=2, gpusPerWorker=1), 1, 0)
    meta, spec = pod["metadata"], pod["spec"]
    assert meta["labels"] == plain["metadata"]["labels"] | {"team": "vision"}
    assert meta["annotations"] == {"example.com/owner": "ana"}
    assert spec["volumes"] == plain["spec"]["volumes"] + WORKER["spec"]["volumes"]
    assert spec["imagePullSecrets"] == [{"name": "registry"}]
    assert spec["nodeSelector"] == {"kubernetes.azure.com/agentpool": "gpu", "example.com/zone": "1"}
    assert spec["affinity"] == WORKER["spec"]["affinity"]
    # the pool's toleration once, the user's added
    assert spec["tolerations"] == [GPU_TOL, {"key": "example.com/dedicated", "operator": "Exists"}]
    assert spec["initContainers"] == [{"name": "fetch", "image": "busybox", "command": ["true"],
                                       "securityContext": common.container_security_context(),
                                       "env": [NO_GPUS]}]  # no GPU limit: no GPU
    worker, exporter = spec["containers"]
    base = plain["spec"]["containers"][0]
    assert worker["env"] == base["env"] + WORKER["spec"]["containers"][0]["env"]
    assert worker["envFrom"] == [{"configMapRef": {"name": "train-settings"}, "prefix": "SETTINGS_"}]
    assert worker["volumeMounts"] == base["volumeMounts"] + [{"name": "settings", "mountPath": "/settings"}]
    assert worker["securityContext"] == base["securityContext"] | {"readOnlyRootFilesystem": True}
    assert worker["image"] == base["image"] and worker["command"] == base["command"]
    assert exporter == WORKER["spec"]["containers"][1] | {
        "securityContext": common.container_security_context(), "env": [NO_GPUS]}
    # the job's own selectors still match its pods
    assert dtj.render_service(j)["spec"]["selector"].items() <= meta["labels"].items()


def test_launcher_override_goes_on_the_launcher_pod_only():
    launcher = {"metadata": {"labels": {"team": "vision"}},
                "spec": {"imagePullSecrets": [{"name": "registry"}],
                         "containers": [{"name": "launcher", "env": [{"name": "EXTRA", "value": "1"}]}]}}
    j = job(podTemplate={"launcher": launcher})
    out = dtj.render_launcher(j, 0)
    template = out["spec"]["template"]
    assert template["metadata"]["labels"]["team"] == "vision"
    assert "team" not in out["metadata"]["labels"]  # the Job object keeps the operator's labels
    assert template["spec"]["imagePullSecrets"] == [{"name": "registry"}]
    assert template["spec"]["containers"][0]["env"][-1] == {"name": "EXTRA", "value": "1"}
    assert dtj.render_worker(j, 0, 0) == dtj.render_worker(job(), 0, 0)


def test_same_block_for_both_roles_and_the_input_is_not_mutated():
    block = {"metadata": {"labels": {"team": "vision"}},
             "spec": {"volumes": [{"name": "scratch", "emptyDir": {}}]}}
    before = copy.deepcopy(block)
    j = job(podTemplate={"worker": block, "launcher": block})
    for pod_spec in (dtj.render_worker(j, 0, 0)["spec"],
                     dtj.render_launcher(j, 0)["spec"]["template"]["spec"]):
        assert pod_spec["volumes"][-1] == {"name": "scratch", "emptyDir": {}}
    dtj.render_worker(j, 0, 0)  # rendering twice adds nothing twice
    assert dtj.render_worker(j, 0, 0)["spec"]["volumes"].count({"name": "scratch", "emptyDir": {}}) == 1
    assert block == before


def test_priority_class_of_the_template_becomes_the_jobs():
    j = job(podTemplate={"worker": {"spec": {"priorityClassName": "high"}},
                         "launcher": {"spec": {"priorityClassName": "high"}}})
    assert j.priority_class_name == "high"
    refused("spec.podTemplate.worker.spec.priorityClassName", priorityClassName="low",
            podTemplate={"worker": {"spec": {"priorityClassName": "high"}}})
    refused("spec.podTemplate.launcher.spec.priorityClassName",
            podTemplate={"worker": {"spec": {"priorityClassName": "high"}},
                         "launcher": {"spec": {"priorityClassName": "low"}}})


@pytest.mark.parametrize("override, field, says", [
    ({"metadata": {"labels": {"trainop.io/role": "x"}}},
     "spec.podTemplate.worker.metadata.labels[trainop.io/role]", "trainop.io/"),
    ({"spec": {"volumes": [{"name": "ok", "emptyDir": {}}, {"name": "ssh", "emptyDir": {}}]}},
     "spec.podTemplate.worker.spec.volumes[1].name", "choose another name"),
    ({"spec": {"containers": [{"name": "worker", "env": [{"name": "NCCL_IB_DISABLE", "value": "0"}]}]}},
     "spec.podTemplate.worker.spec.containers[0].env[0].name", "set by the operator"),
    ({"spec": {"containers": [{"name": "worker", "env": [{"name": "OMPI_COMM_WORLD_RANK", "value": "0"}]}]}},
     "spec.podTemplate.worker.spec.containers[0].env[0].name", "choose another name"),
    ({"spec": {"containers": [{"name": "worker", "env": [{"name": "RANK", "value": "0"}]}]}},
     "spec.podTemplate.worker.spec.containers[0].env[0].name", "choose another name"),
    ({"spec": {"containers": [{"name": "worker", "image": "other"}]}},
     "spec.podTemplate.worker.spec.containers[0].image", "spec.image"),
    ({"spec": {"containers": [{"name": "worker", "volumeMounts": [{"name": "shm", "mountPath": "/output"}]}]}},
     "spec.podTemplate.worker.spec.containers[0].volumeMounts[0].mountPath", "choose another path"),
    ({"spec": {"volumes": [{"name": "v"}], "containers": [
        {"name": "worker", "volumeMounts": [{"name": "v", "mountPath": "/etc/trainop/ssh/extra"}]}]}},
     "spec.podTemplate.worker.spec.containers[0].volumeMounts[0].mountPath", "/etc/trainop/ssh itself"),
    ({"spec": {"containers": [{"name": "worker", "volumeMounts": [{"name": "nope", "mountPath": "/x"}]}]}},
     "spec.podTemplate.worker.spec.containers[0].volumeMounts[0].name", "no volume 'nope'"),
    ({"spec": {"containers": [{"name": "worker", "securityContext": {"allowPrivilegeEscalation": True}}]}},
     "spec.podTemplate.worker.spec.containers[0].securityContext.allowPrivilegeEscalation", "restricted"),
    ({"spec": {"containers": [{"name": "worker", "securityContext": {"runAsUser": 5}}]}},
     "spec.podTemplate.worker.spec.containers[0].securityContext.runAsUser", "spec.securityContext"),
    ({"spec": {"nodeSelector": {"kubernetes.azure.com/agentpool": "cpu"}}},
     "spec.podTemplate.worker.spec.nodeSelector[kubernetes.azure.com/agentpool]", "same value"),
    ({"spec": {"volumes": [{"name": "host", "hostPath": {"path": "/"}}]}},
     "spec.podTemplate.worker.spec.volumes[0].hostPath", "podTemplate.allow.hostPath"),
    ({"spec": {"volumes": [{"name": "n", "nfs": {"server": "s", "path": "/"}}]}},
     "spec.podTemplate.worker.spec.volumes[0].nfs", "podTemplate.allow.volumeTypes"),
    ({"spec": {"hostNetwork": True}}, "spec.podTemplate.worker.spec.hostNetwork", "podTemplate.allow.hostNetwork"),
    ({"spec": {"hostPID": True}}, "spec.podTemplate.worker.spec.hostPID", "podTemplate.allow.hostPID"),
    ({"spec": {"hostIPC": True}}, "spec.podTemplate.worker.spec.hostIPC", "podTemplate.allow.hostIPC"),
    ({"spec": {"containers": [{"name": "s", "image": "x", "securityContext": {"privileged": True}}]}},
     "spec.podTemplate.worker.spec.containers[0].securityContext.privileged", "podTemplate.allow.privileged"),
    ({"spec": {"initContainers": [{"name": "s", "image": "x", "securityContext": {"runAsUser": 0}}]}},
     "spec.podTemplate.worker.spec.initContainers[0].securityContext.runAsUser", "privilege"),
    ({"spec": {"containers": [{"name": "s", "image": "x",
                               "securityContext": {"capabilities": {"add": ["NET_BIND_SERVICE", "SYS_ADMIN"]}}}]}},
     "spec.podTemplate.worker.spec.containers[0].securityContext.capabilities.add[1]", "SYS_ADMIN"),
    ({"spec": {"containers": [{"name": "s", "image": "x", "securityContext": {"seLinuxOptions": {"type": "spc_t"}}}]}},
     "spec.podTemplate.worker.spec.containers[0].securityContext.seLinuxOptions", "restricted"),
    ({"spec": {"containers": [{"name": "s", "image": "x", "ports": [{"containerPort": 80, "hostPort": 80}]}]}},
     "spec.podTemplate.worker.spec.containers[0].ports[0].hostPort", "node"),
    ({"spec": {"containers": [{"name": "s", "image": "x", "resources": {"limits": {"nvidia.com/gpu": 1}}}]}},
     "spec.podTemplate.worker.spec.containers[0].resources.limits", "spec.gpusPerWorker"),
])
def test_refused_overrides_name_the_field(override, field, says):
    assert says in refused(field, podTemplate={"worker": override})


def test_the_log_shippers_name_is_the_operators():
    output = {"blob": {"accountURL": "https://acct.blob.core.windows.net", "container": "out",
                       "auth": {"sasSecretRef": {"name": "sas", "key": "token"}}}}
    for key in ("containers", "initContainers"):
        refused(f"spec.podTemplate.worker.spec.{key}[0].name", output=output,
                podTemplate={"worker": {"spec": {key: [{"name": "logship", "image": "x"}]}}})


def test_a_torchrun_job_has_no_launcher_to_override():
    refused("spec.podTemplate.launcher", launcher="torchrun",
            podTemplate={"launcher": {"metadata": {"labels": {"a": "b"}}}})


def test_operator_affinity_wins():
    """An affinity part the operator rendered (none today: a plugin such as topology-aware
    placement would add one) cannot be replaced."""
    from trainop.render import overrides
    pod = {"metadata": {}, "spec": {"containers": [{"name": "worker"}],
                                    "affinity": {"nodeAffinity": {"x": 1}}}}
    with pytest.raises(SpecError) as err:
        overrides.apply(pod, {"spec": {"affinity": {"nodeAffinity": {"y": 2}}}}, "spec.podTemplate.worker")
    assert err.value.field == "spec.podTemplate.worker.spec.affinity.nodeAffinity"


def test_admin_switches_allow_what_restricted_does_not():
    cfg = config.from_dict({"podTemplate": {"allow": {
        "hostPath": True, "hostNetwork": True, "privileged": True, "capabilities": ["IPC_LOCK"],
        "volumeTypes": ["nfs"]}}})
    j = job(cfg, podTemplate={"worker": {"spec": {
        "hostNetwork": True,
        "volumes": [{"name": "host", "hostPath": {"path": "/var/log"}},
                    {"name": "n", "nfs": {"server": "s", "path": "/"}}],
        "containers": [{"name": "worker", "securityContext": {"capabilities": {"add": ["IPC_LOCK"]}}},
                       {"name": "debug", "image": "x", "securityContext": {"privileged": True}}]}}})
    spec = dtj.render_worker(j, 0, 0)["spec"]
    assert spec["hostNetwork"] is True
    assert [v["name"] for v in spec["volumes"][-2:]] == ["host", "n"]
    # joins the MPI worker's own NET_BIND_SERVICE
    assert spec["containers"][0]["securityContext"]["capabilities"] == {
        "drop": ["ALL"], "add": ["NET_BIND_SERVICE", "IPC_LOCK"]}
    assert spec["containers"][1]["securityContext"]["privileged"] is True
    # the admin's capability list, nothing else
    refused("spec.podTemplate.worker.spec.containers[0].securityContext.capabilities.add[0]",
            config.from_dict({"podTemplate": {"allow": {"capabilities": ["IPC_LOCK"]}}}),
            podTemplate={"worker": {"spec": {"containers": [
                {"name": "s", "image": "x", "securityContext": {"capabilities": {"add": ["SYS_ADMIN"]}}}]}}})


def test_bad_allow_config_names_the_key():
    with pytest.raises(config.ConfigError, match="podTemplate.allow.hostPath"):
        config.from_dict({"podTemplate": {"allow": {"hostPath": "yes"}}})
    with pytest.raises(config.ConfigError, match="podTemplate.allow.capabilities"):
        config.from_dict({"podTemplate": {"allow": {"capabilities": "IPC_LOCK"}}})


def test_merged_pods_still_pass_the_restricted_profile():
    from tests.unit.test_render_pod_security import restricted_violations
    j = job(workers=2, podTemplate={"worker": WORKER, "launcher": {"spec": {
        "containers": [{"name": "sidecar", "image": "x",
                        "securityContext": {"capabilities": {"add": ["NET_BIND_SERVICE"]}}}]}}})
    for pod_spec in (dtj.render_worker(j, 0, 0)["spec"],
                     dtj.render_launcher(j, 0)["spec"]["template"]["spec"]):
        assert restricted_violations(pod_spec) == []


# ---- issue 22: what a pod template can no longer reach (H3, M6, L2, L3) -------------------------
BLOB = {"blob": {"accountURL": "https://acct.blob.core.windows.net", "container": "out",
                 "auth": {"sasSecretRef": {"name": "sas", "key": "token"}}}}
WI_CFG = config.from_dict({"logship": {"workloadIdentityServiceAccount": "uploader"}})
WI = {"blob": {**BLOB["blob"], "auth": {"workloadIdentity": True}}}


def sidecar(**fields):
    return {"name": "thief", "image": "x", **fields}


@pytest.mark.parametrize("worker, field, says", [
    # any Secret of the namespace, however it is spelled
    ({"containers": [{"name": "worker", "env": [
        {"name": "K", "valueFrom": {"secretKeyRef": {"name": "other-team", "key": "k"}}}]}]},
     "containers[0].env[0].valueFrom.secretKeyRef.name", "podTemplate.allow.secrets"),
    ({"containers": [{"name": "worker", "envFrom": [{"secretRef": {"name": "other-team"}, "prefix": "T_"}]}]},
     "containers[0].envFrom[0].secretRef.name", "podTemplate.allow.secrets"),
    ({"volumes": [{"name": "v", "secret": {"secretName": "other-team"}}]},
     "volumes[0].secret.secretName", "podTemplate.allow.secrets"),
    ({"volumes": [{"name": "v", "projected": {"sources": [{"secret": {"name": "other-team"}}]}}]},
     "volumes[0].projected.sources[0].secret.name", "podTemplate.allow.secrets"),
    ({"imagePullSecrets": [{"name": "other-team"}]}, "imagePullSecrets[0].name", "podTemplate.allow.secrets"),
    ({"initContainers": [sidecar(env=[{"name": "K", "valueFrom": {"secretKeyRef": {"name": "x", "key": "k"}}}])]},
     "initContainers[0].env[0].valueFrom.secretKeyRef.name", "podTemplate.allow.secrets"),
    # a token of the pod's ServiceAccount, for the API server or the Azure token exchange
    ({"volumes": [{"name": "v", "projected": {"sources": [{"serviceAccountToken": {
        "path": "t", "audience": "api://AzureADTokenExchange"}}]}}]},
     "volumes[0].projected.sources[0].serviceAccountToken", "job pods hold no token"),
    # a CSI driver may be handed the pod's token: only where the admin opened csi
    ({"volumes": [{"name": "kv", "csi": {"driver": "secrets-store.csi.k8s.io"}}]},
     "volumes[0].csi", "podTemplate.allow.volumeTypes"),
    # the GPUs of the node past gpusPerWorker
    ({"containers": [{"name": "worker", "env": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}]}]},
     "containers[0].env[0].name", "NVIDIA container runtime"),
    ({"initContainers": [sidecar(env=[{"name": "NVIDIA_DRIVER_CAPABILITIES", "value": "all"}])]},
     "initContainers[0].env[0].name", "NVIDIA container runtime"),
    # baseline Pod Security: probe/hook hosts
    ({"containers": [sidecar(readinessProbe={"httpGet": {"host": "169.254.169.254", "port": 80}})]},
     "containers[0].readinessProbe.httpGet.host", "baseline"),
    ({"initContainers": [sidecar(lifecycle={"preStop": {"tcpSocket": {"host": "10.0.0.1", "port": 22}}})]},
     "initContainers[0].lifecycle.preStop.tcpSocket.host", "baseline"),
])
def test_a_template_reaches_no_identity_no_gpu_and_no_host(worker, field, says):
    assert says in refused(f"spec.podTemplate.worker.spec.{field}", podTemplate={"worker": {"spec": worker}})


@pytest.mark.parametrize("meta, field", [
    ({"labels": {"azure.workload.identity/use": "true"}}, "labels[azure.workload.identity/use]"),
    ({"annotations": {"azure.workload.identity/skip-containers": ""}},
     "annotations[azure.workload.identity/skip-containers]"),
    ({"annotations": {"container.apparmor.security.beta.kubernetes.io/worker": "unconfined"}},
     "annotations[container.apparmor.security.beta.kubernetes.io/worker]"),
])
def test_identity_and_apparmor_keys_are_refused(meta, field):
    refused(f"spec.podTemplate.worker.metadata.{field}", podTemplate={"worker": {"metadata": meta}})
    annotations = {"container.apparmor.security.beta.kubernetes.io/worker": "runtime/default"}
    job(podTemplate={"worker": {"metadata": {"annotations": annotations}}})  # baseline's own


def test_spec_env_cannot_choose_the_gpus():
    assert "NVIDIA" in refused("spec.env[1].name", env=[{"name": "A", "value": "1"},
                                                        {"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}])


@pytest.mark.parametrize("prefix", [None, "", "N", "NVIDIA_", "NVIDIA_X_"])
def test_envfrom_on_the_gpu_container_cannot_name_an_nvidia_variable(prefix):
    """Issue 22, M6: an unprefixed envFrom ConfigMap could hold NVIDIA_VISIBLE_DEVICES=all,
    which the kubelet puts after the device plugin's value: refused on the worker's training
    container, unless the prefix keeps every name off NVIDIA_ or the admin opens it."""
    source = {"configMapRef": {"name": "gpu-settings"}} | ({"prefix": prefix} if prefix is not None else {})

    def template(name, role="worker"):
        return {role: {"spec": {"containers": [{"name": name, "envFrom": [source]}]}}}
    says = refused("spec.podTemplate.worker.spec.containers[0].envFrom[0].prefix", podTemplate=template("worker"))
    assert "NVIDIA_VISIBLE_DEVICES" in says and "configMapKeyRef" in says
    job(podTemplate=template("exporter"))  # a sidecar: no GPU, NVIDIA_VISIBLE_DEVICES=void wins
    job(podTemplate=template("launcher", "launcher"))  # the launcher holds no GPU either
    opened = config.from_dict({"podTemplate": {"allow": {"envFromWithoutPrefix": True}}})
    assert job(opened, podTemplate=template("worker")).pod_template


def test_envfrom_with_a_prefix_reaches_the_gpu_container():
    j = job(workers=1, gpusPerWorker=1, podTemplate={"worker": {"spec": {"containers": [
        {"name": "worker", "envFrom": [{"configMapRef": {"name": "s"}, "prefix": "CFG_"}]}]}}})
    assert dtj.render_worker(j, 0, 0)["spec"]["containers"][0]["envFrom"] == [
        {"configMapRef": {"name": "s"}, "prefix": "CFG_"}]


def test_only_the_admins_secrets_and_namespaces():
    cfg = config.from_dict({"podTemplate": {"allow": {"secrets": ["hf-*", "team-b/wandb"]}}})

    def env(name):
        return {"worker": {"spec": {"containers": [{"name": "worker", "envFrom": [
            {"secretRef": {"name": name}, "prefix": "S_"}]}]}}}
    job(cfg, podTemplate=env("hf-token"))  # team-a
    refused("spec.podTemplate.worker.spec.containers[0].envFrom[0].secretRef.name", cfg,
            podTemplate=env("wandb"))  # allowed in team-b only
    assert parse({"metadata": {"name": "j", "namespace": "team-b"},
                  "spec": {"podTemplate": env("wandb")}}, cfg).pod_template


@pytest.mark.parametrize("container", ["worker", "exporter"])
def test_no_container_mounts_the_shippers_token_or_the_ssh_key(container):
    for volume in ("trainop-api-token", "ssh"):
        mount = {"name": volume, "mountPath": "/stolen"}
        entry = {"name": "worker", "volumeMounts": [mount]} if container == "worker" \
            else sidecar(volumeMounts=[mount])
        says = refused("spec.podTemplate.worker.spec.containers[0].volumeMounts[0].name",
                       workers=1, output=BLOB, podTemplate={"worker": {"spec": {"containers": [entry]}}})
        assert "credential" in says


def test_the_webhook_skips_every_container_but_the_shippers():
    """Issue 22, H3: with workload identity the webhook injects the federated token into every
    container the pod's skip-containers annotation does not name: it names every container
    but the shipper and the checkpoint fetcher, the template's sidecars and the preflight too."""
    j = job(WI_CFG, workers=2, gpusPerWorker=1, launcher="torchrun", output=WI,
            checkpoint={"enabled": True}, preflight={"enabled": True},
            podTemplate={"worker": {"spec": {"initContainers": [sidecar()],
                                             "containers": [sidecar(name="exporter")]}}})
    from trainop.resume import Resume
    pod = dtj.render_worker(j, 0, 1, resume=Resume("/output/checkpoints/attempt-0/step-1",
                                                   fetch="j1/0/output/checkpoints/attempt-0/step-1"))
    names = [c["name"] for c in pod["spec"]["initContainers"] + pod["spec"]["containers"]]
    assert set(names) == {"logship", "fetch-checkpoint", "preflight", "thief", "worker", "exporter"}
    skipped = pod["metadata"]["annotations"]["azure.workload.identity/skip-containers"].split(";")
    assert sorted(skipped) == ["exporter", "preflight", "thief", "worker"]
    assert pod["spec"]["serviceAccountName"] == "uploader"


def test_output_uploads_only_as_an_account_the_admin_allows():
    def wi(account):
        return {"blob": {**BLOB["blob"], "auth": {"workloadIdentity": True,
                                                  "serviceAccountName": account}}}
    says = refused("spec.output.blob.auth.serviceAccountName", WI_CFG, output=wi("cluster-admin-ish"))
    assert "blob.allowedServiceAccounts" in says
    assert job(WI_CFG, output=wi("uploader")).output.auth.service_account_name == "uploader"
    cfg = config.from_dict({"blob": {"allowedServiceAccounts": ["team-a/up-*"]}})
    assert job(cfg, output=wi("up-1")).output
    refused("spec.output.blob.auth.serviceAccountName", config.from_dict(
        {"blob": {"allowedServiceAccounts": ["*"]}}), output=wi("default"))
    with pytest.raises(config.ConfigError, match="logship.workloadIdentityServiceAccount"):
        config.from_dict({"logship": {"workloadIdentityServiceAccount": "default"}})
    with pytest.raises(config.ConfigError, match="blob.allowedServiceAccounts"):
        config.from_dict({"blob": {"allowedServiceAccounts": ["default"]}})


@pytest.mark.parametrize("spec, field", [
    # a name only a later attempt's worker 0 has (it fetches the checkpoint to resume from)
    ({"initContainers": [{"name": "fetch-checkpoint", "image": "x"}]}, "initContainers[0].name"),
    # a volume only the shipping worker 0 has: accepted there, a pod the API server refuses on
    # worker 1 (the job then holds its quota with half a gang)
    ({"containers": [{"name": "worker", "volumeMounts": [{"name": "trainop-run",
                                                          "mountPath": "/peek"}]}]},
     "containers[0].volumeMounts[0].name"),
])
def test_a_template_is_judged_against_every_pod_the_job_can_have(spec, field):
    refused(f"spec.podTemplate.worker.spec.{field}", workers=2, output=BLOB,
            checkpoint={"enabled": True}, podTemplate={"worker": {"spec": spec}})


def test_every_variant_is_rendered_and_gpu_less_containers_see_no_gpu():
    j = job(workers=3, gpusPerWorker=1, output=BLOB, checkpoint={"enabled": True},
            podTemplate={"worker": {"spec": {"containers": [sidecar()]}}})
    variants = dtj.pod_variants(j)
    inits = [[c["name"] for c in p["spec"].get("initContainers", [])] for p in variants]
    assert ["logship", "fetch-checkpoint"] in inits and [] in inits  # worker 0 later, worker 1
    for pod in variants:
        for c in pod["spec"].get("initContainers", []) + pod["spec"]["containers"]:
            gpu = (c.get("resources") or {}).get("limits", {}).get("nvidia.com/gpu")
            env = {e["name"]: e.get("value") for e in c.get("env") or []}
            assert (env.get("NVIDIA_VISIBLE_DEVICES") == "void") == (not gpu), c["name"]
