"""Speed check of the DiT token2wav at the released size, with random weights (token2wav only, no LLM).

Writes a released-size random `token2wav/` directory (flow.yaml, flow.pt, hift.pt; `--size micro` for a quick CPU
run), loads it, computes one prompt cache, then measures with `c` concurrent streams whose chunks run together
(`DiTToken2Wav.run_chunks`):
- prefill: the prompt cache (once per voice);
- first chunk: 15 + 3 tokens for every stream (flow + HiFT);
- steady chunks: the following chunks (hops 25, 50, 100) per second of audio they emit;
- offline: `offline` of `--tokens` tokens, real-time factor.
Prints one JSON object.

    PYTHONUNBUFFERED=1 python -m scripts.dit_gpu_check --device cuda --dtype fp32 --concurrency 1 4 16
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

from cosyvoice2.dit.loading import load_dit_token2wav
from cosyvoice2.testing.dit import MICRO_HIFT, micro_dit_config, write_dit_model, write_full_size_random_dit
from scripts.gpu_timing import timed

TOKEN_RATE = 25




def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "fp16", "bf16"])
    parser.add_argument("--size", default="released", choices=["released", "micro"])
    parser.add_argument("--prompt-tokens", type=int, default=75, help="3 s prompt")
    parser.add_argument("--tokens", type=int, default=250, help="generated tokens per stream (10 s)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    device = torch.device(args.device)
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
    levels = {}
    for c in args.concurrency:
        first, steady, steady_audio = [], 0.0, 0
        for repeat in range(args.repeats + 1):  # the first round warms up (allocator, kernels)
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
                index += 1
        levels[c] = {"first_chunk_s": round(statistics.median(first), 4),
                     "steady_s_per_audio_s": round(steady / max(steady_audio / engine.sample_rate, 1e-9), 4)}
    report["streaming"] = levels
    offline = [timed(device, lambda: engine.offline(tokens, *voice, engine.new_generator(0)))[0]
               for _ in range(args.repeats + 1)][1:]
    report["offline_rtf"] = round(statistics.median(offline) / (args.tokens / TOKEN_RATE), 4)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
