"""spec.podTemplate on real pods, in a namespace that enforces Pod Security `restricted`: an extra
ConfigMap volume, envFrom that ConfigMap, env from a Secret and a native sidecar really reach
the training container: the training command (under torchrun) reads the env and the files and
waits for what the sidecar wrote, else it fails the job."""

from __future__ import annotations

import pytest

from tests.e2e.test_real_pods import wait_phase, with_blob_output
from tests.fixtures.cluster import OperatorProcess

pytestmark = pytest.mark.real

# Each rank checks what the pod template gave it; a missing piece exits non-zero, which fails
# the job (backoffLimit 0). The sidecar starts before the training container but may not have
# written its file yet: a bounded wait on that condition.
SCRIPT = """\
set -eu
test "$SETTINGS_EXPERIMENT" = pod-template-e2e
test "$(cat /etc/train-settings/EXPERIMENT)" = pod-template-e2e
test "$API_TOKEN" = s3cret
i=0
until [ -s /shared/from-sidecar ]; do
  i=$((i + 1)); [ "$i" -le 600 ] || { echo "no file from the sidecar" >&2; exit 3; }
  sleep 0.1
done
echo "rank $RANK: EXPERIMENT=$SETTINGS_EXPERIMENT file=$(cat /etc/train-settings/EXPERIMENT) sidecar=$(cat /shared/from-sidecar)"
"""


@pytest.fixture
def operator_allowing_token(real_cluster, restricted_namespace, tmp_path):
    """The admin lets pod templates reference the Secret `token` (podTemplate.allow.secrets)."""
    op = OperatorProcess(real_cluster, [restricted_namespace], tmp_path / "operator.log",
                         config={"podTemplate": {"allow": {"secrets": ["token"]}}}).start()
    yield op
    op.stop()


# A sidecar's idle end: it exits on the kubelet's SIGTERM once training ended (as PID 1, `exec
# sleep infinity` would ignore it and hold the pod for its whole grace period, which is
# logship.drainSeconds + 30 s where logs are shipped: 5.5 minutes of a test).
IDLE = "trap 'exit 0' TERM; sleep infinity & wait"


def test_volume_envfrom_and_sidecar_reach_the_training_container(real_cluster, restricted_namespace,
                                                               operator_allowing_token):
    ns = restricted_namespace
    real_cluster.kubectl("create", "configmap", "train-settings", "-n", ns,
                         "--from-literal=EXPERIMENT=pod-template-e2e")
    real_cluster.kubectl("create", "secret", "generic", "token", "-n", ns, "--from-literal=value=s3cret")
    manifest = {
        "apiVersion": "trainop.io/v1alpha1", "kind": "DistributedTrainingJob", "metadata": {"name": "tpl"},
        "spec": {
            # one GPU each: the gpu pool's real node is where the trainer image is loaded
            "framework": "pytorch", "launcher": "torchrun", "workers": 2, "gpusPerWorker": 1,
            "resources": {"requests": {"cpu": "50m", "memory": "128Mi"}},
            "command": ["sh", "-c", SCRIPT],
            "runPolicy": {"backoffLimit": 0},
            "podTemplate": {"worker": {
                "metadata": {"labels": {"team": "vision"}},
                "spec": {
                    "volumes": [{"name": "settings", "configMap": {"name": "train-settings"}},
                                {"name": "shared", "emptyDir": {}}],
                    "initContainers": [{
                        "name": "sidecar", "image": "trainop/trainer-pytorch:0.1.0",
                        "restartPolicy": "Always",  # a native sidecar: ends with the pod
                        "command": ["sh", "-c", f"echo hello > /shared/from-sidecar; {IDLE}"],
                        "resources": {"requests": {"cpu": "10m", "memory": "16Mi"}},
                        "volumeMounts": [{"name": "shared", "mountPath": "/shared"}]}],
                    "containers": [{
                        "name": "worker",
                        "envFrom": [{"configMapRef": {"name": "train-settings"}, "prefix": "SETTINGS_"}],
                        "env": [{"name": "API_TOKEN",
                                 "valueFrom": {"secretKeyRef": {"name": "token", "key": "value"}}}],
                        "volumeMounts": [{"name": "settings", "mountPath": "/etc/train-settings"},
                                         {"name": "shared", "mountPath": "/shared", "readOnly": True}]}],
                }}},
        },
    }
    real_cluster.apply(manifest, ns)
    wait_phase(real_cluster, ns, "tpl", "Succeeded")
    pods = real_cluster.assert_ran_on_real_nodes(ns, "trainop.io/job-name=tpl")
    assert len(pods) == 2
    lines = []
    for pod in pods:
        assert pod["metadata"]["labels"]["team"] == "vision"
        sidecar = pod["spec"]["initContainers"][-1]
        assert sidecar["securityContext"]["allowPrivilegeEscalation"] is False  # restricted's, added
        lines += [line for line in real_cluster.logs(ns, f"pod/{pod['metadata']['name']}", "-c", "worker").splitlines()
                  if line.startswith("rank ")]
    assert sorted(lines) == [
        f"rank {r}: EXPERIMENT=pod-template-e2e file=pod-template-e2e sidecar=hello" for r in (0, 1)]


# Issue 22, H3 and M6 on real pods: what job code and a pod template's sidecar can reach. The
# sidecar runs first and writes what it found; the training command checks its own view and the
# sidecar's, and fails the job if any token or GPU setting is there.
SPY = """\
set -eu
token=none; ls -R /var/run/secrets 2>/dev/null | grep -q token && token=found
echo "token=$token gpus=${NVIDIA_VISIBLE_DEVICES:-unset} azure=${AZURE_FEDERATED_TOKEN_FILE:-unset}" > /shared/spy
""" + IDLE
CHECK = """\
set -eu
i=0
until [ -s /shared/spy ]; do
  i=$((i + 1)); [ "$i" -le 600 ] || { echo "no report from the sidecar" >&2; exit 3; }
  sleep 0.1
done
mine=none; ls -R /var/run/secrets 2>/dev/null | grep -q token && mine=found
echo "training token=$mine; sidecar $(cat /shared/spy)"
test "$mine" = none
grep -qx 'token=none gpus=void azure=unset' /shared/spy
"""


def test_job_code_and_a_templates_sidecar_hold_no_token_and_see_no_gpu(real_cluster, real_namespace,
                                                                     real_operator, pod_azurite):
    """Worker 0 ships to Azurite, so its pod holds the shipper's projected API token: the training
    container and the template's native sidecar find none, and the sidecar (no GPU limit, in a
    CUDA-capable image on a GPU node) runs with NVIDIA_VISIBLE_DEVICES=void. The attacks that
    would hand them a token are refused before any pod exists."""
    ns = real_namespace
    template = {"worker": {"spec": {
        "volumes": [{"name": "shared", "emptyDir": {}}],
        "initContainers": [{
            "name": "spy", "image": "trainop/trainer-pytorch:0.1.0", "restartPolicy": "Always",
            "command": ["sh", "-c", SPY], "resources": {"requests": {"cpu": "10m", "memory": "16Mi"}},
            "volumeMounts": [{"name": "shared", "mountPath": "/shared"}]}],
        "containers": [{"name": "worker", "volumeMounts": [{"name": "shared", "mountPath": "/shared"}]}]}}}
    manifest = {"apiVersion": "trainop.io/v1alpha1", "kind": "DistributedTrainingJob", "metadata": {"name": "spy"},
                "spec": {"framework": "pytorch", "launcher": "torchrun", "workers": 1, "gpusPerWorker": 1,
                         "resources": {"requests": {"cpu": "50m", "memory": "128Mi"}},
                         "command": ["sh", "-c", CHECK], "runPolicy": {"backoffLimit": 0},
                         "podTemplate": template}}
    with_blob_output(manifest, real_cluster, ns, pod_azurite)
    real_cluster.apply(manifest, ns)
    wait_phase(real_cluster, ns, "spy", "Succeeded")
    (pod,) = real_cluster.assert_ran_on_real_nodes(ns, "trainop.io/job-name=spy")
    assert "trainop-api-token" in [v["name"] for v in pod["spec"]["volumes"]]  # the shipper's, there
    line = next(line for line in real_cluster.logs(ns, "pod/spy-worker-0", "-c", "worker").splitlines()
                if line.startswith("training token="))
    assert line == "training token=none; sidecar token=none gpus=void azure=unset"

    # The same job asking for a token (two ways) or every GPU of the node (two ways): refused,
    # nothing created on any node.
    attacks = {
        "mount": {"containers": [{"name": "worker", "volumeMounts": [
            {"name": "trainop-api-token", "mountPath": "/stolen"}]}]},
        "project": {"volumes": [{"name": "t", "projected": {"sources": [{"serviceAccountToken": {
            "path": "token", "audience": "api://AzureADTokenExchange"}}]}}]},
        "gpus": {"containers": [{"name": "worker", "env": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}]}]},
        "gpus-envfrom": {"containers": [{"name": "worker", "envFrom": [{"configMapRef": {"name": "gpus"}}]}]},
    }
    for name, spec in attacks.items():
        bad = {**manifest, "metadata": {"name": f"spy-{name}"},
               "spec": {**manifest["spec"], "podTemplate": {"worker": {"spec": spec}}}}
        real_cluster.apply(bad, ns)
    for name in attacks:
        status = wait_phase(real_cluster, ns, f"spy-{name}", "Failed", timeout=120)
        failed = next(c for c in status["conditions"] if c["type"] == "Failed")
        assert failed["reason"] == "InvalidSpec" and failed["message"].startswith("spec.podTemplate.worker.spec."), failed
        assert not real_cluster.get("pods", "-n", ns, "-l", f"trainop.io/job-name=spy-{name}")["items"]
