"""logfilter.RetryNoise: kopf's per-attempt retry ERRORs become one WARNING per window (with the
count held back); anything else, kopf's "escalating" ERROR included, passes unchanged."""

import logging

from trainop.logfilter import RetryNoise


def record(msg: str, level: int = logging.ERROR, name: str = "kopf._cogs.clients.watching") -> logging.LogRecord:
    return logging.LogRecord(name, level, __file__, 1, msg, (), None)


def test_retries_become_one_warning_per_window():
    now = [100.0]
    noise = RetryNoise(window=30, clock=lambda: now[0])
    first = record("Request attempt #1/9 failed; will retry: GET /api/v1/pods -> ConnectionRefusedError()")
    assert noise.filter(first) and first.levelno == logging.WARNING and first.levelname == "WARNING"
    assert "0 such lines held back" in first.getMessage() and "GET /api/v1/pods" in first.getMessage()
    assert not any(noise.filter(record(f"Request attempt #{i}/9 failed; will retry: x")) for i in range(2, 6))
    now[0] += 31
    later = record("Request attempt #6/9 failed; will retry: y")
    assert noise.filter(later) and later.levelno == logging.WARNING and "4 such lines held back" in later.getMessage()


def test_other_lines_pass_unchanged():
    noise = RetryNoise(window=30, clock=lambda: 0.0)
    for rec in (record("Request attempt #9/9 failed; escalating: GET x -> boom"),
                record("Request attempt #1/9 failed; will retry: x", name="trainop.controller"),
                record("Request attempt #1/9 failed; will retry: x", level=logging.WARNING),
                record("something else")):
        level = rec.levelno
        assert noise.filter(rec) and rec.levelno == level


def test_the_controller_calls_an_unreachable_api_server_transient_and_a_refusal_not():
    import urllib3
    from kubernetes.client.exceptions import ApiException

    from trainop.controller import _transient
    assert _transient(urllib3.exceptions.ProtocolError("Connection aborted."))
    assert _transient(ConnectionRefusedError()) and _transient(TimeoutError())
    assert _transient(ApiException(status=503)) and _transient(ApiException(status=429))
    assert _transient(ApiException(status=0))
    assert not _transient(ApiException(status=422)) and not _transient(ApiException(status=403))
    assert not _transient(KeyError("a bug"))
