"""`helm install` into the real local control plane (kube-apiserver with RBAC and Pod Security
admission, controller-manager, scheduler, KWOK nodes), then a DistributedTrainingJob driven to
Succeeded by an operator that holds nothing but the chart's ServiceAccount token.

The chart's Deployment runs on a KWOK node (its pod is simulated, so it never acts); the
operator that acts is `python -m trainop operator` with the Deployment's flags, started as a
subprocess whose kubeconfig carries a token of the chart's ServiceAccount (`kubectl create
token`): every API call it makes is authorized by the chart's RBAC and nothing else."""

from __future__ import annotations

import json
import secrets
import subprocess
import types
import urllib.request

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.fixtures.cluster import OperatorProcess, _free_port, delete_namespaces, server_disk
from tests.fixtures.waiting import wait_until
from tests.helm.helm import CHART, docs

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]

RELEASE = "trainop"
SA = "trainop"  # the chart's ServiceAccount (the release's full name)
RESTRICTED = {f"pod-security.kubernetes.io/{mode}": "restricted" for mode in ("enforce", "warn")}


@pytest.fixture(scope="module")
def install(cluster, helm_bin, tmp_path_factory):
    """The chart installed in a `restricted` namespace, watching one job namespace."""
    suffix = secrets.token_hex(3)
    system, jobs = f"trainop-system-{suffix}", f"helm-jobs-{suffix}"
    cluster.kubectl("create", "namespace", system)
    cluster.kubectl("label", "namespace", system, *(f"{k}={v}" for k, v in RESTRICTED.items()))
    cluster.kubectl("create", "namespace", jobs)
    values = tmp_path_factory.mktemp("helm") / "values.yaml"
    # tainting and provisioned servers on: the rights they need, and the admission policies that
    # narrow them, are installed and tried (test_operator_identity_is_narrowed_by_admission)
    values.write_text(yaml.safe_dump({"watchNamespaces": [jobs], "config": {
        "resyncSeconds": 0.5, "preflight": {"taintUnhealthyNodes": True},
        "datastage": {"allowProvisionedServers": True, "nfsClientCIDRs": ["10.224.0.0/16"]}}}))
    helm = [str(helm_bin), "--kubeconfig", str(cluster.kubeconfig)]
    out = subprocess.run([*helm, "install", RELEASE, str(CHART), "-n", system, "-f", str(values),
                          "--wait", "--timeout", "120s"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    try:
        yield types.SimpleNamespace(system=system, jobs=jobs, values=values, helm=helm)
    finally:
        subprocess.run([*helm, "uninstall", RELEASE, "-n", system, "--wait"], capture_output=True)
        delete_namespaces(cluster, system, jobs)


def token_kubeconfig(cluster, namespace: str, path) -> str:
    """A kubeconfig for the cluster whose only credential is the chart ServiceAccount's token."""
    admin = yaml.safe_load(cluster.kubeconfig.read_text())
    token = cluster.kubectl("create", "token", SA, "-n", namespace, "--duration=1h").stdout.strip()
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "sa",
        "clusters": [{"name": "c", "cluster": admin["clusters"][0]["cluster"]}],
        "users": [{"name": "sa", "user": {"token": token}}],
        "contexts": [{"name": "sa", "context": {"cluster": "c", "user": "sa"}}]}))
    return path


def scrape(port: int) -> dict[tuple, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def can_i(cluster, system: str, *args: str) -> bool:
    out = cluster.kubectl("auth", "can-i", f"--as=system:serviceaccount:{system}:{SA}", *args, check=False)
    return out.stdout.strip() == "yes"


def test_operator_pod_admitted_under_the_restricted_profile(cluster, install):
    deploy = cluster.get("deployment", RELEASE, "-n", install.system)
    assert deploy["status"].get("readyReplicas") == 1
    pod = cluster.get("pods", "-n", install.system, "-l", "app.kubernetes.io/name=trainop")["items"][0]
    assert pod["spec"]["serviceAccountName"] == SA


@pytest.mark.parametrize("mode", [{"watchNamespaces": ["default"]}, {"clusterWide": True, "watchNamespaces": []},
                                  {"config": {"preflight": {"taintUnhealthyNodes": True},
                                              "datastage": {"allowProvisionedServers": True, "nfsClientCIDRs": ["10.224.0.0/16"]}},
                                   "metrics": {"networkPolicy": {"scraperNamespaces": ["monitoring"]}}}],
                         ids=["namespaced", "clusterwide", "policies"])
def test_rendered_manifests_pass_server_side_dry_run(cluster, install, mode, tmp_path):
    """The API server's own schemas (strict field validation) and admission (Pod Security
    `restricted`, warn mode) accept every rendered object."""
    values = tmp_path / "v.yaml"
    values.write_text(yaml.safe_dump(mode))
    rendered = subprocess.run([*install.helm, "template", "dryrun", str(CHART), "-n", install.system,
                               "-f", str(values)], capture_output=True, text=True, check=True).stdout
    assert len(docs(rendered)) >= 8
    out = cluster.kubectl("apply", "--dry-run=server", "--validate=strict", "-f", "-",
                          input=rendered, check=False)
    assert out.returncode == 0, out.stderr
    assert "Warning" not in out.stderr, out.stderr


FORBIDDEN = ("Forbidden", "forbidden", "Not enough permissions", " 403")


def assert_no_refusals(op: OperatorProcess) -> None:
    log = op.logs()
    for word in FORBIDDEN:
        assert word not in log, f"{word!r} in the operator log:\n{log[-4000:]}"


def start_sa_operator(cluster, install, tmp_path, name: str) -> OperatorProcess:
    """`trainop operator` with the Deployment's flags and configuration, authenticated only by a
    token of the chart's ServiceAccount; its metrics on a free local port."""
    kubeconfig = token_kubeconfig(cluster, install.system, tmp_path / f"{name}.kubeconfig")
    chart_config = cluster.get("configmap", f"{RELEASE}-config", "-n", install.system)["data"]["config.yaml"]
    deployment_args = cluster.get("deployment", RELEASE, "-n", install.system)[
        "spec"]["template"]["spec"]["containers"][0]["args"]
    # the fixture adds --liveness and --namespace; the metrics port is a free local one
    flags = [a for a in deployment_args[1:] if a.startswith(("--lease", "--log-format"))]
    assert flags == ["--lease=trainop", f"--lease-namespace={install.system}", "--log-format=json"]
    # POD_ID: this replica's identity in the Lease, as the Deployment sets it (the pod's name)
    port = _free_port()
    op = OperatorProcess(types.SimpleNamespace(kubeconfig=kubeconfig), [install.jobs], tmp_path / f"{name}.log",
                         config=yaml.safe_load(chart_config), extra_args=[*flags, f"--metrics-port={port}"],
                         env={"POD_ID": name})
    op.metrics_port = port
    return op.start()


@pytest.fixture(scope="module")
def sa_operator(cluster, install, tmp_path_factory):
    op = start_sa_operator(cluster, install, tmp_path_factory.mktemp("operator"), "operator")
    yield op
    op.stop()


def sample(metrics: dict, name: str, **labels) -> float | None:
    return metrics.get((name, tuple(sorted(labels.items()))))


def test_job_end_to_end_with_only_the_chart_service_account(cluster, install, sa_operator):
    ns, port = install.jobs, sa_operator.metrics_port
    before = scrape(port)
    assert sample(before, "trainop_jobs", namespace=ns, phase="Succeeded") is None
    cluster.apply({"apiVersion": "trainop.io/v1alpha1", "kind": "DistributedTrainingJob",
                   "metadata": {"name": "helm"}, "spec": {"workers": 2, "gpusPerWorker": 4}}, ns)

    def launcher_pod():
        pods = cluster.get("pods", "-n", ns, "-l", "trainop.io/job-name=helm,trainop.io/role=launcher")["items"]
        return next((p["metadata"]["name"] for p in pods if p["status"].get("phase") == "Running"), None)

    pod = wait_until(launcher_pod, timeout=90, what="the launcher pod Running")
    running = scrape(port)
    assert sample(running, "trainop_jobs", namespace=ns, phase="Running") == 1
    cluster.end_pod(ns, pod, 0)
    wait_until(lambda: cluster.get("dtj", "helm", "-n", ns).get("status", {}).get("phase") == "Succeeded",
               timeout=60, what="job helm Succeeded")
    after = wait_until(lambda: (m := scrape(port)) and
                       sample(m, "trainop_jobs", namespace=ns, phase="Succeeded") == 1 and m,
                       timeout=10, what="trainop_jobs{phase=Succeeded} == 1")
    assert not sample(after, "trainop_jobs", namespace=ns, phase="Running")
    transitions = {"name": "trainop_phase_transitions_total", "kind": "DistributedTrainingJob", "phase": "Succeeded"}
    assert sample(after, **transitions) == (sample(before, **transitions) or 0) + 1
    count = {"name": "trainop_reconcile_duration_seconds_count", "kind": "DistributedTrainingJob"}
    assert sample(after, **count) > sample(running, **count) > 0
    assert not [k for k in after if k[0] == "trainop_reconcile_errors_total"]
    assert_no_refusals(sa_operator)
    # structured logs: JSON lines, the job's own lines naming it
    lines = [json.loads(line) for line in sa_operator.logs().splitlines() if line.startswith("{")]
    about = [r for r in lines if (r.get("object") or {}).get("name") == "helm"]
    assert about and all(r["object"]["namespace"] == ns and r["object"]["kind"] == "DistributedTrainingJob"
                         for r in about)


def test_log_shipper_identity_created_with_only_the_chart_service_account(cluster, install, sa_operator):
    """A job with Blob output: the shipper's ServiceAccount, its Role on the progress ConfigMap
    (which the API server lets the operator create only if it holds those verbs itself), the
    RoleBinding, the ConfigMap and the pods, all by the chart's RBAC and nothing else."""
    ns = install.jobs
    cluster.apply({"apiVersion": "trainop.io/v1alpha1", "kind": "DistributedTrainingJob",
                   "metadata": {"name": "shipping"},
                   "spec": {"workers": 1, "gpusPerWorker": 1, "output": {"blob": {
                       "accountURL": "https://acct.blob.core.windows.net", "container": "results",
                       "auth": {"sasSecretRef": {"name": "storage", "key": "sas"}}}}}}, ns)
    wait_until(lambda: cluster.get("dtj", "shipping", "-n", ns).get("status", {}).get("phase") == "Running",
               timeout=90, what="job shipping Running")
    role = cluster.get("role", "shipping-logship", "-n", ns)
    assert role["rules"] == [{"apiGroups": [""], "resources": ["configmaps"],
                              "resourceNames": ["shipping-progress"], "verbs": ["patch"]}]
    cluster.get("rolebinding", "shipping-logship", "-n", ns)
    cluster.get("configmap", "shipping-progress", "-n", ns)
    assert cluster.get("serviceaccount", "shipping-logship", "-n", ns)["automountServiceAccountToken"] is False
    assert_no_refusals(sa_operator)


def test_datastage_end_to_end_with_only_the_chart_service_account(cluster, install, sa_operator):
    """The DataStage side of the RBAC: a provisioned NFS server (NetworkPolicy, Service,
    StatefulSet), the cluster-scoped PV and its claim, the stager's ServiceAccount/Role/RoleBinding (which the
    API server lets the operator create only if it holds the Role's rights itself), the copy
    Job, and the finalizer that deletes the PV."""
    ns, port = install.jobs, sa_operator.metrics_port
    with server_disk(cluster, ns) as sc:
        cluster.kubectl("create", "secret", "generic", "storage", "-n", ns, "--from-literal=sas=sv=x&sig=y")
        cluster.apply({"apiVersion": "trainop.io/v1alpha1", "kind": "DataStage", "metadata": {"name": "data"},
                       "spec": {"source": {"blob": {"accountURL": "https://acct.blob.core.windows.net",
                                                    "container": "imagenet",
                                                    "auth": {"sasSecretRef": {"name": "storage", "key": "sas"}}}},
                                "destination": {"provision": {"size": "8Gi", "storageClassName": sc}}}}, ns)

        def copy_pod():
            pods = cluster.get("pods", "-n", ns, "-l", "trainop.io/datastage=data,trainop.io/role=copy")["items"]
            return next((p["metadata"]["name"] for p in pods if p["status"].get("phase") == "Running"), None)

        pod = wait_until(copy_pod, timeout=90, what="the copy pod Running")
        pv = f"trainop-{cluster.get('dstage', 'data', '-n', ns)['metadata']['uid']}"
        assert cluster.kubectl("get", "pv", pv, check=False).returncode == 0
        # the server's NetworkPolicy, created with the chart's rights only
        assert cluster.get("networkpolicy", "data-nfs", "-n", ns)["spec"]["podSelector"]["matchLabels"] == \
            {"trainop.io/datastage": "data", "trainop.io/role": "nfs-server"}
        cluster.end_pod(ns, pod, 0)
        wait_until(lambda: cluster.get("dstage", "data", "-n", ns).get("status", {}).get("phase") == "Ready",
                   timeout=60, what="DataStage data Ready")
        wait_until(lambda: sample(scrape(port), "trainop_datastages", namespace=ns, phase="Ready") == 1,
                   timeout=10, what="trainop_datastages{phase=Ready} == 1")
        cluster.kubectl("delete", "dstage", "data", "-n", ns, "--wait=false")
        wait_until(lambda: cluster.kubectl("get", "pv", pv, check=False).returncode != 0, timeout=60,
                   what="the finalizer deleted the NFS PV")
    assert not [k for k in scrape(port) if k[0] == "trainop_reconcile_errors_total"]
    assert_no_refusals(sa_operator)


def holder(cluster, install) -> str:
    return ((cluster.get("lease", "trainop", "-n", install.system).get("spec") or {}).get("holderIdentity") or "")


def reconciles(op: OperatorProcess) -> float:
    return sample(scrape(op.metrics_port), "trainop_reconcile_duration_seconds_count",
                  kind="DistributedTrainingJob") or 0


def test_second_replica_stands_by_then_takes_over(cluster, install, sa_operator, tmp_path):
    """Leader election as the chart sets it up (one Lease in the release's namespace; leader.py;
    the chart's own pod runs on a KWOK node, so it runs nothing): of two replicas only the
    Lease's holder reconciles; when it stops cleanly it releases the Lease and the other
    carries on with the same job. (A kill in the middle of a ramp, counted in the audit log:
    tests/cluster/test_chaos.py.)"""
    ns = install.jobs
    wait_until(lambda: holder(cluster, install).startswith("operator_"), timeout=60,
               what="the first replica holding the Lease")
    second = start_sa_operator(cluster, install, tmp_path, "second")
    try:
        idle = reconciles(second)
        cluster.apply({"apiVersion": "trainop.io/v1alpha1", "kind": "DistributedTrainingJob",
                       "metadata": {"name": "peer"}, "spec": {"workers": 1, "gpusPerWorker": 1}}, ns)
        wait_until(lambda: cluster.get("dtj", "peer", "-n", ns).get("status", {}).get("phase") == "Running",
                   timeout=60, what="job peer Running")
        assert reconciles(second) == idle, "the standby reconciled"
        sa_operator.stop()  # a clean exit releases the Lease at once
        wait_until(lambda: holder(cluster, install).startswith("second_"), timeout=30,
                   what="the standby holding the Lease")
        wait_until(lambda: reconciles(second) > idle, timeout=30, what="the standby reconciling the job")
    finally:
        second.stop()


def test_rbac_is_not_broader_than_listed(cluster, install):
    system, jobs = install.system, install.jobs
    # what it needs, in the namespace it serves (positive controls: the check can say yes)
    for verb_resource in (("get", "secrets"), ("create", "pods"), ("patch", "distributedtrainingjobs", "--subresource=status"),
                          ("create", "rolebindings")):
        assert can_i(cluster, system, *verb_resource, "-n", jobs), verb_resource
    assert can_i(cluster, system, "list", "nodes")
    # nothing in namespaces it does not serve
    for ns in ("default", "kube-system", system):
        for verb_resource in (("get", "secrets"), ("create", "pods"), ("list", "distributedtrainingjobs")):
            assert not can_i(cluster, system, *verb_resource, "-n", ns), (ns, verb_resource)
    # and no more than listed where it does serve
    # (patch on pods: granted with provisioned Ganesha servers, narrowed by admission to one
    # annotation: test_operator_identity_is_narrowed_by_admission)
    for verb_resource in (("list", "secrets"), ("watch", "secrets"), ("delete", "secrets"), ("patch", "pods", "--subresource=status"),
                          ("update", "distributedtrainingjobs"), ("create", "distributedtrainingjobs"),
                          ("delete", "roles"), ("escalate", "roles"), ("bind", "clusterroles"),
                          ("create", "pods", "--subresource=exec"),
                          ("get", "pods", "--subresource=log"), ("update", "distributedtrainingjobs", "--subresource=status"), ("delete", "namespaces"), ("patch", "nodes", "--subresource=status"),
                          ("create", "clusterroles"), ("update", "leases")):
        assert not can_i(cluster, system, *verb_resource, "-n", jobs), verb_resource
    assert not can_i(cluster, system, "*", "*", "--all-namespaces")


@pytest.mark.parametrize("values, warned", [({"clusterWide": True, "watchNamespaces": []}, True), (None, False),
                                            ({"watchNamespaces": ["team-a"]}, False)])
def test_a_cluster_wide_install_warns_in_its_notes(cluster, install, helm, values, warned):
    """Serving every namespace binds the operator's rights in kube-system too: the install says so.
    (`install`: the chart's CRDs, which a dry run maps its objects against.)"""
    out = helm("install", "warn", str(CHART), "-n", "trainop-system", "--dry-run=client",
               values=values, kubeconfig=cluster.kubeconfig)
    notes = out.stdout.partition("NOTES:")[2]
    assert notes.startswith("\ntrainop ")
    assert ("WARNING: cluster-wide install" in notes) == warned
    assert ("watchNamespaces={team-a,team-b}" in notes) == warned


@pytest.mark.parametrize("values, message", [
    ({"config": {"nodePools": {"big": {"tolerations": []}}}}, "missing property 'nodeSelector'"),
    ({"config": {"limits": {"maxGpusPerJob": -4}}}, "/config/limits/maxGpusPerJob"),
])
def test_wrong_value_fails_helm_install_and_creates_nothing(cluster, install, values, message, tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(values))
    out = subprocess.run([*install.helm, "install", "bad", str(CHART), "-n", install.system, "-f", str(path)],
                         capture_output=True, text=True)
    assert out.returncode != 0
    assert "values don't meet the specifications of the schema" in out.stderr and message in out.stderr, out.stderr
    left = cluster.kubectl("get", "configmap,secret,deployment", "-n", install.system, "-o", "name").stdout
    assert "bad" not in left, left


def as_operator(cluster, system: str, *args: str, input: str | None = None):
    return cluster.kubectl(f"--as=system:serviceaccount:{system}:{SA}", *args, input=input, check=False)


def test_operator_identity_is_narrowed_by_admission(cluster, install):
    """Issue 22 M11: what RBAC cannot narrow, Kubernetes' ValidatingAdmissionPolicies do. With
    tainting on, the chart's ServiceAccount may patch nodes: it tries to label a node, cordon it,
    add another taint, and is refused; the trainop.io/unhealthy taint alone is admitted. With
    provisioned servers on, it may create PersistentVolumes: a hostPath one (root on a node) and
    an NFS one without the DataStage label are refused."""
    system = install.system
    node = next(n for n in cluster.get("nodes")["items"] if "kwok.x-k8s.io/node" in n["metadata"].get("annotations", {}))
    name = node["metadata"]["name"]
    taints = (node.get("spec") or {}).get("taints") or []
    assert can_i(cluster, system, "patch", "nodes")  # RBAC says yes: the policy decides
    for patch in ({"metadata": {"labels": {"kubernetes.azure.com/agentpool": "stolen"}}},
                  {"metadata": {"annotations": {"x": "y"}}},
                  {"spec": {"unschedulable": True}},
                  {"spec": {"taints": [*taints, {"key": "other", "effect": "NoSchedule"}]}},
                  {"spec": {"taints": [*taints, {"key": "trainop.io/unhealthy", "value": "preflight", "effect": "NoSchedule"}],
                            "unschedulable": True}}):
        out = as_operator(cluster, system, "patch", "node", name, "--type=merge", "-p", json.dumps(patch))
        assert out.returncode != 0 and "ValidatingAdmissionPolicy" in out.stderr and "trainop" in out.stderr, (patch, out.stderr)
    assert cluster.get("node", name)["metadata"]["labels"].get("kubernetes.azure.com/agentpool") != "stolen"
    ours = {"spec": {"taints": [*taints, {"key": "trainop.io/unhealthy", "value": "preflight", "effect": "NoSchedule"}]}}
    out = as_operator(cluster, system, "patch", "node", name, "--type=merge", "-p", json.dumps(ours))
    try:
        assert out.returncode == 0, out.stderr
    finally:
        cluster.kubectl("patch", "node", name, "--type=merge", "-p", json.dumps({"spec": {"taints": taints or None}}))

    def pv(name: str, source: dict, labels: dict) -> str:
        return json.dumps({"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": name, "labels": labels},
                           "spec": {"capacity": {"storage": "1Gi"}, "accessModes": ["ReadWriteOnce"],
                                    "storageClassName": "", **source}})
    uid = {"trainop.io/datastage-uid": "x"}
    suffix = system.rsplit("-", 1)[1]
    for name_, source, labels in ((f"root-{suffix}", {"hostPath": {"path": "/"}}, uid),
                                  (f"unlabelled-{suffix}", {"nfs": {"server": "10.0.0.4", "path": "/x"}}, {})):
        out = as_operator(cluster, system, "create", "-f", "-", input=pv(name_, source, labels))
        assert out.returncode != 0 and "ValidatingAdmissionPolicy" in out.stderr, out.stderr
        assert cluster.kubectl("get", "pv", name_, check=False).returncode != 0
    ok = f"nfs-{suffix}"
    out = as_operator(cluster, system, "create", "-f", "-", input=pv(ok, {"nfs": {"server": "10.0.0.4", "path": "/x"}}, uid))
    cluster.kubectl("delete", "pv", ok, "--wait=false", check=False)
    assert out.returncode == 0, out.stderr


def test_operator_may_only_annotate_nfs_server_pods(cluster, install):
    """Issue 28: with provisioned Ganesha servers the operator may patch pods (the digest of a
    server's client list, render/datastage.py CLIENTS_ANNOTATION), which RBAC cannot narrow.
    As the chart's ServiceAccount: a server pod's image, labels, other annotations and a training
    pod's annotation are all refused by the admission policy; the one annotation is admitted."""
    system, ns = install.system, install.jobs
    node = next(n for n in cluster.get("nodes")["items"] if "kwok.x-k8s.io/node" in n["metadata"].get("annotations", {}))

    def pod(name: str, labels: dict) -> dict:
        return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": labels},
                "spec": {"nodeName": node["metadata"]["name"], "tolerations": [{"operator": "Exists"}],
                         "containers": [{"name": "main", "image": "trainop/nfs-server:0.2.0"}]}}
    server = pod("fake-nfs-0", {"trainop.io/datastage": "fake", "trainop.io/role": "nfs-server"})  # no such DataStage
    worker = pod("fake-worker-0", {"trainop.io/job-name": "fake", "trainop.io/role": "worker"})
    cluster.apply([server, worker], ns)
    try:
        assert can_i(cluster, system, "patch", "pods", "-n", ns)  # RBAC says yes: the policy decides
        ours = {"metadata": {"annotations": {"trainop.io/nfs-clients": "0123456789abcdef"}}}
        # (the image by a strategic merge patch, which keeps the container: the API server's own
        # validation would refuse a merge patch's whole new container list before admission)
        for name, kind, patch in (("fake-nfs-0", "strategic", {"spec": {"containers": [{"name": "main", "image": "evil:1"}]}}),
                                  ("fake-nfs-0", "merge", {"metadata": {"labels": {"trainop.io/role": "worker"}}}),
                                  ("fake-nfs-0", "merge", {"metadata": {"annotations": {"other": "x"}}}),
                                  ("fake-nfs-0", "merge", {"metadata": {"annotations": {**ours["metadata"]["annotations"], "other": "x"}}}),
                                  ("fake-worker-0", "merge", ours)):
            out = as_operator(cluster, system, "patch", "pod", name, "-n", ns, f"--type={kind}", "-p", json.dumps(patch))
            assert out.returncode != 0 and "ValidatingAdmissionPolicy" in out.stderr and "trainop" in out.stderr, (name, patch, out.stderr)
        assert cluster.get("pod", "fake-nfs-0", "-n", ns)["spec"]["containers"][0]["image"] == "trainop/nfs-server:0.2.0"
        assert "trainop.io/nfs-clients" not in (cluster.get("pod", "fake-worker-0", "-n", ns)["metadata"].get("annotations") or {})
        out = as_operator(cluster, system, "patch", "pod", "fake-nfs-0", "-n", ns, "--type=merge", "-p", json.dumps(ours))
        assert out.returncode == 0, out.stderr
        assert cluster.get("pod", "fake-nfs-0", "-n", ns)["metadata"]["annotations"]["trainop.io/nfs-clients"] == "0123456789abcdef"
    finally:
        cluster.kubectl("delete", "pod", "fake-nfs-0", "fake-worker-0", "-n", ns, "--grace-period=0", "--force", check=False)


def test_a_default_install_has_no_node_or_volume_rights(cluster, install, tmp_path):
    """Issue 22 M11: the chart's defaults: namespaced (default only), no PersistentVolume right
    (no DataStage NFS destination allowed), no node patch, and the operator pod's NetworkPolicy
    selects the operator pod (issue 22 L8)."""
    suffix = secrets.token_hex(3)
    system = f"plain-{suffix}"
    cluster.kubectl("create", "namespace", system)
    release = f"plain{suffix}"
    out = subprocess.run([*install.helm, "install", release, str(CHART), "-n", system, "--wait", "--timeout", "120s"],
                         capture_output=True, text=True)
    try:
        assert out.returncode == 0, out.stderr
        user = f"--as=system:serviceaccount:{system}:{release}-trainop"

        def allowed(*args: str) -> bool:
            return cluster.kubectl("auth", "can-i", user, *args, check=False).stdout.strip() == "yes"
        assert allowed("create", "pods", "-n", "default")  # positive control: it serves default
        assert not allowed("create", "pods", "-n", "kube-system")
        for verb in ("create", "get", "delete", "patch"):
            assert not allowed(verb, "persistentvolumes"), verb
        assert not allowed("patch", "nodes")
        hostpath = json.dumps({"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": f"root-{suffix}"},
                               "spec": {"capacity": {"storage": "1Gi"}, "accessModes": ["ReadWriteOnce"],
                                        "hostPath": {"path": "/"}}})
        out = cluster.kubectl(user, "create", "-f", "-", input=hostpath, check=False)
        assert out.returncode != 0 and "forbidden" in out.stderr, out.stderr
        # L8: the policy in the operator's namespace selects its pod and admits nobody by default
        policy = cluster.get("networkpolicy", f"{release}-trainop", "-n", system)
        selector = ",".join(f"{k}={v}" for k, v in policy["spec"]["podSelector"]["matchLabels"].items())
        pods = cluster.get("pods", "-n", system, "-l", selector)["items"]
        assert [p["metadata"]["name"] for p in pods] and all(
            p["metadata"]["name"].startswith(f"{release}-trainop") for p in pods)
        assert policy["spec"]["policyTypes"] == ["Ingress"] and not policy["spec"].get("ingress")
    finally:
        subprocess.run([*install.helm, "uninstall", release, "-n", system, "--wait"], capture_output=True)
        delete_namespaces(cluster, system)
