"""spec.podTemplate against the real API server: the CRD's copy of the core schemas and its CEL
rules, the merged fields on the pods the API server admits, and refused overrides that create
nothing and name the field."""

from __future__ import annotations

import json

import pytest

from tests.cluster.test_dtj import FAST, Api, manifest

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(240)]

WORKER = {
    "metadata": {"labels": {"team": "vision"}, "annotations": {"example.com/owner": "ana"}},
    "spec": {
        "volumes": [{"name": "settings", "configMap": {"name": "train-settings"}},
                    {"name": "scratch", "emptyDir": {"sizeLimit": "1Gi"}}],
        "imagePullSecrets": [{"name": "registry"}],
        "nodeSelector": {"kubernetes.azure.com/accelerator": "nvidia"},
        "affinity": {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
            {"weight": 1, "podAffinityTerm": {"topologyKey": "kubernetes.io/hostname",
                                              "labelSelector": {"matchLabels": {"team": "vision"}}}}]}},
        "tolerations": [{"key": "example.com/dedicated", "operator": "Exists", "effect": "NoSchedule"}],
        "containers": [
            {"name": "worker",
             "env": [{"name": "API_TOKEN", "valueFrom": {"secretKeyRef": {"name": "token", "key": "value"}}},
                     {"name": "MY_NODE", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}],
             "envFrom": [{"configMapRef": {"name": "train-settings"}, "prefix": "SETTINGS_"}],
             "volumeMounts": [{"name": "settings", "mountPath": "/settings", "readOnly": True}],
             "securityContext": {"readOnlyRootFilesystem": True}},
            {"name": "exporter", "image": "registry.example.com/exporter:1",
             "ports": [{"containerPort": 9400, "name": "metrics"}],
             "resources": {"requests": {"cpu": "10m", "memory": "16Mi"}},
             "volumeMounts": [{"name": "settings", "mountPath": "/settings"}]},
        ],
    },
}


@pytest.fixture
def api(cluster, namespace):
    return Api(cluster, namespace)


def test_pods_carry_the_merged_fields(cluster, namespace, api, operator_factory):
    operator_factory(config=FAST | {"podTemplate": {"allow": {"secrets": ["token", "registry"]}}})
    launcher = {"metadata": {"labels": {"team": "vision"}},
                "spec": {"imagePullSecrets": [{"name": "registry"}],
                         "containers": [{"name": "launcher", "env": [{"name": "EXTRA", "value": "1"}]}]}}
    cluster.apply(manifest("tpl", podTemplate={"worker": WORKER, "launcher": launcher}), namespace)
    launcher_pod = api.wait_running("tpl")
    for pod in api.pods("tpl", "worker"):
        spec = pod.spec
        assert pod.metadata.labels["team"] == "vision"
        assert pod.metadata.labels["trainop.io/role"] == "worker"
        assert pod.metadata.annotations["example.com/owner"] == "ana"
        assert [v.name for v in spec.volumes][-2:] == ["settings", "scratch"]
        assert [s.name for s in spec.image_pull_secrets] == ["registry"]
        assert spec.node_selector == {"kubernetes.azure.com/agentpool": "gpu",
                                      "kubernetes.azure.com/accelerator": "nvidia"}
        assert spec.affinity.pod_anti_affinity.preferred_during_scheduling_ignored_during_execution[0].weight == 1
        assert "example.com/dedicated" in [t.key for t in spec.tolerations]
        worker, exporter = spec.containers
        env = {e.name: e for e in worker.env}
        assert env["API_TOKEN"].value_from.secret_key_ref.name == "token"
        assert env["MY_NODE"].value_from.field_ref.field_path == "spec.nodeName"
        assert env["NCCL_IB_DISABLE"].value == "1"  # the operator's own env is still there
        assert worker.env_from[0].config_map_ref.name == "train-settings"
        assert ("settings", "/settings") in [(m.name, m.mount_path) for m in worker.volume_mounts]
        assert worker.security_context.read_only_root_filesystem is True
        assert worker.security_context.allow_privilege_escalation is False
        assert worker.security_context.capabilities.drop == ["ALL"]
        assert (exporter.name, exporter.image) == ("exporter", "registry.example.com/exporter:1")
        assert exporter.security_context.allow_privilege_escalation is False
        assert exporter.security_context.capabilities.drop == ["ALL"]
    assert launcher_pod.metadata.labels["team"] == "vision"
    assert launcher_pod.spec.containers[0].env[-1].name == "EXTRA"
    assert [s.name for s in launcher_pod.spec.image_pull_secrets] == ["registry"]


@pytest.mark.parametrize("override, config, message", [
    ({"spec": {"volumes": [{"name": "ssh", "emptyDir": {}}]}}, FAST,
     "spec.podTemplate.worker.spec.volumes[0].name: 'ssh' is a volume the operator mounts in this "
     "role's pods: choose another name"),
    ({"spec": {"volumes": [{"name": "logs", "hostPath": {"path": "/var/log"}}]}}, FAST,
     "spec.podTemplate.worker.spec.volumes[0].hostPath: mounts the node's files into the pod: use "
     "a persistentVolumeClaim, configMap, secret or emptyDir (or ask the cluster admin for "
     "podTemplate.allow.hostPath)"),
    ({"spec": {"containers": [{"name": "worker", "env": [{"name": "OMPI_MCA_btl", "value": "tcp"}]}]}}, FAST,
     "spec.podTemplate.worker.spec.containers[0].env[0].name: OMPI_MCA_btl is set by the operator "
     "(or by spec.env): set it in one place, spec.env"),
])
def test_a_refused_override_creates_nothing_and_names_the_field(cluster, namespace, api, operator_factory,
                                                                 override, config, message):
    operator_factory(config=config)
    cluster.apply(manifest("bad", podTemplate={"worker": override}), namespace)
    api.wait_phase("bad", "Failed")
    cond = api.condition("bad", "Failed")
    assert (cond["reason"], cond["message"]) == ("InvalidSpec", message)
    assert not any(api.children("bad").values())


def test_what_the_admin_allows_reaches_the_pod(cluster, namespace, api, operator_factory):
    operator_factory(config=FAST | {"podTemplate": {"allow": {"hostPath": True}}})
    cluster.apply(manifest("host", workers=1, podTemplate={"worker": {"spec": {
        "volumes": [{"name": "logs", "hostPath": {"path": "/var/log"}}]}}}), namespace)
    api.wait_running("host")
    volumes = {v.name: v for v in api.pods("host", "worker")[0].spec.volumes}
    assert volumes["logs"].host_path.path == "/var/log"


@pytest.mark.parametrize("spec, says", [
    ({"podTemplate": {"worker": {"metadata": {"labels": {"trainop.io/role": "launcher"}}}}},
     "labels under trainop.io/ are the operator's"),
    ({"priorityClassName": "high", "podTemplate": {"worker": {"spec": {"priorityClassName": "low"}}}},
     "conflicts with spec.priorityClassName"),
    ({"podTemplate": {"worker": {"spec": {"priorityClassName": "a"}},
                      "launcher": {"spec": {"priorityClassName": "b"}}}},
     "a gang has one priority"),
    ({"podTemplate": {"worker": {"spec": {"volumes": [{"name": "v", "emptyDir": {"sizeLimit": "lots"}}]}}}},
     "sizeLimit"),  # the core schema's IntOrString/Quantity copy
    ({"podTemplate": {"worker": {"spec": {"containers": [{"image": "x"}]}}}},
     "name: Required value"),
])
def test_the_api_server_refuses_what_the_schema_can(cluster, namespace, spec, says):
    result = cluster.kubectl("apply", "-n", namespace, "-f", "-", check=False,
                             input=json.dumps(manifest("cel", **spec)))
    assert result.returncode != 0 and says in result.stderr, result.stderr
