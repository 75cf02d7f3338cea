"""Read trainop manifests from a YAML file and check them against the CRDs' own schemas, the way
the API server will, so `trainop run --local` and `trainop submit` refuse the same input the
cluster refuses. Errors are one line naming the file and the field.

    docs = manifests.load("job.yaml", kinds=("DistributedTrainingJob",))
"""

from __future__ import annotations

from pathlib import Path

import yaml

from trainop import API_VERSION, crds


class ManifestError(ValueError):
    """Bad input: one line, naming the file and what to change."""


def _describe(doc) -> str:
    if not isinstance(doc, dict):
        return f"a YAML {type(doc).__name__}"
    return f"{doc.get('kind') or 'an object without kind'} ({doc.get('apiVersion') or 'no apiVersion'})"


def load(path: str | Path, kinds: tuple[str, ...]) -> list[dict]:
    """Every document of `path`, each of one of `kinds` (trainop.io/v1alpha1) and valid against
    its CRD's schema. Raises ManifestError for the first problem found; returns nothing partial."""
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ManifestError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise ManifestError(f"{path}: is a folder; give a manifest file") from None
    except OSError as exc:
        raise ManifestError(f"{path}: cannot read it ({exc.strerror})") from None
    try:
        docs = [d for d in yaml.safe_load_all(text) if d is not None]
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        raise ManifestError(f"{path}: not valid YAML{where}: {getattr(exc, 'problem', exc)}") from None
    if not docs:
        raise ManifestError(f"{path}: no manifest in the file")
    wanted = " or ".join(kinds)
    for index, doc in enumerate(docs):
        where = f"{path}" if len(docs) == 1 else f"{path} (document {index + 1})"
        if not isinstance(doc, dict) or doc.get("kind") not in kinds or doc.get("apiVersion") != API_VERSION:
            raise ManifestError(f"{where}: {_describe(doc)} is not a {wanted} ({API_VERSION})")
        if not isinstance(doc.get("metadata"), dict) or not doc["metadata"].get("name"):
            raise ManifestError(f"{where}: metadata.name: required; give the {doc['kind']} a name")
        errors = crds.validate(crds.default(doc))
        if errors:
            more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
            raise ManifestError(f"{where}: {errors[0]}{more}")
    return docs
