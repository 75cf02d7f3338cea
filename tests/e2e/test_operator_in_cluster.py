"""(e) The operator itself in the cluster: its image, installed by the Helm chart into a
`restricted` namespace, running under the chart's ServiceAccount on a real node (it reaches the
API server through the `kubernetes` Service, i.e. kube-proxy), drives a job on real pods; its
NetworkPolicy (issue 22 L8) admits only the scrapers' namespace to its metrics port, and its
kubelet probes (from the node) still pass."""

from __future__ import annotations

import secrets
import subprocess

import pytest
import yaml

from tests.e2e.test_network_policy import IDLE, can_connect, pod, start
from tests.e2e.test_real_pods import digests, reduced, wait_phase
from tests.fixtures.waiting import wait_until
from tests.helm.helm import CHART, helm_binary

pytestmark = [pytest.mark.real]

RESTRICTED = {f"pod-security.kubernetes.io/{mode}": "restricted" for mode in ("enforce", "warn")}


def test_chart_installed_operator_runs_a_job(real_cluster, tmp_path):
    suffix = secrets.token_hex(3)
    system, jobs, scrapers = f"trainop-system-{suffix}", f"jobs-{suffix}", f"monitoring-{suffix}"
    real_cluster.kubectl("create", "namespace", system)
    real_cluster.kubectl("label", "namespace", system, *(f"{k}={v}" for k, v in RESTRICTED.items()))
    real_cluster.kubectl("create", "namespace", jobs)
    real_cluster.kubectl("create", "namespace", scrapers)
    values = tmp_path / "values.yaml"
    values.write_text(yaml.safe_dump({"watchNamespaces": [jobs], "logFormat": "plain",
                                      "metrics": {"networkPolicy": {"scraperNamespaces": [scrapers]}}}))
    helm = [str(helm_binary()), "--kubeconfig", str(real_cluster.kubeconfig)]
    try:
        out = subprocess.run([*helm, "install", "trainop", str(CHART), "-n", system, "-f", str(values),
                              "--wait", "--timeout", "300s"], capture_output=True, text=True)
        assert out.returncode == 0, out.stderr + real_cluster.kubectl(
            "describe", "pods", "-n", system, check=False).stdout
        pods = real_cluster.assert_ran_on_real_nodes(system, "app.kubernetes.io/name=trainop")
        operator_pod = pods[0]
        assert operator_pod["spec"]["serviceAccountName"] == "trainop"
        assert operator_pod["spec"]["containers"][0]["image"].startswith("trainop/operator:")
        # L8: the metrics port from a scrapers' pod, and from a pod of the jobs' namespace
        ip = operator_pod["status"]["podIP"]
        start(real_cluster, scrapers, [pod("scraper", {"app": "scraper"}, "system", IDLE)])
        start(real_cluster, jobs, [pod("curious", {"app": "curious"}, "system", IDLE)])
        wait_until(lambda: can_connect(real_cluster, scrapers, "scraper", ip, 9090), timeout=60,
                   what="the scrapers' namespace reaching /metrics")
        wait_until(lambda: not can_connect(real_cluster, jobs, "curious", ip, 9090), timeout=60,
                   what="a job namespace's pod refused at /metrics")
        assert not can_connect(real_cluster, jobs, "curious", ip, 8080)  # /healthz
        real_cluster.kubectl("delete", "pod", "curious", "-n", jobs, "--wait=false")

        real_cluster.apply(reduced("pytorch-horovod-synthetic.yaml", "incluster"), jobs)
        wait_phase(real_cluster, jobs, "incluster", "Succeeded")
        ranks = digests(real_cluster.logs(jobs, "job/incluster-launcher", "-c", "launcher"))
        assert sorted(ranks) == [0, 1] and len(set(ranks.values())) == 1
        # The operator that acted is the pod: its own log (read through its kubelet) names the job.
        wait_until(lambda: "incluster" in real_cluster.logs(system, operator_pod["metadata"]["name"]),
                   timeout=30, what="the job in the operator pod's log")
    finally:
        subprocess.run([*helm, "uninstall", "trainop", "-n", system, "--wait"], capture_output=True)
        real_cluster.kubectl("delete", "namespace", system, jobs, scrapers, "--wait=false", check=False)
