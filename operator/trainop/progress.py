"""Progress and ETA of a training job, for display only, and the terminal chart of its throughput.
Pure: no I/O, no clock (the caller passes `now`).

`status.progress` is derived from the trainer's latest report (`status.metrics`, already checked
by render/logship.progress_metrics): percent from step/totalSteps, seconds left from the steps
left times the report's seconds per step, and the ETA from the report's own time. Computed from
the report alone, it changes only when a new report arrives, so reconciles between reports write
nothing. Nothing the operator decides reads it (docs/security.md): a pod controls these numbers
(the stall check, jobsync/stall.py, reads the report's step itself, by the operator's clock).
"""

from __future__ import annotations

import datetime as dt
import math

# Reports whose time is outside these bounds are not believed (a pod's clock or a forged report).
_EARLIEST = dt.datetime(2020, 1, 1, tzinfo=dt.UTC).timestamp()
_LATEST = dt.datetime(2200, 1, 1, tzinfo=dt.UTC).timestamp()
MAX_SECONDS_LEFT = 366 * 86400  # an ETA more than a year away says nothing; left out


def _number(value, low: float = 0.0) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value) if value >= low else None


def _int(value, low: int = 0) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and low <= value < 2 ** 63 else None


def timestamp(seconds: float) -> str:
    """RFC 3339, UTC, whole seconds (what Kubernetes' date-time fields hold)."""
    return dt.datetime.fromtimestamp(seconds, dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def compute(metrics: dict | None, running: bool) -> dict | None:
    """`status.progress` from a checked report: `percent` (0-100, one decimal), `step`,
    `totalSteps`, `imagesPerSec`, `secondsPerStep`, `reportTime`, and while `running` and not
    final, `secondsLeft` and `eta`. Each value only when the report supports it; None when
    nothing is."""
    if not metrics:
        return None
    out: dict = {}
    step, total = _int(metrics.get("step")), _int(metrics.get("totalSteps"), 1)
    final = metrics.get("final") is True
    if step is not None:
        out["step"] = step
    if total is not None:
        out["totalSteps"] = total
    if step is not None and total is not None and step <= total:
        out["percent"] = 100.0 if final else round(100.0 * step / total, 1)
    rate = _number(metrics.get("imagesPerSec"))
    if rate is not None:
        out["imagesPerSec"] = round(rate, 2)
    per_step = _number(metrics.get("stepTime"))
    if per_step is not None and per_step > 0:
        out["secondsPerStep"] = round(per_step, 6)
    at = _number(metrics.get("time"))
    if at is not None and not _EARLIEST <= at < _LATEST:
        at = None
    if at is not None:
        out["reportTime"] = timestamp(at)
    if running and not final and "percent" in out and "secondsPerStep" in out:
        left = (total - step) * per_step
        if left <= MAX_SECONDS_LEFT:
            out["secondsLeft"] = int(round(left))
            if at is not None:
                out["eta"] = timestamp(at + left)
    return out or None


def duration(seconds: float) -> str:
    """A short human duration: 45s, 12m30s, 3h05m, 2d04h."""
    s = max(0, int(round(seconds)))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def percent_text(progress: dict | None) -> str:
    value = (progress or {}).get("percent")
    return "-" if not isinstance(value, (int, float)) else f"{value:.0f}%"


def eta_text(progress: dict | None, now: dt.datetime) -> str:
    """What is left until the ETA, as `trainop get` shows it: "1h05m", "due" once the ETA has
    passed without a newer report, "-" without an ETA."""
    eta = (progress or {}).get("eta")
    if not isinstance(eta, str):
        return "-"
    try:
        when = dt.datetime.fromisoformat(eta.replace("Z", "+00:00"))
    except ValueError:
        return "-"
    left = (when - now).total_seconds()
    return duration(left) if left >= 1 else "due"


BLOCKS = " ▁▂▃▄▅▆▇█"  # eighths of a cell


def chart(samples: list[list[float]], height: int = 6, unit: str = "images/sec") -> list[str]:
    """A bar chart of `[time, step, value]` samples (oldest first), one column per sample, bars
    from zero, `height` rows of eighth blocks, the top and zero labelled on the left, the first
    and last times below. Empty without samples."""
    if not samples:
        return []
    values = [s[2] for s in samples]
    top = max(values) or 1.0
    label_w = max(len(f"{top:.1f}"), 3)
    rows = []
    for row in range(height, 0, -1):  # top row first
        cells = []
        for v in values:
            eighths = int(round(v / top * height * 8))
            fill = eighths - (row - 1) * 8
            cells.append(BLOCKS[max(0, min(8, fill))])
        label = f"{top:.1f}" if row == height else ("0" if row == 1 else "")
        rows.append(f"{label:>{label_w}} ┤{''.join(cells)}" if label else f"{'':>{label_w}} │{''.join(cells)}")
    start, end = timestamp(samples[0][0]), timestamp(samples[-1][0])
    axis = f"{'':>{label_w}} └{'─' * len(values)}"
    span = f"{'':>{label_w}}  {start[11:19]} … {end[11:19]} UTC" if len(samples) > 1 else \
        f"{'':>{label_w}}  {start[11:19]} UTC"
    last = samples[-1]
    head = (f"{unit} over the last {len(samples)} report(s): latest {last[2]:.1f} at step {int(last[1])}, "
            f"peak {max(values):.1f}")
    return [head, *rows, axis, span]
