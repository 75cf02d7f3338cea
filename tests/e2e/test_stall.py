"""Issue 24, a rank that hangs, on real pods: PyTorch + Horovod with Blob output (Azurite in the
pod network) and runPolicy.stallTimeoutSeconds. Once a checkpoint is reported, rank 1's trainer
is frozen (SIGSTOP, through `kubectl exec` as the pod's own user): rank 0 waits in its next
allreduce forever and the step stops moving in its reports. The operator sets Stalled and
restarts the gang as a Stall; the next attempt resumes from the checkpoint and succeeds; the
first attempt's shipped launcher log holds rank 0's Python stacks from its watchdog."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.e2e.test_real_pods import RUN_TIMEOUT, reduced, wait_phase, with_blob_output
from tests.fixtures.cluster import cli_config
from tests.fixtures.waiting import wait_until

pytestmark = [pytest.mark.real, pytest.mark.azurite]

# The rank's python process (the bracket keeps this shell's own command line from matching).
FREEZE = ("for d in /proc/[0-9]*; do [ \"${d#/proc/}\" = $$ ] && continue; "
          "grep -q 'trainop_traine[r]' \"$d/cmdline\" 2>/dev/null "
          "&& kill -STOP \"${d#/proc/}\" && echo frozen \"${d#/proc/}\"; done; true")


def test_a_hung_rank_stalls_the_gang_which_restarts_and_resumes(real_cluster, real_namespace, real_operator,
                                                               pod_azurite, tmp_path):
    ns, name = real_namespace, "stall"
    manifest = reduced("pytorch-horovod-synthetic.yaml", name, steps=80)
    manifest["spec"]["runPolicy"] = {"backoffLimit": 2, "stallTimeoutSeconds": 30}
    manifest["spec"]["checkpoint"] = {"everySteps": 5}
    with_blob_output(manifest, real_cluster, ns, pod_azurite)
    real_cluster.apply(manifest, ns)

    def status() -> dict:
        return real_cluster.get("dtj", name, "-n", ns).get("status") or {}

    wait_until(lambda: status().get("checkpoint") and (status().get("stall") or {}).get("since"),
               timeout=RUN_TIMEOUT, interval=1, what="a checkpoint reported and the step moving")
    frozen = real_cluster.kubectl("exec", "-n", ns, f"{name}-worker-1", "-c", "worker", "--",
                                  "sh", "-c", FREEZE).stdout
    assert "frozen" in frozen, frozen
    stalled = wait_until(lambda: next((c for c in status().get("conditions") or []
                                       if c["type"] == "Stalled" and c["status"] == "True"), None),
                         timeout=180, interval=1, what="the Stalled condition")
    assert "runPolicy.stallTimeoutSeconds=30" in stalled["message"], stalled
    done = wait_phase(real_cluster, ns, name, "Succeeded")
    assert done["attempt"] == 1 and done["lastFailure"]["cause"] == "Stall", done
    assert done["restarts"]["failures"] == 1
    # rank 0's stacks, from its watchdog, in the first attempt's shipped launcher log
    shown = subprocess.run([sys.executable, "-m", "trainop", "logs", name, "-n", ns, "--attempt", "0",
                            "--kubeconfig", str(real_cluster.kubeconfig),
                            "--config", str(cli_config(tmp_path / "cli-config.yaml"))],
                           capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0, shown.stderr
    assert "Timeout (0:00:15)!" in shown.stdout and "most recent call first" in shown.stdout, shown.stdout[-3000:]
