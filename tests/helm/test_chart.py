"""The chart without a cluster: lint, rendering, the values schema, the RBAC rule table, the
single source of CRDs, the operator configuration it renders, and the operator's Dockerfile."""

from __future__ import annotations

import json
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import yaml

from tests.helm.helm import CHART, find
from trainop import config
from trainop.paths import CRDS_DIR, REPO_ROOT
from trainop.spec import parse_stage

IMAGE = "trainop/operator:0.1.0"

# The operator's whole permission set, as the chart must render it (resource -> verbs).
CLUSTER_RULES = {
    ("", "nodes"): ["list", "watch"],
    ("scheduling.k8s.io", "priorityclasses"): ["get", "list", "watch"],
    ("kueue.x-k8s.io", "workloadpriorityclasses"): ["get", "list", "watch"],
    ("kueue.x-k8s.io", "resourceflavors"): ["get", "list", "watch"],
    ("apiextensions.k8s.io", "customresourcedefinitions"): ["list", "watch"],
    ("", "namespaces"): ["list", "watch"],
}
NAMESPACED_RULES = {
    ("trainop.io", "distributedtrainingjobs"): ["list", "watch", "patch", "delete"],
    ("trainop.io", "datastages"): ["get", "list", "watch", "patch"],
    ("trainop.io", "distributedtrainingjobs/status"): ["get", "patch"],
    ("trainop.io", "datastages/status"): ["get", "patch"],
    ("", "events"): ["create"],
    ("", "pods"): ["get", "list", "watch", "create", "delete"],
    ("", "resourcequotas"): ["list", "watch"],
    ("kueue.x-k8s.io", "workloads"): ["get", "list", "watch", "create", "patch", "delete"],
    ("kueue.x-k8s.io", "workloads/status"): ["patch"],
    ("batch", "jobs"): ["get", "list", "watch", "create", "delete"],
    ("scheduling.x-k8s.io", "podgroups"): ["get", "create", "patch"],
    ("scheduling.volcano.sh", "podgroups"): ["get", "create", "patch"],
    ("", "services"): ["get", "list", "watch", "create", "patch"],
    ("", "configmaps"): ["get", "list", "watch", "create", "patch"],
    ("", "serviceaccounts"): ["get", "list", "watch", "create", "patch"],
    ("", "persistentvolumeclaims"): ["get", "list", "watch", "create", "patch"],
    ("apps", "statefulsets"): ["get", "list", "watch", "create", "patch"],
    ("rbac.authorization.k8s.io", "roles"): ["get", "list", "watch", "create", "patch"],
    ("rbac.authorization.k8s.io", "rolebindings"): ["get", "list", "watch", "create", "patch"],
    ("", "secrets"): ["get", "create"],
    ("networking.k8s.io", "networkpolicies"): ["get", "list", "watch", "create", "patch"],
}
# leader election (leader.py): create a Lease, get/update only the chart's one, in its namespace
LEADER_RULES = [{"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["create"]},
                {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "resourceNames": ["trainop"],
                 "verbs": ["get", "update"]}]
VOLUMES = {("", "persistentvolumes"): ["get", "create", "patch", "delete"]}  # only with NFS destinations


def rule_table(role: dict) -> dict:
    table = {}
    for rule in role["rules"]:
        assert set(rule) == {"apiGroups", "resources", "verbs"}, rule  # no resourceNames/nonResourceURLs
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                assert (group, resource) not in table, f"{group}/{resource} listed twice"
                table[(group, resource)] = rule["verbs"]
    return table


def test_helm_lint(helm):
    out = helm("lint", "--strict", str(CHART))
    assert "1 chart(s) linted, 0 chart(s) failed" in out.stdout


def test_default_render_serves_only_the_default_namespace(render):
    """Issue 22 M11: a plain install is namespaced (watchNamespaces: [default])."""
    objs = render()
    kinds = sorted(o["kind"] for o in objs)
    assert kinds == sorted(["CustomResourceDefinition"] * 2 + [
        "ClusterRole", "ClusterRole", "ClusterRoleBinding", "RoleBinding", "Role", "RoleBinding",
        "ConfigMap", "Deployment", "Service", "ServiceAccount", "NetworkPolicy"])
    assert find(objs, "RoleBinding", "trainop")["metadata"]["namespace"] == "default"
    args = find(objs, "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[:2] == ["operator", "--namespace=default"]
    assert rule_table(find(objs, "ClusterRole", "trainop-cluster")) == CLUSTER_RULES  # no PV rights


def test_cluster_wide_only_when_the_admin_says_so(render, helm):
    out = helm("template", "trainop", str(CHART), values={"watchNamespaces": []}, check=False)
    assert out.returncode != 0
    assert "watchNamespaces: list the namespaces that train" in out.stderr and "clusterWide=true" in out.stderr
    objs = render({"clusterWide": True, "watchNamespaces": []})
    kinds = sorted(o["kind"] for o in objs)
    assert kinds == sorted(["CustomResourceDefinition"] * 2 + [
        "ClusterRole", "ClusterRole", "ClusterRoleBinding", "ClusterRoleBinding", "Role", "RoleBinding",
        "ConfigMap", "Deployment", "Service", "ServiceAccount", "NetworkPolicy"])
    args = find(objs, "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args == ["operator", "--all-namespaces", "--lease=trainop", "--lease-namespace=trainop-system",
                    "--liveness=http://0.0.0.0:8080/healthz", "--metrics-port=9090", "--log-format=json"]
    leader = find(objs, "Role", "trainop-leader")
    assert leader["metadata"]["namespace"] == "trainop-system" and leader["rules"] == LEADER_RULES
    assert find(objs, "RoleBinding", "trainop-leader")["roleRef"]["name"] == "trainop-leader"
    assert rule_table(find(objs, "ClusterRole", "trainop-cluster")) == CLUSTER_RULES
    assert rule_table(find(objs, "ClusterRole", "trainop-namespaced")) == NAMESPACED_RULES
    binding = find(objs, "ClusterRoleBinding", "trainop-namespaced")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "trainop", "namespace": "trainop-system"}]


def test_watched_namespaces_get_role_bindings_only_there(render):
    objs = render({"watchNamespaces": ["team-a", "team-b"]})
    assert [o["metadata"]["name"] for o in objs if o["kind"] == "ClusterRoleBinding"] == ["trainop-cluster"]
    bindings = [o for o in objs if o["kind"] == "RoleBinding" and o["metadata"]["name"] != "trainop-leader"]
    assert sorted(b["metadata"]["namespace"] for b in bindings) == ["team-a", "team-b"]
    assert all(b["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                                "name": "trainop-namespaced"} for b in bindings)
    assert rule_table(find(objs, "ClusterRole", "trainop-cluster")) == CLUSTER_RULES
    assert rule_table(find(objs, "ClusterRole", "trainop-namespaced")) == NAMESPACED_RULES
    args = find(objs, "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[:3] == ["operator", "--namespace=team-a", "--namespace=team-b"]


def helper_roles() -> list[dict]:
    """Every Role the operator creates per job and per DataStage (render/identity.py)."""
    from trainop import spec
    from trainop.render import datastage, logship
    blob = {"accountURL": "https://a.blob.core.windows.net", "container": "results",
            "auth": {"sasSecretRef": {"name": "s", "key": "sas"}}}
    job = spec.parse({"metadata": {"name": "j", "namespace": "ns"},
                      "spec": {"workers": 1, "output": {"blob": blob}}}, config.from_dict(None))
    stage = parse_stage({"apiVersion": "trainop.io/v1alpha1", "kind": "DataStage",
                             "metadata": {"name": "d", "namespace": "ns"},
                             "spec": {"source": {"blob": blob}, "destination": {"volumeClaim": {"claimName": "c"}}}})
    roles = [o for o in logship.rbac(job, {}) + datastage.rbac_objects(stage) if o["kind"] == "Role"]
    assert len(roles) == 2
    return roles


def test_the_operator_holds_every_verb_of_every_role_it_creates(render):
    """The API server refuses a Role that grants what its creator lacks (escalation check)."""
    chart = rule_table(find(render(), "ClusterRole", "trainop-namespaced"))
    for role in helper_roles():
        for rule in role["rules"]:
            for group in rule["apiGroups"]:
                for resource in rule["resources"]:
                    missing = set(rule["verbs"]) - set(chart.get((group, resource), []))
                    assert not missing, (role["metadata"]["name"], group, resource, missing)


def test_pod_meets_the_restricted_profile_and_probes_kopf(render):
    pod = find(render(), "Deployment")["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    container = pod["containers"][0]
    assert container["securityContext"] == {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                                            "capabilities": {"drop": ["ALL"]}}
    for probe in ("livenessProbe", "readinessProbe"):
        assert container[probe]["httpGet"] == {"path": "/healthz", "port": "health"}
    assert {p["name"]: p["containerPort"] for p in container["ports"]} == {"health": 8080, "metrics": 9090}
    assert container["image"] == IMAGE
    assert {"name": "TRAINOP_CONFIG", "value": "/etc/trainop/config.yaml"} in container["env"]


def test_workload_identity_annotation_and_pod_label(render):
    objs = render({"serviceAccount": {"workloadIdentity": {"enabled": True, "clientId": "1111-2222",
                                                           "tenantId": "3333"}}})
    sa = find(objs, "ServiceAccount")
    assert sa["metadata"]["annotations"] == {"azure.workload.identity/client-id": "1111-2222",
                                             "azure.workload.identity/tenant-id": "3333"}
    labels = find(objs, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert labels["azure.workload.identity/use"] == "true"
    plain = render()
    assert "annotations" not in find(plain, "ServiceAccount")["metadata"]
    assert "azure.workload.identity/use" not in find(plain, "Deployment")["spec"]["template"]["metadata"]["labels"]


def test_service_monitor_and_digest(render):
    objs = render({"metrics": {"serviceMonitor": {"enabled": True, "labels": {"release": "prom"}}},
                   "image": {"digest": "sha256:" + "a" * 64}})
    monitor = find(objs, "ServiceMonitor")
    assert monitor["metadata"]["labels"]["release"] == "prom"
    assert monitor["spec"]["endpoints"][0]["port"] == "metrics"
    assert find(objs, "Service")["spec"]["ports"][0]["targetPort"] == "metrics"
    image = "trainop/operator@sha256:" + "a" * 64
    assert find(objs, "Deployment")["spec"]["template"]["spec"]["containers"][0]["image"] == image
    rendered = yaml.safe_load(find(objs, "ConfigMap")["data"]["config.yaml"])
    assert rendered["datastage"]["image"] == rendered["logship"]["image"] == image


def test_rendered_config_is_what_the_operator_loads(render):
    """The chart's defaults are config.py's defaults; admins' values reach the operator."""
    text = find(render(), "ConfigMap")["data"]["config.yaml"]
    loaded = config.from_dict(yaml.safe_load(text))
    defaults = config.from_dict(None)
    for attr in ("resync_seconds", "safety_resync_seconds", "node_pools", "default_node_pools", "images", "launcher_resources",
                 "max_gpus_per_job", "scheduling_timeout_seconds", "allowed_account_urls", "allowed_nfs_exports", "nfs_client_cidrs"):
        assert getattr(loaded, attr) == getattr(defaults, attr), attr
    assert loaded.section("datastage") == {"image": IMAGE, "allowedNfsExports": [], "nfsClientCIDRs": [],
                                           "allowProvisionedServers": False, "server": "ganesha"}
    assert loaded.section("logship") == {"image": IMAGE}

    allowed = render({"config": {"blob": {"allowedAccountURLs": ["https://*.blob.local.azurestack.external"]},
                                 "datastage": {"allowedNfsExports": [{"server": "10.240.0.4", "path": "/export",
                                                                      "namespaces": ["team-a"]}],
                                               "nfsClientCIDRs": ["10.224.0.0/16"]}}})
    cfg = config.from_dict(yaml.safe_load(find(allowed, "ConfigMap")["data"]["config.yaml"]))
    assert cfg.allowed_account_urls == ("https://*.blob.local.azurestack.external",)
    assert cfg.allowed_nfs_exports == (config.NfsExport("10.240.0.4", "/export", ("team-a",)),) and cfg.nfs_client_cidrs == ("10.224.0.0/16",)

    custom = render({"config": {"nodePools": {"ibgpu": None, "a100": {
        "nodeSelector": {"pool": "a100"}, "infiniband": True, "rdmaResource": "rdma/hca"}},
        "defaultNodePools": {"infiniband": "a100"}, "limits": {"maxGpusPerJob": 16},
        "logship": {"image": "mirror/op:1"}}})
    cfg = config.from_dict(yaml.safe_load(find(custom, "ConfigMap")["data"]["config.yaml"]))
    assert sorted(cfg.node_pools) == ["a100", "gpu", "spotgpu", "system"]
    assert cfg.node_pools["a100"] == config.NodePool("a100", {"pool": "a100"}, [], True, "nvidia.com/gpu", "rdma/hca")
    assert cfg.max_gpus_per_job == 16 and cfg.section("logship") == {"image": "mirror/op:1"}


def test_nodes_are_patched_only_where_the_admin_enabled_tainting(render):
    """spec.preflight may taint a slow node trainop.io/unhealthy (docs/security.md): the
    operator holds get and patch on nodes only with config.preflight.taintUnhealthyNodes, and an
    admission policy on its ServiceAccount narrows that patch to the taint (tests/helm/test_install.py
    tries the rest against the API server)."""
    assert not [o for o in render() if o["kind"].startswith("ValidatingAdmissionPolicy")]
    objs = render({"config": {"preflight": {"taintUnhealthyNodes": True}},
                   "watchNamespaces": ["team-a"]})
    assert rule_table(find(objs, "ClusterRole", "trainop-cluster")) == \
        CLUSTER_RULES | {("", "nodes"): ["list", "watch", "get", "patch"]}
    policy = find(objs, "ValidatingAdmissionPolicy", "trainop-node-taint")
    assert policy["spec"]["matchConditions"] == [
        {"name": "the-operator", "expression": 'request.userInfo.username == "system:serviceaccount:trainop-system:trainop"'}]
    assert find(objs, "ValidatingAdmissionPolicyBinding", "trainop-node-taint")["spec"]["validationActions"] == ["Deny"]
    loaded = config.from_dict(yaml.safe_load(find(objs, "ConfigMap")["data"]["config.yaml"]))
    assert loaded.fabric.taint_unhealthy_nodes is True
    ib = render({"config": {"infiniband": {"ipcLock": True, "socketTransport": "fail",
                                           "topologyFiles": {"Standard_ND96asr_v4": "/opt/hpc/ndv4.xml"}},
                            "nodePools": {"ibgpu": {"nodeSelector": {"kubernetes.azure.com/agentpool": "ibgpu"},
                                                    "infiniband": True, "instanceType": "Standard_ND96asr_v4",
                                                    "preflightMinBusBandwidthGBps": 100}}}})
    loaded = config.from_dict(yaml.safe_load(find(ib, "ConfigMap")["data"]["config.yaml"]))
    assert (loaded.fabric.ipc_lock, loaded.fabric.socket_transport) == (True, "fail")
    assert loaded.fabric.topology_files["Standard_ND96asr_v4"] == "/opt/hpc/ndv4.xml"
    assert loaded.node_pools["ibgpu"].preflight_min_busbw == 100


def test_persistent_volumes_only_with_nfs_destinations(render):
    """Issue 22 M11: no PV right unless a DataStage may make an NFS PV; then only NFS PVs."""
    for values in ({"allowProvisionedServers": True},
                   {"allowedNfsExports": [{"server": "10.0.0.4", "path": "/export/{namespace}"}]}):
        objs = render({"config": {"datastage": values}})
        assert rule_table(find(objs, "ClusterRole", "trainop-cluster")) == CLUSTER_RULES | VOLUMES
        rule = find(objs, "ValidatingAdmissionPolicy", "trainop-nfs-volumes")["spec"]["validations"][0]
        assert rule["expression"].startswith("has(object.spec.nfs)")


def test_no_privileged_nfs_server_unless_the_kernel_server_is_chosen(render):
    """Issue 28: with NFS-Ganesha (the default) the operator may create no privileged StatefulSet."""
    objs = render({"config": {"datastage": {"allowProvisionedServers": True, "nfsClientCIDRs": ["10.224.0.0/16"]}}})
    policy = find(objs, "ValidatingAdmissionPolicy", "trainop-unprivileged-servers")["spec"]
    assert policy["matchConstraints"]["resourceRules"][0]["resources"] == ["statefulsets"]
    assert "DAC_READ_SEARCH" in policy["validations"][0]["expression"]
    assert find(objs, "ValidatingAdmissionPolicyBinding", "trainop-unprivileged-servers")["spec"]["validationActions"] == ["Deny"]
    for values in ({"allowProvisionedServers": True, "server": "kernel"}, {}):
        assert not [o for o in render({"config": {"datastage": values}})
                    if o["metadata"]["name"] == "trainop-unprivileged-servers"]


def test_pod_patch_only_with_ganesha_servers_and_only_their_annotation(render):
    """Issue 28: a Ganesha server's client list follows its readers, and the operator annotates
    the server pod so its kubelet updates the list at once: `patch` on pods, which RBAC cannot
    narrow, so an admission policy does (tests/helm/test_install.py tries it on the API server).
    Without Ganesha servers the operator may patch no pod."""
    objs = render({"config": {"datastage": {"allowProvisionedServers": True}}})
    assert rule_table(find(objs, "ClusterRole", "trainop-namespaced")) == \
        NAMESPACED_RULES | {("", "pods"): ["get", "list", "watch", "create", "delete", "patch"]}
    policy = find(objs, "ValidatingAdmissionPolicy", "trainop-server-pods")["spec"]
    assert policy["matchConstraints"]["resourceRules"][0]["resources"] == ["pods"]
    assert policy["matchConstraints"]["resourceRules"][0]["operations"] == ["UPDATE"]
    assert find(objs, "ValidatingAdmissionPolicyBinding", "trainop-server-pods")["spec"]["validationActions"] == ["Deny"]
    for values in ({"allowProvisionedServers": True, "server": "kernel"}, {},
                   {"allowedNfsExports": [{"server": "10.0.0.4", "path": "/export/{namespace}"}]}):
        objs = render({"config": {"datastage": values}})
        assert rule_table(find(objs, "ClusterRole", "trainop-namespaced")) == NAMESPACED_RULES, values
        assert not [o for o in objs if o["metadata"]["name"] == "trainop-server-pods"]


def test_operator_pod_network_policy_admits_only_the_scrapers(render):
    """Issue 22 L8: /metrics and /healthz have no authentication."""
    policy = find(render(), "NetworkPolicy")
    assert policy["spec"]["podSelector"]["matchLabels"] == find(render(), "Deployment")["spec"]["selector"]["matchLabels"]
    assert policy["spec"]["policyTypes"] == ["Ingress"] and policy["spec"]["ingress"] == []
    policy = find(render({"metrics": {"networkPolicy": {"scraperNamespaces": ["monitoring"],
                                                         "probeCIDRs": ["10.224.0.0/16"]}}}), "NetworkPolicy")
    assert policy["spec"]["ingress"] == [
        {"from": [{"namespaceSelector": {"matchExpressions": [
            {"key": "kubernetes.io/metadata.name", "operator": "In", "values": ["monitoring"]}]}}],
         "ports": [{"protocol": "TCP", "port": 9090}]},
        {"from": [{"ipBlock": {"cidr": "10.224.0.0/16"}}], "ports": [{"protocol": "TCP", "port": 8080}]}]
    assert not [o for o in render({"metrics": {"networkPolicy": {"enabled": False}}}) if o["kind"] == "NetworkPolicy"]


@pytest.mark.parametrize("values, message", [
    ({"config": {"nodePools": {"big": {"tolerations": []}}}},
     "at '/config/nodePools/big': missing property 'nodeSelector'"),
    ({"config": {"nodePools": {"big": {"nodeSelector": {}}}}},
     "at '/config/nodePools/big/nodeSelector': minProperties"),
    ({"config": {"limits": {"maxGpusPerJob": -1}}},
     "at '/config/limits/maxGpusPerJob': minimum: got -1, want 0"),
    ({"config": {"resyncSeconds": 0}}, "/config/resyncSeconds"),
    ({"watchNamespaces": ["Team_A"]}, "/watchNamespaces/0"),
    ({"serviceAccount": {"workloadIdentity": {"enabled": True}}}, "clientId"),
    ({"config": {"nodePool": {}}}, "nodePool"),
    ({"config": {"nodePools": {"big": {"nodeSelector": {"a": "b"}, "autoscale": {"minNodes": 0}}}}},
     "at '/config/nodePools/big/autoscale': missing property 'maxNodes'"),
    ({"config": {"nodePools": {"big": {"nodeSelector": {"a": "b"}, "spot": "yes"}}}},
     "/config/nodePools/big/spot"),
    ({"config": {"datastage": {"allowedNfsExports": [{"server": "10.0.0.4", "path": "/export"}]}}},
     "/config/datastage/allowedNfsExports/0"),
])
def test_wrong_values_fail_with_the_schema_message(helm, values, message):
    out = helm("template", "trainop", str(CHART), values=values, check=False)
    assert out.returncode != 0
    assert "values don't meet the specifications of the schema" in out.stderr
    assert message in out.stderr, out.stderr


def test_chart_crds_are_the_repository_crds(helm, tmp_path):
    """One source: the chart's crds/ links every file of crds/, and `helm package` stores the
    linked files' contents."""
    chart_crds = CHART / "crds"
    for crd in sorted(CRDS_DIR.glob("*.yaml")):
        link = chart_crds / crd.name
        assert link.is_symlink() and link.resolve() == crd.resolve(), f"{link} must link to {crd}"
    links = {p.name for p in chart_crds.iterdir() if p.is_symlink()}
    assert links == {p.name for p in CRDS_DIR.glob("*.yaml")}
    helm("package", str(CHART), "--destination", str(tmp_path))
    with tarfile.open(tmp_path / "trainop-0.1.0.tgz") as tar:
        for crd in CRDS_DIR.glob("*.yaml"):
            assert tar.extractfile(f"trainop/crds/{crd.name}").read() == crd.read_bytes()


def test_operator_dockerfile_passes_hadolint():
    hadolint = Path(sys.executable).parent / "hadolint"
    out = subprocess.run([str(hadolint), "--format", "json", str(REPO_ROOT / "operator" / "Dockerfile")],
                         capture_output=True, text=True)
    assert out.returncode == 0 and json.loads(out.stdout or "[]") == [], out.stdout + out.stderr
    text = (REPO_ROOT / "operator" / "Dockerfile").read_text()
    assert "USER 10001" in text and 'ENTRYPOINT ["trainop"]' in text
