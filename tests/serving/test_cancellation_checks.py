"""`run_until_cancelled`: a request's work is cancelled once the server says the client left, and asking the
server (the python backend stub's blocking `request.is_cancelled()`) never holds up the event loop that every other
request of the model runs on."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from speech_serving.orchestrator import run_until_cancelled


async def test_work_that_ends_returns_its_outcome() -> None:
    async def work() -> None:
        await asyncio.sleep(0.12)

    assert await run_until_cancelled(work, lambda: False, poll_s=0.01) is False

    async def failing() -> None:
        await asyncio.sleep(0.03)
        raise ValueError("bad input")

    with pytest.raises(ValueError, match="bad input"):
        await run_until_cancelled(failing, lambda: False, poll_s=0.01)


async def test_work_is_cancelled_once_the_client_has_left() -> None:
    left = threading.Event()
    stopped = asyncio.Event()

    async def work() -> None:
        try:
            await asyncio.sleep(30)
        finally:
            stopped.set()

    asyncio.get_running_loop().call_later(0.1, left.set)
    started = time.monotonic()
    assert await run_until_cancelled(work, left.is_set, poll_s=0.01) is True
    assert stopped.is_set() and time.monotonic() - started < 5


async def test_a_slow_answer_holds_up_no_other_request() -> None:
    """The check blocks for 0.5 s (a busy server); meanwhile the loop keeps running other requests, and work that
    ends during a check returns at once."""

    def slow_check() -> bool:
        time.sleep(0.5)
        return False

    ticks = 0

    async def other_request() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.01)
            ticks += 1

    async def work() -> None:
        await asyncio.sleep(0.3)

    ticker = asyncio.create_task(other_request())
    started = time.monotonic()
    try:
        assert await run_until_cancelled(work, slow_check, poll_s=0.01) is False
    finally:
        ticker.cancel()
    assert time.monotonic() - started < 0.45  # did not wait for the check in progress
    assert ticks >= 10  # ~30 ticks in 0.3 s; a check on the loop would have stopped them for 0.5 s
