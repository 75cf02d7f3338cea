"""The CRDs in crds/ as data: their OpenAPI schemas, the API server's structural defaulting,
and offline validation. One source of truth: the CLI (`trainop run --local`), spec parsing and
the tests use the same files the API server gets.

    from trainop import crds
    obj = crds.default(manifest)        # copy with the schema's defaults filled in
    errors = crds.validate(obj)         # ["spec.workers: 0 is less than the minimum of 1"]

CEL rules (x-kubernetes-validations) are checked only by the API server; spec.py repeats the
few the operator relies on as typed checks.
"""

from __future__ import annotations

import copy
import functools
import threading

import jsonschema
import yaml

from trainop.paths import CRDS_DIR

# libyaml's loader where PyYAML was built with it (10x the pure-Python one): the DTJ CRD carries
# Kubernetes' core/v1 schemas (coreschema.py), about 190 KB of YAML.
_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
_load_lock = threading.RLock()


@functools.cache
def _load_all() -> dict[str, dict]:
    out = {}
    for file in sorted(CRDS_DIR.glob("*.yaml")):
        for doc in yaml.load_all(file.read_text(), Loader=_LOADER):
            if doc and doc.get("kind") == "CustomResourceDefinition":
                out[doc["spec"]["names"]["kind"]] = doc
    return out


def load_all() -> dict[str, dict]:
    """kind -> CustomResourceDefinition, from every YAML file in crds/, read once per process.
    Locked: functools.cache alone lets every reconcile thread that asks first parse the files
    at once (8 threads on the first jobs of a burst: 1.5 s of CPU, measured, issue 30)."""
    with _load_lock:
        return _load_all()


def crd(kind: str) -> dict:
    try:
        return load_all()[kind]
    except KeyError:
        raise KeyError(f"no CRD for kind {kind!r} in {CRDS_DIR}") from None


def schema(kind: str, version: str | None = None) -> dict:
    """The openAPIV3Schema of `kind` (the storage version unless `version` is given)."""
    for ver in crd(kind)["spec"]["versions"]:
        if ver["name"] == version or (version is None and ver.get("storage")):
            return ver["schema"]["openAPIV3Schema"]
    raise KeyError(f"{kind} has no version {version}")


def _default(node, sch: dict):
    if isinstance(node, dict) and sch.get("type") == "object":
        for key, sub in (sch.get("properties") or {}).items():
            if key not in node and "default" in sub:
                node[key] = copy.deepcopy(sub["default"])
            if key in node:
                _default(node[key], sub)
        extra = sch.get("additionalProperties")
        if isinstance(extra, dict):
            for key in node:
                if key not in (sch.get("properties") or {}):
                    _default(node[key], extra)
    elif isinstance(node, list) and isinstance(sch.get("items"), dict):
        for item in node:
            _default(item, sch["items"])
    return node


def default(obj: dict) -> dict:
    """A copy of `obj` with defaults applied the way the API server does (top-down, defaults
    inside defaulted values included)."""
    return _default(copy.deepcopy(obj), schema(obj["kind"], obj["apiVersion"].split("/")[-1]))


def _path(error: jsonschema.ValidationError) -> str:
    out = ""
    for part in error.absolute_path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "<root>"


@functools.cache
def _compiled(kind: str, version: str) -> jsonschema.Draft7Validator:
    return jsonschema.Draft7Validator(schema(kind, version))


def _validator(kind: str, version: str) -> jsonschema.Draft7Validator:
    with _load_lock:  # (compiled once, not once per thread that asks first)
        return _compiled(kind, version)


def preload() -> None:
    """Read every CRD and compile each version's validator now (the operator's start-up), not
    in the first reconciles of a burst of jobs (85 ms of YAML, once per process)."""
    for kind, doc in load_all().items():
        for ver in doc["spec"]["versions"]:
            _validator(kind, ver["name"])


def validate(obj: dict) -> list[str]:
    """Schema errors of `obj` (after defaulting), each 'field.path: problem'; [] when valid."""
    try:
        validator = _validator(obj["kind"], obj["apiVersion"].split("/")[-1])
    except (KeyError, AttributeError, TypeError):
        return [f"kind/apiVersion: not a known custom resource "
                f"({obj.get('apiVersion') if isinstance(obj, dict) else obj!r})"]
    errors = sorted(validator.iter_errors(obj), key=lambda e: list(map(str, e.absolute_path)))
    return [f"{_path(e)}: {e.message}" for e in errors]
