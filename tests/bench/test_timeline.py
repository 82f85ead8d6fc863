"""stack-bench's second-by-second pace: the slowest period of a level, from counters read while it runs."""

from __future__ import annotations

import itertools
import time

from stackbench.timeline import MetricsTimeline


def counters_of(steps: list[tuple[float, float]]):
    """A `read` that returns running totals: per call, (LLM steps done, their seconds) added to the last."""
    totals = {"llm_steps_total": 0.0, "llm_step_seconds_total": 0.0, "unrelated_total": 1.0}
    pending = iter(steps)

    def read() -> dict[str, float]:
        done, seconds = next(pending, (0.0, 0.0))
        totals["llm_steps_total"] += done
        totals["llm_step_seconds_total"] += seconds
        return dict(totals)

    return read


def test_the_slowest_period_inside_the_window_is_reported():
    # periods of 100 steps at 3 ms, one at 40 ms, then an idle one (no steps: not a pace)
    timeline = MetricsTimeline(counters_of([(0, 0), (100, 0.3), (100, 4.0), (100, 0.3), (0, 0)]))
    for _ in range(5):
        timeline.sample()
        time.sleep(0.002)  # distinct tick times, so the windows below are unambiguous
    assert [sorted(t.counters) for t in timeline.ticks[:1]] == [["llm_step_seconds_total", "llm_steps_total"]]
    window = (timeline.ticks[0].at, timeline.ticks[-1].at)
    slowest = timeline.slowest(window)
    assert abs(slowest["llm_step_ms_slowest"] - 40.0) < 1e-9
    assert slowest["token2wav_call_ms_slowest"] is None  # never counted: not 0
    # a window that leaves the slow period out
    assert abs(timeline.slowest((timeline.ticks[2].at, timeline.ticks[4].at))["llm_step_ms_slowest"] - 3.0) < 1e-9
    assert timeline.slowest(None) == {"llm_step_ms_slowest": None, "token2wav_call_ms_slowest": None}


def test_a_failed_reading_is_a_missing_tick_and_the_thread_stops():
    calls = itertools.count()

    def flaky() -> dict[str, float]:
        if next(calls) % 2:
            raise OSError("connection refused")
        return {"llm_steps_total": 1.0}

    timeline = MetricsTimeline(flaky, memory=lambda: [123], period_s=0.01).start()
    time.sleep(0.2)
    timeline.stop()
    assert timeline.ticks and all(t.gpu_used == [123] for t in timeline.ticks)
    count = len(timeline.ticks)
    time.sleep(0.05)
    assert len(timeline.ticks) == count  # stopped
    assert timeline.to_json()[0]["llm_steps_total"] == 1.0
