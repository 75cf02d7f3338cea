"""README.md stays true: its Quickstart is the two Makefile targets CI runs, the examples it
lists are the ones in examples/, and the files and verbs it names exist."""

import re
from pathlib import Path

from trainop.cli import build_parser

REPO = Path(__file__).resolve().parents[2]
README = (REPO / "README.md").read_text()


def test_quickstart_is_make_demo_and_make_test_as_ci_runs_them():
    quickstart = README.split("## Quickstart")[1].split("\n## ")[0]
    block = quickstart.split("```sh\n")[1].split("```")[0]
    assert [line.split("#")[0].strip() for line in block.strip().splitlines()] == ["make demo", "make test"]
    makefile = (REPO / "Makefile").read_text()
    assert re.search(r"^demo:", makefile, re.M) and re.search(r"^test:", makefile, re.M)
    assert "make test" in (REPO / ".ci/run").read_text()


def test_every_example_is_listed_and_every_listed_file_exists():
    named = set(re.findall(r"`((?:examples|docs|charts|operator|trainer_images|scripts)/[\w./-]+)`", README))
    for path in named:
        assert (REPO / path).exists(), path
    for example in (REPO / "examples").glob("*.yaml"):
        assert f"`examples/{example.name}`" in README, example.name


def test_every_trainop_verb_is_documented():
    verbs = build_parser()._subparsers._group_actions[0].choices
    table = README.split("## The `trainop` command")[1].split("\n## ")[0]
    for verb in verbs:
        assert f"`trainop {verb}" in table, verb
