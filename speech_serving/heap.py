"""The Python heap of a serving process: frozen once the process has loaded what it serves, and every pause of
its garbage collector counted.

Why freeze: CPython's full (generation 2) collection walks every container object the process tracks, holding
the GIL, so every thread of the process - the LLM scheduler, the token2wav worker, the serving loop - stops
until it ends. A loaded model process tracks hundreds of thousands of objects (the released CosyVoice2 engine
alone, loaded on a CPU: ~254,000, one full collection 80-90 ms), nearly all of them made while loading and alive
until the process ends; a collection during a busy level delays the next chunk of every stream by that long.
`gc.freeze()` moves every object alive at that point into a permanent generation that no collection walks: later
full collections walk only what serving made since. Objects frozen are still freed by reference counting; only
a reference cycle among them that becomes garbage later is never collected (nothing loaded at start is expected
to become garbage).
"""

from __future__ import annotations

import gc
import threading
import time
from collections import deque

from speech_serving.stats import Stats

#: The counters of a process's collections (`GcPauses`): every generation's, and the full ones among them.
GC_STATS = (
    "python_gc_collections_total",
    "python_gc_seconds_total",
    "python_gc_full_collections_total",
    "python_gc_full_seconds_total",
    "python_gc_frozen_objects",  # objects `freeze_heap` put out of every collection's reach
)
#: The oldest generation: its collections walk every tracked object that is not frozen.
FULL_GENERATION = 2
#: Seconds between two hand-overs of counted pauses to the stats (`GcPauses`).
FLUSH_PERIOD_S = 0.25


def freeze_heap(stats: Stats | None = None) -> int:
    """Collect what is garbage now, then freeze every object left; returns how many are frozen (in all, with any
    frozen before). Call once the process has loaded everything it serves."""
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    if stats is not None:
        stats.set("python_gc_frozen_objects", frozen)
    return frozen


class GcPauses:
    """Counts this process's collections and the time each takes (`gc.callbacks`) into `stats` (`GC_STATS`).

    A collection starts on whichever thread allocates at that moment, possibly inside a `Stats` update that holds
    the stats' lock: the callback therefore takes no lock, it only appends to a deque (atomic under the GIL), and a
    thread of its own hands the counts to the stats every `FLUSH_PERIOD_S`."""

    def __init__(self, stats: Stats | None = None, period_s: float = FLUSH_PERIOD_S) -> None:
        self.stats = stats if stats is not None else Stats(GC_STATS)
        self.period_s = period_s
        self._pauses: deque[tuple[int, float]] = deque()  # (generation, seconds) not yet in the stats
        self._started = 0.0
        self._installed = False
        self._stop = threading.Event()

    def install(self) -> GcPauses:
        """Start counting (once; again is a no-op)."""
        if not self._installed:
            self._installed = True
            self._stop = threading.Event()  # the flusher of an earlier install has its own
            gc.callbacks.append(self._on_gc)
            threading.Thread(target=self._flush_forever, args=(self._stop,), name="gc-pauses", daemon=True).start()
        return self

    def uninstall(self) -> None:
        """Stop counting and hand over what was counted."""
        if self._installed:
            self._installed = False
            gc.callbacks.remove(self._on_gc)
            self._stop.set()
            self.flush()

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        # runs inside the collection, on the thread that set it off: no locks, no waiting
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self._pauses.append((info["generation"], time.perf_counter() - self._started))

    def flush(self) -> None:
        """Hand the pauses counted since the last flush to the stats, all at once."""
        count = full = 0
        seconds = full_seconds = 0.0
        while self._pauses:
            generation, pause = self._pauses.popleft()
            count += 1
            seconds += pause
            if generation == FULL_GENERATION:
                full += 1
                full_seconds += pause
        if count:
            self.stats.add_all({"python_gc_collections_total": count, "python_gc_seconds_total": seconds,
                                "python_gc_full_collections_total": full,
                                "python_gc_full_seconds_total": full_seconds})  # fmt: skip

    def _flush_forever(self, stop: threading.Event) -> None:
        while not stop.wait(self.period_s):
            self.flush()
