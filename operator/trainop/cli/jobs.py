"""`trainop submit | get | describe | delete`: DistributedTrainingJobs on a cluster, with
kubectl's connection flags (--kubeconfig, --context, -n/--namespace).

`get` shows progress (percent of steps done) and the time left until the ETA from
`status.progress`; `get -w` then follows the jobs through a watch (a row per change, as
`kubectl get -w`). `describe` adds a chart of images/sec over the last reports, from the job's
progress ConfigMap (`<job>-progress`, key `history`, written by the log shipper).

`submit` checks the file against the CRDs' own schemas first, then asks the API server to
validate every document (a server-side dry run, so CEL rules count too) before it creates any:
a file is either created whole or not at all.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
import time

import yaml

from trainop import API_VERSION, jobsync, kube, manifests, progress
from trainop.render import common
from trainop.render import logship as render_logship

KIND = "DistributedTrainingJob"
RESOURCE = "distributedtrainingjob.trainop.io"
SUBMITTABLE = (KIND, "DataStage")  # a job and the DataStage it reads can share a file
DELETE_POLL_SECONDS = 0.5


class JobsError(RuntimeError):
    """One line for the user; no secret."""


def _connection_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--kubeconfig", help="kubeconfig file (default: $KUBECONFIG, else ~/.kube/config)")
    p.add_argument("--context", help="kubeconfig context (default: its current context)")
    p.add_argument("-n", "--namespace", help="namespace (default: the context's, else default)")


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "submit", help="create the jobs (and DataStages) of a manifest file on the cluster",
        description="Create the DistributedTrainingJobs and DataStages of a YAML file on the cluster. "
                    "The file is checked against the CRDs' own schemas first, then the API server "
                    "validates every document (a server-side dry run, so CEL rules count too) before "
                    "any is created: a file is created whole or not at all.")
    p.add_argument("manifest", metavar="FILE", help="YAML with DistributedTrainingJob / DataStage documents")
    _connection_flags(p)
    p.set_defaults(func=submit)

    p = subparsers.add_parser(
        "get", help="list training jobs, or show one",
        description="List training jobs (every job of the namespace, or the named ones): phase, ready "
                    "workers, GPUs, restarts (counted, and +Nd disruptions not counted), images/sec, "
                    "progress (percent of steps done) and the time left until the ETA, from "
                    "status.progress. -w then prints a row whenever a job changes (a watch, as "
                    "`kubectl get -w`).")
    p.add_argument("names", nargs="*", metavar="NAME", help="jobs to show (default: every job)")
    p.add_argument("-A", "--all-namespaces", action="store_true", help="jobs of every namespace")
    p.add_argument("-o", "--output", choices=("table", "wide", "yaml", "json"), default="table",
                   help="wide adds framework, launcher, node pool and the last failure; yaml and json "
                        "print the objects")
    p.add_argument("-w", "--watch", action="store_true",
                   help="after the table, print a row whenever a job changes (a watch; Ctrl-C stops)")
    _connection_flags(p)
    p.set_defaults(func=get)

    p = subparsers.add_parser(
        "describe", help="a job's spec, status, conditions, pods and events",
        description="Show one training job: a summary of its spec, its status, the attempt and restart "
                    "history, progress and ETA, a chart of images/sec over the last reports (from the "
                    "job's progress ConfigMap <job>-progress, key history, written by the log "
                    "shipper), its conditions, its pods and their nodes, and its events.")
    p.add_argument("name", metavar="NAME", help="the job")
    _connection_flags(p)
    p.set_defaults(func=describe)

    p = subparsers.add_parser(
        "delete", help="delete training jobs (their pods and other children go with them)",
        description="Delete training jobs in the foreground (their pods and other children are deleted "
                    "first) and wait until they are gone.")
    p.add_argument("names", nargs="+", metavar="NAME", help="jobs to delete")
    p.add_argument("--no-wait", dest="wait", action="store_false", help="return without waiting until they are gone")
    p.add_argument("--timeout", type=float, default=120, metavar="SECONDS", help="how long to wait (default 120)")
    p.add_argument("--ignore-not-found", action="store_true", help="a missing job is not an error")
    _connection_flags(p)
    p.set_defaults(func=delete)


# ---- connection and errors --------------------------------------------------------------------
def connect(args: argparse.Namespace) -> str:
    """Point kube at the cluster the flags name; returns the namespace to use."""
    from kubernetes import config

    try:
        api, context_namespace = kube.connect(args.kubeconfig, args.context)
    except (config.ConfigException, OSError) as exc:
        raise JobsError(f"no usable kubeconfig ({exc}); pass --kubeconfig or set KUBECONFIG "
                        f"(`trainop devcluster up` prints one)") from None
    kube.configure(api)
    return args.namespace or context_namespace or "default"


def _api_message(exc) -> str:
    try:
        return json.loads(exc.body)["message"]
    except (TypeError, ValueError, KeyError):
        return f"{exc.status} {exc.reason}"


def _handled(verb: str, action) -> int:
    from kubernetes.client.exceptions import ApiException
    from urllib3.exceptions import HTTPError

    try:
        return action()
    except (JobsError, manifests.ManifestError) as exc:
        message = str(exc)
    except ApiException as exc:
        message = f"the API server refused: {_api_message(exc)}"
    except HTTPError as exc:
        message = f"cannot reach the API server ({type(exc).__name__}); is the cluster up?"
    print(f"trainop {verb}: {message}", file=sys.stderr)
    return 1


def _job(name: str, namespace: str) -> dict:
    job = kube.get(API_VERSION, KIND, name, namespace)
    if job is None:
        raise JobsError(f"{RESOURCE} {name!r} not found in namespace {namespace}")
    return job


# ---- submit -----------------------------------------------------------------------------------
def submit(args: argparse.Namespace) -> int:
    from kubernetes.client.exceptions import ApiException

    def action() -> int:
        docs = manifests.load(args.manifest, kinds=SUBMITTABLE)
        namespace = connect(args)
        for doc in docs:
            doc["metadata"]["namespace"] = args.namespace or doc["metadata"].get("namespace") or namespace
        for doc in docs:  # every document validated by the server before any is created
            ref = f"{doc['kind'].lower()}.trainop.io/{doc['metadata']['name']}"
            try:
                kube.request("POST", kube.path(API_VERSION, doc["kind"], doc["metadata"]["namespace"]),
                             body=doc, query=[("dryRun", "All")])
            except ApiException as exc:
                if exc.status == 409:
                    raise JobsError(f"{ref} already exists in namespace {doc['metadata']['namespace']}; "
                                    f"delete it first (trainop delete) or rename it") from None
                raise JobsError(f"{ref}: the API server refused it: {_api_message(exc)}") from None
        for doc in docs:
            kube.create(doc)
            print(f"{doc['kind'].lower()}.trainop.io/{doc['metadata']['name']} created")
        jobs = [d for d in docs if d["kind"] == KIND]
        if jobs:
            name, ns = jobs[0]["metadata"]["name"], jobs[0]["metadata"]["namespace"]
            print(f"\nfollow it: trainop get {name} -n {ns}  |  trainop describe {name} -n {ns}  |  "
                  f"trainop logs {name} -n {ns} -f")
        return 0
    return _handled("submit", action)


# ---- get --------------------------------------------------------------------------------------
def age(timestamp: str | None, now: dt.datetime | None = None) -> str:
    """kubectl-style age: 45s, 12m, 3h, 5d."""
    if not timestamp:
        return "<unknown>"
    then = dt.datetime.fromisoformat(timestamp.replace("Z", "+00:00"))
    seconds = int(((now or dt.datetime.now(dt.timezone.utc)) - then).total_seconds())
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= 2 * size:
            return f"{seconds // size}{unit}"
    return f"{max(seconds, 0)}s"


def _rate(value) -> str:
    """imagesPerSec as shown: a number to one decimal; "NaN"/"Infinity" (non-finite reports) as
    they are; "-" when unreported."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return f"{value:.1f}"
    return str(value) if value is not None else "-"


HEADER = ["NAME", "PHASE", "WORKERS", "GPUS", "RESTARTS", "IMAGES/SEC", "PROGRESS", "ETA", "AGE"]
WIDE_HEADER = ["FRAMEWORK", "LAUNCHER", "POOL", "LAST FAILURE"]


def _restarts(status: dict) -> str:
    """RESTARTS: counted failures, and the disruptions beside them when there were any."""
    counts = jobsync.restart_counts(status)
    return str(counts["failures"]) + (f"+{counts['disruptions']}d" if counts["disruptions"] else "")


def _restarts_long(status: dict, limit: int) -> str:
    counts = jobsync.restart_counts(status)
    return (f"{counts['failures']} failures (backoffLimit {limit}), {counts['disruptions']} "
            f"disruptions (not counted; {counts['spotEvictions']} spot evictions); "
            f"attempt {jobsync.attempt(status)}")


def row(job: dict, wide: bool, with_namespace: bool, now: dt.datetime | None = None) -> list[str]:
    status, spec = job.get("status") or {}, job.get("spec") or {}
    metrics = status.get("metrics") or {}
    now = now or dt.datetime.now(dt.timezone.utc)
    workers = (status.get("workers") or {}).get("summary") or f"0/{spec.get('workers', 1)}"
    out = [job["metadata"]["namespace"]] if with_namespace else []
    out += [job["metadata"]["name"], status.get("phase") or "Pending", workers,
            str(status.get("gpus", spec.get("workers", 1) * spec.get("gpusPerWorker", 0))),
            _restarts(status),
            _rate(metrics.get("imagesPerSec")),
            progress.percent_text(status.get("progress")),
            progress.eta_text(status.get("progress"), now),
            age(job["metadata"].get("creationTimestamp"), now)]
    if wide:
        out += [spec.get("framework", "pytorch"), spec.get("launcher", "mpi"),
                (spec.get("nodePool") or {}).get("name") or "default",
                (status.get("lastFailure") or {}).get("message", "")]
    return out


def table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    return "\n".join("   ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in [header, *rows])


def get(args: argparse.Namespace) -> int:
    def action() -> int:
        namespace = connect(args)
        if args.watch and args.output in ("yaml", "json"):
            raise JobsError("--watch prints table rows; use -o table or -o wide with it")
        # the list's resourceVersion is where a watch starts
        listed = kube.request("GET", kube.path(API_VERSION, KIND, None if args.all_namespaces else namespace)) \
            if args.watch or not args.names else {}
        if args.names:
            jobs = [_job(n, namespace) for n in args.names]
        else:
            jobs = listed.get("items") or []
            for item in jobs:  # a list's items leave these out
                item.setdefault("apiVersion", API_VERSION)
                item.setdefault("kind", KIND)
            jobs.sort(key=lambda j: (j["metadata"]["namespace"], j["metadata"]["name"]))
        if args.output in ("yaml", "json"):
            data = jobs[0] if len(args.names) == 1 else {"apiVersion": "v1", "kind": "List", "items": jobs}
            print(yaml.safe_dump(data, sort_keys=False) if args.output == "yaml" else json.dumps(data, indent=2))
            return 0
        wide, with_ns = args.output == "wide", args.all_namespaces
        header = (["NAMESPACE"] if with_ns else []) + HEADER + (WIDE_HEADER if wide else [])
        rows = [row(j, wide, with_ns) for j in jobs]
        if not jobs:
            where = "any namespace" if args.all_namespaces else f"namespace {namespace}"
            print(f"No training jobs in {where}.", file=sys.stderr)
            if not args.watch:
                return 0
        print(table(header, rows), flush=True)
        if args.watch:
            watch_rows(namespace, args, listed["metadata"]["resourceVersion"], header, rows, jobs)
        return 0
    return _handled("get", action)


def watch_rows(namespace: str, args: argparse.Namespace, resource_version: str, header: list[str],
               rows: list[list[str]], jobs: list[dict]) -> None:
    """`get -w`: a row each time a listed job (or any job, without names) changes, from a watch
    that starts at the list's resourceVersion (nothing missed, nothing polled). A row equal to
    the last one printed for its job, but for AGE and ETA (which move with the clock), is not
    printed again. Columns keep the table's widths (wider values push the row out)."""
    from kubernetes import client, watch
    from kubernetes.client.exceptions import ApiException

    group, version = API_VERSION.split("/")
    api = client.CustomObjectsApi(kube.configure())
    plural = kube.plural(KIND)
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    moving = {header.index("AGE"), header.index("ETA")}
    last = {(j["metadata"]["namespace"], j["metadata"]["name"]): r for j, r in zip(jobs, rows)}
    wide, with_ns = args.output == "wide", args.all_namespaces
    while True:
        if args.all_namespaces:
            fn, fn_args = api.list_cluster_custom_object, (group, version, plural)
        else:
            fn, fn_args = api.list_namespaced_custom_object, (group, version, namespace, plural)
        try:
            for event in watch.Watch().stream(fn, *fn_args, resource_version=resource_version,
                                              allow_watch_bookmarks=True):
                job = event["raw_object"]
                resource_version = job["metadata"]["resourceVersion"]
                if event["type"] == "BOOKMARK" or (args.names and job["metadata"]["name"] not in args.names):
                    continue
                key = (job["metadata"]["namespace"], job["metadata"]["name"])
                new = row(job, wide, with_ns)
                if event["type"] == "DELETED":
                    new[header.index("PHASE")] = "Deleted"
                before = last.get(key)
                if before and all(a == b for i, (a, b) in enumerate(zip(before, new)) if i not in moving):
                    continue
                last[key] = new
                print("   ".join(c.ljust(w) for c, w in zip(new, widths)).rstrip(), flush=True)
        except ApiException as exc:
            if exc.status != 410:
                raise
            # The resourceVersion expired: list again and watch on from there.
            listed = kube.request("GET", kube.path(API_VERSION, KIND, None if args.all_namespaces else namespace))
            resource_version = listed["metadata"]["resourceVersion"]


# ---- describe ---------------------------------------------------------------------------------
def _data(spec: dict) -> str:
    data = spec.get("data") or {"synthetic": True}
    if "dataStageRef" in data:
        return f"DataStage {data['dataStageRef']['name']}, mounted read-only at {data.get('mountPath', '/data')}"
    return "synthetic"


def _output(spec: dict) -> str:
    out = spec.get("output") or {}
    if "blob" in out:
        b = out["blob"]
        return f"Blob {b['accountURL'].rstrip('/')}/{b['container']}/{b.get('prefix', '')}"
    if "pvc" in out:
        return f"PersistentVolumeClaim {out['pvc']['claimName']}"
    return "none (results stay in the pods)"


def _progress_line(shown: dict, now: dt.datetime) -> str:
    parts = []
    if "percent" in shown:
        # the API server hands 50.0 back as 50: numbers are formatted, not printed as they come
        parts.append(f"{shown['percent']:.1f}% (step {shown.get('step')} of {shown.get('totalSteps')})")
    if "imagesPerSec" in shown:
        parts.append(f"{shown['imagesPerSec']:.1f} images/sec")
    if "secondsPerStep" in shown:
        parts.append(f"{shown['secondsPerStep']:g} s/step")
    if "eta" in shown:
        parts.append(f"ETA {shown['eta']} (in {progress.eta_text(shown, now)})")
    if "reportTime" in shown:
        parts.append(f"reported {shown['reportTime']}")
    return ", ".join(parts)


def describe_text(job: dict, pods: list[dict], events: list[dict], history: list[list[float]] | None = None,
                  now: dt.datetime | None = None) -> str:
    """`trainop describe`'s text for a job, its pods, its events and its throughput history
    (`[time, step, imagesPerSec]` samples from the progress ConfigMap) (pure)."""
    meta, spec, status = job["metadata"], job.get("spec") or {}, job.get("status") or {}
    workers = spec.get("workers", 1)
    gpus = spec.get("gpusPerWorker", 0)
    pool = spec.get("nodePool") or {}
    lines = [
        ("Name", meta["name"]), ("Namespace", meta["namespace"]),
        ("Created", f"{meta.get('creationTimestamp')} ({age(meta.get('creationTimestamp'))} ago)"),
        ("Phase", status.get("phase") or "Pending"),
        ("Framework", f"{spec.get('framework', 'pytorch')}, launcher {spec.get('launcher', 'mpi')}"
                      + (f" ({spec.get('mpiImplementation', 'OpenMPI')})" if spec.get("launcher", "mpi") == "mpi" else "")),
        ("Image", spec.get("image") or "the operator's default for the framework"),
        ("Workers", f"{(status.get('workers') or {}).get('summary') or f'0/{workers}'} ready, "
                    f"{gpus} GPUs each ({workers * gpus} in all)"),
        ("Node pool", (pool.get("name") or (f"nodeSelector {pool['nodeSelector']}" if "nodeSelector" in pool
                                            else "the operator's default"))
                      + (", InfiniBand" if spec.get("infiniband") else "")
                      + (f"; this attempt on {status['nodePool']}" if status.get("nodePool")
                         and status["nodePool"] != pool.get("name") else "")),
        ("Data", _data(spec)), ("Output", _output(spec)),
        ("Restarts", _restarts_long(status, (spec.get('runPolicy') or {}).get('backoffLimit', 3))),
    ]
    for entry in jobsync.restart_counts(status)["history"]:
        lines.append((f"  attempt {entry.get('attempt')}",
                     f"{entry.get('time', '')} {entry.get('cause', '')}"
                     f"{'' if entry.get('counted') else ' (not counted)'}: {entry.get('message', '')}"))
    for key, label in (("startTime", "Started"), ("completionTime", "Completed"),
                       ("outputURL", "Output URL"), ("logsURL", "Logs URL")):
        if status.get(key):
            lines.append((label, status[key]))
    metrics = status.get("metrics") or {}
    if metrics:
        lines.append(("Metrics", ", ".join(f"{k} {v}" for k, v in metrics.items())))
    shown = status.get("progress") or {}
    if shown:
        lines.append(("Progress", _progress_line(shown, now or dt.datetime.now(dt.timezone.utc))))
    failure = status.get("lastFailure") or {}
    if failure:
        lines.append(("Last failure", failure.get("message") or json.dumps(failure)))
    width = max(len(k) for k, _ in lines) + 1
    out = [f"{k + ':':<{width}} {v}" for k, v in lines]
    conditions = status.get("conditions") or []
    out += ["", "Conditions:"]
    out += ["  " + line for line in table(
        ["TYPE", "STATUS", "REASON", "AGE", "MESSAGE"],
        [[c["type"], c["status"], c.get("reason", ""), age(c.get("lastTransitionTime")), c.get("message", "")]
         for c in conditions]).splitlines()] if conditions else ["  <none>"]
    if history:
        out += ["", "Throughput:"] + ["  " + line for line in progress.chart(history)]
    out += ["", "Pods:"]
    out += ["  " + line for line in table(
        ["NAME", "ROLE", "PHASE", "NODE", "AGE"],
        [[p["metadata"]["name"], p["metadata"].get("labels", {}).get(common.LABEL_ROLE, ""),
          (p.get("status") or {}).get("phase", ""), p["spec"].get("nodeName") or "<unscheduled>",
          age(p["metadata"].get("creationTimestamp"))] for p in pods]).splitlines()] if pods else ["  <none>"]
    out += ["", "Events:"]
    out += ["  " + line for line in table(
        ["AGE", "TYPE", "REASON", "MESSAGE"],
        [[age(e.get("lastTimestamp") or e.get("eventTime") or e["metadata"].get("creationTimestamp")),
          e.get("type", ""), e.get("reason", ""), e.get("message", "")] for e in events]).splitlines()] \
        if events else ["  <none>"]
    return "\n".join(out)


def _history(name: str, namespace: str) -> list[list[float]]:
    """The throughput samples the log shipper keeps in `<job>-progress`, checked like any report
    from a pod (render/logship.progress_history); none when the caller may not read ConfigMaps."""
    from kubernetes.client.exceptions import ApiException

    try:
        shipped = kube.get("v1", "ConfigMap", f"{name}-progress", namespace)
    except ApiException as exc:
        if exc.status == 403:
            return []
        raise
    return render_logship.progress_history(shipped)


def describe(args: argparse.Namespace) -> int:
    def action() -> int:
        namespace = connect(args)
        job = _job(args.name, namespace)
        pods = kube.list_objects("v1", "Pod", namespace, common.labels(args.name))
        pods.sort(key=lambda p: p["metadata"]["name"])
        selector = f"involvedObject.name={args.name},involvedObject.kind={KIND}"
        events = kube.request("GET", kube.path("v1", "Event", namespace),
                              query=[("fieldSelector", selector)]).get("items") or []
        events.sort(key=lambda e: e.get("lastTimestamp") or e.get("eventTime") or "")
        print(describe_text(job, pods, events, _history(args.name, namespace)))
        return 0
    return _handled("describe", action)


# ---- delete -----------------------------------------------------------------------------------
def delete(args: argparse.Namespace) -> int:
    def action() -> int:
        namespace = connect(args)
        missing = [n for n in args.names if kube.get(API_VERSION, KIND, n, namespace) is None]
        if missing and not args.ignore_not_found:
            raise JobsError(f"{RESOURCE} {', '.join(missing)} not found in namespace {namespace}")
        names = [n for n in args.names if n not in missing]
        for name in names:
            kube.delete(API_VERSION, KIND, name, namespace, propagation="Foreground")
        if args.wait:
            deadline = time.monotonic() + args.timeout
            for name in names:
                while kube.get(API_VERSION, KIND, name, namespace) is not None:
                    if time.monotonic() > deadline:
                        raise JobsError(f"{RESOURCE}/{name} still exists after {args.timeout:.0f}s "
                                        f"(its children are being removed); check `trainop describe {name}`")
                    time.sleep(DELETE_POLL_SECONDS)
        for name in names:
            print(f"{RESOURCE}/{name} deleted")
        return 0
    return _handled("delete", action)
