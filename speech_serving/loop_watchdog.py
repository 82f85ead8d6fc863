"""Reports an event loop that stopped turning, with every thread's stack: a model process whose loop is stuck
serves no request and answers no deadline of its own (its timeouts run on that loop), so without this it fails
silently.

Each python model process runs its requests on one asyncio loop. A heartbeat on the loop marks the time every
`period_s`; a thread of its own checks the mark and, once it is older than `stuck_s`, reports the loop stuck, once
per episode, with the stack of every thread (where the loop's thread is blocked, and what the others do), and
reports again when the loop turns again.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import threading
import time
import traceback
from typing import Callable, Optional

logger = logging.getLogger(__name__)

#: A loop turns every few milliseconds under load; seconds without a turn is a blocked loop, not a busy one.
STUCK_S = 10.0


def thread_stacks(skip: Optional[int] = None) -> str:
    """Every thread's stack but `skip`'s (a thread id), innermost call last; threads with the same stack (a pool's
    idle workers) once, with all their names."""
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    by_stack: dict[str, list[str]] = {}
    for ident, frame in sys._current_frames().items():
        if ident != skip:
            by_stack.setdefault("".join(traceback.format_stack(frame)), []).append(str(names.get(ident, ident)))
    return "\n".join(f"{len(who)} thread(s) {', '.join(sorted(who))}:\n{stack}" for stack, who in by_stack.items())


class LoopWatchdog:
    """`start(loop)` from a coroutine on the loop to watch (again for another loop: the old watch stops)."""

    def __init__(self, name: str = "model", stuck_s: float = STUCK_S, period_s: float = 1.0,
                 report: Callable[[str], None] = logger.error) -> None:
        self.name, self.stuck_s, self.period_s, self.report = name, stuck_s, period_s, report
        self.stalls = 0  # episodes reported
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._beat = time.monotonic()

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._loop is loop:
            return
        self._loop, self._beat = loop, time.monotonic()
        loop.call_soon(self._tick, loop)
        threading.Thread(target=self._watch, args=(loop,), name=f"loop-watchdog-{self.name}", daemon=True).start()

    def _tick(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._loop is not loop:
            return
        self._beat = time.monotonic()
        loop.call_later(self.period_s, self._tick, loop)

    def _watch(self, loop: asyncio.AbstractEventLoop) -> None:
        stuck_since: Optional[float] = None
        while self._loop is loop and not loop.is_closed():
            time.sleep(self.period_s / 2)
            now = time.monotonic()
            late = now - self._beat
            if stuck_since is None and late > self.stuck_s:
                stuck_since = self._beat
                self.stalls += 1
                self.report(f"{self.name}: event loop stuck for {late:.1f} s (no request is served and no deadline "
                            f"fires while it is); threads:\n{thread_stacks(skip=threading.get_ident())}")
            elif stuck_since is not None and late <= self.stuck_s:
                self.report(f"{self.name}: event loop turning again after {now - stuck_since:.1f} s")
                stuck_since = None
