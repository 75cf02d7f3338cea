"""The only module that talks to the Kubernetes API (besides kopf itself).

Objects are plain dicts (what render/ produces). Calls are synchronous: the controller runs
them in a thread pool. The client is created on first use (never at import time) from the
in-cluster service account or $KUBECONFIG (`connect()`, the one place that reads a kubeconfig).

    from trainop import kube
    kube.apply(manifest)                          # server-side apply, field manager "trainop"
    kube.ensure(manifest, owner=job_body)        # create if missing, check ownership, apply
    kube.ensure(secret, owner=job_body, update=False)  # create once, never touch again
    pods = kube.list_objects("v1", "Pod", ns, labels={"trainop.io/job-name": name})
    kube.get("trainop.io/v1alpha1", "DataStage", name, ns)   # None when absent
    kube.delete("v1", "Pod", name, ns)                        # False when already gone
    kube.patch("v1", "ConfigMap", name, ns, {"data": {...}})  # JSON merge patch
    for event in kube.watch("/api/v1/pods", rv, 300): ...      # one watch request (informer.py)

Errors: kubernetes.client.ApiException for API failures; OwnershipError when an object with
the child's name exists but belongs to someone else (never adopted, never overwritten);
NotLeading when a write is asked of a replica that does not hold the Lease (`fence`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import urllib3
from kubernetes import client as k8s
from kubernetes import config as k8s_config
from kubernetes.client.exceptions import ApiException

from trainop import fastjson

FIELD_MANAGER = "trainop"
# Kinds whose plural is not kind.lower() + "s".
_PLURALS = {"Endpoints": "endpoints", "NetworkPolicy": "networkpolicies",
            "PriorityClass": "priorityclasses",
            "WorkloadPriorityClass": "workloadpriorityclasses", "StorageClass": "storageclasses",
            "IngressClass": "ingressclasses", "RuntimeClass": "runtimeclasses"}

# (connect, read) seconds: a stalled connection becomes an error kopf retries, never a reconcile
# that hangs (and with it the job's finalizer) forever.
REQUEST_TIMEOUT = (10, 30)

_lock = threading.Lock()
_client: k8s.ApiClient | None = None
USER_AGENT = "trainop"
_may_write: Callable[[], bool] = lambda: True  # noqa: E731  (see fence())


class OwnershipError(RuntimeError):
    """A child's name is taken by an object this owner does not control."""


class NotLeading(RuntimeError):
    """A write from a replica that does not hold the Lease (leader.py): refused before it is
    sent."""


def configure(api_client: k8s.ApiClient | None = None, user_agent: str | None = None
              ) -> k8s.ApiClient:
    """Use `api_client`, or build one from the service account / $KUBECONFIG. `user_agent`
    names this replica in the API server's audit log (`trainop/<identity>`)."""
    global _client, USER_AGENT
    with _lock:
        if user_agent is not None:
            USER_AGENT = user_agent
        if api_client is not None:
            _client = api_client
        elif _client is None:
            _client = connect()[0]
        _client.user_agent = USER_AGENT
        return _client


def fence(may_write: Callable[[], bool]) -> None:
    """Every write (any method but GET) first asks `may_write()`, in whatever thread it runs:
    a standby replica, or a leader past its renew deadline, sends nothing (leader.py). The one
    place that enforces "only the leader acts", whichever code path asks for the write."""
    global _may_write
    _may_write = may_write


# Connections kept open to the API server: as many as threads call it at once (the controller's
# reconciles, each one's stage of parallel calls (apply.py), its Event posters, the Lease). The
# client's default is 5 per CPU: on 2 CPUs, 10, and every call over that opened a new TLS
# connection and threw it away ("Connection pool is full"), a handshake of CPU each time.
MAX_CONNECTIONS = 32


def _configuration() -> k8s.Configuration:
    cfg = k8s.Configuration()
    cfg.connection_pool_maxsize = MAX_CONNECTIONS
    return cfg


def connect(kubeconfig: str | None = None, context: str | None = None
            ) -> tuple[k8s.ApiClient, str | None]:
    """A client and the context's namespace (None in a pod, or when the context names none):
    the pod's service account when running in a cluster and no kubeconfig is named, else the
    kubeconfig (`kubeconfig`, else $KUBECONFIG, else ~/.kube/config). Raises
    kubernetes.config.ConfigException when neither works."""
    if kubeconfig is None and context is None:
        try:
            cfg = _configuration()
            k8s_config.load_incluster_config(client_configuration=cfg)
            return k8s.ApiClient(cfg), None
        except k8s_config.ConfigException:
            pass
    cfg = _configuration()
    k8s_config.load_kube_config(config_file=kubeconfig, context=context, client_configuration=cfg)
    api = k8s.ApiClient(cfg)
    _, active = k8s_config.list_kube_config_contexts(config_file=kubeconfig)
    if context:
        contexts, _ = k8s_config.list_kube_config_contexts(config_file=kubeconfig)
        active = next((c for c in contexts if c["name"] == context), active)
    return api, ((active or {}).get("context") or {}).get("namespace")


def plural(kind: str) -> str:
    return _PLURALS.get(kind, kind.lower() + "s")


def path(api_version: str, kind: str, namespace: str | None = None, name: str | None = None,
         subresource: str | None = None) -> str:
    base = f"/api/{api_version}" if "/" not in api_version else f"/apis/{api_version}"
    parts = [base]
    if namespace:
        parts.append(f"namespaces/{namespace}")
    parts.append(plural(kind))
    if name:
        parts.append(name)
    if subresource:
        parts.append(subresource)
    return "/".join(parts)


# Whether an optional API (Kueue, a gang scheduler's PodGroup) is served: a yes is kept for good
# (such APIs come with their CRDs and stay), a no is asked again after SERVED_RECHECK_SECONDS, so
# an API installed later is found without a restart.
SERVED_RECHECK_SECONDS = 30.0
_served: dict[str, tuple[bool, float]] = {}
_served_lock = threading.Lock()


def served(group_version: str) -> bool:
    """Is /apis/<group_version> served? (cached, see above)"""
    with _served_lock:
        hit = _served.get(group_version)
        if hit and (hit[0] or time.monotonic() - hit[1] < SERVED_RECHECK_SECONDS):
            return hit[0]
        try:
            request("GET", f"/apis/{group_version}")
            found = True
        except ApiException as exc:
            if exc.status != 404:
                raise
            found = False
        _served[group_version] = (found, time.monotonic())
        return found


def request(method: str, url_path: str, *, body=None, query: list | None = None,
            content_type: str = "application/json", fenced: bool = True):
    """One API call; returns the decoded JSON body; raises ApiException on non-2xx, NotLeading
    for a write the fence refuses (`fenced=False`: the Lease's own writes only)."""
    if fenced and method != "GET" and not _may_write():
        raise NotLeading(f"{method} {url_path}: this replica does not hold the Lease")
    api = configure()
    _, url, headers, _, _ = api.param_serialize(
        method, url_path, query_params=query or [],
        header_params={"Content-Type": content_type, "Accept": "application/json"},
        auth_settings=["BearerToken"])
    if body is None:
        resp = api.call_api(method, url, header_params=headers, _request_timeout=REQUEST_TIMEOUT)
    else:
        # The body encoded by orjson and sent through the client's own connection pool: the
        # client walks it (sanitize_for_serialization) and json.dumps it, about 300 µs of CPU
        # for a worker pod against 5 (issue 30), and has no setting for the encoder.
        resp = k8s.rest.RESTResponse(api.rest_client.pool_manager.request(
            method, url, body=fastjson.dumps(body), headers=headers, preload_content=False,
            timeout=urllib3.Timeout(connect=REQUEST_TIMEOUT[0], read=REQUEST_TIMEOUT[1])))
    resp.read()
    if not 200 <= resp.status <= 299:
        raise ApiException(http_resp=resp)
    return fastjson.api_object(resp.data) if resp.data else None


def watch(url_path: str, resource_version: str, timeout_seconds: int, selector: str | None = None):
    """One watch request from `resource_version` (of the objects with the label `selector`), with
    bookmarks: yields each event (decoded, managedFields dropped) until the API server ends it
    after `timeout_seconds` (informer.py lists and watches on). Raises
    ApiException for a refusal (410: the version is too old, list again), urllib3's errors for
    a broken connection. A read that waits past the server's timeout (a frozen or vanished
    API server) raises too."""
    api = configure()
    query = [("watch", "true"), ("allowWatchBookmarks", "true"),
             ("resourceVersion", resource_version), ("timeoutSeconds", str(timeout_seconds))]
    if selector:
        query.append(("labelSelector", selector))
    _, url, headers, _, _ = api.param_serialize("GET", url_path, query_params=query,
                                                header_params={"Accept": "application/json"},
                                                auth_settings=["BearerToken"])
    resp = api.call_api("GET", url, header_params=headers,
                        _request_timeout=(REQUEST_TIMEOUT[0], timeout_seconds + 30))
    try:
        if not 200 <= resp.status <= 299:
            resp.read()
            raise ApiException(http_resp=resp)
        rest = b""
        for chunk in resp.response.stream(65536):
            *lines, rest = (rest + chunk).split(b"\n")
            for line in lines:
                if line.strip():
                    yield fastjson.watch_event(line)
    finally:
        resp.response.release_conn()


def _ref(obj: dict) -> tuple[str, str, str, str | None]:
    meta = obj["metadata"]
    return obj["apiVersion"], obj["kind"], meta["name"], meta.get("namespace")


def get(api_version: str, kind: str, name: str, namespace: str | None = None) -> dict | None:
    try:
        return request("GET", path(api_version, kind, namespace, name))
    except ApiException as exc:
        if exc.status == 404:
            return None
        raise


def list_objects(api_version: str, kind: str, namespace: str | None = None,
                 labels: dict[str, str] | None = None) -> list[dict]:
    query = [("labelSelector", ",".join(f"{k}={v}" for k, v in labels.items()))] if labels \
        else []
    result = request("GET", path(api_version, kind, namespace), query=query)
    items = result.get("items") or []
    for item in items:  # list responses leave these out of each item
        item.setdefault("apiVersion", api_version)
        item.setdefault("kind", kind)
    return items


def create(obj: dict) -> dict:
    api_version, kind, _, namespace = _ref(obj)
    return request("POST", path(api_version, kind, namespace), body=obj,
                   query=[("fieldManager", FIELD_MANAGER)])


def apply(obj: dict) -> dict:
    """Server-side apply with field manager "trainop", forced: the fields `obj` sets are ours
    (an edit by someone else is taken back), fields it stops setting are removed, and defaults
    the API server adds are never compared or fought over."""
    api_version, kind, name, namespace = _ref(obj)
    body = {k: v for k, v in obj.items() if k != "status"}
    return request("PATCH", path(api_version, kind, namespace, name), body=body,
                   query=[("fieldManager", FIELD_MANAGER), ("force", "true")],
                   content_type="application/apply-patch+yaml")  # JSON is YAML


def delete(api_version: str, kind: str, name: str, namespace: str | None = None, *,
           propagation: str = "Background", grace_seconds: int | None = None,
           uid: str | None = None) -> bool:
    """Delete; False if it was already gone. `uid` deletes only that incarnation."""
    body: dict = {"propagationPolicy": propagation}
    if grace_seconds is not None:
        body["gracePeriodSeconds"] = grace_seconds
    if uid:
        body["preconditions"] = {"uid": uid}
    try:
        request("DELETE", path(api_version, kind, namespace, name), body=body)
        return True
    except ApiException as exc:
        if exc.status in (404, 409):  # 409: the uid precondition failed, a newer object
            return False
        raise


def patch(api_version: str, kind: str, name: str, namespace: str | None, body: dict, *,
          subresource: str | None = None) -> dict:
    """JSON merge patch (RFC 7386): maps merge, lists and scalars replace, None deletes."""
    return request("PATCH", path(api_version, kind, namespace, name, subresource), body=body,
                   content_type="application/merge-patch+json")


def json_patch(api_version: str, kind: str, name: str, namespace: str | None,
               operations: list[dict]) -> dict:
    """JSON patch (RFC 6902): the operations in order, none applied if a `test` fails (422)."""
    return request("PATCH", path(api_version, kind, namespace, name), body=operations,
                   content_type="application/json-patch+json")


def owner_reference(owner: dict) -> dict:
    return {"apiVersion": owner["apiVersion"], "kind": owner["kind"],
            "name": owner["metadata"]["name"], "uid": owner["metadata"]["uid"],
            "controller": True, "blockOwnerDeletion": True}


def controlled_by(obj: dict, owner: dict) -> bool:
    return controller_uid(obj) == owner["metadata"]["uid"]


def controller_uid(obj: dict) -> str | None:
    """The uid of the object's controller (its ownerReference with controller: true)."""
    return next((ref.get("uid") for ref in obj["metadata"].get("ownerReferences") or []
                 if ref.get("controller")), None)


def with_owner(obj: dict, owner: dict | None) -> dict:
    """Copy of `obj` carrying the owner's controller reference (if given)."""
    out = fastjson.clone(obj)
    if owner is not None:
        out.setdefault("metadata", {})["ownerReferences"] = [owner_reference(owner)]
    return out


def ensure(obj: dict, owner: dict | None = None, *, update: bool = True) -> dict:
    """Create `obj` if missing; otherwise check that `owner` controls it and, when `update`,
    server-side apply it (drift fix: an edited field comes back). Returns the live object.
    Use update=False for immutable or generate-once children (Pods, Jobs, the SSH Secret)."""
    desired = with_owner(obj, owner)
    api_version, kind, name, namespace = _ref(desired)
    try:
        return create(desired)
    except ApiException as exc:
        if exc.status != 409:  # 409: it exists (an earlier reconcile, or someone else's)
            raise
    live = get(api_version, kind, name, namespace)
    if live is None:  # deleted in between: the next reconcile creates it
        raise ApiException(status=409, reason=f"{kind} {namespace}/{name} is being replaced")
    if owner is not None and not controlled_by(live, owner):
        raise OwnershipError(f"{kind} {namespace}/{name} already exists and is not controlled "
                             f"by {owner['kind']} {owner['metadata']['name']}; delete or "
                             f"rename it")
    return apply(desired) if update else live
