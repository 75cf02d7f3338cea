"""`trainop operator` refuses a wrong configuration before it connects anywhere: one line,
naming the key."""

import subprocess
import sys


def test_bad_config_is_one_line_naming_the_key(tmp_path):
    bad = tmp_path / "config.yaml"
    bad.write_text("nodePools:\n  gpu: {tolerations: []}\n")
    run = subprocess.run([sys.executable, "-m", "trainop", "operator", "--config", str(bad)],
                         capture_output=True, text=True, timeout=60,
                         env={"PATH": "/usr/bin:/bin", "KUBECONFIG": str(tmp_path / "none")})
    assert run.returncode != 0
    assert run.stderr.strip() == ("trainop operator: nodePools.gpu.nodeSelector: required, "
                                  "a non-empty map of node labels")


def test_operator_verb_is_registered():
    run = subprocess.run([sys.executable, "-m", "trainop", "operator", "--help"],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0
    for flag in ("--namespace", "--all-namespaces", "--lease", "--lease-namespace", "--standalone", "--liveness"):
        assert flag in run.stdout
