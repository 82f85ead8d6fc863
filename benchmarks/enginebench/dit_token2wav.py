"""Speed of the DiT token2wav at the released size, with random weights (token2wav only, no LLM).

Writes a released-size random `token2wav/` directory (flow.yaml, flow.pt, hift.pt; `--size micro` for a quick CPU
run), loads it, computes one prompt cache, then measures with `c` concurrent streams whose chunks run together
(`DiTToken2Wav.run_chunks`):
- prefill: the prompt cache (once per voice);
- first chunk: 15 + 3 tokens for every stream (flow + HiFT);
- steady chunks: the following chunks (hops 25, 50, 100) per second of audio they emit;
- offline: `offline` of `--tokens` tokens, real-time factor.
Then the flow's step graphs (`cosyvoice2.dit.graphs`): it captures every bucket (count, seconds, static buffer
bytes) and measures the streaming levels again with the graphs replayed. Prints one JSON object, then a table of
eager vs graphs. That the replays equal the eager flow is a test: tests/gpu/test_dit_graphs.py.

    PYTHONUNBUFFERED=1 python -m enginebench.dit_token2wav --device cuda --dtype fp32 --concurrency 1 4 16
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from cosyvoice2.dit.graphs import DiTGraphBuckets, DiTStepGraphs
from cosyvoice2.dit.loading import load_dit_token2wav
from cosyvoice2.dit.token2wav import DiTToken2Wav
from cosyvoice2.testing.dit import MICRO_HIFT, micro_dit_config, write_dit_model, write_full_size_random_dit
from enginebench.timing import timed

TOKEN_RATE = 25


def streaming_levels(engine: DiTToken2Wav, prompt, tokens: list[int], levels: list[int], repeats: int,
                     device: torch.device) -> dict[int, dict[str, float]]:
    """Per concurrency c: c streams of `tokens`, the next chunks of all of them in one `run_chunks` call."""
    out = {}
    for c in levels:
        first, steady, steady_audio, steady_calls = [], 0.0, 0, []
        for repeat in range(repeats + 1):  # the first round warms up (allocator, kernels, HiFT graphs)
            streams = [engine.open_stream(prompt, engine.new_generator(i)) for i in range(c)]
            for stream in streams:
                stream.extend(tokens)
            index = 0
            while not all(s.finished for s in streams):
                work = [(s, ch) for s in streams if (ch := s.next_chunk(finished=True)) is not None]
                seconds, audio = timed(device, lambda: engine.run_chunks(work))
                if repeat:
                    if index == 0:
                        first.append(seconds)
                    else:
                        steady += seconds
                        steady_audio += sum(len(a) for a in audio) // c
                        if not work[0][1].final:
                            steady_calls.append(seconds)
                index += 1
        out[c] = {"first_chunk_s": round(statistics.median(first), 4),
                  "steady_call_s": round(statistics.median(steady_calls), 4) if steady_calls else None,
                  "steady_s_per_audio_s": round(steady / max(steady_audio / engine.sample_rate, 1e-9), 4)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "fp16", "bf16"])
    parser.add_argument("--size", default="released", choices=["released", "micro"])
    parser.add_argument("--prompt-tokens", type=int, default=75, help="3 s prompt")
    parser.add_argument("--tokens", type=int, default=250, help="generated tokens per stream (10 s)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--graph-prompt-frames", type=int, default=None,
                        help="cover prompts up to this many mel frames with graph buckets (default: the frontend's "
                             "limit, as a server does; smaller: fewer graphs, e.g. for a quick CPU run)")
    args = parser.parse_args()
    device = torch.device(args.device)
    # fp32 means fp32, as in the figures of docs/engine.md (TF32 would speed up the matmuls and convolutions)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False

    with tempfile.TemporaryDirectory() as tmp:
        started = time.perf_counter()
        model_dir = (write_full_size_random_dit(Path(tmp) / "token2wav") if args.size == "released"
                     else write_dit_model(Path(tmp) / "token2wav", micro_dit_config(), MICRO_HIFT))
        written = time.perf_counter() - started
        engine = load_dit_token2wav(model_dir, device=device, dtype=args.dtype)
    rng = np.random.default_rng(0)
    voice = (rng.integers(0, 6561, args.prompt_tokens),
             rng.standard_normal((2 * args.prompt_tokens, 80)).astype(np.float32) - 5,
             rng.standard_normal(192).astype(np.float32))
    tokens = rng.integers(0, 6561, args.tokens).tolist()

    prefill = [timed(device, lambda: engine.prompt_cache(*voice))[0] for _ in range(args.repeats)]
    prompt = engine.prompt_cache(*voice)
    report: dict[str, object] = {"device": str(device), "dtype": args.dtype, "size": args.size,
                                 "prompt_tokens": args.prompt_tokens, "tokens": args.tokens,
                                 "model_write_s": round(written, 2), "prefill_s": round(statistics.median(prefill), 4)}
    if args.graph_prompt_frames is not None:
        engine.use_graph_buckets(DiTGraphBuckets.covering([engine.schedule], engine.flow.config,
                                                          args.graph_prompt_frames))
    captured = engine.graphs
    engine.graphs = DiTStepGraphs(engine.flow.decoder, DiTGraphBuckets())  # no bucket: every call eager
    levels = streaming_levels(engine, prompt, tokens, args.concurrency, args.repeats, device)
    report["streaming"] = levels
    offline = [timed(device, lambda: engine.offline(tokens, *voice, engine.new_generator(0)))[0]
               for _ in range(args.repeats + 1)][1:]
    report["offline_rtf"] = round(statistics.median(offline) / (args.tokens / TOKEN_RATE), 4)
    engine.graphs = captured
    captured.emulate = device.type != "cuda"  # a CPU run checks the bucket path (static buffers, padding) only
    seconds, count = timed(device, lambda: captured.capture_all(device, engine.flow_dtype))
    replayed = streaming_levels(engine, prompt, tokens, args.concurrency, args.repeats, device)
    report["graphs"] = {"emulated": captured.emulate, "captured": count, "capture_s": round(seconds, 2),
                        "static_buffer_bytes": captured.static_bytes(),
                        "buckets": {"rows": captured.buckets.rows, "chunk_frames": captured.buckets.chunk_frames,
                                    "cache_frames": captured.buckets.cache_frames},
                        "streaming": replayed}
    print(json.dumps(report, indent=1))
    print(f"\n{'streams':>7} | {'first chunk s (eager / graphs)':>30} | {'steady call s (eager / graphs)':>30} | "
          f"{'s per audio s (eager / graphs)':>30}")
    for c in args.concurrency:
        e, g = levels[c], replayed[c]
        print(f"{c:>7} | {e['first_chunk_s']:>14} / {g['first_chunk_s']:<13} | {str(e['steady_call_s']):>14} / "
              f"{str(g['steady_call_s']):<13} | {e['steady_s_per_audio_s']:>14} / {g['steady_s_per_audio_s']:<13}")

if __name__ == "__main__":
    main()
