"""Kubernetes' own core/v1 schemas, copied into crds/ where a CRD field is a core type.

A CRD schema cannot `$ref` the API server's types, so `spec.podTemplate` (volumes, containers,
affinity, tolerations, ...) carries a copy. This module makes that copy from the Kubernetes
OpenAPI v3 document (`/openapi/v3/api/v1` of a cluster, or a saved copy) the way controller-gen
does for Go types, so the copy is never written by hand:

    python -m trainop.coreschema --openapi api__v1_openapi.json --write
    python -m trainop.coreschema --kubeconfig .kubeconfig --write   # from a running cluster

In crds/*.yaml, the lines between `# BEGIN core/v1 <Type>` and `# END core/v1 <Type>` are
replaced by <Type>'s schema at the marker's indentation. The copy is made structural: `$ref`
inlined, IntOrString and Quantity as `x-kubernetes-int-or-string` (Quantity with its pattern),
ObjectMeta (inside ephemeral volumes) reduced to labels and annotations, defaults, formats and
list types dropped (the API server applies them on the Pod itself). Kubernetes' descriptions
are kept, so `kubectl explain dtj.spec.podTemplate.worker.spec.containers` explains each field
(issue 25): the DistributedTrainingJob CRD is then about 460 KB of JSON, a third of etcd's
1.5 MiB request limit; it is applied server-side only (a client-side apply's annotation would
exceed 256 KiB).
"""

from __future__ import annotations

import argparse
import json
import re
import sys

import yaml

from trainop.paths import CRDS_DIR

CORE = "io.k8s.api.core.v1."
_MARKER = re.compile(r"^(?P<indent> *)# BEGIN core/v1 (?P<type>\w+)\b.*$")
_INT_OR_STRING = {"x-kubernetes-int-or-string": True}
_SPECIAL = {
    "io.k8s.apimachinery.pkg.util.intstr.IntOrString": _INT_OR_STRING,
    # the pattern apimachinery's parser accepts (controller-gen writes the same)
    "io.k8s.apimachinery.pkg.api.resource.Quantity": _INT_OR_STRING | {
        "pattern": r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|"
                   r"([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"},
    "io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta": {
        "type": "object", "properties": {
            "labels": {"type": "object", "additionalProperties": {"type": "string"}},
            "annotations": {"type": "object", "additionalProperties": {"type": "string"}}}},
}
_KEEP = ("description", "type", "properties", "items", "additionalProperties", "required", "enum")


class _NoAliases(yaml.SafeDumper):
    """Each block stands alone: no YAML anchors from shared lists (two blocks would collide)."""

    def ignore_aliases(self, data) -> bool:
        return True


def _structural(node: dict, schemas: dict, seen: tuple[str, ...] = ()) -> dict:
    if "$ref" in node or ("allOf" in node and len(node["allOf"]) == 1):
        ref = (node.get("$ref") or node["allOf"][0]["$ref"]).rsplit("/", 1)[-1]
        if ref in _SPECIAL:
            return dict(_SPECIAL[ref])
        if ref in seen:
            raise ValueError(f"recursive type {ref}: cannot be copied into a CRD")
        return _structural(schemas[ref], schemas, seen + (ref,))
    if node.get("format") == "int-or-string" or "oneOf" in node:
        return dict(_INT_OR_STRING)
    out: dict = {}
    for key in _KEEP:
        if key not in node:
            continue
        value = node[key]
        if key == "properties":
            value = {k: _structural(v, schemas, seen) for k, v in sorted(value.items())}
        elif key in ("items", "additionalProperties") and isinstance(value, dict):
            value = _structural(value, schemas, seen)
        out[key] = value
    if out.get("type") is None and "properties" in out:
        out["type"] = "object"
    return out


def schema(type_name: str, openapi: dict, description: str) -> dict:
    """core/v1 `type_name` as a structural CRD schema; `description` says where it comes from
    (crdref.py lists such a field but not its core sub-fields)."""
    schemas = openapi["components"]["schemas"]
    body = _structural(schemas[CORE + type_name], schemas)
    body.pop("description", None)  # ours says where the copy comes from
    return {"description": description, **body}


def rewrite(text: str, openapi: dict) -> str:
    """`text` (a CRD file) with every BEGIN/END core/v1 block regenerated."""
    lines, out, i = text.splitlines(keepends=True), [], 0
    while i < len(lines):
        match = _MARKER.match(lines[i])
        out.append(lines[i])
        i += 1
        if not match:
            continue
        name, indent = match["type"], match["indent"]
        end = f"{indent}# END core/v1 {name}"
        while i < len(lines) and not lines[i].startswith(end):
            i += 1
        if i == len(lines):
            raise ValueError(f"no '{end.strip()}' after '# BEGIN core/v1 {name}'")
        desc = (f"core/v1 {name}, Kubernetes' own schema (kubectl explain pod.spec shows its "
                f"fields); the operator's checks and merge rules are in docs/pod-template.md.")
        body = yaml.dump(schema(name, openapi, desc), Dumper=_NoAliases, sort_keys=False,
                         width=10_000)
        out += [f"{indent}{line}\n" for line in body.splitlines()]
        out.append(lines[i])
        i += 1
    return "".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainop.coreschema",
                                     description=__doc__.splitlines()[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--openapi", help="a saved /openapi/v3/api/v1 document")
    source.add_argument("--kubeconfig", help="read /openapi/v3/api/v1 from this cluster")
    parser.add_argument("--write", action="store_true", help="rewrite crds/*.yaml in place")
    args = parser.parse_args(argv)
    if args.openapi:
        with open(args.openapi) as f:
            openapi = json.load(f)
    else:
        from trainop.devcluster import kubectl  # the control plane's own release

        raw = kubectl.run(args.kubeconfig, "get", "--raw", "/openapi/v3/api/v1", check=True)
        openapi = json.loads(raw.stdout)
    changed = []
    for path in sorted(CRDS_DIR.glob("*.yaml")):
        text = path.read_text()
        new = rewrite(text, openapi)
        if new != text:
            changed.append(path.name)
            if args.write:
                path.write_text(new)
    print(("rewrote " if args.write else "out of date: ") + (", ".join(changed) or "nothing"))
    return 1 if changed and not args.write else 0


if __name__ == "__main__":
    sys.exit(main())
