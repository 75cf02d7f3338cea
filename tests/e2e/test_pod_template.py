"""spec.podTemplate on real pods, in a namespace that enforces Pod Security `restricted`: an extra
ConfigMap volume, envFrom that ConfigMap, env from a Secret and a native sidecar really reach
the training container: the training command (under torchrun) reads the env and the files and
waits for what the sidecar wrote, else it fails the job."""

from __future__ import annotations

import pytest

from tests.e2e.test_real_pods import wait_phase

pytestmark = pytest.mark.real

# Each rank checks what the pod template gave it; a missing piece exits non-zero, which fails
# the job (backoffLimit 0). The sidecar starts before the training container but may not have
# written its file yet: a bounded wait on that condition.
SCRIPT = """\
set -eu
test "$EXPERIMENT" = pod-template-e2e
test "$(cat /etc/train-settings/EXPERIMENT)" = pod-template-e2e
test "$API_TOKEN" = s3cret
i=0
until [ -s /shared/from-sidecar ]; do
  i=$((i + 1)); [ "$i" -le 600 ] || { echo "no file from the sidecar" >&2; exit 3; }
  sleep 0.1
done
echo "rank $RANK: EXPERIMENT=$EXPERIMENT file=$(cat /etc/train-settings/EXPERIMENT) sidecar=$(cat /shared/from-sidecar)"
"""


def test_volume_envfrom_and_sidecar_reach_the_training_container(real_cluster, restricted_namespace,
                                                               restricted_operator):
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
                        "command": ["sh", "-c", "echo hello > /shared/from-sidecar; exec sleep infinity"],
                        "resources": {"requests": {"cpu": "10m", "memory": "16Mi"}},
                        "volumeMounts": [{"name": "shared", "mountPath": "/shared"}]}],
                    "containers": [{
                        "name": "worker",
                        "envFrom": [{"configMapRef": {"name": "train-settings"}}],
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
