"""The stack's pace second by second while the levels run.

A level's stage table holds means over the whole level, which hide a stack that runs well for most of a level and
then slows down as a whole for a while (steps of the LLM and token2wav calls several times slower, streams
stalled for many seconds). `MetricsTimeline` reads the servers' counters once a period in a thread of its own,
with the GPUs' used memory beside them, so that each level also reports its slowest period (`slowest`) and the
results directory keeps every tick (`timeline.json`) to line such a phase up with memory and the counters.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

#: Seconds between two readings.
TIMELINE_PERIOD_S = 1.0

#: The counters a tick keeps (the stage table's names, without the `cosyvoice2_` prefix).
TIMELINE_STATS = (
    "llm_steps_total",
    "llm_step_seconds_total",
    "token2wav_engine_calls_total",
    "token2wav_engine_seconds_total",
    "token2wav_call_jobs_total",
    "token2wav_flow_cache_refused_total",
    "token2wav_cuda_alloc_retries_total",
    "python_gc_seconds_total",
    "token2wav_active_streams",
    "orchestrator_active_requests",
)

#: (slowest-period key, numerator counter, denominator counter): the period's mean of one thing, in ms.
PACES = (
    ("llm_step_ms_slowest", "llm_step_seconds_total", "llm_steps_total"),
    ("token2wav_call_ms_slowest", "token2wav_engine_seconds_total", "token2wav_engine_calls_total"),
)


@dataclass(frozen=True)
class Tick:
    at: float  # wall-clock time (time.time(), like the levels' windows)
    counters: dict[str, float]
    gpu_used: list[int] | None  # bytes per visible GPU; None when not read


class MetricsTimeline:
    """`read()` (the machine's counters, every replica added up) and `memory()` (bytes used per GPU, or None) every
    `period_s` seconds from `start` to `stop`. A failed reading is a missing tick."""

    def __init__(self, read: Callable[[], dict[str, float]],
                 memory: Callable[[], list[int] | None] | None = None,
                 period_s: float = TIMELINE_PERIOD_S,
                 on_tick: Callable[[Tick, Tick], None] | None = None) -> None:  # fmt: skip
        """`on_tick(previous, latest)` after each tick but the first (e.g. `stackbench.stacks.SlowStacks`)."""
        self.read = read
        self.memory = memory
        self.period_s = period_s
        self.on_tick = on_tick
        self.ticks: list[Tick] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> MetricsTimeline:
        self._thread = threading.Thread(target=self._run, name="metrics-timeline", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5 * self.period_s + 5)

    def _run(self) -> None:
        while True:
            self.sample()
            if self._stop.wait(self.period_s):
                return

    def sample(self) -> None:
        """One tick now (the thread's loop; tests call it directly)."""
        try:
            counters = self.read()
        except Exception:  # noqa: BLE001 - a server busy or restarting: this tick is missing, the run goes on
            return
        self.ticks.append(Tick(time.time(), {k: counters[k] for k in TIMELINE_STATS if k in counters},
                               self.memory() if self.memory is not None else None))
        if self.on_tick is not None and len(self.ticks) > 1:
            try:
                self.on_tick(self.ticks[-2], self.ticks[-1])
            except Exception:  # noqa: BLE001 - an observer's failure must not stop the timeline
                pass

    def slowest(self, window: Sequence[float] | None) -> dict[str, float | None]:
        """Per `PACES` entry, the largest mean (ms) of one period inside ``window`` (start, end) among the periods
        that did any of that work; None where no period did (or without a window)."""
        out: dict[str, float | None] = {key: None for key, _, _ in PACES}
        if not window:
            return out
        inside = [tick for tick in self.ticks if window[0] <= tick.at <= window[1]]
        for before, after in zip(inside, inside[1:]):
            for key, num, den in PACES:
                done = after.counters.get(den, 0.0) - before.counters.get(den, 0.0)
                if done > 0:
                    pace = 1000.0 * (after.counters.get(num, 0.0) - before.counters.get(num, 0.0)) / done
                    out[key] = pace if out[key] is None else max(out[key], pace)  # type: ignore[type-var]
        return out

    def to_json(self) -> list[dict[str, Any]]:
        return [{"at": round(t.at, 3), **t.counters, "gpu_used": t.gpu_used} for t in self.ticks]
