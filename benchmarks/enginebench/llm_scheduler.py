"""Host overhead of the continuous-batching LLM scheduler per decoder step, without any model.

    python -m enginebench.llm_scheduler [--batches 1 16 64] [--steps 1000] [--repeats 3] [--step-us 1000]

The decoder is a stub whose `step()` returns a prepared result after sleeping `--step-us` (a sleep
releases the GIL, as a GPU step does while it waits for its tokens). The time from the end of one `step()`
to the start of the next is pure host overhead: the scheduler thread's bookkeeping and hand-over of the
tokens, its stats updates (with a listener like the Triton metrics exporter's), plus any wait for the GIL
while the asyncio consumers (the adapter's role) run. The step's own overrun (its wall time beyond the
sleep, minus what a lone sleep overshoots) is the wait for the GIL when the "device" is done: what inflates a
real decode step while other threads of the process run Python. The interpreter's
switch interval is the serving processes' (`speech_serving.llm_scheduler.SWITCH_INTERVAL_S`; `--switch-interval-ms`),
and `--busy-thread` adds a thread that runs Python throughout, as token2wav's worker does beside the LLM. Every sequence of a run
joins before the first measured step and runs `--steps` steps.

Two delivery modes: `token` (a consumer wakes up for every token, as a caller without a delivery
schedule gets) and `chunk` (tokens are handed over only at the streaming schedule's boundaries, what the
orchestrator asks for; `ChunkSchedule` defaults, no prompt padding). The table gives p50/p90 of the
per-step interval in microseconds over all repeats.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import inspect
import statistics
import sys
import threading
import time
from typing import Sequence

from cosyvoice2.streaming import ChunkSchedule
from speech_serving.llm_scheduler import SWITCH_INTERVAL_S, ContinuousBatchingScheduler, StepOutput


class StubDecoder:
    """`SlotDecoder` with a trivial step: every slot emits a token; all finish together at `steps`."""

    last_step_sync_seconds = 0.0  # no device
    last_step_device_seconds = 0.0

    def __init__(self, num_slots: int, steps: int, step_s: float) -> None:
        self.num_slots = num_slots
        self.steps = steps
        self.step_s = step_s
        self.used: set[int] = set()
        self.stamps: list[tuple[int, int]] = []  # perf_counter_ns at entry and exit of every full-batch step
        self._count = 0
        self._running: dict[int, StepOutput] = {}
        self._last: dict[int, StepOutput] = {}

    def add(self, request: object) -> int:
        slot = min(set(range(self.num_slots)) - self.used)
        self.used.add(slot)
        self._running = {s: StepOutput(token=s, finished=False) for s in sorted(self.used)}
        self._last = {s: StepOutput(token=s, finished=True) for s in sorted(self.used)}
        return slot

    def add_many(self, requests: Sequence[object]) -> list[int]:
        return [self.add(request) for request in requests]

    def step(self) -> dict[int, StepOutput]:
        entered = time.perf_counter_ns()
        if self.step_s > 0:
            time.sleep(self.step_s)
        if len(self.used) < self.num_slots:
            return self._running
        self._count += 1
        self.stamps.append((entered, time.perf_counter_ns()))
        return self._last if self._count >= self.steps else self._running

    def remove(self, slot: int) -> None:
        self.used.discard(slot)


def _submit(scheduler: ContinuousBatchingScheduler, request_id: str, deliver_at: tuple[int, ...] | None):
    if "deliver_at" in inspect.signature(scheduler.submit).parameters:
        return scheduler.submit(request_id, None, deliver_at=deliver_at)
    if deliver_at is not None:
        raise SystemExit("this scheduler has no delivery schedule (chunk mode)")
    return scheduler.submit(request_id, None)


async def _consume(stream) -> int:
    received = 0
    async for tokens in stream:
        received += len(tokens)
    return received


class BusyThread:
    """A thread that runs Python without pause, as token2wav's worker does between its kernel launches (with
    `--busy-thread`): a step that ends while it holds the interpreter lock waits up to the switch interval."""

    def __init__(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="busy", daemon=True)

    def _run(self) -> None:
        total = 0
        while not self._stop.is_set():
            for i in range(200):
                total += i

    def __enter__(self) -> "BusyThread":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


async def run_once(batch: int, steps: int, mode: str, step_s: float) -> tuple[list[float], list[float]]:
    """Per step of `batch` sequences, microseconds: (end of a step to the start of the next, the step's wall
    time beyond its sleep)."""
    decoder = StubDecoder(batch, steps, step_s)
    scheduler = ContinuousBatchingScheduler(decoder, max_waiting=batch)
    changed = threading.Event()
    scheduler.stats.add_listener(lambda name, value: changed.set())  # what the Triton metrics exporter does
    deliver_at = tuple(ChunkSchedule().boundaries(steps)) if mode == "chunk" else None
    try:
        streams = [_submit(scheduler, f"r{i}", deliver_at) for i in range(batch)]
        received = await asyncio.gather(*(_consume(s) for s in streams))
    finally:
        scheduler.close()
    if min(received) < steps:
        raise RuntimeError(f"a consumer got {min(received)} of at least {steps} tokens")
    stamps = decoder.stamps
    between = [(entered - exited) / 1000 for (_, exited), (entered, _) in zip(stamps, stamps[1:])]
    overrun = [(exited - entered) / 1000 - step_s * 1e6 for entered, exited in stamps]
    return between, overrun


def sleep_overshoot_us(step_s: float, samples: int = 200) -> float:
    """Median time a lone `time.sleep(step_s)` takes beyond `step_s` (timer slack, wake-up), microseconds."""
    if step_s <= 0:
        return 0.0
    late = []
    for _ in range(samples):
        started = time.perf_counter_ns()
        time.sleep(step_s)
        late.append((time.perf_counter_ns() - started) / 1000 - step_s * 1e6)
    return statistics.median(late)


def _summary(values: list[float]) -> str:
    deciles = statistics.quantiles(values, n=10)
    return f"{deciles[4]:.1f} | {deciles[8]:.1f} | {statistics.fmean(values):.1f}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m enginebench.llm_scheduler", description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--steps", type=int, default=1000, help="measured steps per run")
    parser.add_argument("--step-us", type=float, default=1000.0, help="simulated device time of one step (GIL released)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--modes", nargs="+", default=["token", "chunk"], choices=["token", "chunk"])
    parser.add_argument("--switch-interval-ms", type=float, default=SWITCH_INTERVAL_S * 1e3,
                        help="the interpreter's thread switch interval (default: the serving processes')")
    parser.add_argument("--busy-thread", action="store_true",
                        help="one more thread running Python throughout, as token2wav's worker beside the LLM")
    args = parser.parse_args(argv)
    if args.switch_interval_ms <= 0:
        parser.error("--switch-interval-ms must be positive")
    sys.setswitchinterval(args.switch_interval_ms / 1e3)
    step_s = args.step_us / 1e6
    overshoot = sleep_overshoot_us(step_s)
    print(f"microseconds per decoder step; stub step = sleep {args.step_us:.0f} us (a lone sleep overshoots by "
          f"{overshoot:.0f} us, subtracted from the overrun); switch interval {args.switch_interval_ms} ms"
          + ("; a busy Python thread beside" if args.busy_thread else ""))
    print("| delivery | batch | between steps p50 | p90 | mean | step overrun (GIL wait) p50 | p90 | mean |")
    print("|---|---|---|---|---|---|---|---|")
    for mode in args.modes:
        for batch in args.batches:
            between: list[float] = []
            overrun: list[float] = []
            try:
                for _ in range(args.repeats):
                    with BusyThread() if args.busy_thread else contextlib.nullcontext():
                        b, o = asyncio.run(run_once(batch, args.steps, mode, step_s))
                    between += b
                    overrun += [value - overshoot for value in o]
            except SystemExit as exc:
                print(f"| {mode} | {batch} | {exc} | | | | | |")
                continue
            print(f"| {mode} | {batch} | {_summary(between)} | {_summary(overrun)} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
