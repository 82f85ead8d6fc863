"""Host overhead of the continuous-batching LLM scheduler per decoder step, without any model.

    python -m scripts.llm_scheduler_bench [--batches 1 16 64] [--steps 1000] [--repeats 3] [--step-us 1000]

The decoder is a stub whose `step()` returns a prepared result after sleeping `--step-us` (a sleep
releases the GIL, as a GPU step does while it waits for its tokens). The time from the end of one `step()`
to the start of the next is pure host overhead: the scheduler thread's bookkeeping and hand-over of the
tokens, plus any wait for the GIL while the asyncio consumers (the adapter's role) run. The interpreter's
switch interval is 1 ms, as in the Triton stubs (`triton_repo/adapters/common.py`). Every sequence of a run
joins before the first measured step and runs `--steps` steps.

Two delivery modes: `token` (a consumer wakes up for every token, as a caller without a delivery
schedule gets) and `chunk` (tokens are handed over only at the streaming schedule's boundaries, what the
orchestrator asks for; `ChunkSchedule` defaults, no prompt padding). The table gives p50/p90 of the
per-step interval in microseconds over all repeats.
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import statistics
import sys
import threading
import time
from typing import Sequence

from cosyvoice2.streaming import ChunkSchedule
from cosyvoice2_serving.llm_scheduler import ContinuousBatchingScheduler, StepOutput


class StubDecoder:
    """`SlotDecoder` with a trivial step: every slot emits a token; all finish together at `steps`."""

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


async def run_once(batch: int, steps: int, mode: str, step_s: float) -> list[float]:
    """Host overhead per step (microseconds: end of a step to the start of the next) of `batch` sequences."""
    decoder = StubDecoder(batch, steps, step_s)
    scheduler = ContinuousBatchingScheduler(decoder, max_waiting=batch)
    deliver_at = tuple(ChunkSchedule().boundaries(steps)) if mode == "chunk" else None
    try:
        streams = [_submit(scheduler, f"r{i}", deliver_at) for i in range(batch)]
        received = await asyncio.gather(*(_consume(s) for s in streams))
    finally:
        scheduler.close()
    if min(received) < steps:
        raise RuntimeError(f"a consumer got {min(received)} of at least {steps} tokens")
    stamps = decoder.stamps
    return [(entered - exited) / 1000 for (_, exited), (entered, _) in zip(stamps, stamps[1:])]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m scripts.llm_scheduler_bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--steps", type=int, default=1000, help="measured steps per run")
    parser.add_argument("--step-us", type=float, default=1000.0, help="simulated device time of one step (GIL released)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--modes", nargs="+", default=["token", "chunk"], choices=["token", "chunk"])
    args = parser.parse_args(argv)
    sys.setswitchinterval(0.001)
    print(f"host overhead per decoder step (stub step of {args.step_us:.0f} us excluded), microseconds")
    print("| delivery | batch | p50 | p90 | mean |")
    print("|---|---|---|---|---|")
    for mode in args.modes:
        for batch in args.batches:
            intervals: list[float] = []
            try:
                for _ in range(args.repeats):
                    intervals += asyncio.run(run_once(batch, args.steps, mode, args.step_us / 1e6))
            except SystemExit as exc:
                print(f"| {mode} | {batch} | {exc} | | |")
                continue
            deciles = statistics.quantiles(intervals, n=10)
            print(f"| {mode} | {batch} | {deciles[4]:.1f} | {deciles[8]:.1f} | {statistics.fmean(intervals):.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
