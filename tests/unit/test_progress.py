"""progress.py: the progress math, the ETA text and the terminal chart (pure)."""

import datetime as dt

from trainop import progress
from trainop.render import logship

NOW = dt.datetime(2026, 11, 26, 12, 0, 0, tzinfo=dt.UTC)
T = NOW.timestamp()


def test_percent_seconds_left_and_eta_at_the_reports_pace():
    shown = progress.compute({"step": 250, "totalSteps": 1000, "stepTime": 0.4, "imagesPerSec": 640.123,
                              "time": T, "final": False}, running=True)
    assert shown == {"step": 250, "totalSteps": 1000, "percent": 25.0, "imagesPerSec": 640.12,
                     "secondsPerStep": 0.4, "reportTime": "2026-11-26T12:00:00Z", "secondsLeft": 300,
                     "eta": "2026-11-26T12:05:00Z"}
    assert progress.compute({"step": 1, "totalSteps": 3}, running=True) == \
        {"step": 1, "totalSteps": 3, "percent": 33.3}


def test_no_eta_unless_running_and_unfinished():
    report = {"step": 1000, "totalSteps": 1000, "stepTime": 0.4, "time": T, "final": True}
    assert progress.compute(report, running=True)["percent"] == 100.0
    assert "eta" not in progress.compute(report, running=True)
    assert "eta" not in progress.compute({**report, "step": 10, "final": False}, running=False)
    assert progress.compute({}, running=True) is None and progress.compute(None, running=True) is None


def test_an_eta_beyond_a_year_or_from_an_implausible_clock_is_left_out():
    far = progress.compute({"step": 0, "totalSteps": 10 ** 9, "stepTime": 1.0, "time": T}, running=True)
    assert "eta" not in far and "secondsLeft" not in far
    old_clock = progress.compute({"step": 5, "totalSteps": 10, "stepTime": 1.0, "time": 86400.0}, running=True)
    assert "eta" not in old_clock and "reportTime" not in old_clock and old_clock["secondsLeft"] == 5


def test_texts_for_get():
    assert progress.percent_text({"percent": 42.6}) == "43%"
    assert progress.percent_text(None) == "-"
    eta = {"eta": "2026-11-26T13:05:30Z"}
    assert progress.eta_text(eta, NOW) == "1h05m"
    assert progress.eta_text({"eta": "2026-11-26T12:00:45Z"}, NOW) == "45s"
    assert progress.eta_text({"eta": "2026-11-26T11:00:00Z"}, NOW) == "due"
    assert progress.eta_text({"eta": "soon"}, NOW) == "-"
    assert progress.eta_text({}, NOW) == "-"
    assert [progress.duration(s) for s in (0, 59, 61, 3599, 3600, 90061)] == ["0s", "59s", "1m01s", "59m59s",
                                                                               "1h00m", "1d01h"]


def test_chart_draws_bars_from_zero_in_eighths():
    samples = [[T + 60 * i, 100 * (i + 1), v] for i, v in enumerate([1000.0, 500.0, 0.0, 250.0])]
    assert progress.chart(samples, height=2) == [
        "images/sec over the last 4 report(s): latest 250.0 at step 400, peak 1000.0",
        "1000.0 ┤█   ",  # two rows of 8 eighths each: 1000 fills both, 500 the lower one, 250 half of it
        "     0 ┤██ ▄",
        "       └────",
        "        12:00:00 … 12:03:00 UTC",
    ]
    assert progress.chart([]) == []
    one = progress.chart([[T, 5, 0.0]], height=1)
    assert one[1:] == ["1.0 ┤ ", "    └─", "     12:00:00 UTC"]  # all zero: no division by zero


def test_history_is_the_last_60_finite_reports_and_is_checked_when_read():
    reports = [{"time": T + i, "step": i, "imagesPerSec": float(i), "final": False} for i in range(70)]
    reports += [{"time": T + 99, "step": 70, "imagesPerSec": 1.0, "final": True},  # the run's average
                {"time": T + 98, "step": 69, "imagesPerSec": "NaN"}]
    samples = logship.history_samples(reports)
    assert len(samples) == logship.HISTORY_SAMPLES and samples[0] == [T + 10, 10, 10.0] and samples[-1][1] == 69

    def cm(text):
        return {"data": {logship.HISTORY_KEY: text}}
    assert logship.progress_history(cm('[[1.0, 2, 3.5], [1, -2, 3], ["x", 2, 3], [1, 2], [1, 2, true], 7]')) == \
        [[1.0, 2, 3.5]]
    assert logship.progress_history(cm("not json")) == []
    assert logship.progress_history(cm('{"a": 1}')) == []
    assert logship.progress_history(cm("[" + ",".join(["[1,2,3]"] * 2000) + "]")) == []  # too long to read
    assert logship.progress_history(None) == []
