"""`trainop quota [-n NS | -A]`: per namespace, the GPU quota, the GPUs in use, and the jobs
admitted and waiting (with the GPUs the waiting ones ask for).

QUOTA is the ResourceQuota that limits GPUs with the least room (`-` when none does; then
GPU-USED counts the namespace's running pods, as the operator's limits.namespaceGpus does).
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from decimal import Decimal

from trainop import API_VERSION, admission, conditions, kube, phases
from trainop.cli.logs import connect
from trainop.config import DEFAULTS

KIND = "DistributedTrainingJob"
GPU = f"requests.{DEFAULTS['gpuResource']}"
HEADER = ("NAMESPACE", "QUOTA", "GPU-HARD", "GPU-USED", "ADMITTED", "QUEUED", "QUEUED-GPUS")


def register(subparsers) -> None:
    p = subparsers.add_parser("quota", help="GPU quota, use and queued demand per namespace",
                              description=__doc__)
    scope = p.add_mutually_exclusive_group()
    scope.add_argument("-n", "--namespace", help="default: the kubeconfig context's namespace")
    scope.add_argument("-A", "--all-namespaces", action="store_true",
                       help="every namespace with a GPU quota or a job")
    p.add_argument("--kubeconfig", help="default: $KUBECONFIG or ~/.kube/config")
    p.set_defaults(func=run)


def row(namespace: str, quotas: list[dict], pods: list[dict], jobs: list[dict]) -> tuple:
    """One line of the table from the namespace's live objects (pure)."""
    limiting = [q for q in quotas if GPU in ((q.get("spec") or {}).get("hard") or {})]
    if limiting:
        def room(q):
            hard, used = q["spec"]["hard"][GPU], ((q.get("status") or {}).get("used") or {})
            return admission.quantity(hard) - admission.quantity(used.get(GPU, "0"))
        q = min(limiting, key=room)
        name, hard = q["metadata"]["name"], admission.quantity(q["spec"]["hard"][GPU])
        used = admission.quantity(((q.get("status") or {}).get("used") or {}).get(GPU, "0"))
    else:
        name, hard = "-", None
        used = sum((admission.pod_usage(p).get(GPU, Decimal(0)) for p in pods
                    if admission.counts_in_quota(p)), Decimal(0))
    admitted = queued = queued_gpus = 0
    for job in jobs:
        status = job.get("status") or {}
        if phases.finished(job):
            continue
        if status.get("phase") == "Queued":
            queued += 1
            spec = job.get("spec") or {}
            queued_gpus += int(status.get("gpus") or
                               spec.get("workers", 1) * spec.get("gpusPerWorker", 0))
        elif conditions.is_true(status.get("conditions"), "Admitted"):
            admitted += 1
    return (namespace, name, "-" if hard is None else admission.show(hard), admission.show(used),
            admitted, queued, queued_gpus)


def run(args: argparse.Namespace) -> int:
    namespace = connect(args.kubeconfig, args.namespace)
    if args.all_namespaces:
        namespace = None
    quotas, pods, jobs = (defaultdict(list) for _ in range(3))
    for kind, api, into in (("ResourceQuota", "v1", quotas), ("Pod", "v1", pods),
                            (KIND, API_VERSION, jobs)):
        for obj in kube.list_objects(api, kind, namespace):
            into[obj["metadata"]["namespace"]].append(obj)
    names = [namespace] if namespace else sorted(
        ns for ns in set(quotas) | set(jobs)
        if jobs.get(ns) or any(GPU in (q.get("spec") or {}).get("hard", {}) for q in quotas[ns]))
    table = [HEADER] + [row(ns, quotas[ns], pods[ns], jobs[ns]) for ns in names]
    widths = [max(len(str(r[i])) for r in table) for i in range(len(HEADER))]
    for r in table:
        print("   ".join(str(v).ljust(w) for v, w in zip(r, widths)).rstrip(), file=sys.stdout)
    return 0
