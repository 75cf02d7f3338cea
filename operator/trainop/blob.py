"""Azure Blob Storage auth: one place that turns an `auth` block into azure-storage-blob clients.

Shared by the stager (DataStage) and the log shipper (DistributedTrainingJob output). Two halves:

* spec side (pure, used by renderers): `parse_auth` validates an `auth` block and the account URL
  with errors that name the field; `BlobAuth.container_env()` / `pod_labels()` /
  `service_account_name` say how a pod must be set up to authenticate.
* runtime side (in the pod): `service_client(account_url, auth_from_env())` builds the client;
  `explain(exc)` turns any auth/network failure into one line that carries no secret.

The `auth` block (the same in every CRD that reads Blob Storage):

    auth:                      # exactly one of:
      workloadIdentity: true   # + serviceAccountName: the ServiceAccount federated with the identity
      sasSecretRef | accountKeySecretRef | connectionStringSecretRef: {name: secret, key: key}

The secret value reaches the pod as one env var (SECRET_ENV) through a secretKeyRef, so it is never
rendered into a manifest, an argument list, a log line or a status field.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

METHODS = ("WorkloadIdentity", "SASToken", "AccountKey", "ConnectionString")
# The `auth` block's Secret references and the method each selects.
SECRET_REFS = {"sasSecretRef": "SASToken", "accountKeySecretRef": "AccountKey",
               "connectionStringSecretRef": "ConnectionString"}
# Env vars the pod gets: the method, and the secret value itself (methods other than WorkloadIdentity).
METHOD_ENV = "TRAINOP_BLOB_AUTH_METHOD"
SECRET_ENV = "TRAINOP_BLOB_SECRET"
# AKS workload identity: the mutating webhook injects AZURE_CLIENT_ID, AZURE_TENANT_ID,
# AZURE_FEDERATED_TOKEN_FILE and AZURE_AUTHORITY_HOST into pods that carry this label.
WORKLOAD_IDENTITY_LABEL = "azure.workload.identity/use"
# ... into every container but those this pod annotation lists (semicolon-separated names).
WORKLOAD_IDENTITY_SKIP = "azure.workload.identity/skip-containers"
WORKLOAD_IDENTITY_ENV = ("AZURE_CLIENT_ID", "AZURE_TENANT_ID", "AZURE_FEDERATED_TOKEN_FILE")
STORAGE_SCOPE = "https://storage.azure.com/.default"
# Retries are for transient faults; a dead endpoint must fail within seconds, not the SDK's
# default minutes (initial_backoff 15 s, base 3): with these, 3 retries wait ~17 s in all.
# Where a spec's accountURL may point by default: https:// on Azure Storage's Blob host suffixes
# (public, China, US Government clouds). Anything else must be listed by the admin in the
# operator configuration (ALLOWED_KEY), or a workload-identity token, a SAS or a key would be
# sent to a host the user picked.
AZURE_BLOB_SUFFIXES = (".blob.core.windows.net", ".blob.core.chinacloudapi.cn",
                       ".blob.core.usgovcloudapi.net")
ALLOWED_KEY = "blob.allowedAccountURLs"
RETRY = {"retry_total": 3, "initial_backoff": 1, "increment_base": 2}
CONNECTION_TIMEOUT_S = 10


class BlobConfigError(ValueError):
    """A bad `auth` block, account URL or runtime environment. The message is one line, names the
    field (or env var) and the fix, and never contains a secret value."""


@dataclass(frozen=True)
class BlobAuth:
    method: str
    secret_name: str | None = None
    secret_key: str | None = None
    service_account_name: str | None = None

    def container_env(self) -> list[dict[str, Any]]:
        """Env entries for the container that talks to Blob Storage (the secret by reference)."""
        env: list[dict[str, Any]] = [{"name": METHOD_ENV, "value": self.method}]
        if self.secret_name:
            env.append({
                "name": SECRET_ENV,
                "valueFrom": {"secretKeyRef": {"name": self.secret_name, "key": self.secret_key}},
            })
        return env

    def pod_labels(self) -> dict[str, str]:
        """Labels the pod needs so the AKS workload-identity webhook injects the token file."""
        return {WORKLOAD_IDENTITY_LABEL: "true"} if self.method == "WorkloadIdentity" else {}

    def pod_annotations(self, without: list[str]) -> dict[str, str]:
        """Annotations that keep the workload-identity token out of the containers `without`
        (the ones that run user code): only the container that talks to Blob Storage gets it."""
        if self.method != "WorkloadIdentity" or not without:
            return {}
        return {WORKLOAD_IDENTITY_SKIP: ";".join(without)}


def parse_auth(auth: Mapping[str, Any] | None, field: str) -> BlobAuth:
    """Validate an `auth` block (`field` is its path, e.g. `spec.source.blob.auth`). The CRDs'
    CEL rules reject most mistakes first; this catches the rest, naming the field."""
    auth = auth or {"workloadIdentity": True}
    chosen = [k for k in ("workloadIdentity", *SECRET_REFS) if auth.get(k)]
    if len(chosen) != 1:
        raise BlobConfigError(f"{field}: set exactly one of workloadIdentity: true, {', '.join(SECRET_REFS)}")
    if chosen[0] == "workloadIdentity":
        return BlobAuth("WorkloadIdentity", service_account_name=auth.get("serviceAccountName") or None)
    ref = auth[chosen[0]]
    for part in ("name", "key"):
        if not ref.get(part):
            raise BlobConfigError(f"{field}.{chosen[0]}.{part}: required (the Secret {part} that holds the credential)")
    return BlobAuth(SECRET_REFS[chosen[0]], secret_name=ref["name"], secret_key=ref["key"])


def check_account_url(url: str | None, field: str) -> str:
    """An account endpoint such as https://acct.blob.core.windows.net (or an emulator's
    http://127.0.0.1:10000/devstoreaccount1). A query string is refused: a SAS pasted into the URL
    would end up in manifests and logs; it belongs in a SAS Secret."""
    if not url:
        raise BlobConfigError(f"{field}: required, e.g. https://<account>.blob.core.windows.net")
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 -- a malformed or out-of-range port raises only when read
    except ValueError as exc:
        # Here, not later in a reconcile or the admission gate, where it would fail every pass.
        raise BlobConfigError(f"{field}: {_strip_query(url)!r} is not a valid URL ({exc}); use "
                              f"https://<account>.blob.core.windows.net[:port]") from None
    if parts.scheme not in ("https", "http") or not parts.hostname:
        raise BlobConfigError(f"{field}: {_strip_query(url)!r} is not an http(s) URL; use https://<account>.blob.core.windows.net")
    if parts.query or parts.fragment:
        raise BlobConfigError(f"{field}: must not carry a query string (a SAS token belongs in a Secret: auth.sasSecretRef)")
    if not account_name(url):
        raise BlobConfigError(f"{field}: cannot tell the storage account from {url!r}; use https://<account>.blob.core.windows.net")
    return url.rstrip("/")


def check_endpoint_allowed(url: str | None, field: str, extra: tuple[str, ...] = ()) -> str:
    """THE check before a credential goes to an account URL, for everyone who sends one: the
    operator (a job's output, a DataStage's source) and the CLI (`trainop logs`/`tensorboard`,
    which send the user's own token or a Secret the job names). The URL's shape
    (check_account_url), then: Azure Storage, or an endpoint in the admin's list (`extra`,
    blob.allowedAccountURLs). Returns the URL without a trailing slash."""
    url = check_account_url(url, field)
    if endpoint_allowed(url, extra):
        return url
    host = urlsplit(url).hostname or ""
    raise BlobConfigError(
        f"{field}: {urlsplit(url).scheme}://{host} is not an allowed Blob endpoint; use "
        f"https://<account>{AZURE_BLOB_SUFFIXES[0]} (or another Azure cloud's), or ask the cluster "
        f"admin to add it to {ALLOWED_KEY} in the operator configuration")


def endpoint_allowed(url: str, extra: tuple[str, ...] = ()) -> bool:
    parts = urlsplit(url)
    host = (parts.hostname or "").lower()
    if parts.scheme == "https" and host.endswith(AZURE_BLOB_SUFFIXES) and parts.port in (None, 443) \
            and not parts.username:
        return True
    return any(_endpoint_matches(parts, entry) for entry in extra)


def _endpoint_matches(parts, entry: str) -> bool:
    want = urlsplit(entry)
    host, want_host = (parts.hostname or "").lower(), (want.hostname or "").lower()
    if parts.scheme != want.scheme or parts.username:
        return False
    if want_host.startswith("*."):
        if not (host.endswith(want_host[1:]) and len(host) > len(want_host) - 1):
            return False
    elif host != want_host:
        return False
    if want.port is not None and parts.port != want.port:
        return False
    prefix = want.path.rstrip("/")
    return not prefix or parts.path == prefix or parts.path.startswith(prefix + "/")


def account_name(url: str) -> str | None:
    """`acct` from https://acct.blob.core.windows.net, or from the path of an emulator-style URL
    (IP or localhost host: http://127.0.0.1:10000/acct)."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    if host == "localhost" or re.fullmatch(r"[\d.]+|\[?[0-9a-fA-F:]+\]?", host):
        first = parts.path.strip("/").split("/", 1)[0]
        return first or None
    return host.split(".", 1)[0] or None


# ---- runtime --------------------------------------------------------------------------------

def auth_from_env(environ: Mapping[str, str] = os.environ) -> tuple[str, str | None]:
    """(method, secret) as the pod received them (see BlobAuth.container_env)."""
    method = environ.get(METHOD_ENV, "WorkloadIdentity")
    if method not in METHODS:
        raise BlobConfigError(f"{METHOD_ENV}: {method!r} is not one of {', '.join(METHODS)}")
    secret = environ.get(SECRET_ENV) or None
    if method != "WorkloadIdentity" and not secret:
        raise BlobConfigError(f"{SECRET_ENV}: empty, but method {method} needs the credential from its Secret")
    return method, secret


def service_client(account_url: str, method: str, secret: str | None = None, **client_kwargs: Any):
    """A BlobServiceClient for `method`. `client_kwargs` go to the SDK (e.g. connection_verify,
    max_single_get_size); retries and timeouts default to fail-fast values."""
    from azure.storage.blob import BlobServiceClient, ExponentialRetry

    client_kwargs.setdefault("retry_policy", ExponentialRetry(**RETRY))
    client_kwargs.setdefault("connection_timeout", CONNECTION_TIMEOUT_S)
    if method == "ConnectionString":
        # The endpoint comes from the connection string itself (it names the account).
        try:
            return BlobServiceClient.from_connection_string(secret or "", **client_kwargs)
        except ValueError:
            raise BlobConfigError(f"{SECRET_ENV}: not a valid storage connection string (expected AccountName=...;AccountKey=... or BlobEndpoint=...;SharedAccessSignature=...)") from None
    return BlobServiceClient(account_url, credential=_credential(account_url, method, secret), **client_kwargs)


def _credential(account_url: str, method: str, secret: str | None):
    if method == "SASToken":
        from azure.core.credentials import AzureSasCredential
        sas = (secret or "").strip().lstrip("?")
        if "sig=" not in sas:
            raise BlobConfigError(f"{SECRET_ENV}: does not look like a SAS token (no sig= parameter); store the token (sv=...&sig=...) in the Secret")
        return AzureSasCredential(sas)
    if method == "AccountKey":
        from azure.core.credentials import AzureNamedKeyCredential
        return AzureNamedKeyCredential(account_name(account_url) or "", (secret or "").strip())
    if method == "WorkloadIdentity":
        missing = [name for name in WORKLOAD_IDENTITY_ENV if not os.environ.get(name)]
        if missing:
            raise BlobConfigError(
                f"workload identity: {', '.join(missing)} not set; label the pod {WORKLOAD_IDENTITY_LABEL}=true "
                "and run it under a ServiceAccount federated with the managed identity (auth.serviceAccountName)")
        from azure.identity import DefaultAzureCredential
        # Managed-identity and developer-tool fallbacks are excluded: in a pod they only turn a
        # misconfiguration into a slow, confusing failure.
        credential = DefaultAzureCredential(
            exclude_managed_identity_credential=True, exclude_cli_credential=True,
            exclude_powershell_credential=True, exclude_developer_cli_credential=True,
            exclude_visual_studio_code_credential=True, exclude_shared_token_cache_credential=True)
        # Get the first token now: the storage retry policy retries a failed token exchange like a
        # network fault (~15 s); here it fails at once, and the token is cached for the client.
        credential.get_token(STORAGE_SCOPE)
        return credential
    raise BlobConfigError(f"{METHOD_ENV}: {method!r} is not one of {', '.join(METHODS)}")


_SIG = re.compile(r"\b(sig|AccountKey|SharedAccessSignature)=[^&;\s'\"]+", re.IGNORECASE)


def redact(text: str, *secrets: str | None) -> str:
    """Remove secret values and SAS/connection-string signatures from `text`."""
    for secret in secrets:
        if secret:
            text = text.replace(secret, "<redacted>")
    return _SIG.sub(lambda m: f"{m.group(1)}=<redacted>", text)


def _strip_query(url: str) -> str:
    return url.split("?", 1)[0]


def explain(exc: BaseException, *secrets: str | None) -> str:
    """One line for an auth, permission, not-found or network failure; no secret, no stack."""
    from azure.core.exceptions import (
        ClientAuthenticationError,
        HttpResponseError,
        ResourceNotFoundError,
        ServiceRequestError,
        ServiceResponseError,
    )
    if isinstance(exc, BlobConfigError):
        return str(exc)
    code = getattr(exc, "error_code", None) or ""
    code = getattr(code, "value", code)  # the SDK's StorageErrorCode enum -> "AuthenticationFailed"
    status = getattr(exc, "status_code", None)
    if isinstance(exc, ClientAuthenticationError) and status is None:
        # Raised by azure-identity: the token exchange itself failed. DefaultAzureCredential lists
        # every credential it tried; the workload-identity line is the one that says why.
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()] or [type(exc).__name__]
        why = next((line for line in lines if line.startswith("WorkloadIdentityCredential:")), lines[0])
        return f"authentication failed: could not get a token ({redact(why, *secrets)[:300]})"
    if isinstance(exc, ClientAuthenticationError) or status in (401, 403):
        return (f"authentication failed ({status} {code}): the credential was refused or lacks read/list "
                "permission on the container; check the Secret's value, its expiry, or the identity's role assignment")
    if isinstance(exc, ResourceNotFoundError) or status == 404:
        return f"not found ({code or 404}): check the account URL and container name"
    if isinstance(exc, (ServiceRequestError, ServiceResponseError)):
        reason = redact(_root_cause(exc), *secrets)
        return f"network error: cannot reach the storage endpoint ({reason[:300]})"
    if isinstance(exc, HttpResponseError):
        return f"storage error ({status} {code})"
    return redact(f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}", *secrets)[:400]


def _root_cause(exc: BaseException) -> str:
    while exc.__cause__ is not None or getattr(exc, "inner_exception", None) is not None:
        exc = exc.__cause__ or exc.inner_exception  # type: ignore[attr-defined]
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    # requests' "Max retries exceeded with url: /c?...": the query (a SAS) must not survive.
    return re.sub(r"url: \S+", "url: <redacted>", text)
