"""The chart under test and the helm binary (scripts/install-helm.sh builds it once, cached by
version under $TRAINOP_CACHE/bin)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import yaml

from trainop.paths import REPO_ROOT

CHART = REPO_ROOT / "charts" / "trainop"


def helm_binary() -> Path:
    out = subprocess.run([str(REPO_ROOT / "scripts" / "install-helm.sh")], capture_output=True,
                         text=True, check=True)
    return Path(out.stdout.strip().splitlines()[-1])


def values_args(values: dict | None, tmp: Path) -> list[str]:
    if not values:
        return []
    path = tmp / f"values-{abs(hash(repr(values)))}.yaml"
    path.write_text(yaml.safe_dump(values))
    return ["-f", str(path)]


def docs(text: str) -> list[dict]:
    return [d for d in yaml.safe_load_all(text) if d]


def find(objs: list[dict], kind: str, name: str | None = None) -> dict:
    hits = [o for o in objs if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]
    assert len(hits) == 1, f"{kind} {name or ''}: {len(hits)} rendered"
    return hits[0]
