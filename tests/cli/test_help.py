"""Every `trainop` verb's `--help` says what the verb does.

The verbs are read from the parser that `trainop` itself builds (cli.build_parser), walking every
level of sub-commands (`devcluster up`, ...), so a verb added later is checked without editing
this file. A description must be there, be a complete sentence (not the first line of a
developer docstring cut off mid-sentence, as `trainop --help` once printed), differ from every
other verb's, and be what `--help` really prints.
"""

import argparse
import re
import subprocess
import sys

import pytest

from trainop import cli


def _verbs(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    """(path, parser) of the command and of every sub-command under it. argparse has no public
    way to list sub-parsers; its _SubParsersAction.choices is what `parse_args` itself uses."""
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _verbs(sub, (*path, name))


VERBS = dict(_verbs(cli.build_parser()))


def _words(text: str) -> str:
    return " ".join(text.split())


def _complete(text: str) -> bool:
    """A whole sentence or paragraph: ends like one, with every bracket and backquote closed."""
    return bool(re.search(r"[.!?]['\")`]*$", text)) and text.count("(") == text.count(")") \
        and text.count("`") % 2 == 0


def test_the_walk_finds_every_verb_and_sub_command():
    # a guard on the walk itself, so the checks below are not vacuous
    assert {"run", "submit", "get", "describe", "delete", "logs", "quota", "tensorboard",
            "operator", "devcluster", "convert"} <= {path[0] for path in VERBS if path}
    assert ("devcluster", "images") in VERBS


@pytest.mark.parametrize("path", list(VERBS), ids=lambda p: " ".join(("trainop", *p)))
def test_each_verb_has_a_description_that_help_prints(path, capsys):
    description = (VERBS[path].description or "").strip()
    name = " ".join(("trainop", *path))
    assert len(description.split()) >= 5, f"`{name} --help` has no description"
    assert _complete(description), f"`{name} --help`'s description is cut off: {description!r}"
    with pytest.raises(SystemExit) as done:
        cli.main([*path, "--help"])
    assert done.value.code == 0
    assert _words(description) in _words(capsys.readouterr().out)


def test_no_two_verbs_share_a_description():
    seen: dict[str, str] = {}
    for path, parser in VERBS.items():
        text = _words(parser.description or "")
        assert text not in seen, f"trainop {' '.join(path)} and trainop {seen[text]} say the same"
        seen[text] = " ".join(path)


@pytest.mark.parametrize("path", list(VERBS), ids=lambda p: " ".join(("trainop", *p)))
def test_every_listed_verb_and_every_option_says_what_it_is(path):
    """The one-line summaries that a parent's --help lists, and each argument's help."""
    for action in VERBS[path]._actions:
        if isinstance(action, argparse._SubParsersAction):
            for choice in action._choices_actions:
                assert (choice.help or "").strip(), f"trainop {' '.join(path)}: {choice.dest} has no summary"
        elif not isinstance(action, argparse._HelpAction):
            flag = "/".join(action.option_strings) or action.metavar or action.dest
            assert (action.help or "").strip(), f"trainop {' '.join(path)}: {flag} has no help"


def test_the_installed_entry_point_prints_the_description():
    """`python -m trainop --help`, as a user runs it (a process of its own, not the parser)."""
    result = subprocess.run([sys.executable, "-m", "trainop", "--help"], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert _words(cli.DESCRIPTION) in _words(result.stdout)
