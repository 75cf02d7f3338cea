"""Issue 22 against the real API server and the real operator: what a namespace user tries to
reach through a job (H3: any Secret, ServiceAccount or token of the namespace; M6: the node's
GPUs; M1: a PodGroup class past limits.maxPriority; L2/L3: templates that wedge a gang or pass
baseline's holes) is refused with InvalidSpec naming the field, and nothing is created; what
is allowed reaches the pods the API server admits with every container but the shipper kept
from the identity; L4: a pod the API server refuses for what it is fails the job; L5: a
ConfigMap labelled like the job's progress report is not read."""

from __future__ import annotations

import json

import pytest

from tests.cluster.test_dtj import FAST, Api, manifest
from tests.fixtures.waiting import wait_until

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]

# an endpoint the operator allows without configuration; nothing is uploaded in these tests
OUTPUT = {"blob": {"accountURL": "https://acct.blob.core.windows.net", "container": "out",
                   "auth": {"sasSecretRef": {"name": "sas", "key": "token"}}}}
WI_OUTPUT = {"blob": {**OUTPUT["blob"], "auth": {"workloadIdentity": True,
                                                 "serviceAccountName": "team-wi"}}}
CONFIG = FAST | {"blob": {"allowedServiceAccounts": ["team-wi"]},
                 "podTemplate": {"allow": {"secrets": ["shared-settings"]}},
                 "gangScheduling": {"scheduler": "volcano"}}


def worker(**spec) -> dict:
    return {"podTemplate": {"worker": {"spec": spec}}}


def sidecar(**fields) -> dict:
    return {"name": "thief", "image": "busybox", **fields}


TOKEN = "spec.podTemplate.worker.spec"
# name -> (spec, the field the refusal names, words of its message)
ATTACKS = {
    # H3: a Secret the admin did not list, however it is spelled
    "env-secret": (worker(containers=[{"name": "worker", "env": [
        {"name": "K", "valueFrom": {"secretKeyRef": {"name": "other-team", "key": "k"}}}]}]),
        f"{TOKEN}.containers[0].env[0].valueFrom.secretKeyRef.name", "podTemplate.allow.secrets"),
    "envfrom-secret": (worker(containers=[sidecar(envFrom=[{"secretRef": {"name": "other-team"}}])]),
                       f"{TOKEN}.containers[0].envFrom[0].secretRef.name", "podTemplate.allow.secrets"),
    "secret-volume": (worker(volumes=[{"name": "s", "secret": {"secretName": "other-team"}}]),
                      f"{TOKEN}.volumes[0].secret.secretName", "podTemplate.allow.secrets"),
    # H3: a token of the pod's ServiceAccount for the Azure token exchange
    "azure-token": (worker(volumes=[{"name": "t", "projected": {"sources": [{"serviceAccountToken": {
        "path": "token", "audience": "api://AzureADTokenExchange"}}]}}]),
        f"{TOKEN}.volumes[0].projected.sources[0].serviceAccountToken", "job pods hold no token"),
    # H3: the shipper's API token and the SSH key, mounted into job code
    "mount-shipper-token": ({"output": OUTPUT, **worker(containers=[{"name": "worker", "volumeMounts": [
        {"name": "trainop-api-token", "mountPath": "/stolen"}]}])},
        f"{TOKEN}.containers[0].volumeMounts[0].name", "credential"),
    "sidecar-ssh-key": (worker(containers=[sidecar(volumeMounts=[{"name": "ssh", "mountPath": "/k"}])]),
                        f"{TOKEN}.containers[0].volumeMounts[0].name", "credential"),
    # H3: opting the pod into the webhook, or choosing what it skips
    "wi-label": ({"podTemplate": {"worker": {"metadata": {"labels": {"azure.workload.identity/use": "true"}}}}},
                 "spec.podTemplate.worker.metadata.labels[azure.workload.identity/use]", "operator's"),
    # H3: an account the admin did not list, or the namespace's default
    "other-account": ({"output": {"blob": {**OUTPUT["blob"], "auth": {"workloadIdentity": True,
                                                                     "serviceAccountName": "platform-admin"}}}},
                      "spec.output.blob.auth.serviceAccountName", "blob.allowedServiceAccounts"),
    "default-account": ({"output": {"blob": {**OUTPUT["blob"], "auth": {"workloadIdentity": True,
                                                                       "serviceAccountName": "default"}}}},
                        "spec.output.blob.auth.serviceAccountName", "blob.allowedServiceAccounts"),
    # M6: every GPU of the node
    "gpu-env": ({"env": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}]}, "spec.env[0].name",
                "NVIDIA container runtime"),
    "gpu-env-template": (worker(containers=[{"name": "worker", "env": [
        {"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}]}]),
        f"{TOKEN}.containers[0].env[0].name", "NVIDIA container runtime"),
    "gpu-envfrom": (worker(containers=[{"name": "worker", "envFrom": [{"configMapRef": {"name": "gpus"}}]}]),
                    f"{TOKEN}.containers[0].envFrom[0].prefix", "NVIDIA_VISIBLE_DEVICES"),
    # M1: the PodGroup's class past the cap, another team's Volcano queue
    "podgroup-class": ({"runPolicy": {"schedulingPolicy": {"priorityClass": "system-node-critical"}}},
                       "spec.priorityClassName", "limits.maxPriority"),
    "podgroup-queue": ({"runPolicy": {"schedulingPolicy": {"queue": "other-team"}}},
                       "spec.runPolicy.schedulingPolicy.queue", "gangScheduling.allowedQueues"),
    # L2: a name only a later attempt's worker 0 has
    "fetch-checkpoint": ({"output": OUTPUT, "checkpoint": {"enabled": True},
                          **worker(initContainers=[sidecar(name="fetch-checkpoint")])},
                         f"{TOKEN}.initContainers[0].name", "choose another name"),
    # L3: baseline's probe host and AppArmor annotation
    "probe-host": (worker(containers=[sidecar(readinessProbe={"httpGet": {"host": "169.254.169.254",
                                                                          "port": 80}})]),
                   f"{TOKEN}.containers[0].readinessProbe.httpGet.host", "baseline"),
    "apparmor": ({"podTemplate": {"worker": {"metadata": {"annotations": {
        "container.apparmor.security.beta.kubernetes.io/worker": "unconfined"}}}}},
        "spec.podTemplate.worker.metadata.annotations[container.apparmor.security.beta.kubernetes.io/worker]",
        "AppArmor"),
}


@pytest.fixture
def api(cluster, namespace):
    return Api(cluster, namespace)


def test_what_a_job_may_not_reach_is_refused_naming_the_field_and_nothing_is_created(
        cluster, namespace, api, operator_factory):
    operator_factory(config=CONFIG)
    for name, (spec, _, _) in ATTACKS.items():
        cluster.apply(manifest(name, workers=2, gpusPerWorker=1, **spec), namespace)
    for name, (_, field, says) in ATTACKS.items():
        api.wait_phase(name, "Failed")
        cond = api.condition(name, "Failed")
        assert cond["reason"] == "InvalidSpec", (name, cond)
        assert cond["message"].startswith(f"{field}: ") and says in cond["message"], (name, cond["message"])
        assert not any(api.children(name).values()), name


def test_an_allowed_template_keeps_every_container_but_the_shipper_from_the_identity(
        cluster, namespace, api, operator_factory):
    """The pods the API server admits for a workload-identity job with a pod template: the
    webhook's skip list names the template's sidecar and init container too, no container but
    the shipper mounts a token, the allowed Secret is there, and GPU-less containers (the
    launcher, the sidecars) get NVIDIA_VISIBLE_DEVICES=void."""
    operator_factory(config=CONFIG)
    cluster.kubectl("create", "serviceaccount", "team-wi", "-n", namespace)
    cluster.kubectl("create", "secret", "generic", "shared-settings", "-n", namespace, "--from-literal=a=b")
    spec = {"output": WI_OUTPUT, **worker(
        initContainers=[sidecar(name="warmup", command=["true"])],
        containers=[{"name": "worker", "envFrom": [{"secretRef": {"name": "shared-settings"},
                                                                "prefix": "SHARED_"}]},
                    sidecar(name="exporter")])}
    cluster.apply(manifest("wi", workers=2, gpusPerWorker=1, **spec), namespace)
    launcher = api.wait_running("wi")
    pods = [cluster.get("pod", p.metadata.name, "-n", namespace) for p in api.pods("wi", "worker")]
    pods.append(cluster.get("pod", launcher.metadata.name, "-n", namespace))
    shipping = [p for p in pods if p["spec"].get("serviceAccountName") == "team-wi"]
    assert sorted(p["metadata"]["name"] for p in shipping) == sorted(
        ["wi-worker-0", launcher.metadata.name])
    for pod in pods:
        spec_ = pod["spec"]
        containers = spec_.get("initContainers", []) + spec_["containers"]
        assert spec_["automountServiceAccountToken"] is False
        if pod in shipping:
            skipped = pod["metadata"]["annotations"]["azure.workload.identity/skip-containers"].split(";")
            assert sorted(skipped) == sorted(c["name"] for c in containers if c["name"] != "logship")
        for c in containers:
            if c["name"] != "logship":
                assert not [m for m in c.get("volumeMounts", []) if m["name"] == "trainop-api-token"
                            or m["mountPath"].startswith("/var/run/secrets")], (pod["metadata"]["name"], c["name"])
            gpus = (c.get("resources") or {}).get("limits", {}).get("nvidia.com/gpu")
            env = {e["name"]: e.get("value") for e in c.get("env") or []}
            assert (env.get("NVIDIA_VISIBLE_DEVICES") == "void") == (not gpus), c["name"]


def test_pod_security_refusing_a_template_fails_the_job_and_frees_its_place(
        cluster, namespace, api, operator_factory):
    """L4: the admin allows privileged sidecars, the namespace enforces restricted: the API
    server refuses the pods (403), and the job fails (ChildRejected) instead of holding its
    admission forever. A LimitRange's 403 does the same."""
    cluster.kubectl("label", "namespace", namespace, "pod-security.kubernetes.io/enforce=restricted")
    operator_factory(config=FAST | {"podTemplate": {"allow": {"privileged": True}}})
    cluster.apply(manifest("priv", workers=1, gpusPerWorker=1, **worker(
        containers=[sidecar(securityContext={"privileged": True, "allowPrivilegeEscalation": True})])), namespace)
    api.wait_phase("priv", "Failed")
    cond = api.condition("priv", "Failed")
    assert cond["reason"] == "ChildRejected"
    assert cond["message"].startswith("spec.podTemplate: the namespace's Pod Security admission refused")
    assert "thief" in cond["message"]
    assert not api.pods("priv")
    cluster.apply({"apiVersion": "v1", "kind": "LimitRange", "metadata": {"name": "small"},
                   "spec": {"limits": [{"type": "Container", "max": {"cpu": "1"}}]}}, namespace)
    cluster.apply(manifest("big", workers=1, gpusPerWorker=1,
                           resources={"limits": {"cpu": "2"}, "requests": {"cpu": "2"}}), namespace)
    api.wait_phase("big", "Failed")
    cond = api.condition("big", "Failed")
    assert cond["reason"] == "ChildRejected" and "maximum cpu usage per Container" in cond["message"]


def test_a_configmap_labelled_like_the_progress_report_is_not_read(cluster, namespace, api, operator_factory):
    """L5: the report is the job's own `<job>-progress` (its owner the job), not any ConfigMap
    that someone labelled with the job's name and the progress role."""
    operator_factory(config=FAST)
    forged = {"apiVersion": "v1", "kind": "ConfigMap",
              "metadata": {"name": "rep-forged", "labels": {"trainop.io/job-name": "rep",
                                                            "trainop.io/role": "progress"}},
              "data": {"metrics": json.dumps({"step": 424242, "epoch": 9})}}
    cluster.apply(forged, namespace)
    cluster.apply(manifest("rep", workers=1, gpusPerWorker=1, output=OUTPUT), namespace)
    api.wait_running("rep")
    # what the shipper would write, into the real one
    wait_until(lambda: cluster.kubectl("get", "configmap", "rep-progress", "-n", namespace,
                                       check=False).returncode == 0, timeout=60, what="rep-progress")
    cluster.kubectl("patch", "configmap", "rep-progress", "-n", namespace, "--type=merge", "-p",
                    json.dumps({"data": {"metrics": json.dumps({"step": 7, "epoch": 1})}}))
    status = wait_until(lambda: (api.status("rep").get("metrics") or {}).get("step") == 7 and api.status("rep"),
                        timeout=60, what=f"the real report in the status ({api.status('rep').get('metrics')})")
    assert status["metrics"]["epoch"] == 1
