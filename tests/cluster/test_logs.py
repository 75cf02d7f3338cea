"""Logs and results that outlive pods, on the real local control plane (KWOK runs no containers):
the rendered pods carry the log sidecar; that sidecar, started as a real process with exactly the
args, env, Secret and ServiceAccount identity of its rendered pod, reports metrics into the job's
status and archives the log in Azurite; `trainop logs` returns the archive after the pods are
gone; no credential shows up in any status, Event, pod spec or log."""

from __future__ import annotations

import base64
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import kubernetes.client as k8s
import pytest
import yaml

from tests.fixtures.cluster import cli_config
from tests.fixtures.waiting import wait_until
from trainop import blob, kube
from trainop.cli.logs import job_folder
from trainop.render import logship

pytestmark = [pytest.mark.cluster, pytest.mark.azurite]

SECRET = "storage"


def dtj(name: str, azurite, container: str, **run_policy) -> dict:
    return {
        "apiVersion": "trainop.io/v1alpha1", "kind": "DistributedTrainingJob",
        "metadata": {"name": name},
        "spec": {
            "workers": 2, "gpusPerWorker": 1,
            "output": {"blob": {"accountURL": azurite.http_url, "container": container, "prefix": "runs",
                                "auth": {"sasSecretRef": {"name": SECRET, "key": "sas"}}}},
            "runPolicy": run_policy,
        },
    }


def setup_job(cluster, namespace, azurite, name: str, **run_policy) -> tuple[str, object]:
    container = azurite.new_container()
    sas = azurite.container_sas(container.container_name, permission="racwl")
    cluster.kubectl("create", "secret", "generic", SECRET, "-n", namespace, f"--from-literal=sas={sas}")
    cluster.apply(dtj(name, azurite, container.container_name, **run_policy), namespace)
    return sas, container


def launcher_pod(cluster, namespace: str, name: str) -> dict:
    def find():
        pods = cluster.get("pods", "-n", namespace, "-l", f"trainop.io/job-name={name},trainop.io/role=launcher")
        return pods["items"][0] if pods["items"] else None
    return wait_until(find, timeout=120, what=f"the launcher pod of {name}")


class RenderedSidecar:
    """The pod's `logship` init container run as a local process: its command and args (pod
    paths mapped onto `root`), its env (fieldRefs from the pod, secretKeyRefs from the Secret),
    and a kubeconfig holding a token of the pod's own ServiceAccount."""

    def __init__(self, cluster, pod: dict, root: Path):
        spec = next(c for c in pod["spec"]["initContainers"] if c["name"] == logship.SIDECAR)
        meta = pod["metadata"]
        self.root = root
        self.run_dir, self.output_dir = root / "run", root / "output"
        self.run_dir.mkdir(parents=True)
        self.output_dir.mkdir()
        fields = {"metadata.name": meta["name"], "metadata.namespace": meta["namespace"], "metadata.uid": meta["uid"]}
        env = {**os.environ}
        for item in spec["env"]:
            source = item.get("valueFrom") or {}
            if "value" in item:
                env[item["name"]] = item["value"]
            elif "fieldRef" in source:
                env[item["name"]] = fields[source["fieldRef"]["fieldPath"]]
            else:
                ref = source["secretKeyRef"]
                data = cluster.get("secret", ref["name"], "-n", meta["namespace"])["data"]
                env[item["name"]] = base64.b64decode(data[ref["key"]]).decode()
        env["KUBECONFIG"] = str(self._kubeconfig(cluster, pod))
        args = [a.replace("$(POD_NAME)", meta["name"]).replace(logship.RUN_DIR, str(self.run_dir))
                .replace("/output", str(self.output_dir)) for a in spec["args"]]
        assert spec["command"][0] == "python"
        self.log = root / "sidecar.log"
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen([sys.executable, *spec["command"][1:], *args], env=env,
                                         stdout=out, stderr=subprocess.STDOUT)
        wait_until(lambda: "shipping " in self.output() or self.proc.poll() is not None, timeout=30,
                   what="the sidecar to start")

    def _kubeconfig(self, cluster, pod: dict) -> Path:
        account, ns = pod["spec"]["serviceAccountName"], pod["metadata"]["namespace"]
        token = cluster.kubectl("create", "token", account, "-n", ns).stdout.strip()
        admin = yaml.safe_load(Path(cluster.kubeconfig).read_text())
        config = {"apiVersion": "v1", "kind": "Config", "clusters": admin["clusters"],
                  "users": [{"name": account, "user": {"token": token}}],
                  "contexts": [{"name": "pod", "context": {"cluster": admin["clusters"][0]["name"],
                                                           "user": account, "namespace": ns}}],
                  "current-context": "pod"}
        path = self.root / "pod.kubeconfig"
        path.write_text(yaml.safe_dump(config))
        return path

    def output(self) -> str:
        return self.log.read_text()

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=60)


def test_launcher_pod_has_the_sidecar_the_shared_volume_and_the_identity(cluster, namespace, operator, azurite):
    sas, _ = setup_job(cluster, namespace, azurite, "ship")
    pod = launcher_pod(cluster, namespace, "ship")
    spec = pod["spec"]
    sidecar = next(c for c in spec["initContainers"] if c["name"] == "logship")
    assert sidecar["restartPolicy"] == "Always"
    assert {"name": "trainop-run", "emptyDir": {"sizeLimit": "20Gi"}} in spec["volumes"]
    assert {"name": "trainop-run", "mountPath": "/var/trainop"} in sidecar["volumeMounts"]
    assert {"name": "trainop-run", "mountPath": "/var/trainop"} in spec["containers"][0]["volumeMounts"]
    assert spec["containers"][0]["command"][:2] == ["/bin/sh", "-c"]
    assert spec["serviceAccountName"] == "ship-logship"
    assert {"name": blob.SECRET_ENV, "valueFrom": {"secretKeyRef": {"name": SECRET, "key": "sas"}}} in sidecar["env"]
    # The identity may get/patch the job's progress ConfigMap and nothing else: not the job,
    # not its status (which the operator acts on).
    who = f"system:serviceaccount:{namespace}:ship-logship"
    def can(*what: str) -> bool:
        return cluster.kubectl("auth", "can-i", "-n", namespace, f"--as={who}", *what, check=False).stdout.strip() == "yes"
    assert can("patch", "configmaps/ship-progress")
    assert not can("patch", "configmaps/ship-mpi")
    assert not can("patch", "distributedtrainingjobs.trainop.io/ship", "--subresource=status")
    assert not can("patch", "distributedtrainingjobs.trainop.io/ship")
    assert not can("get", "pods")
    assert not can("get", "secrets")
    status = cluster.get("dtj", "ship", "-n", namespace)["status"]
    folder = job_folder(cluster.get("dtj", "ship", "-n", namespace))  # runs/<namespace>/ship-<uid8>
    assert folder.startswith(f"runs/{namespace}/ship-")
    base = f"{azurite.http_url}/{_container_of(cluster, namespace)}/{folder}/0/"
    assert (status["logsURL"], status["outputURL"]) == (base, base + "output/")
    assert sas not in json.dumps(pod) and sas not in json.dumps(status)

    # Bad input to `trainop logs`: one line naming the problem.
    trainop = [sys.executable, "-m", "trainop", "logs", "-n", namespace, "--kubeconfig", str(cluster.kubeconfig)]
    for args, message in ((["ship", "--pod", "boss"], "trainop logs: --pod 'boss': expected launcher or worker-N (e.g. worker-0)\n"),
                          (["nope"], f"trainop logs: DistributedTrainingJob {namespace}/nope not found\n")):
        shown = subprocess.run([*trainop, *args], capture_output=True, text=True, timeout=60)
        assert (shown.returncode, shown.stderr) == (1, message)


def _container_of(cluster, namespace: str) -> str:
    return cluster.get("dtj", "ship", "-n", namespace)["spec"]["output"]["blob"]["container"]


def test_metrics_reach_the_status_and_logs_outlive_the_pods(cluster, namespace, operator, azurite, tmp_path):
    sas, container = setup_job(cluster, namespace, azurite, "arch", cleanPodPolicy="All")
    launcher = launcher_pod(cluster, namespace, "arch")
    worker0 = cluster.get("pod", "arch-worker-0", "-n", namespace)

    # Worker 0's sidecar (where rank 0 writes its metrics) reports them with its pod's own token,
    # into the progress ConfigMap; the operator shows them in status.metrics.
    rank0 = RenderedSidecar(cluster, worker0, tmp_path / "worker-0")
    metrics = rank0.output_dir / "metrics.jsonl"
    metrics.write_text(json.dumps({"epoch": 0, "step": 10, "loss": 6.5, "imagesPerSec": 812.5, "worldSize": 2}) + "\n")
    expected = {"epoch": 0, "step": 10, "loss": 6.5, "imagesPerSec": 812.5, "worldSize": 2}
    wait_until(lambda: (cluster.get("dtj", "arch", "-n", namespace).get("status") or {}).get("metrics") == expected,
               timeout=60, what="status.metrics from the sidecar")
    # A diverged loss: Python's json writes a bare NaN, which once made every later patch invalid.
    with open(metrics, "a") as f:
        f.write(json.dumps({"epoch": 0, "step": 15, "loss": float("nan"), "worldSize": 2}) + "\n")
    wait_until(lambda: (cluster.get("dtj", "arch", "-n", namespace).get("status") or {}).get("metrics")
               == {"epoch": 0, "step": 15, "loss": "NaN", "worldSize": 2},
               timeout=60, what="a NaN loss in status.metrics")

    # The launcher's sidecar archives the tee'd log; `trainop logs -f` follows it. KWOK runs no
    # kubelet to serve the live pod's log, so -f shows the archive (the fallback for a pod whose
    # node is unreachable), as it grows, and ends once the job is over and its pods are gone.
    shipper = RenderedSidecar(cluster, launcher, tmp_path / "launcher")
    first = b"".join(b"rank 0 step %d loss %.3f\n" % (i, 7 - i / 100) for i in range(1000))
    second = b"".join(b"rank 0 step %d loss %.3f\n" % (i, 7 - i / 100) for i in range(1000, 2000)) + b"done"
    text = first + second
    (shipper.run_dir / "train.log").write_bytes(first)
    trainop = [sys.executable, "-m", "trainop", "logs", "arch", "-n", namespace, "--kubeconfig", str(cluster.kubeconfig),
               "--config", str(cli_config(tmp_path / "cli-config.yaml"))]
    followed, follow_err = tmp_path / "followed.log", tmp_path / "followed.err"
    with open(followed, "wb") as out, open(follow_err, "wb") as err:
        follower = subprocess.Popen([*trainop, "-f"], stdout=out, stderr=err)
    wait_until(lambda: followed.read_bytes() == first, timeout=60, what="trainop logs -f to show the first part")
    with open(shipper.run_dir / "train.log", "ab") as f:
        f.write(second)
    wait_until(lambda: followed.read_bytes() == text, timeout=60, what="trainop logs -f to show what followed")
    with open(metrics, "a") as f:
        f.write(json.dumps({"epoch": 1, "step": 20, "loss": 5.0, "final": True}) + "\n")
    # Native sidecars stop after the training container: the test stops them the same way.
    assert shipper.stop() == 0, shipper.output()
    assert rank0.stop() == 0, rank0.output()
    wait_until(lambda: cluster.get("dtj", "arch", "-n", namespace)["status"].get("metrics")
               == {"epoch": 1, "step": 20, "loss": 5.0, "final": True}, timeout=60, what="the final metrics")

    cluster.end_pod(namespace, launcher["metadata"]["name"], exit_code=0)
    wait_until(lambda: cluster.get("dtj", "arch", "-n", namespace).get("status", {}).get("phase") == "Succeeded",
               timeout=120, what="the job to succeed")
    wait_until(lambda: not cluster.get("pods", "-n", namespace, "-l", "trainop.io/job-name=arch")["items"],
               timeout=120, what="cleanPodPolicy All to delete every pod")

    assert follower.wait(timeout=60) == 0, follow_err.read_text()
    assert followed.read_bytes() == text
    shown = subprocess.run(trainop, capture_output=True, timeout=60)
    assert shown.returncode == 0, shown.stderr.decode()
    assert shown.stdout == text
    folder = job_folder(cluster.get("dtj", "arch", "-n", namespace))
    assert container.get_blob_client(f"{folder}/0/output/metrics.jsonl").download_blob().readall() == metrics.read_bytes()
    missing = subprocess.run([*trainop, "--attempt", "3"], capture_output=True, text=True, timeout=60)
    assert missing.returncode == 1
    assert missing.stderr.startswith("trainop logs: no live pod and no archived log for launcher of attempt 3")

    # No credential in anything the job, the operator or the sidecars left behind.
    events = cluster.kubectl("get", "events", "-n", namespace, "-o", "json").stdout
    texts = [events, json.dumps(cluster.get("dtj", "arch", "-n", namespace)), operator.logs(),
             rank0.output(), shipper.output(), shown.stderr.decode(), missing.stderr, follow_err.read_text()]
    signature = sas.split("sig=", 1)[1].split("&", 1)[0]
    for text_ in texts:
        assert sas not in text_ and signature not in text_


def token_kubeconfig(cluster, namespace: str, account: str, path: Path) -> Path:
    """A kubeconfig whose only credential is a token of `account` (what a pod of it can get)."""
    token = cluster.kubectl("create", "token", account, "-n", namespace).stdout.strip()
    admin = yaml.safe_load(Path(cluster.kubeconfig).read_text())
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "t",
        "clusters": [{"name": "c", "cluster": admin["clusters"][0]["cluster"]}],
        "users": [{"name": "u", "user": {"token": token}}],
        "contexts": [{"name": "t", "context": {"cluster": "c", "user": "u", "namespace": namespace}}]}))
    return path


def user_containers(pod: dict) -> list[dict]:
    """The containers that run the job's own code (every one but the log shipper)."""
    return pod["spec"]["containers"] + [c for c in pod["spec"].get("initContainers", [])
                                        if c["name"] != logship.SIDECAR]


def test_job_code_holds_no_token_and_the_shippers_cannot_write_the_status(cluster, namespace, operator, azurite, tmp_path):
    """Issue 15, item 3. The pods as the API server admitted them (its ServiceAccount admission
    adds a token volume to every container unless the pod opts out): no container that runs the
    job's code has a token; worker 0's shipper alone has one, projected. With that token,
    marking the job Succeeded is Forbidden, while its own progress ConfigMap may be patched."""
    setup_job(cluster, namespace, azurite, "liar")
    launcher_pod(cluster, namespace, "liar")
    pods = cluster.get("pods", "-n", namespace, "-l", "trainop.io/job-name=liar")["items"]
    assert len(pods) == 3
    for pod in pods:
        assert pod["spec"]["automountServiceAccountToken"] is False
        assert not [v for v in pod["spec"]["volumes"] if v["name"].startswith("kube-api-access")]
        for container in user_containers(pod):
            mounts = [m["mountPath"] for m in container.get("volumeMounts", [])]
            assert not [m for m in mounts if m.startswith("/var/run/secrets")], (pod["metadata"]["name"], mounts)
    worker0 = next(p for p in pods if p["metadata"]["name"] == "liar-worker-0")
    shipper = next(c for c in worker0["spec"]["initContainers"] if c["name"] == logship.SIDECAR)
    assert {"name": logship.API_TOKEN_VOLUME, "mountPath": logship.API_TOKEN_DIR, "readOnly": True} in shipper["volumeMounts"]

    kubeconfig = token_kubeconfig(cluster, namespace, worker0["spec"]["serviceAccountName"], tmp_path / "shipper")
    # PATCH requests straight from a client holding that token, as the sidecar makes them
    # (kubectl patch would GET first, and a Forbidden GET would prove nothing about PATCH)
    api = kube.connect(str(kubeconfig))[0]
    core, custom = k8s.CoreV1Api(api), k8s.CustomObjectsApi(api)

    def expect(code, call) -> None:
        try:
            call()
        except k8s.ApiException as exc:
            assert exc.status == code, exc
            return
        assert code is None, "allowed"
    lie = {"status": {"phase": "Succeeded", "cleanedUp": True}}
    expect(403, lambda: custom.patch_namespaced_custom_object_status(
        "trainop.io", "v1alpha1", namespace, "distributedtrainingjobs", "liar", lie))
    expect(403, lambda: custom.patch_namespaced_custom_object(
        "trainop.io", "v1alpha1", namespace, "distributedtrainingjobs", "liar", {"spec": {"workers": 1}}))
    assert cluster.get("dtj", "liar", "-n", namespace)["status"]["phase"] == "Running"
    # what it may do: report progress, which the operator only shows
    expect(None, lambda: core.patch_namespaced_config_map(
        "liar-progress", namespace, {"data": {"metrics": json.dumps({"step": 3, "phase": "Succeeded"})}}))
    wait_until(lambda: cluster.get("dtj", "liar", "-n", namespace)["status"].get("metrics") == {"step": 3},
               timeout=60, what="the report in status.metrics")
    assert cluster.get("dtj", "liar", "-n", namespace)["status"]["phase"] == "Running"
    expect(403, lambda: core.patch_namespaced_config_map("liar-mpi", namespace, {"data": {"x": "1"}}))
    expect(403, lambda: core.read_namespaced_config_map("liar-progress", namespace))


def test_workload_identity_reaches_the_shipper_not_the_job_code(cluster, namespace, operator_factory, azurite):
    """Issue 15, item 7. With workload identity the pods must run as the federated
    ServiceAccount (the webhook federates only the pod's own account), so the training
    container is kept from every credential of it: no API token, and the webhook is told to
    skip it; the Role bound to that account allows only the progress ConfigMap."""
    account = "team-wi"
    operator_factory(config={"blob": {"allowedServiceAccounts": [account]}})  # the admin's list
    cluster.kubectl("create", "serviceaccount", account, "-n", namespace)
    cluster.kubectl("annotate", "serviceaccount", account, "-n", namespace,
                    "azure.workload.identity/client-id=00000000-0000-0000-0000-000000000000")
    container = azurite.new_container()
    body = dtj("wi", azurite, container.container_name)
    body["spec"]["output"]["blob"]["auth"] = {"workloadIdentity": True, "serviceAccountName": account}
    cluster.apply(body, namespace)
    launcher_pod(cluster, namespace, "wi")
    pods = cluster.get("pods", "-n", namespace, "-l", "trainop.io/job-name=wi")["items"]
    assert len(pods) == 3
    for pod in pods:
        spec, meta = pod["spec"], pod["metadata"]
        assert spec["automountServiceAccountToken"] is False
        if meta["name"] == "wi-worker-1":  # ships nothing (shipWorkerLogs is off): no identity at all
            assert spec["serviceAccountName"] == "default" and "initContainers" not in spec
            continue
        assert spec["serviceAccountName"] == account
        assert meta["labels"]["azure.workload.identity/use"] == "true"
        users = [c["name"] for c in user_containers(pod)]
        assert meta["annotations"]["azure.workload.identity/skip-containers"].split(";") == users
        for c in user_containers(pod):
            assert not [m for m in c.get("volumeMounts", []) if m["mountPath"].startswith("/var/run/secrets")]
    # the user's account is bound to the narrow Role, not created or widened
    who = f"system:serviceaccount:{namespace}:{account}"
    def can(*what: str) -> bool:
        return cluster.kubectl("auth", "can-i", "-n", namespace, f"--as={who}", *what, check=False).stdout.strip() == "yes"
    assert can("patch", "configmaps/wi-progress")
    assert not can("patch", "distributedtrainingjobs.trainop.io/wi", "--subresource=status")
    assert "ownerReferences" not in cluster.get("serviceaccount", account, "-n", namespace)["metadata"]
