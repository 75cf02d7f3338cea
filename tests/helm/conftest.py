from __future__ import annotations

import subprocess

import pytest

from tests.helm.helm import CHART, docs, helm_binary, values_args


@pytest.fixture(scope="session")
def helm_bin():
    return helm_binary()


@pytest.fixture
def helm(helm_bin, tmp_path):
    """helm(*args, values=None, kubeconfig=None, check=True) -> CompletedProcess."""

    def run(*args: str, values: dict | None = None, kubeconfig=None, check: bool = True):
        env_args = ["--kubeconfig", str(kubeconfig)] if kubeconfig else []
        proc = subprocess.run([str(helm_bin), *args, *values_args(values, tmp_path), *env_args],
                              capture_output=True, text=True, timeout=120)
        if check and proc.returncode:
            raise AssertionError(f"helm {' '.join(args)} failed:\n{proc.stderr}")
        return proc

    return run


@pytest.fixture
def render(helm):
    """render(values=None, namespace="trainop-system") -> the manifests `helm template` renders."""
    def run(values: dict | None = None, namespace: str = "trainop-system", release: str = "trainop"):
        return docs(helm("template", release, str(CHART), "--namespace", namespace,
                         "--include-crds", values=values).stdout)

    return run
