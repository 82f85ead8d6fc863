"""Where a streaming token2wav call's time goes, phase by phase (engine alone, no LLM, no server).

Released-size random flow and HiFT, flow caches on (`chunked`), step and encoder graphs captured (`--eager-encoder`:
the encoder pass eagerly), one voice whose prefix is cached; for each `--streams N` it times calls of N first
chunks, of N later chunks (50 new tokens over a history), and of half first and half 4th chunks (a call under load)
three ways:
- wall: the call as the server runs it (no added syncs);
- phases: the same call with the device synchronised around each phase (encoder pass, the Euler solve, HiFT), so
  each phase's time is its own (the sum is a little above the wall time);
- kernels: the CUDA kernels of one call (count and summed kernel time): wall minus kernel time is time the GPU
  waited for the host.
Each row ends with the flow padding of its calls (the share of the estimator's frames computed in vain: the packed
frame axis padded up to its graph bucket).
With `--by-op`, one more call of each case runs with the step and encoder graphs off, under the profiler with input shapes, and
the operators that launched the most kernel time are listed with their shapes: a graph replay shows only kernel
names (a strided `elementwise_kernel` can come from any of a hundred call sites), an eager call shows the caller.

    PYTHONUNBUFFERED=1 python -m enginebench.t2w_phase_profile --streams 1 8 16 [--by-op] [--eager-encoder]
    PYTHONUNBUFFERED=1 python -m enginebench.t2w_phase_profile --rows 32 --streams 16 24 32
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict
from typing import Callable

import torch

import speech_lm.kernels  # noqa: F401 - the fused kernels the server uses
from cosyvoice2.config import EngineConfig, resolve_dtype
from cosyvoice2.streaming import Token2Wav
from enginebench.microbench import (advanced_streams, kernel_profile, random_flow, random_hift, random_tokens,
                                     random_voice)
from enginebench.timing import sync

PROMPT_TOKENS = 150


class Phases:
    """Wraps methods so that each call is timed with the device synchronised before and after."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.totals: dict[str, float] = defaultdict(float)
        self.active = False

    def wrap(self, owner: object, name: str, label: str) -> None:
        inner = getattr(owner, name)

        def timed(*args, **kwargs):
            if not self.active:
                return inner(*args, **kwargs)
            sync(self.device)
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                sync(self.device)
                self.totals[label] += (time.perf_counter() - start) * 1e3

        setattr(owner, name, timed)


def op_profile(fn: Callable[[], object], device: torch.device, top: int) -> list[tuple[str, str, int, float]]:
    """(operator, input shapes, calls, device ms) of the operators whose own kernels took the most device time in
    one call of `fn` (CPU: their own CPU time)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    fn()
    sync(device)
    with profile(activities=activities, record_shapes=True) as prof:
        fn()
        sync(device)

    def own_time(event) -> float:  # microseconds; the attribute's name moved between torch versions
        for name in ("self_device_time_total", "self_cuda_time_total"):
            value = getattr(event, name, None)
            if value is not None and device.type == "cuda":
                return value
        return event.self_cpu_time_total

    events = sorted(prof.key_averages(group_by_input_shape=True), key=own_time, reverse=True)[:top]
    return [(e.key, str(e.input_shapes)[:90], e.count, own_time(e) / 1e3) for e in events]


def median_ms(device: torch.device, fn: Callable[[], object], repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 8, 16])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--by-op", action="store_true", help="also list the costliest operators of an eager call")
    parser.add_argument("--top", type=int, default=8, help="operators listed per case with --by-op")
    parser.add_argument("--eager-encoder", action="store_true", help="run the encoder pass eagerly (no graphs)")
    parser.add_argument("--rows", type=int, default=None,
                        help="rows per call the graphs take at most (the served --token2wav-rows; default: the "
                             "engine's)")
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = resolve_dtype(args.dtype)
    config = EngineConfig()
    engine = Token2Wav(random_flow(config.flow, device, dtype), random_hift(config.hift, device), config,
                       flow_cache="chunked", max_rows=args.rows)
    if max(args.streams) > engine.cached.max_rows:
        parser.error(f"--streams {max(args.streams)} is more than the {engine.cached.max_rows} rows a call's graphs "
                     "take: raise --rows")
    start = time.perf_counter()
    graphs = engine.cached.solve_graphs
    count = graphs.capture_all(device, dtype) if graphs is not None and device.type == "cuda" else 0
    hift_count = engine.capture_hift_graphs()  # as a server does before it reports ready
    sync(device)
    print(f"captured {count} step graphs and {hift_count} HiFT graphs in {time.perf_counter() - start:.1f} s",
          flush=True)
    encoder_graphs = engine.cached.encoder.graphs
    if args.eager_encoder:
        engine.cached.encoder.graphs = None
    elif encoder_graphs is not None and device.type == "cuda":
        before, start = torch.cuda.memory_allocated(device), time.perf_counter()
        count = encoder_graphs.capture_all(device, dtype)
        sync(device)
        print(f"captured {count} encoder graphs in {time.perf_counter() - start:.1f} s, "
              f"{(torch.cuda.memory_allocated(device) - before) / 2**20:.0f} MiB (key buffers and graph pool)",
              flush=True)
    voice = random_voice(config.flow, device, dtype, key="voice", prompt_tokens=PROMPT_TOKENS)
    engine.prefix(voice)
    tokens = random_tokens(config.flow, 400)

    phases = Phases(device)
    runner = engine.cached
    phases.wrap(runner, "_encode", "encoder")
    phases.wrap(runner.solver, "solve", "Euler steps")
    phases.wrap(engine, "vocode_batch", "HiFT")

    print(f"\n{'call':<28} | {'wall ms':>8} | {'kernels':>7} | {'kernel ms':>9} | phases (synchronised, ms)")
    for n in args.streams:
        # mixed: half the rows first chunks, half 4th chunks (200 new frames over a history), as calls under load
        for label, earlier in (("first chunks", 0), ("2nd chunks", 1), ("mixed 1st + 4th", None)):
            def prepare(n=n, earlier=earlier) -> list:
                if earlier is not None:
                    return advanced_streams(engine, voice, tokens, n, earlier)
                return (advanced_streams(engine, voice, tokens, (n + 1) // 2, 0)
                        + advanced_streams(engine, voice, tokens, n // 2, 3))

            prepared = [prepare() for _ in range(args.repeats + 2)]
            wall = median_ms(device, lambda: engine.run_chunks(prepared.pop()), args.repeats)
            kernels = (kernel_profile(device, lambda: engine.run_chunks(prepared.pop()), top=6)
                       if device.type == "cuda" else {"kernels": 0, "busy_ms": 0.0, "top": []})
            timed_calls = 3
            prepared = [prepare() for _ in range(timed_calls)]
            phases.totals.clear()
            phases.active = True
            needed, computed = runner.frames_needed, runner.frames_computed
            for _ in range(timed_calls):
                engine.run_chunks(prepared.pop())
            phases.active = False
            padding = 1.0 - (runner.frames_needed - needed) / max(1, runner.frames_computed - computed)
            split = ", ".join(f"{k} {v / timed_calls:.1f}" for k, v in phases.totals.items())
            split += f"; flow padding {100 * padding:.0f} %"
            print(f"{label + ' x ' + str(n):<28} | {wall:8.1f} | {kernels['kernels']:7d} | {kernels['busy_ms']:9.1f} | "
                  f"{split}", flush=True)
            for kernel, ms in kernels["top"]:
                print(f"{'':<30}{ms:8.2f} ms  {kernel}")
            if args.by_op:
                # eager: each kernel keeps its launching operator
                graphs, runner.solver.graphs = runner.solver.graphs, None
                encoder, runner.encoder.graphs = runner.encoder.graphs, None
                try:
                    prepared = [prepare() for _ in range(2)]
                    ops = op_profile(lambda: engine.run_chunks(prepared.pop()), device, args.top)
                finally:
                    runner.solver.graphs, runner.encoder.graphs = graphs, encoder
                print(f"{'':<30}eager, by operator (own device ms, calls, input shapes):")
                for op, shapes, calls, ms in ops:
                    print(f"{'':<30}{ms:8.2f} ms {calls:6d}x  {op}  {shapes}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
