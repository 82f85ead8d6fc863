"""stack-bench's stacks of a slow stack: py-spy dumps of the servers' processes when a second's LLM step is slow."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import time
from pathlib import Path

from stackbench.stacks import SlowStacks, frozen, step_ms
from stackbench.timeline import MetricsTimeline, Tick


def tick(at: float, steps: float, seconds: float) -> Tick:
    return Tick(at, {"llm_steps_total": steps, "llm_step_seconds_total": seconds}, None)


def fake_py_spy(tmp_path: Path) -> Path:
    """A stand-in for py-spy: prints the pid it was asked for (the real one prints its threads' stacks)."""
    script = tmp_path / "py-spy"
    script.write_text(f"#!{sys.executable}\nimport sys\nprint('Thread main (idle) of', sys.argv[-1])\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return script


def test_the_pace_of_a_period():
    assert step_ms(tick(0, 100, 0.3), tick(1, 200, 0.6)) == 3.0
    assert step_ms(tick(0, 100, 0.3), tick(1, 100, 0.3)) is None  # no step: no pace


def busy_tick(at: float, steps: float, calls: float, active: float) -> Tick:
    return Tick(at, {"llm_steps_total": steps, "llm_step_seconds_total": steps * 0.003,
                     "token2wav_engine_calls_total": calls, "orchestrator_active_requests": active}, None)


def test_a_frozen_period_is_work_in_flight_with_nothing_finished():
    assert frozen(busy_tick(0, 100, 10, 29), busy_tick(1, 100, 10, 29))
    assert not frozen(busy_tick(0, 100, 10, 29), busy_tick(1, 101, 10, 29))  # a step finished
    assert not frozen(busy_tick(0, 100, 10, 29), busy_tick(1, 100, 11, 29))  # a token2wav call finished
    assert not frozen(busy_tick(0, 100, 10, 0), busy_tick(1, 100, 10, 0))  # idle between levels
    assert not frozen(busy_tick(0, 100, 10, 0), busy_tick(1, 100, 10, 5))  # a level starting


def worker_py_spy(tmp_path: Path) -> Path:
    """A stand-in for py-spy on the engine's process: its token2wav worker thread."""
    script = tmp_path / "py-spy"
    script.write_text(f'#!{sys.executable}\nprint(\'Thread 7 (active): "token2wav"\')\n')
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return script


def test_a_frozen_second_dumps_while_it_lasts(tmp_path):
    stacks = SlowStacks(lambda: [os.getpid()], tmp_path / "stacks", threshold_ms=15.0,
                        py_spy=str(worker_py_spy(tmp_path)))
    stacks.observe(busy_tick(0, 100, 10, 29), busy_tick(1, 100, 10, 29))  # no step finishes: no pace to compare
    stacks.join()
    assert stacks.rounds == 1
    dump = (tmp_path / "stacks" / f"{time.strftime('%H%M%S', time.gmtime(1))}-{os.getpid()}.txt").read_text()
    assert dump.startswith("frozen:") and '"token2wav"' in dump


def test_a_slow_second_dumps_every_process_of_every_server_once_per_round(tmp_path):
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        stacks = SlowStacks(lambda: [os.getpid(), None], tmp_path / "stacks", threshold_ms=15.0, every_s=20.0,
                            py_spy=str(fake_py_spy(tmp_path)))
        stacks.observe(tick(0, 0, 0), tick(1, 100, 0.3))  # 3 ms: fine
        assert stacks.rounds == 0
        stacks.observe(tick(1, 100, 0.3), tick(2, 110, 0.7))  # 40 ms
        stacks.observe(tick(2, 110, 0.7), tick(3, 120, 1.1))  # still slow, within every_s: no second round
        stacks.join()
        assert stacks.rounds == 1
        dumps = sorted((tmp_path / "stacks").iterdir())
        pids = {int(d.stem.split("-")[1]) for d in dumps if not d.stem.endswith("machine")}
        assert {os.getpid(), child.pid} <= pids  # the server and its descendants
        text = next(d for d in dumps if not d.stem.endswith("machine")).read_text()
        assert text.startswith("LLM step 40.0 ms") and "Thread main" in text
        assert (tmp_path / "stacks" / f"{dumps[0].stem.split('-')[0]}-machine.txt").read_text().count("== ") == 3
        stacks.observe(tick(22, 120, 1.1), tick(23, 130, 1.5))  # a later round
        stacks.join()
        assert stacks.rounds == 2
    finally:
        child.kill()
        child.wait()


def test_without_py_spy_nothing_is_dumped_and_the_timeline_goes_on(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no py-spy anywhere
    stacks = SlowStacks(lambda: [os.getpid()], tmp_path / "stacks", threshold_ms=1.0)
    assert stacks.py_spy is None
    totals = iter(range(1, 100))

    def read() -> dict[str, float]:
        n = next(totals)
        return {"llm_steps_total": float(n), "llm_step_seconds_total": float(n)}  # 1 s per step: slow

    timeline = MetricsTimeline(read, on_tick=stacks.observe)
    for _ in range(3):
        timeline.sample()
        time.sleep(0.002)
    assert len(timeline.ticks) == 3 and stacks.rounds == 0 and not (tmp_path / "stacks").exists()
