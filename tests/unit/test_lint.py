"""ruff over the whole tree with the rule set in pyproject.toml: CI's `make test` runs it here."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from trainop.paths import REPO_ROOT


def test_ruff_finds_nothing():
    ruff = Path(sys.executable).parent / "ruff"
    if not ruff.exists():
        ruff = shutil.which("ruff")
    if not ruff:  # a missing tool is a broken setup (bootstrap installs .[test]), not a skip
        pytest.fail("ruff is not installed: pip install -e .[test]")
    result = subprocess.run([str(ruff), "check", "--output-format", "concise", "."], cwd=REPO_ROOT,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
