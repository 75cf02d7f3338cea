"""Kubernetes-style status conditions (API conventions: type, status "True"/"False"/"Unknown",
CamelCase reason, human message, lastTransitionTime, observedGeneration).

Pure functions over the list found in `status.conditions`; they never mutate their input:

    conds = set_condition(status.get("conditions", []), "Ready", True, "CopyComplete",
                          "copied 12 files", generation=meta["generation"])
    if is_true(conds, "Ready"): ...

lastTransitionTime changes only when `status` flips, so a reconcile that re-asserts the same
state writes an identical list (and the caller can skip the status write).
"""

from __future__ import annotations

import datetime as _dt


def now() -> str:
    """RFC 3339 UTC timestamp, second precision, as the API server writes them."""
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_time(value: str) -> _dt.datetime:
    return _dt.datetime.strptime(value, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=_dt.timezone.utc)


def _status_str(status: bool | str) -> str:
    if isinstance(status, bool):
        return "True" if status else "False"
    if status not in ("True", "False", "Unknown"):
        raise ValueError(f"condition status must be True, False or Unknown, not {status!r}")
    return status


def get_condition(conditions: list[dict] | None, type_: str) -> dict | None:
    return next((c for c in conditions or [] if c.get("type") == type_), None)


def is_true(conditions: list[dict] | None, type_: str) -> bool:
    cond = get_condition(conditions, type_)
    return cond is not None and cond.get("status") == "True"


def set_condition(conditions: list[dict] | None, type_: str, status: bool | str, reason: str,
                  message: str, *, generation: int | None = None,
                  timestamp: str | None = None) -> list[dict]:
    """Return a copy of `conditions` with `type_` set; keeps lastTransitionTime unless the
    status changes."""
    status_s = _status_str(status)
    old = get_condition(conditions, type_)
    transition = (old or {}).get("lastTransitionTime") if old and old.get("status") == status_s \
        else None
    new = {"type": type_, "status": status_s, "reason": reason, "message": message,
           "lastTransitionTime": transition or timestamp or now()}
    if generation is not None:
        new["observedGeneration"] = generation
    out = [new if c.get("type") == type_ else dict(c) for c in conditions or []]
    if old is None:
        out.append(new)
    return out

