"""Where a CosyVoice3 token2wav call's time goes (engine alone, no LLM, no server).

Released-size random flow (in `--dtype`) and causal HiFT (float32), streams with per-stream flow caches (`cached`,
as served) of one voice whose prompt cache is computed beforehand. For each `--streams N` it times one
`run_chunks` call of N first chunks and one of N second chunks (median wall time over `--repeats` calls, each on
freshly advanced streams), then profiles one more call: its kernels (count and summed kernel time; wall minus kernel
time is time the GPU waited for the host) and the operators whose own kernels took the most device time, with their
input shapes (on the CPU: their own CPU time). `--chunks` picks the chunk indices timed (0: first chunks; later
ones show that a chunk's cost no longer grows with the stream: the vocoder runs over a bounded window).

Without `--graphs` the flow and the vocoder run eagerly, so every kernel keeps the operator that launched it; with
`--graphs` the flow's step graphs and the vocoder's graphs of the engine's buckets are captured first (their counts,
time and the step graphs' static memory are printed) and the calls replay them (a replayed kernel is listed under
the graph launch); on the CPU `--graphs` emulates the buckets (padded calls, run eagerly), which only checks the
padded path.

    PYTHONUNBUFFERED=1 python -m enginebench.cosyvoice3_token2wav --streams 1 16 --chunks 0 1 4 [--graphs] [--top 12]
    python -m enginebench.cosyvoice3_token2wav --tiny --device cpu --dtype fp32 --streams 1 --repeats 1  # smoke
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import torch

from cosyvoice2.config import resolve_dtype
from cosyvoice3.config import CosyVoice3Config
from cosyvoice3.flow import CosyVoice3Flow
from cosyvoice3.hift import CausalHiFT
from cosyvoice3.testing import tiny_config
from cosyvoice3.token2wav import CosyVoice3Stream, CosyVoice3Token2Wav, VoicePrompt
from enginebench.timing import sync

PROMPT_TOKENS = 150  # a 6 s reference at 25 tokens per second


def random_engine(config: CosyVoice3Config, device: torch.device, dtype: torch.dtype) -> CosyVoice3Token2Wav:
    """The token2wav of `config` with its modules' own random initialisation (the weights do not change the time)."""
    torch.manual_seed(0)
    flow = CosyVoice3Flow(config.flow).to(device, dtype).eval()
    hift = CausalHiFT(config.hift)
    hift.fold_weight_norm()  # as `cosyvoice3.loading` serves it
    return CosyVoice3Token2Wav(flow, hift.to(device).eval())


def advanced_streams(engine: CosyVoice3Token2Wav, voice: VoicePrompt, tokens: list[int], n: int,
                     chunks: int) -> list[tuple[CosyVoice3Stream, object]]:
    """`n` fresh cached streams of `voice` over `tokens`, each run through `chunks` chunks, with their next chunk:
    the work of one `run_chunks` call (the advancing is not part of it: the streams advance together)."""
    streams = []
    for _ in range(n):
        stream = engine.open_stream(voice, cached=True)
        stream.extend(tokens)
        streams.append(stream)
    for _ in range(chunks):
        engine.run_chunks([(stream, stream.next_chunk(finished=False)) for stream in streams])
    return [(stream, stream.next_chunk(finished=False)) for stream in streams]


def op_profile(fn: Callable[[], object], device: torch.device, top: int) -> tuple[int, float, list]:
    """(kernels, kernel ms, [(operator, input shapes, calls, own ms)]) of one call of `fn`."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities, record_shapes=True) as prof:
        fn()
        sync(device)
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    kernel_ms = sum(e.time_range.elapsed_us() for e in kernels) / 1e3

    def own_us(event) -> float:  # the device-time attribute's name moved between torch versions
        if device.type == "cuda":
            for name in ("self_device_time_total", "self_cuda_time_total"):
                if getattr(event, name, None) is not None:
                    return getattr(event, name)
        return event.self_cpu_time_total

    ops = sorted(prof.key_averages(group_by_input_shape=True), key=own_us, reverse=True)[:top]
    return len(kernels), kernel_ms, [(e.key, str(e.input_shapes)[:100], e.count, own_us(e) / 1e3) for e in ops]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--top", type=int, default=12, help="operators listed per case")
    parser.add_argument("--chunks", type=int, nargs="+", default=[0, 1],
                        help="chunk indices timed (0: first chunks)")
    parser.add_argument("--graphs", action="store_true",
                        help="capture the flow's step graphs and the vocoder's graphs first (CPU: emulate the buckets)")
    parser.add_argument("--tiny", action="store_true", help="the tiny test model (a smoke run of this tool)")
    args = parser.parse_args()
    device, dtype = torch.device(args.device), resolve_dtype(args.dtype)
    config = tiny_config() if args.tiny else CosyVoice3Config()
    engine = random_engine(config, device, dtype)
    if args.graphs and device.type == "cuda":
        started = time.perf_counter()
        count = engine.graphs.capture_all(device, dtype)
        vocoder = engine.vocoder_graphs.capture_all(engine.hift_device)
        sync(device)
        print(f"captured {count} flow step graphs and {vocoder} vocoder graphs in "
              f"{time.perf_counter() - started:.1f} s ({engine.graphs.static_bytes() / 2**30:.2f} GiB static "
              "keys/values)", flush=True)
    elif args.graphs:
        engine.graphs.emulate = True
        engine.vocoder_graphs.emulate = True
    else:  # eager: every kernel keeps its operator
        engine.graphs = None  # type: ignore[assignment]
        engine.vocoder_graphs = None  # type: ignore[assignment]
    gen = torch.Generator().manual_seed(1)
    vocab = config.flow.vocab_size
    voice = VoicePrompt(torch.randint(0, vocab, (PROMPT_TOKENS,), generator=gen),
                        torch.randn(2 * PROMPT_TOKENS, config.flow.output_size, generator=gen),
                        torch.randn(config.flow.spk_embed_dim, generator=gen))
    started = time.perf_counter()
    engine.prompt_flow_cache(voice)
    sync(device)
    print(f"voice prompt cache ({PROMPT_TOKENS} tokens) in {(time.perf_counter() - started) * 1e3:.0f} ms", flush=True)
    tokens = torch.randint(0, vocab, (2 * sum(engine.schedule.hop(i) for i in range(max(args.chunks) + 1)) + 10,),
                           generator=gen).tolist()

    print(f"\n{'call':<26} | {'wall ms':>8} | {'kernels':>7} | {'kernel ms':>9}")
    for n in args.streams:
        for earlier in args.chunks:
            label = f"chunk {earlier} (hop {engine.schedule.hop(earlier)})"
            prepared = [advanced_streams(engine, voice, tokens, n, earlier) for _ in range(args.repeats + 1)]
            engine.run_chunks(prepared.pop())  # warm-up
            samples = []
            for work in prepared:
                sync(device)
                start = time.perf_counter()
                engine.run_chunks(work)
                sync(device)
                samples.append((time.perf_counter() - start) * 1e3)
            work = advanced_streams(engine, voice, tokens, n, earlier)
            kernels, kernel_ms, ops = op_profile(lambda: engine.run_chunks(work), device, args.top)
            print(f"{label + ' x ' + str(n):<26} | {statistics.median(samples):8.1f} | {kernels:7d} | "
                  f"{kernel_ms:9.1f}", flush=True)
            for op, shapes, calls, ms in ops:
                print(f"{'':<22}{ms:8.2f} ms {calls:6d}x  {op}  {shapes}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
