"""`trainop logs JOB [-f] [--pod launcher|worker-N] [--attempt N]`: a job's training log, from the
live pod while it exists, from Blob Storage (where the log sidecar archived it) once it is gone.

The bytes are the same either way: the training container tees its stdout+stderr, unchanged,
both to its own stream (what the API serves) and to the file the sidecar appends to the blob.
A job whose output is a claim (spec.output.pvc) has its logs on the claim, under
logs/<job>/<attempt>/: mount it to read them once the pod is gone.
"""

from __future__ import annotations

import argparse
import base64
import re
import sys
import time
from typing import BinaryIO

from trainop import API_VERSION, blob, config, jobsync, kube, phases
from trainop.render import common, logship

KIND = "DistributedTrainingJob"
POLL_SECONDS = 2.0  # -f on an archived log: how often the blob's length is checked
STREAM_CHUNK = 64 * 1024


class LogsError(RuntimeError):
    """Why no log can be shown; one line, no secret."""


def register(subparsers) -> None:
    p = subparsers.add_parser("logs", help="print a training job's log (live or archived)", description=__doc__)
    p.add_argument("job", help="DistributedTrainingJob name")
    p.add_argument("-n", "--namespace", help="default: the kubeconfig context's namespace")
    p.add_argument("-f", "--follow", action="store_true", help="keep printing as the log grows")
    p.add_argument("--pod", help="launcher or worker-N (default: launcher for MPI jobs, worker-0 for torchrun)")
    p.add_argument("--attempt", type=int, help="gang attempt (default: the current one, status.attempt)")
    p.add_argument("--kubeconfig", help="default: $KUBECONFIG or ~/.kube/config")
    add_config_flag(p)
    p.set_defaults(func=run)


def add_config_flag(p) -> None:
    p.add_argument("--config", metavar="FILE",
                   help="the operator's configuration: its blob.allowedAccountURLs (besides Azure "
                        "Storage's own endpoints) are where the archive may be read with your "
                        "credential (default: $TRAINOP_CONFIG, else Azure Storage only)")


def run(args: argparse.Namespace) -> int:
    try:
        namespace = connect(args.kubeconfig, args.namespace)
        job = kube.get(API_VERSION, KIND, args.job, namespace)
        if job is None:
            raise LogsError(f"{KIND} {namespace}/{args.job} not found")
        allowed = allowed_endpoints(args.config)
        out = sys.stdout.buffer
        show(job, args.pod, args.attempt, args.follow, Sanitized(out) if sys.stdout.isatty() else out, allowed)
        return 0
    except LogsError as exc:
        print(f"trainop logs: {exc}", file=sys.stderr)
        return 1


def allowed_endpoints(path: str | None) -> tuple[str, ...]:
    """blob.allowedAccountURLs of the operator configuration at `path` (or $TRAINOP_CONFIG)."""
    try:
        return config.load(path).allowed_account_urls
    except config.ConfigError as exc:
        raise LogsError(f"--config: {exc}") from None


def connect(kubeconfig: str | None, namespace: str | None) -> str:
    """Point kube at the cluster (kube.connect); returns the namespace to use."""
    api, context_namespace = kube.connect(kubeconfig)
    kube.configure(api)
    return namespace or context_namespace or "default"


def parse_pod(job: dict, pod: str | None) -> tuple[str, int | None]:
    """--pod as (role, index)."""
    if pod is None:
        return ("launcher", None) if job["spec"].get("launcher", "mpi") == "mpi" else ("worker", 0)
    if pod == "launcher":
        return "launcher", None
    m = re.fullmatch(r"worker-(\d+)", pod)
    if not m:
        raise LogsError(f"--pod {pod!r}: expected launcher or worker-N (e.g. worker-0)")
    return "worker", int(m.group(1))


def show(job: dict, pod: str | None, attempt: int | None, follow: bool, out: BinaryIO,
         allowed: tuple[str, ...] = ()) -> None:
    name, namespace = job["metadata"]["name"], job["metadata"]["namespace"]
    role, index = parse_pod(job, pod)
    if attempt is None:
        attempt = jobsync.attempt(job.get("status"))
    archived = bool((job["spec"].get("output") or {}).get("blob"))
    live = _live_pod(name, namespace, role, index, attempt)
    if live is not None:
        try:
            _stream_pod(live, follow, out)
            return
        except LogsError as exc:
            if not archived:
                raise
            # The pod object outlived its node (kubelet unreachable, node lost): the archive has it.
            print(f"trainop logs: {exc}; showing the archived log", file=sys.stderr)
    if not archived:
        what = f"{name}-{role}" + ("" if index is None else f"-{index}")
        claim = ((job["spec"].get("output") or {}).get("pvc") or {}).get("claimName")
        if claim:
            raise LogsError(f"no live pod {what} (attempt {attempt}); its log is on PVC {claim} under "
                            f"logs/{name}/{attempt}/ (mount the claim to read it)")
        raise LogsError(f"no live pod {what} (attempt {attempt}) and the job has no spec.output to "
                        "archive logs in")
    _stream_blob(job, role, index, attempt, follow, out, allowed)


def _live_pod(name: str, namespace: str, role: str, index: int | None, attempt: int) -> dict | None:
    """The attempt's pod for role/index whose training container has started."""
    labels = common.labels(name, role, index) | {common.LABEL_ATTEMPT: str(attempt)}
    pods = [p for p in kube.list_objects("v1", "Pod", namespace, labels) if _started(p)]
    pods.sort(key=lambda p: p["metadata"].get("creationTimestamp") or "")
    return pods[-1] if pods else None


def _started(pod: dict) -> bool:
    main = pod["spec"]["containers"][0]["name"]
    for status in (pod.get("status") or {}).get("containerStatuses") or []:
        if status.get("name") == main:
            state = status.get("state") or {}
            return "running" in state or "terminated" in state
    return False


def _stream_pod(pod: dict, follow: bool, out: BinaryIO) -> None:
    from kubernetes.client import CoreV1Api
    from kubernetes.client.exceptions import ApiException

    meta = pod["metadata"]
    try:
        resp = CoreV1Api(kube.configure()).read_namespaced_pod_log(
            meta["name"], meta["namespace"], container=pod["spec"]["containers"][0]["name"],
            follow=follow, _preload_content=False)
    except ApiException as exc:
        raise LogsError(f"pod {meta['name']}: the API refused its log ({exc.status} {exc.reason})") from None
    for chunk in resp.stream(STREAM_CHUNK):
        out.write(chunk)
        out.flush()


def archive_client(job: dict, allowed: tuple[str, ...] = ()):
    """A ContainerClient for the job's output, authenticated as the job's own auth block says:
    the Secret it names (read through the API, so RBAC decides who may), or for workload identity
    the caller's own Azure login (DefaultAzureCredential: az login, environment, ...).

    Whoever may edit the job chooses its accountURL, and the credential sent there is the
    reader's (their token, or a Secret they can read): the URL must pass the operator's own
    check (blob.check_endpoint_allowed: Azure Storage, or `allowed`, the admin's
    blob.allowedAccountURLs) before any Secret is read or any request made."""
    spec = job["spec"]["output"]["blob"]
    field = "spec.output.blob.accountURL"
    try:
        url = blob.check_endpoint_allowed(spec.get("accountURL"), field, allowed)
    except blob.BlobConfigError as exc:
        raise LogsError(f"{exc}; no credential was sent (the CLI reads the allowed endpoints from "
                        f"--config or $TRAINOP_CONFIG)") from None
    try:
        auth = blob.parse_auth(spec.get("auth"), "spec.output.blob.auth")
    except blob.BlobConfigError as exc:
        raise LogsError(str(exc)) from None
    if auth.method == "WorkloadIdentity":
        from azure.identity import DefaultAzureCredential
        from azure.storage.blob import BlobServiceClient
        return BlobServiceClient(url, credential=DefaultAzureCredential()).get_container_client(spec["container"]), None
    secret_obj = kube.get("v1", "Secret", auth.secret_name, job["metadata"]["namespace"])
    if secret_obj is None or auth.secret_key not in (secret_obj.get("data") or {}):
        raise LogsError(f"spec.output.blob.auth: Secret {auth.secret_name} (key {auth.secret_key}) not found")
    secret = base64.b64decode(secret_obj["data"][auth.secret_key]).decode()
    try:
        service = blob.service_client(url, auth.method, secret)
        if auth.method == "ConnectionString":  # the string names its own endpoint: checked alike
            blob.check_endpoint_allowed(service.url.split("?", 1)[0], f"Secret {auth.secret_name} "
                                        "(spec.output.blob.auth.connectionStringSecretRef) BlobEndpoint", allowed)
    except blob.BlobConfigError as exc:
        raise LogsError(blob.explain(exc, secret)) from None
    return service.get_container_client(spec["container"]), secret


def job_folder(job: dict) -> str:
    """The job's blob folder (render/logship.job_path) from its stored object."""
    meta = job["metadata"]
    return logship.job_path(job["spec"]["output"]["blob"].get("prefix", ""), meta["namespace"], meta["name"],
                            meta.get("uid"))


def _find_blob(container, folder: str, name: str, role: str, index: int | None) -> str | None:
    if role == "worker":
        return f"{folder}/{name}-worker-{index}.log"
    # The launcher's pod name ends in the batch Job's random suffix: the newest one of the attempt.
    launchers = [b for b in container.list_blobs(name_starts_with=f"{folder}/{name}-launcher")
                 if b.name.endswith(".log")]
    launchers.sort(key=lambda b: b.creation_time)
    return launchers[-1].name if launchers else None


def _stream_blob(job: dict, role: str, index: int | None, attempt: int, follow: bool, out: BinaryIO,
                 allowed: tuple[str, ...]) -> None:
    from azure.core.exceptions import AzureError, ResourceNotFoundError

    name, namespace = job["metadata"]["name"], job["metadata"]["namespace"]
    spec = job["spec"]["output"]["blob"]
    folder = logship.run_path(job_folder(job), attempt)
    container, secret = archive_client(job, allowed)
    where = f"{spec['container']}/{folder}/"
    try:
        client = None
        offset = 0
        while True:
            # Checked before reading: once the job is over and its pods (and their sidecars,
            # which drain before they exit) are gone, this read is the last and complete one.
            done = not follow or _finished(name, namespace)
            if client is None:
                blob_name = _find_blob(container, folder, name, role, index)
                client = container.get_blob_client(blob_name) if blob_name else None
            try:
                size = client.get_blob_properties().size if client else None
            except ResourceNotFoundError:
                size = None
            if size is None and done:
                raise LogsError(f"no live pod and no archived log for {role}"
                                f"{'' if index is None else f'-{index}'} of attempt {attempt} under {where}")
            if size and size > offset:
                for chunk in client.download_blob(offset=offset, length=size - offset).chunks():
                    out.write(chunk)
                    out.flush()
                offset = size
            if done:
                return
            time.sleep(POLL_SECONDS)
    except AzureError as exc:
        raise LogsError(f"reading {where}: {blob.explain(exc, secret)}") from None


# What a terminal would act on rather than show: C0 controls but tab and newline (ESC starts the
# sequences that move the cursor, retitle the window, set the clipboard (OSC 52), or hide text),
# DEL, and the C1 controls as UTF-8 (U+0080..U+009F; U+009B is a one-character CSI).
_CONTROL = re.compile(rb"\r\n|[\x00-\x08\x0b-\x1f\x7f]|\xc2[\x80-\x9f]")


def _visible(m: re.Match) -> bytes:
    c = m.group()
    if c in (b"\r\n", b"\r"):  # a line end; a lone CR (progress bars) must not overwrite a line
        return b"\n"
    if len(c) == 2:
        return b"\\u%04x" % c[1]
    return b"^?" if c == b"\x7f" else b"^" + bytes([c[0] + 64])


class Sanitized:
    """A terminal's view of a log that job code wrote: control characters shown in caret
    notation (ESC as ^[), never acted on; tab and newline kept. Bytes are unchanged when the
    output is not a terminal (a file or a pipe gets the log as it is). A CR or the first byte of
    a C1 character at the end of a chunk waits for the next, so no sequence passes split."""

    def __init__(self, out: BinaryIO):
        self.out, self.held = out, b""

    def write(self, chunk: bytes) -> int:
        data = self.held + bytes(chunk)
        cut = len(data) - 1 if data[-1:] in (b"\r", b"\xc2") else len(data)
        self.held = data[cut:]  # dropped at the end of the stream: a lone CR or a broken character
        self.out.write(_CONTROL.sub(_visible, data[:cut]))
        return len(chunk)

    def flush(self) -> None:
        self.out.flush()


def _finished(name: str, namespace: str) -> bool:
    """-f stops once the job is over and its pods are gone (their sidecars have drained)."""
    job = kube.get(API_VERSION, KIND, name, namespace)
    if job is None:
        return True
    if (job.get("status") or {}).get("phase") not in phases.TERMINAL:
        return False
    return not kube.list_objects("v1", "Pod", namespace, common.labels(name))
