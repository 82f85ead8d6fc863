"""Stacks of the servers' model processes, taken while the stack is slow (`--stacks-when-slow MS`).

A stack that slows down as a whole for a while (LLM steps several times their usual time) is gone by the time a
person looks. `SlowStacks` watches the timeline's ticks (`stackbench.timeline`) for two things: a period whose mean
LLM step is above the threshold, and a **frozen** period (requests in flight, yet neither an LLM step nor a
token2wav call finished: the slow phase seen on H100s is a freeze of tens of seconds, and a step that takes that
long is only counted once it ends, too late for the first trigger). Then it runs `py-spy dump --native` (Python and
C frames: what a thread waits for inside CUDA or the driver) on every process of every tritonserver (the python
stubs hold the models), in a thread of its own so the timeline keeps ticking, at most once per `every_s`, and keeps
the machine's state beside them (`nvidia-smi -q` performance and clocks, the host's memory and pressure). Each
dump is a text file under the results directory, named by the time and the process, with the reason in its first
line. No debugger attaches: `cuda-gdb` asked for the kernels of frozen processes (none ran) and killed three of
the four frozen servers it attached to on four H200s (docs/experiments/2026-11-28-replica-freeze-cause.md).
"""

from __future__ import annotations

import shutil
import subprocess
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from stackbench.timeline import Tick
from triton_repo.server import process_tree

#: Seconds between two rounds of dumps (one slow phase gives a few, not one per second).
DUMP_EVERY_S = 20.0
#: A dump that has not finished by then is given up (py-spy waits on a process that does not answer).
DUMP_TIMEOUT_S = 30.0


#: What the machine's state file holds: (title, command).
MACHINE_STATE = (
    ("GPU performance and clocks", ["nvidia-smi", "-q", "-d", "PERFORMANCE,CLOCK,MEMORY,TEMPERATURE,POWER"]),
    ("host memory", ["cat", "/proc/meminfo"]),
    ("host pressure", ["sh", "-c", "grep . /proc/pressure/* 2>/dev/null; vmstat 1 2 2>/dev/null"]),
)


def frozen(before: Tick, after: Tick) -> bool:
    """Requests were in flight through the period, yet no LLM step and no token2wav call finished in it."""
    def done(name: str) -> float:
        return after.counters.get(name, 0.0) - before.counters.get(name, 0.0)

    busy = min(before.counters.get("orchestrator_active_requests", 0.0),
               after.counters.get("orchestrator_active_requests", 0.0)) > 0
    return busy and done("llm_steps_total") <= 0 and done("token2wav_engine_calls_total") <= 0


def step_ms(before: Tick, after: Tick) -> float | None:
    """The mean LLM step (ms) between two ticks; None when no step ran."""
    steps = after.counters.get("llm_steps_total", 0.0) - before.counters.get("llm_steps_total", 0.0)
    if steps <= 0:
        return None
    seconds = after.counters.get("llm_step_seconds_total", 0.0) - before.counters.get("llm_step_seconds_total", 0.0)
    return 1000.0 * seconds / steps


class SlowStacks:
    """`observe(before, after)` after each tick; dumps land in `out_dir` (created on the first one)."""

    def __init__(self, server_pids: Callable[[], Iterable[int | None]], out_dir: Path, threshold_ms: float,
                 every_s: float = DUMP_EVERY_S, py_spy: str | None = None) -> None:  # fmt: skip
        self.server_pids = server_pids
        self.out_dir = out_dir
        self.threshold_ms = threshold_ms
        self.every_s = every_s
        self.py_spy = py_spy or shutil.which("py-spy")
        self.rounds = 0
        self._last: float | None = None
        self._threads: list[threading.Thread] = []

    def observe(self, before: Tick, after: Tick) -> None:
        if self.py_spy is None:
            return
        pace = step_ms(before, after)
        stuck = frozen(before, after)
        if stuck:
            reason = (f"frozen: requests in flight, no LLM step and no token2wav call finished in "
                      f"{after.at - before.at:.1f} s")
        elif pace is not None and pace > self.threshold_ms:
            reason = f"LLM step {pace:.1f} ms in that second"
        else:
            return
        if self._last is not None and after.at - self._last < self.every_s:
            return
        self._last = after.at
        self.rounds += 1
        pids = sorted({p for server in self.server_pids() if server is not None for p in process_tree(server)})
        thread = threading.Thread(target=self._dump, args=(pids, after.at, reason), name="slow-stacks",
                                  daemon=True)
        self._threads.append(thread)
        thread.start()

    def _dump(self, pids: list[int], at: float, reason: str) -> None:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        stamp = time.strftime("%H%M%S", time.gmtime(at))
        for pid in pids:
            text = run_text([self.py_spy, "dump", "--native", "--pid", str(pid)])
            if "Thread " not in text:  # no stacks: native unwinding failed here, the Python frames alone
                text += run_text([self.py_spy, "dump", "--pid", str(pid)])
            (self.out_dir / f"{stamp}-{pid}.txt").write_text(f"{reason}\n{text}")
        state = [f"{reason}\n"] + [f"== {title}\n{run_text(command)}" for title, command in MACHINE_STATE]
        (self.out_dir / f"{stamp}-machine.txt").write_text("\n".join(state))

    def join(self, timeout_s: float = DUMP_TIMEOUT_S) -> None:
        """Wait for the dumps still running (the end of a run)."""
        for thread in self._threads:
            thread.join(timeout_s)


def run_text(command: list[str]) -> str:
    """What `command` printed (stdout, then stderr), or why it could not run."""
    try:
        run = subprocess.run(command, capture_output=True, text=True, timeout=DUMP_TIMEOUT_S, check=False)  # noqa: S603
        return run.stdout + run.stderr
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{command[0]} failed: {exc}\n"
