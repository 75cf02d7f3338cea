"""render/logship.py: the sidecar, shared volume, identity and RBAC a shipping pod gets."""

from __future__ import annotations

import signal
import subprocess

import pytest

from tests.fixtures.waiting import wait_until
from trainop import config, spec
from trainop.render import logship

ACCOUNT = "https://acct.blob.core.windows.net"


def job(output: dict | None, name: str = "j1") -> spec.Job:
    body = {"metadata": {"name": name, "namespace": "team-a"}, "spec": {"workers": 2, "gpusPerWorker": 1}}
    if output is not None:
        body["spec"]["output"] = output
    # the admin lets jobs upload as WI's account (blob.allowedServiceAccounts)
    return spec.parse(body, config.from_dict({"blob": {"allowedServiceAccounts": ["trainer-wi"]}}))


def blob_output(auth: dict | None = None, prefix: str = "runs/") -> dict:
    out = {"accountURL": ACCOUNT, "container": "results", "prefix": prefix}
    if auth is not None:
        out["auth"] = auth
    return {"blob": out}


SAS = {"sasSecretRef": {"name": "storage", "key": "sas"}}
WI = {"workloadIdentity": True, "serviceAccountName": "trainer-wi"}
FIELD_ENV = [
    {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
    {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
    {"name": "POD_UID", "valueFrom": {"fieldRef": {"fieldPath": "metadata.uid"}}},
]


def test_launcher_gets_native_sidecar_shared_volume_and_tee():
    parts = logship.pod_parts(job(blob_output(SAS)), "launcher", None, 2, ["mpirun", "python", "train.py"], {})
    assert parts.init_containers == [{
        "name": "logship",
        "image": "trainop/operator:0.1.0",
        "restartPolicy": "Always",
        "command": ["python", "-m", "trainop.logship"],
        "args": ["--account-url", ACCOUNT, "--container", "results", "--dest", "runs/team-a/j1/2",
                 "--file", "/var/trainop/train.log=$(POD_NAME).log", "--interval", "2", "--drain-timeout", "300"],
        "env": FIELD_ENV + [
            {"name": "TRAINOP_BLOB_AUTH_METHOD", "value": "SASToken"},
            {"name": "TRAINOP_BLOB_SECRET", "valueFrom": {"secretKeyRef": {"name": "storage", "key": "sas"}}},
        ],
        "volumeMounts": [{"name": "trainop-run", "mountPath": "/var/trainop"}],
        "resources": {"requests": {"cpu": "50m", "memory": "96Mi"}, "limits": {"memory": "256Mi"}},
        "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
    }]
    assert parts.volumes == [{"name": "trainop-run", "emptyDir": {"sizeLimit": "20Gi"}}]  # limits.emptyDirSizeLimit
    assert parts.mounts == [{"name": "trainop-run", "mountPath": "/var/trainop"}]
    assert parts.command == ["/bin/sh", "-c", logship.TEE_SCRIPT, "trainop-tee", "/var/trainop/train.log",
                             "mpirun", "python", "train.py"]
    assert parts.service_account_name == "j1-logship"
    assert parts.labels == {}
    assert parts.env == []
    assert parts.drain_seconds == 300  # the pod: this plus the ranks' share (render/dtj.py grace_seconds)


def test_worker_0_uploads_output_and_reports_metrics():
    output = {"name": "output", "mountPath": "/output"}
    parts = logship.pod_parts(job(blob_output(SAS)), "worker", 0, 0, ["/usr/sbin/sshd", "-De"], {}, output_mount=output)
    sidecar = parts.init_containers[0]
    assert sidecar["args"][-11:] == ["--output-dir", "/output", "--metrics-file", "/output/metrics.jsonl",
                                     "--progress", "j1-progress", "--metrics-interval", "15",
                                     # PyTorch with Blob output checkpoints by default: each one is
                                     # uploaded, then reported (trainop.resume)
                                     "--checkpoint-dir", "/output/checkpoints/attempt-0", "--checkpoint-upload"]
    token = "/var/run/secrets/kubernetes.io/serviceaccount"
    assert sidecar["volumeMounts"] == [{"name": "trainop-run", "mountPath": "/var/trainop"},
                                       {"name": "output", "mountPath": "/output", "readOnly": True},
                                       {"name": "trainop-api-token", "mountPath": token, "readOnly": True}]
    # The API token is projected (short-lived, the API server's audience) for the sidecar only:
    # the training container's mounts (parts.mounts) do not name it.
    assert parts.volumes[1] == {"name": "trainop-api-token", "projected": {"sources": [
        {"serviceAccountToken": {"path": "token", "expirationSeconds": 600}},
        {"configMap": {"name": "kube-root-ca.crt", "items": [{"key": "ca.crt", "path": "ca.crt"}]}},
        {"downwardAPI": {"items": [{"path": "namespace",
                                    "fieldRef": {"apiVersion": "v1", "fieldPath": "metadata.namespace"}}]}}]}}
    assert parts.mounts == [{"name": "trainop-run", "mountPath": "/var/trainop"}]
    # The launcher is not where rank 0 writes: it ships its log only, and holds no API token.
    launcher = logship.pod_parts(job(blob_output(SAS)), "launcher", None, 0, ["mpirun"], {}, output_mount=output)
    assert "--output-dir" not in launcher.init_containers[0]["args"]
    assert [v["name"] for v in launcher.volumes] == ["trainop-run"]
    assert all(m["name"] != "trainop-api-token" for m in launcher.init_containers[0]["volumeMounts"])


def test_other_workers_ship_only_when_configured():
    j = job(blob_output(SAS))
    assert logship.pod_parts(j, "worker", 1, 0, ["sshd"], {}) is None
    parts = logship.pod_parts(j, "worker", 1, 0, ["sshd"], {"shipWorkerLogs": True})
    assert "--progress" not in parts.init_containers[0]["args"]
    assert [v["name"] for v in parts.volumes] == ["trainop-run"]


def test_no_output_ships_nothing():
    j = job(None)
    assert logship.pod_parts(j, "launcher", None, 0, ["mpirun"], {}) is None
    assert logship.rbac(j, {}) == []
    assert logship.status_urls(j, 0, {}) == {}


def test_workload_identity_uses_the_federated_account_and_label():
    j = job(blob_output(WI))
    parts = logship.pod_parts(j, "launcher", None, 0, ["mpirun"], {})
    assert parts.service_account_name == "trainer-wi"
    assert parts.labels == {"azure.workload.identity/use": "true"}
    # the webhook injects the federated token into the sidecar, not the training container
    assert parts.annotations == {"azure.workload.identity/skip-containers": "launcher"}
    assert logship.pod_parts(j, "worker", 0, 0, ["sshd"], {}).annotations == {
        "azure.workload.identity/skip-containers": "worker"}
    assert logship.pod_parts(job(blob_output(SAS)), "worker", 0, 0, ["sshd"], {}).annotations == {}
    assert parts.init_containers[0]["env"] == FIELD_ENV + [
        {"name": "TRAINOP_BLOB_AUTH_METHOD", "value": "WorkloadIdentity"}]
    # The user's federated ServiceAccount is bound, not created.
    assert [o["kind"] for o in logship.rbac(j, {})] == ["Role", "RoleBinding"]
    assert logship.rbac(j, {})[1]["subjects"] == [
        {"kind": "ServiceAccount", "name": "trainer-wi", "namespace": "team-a"}]


def test_workload_identity_without_an_account_names_the_field():
    with pytest.raises(spec.SpecError) as err:
        job(blob_output())  # parsed once, in the model: the error comes at parse time
    assert err.value.field == "spec.output.blob.auth.serviceAccountName"
    cfg = config.from_dict({"logship": {"workloadIdentityServiceAccount": "platform-wi"}})
    parsed = spec.parse({"metadata": {"name": "j1", "namespace": "team-a"},
                         "spec": {"workers": 2, "gpusPerWorker": 1, "output": blob_output()}}, cfg)
    parts = logship.pod_parts(parsed, "launcher", None, 0, ["mpirun"], cfg.section("logship"))
    assert parts.service_account_name == "platform-wi"


def test_account_url_with_a_sas_is_refused():
    with pytest.raises(spec.SpecError) as err:
        spec.parse_output({"blob": {"accountURL": f"{ACCOUNT}?sv=1&sig=abc", "container": "c"}}, None)
    assert err.value.field == "spec.output.blob.accountURL"
    assert "sig=abc" not in str(err.value)


@pytest.mark.parametrize("url", ["https://acct.blob.core.windows.net:abc", "https://acct.blob.core.windows.net:99999",
                                 "https://acct.blob.core.windows.net:-1", "http://[::1/devstoreaccount1"])
def test_account_url_with_a_malformed_port_is_a_spec_error_naming_the_field(url):
    """Issue 22 L1: urlsplit raises ValueError only when the port is read, which once happened
    in every reconcile and in the admission gate (for every job of the namespace)."""
    with pytest.raises(spec.SpecError) as err:
        spec.parse_output({"blob": {"accountURL": url + "?sv=1&sig=abc", "container": "c"}}, None)
    assert err.value.field == "spec.output.blob.accountURL"
    assert "is not a valid URL" in str(err.value) and "sig=abc" not in str(err.value)
    with pytest.raises(spec.SpecError) as err:
        spec.parse_stage({"apiVersion": "trainop.io/v1alpha1", "kind": "DataStage", "metadata": {"name": "s", "namespace": "n"},
                          "spec": {"source": {"blob": {"accountURL": url, "container": "c"}},
                                   "destination": {"provision": {"size": "1Gi"}}}})
    assert err.value.field == "spec.source.blob.accountURL"


def test_rbac_allows_only_this_jobs_progress_config_map():
    objs = logship.rbac(job(blob_output(SAS)), {})
    labels = {"trainop.io/job-name": "j1"}
    assert objs == [
        {"apiVersion": "v1", "kind": "ServiceAccount",
         "metadata": {"name": "j1-logship", "namespace": "team-a", "labels": labels},
         "automountServiceAccountToken": False},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
         "metadata": {"name": "j1-logship", "namespace": "team-a", "labels": labels},
         "rules": [{"apiGroups": [""], "resources": ["configmaps"],
                    "resourceNames": ["j1-progress"], "verbs": ["patch"]}]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
         "metadata": {"name": "j1-logship", "namespace": "team-a", "labels": labels},
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "j1-logship"},
         "subjects": [{"kind": "ServiceAccount", "name": "j1-logship", "namespace": "team-a"}]},
    ]


def test_progress_config_map_only_with_a_sidecar():
    made = {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": "j1-progress", "namespace": "team-a",
                         "labels": {"trainop.io/job-name": "j1", "trainop.io/role": "progress"}},
            "data": {}}
    assert logship.progress_config_map(job(blob_output(SAS)), {}) == made
    assert logship.progress_config_map(job({"pvc": {"claimName": "results"}}), {}) == made
    assert logship.progress_config_map(job(None), {}) is None


@pytest.mark.parametrize("data, shown", [
    ({"metrics": '{"step": 3, "loss": 1.5, "final": true}'}, {"step": 3, "loss": 1.5, "final": True}),
    # the images the trainer skipped as bad (trainop_trainer/data.py) reach the status too
    ({"metrics": '{"step": 3, "badSamples": 2}'}, {"step": 3, "badSamples": 2}),
    ({"metrics": '{"step": 3, "badSamples": "many"}'}, {"step": 3}),
    # non-finite values arrive as strings (the sidecar's JSON has no NaN literal) and stay so
    ({"metrics": '{"step": 3, "loss": "NaN", "stepTime": "Infinity"}'},
     {"step": 3, "loss": "NaN", "stepTime": "Infinity"}),
    # untrusted input: a bare NaN (Python's json reads it) becomes the string, not a float
    ({"metrics": '{"loss": NaN, "imagesPerSec": -Infinity}'}, {"loss": "NaN", "imagesPerSec": "-Infinity"}),
    # only the contract's keys, numbers or bools; nothing else reaches the status
    ({"metrics": '{"step": 1, "phase": "Succeeded", "loss": "low", "epoch": {"a": 1}, "worldSize": 1e400}'},
     {"step": 1, "worldSize": "Infinity"}),
    ({"metrics": '{"step": 123456789012345678901234567890}'}, None),
    ({"metrics": "not json"}, None), ({"metrics": "[1]"}, None), ({"metrics": '{"x": 1}'}, None),
    ({"metrics": '{"step": 1, "pad": "' + "x" * 5000 + '"}'}, None), ({}, None),
])
def test_progress_metrics_are_checked_as_untrusted_input(data, shown):
    assert logship.progress_metrics({"data": data}) == shown


def test_progress_metrics_without_a_config_map():
    assert logship.progress_metrics(None) is None


def test_status_urls():
    assert logship.status_urls(job(blob_output(SAS)), 3, {}) == {
        "logsURL": f"{ACCOUNT}/results/runs/team-a/j1/3/", "outputURL": f"{ACCOUNT}/results/runs/team-a/j1/3/output/"}
    assert logship.status_urls(job(blob_output(SAS, prefix="")), 0, {}) == {
        "logsURL": f"{ACCOUNT}/results/team-a/j1/0/", "outputURL": f"{ACCOUNT}/results/team-a/j1/0/output/"}
    # issue 22 M3: a stored job's folder carries its namespace and uid: a job of its name in
    # another namespace, or an earlier one here, writing the same container has another folder
    stored = spec.parse({"metadata": {"name": "j1", "namespace": "team-a", "uid": "0123abcd-ffff"},
                         "spec": {"workers": 2, "gpusPerWorker": 1, "output": blob_output(SAS)}}, config.from_dict(None))
    assert logship.status_urls(stored, 1, {})["logsURL"] == f"{ACCOUNT}/results/runs/team-a/j1-0123abcd/1/"
    assert logship.pod_parts(stored, "launcher", None, 1, ["mpirun"], {}).init_containers[0]["args"][5] == \
        "runs/team-a/j1-0123abcd/1"
    assert logship.status_urls(job({"pvc": {"claimName": "results"}}), 1, {}) == {
        "logsURL": "pvc://results/logs/j1/1/", "outputURL": "pvc://results/"}


def test_pvc_output_tees_onto_the_claim_and_worker_0_only_reports():
    j = job({"pvc": {"claimName": "results"}})
    parts = logship.pod_parts(j, "launcher", None, 1, ["mpirun"], {})
    assert parts.init_containers == []
    assert parts.volumes == [{"name": "trainop-run", "persistentVolumeClaim": {"claimName": "results"}}]
    assert parts.mounts == [{"name": "trainop-run", "mountPath": "/var/trainop"}]
    assert parts.command[-2:] == ["/var/trainop/logs/j1/1/$(POD_NAME).log", "mpirun"]
    assert parts.env == FIELD_ENV[:1]
    assert parts.service_account_name is None
    # Worker 0: the same tee, and a sidecar that ships nothing (no Blob, no credential) but
    # reports the trainer's metrics into the progress ConfigMap, through its own token.
    w0 = logship.pod_parts(j, "worker", 0, 1, ["sshd"], {}, output_mount={"name": "output", "mountPath": "/output"})
    assert w0.command == logship.pod_parts(j, "worker", 0, 1, ["sshd"], {}).command
    (sidecar,) = w0.init_containers
    # each complete checkpoint (on the claim: spec.checkpoint's default) reported, not uploaded
    assert sidecar["args"] == ["--interval", "2", "--drain-timeout", "300", "--metrics-file", "/output/metrics.jsonl",
                               "--progress", "j1-progress", "--metrics-interval", "15",
                               "--checkpoint-dir", "/output/checkpoints/j1/attempt-1"]
    assert sidecar["env"] == FIELD_ENV
    assert sidecar["volumeMounts"] == [{"name": "output", "mountPath": "/output", "readOnly": True},
                                       {"name": "trainop-api-token", "readOnly": True,
                                        "mountPath": "/var/run/secrets/kubernetes.io/serviceaccount"}]
    assert [v["name"] for v in w0.volumes] == ["trainop-run", "trainop-api-token"]
    assert w0.service_account_name == "j1-logship"
    role = next(o for o in logship.rbac(j, {}) if o["kind"] == "Role")
    assert role["rules"] == [{"apiGroups": [""], "resources": ["configmaps"], "resourceNames": ["j1-progress"],
                              "verbs": ["patch"]}]


# The tee wrapper, run for real by /bin/sh (what the training container runs).

def tee(tmp_path, *command: str, **kw) -> subprocess.Popen:
    return subprocess.Popen(["/bin/sh", "-c", logship.TEE_SCRIPT, "trainop-tee", str(tmp_path / "logs" / "train.log"),
                             *command], stdout=subprocess.PIPE, **kw)


def test_tee_keeps_stdout_and_stderr_in_both_places_and_the_exit_code(tmp_path):
    proc = tee(tmp_path, "/bin/sh", "-c", "echo out; echo err >&2; printf 'no newline'; exit 7")
    stdout, _ = proc.communicate(timeout=30)
    assert proc.returncode == 7
    assert stdout == b"out\nerr\nno newline"
    assert (tmp_path / "logs" / "train.log").read_bytes() == stdout


def test_tee_appends_after_a_container_restart(tmp_path):
    for word in ("first", "second"):
        proc = tee(tmp_path, "echo", word)
        proc.communicate(timeout=30)
        assert proc.returncode == 0
    assert (tmp_path / "logs" / "train.log").read_bytes() == b"first\nsecond\n"


def test_tee_forwards_sigterm_to_the_command(tmp_path):
    script = "trap 'echo got TERM; exit 143' TERM; echo ready; while :; do sleep 0.1; done"
    proc = tee(tmp_path, "/bin/sh", "-c", script)
    log = tmp_path / "logs" / "train.log"
    wait_until(lambda: log.exists() and b"ready" in log.read_bytes(), timeout=30, what="the command to start")
    proc.send_signal(signal.SIGTERM)
    stdout, _ = proc.communicate(timeout=30)
    assert proc.returncode == 143
    assert stdout == log.read_bytes() == b"ready\ngot TERM\n"
