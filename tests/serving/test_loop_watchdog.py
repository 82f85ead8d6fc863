"""The event-loop watchdog: a loop blocked past the limit is reported once, with the blocking call in the stacks,
and again when it turns; a loop that keeps turning is never reported."""

from __future__ import annotations

import asyncio
import time

from speech_serving.loop_watchdog import LoopWatchdog


def blocking_call_for_the_watchdog_test(seconds: float) -> None:
    time.sleep(seconds)  # what a synchronous round trip to tritonserver does to the loop


async def test_a_blocked_loop_is_reported_with_where_it_is_blocked() -> None:
    reports: list[str] = []
    watchdog = LoopWatchdog("orchestrator", stuck_s=0.2, period_s=0.05, report=reports.append)
    watchdog.start(asyncio.get_running_loop())
    await asyncio.sleep(0.1)
    blocking_call_for_the_watchdog_test(0.6)
    await asyncio.sleep(0.3)
    assert watchdog.stalls == 1 and len(reports) == 2
    assert "orchestrator: event loop stuck" in reports[0]
    assert "blocking_call_for_the_watchdog_test" in reports[0]  # the loop thread's stack
    assert "turning again" in reports[1]


async def test_a_turning_loop_is_not_reported() -> None:
    reports: list[str] = []
    watchdog = LoopWatchdog("engine", stuck_s=0.2, period_s=0.05, report=reports.append)
    watchdog.start(asyncio.get_running_loop())
    for _ in range(20):
        blocking_call_for_the_watchdog_test(0.02)  # short blocks: a busy loop, not a stuck one
        await asyncio.sleep(0.01)
    assert reports == [] and watchdog.stalls == 0


def test_threads_with_one_stack_are_listed_once() -> None:
    import threading

    from speech_serving.loop_watchdog import thread_stacks

    release = threading.Event()
    workers = [threading.Thread(target=release.wait, name=f"idle-{i}") for i in range(5)]
    for worker in workers:
        worker.start()
    try:
        stacks = thread_stacks()
    finally:
        release.set()
        for worker in workers:
            worker.join()
    assert "5 thread(s) idle-0, idle-1, idle-2, idle-3, idle-4:" in stacks
