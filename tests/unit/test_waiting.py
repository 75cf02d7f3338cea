"""tests/fixtures/waiting.py: the long waits it records for the end-of-run summary (conftest.py)."""

from __future__ import annotations

import pytest

from tests.fixtures import waiting


def test_a_long_wait_is_recorded_with_what_and_the_test_and_a_short_one_is_not(monkeypatch):
    monkeypatch.setattr(waiting, "LONG_WAITS", [])
    answers = iter([None, None, "done"])
    monkeypatch.setattr(waiting, "LONG_WAIT_SECONDS", 0.0)
    assert waiting.wait_until(lambda: next(answers), interval=0, what="the third answer") == "done"
    ((took, what, test),) = waiting.LONG_WAITS
    assert what == "the third answer" and took >= 0
    assert test == "tests/unit/test_waiting.py::" \
                   "test_a_long_wait_is_recorded_with_what_and_the_test_and_a_short_one_is_not"

    monkeypatch.setattr(waiting, "LONG_WAIT_SECONDS", 60.0)
    waiting.wait_until(lambda: True, what="at once")
    assert len(waiting.LONG_WAITS) == 1


def test_a_wait_that_times_out_names_what_and_the_last_value():
    with pytest.raises(AssertionError, match=r"timed out after 0s waiting for nothing \(last value: 0\)"):
        waiting.wait_until(lambda: 0, timeout=0, what="nothing")
