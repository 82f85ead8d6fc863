"""The LLM's decode step beside token2wav's calls on one GPU: shared SMs against token2wav held to a share of them.

    PYTHONUNBUFFERED=1 python -m enginebench.sm_share [--llm-rows 16] [--t2w-rows 4] [--t2w-sms 0 112 96]
        [--seconds 8] [--switch-interval-ms 1]

In the colocated server one process decodes the LLM's sequences and runs token2wav's calls on two CUDA streams of
one context, and every SM may run either's kernels: a decode step of 16 sequences takes ~4.3 ms beside token2wav
against ~1.5 ms alone (one H100), and the first chunk waits for 37 of them. CUDA green contexts hold a stream's
kernels to a set of SMs (`torch.cuda.green_contexts`). Here token2wav's worker stream comes from a green context of
`N` SMs while the LLM keeps the device's own context (all SMs): the LLM then always finds the SMs token2wav may not
use free, and token2wav loses what it would have run on them.

Released-size random weights, bf16. Two threads as in the server: one decodes `--llm-rows` sequences step by step
(CUDA-graph replays, one host read per step), the other runs the flow of token2wav calls of `--t2w-rows` streams'
third chunks (100 new tokens after the voice prefix and two chunks) back to back, CUDA graphs replayed on its worker
stream. Cases: each alone, then both together for each `--t2w-sms` value (0: no green context, every SM shared).
token2wav's graphs are captured once, as the server captures them, and replayed on the green context's stream
(whether CUDA holds a replay to the stream's SMs is part of the question: "token2wav alone on N SMs" against "all
SMs" answers it; a case CUDA refuses is reported as failed).
Both threads share one interpreter lock, as the server's do: `--switch-interval-ms` sets how soon a thread whose GPU
work finished gets it back from one running Python (docs/experiments/2026-11-27-sm-share.md: the green contexts
left the LLM's step as slow, so the lock is the next suspect).
Table: LLM step p50/p90 (ms), token2wav call p50/p90 (ms), and both rates (steps/s, calls/s).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from typing import Callable

import torch

import speech_lm.kernels  # noqa: F401 - the fused kernels the server uses
from cosyvoice2.config import EngineConfig, resolve_dtype
from cosyvoice2.llm import CosyVoice2LM, LLMConfig
from cosyvoice2.streaming import Token2Wav
from enginebench.microbench import (advanced_streams, decode_request, random_flow, random_hift, random_tokens,
                                     random_voice)
from enginebench.timing import sync
from speech_lm.decode import BatchedDecoder
from speech_serving.llm_scheduler import SWITCH_INTERVAL_S

PROMPT_TOKENS = 150
EARLIER_CHUNKS = 2  # the measured call runs each stream's third chunk: 100 new tokens over a history


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


class Loop:
    """Runs `work` back to back on `stream` in a thread of its own until stopped; keeps each call's wall time."""

    def __init__(self, name: str, work: Callable[[], object], stream: torch.cuda.Stream, device: torch.device):
        self.name, self.work, self.stream, self.device = name, work, stream, device
        self.samples: list[float] = []
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def _run(self) -> None:
        try:
            torch.cuda.set_device(self.device)
            with torch.cuda.stream(self.stream), torch.inference_mode():
                while not self._stop.is_set():
                    start = time.perf_counter()
                    self.work()
                    self.stream.synchronize()  # what the worker waits for: its results on the host
                    self.samples.append((time.perf_counter() - start) * 1e3)
        except BaseException as exc:  # noqa: BLE001 - reported in the table, the other loop goes on
            self.error = exc

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def measure(loops: list[Loop], seconds: float, warmup_s: float = 1.0) -> None:
    for loop in loops:
        loop.start()
    time.sleep(warmup_s)
    for loop in loops:
        loop.samples.clear()
    time.sleep(seconds)
    for loop in loops:
        loop.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--llm-rows", type=int, default=16, help="sequences decoded together")
    parser.add_argument("--t2w-rows", type=int, default=4, help="streams per token2wav call")
    parser.add_argument("--t2w-sms", type=int, nargs="+", default=[0, 112, 96, 80],
                        help="SMs token2wav may use (0: all, no green context)")
    parser.add_argument("--seconds", type=float, default=8.0, help="measured seconds per case")
    parser.add_argument("--switch-interval-ms", type=float, default=SWITCH_INTERVAL_S * 1e3,
                        help="the interpreter's thread switch interval (default: the serving processes'): how long a "
                             "thread whose GPU work is done may wait for the lock another thread's Python holds")
    args = parser.parse_args()
    if args.switch_interval_ms <= 0:
        raise SystemExit("sm_share: --switch-interval-ms must be positive")
    sys.setswitchinterval(args.switch_interval_ms / 1e3)
    device = torch.device(args.device)
    if device.type != "cuda":
        raise SystemExit("sm_share: needs a CUDA device (--device cuda)")
    device = torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
    torch.cuda.set_device(device)
    dtype = resolve_dtype(args.dtype)
    total_sms = torch.cuda.get_device_properties(device).multi_processor_count
    bad = [n for n in args.t2w_sms if not 0 <= n <= total_sms]
    if bad:
        raise SystemExit(f"sm_share: --t2w-sms must lie in 0..{total_sms} (this GPU's SMs), got {bad}")
    green = None
    if any(args.t2w_sms):
        from torch.cuda import green_contexts

        if not green_contexts.SUPPORTED:
            raise SystemExit("sm_share: this PyTorch has no green contexts (torch.cuda.green_contexts); use --t2w-sms 0")
        green = green_contexts.GreenContext
    print(f"{torch.cuda.get_device_name(device)}: {total_sms} SMs; LLM {args.llm_rows} sequences, token2wav calls "
          f"of {args.t2w_rows} third chunks; switch interval {args.switch_interval_ms} ms", flush=True)

    with torch.device(device):
        llm = CosyVoice2LM(LLMConfig()).to(dtype).eval()
    decoder = BatchedDecoder(llm, num_slots=args.llm_rows, max_seq_len=2048, cuda_graphs=True)
    decoder.add_many([decode_request(i) for i in range(args.llm_rows)])
    config = EngineConfig()
    llm_stream = torch.cuda.Stream(device, priority=-1)

    engine = Token2Wav(random_flow(config.flow, device, dtype), random_hift(config.hift, device), config,
                       flow_cache="chunked")
    started, before = time.perf_counter(), torch.cuda.memory_allocated(device)
    steps = engine.cached.solve_graphs.capture_all(device, dtype)
    encoder_graphs = engine.cached.encoder.graphs  # (an empty set of graphs is falsy: compare with None)
    encoder = encoder_graphs.capture_all(device, dtype) if encoder_graphs is not None else 0
    sync(device)
    print(f"token2wav: {steps} step graphs and {encoder} encoder graphs captured in {time.perf_counter() - started:.1f} "
          f"s, {(torch.cuda.memory_allocated(device) - before) / 2**30:.1f} GiB", flush=True)
    voice = random_voice(config.flow, device, dtype, key="voice", prompt_tokens=PROMPT_TOKENS)
    tokens = random_tokens(config.flow, 400)
    work = advanced_streams(engine, voice, tokens, args.t2w_rows, EARLIER_CHUNKS)
    # the flow of the call, run without committing its caches so that it repeats: the part of a call that shares
    # the GPU with the LLM (HiFT is a few ms of it)
    rows = [engine._cached_row(stream.flow_call(chunk)) for stream, chunk in work]
    sync(device)

    def t2w_call() -> object:
        return engine.cached.run_pending(rows)

    def llm_step() -> object:
        if len(decoder.active_slots) < args.llm_rows:  # benchmark-mode sequences end at their max_tokens
            for slot in decoder.active_slots:
                decoder.remove(slot)
            decoder.add_many([decode_request(i) for i in range(args.llm_rows)])
        return decoder.step()

    results: list[tuple[str, Loop | None, Loop | None]] = []
    t2w_stream = torch.cuda.Stream(device, priority=-2)
    llm_loop = Loop("llm", llm_step, llm_stream, device)
    measure([llm_loop], args.seconds)
    results.append(("LLM alone", llm_loop, None))
    t2w_loop = Loop("token2wav", t2w_call, t2w_stream, device)
    measure([t2w_loop], args.seconds)
    results.append(("token2wav alone, all SMs", None, t2w_loop))
    contexts = []  # kept alive until the end: a context's streams die with it
    for sms in args.t2w_sms:
        stream, label = t2w_stream, "together, all SMs shared"
        if 0 < sms < total_sms:
            try:
                contexts.append(green.create(num_sms=sms, device_id=device.index))  # type: ignore[union-attr]
                stream = contexts[-1].Stream()
            except Exception as exc:  # noqa: BLE001 - a case that cannot run is reported, the others still run
                print(f"a green context of {sms} SMs: {type(exc).__name__}: {exc}", flush=True)
                continue
            label = f"together, token2wav on {sms} SMs"
            alone = Loop("token2wav", t2w_call, stream, device)
            measure([alone], args.seconds)
            results.append((f"token2wav alone on {sms} SMs", None, alone))
        llm_loop, t2w_loop = Loop("llm", llm_step, llm_stream, device), Loop("token2wav", t2w_call, stream, device)
        measure([llm_loop, t2w_loop], args.seconds)
        results.append((label, llm_loop, t2w_loop))

    print("\n| case | LLM step p50 / p90 (ms) | steps/s | token2wav call p50 / p90 (ms) | calls/s |")
    print("|---|---|---|---|---|")
    for label, llm_loop, t2w_loop in results:
        cells = []
        for loop in (llm_loop, t2w_loop):
            if loop is None:
                cells += ["-", "-"]
            elif loop.error is not None:
                cells += [f"failed: {type(loop.error).__name__}: {loop.error}", "-"]
            else:
                s = loop.samples
                cells += [f"{statistics.median(s):.2f} / {percentile(s, 0.9):.2f}", f"{len(s) / args.seconds:.1f}"]
        print(f"| {label} | {' | '.join(cells)} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
