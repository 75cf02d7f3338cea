# Fixture modules shared by every test folder (see docs/DEVELOPING.md).
pytest_plugins = [
    "tests.fixtures.cluster",
    "tests.fixtures.azurite",
]


def pytest_terminal_summary(terminalreporter):
    """The 20 longest condition waits of the run (tests/fixtures/waiting.py), after --durations:
    where a test's time went while it waited on the cluster rather than computed."""
    from tests.fixtures.waiting import LONG_WAIT_SECONDS, LONG_WAITS

    if LONG_WAITS:
        terminalreporter.write_sep("=", f"longest condition waits ({len(LONG_WAITS)} of {LONG_WAIT_SECONDS:g} s or more)")
        for took, what, test in sorted(LONG_WAITS, reverse=True)[:20]:
            # one line each: some callers put a whole object's status into `what`
            terminalreporter.write_line(f"{took:7.1f}s  {what[:100]}  [{test}]")
