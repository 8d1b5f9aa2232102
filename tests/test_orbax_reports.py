"""The filters that keep Orbax's and Tensorstore's after-the-fact reports from printing around
jaxtrain's one-line checkpoint error, fed the real exception a closed asyncio loop raises."""

import asyncio
import logging
import sys
import types

import pytest

from jaxtrain.checkpointing.quiet import quiet_orbax


def closed_loop_report() -> types.SimpleNamespace:
    """What Tensorstore's thread hands sys.unraisablehook when a future completes late."""
    loop = asyncio.new_event_loop()
    loop.close()
    try:
        loop.call_soon_threadsafe(lambda: None)
    except RuntimeError as err:
        return types.SimpleNamespace(
            exc_type=RuntimeError, exc_value=err, exc_traceback=err.__traceback__,
            err_msg=None, object=None,
        )  # fmt: skip
    raise AssertionError("a closed loop accepted a callback")


@pytest.fixture
def recorded_unraisable(monkeypatch):
    seen = []
    monkeypatch.setattr(sys, "unraisablehook", seen.append)
    quiet_orbax()
    return seen


def test_the_closed_loop_report_is_dropped_and_others_still_reach_the_hook(recorded_unraisable):
    sys.unraisablehook(closed_loop_report())
    assert recorded_unraisable == []
    other = ValueError("a real problem")
    report = types.SimpleNamespace(
        exc_type=ValueError, exc_value=other, exc_traceback=None, err_msg=None, object=None
    )
    sys.unraisablehook(report)
    assert recorded_unraisable == [report]


def test_installing_twice_wraps_the_hook_once(recorded_unraisable):
    hook = sys.unraisablehook
    quiet_orbax()
    assert sys.unraisablehook is hook


def test_unretrieved_orbax_task_errors_are_not_logged_but_other_tasks_are(caplog):
    quiet_orbax()
    asyncio_logger = logging.getLogger("asyncio")
    with caplog.at_level(logging.ERROR, logger="asyncio"):
        asyncio_logger.error(
            "Task exception was never retrieved\nfuture: <Task finished coro=<async_deserialize()"
            " defined at /site-packages/orbax/checkpoint/_src/serialization/serialization.py:394>>"
        )
        asyncio_logger.error(
            "Task exception was never retrieved\nfuture: <Task finished coro=<user_job()>>"
        )
    assert [r.getMessage().splitlines()[-1] for r in caplog.records] == [
        "future: <Task finished coro=<user_job()>>"
    ]
