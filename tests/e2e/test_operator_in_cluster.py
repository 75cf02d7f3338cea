"""(e) The operator itself in the cluster: its image, installed by the Helm chart into a
`restricted` namespace, running under the chart's ServiceAccount on a real node (it reaches the
API server through the `kubernetes` Service, i.e. kube-proxy), drives a job on real pods; its
NetworkPolicy (issue 22 L8) admits only the scrapers' namespace to its metrics port, and its
kubelet probes (from the node) still pass."""

from __future__ import annotations

import copy
import json
import secrets
import subprocess

import pytest
import yaml

from bench.chaos import job_reconciles
from tests.e2e.test_network_policy import IDLE, can_connect, pod, start
from tests.e2e.test_real_pods import digests, reduced, wait_phase
from tests.fixtures.cluster import delete_namespaces
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
        delete_namespaces(real_cluster, system, jobs, scrapers)


UPGRADE_JOBS = 50


def _reconciles(cluster, namespace: str, pod: str) -> int:
    """DistributedTrainingJob reconciles the operator pod has done (its /metrics, read inside the
    pod: the chart's NetworkPolicy admits only scrapers to the port)."""
    out = cluster.kubectl("exec", "-n", namespace, pod, "--", "python", "-c",
                          "import urllib.request; print(urllib.request.urlopen("
                          "'http://127.0.0.1:9090/metrics', timeout=5).read().decode())", check=False).stdout
    return job_reconciles(out)


def test_helm_upgrade_with_jobs_running_makes_no_pod_anew(real_cluster, tmp_path):
    """`helm upgrade` with new configuration (other trainer images, launcher resources, timeouts:
    the Deployment rolls, its checksum/config annotation changed) while 50 jobs run on KWOK nodes
    of this cluster: the new operator pod adopts every job and makes, deletes or changes no pod,
    and no job restarts. (The same build, a new configuration: no second operator build is made
    here; bench/chaos.py --upgrade-from DIR starts from an older commit's operator.)"""
    suffix = secrets.token_hex(3)
    system, jobs = f"trainop-system-{suffix}", f"jobs-{suffix}"
    gpu_pool, cpu_pool = f"upggpu{suffix}", f"upgcpu{suffix}"
    made = [real_cluster.add_node(gpu_pool, i, gpus=8) for i in range((UPGRADE_JOBS + 7) // 8)]
    made += [real_cluster.add_node(cpu_pool, i, gpus=0) for i in range(2)]  # 24 CPUs each, 50 launchers of 0.5
    for ns in (system, jobs):
        real_cluster.kubectl("create", "namespace", ns)
    real_cluster.kubectl("label", "namespace", system, *(f"{k}={v}" for k, v in RESTRICTED.items()))
    pools = {"upgcpu": {"nodeSelector": {"kubernetes.azure.com/agentpool": cpu_pool}},
             "upggpu": {"nodeSelector": {"kubernetes.azure.com/agentpool": gpu_pool},
                        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]}}
    before_values = {"watchNamespaces": [jobs], "logFormat": "plain",
                     # the operator on the real system node (the KWOK nodes here run nothing)
                     "nodeSelector": {"kubernetes.azure.com/agentpool": "system"},
                     "config": {"nodePools": pools, "defaultNodePools": {"cpu": "upgcpu", "gpu": "upggpu"}}}
    after_values = copy.deepcopy(before_values)
    after_values["config"] |= {"images": {"pytorch": "trainop/trainer-pytorch:0.2.0"},
                               "launcherResources": {"requests": {"cpu": "750m", "memory": "768Mi"}},
                               "startTimeoutSeconds": 900}
    helm = [str(helm_binary()), "--kubeconfig", str(real_cluster.kubeconfig)]

    def helm_run(verb: str, values: dict) -> None:
        path = tmp_path / f"{verb}.yaml"
        path.write_text(yaml.safe_dump(values))
        out = subprocess.run([*helm, verb, "trainop", str(CHART), "-n", system, "-f", str(path),
                              "--wait", "--timeout", "300s"], capture_output=True, text=True)
        assert out.returncode == 0, out.stderr

    def operator_pods() -> list[dict]:
        return [p for p in real_cluster.get("pods", "-n", system, "-l", "app.kubernetes.io/name=trainop")["items"]
                if not p["metadata"].get("deletionTimestamp")]

    def job_pods() -> dict[str, tuple]:
        return {p["metadata"]["name"]: (p["metadata"]["uid"], tuple(c["image"] for c in p["spec"]["containers"]),
                                        json.dumps(p["spec"]["containers"][0].get("resources"), sort_keys=True))
                for p in real_cluster.get("pods", "-n", jobs)["items"]}

    def phases() -> dict[str, str]:
        return {j["metadata"]["name"]: (j.get("status") or {}).get("phase")
                for j in real_cluster.get("dtj", "-n", jobs)["items"]}

    try:
        helm_run("install", before_values)
        real_cluster.apply([{"apiVersion": "trainop.io/v1alpha1", "kind": "DistributedTrainingJob",
                             "metadata": {"name": f"j{i:02d}"}, "spec": {"workers": 1, "gpusPerWorker": 1}}
                            for i in range(UPGRADE_JOBS)], jobs)
        wait_until(lambda: list(phases().values()).count("Running") == UPGRADE_JOBS, timeout=300,
                   what=f"{UPGRADE_JOBS} jobs Running")
        # and every pod made and Running (the status says Running once the launcher's batch Job
        # exists; the Job controller makes its pod after)
        wait_until(lambda: [p["status"].get("phase") for p in real_cluster.get("pods", "-n", jobs)["items"]]
                   == ["Running"] * 2 * UPGRADE_JOBS, timeout=120, what="a worker and a launcher pod Running per job")
        before, (old,) = job_pods(), operator_pods()

        helm_run("upgrade", after_values)
        new = wait_until(lambda: (pods := operator_pods()) and len(pods) == 1
                         and pods[0]["metadata"]["uid"] != old["metadata"]["uid"] and pods[0], timeout=120,
                         what="the upgraded operator pod, alone")
        # it has judged every job (its first listing wakes each one) before the pods are compared
        wait_until(lambda: _reconciles(real_cluster, system, new["metadata"]["name"]) >= UPGRADE_JOBS,
                   timeout=120, what="every job reconciled by the new operator")
        after = job_pods()
        changed = {"gone": sorted(set(before) - set(after)), "new": sorted(set(after) - set(before)),
                   "changed": sorted(n for n in set(before) & set(after) if before[n] != after[n])}
        assert changed == {"gone": [], "new": [], "changed": []}, (  # no pod made, deleted or changed
            changed, real_cluster.kubectl("get", "events", "-n", jobs, "--sort-by=.lastTimestamp",
                                          check=False).stdout[-3000:])
        assert set(phases().values()) == {"Running"}
        restarts = [(j["metadata"]["name"], j["status"].get("restarts"), j["status"].get("attempt"))
                    for j in real_cluster.get("dtj", "-n", jobs)["items"]
                    if (j["status"].get("restarts") or {}).get("failures") or j["status"].get("attempt")]
        assert restarts == []
        log = real_cluster.logs(system, new["metadata"]["name"])
        assert "[ERROR" not in log and " ERROR " not in log, log[-3000:]
    finally:
        subprocess.run([*helm, "uninstall", "trainop", "-n", system, "--wait"], capture_output=True)
        delete_namespaces(real_cluster, system, jobs)
        for node in made:
            real_cluster.kubectl("delete", "node", node, "--wait=false", check=False)
