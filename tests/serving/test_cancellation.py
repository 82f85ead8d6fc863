"""Client cancellation is asked about off the event loop, at a bounded rate, and reaches the request's work."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from speech_serving.cancellation import CancellationWatcher, run_until_cancelled


class Flag:
    """A request's `is_cancelled`, recording the threads that asked and how often."""

    def __init__(self) -> None:
        self.cancelled = False
        self.calls = 0
        self.threads: set[int] = set()

    def __call__(self) -> bool:
        self.calls += 1
        self.threads.add(threading.get_ident())
        return self.cancelled


def wait_until(predicate, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


def test_a_cancelled_request_is_reported_once_and_no_longer_asked_about():
    watcher = CancellationWatcher(period_s=0.01, max_checks_per_s=1000)
    flag, reported = Flag(), []
    watcher.watch(flag, lambda: reported.append(True))
    assert wait_until(lambda: flag.calls >= 2)
    assert reported == []
    flag.cancelled = True
    assert wait_until(lambda: reported == [True])
    asked = flag.calls
    time.sleep(0.1)
    assert flag.calls == asked and reported == [True] and watcher.watched() == 0


def test_an_unwatched_request_is_never_asked_again_and_unwatching_twice_is_harmless():
    watcher = CancellationWatcher(period_s=0.01, max_checks_per_s=1000)
    flag = Flag()
    unwatch = watcher.watch(flag, lambda: pytest.fail("not cancelled"))
    assert wait_until(lambda: flag.calls >= 1)
    unwatch()
    unwatch()
    asked = flag.calls
    time.sleep(0.1)
    assert flag.calls <= asked + 1  # at most the question that was under way
    assert watcher.watched() == 0


def test_questions_per_second_stay_within_the_limit_however_many_requests_are_watched():
    watcher = CancellationWatcher(period_s=0.01, max_checks_per_s=100)
    flags = [Flag() for _ in range(50)]
    unwatch = [watcher.watch(flag, lambda: None) for flag in flags]
    time.sleep(1.0)
    for stop in unwatch:
        stop()
    asked = sum(flag.calls for flag in flags)
    assert 0 < asked <= 100 * 1.0 + 10  # one second at 100 questions per second (+ the round under way)


def test_a_question_that_fails_leaves_the_request_watched_and_the_watcher_alive():
    watcher = CancellationWatcher(period_s=0.01, max_checks_per_s=1000)
    calls = []

    def broken() -> bool:
        calls.append(1)
        raise RuntimeError("stub gone")

    watcher.watch(broken, lambda: pytest.fail("not cancelled"))
    flag, reported = Flag(), []
    watcher.watch(flag, lambda: reported.append(True))
    flag.cancelled = True
    assert wait_until(lambda: reported == [True] and len(calls) >= 2)
    assert watcher.watched() == 1


async def test_work_runs_to_its_end_and_the_event_loop_never_asks():
    watcher = CancellationWatcher(period_s=0.01, max_checks_per_s=1000)
    flag = Flag()
    done = []

    async def work() -> None:
        await asyncio.sleep(0.1)
        done.append(True)

    assert await run_until_cancelled(work, flag, watcher) is False
    assert done == [True] and flag.calls >= 1
    assert threading.get_ident() not in flag.threads
    assert watcher.watched() == 0


async def test_a_cancelled_request_cancels_its_work():
    watcher = CancellationWatcher(period_s=0.01, max_checks_per_s=1000)
    flag = Flag()
    seen = []

    async def work() -> None:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            seen.append("cancelled")
            raise

    async def leave_soon() -> None:
        await asyncio.sleep(0.05)
        flag.cancelled = True

    leaving = asyncio.ensure_future(leave_soon())
    assert await asyncio.wait_for(run_until_cancelled(work, flag, watcher), 10) is True
    await leaving
    assert seen == ["cancelled"] and watcher.watched() == 0


async def test_an_error_of_the_work_is_raised():
    watcher = CancellationWatcher(period_s=0.01, max_checks_per_s=1000)

    async def work() -> None:
        raise ValueError("bad input")

    with pytest.raises(ValueError, match="bad input"):
        await run_until_cancelled(work, Flag(), watcher)
    assert watcher.watched() == 0


async def test_cancelling_the_caller_cancels_the_work_too():
    watcher = CancellationWatcher(period_s=0.01, max_checks_per_s=1000)
    seen = []

    async def work() -> None:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            seen.append("cancelled")
            raise

    caller = asyncio.ensure_future(run_until_cancelled(work, Flag(), watcher))
    await asyncio.sleep(0.05)
    caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await caller
    await asyncio.sleep(0)
    assert seen == ["cancelled"] and watcher.watched() == 0
