"""Where things live: the repository's crds/ folder (one source of truth for schemas) and the
cache folder for heavy downloads and builds.

    from trainop.paths import CRDS_DIR, cache_dir
"""

from __future__ import annotations

import os
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
REPO_ROOT = PACKAGE_DIR.parents[1]
# In a checkout the CRDs are the repo's crds/; an installed wheel carries a copy in the package.
CRDS_DIR = REPO_ROOT / "crds" if (REPO_ROOT / "crds").is_dir() else PACKAGE_DIR / "crds"


def cache_dir() -> Path:
    """$TRAINOP_CACHE, else .cache/ in the repository (git-ignored); created on first use."""
    path = Path(os.environ.get("TRAINOP_CACHE") or REPO_ROOT / ".cache")
    path.mkdir(parents=True, exist_ok=True)
    return path


def state_dir() -> Path:
    """Runtime state of `trainop devcluster` (kubeconfig, etcd data, logs): $TRAINOP_STATE or ~/.trainop."""
    path = Path(os.environ.get("TRAINOP_STATE") or Path.home() / ".trainop")
    path.mkdir(parents=True, exist_ok=True)
    return path
