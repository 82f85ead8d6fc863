"""Client cancellation, watched by one thread per process instead of the event loop.

Whether a client left is known to tritonserver, and a model asks for it request by request
(`request.is_cancelled()` in the python backend): each question is a blocking round trip through tritonserver's one
stub-to-parent thread per model (the same thread carries the model's logs, metrics and the clean-up of every
finished BLS stream), after which the asking thread must win the GIL back from the stub's other threads. Asked from
the event loop for every in-flight request every 50 ms, those waits grew with the number of requests until, between
32 and 64 streams, they took the loop's whole time: every hand-over between the models waited behind them
(docs/PERFORMANCE.md, "other" at 64 streams).

So the event loop never asks. `CancellationWatcher` asks on a thread of its own, one request after another, at most
`max_checks_per_s` questions per second and a full round at most every `period_s`; when a request was cancelled it
calls that request's `on_cancel` (which hands the cancellation to the loop). With many requests in flight a
cancellation is noticed a little later (64 requests at 200 questions per second: within about a third of a
second), which costs nothing but the audio made meanwhile.

Models called only by other models of the pipeline are never cancelled through tritonserver (their callers stop
what they started explicitly: `llm_stop`, `token2wav_close`), so they are not watched at all.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from typing import Awaitable, Callable

logger = logging.getLogger(__name__)


class CancellationWatcher:
    """One thread that asks each watched request's `is_cancelled()` in turn (module docstring)."""

    def __init__(self, period_s: float = 0.1, max_checks_per_s: float = 200.0) -> None:
        if period_s <= 0 or max_checks_per_s <= 0:
            raise ValueError("period_s and max_checks_per_s must be positive")
        self.period_s = period_s
        self.check_interval_s = 1.0 / max_checks_per_s
        self._watched: dict[int, tuple[Callable[[], bool], Callable[[], None]]] = {}
        self._ids = itertools.count()
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None

    def watch(self, is_cancelled: Callable[[], bool], on_cancel: Callable[[], None]) -> Callable[[], None]:
        """Ask `is_cancelled()` from now on; the first time it is true, call `on_cancel()` (on the watcher's thread)
        and stop asking. Returns the function that stops watching (safe to call more than once)."""
        key = next(self._ids)
        with self._cond:
            self._watched[key] = (is_cancelled, on_cancel)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="cancellation-watcher", daemon=True)
                self._thread.start()
            self._cond.notify()

        def unwatch() -> None:
            with self._cond:
                self._watched.pop(key, None)

        return unwatch

    def watched(self) -> int:
        with self._cond:
            return len(self._watched)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._watched:
                    self._cond.wait()
                keys = list(self._watched)
            started = time.monotonic()
            for key in keys:
                self._check(key)
                time.sleep(self.check_interval_s)
            time.sleep(max(0.0, self.period_s - (time.monotonic() - started)))

    def _check(self, key: int) -> None:
        with self._cond:
            entry = self._watched.get(key)
        if entry is None:  # finished meanwhile
            return
        is_cancelled, on_cancel = entry
        try:
            cancelled = is_cancelled()
        except Exception:  # noqa: BLE001 - a request that cannot be asked about is treated as still wanted
            logger.debug("is_cancelled failed", exc_info=True)
            return
        if not cancelled:
            return
        with self._cond:
            if self._watched.pop(key, None) is None:
                return  # finished while we asked
        try:
            on_cancel()
        except Exception:  # noqa: BLE001 - the watcher serves every request of the process: never die
            logger.exception("cancelling a request failed")


async def run_until_cancelled(
    work: Callable[[], Awaitable[None]], is_cancelled: Callable[[], bool], watcher: CancellationWatcher
) -> bool:
    """Run `work()` and cancel it once `watcher` finds `is_cancelled()` true. Returns True if it was cancelled so;
    an error of `work` is raised (also one raised while it unwinds from the cancellation)."""
    loop = asyncio.get_running_loop()
    task = asyncio.ensure_future(work())
    cancelled = False

    def cancel_on_loop() -> None:
        nonlocal cancelled
        if not task.done():
            cancelled = True
            task.cancel()

    def on_cancel() -> None:  # the watcher's thread
        try:
            loop.call_soon_threadsafe(cancel_on_loop)
        except RuntimeError:  # the loop is closed: the model is shutting down
            pass

    unwatch = watcher.watch(is_cancelled, on_cancel)
    try:
        await asyncio.wait({task})
    except asyncio.CancelledError:  # the caller itself is being cancelled: take the work along
        task.cancel()
        raise
    finally:
        unwatch()
    if cancelled:
        if not task.cancelled():
            task.result()
        return True
    task.result()
    return False
