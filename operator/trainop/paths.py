"""Where trainop finds its own files and keeps its caches."""

from __future__ import annotations

import os
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
# The operator runs from a source checkout (editable install) or from its image, which copies
# crds/ to the same place relative to the package; TRAINOP_CRDS_DIR overrides both.
REPO_ROOT = PACKAGE_DIR.parents[1]
CRDS_DIR = Path(os.environ.get("TRAINOP_CRDS_DIR", REPO_ROOT / "crds"))


def cache_dir() -> Path:
    """Heavy, rebuildable things (Kubernetes binaries, wheels): $TRAINOP_CACHE or <repo>/.cache."""
    path = Path(os.environ.get("TRAINOP_CACHE") or REPO_ROOT / ".cache")
    path.mkdir(parents=True, exist_ok=True)
    return path


def state_dir() -> Path:
    """Runtime state of the local dev cluster (kubeconfig, etcd data, logs)."""
    path = Path(os.environ.get("TRAINOP_STATE") or Path.home() / ".trainop")
    path.mkdir(parents=True, exist_ok=True)
    return path
