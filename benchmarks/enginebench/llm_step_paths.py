"""The LLM decode step of one stream along the served path, layer by layer, in one process (no Triton).

    python -m enginebench.llm_step_paths [--requests 8] [--tokens 250] [--with-token2wav] [--model-dir DIR]

The served stack's step at one stream was slower than the step alone (1.45 ms on an H200 against 2.12-2.22 ms in
the stack, with token2wav idle). This adds the served path's layers one at a time to a full-size random LLM (bf16;
by default the served decoder's 64 slots and 4096 positions; stack-bench renders 2048) and times the same requests
through each, so a layer that costs the time shows. None did: run in the stub process's environment it was the
library path (the image's cuDNN ahead of torch's; docs/experiments/2026-12-02-h200-stub-library-path.md), so run it
in the environment under suspicion too (`LD_LIBRARY_PATH=... python -m enginebench.llm_step_paths`):

- `bare`: `BatchedDecoder.step` in a loop on the default stream (the microbench's step);
- `stream`: the same through `StreamDecoder` on the LLM worker's prioritised stream (`speech_serving.cuda_streams`);
- `thread`: `stream` from a plain worker thread (the scheduler's thread without the scheduler). On a CPU a step
  from any thread but the main one is slower when torch runs several intra-op threads (OpenMP: tiny model, 2 threads,
  1.39 -> 2.19 ms; the same with one); on a GPU the step replays graphs and the host only launches and waits;
- `scheduler`: through `ContinuousBatchingScheduler` (its thread, the hand-over at the streaming schedule's chunk
  boundaries to an asyncio consumer), what the serving process runs; its step time is the scheduler's own counter.

Each request is a stream of one voice at a time, as stack-bench's c=1: a 6 s voice (150 prompt speech tokens), a
sentence of text, `--tokens` decoded tokens (benchmark mode: no stop token), then the next request. With
`--with-token2wav` the full-size flow and HiFT are loaded and their CUDA graphs captured first (token2wav stays idle):
whether merely sharing the process and its graph pools with them slows the LLM's replays.
With `--model-dir` the LLM is loaded from a model directory as the served engine loads it (`load_llm`, and in
benchmark mode the stop ids disabled: stack-bench's random full-size directory is `var/stackbench/model`), instead
of a freshly initialised one: whether the served weights (their values, the loading path) make the step slower.
The table gives p50/p90 of the step (wall) and of its wait for the tokens (`last_step_sync_seconds`), and the p50 of
its span on the GPU (`last_step_device_seconds`; under the scheduler: per-request means of its counters).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import threading
import time
from pathlib import Path
from typing import Callable

import torch

from cosyvoice2.config import EngineConfig
from cosyvoice2.layout import LLM_FILE
from cosyvoice2.llm import CosyVoice2LM, LLMConfig
from cosyvoice2.llm.request import CosyVoice2Sampling, cosyvoice2_request
from cosyvoice2.loading import load_llm
from cosyvoice2.streaming import ChunkSchedule
from speech_lm.decode import BatchedDecoder, DecodeRequest
from speech_serving.cuda_streams import (
    LLM_STREAM_PRIORITY,
    TOKEN2WAV_STREAM_PRIORITY,
    StreamDecoder,
    StreamToken2Wav,
    worker_stream,
)
from speech_serving.engines import disable_stop_tokens
from speech_serving.gpu_yield import Token2WavCalls
from speech_serving.llm_scheduler import LLM_STATS, ContinuousBatchingScheduler
from speech_serving.stats import Stats
from speech_serving.token2wav import Token2WavService
from triton_repo.render_options import GPU_PYTORCH_MAX_BATCH, RenderOptions

PROMPT_TOKENS = 150  # a 6 s voice, as the stack's reference voices
PROMPT_TEXT_TOKENS = 20
TEXT_TOKENS = 24


def stream_request(index: int, tokens: int, config: LLMConfig) -> DecodeRequest:
    text = [(1000 + index + i) % config.qwen.vocab_size for i in range(TEXT_TOKENS + PROMPT_TEXT_TOKENS)]
    speech = [(7 * index + 13 * i) % config.speech_token_size for i in range(PROMPT_TOKENS)]
    sampling = CosyVoice2Sampling(seed=index, min_tokens=tokens, max_tokens=tokens)
    return cosyvoice2_request(text[PROMPT_TEXT_TOKENS:], text[:PROMPT_TEXT_TOKENS], speech, sampling)


class Timings:
    """Per step: its wall time and its wait for the tokens, request by request (`per_request` holds where each
    request's steps start: the first request is the warm-up, `measured` drops it)."""

    def __init__(self) -> None:
        self.walls: list[float] = []
        self.syncs: list[float] = []
        self.devices: list[float] = []
        self.per_request: list[int] = []

    def next_request(self) -> None:
        self.per_request.append(len(self.walls))

    def measured(self) -> Timings:
        out = Timings()
        skip = self.per_request[1] if len(self.per_request) > 1 else 0
        out.walls, out.syncs, out.devices = self.walls[skip:], self.syncs[skip:], self.devices[skip:]
        return out

    def row(self, name: str) -> str:
        def pct(values: list[float], q: float) -> float:
            return statistics.quantiles(values, n=100)[q - 1] * 1e3 if len(values) > 1 else values[0] * 1e3
        return (f"| {name} | {len(self.walls)} | {pct(self.walls, 50):.3f} | {pct(self.walls, 90):.3f} "
                f"| {pct(self.syncs, 50):.3f} | {pct(self.syncs, 90):.3f} | {pct(self.devices, 50):.3f} |")


def direct(decoder: BatchedDecoder | StreamDecoder, requests: list[DecodeRequest],
           last: Callable[[], tuple[float, float]]) -> Timings:
    timings = Timings()
    for request in requests:
        timings.next_request()
        decoder.add(request)
        while True:
            started = time.perf_counter()
            outputs = decoder.step()
            timings.walls.append(time.perf_counter() - started)
            sync, device = last()
            timings.syncs.append(sync)
            timings.devices.append(device)
            if all(out.finished for out in outputs.values()):
                break
    return timings


def in_thread(decoder: StreamDecoder, requests: list[DecodeRequest], last: Callable[[], tuple[float, float]]
              ) -> Timings:
    result: list[Timings] = []

    def run() -> None:
        with torch.inference_mode():
            result.append(direct(decoder, requests, last))

    worker = threading.Thread(target=run, name="llm-step-paths")
    worker.start()
    worker.join()
    return result[0]


async def scheduled(decoder: StreamDecoder, requests: list[DecodeRequest], tokens: int,
                    calls: Token2WavCalls | None = None) -> Timings:
    """Through the scheduler: its per-step counters, read per request (steps, seconds, sync seconds). `calls`: a
    token2wav service's calls in this process, which the scheduler watches and yields to as the engine's does."""
    stats = Stats(LLM_STATS)
    scheduler = ContinuousBatchingScheduler(decoder, max_waiting=0, stats=stats, yield_to=calls)
    boundaries = ChunkSchedule(prompt_tokens=PROMPT_TOKENS).boundaries(tokens)
    timings = Timings()
    try:
        for index, request in enumerate(requests):
            timings.next_request()
            before = stats.snapshot()
            async for _ in scheduler.submit(f"r{index}", request, boundaries, streaming=True).deliveries():
                pass
            after = stats.snapshot()  # complete: the scheduler publishes a sequence's steps before handing over its end
            steps = after["llm_steps_total"] - before["llm_steps_total"]
            seconds = after["llm_step_seconds_total"] - before["llm_step_seconds_total"]
            sync = after["llm_step_sync_seconds_total"] - before["llm_step_sync_seconds_total"]
            device = after["llm_step_device_seconds_total"] - before["llm_step_device_seconds_total"]
            # one mean per request (the counters are sums); each request weighs as its steps
            timings.walls += [seconds / steps] * int(steps)
            timings.syncs += [sync / steps] * int(steps)
            timings.devices += [device / steps] * int(steps)
    finally:
        scheduler.close()
    return timings


def load_token2wav(config: EngineConfig, device: torch.device, dtype: torch.dtype
                   ) -> tuple[Token2WavService, Token2WavCalls]:
    """The full-size flow and HiFT with the served schedules' CUDA graphs captured, behind the token2wav service on
    its worker's stream, as the serving process holds them (after the LLM's, as there); idle."""
    from enginebench.microbench import random_flow, random_hift  # noqa: PLC0415 - only with --with-token2wav
    from speech_serving.engines import BatchedToken2Wav  # noqa: PLC0415
    from speech_serving.schedule import StreamScheduleParams  # noqa: PLC0415

    params = StreamScheduleParams(lone_first_hop=12)
    engine = BatchedToken2Wav(random_flow(config.flow, device, dtype), random_hift(config.hift, device), config,
                              params.schedule(config), "chunked", 32.0, schedules=params.schedules(config))
    graphs, seconds = engine.capture_graphs()
    print(f"token2wav: {graphs} CUDA graphs captured in {seconds:.1f} s", flush=True)
    calls = Token2WavCalls()
    service = Token2WavService(StreamToken2Wav(engine, worker_stream(device, TOKEN2WAV_STREAM_PRIORITY)), calls=calls)
    return service, calls


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=8, help="streams, one after the other (the first warms up)")
    parser.add_argument("--tokens", type=int, default=250, help="decoded tokens per stream")
    # the served decoder's sizes by default (a CUDA render without TensorRT-LLM engines)
    parser.add_argument("--slots", type=int, default=GPU_PYTORCH_MAX_BATCH)
    parser.add_argument("--max-seq-len", type=int, default=RenderOptions.max_seq_len)
    parser.add_argument("--with-token2wav", action="store_true", help="load token2wav and capture its graphs first")
    parser.add_argument("--tiny", action="store_true", help="the tiny test model on the CPU (a smoke run of this script)")
    parser.add_argument("--model-dir", type=Path, default=None,
                        help="load the LLM from this model directory as the served engine does (stop ids disabled, "
                             "as in benchmark mode)")
    args = parser.parse_args()
    if args.tiny:
        from cosyvoice2.testing import tiny_config  # noqa: PLC0415

        device, dtype, engine_config = torch.device("cpu"), torch.float32, tiny_config()
        print(f"tiny model on the CPU ({torch.get_num_threads()} intra-op threads), torch {torch.__version__}",
              flush=True)
    else:
        device, dtype, engine_config = torch.device("cuda"), torch.bfloat16, EngineConfig()
        print(f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}", flush=True)
    if args.model_dir is not None:
        engine_config = EngineConfig.for_model_dir(args.model_dir)
        llm = load_llm(args.model_dir / LLM_FILE, engine_config, device, dtype)
        disable_stop_tokens(llm)  # the requests run to their length anyway (min_tokens); as the benchmark stack
        print(f"LLM loaded from {args.model_dir}", flush=True)
    else:
        with torch.device(device):
            llm = CosyVoice2LM(engine_config.llm).to(dtype).eval()
    config = engine_config.llm
    decoder = BatchedDecoder(llm, num_slots=args.slots, max_seq_len=args.max_seq_len)
    token2wav = load_token2wav(engine_config, device, dtype) if args.with_token2wav else None
    on_stream = StreamDecoder(decoder, worker_stream(device, LLM_STREAM_PRIORITY))

    def requests() -> list[DecodeRequest]:
        return [stream_request(i, args.tokens, config) for i in range(args.requests)]

    def last() -> tuple[float, float]:
        return decoder.last_step_sync_seconds, decoder.last_step_device_seconds

    rows = []
    with torch.inference_mode():
        rows.append(direct(decoder, requests(), last).measured().row("bare"))
        rows.append(direct(on_stream, requests(), last).measured().row("stream"))
    rows.append(in_thread(on_stream, requests(), last).measured().row("thread"))
    calls = None if token2wav is None else token2wav[1]
    rows.append(asyncio.run(scheduled(on_stream, requests(), args.tokens, calls)).measured().row("scheduler"))
    if token2wav is not None:
        token2wav[0].shutdown()
    print(f"\nOne stream at a time, {args.tokens} tokens each, {args.slots} slots of {args.max_seq_len} positions"
          f"{', token2wav loaded (idle; the scheduler watches its calls)' if token2wav is not None else ''}:")
    print("| path | steps | step p50 ms | step p90 ms | token wait p50 ms | token wait p90 ms | on the GPU p50 ms |\n"
          "|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
