"""Speed of the CosyVoice2 engine at the released size, with random weights.

Writes a full-size random model (cosyvoice2.testing.write_full_size_random_model) to a temp dir, loads it
(default: bf16 on CUDA), runs offline and streaming synthesis in benchmark mode (a fixed number of speech
tokens per segment, since random weights never stop sensibly) and prints, per second of generated audio,
the time spent in the LLM, the flow and HiFT, plus the streaming first-chunk latency. That these calls give the
right audio at this size is a test: tests/gpu/test_engine.py.

    PYTHONUNBUFFERED=1 python -m enginebench.cosyvoice2_engine --tokens 250 --dtype bf16 --device cuda
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

import cosyvoice2
from cosyvoice2.config import resolve_dtype
from cosyvoice2.testing import write_full_size_random_model
from enginebench.timing import timed

TEXT = "This sentence only sets the text length; benchmark mode fixes the number of speech tokens."
TOKENS_PER_SECOND = 25




def prompt_wav(seconds: float, sample_rate: int = 16000) -> np.ndarray:
    t = np.arange(int(seconds * sample_rate)) / sample_rate
    return (0.3 * np.sin(2 * np.pi * 180 * t * (1 + 0.1 * t))).astype(np.float32)


def first_chunk_latency(device: torch.device, chunks) -> tuple[float, float, int]:
    """(seconds to the first chunk, seconds to the end, samples) of a streaming generator."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    first, samples = None, 0
    for chunk in chunks:
        if first is None:
            first = time.perf_counter() - start
        samples += len(chunk)
    return first or 0.0, time.perf_counter() - start, samples


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=250, help="speech tokens per request (25 per second)")
    parser.add_argument("--dtype", default="bf16", help="LLM + flow dtype: fp32, fp16, bf16")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompt-seconds", type=float, default=3.0)
    parser.add_argument("--model-dir", type=Path, help="reuse/write the random model here (default: temp dir)")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = resolve_dtype(args.dtype)
    model_dir = args.model_dir or Path(tempfile.mkdtemp(prefix="cosyvoice2_full_random_"))

    if not (model_dir / "llm.pt").is_file():
        seconds, _ = timed(torch.device("cpu"), lambda: write_full_size_random_model(model_dir, dtype))
        print(f"wrote full-size random model to {model_dir} in {seconds:.1f} s", flush=True)
    seconds, tts = timed(device, lambda: cosyvoice2.load(model_dir, device=device, dtype=dtype))
    print(f"loaded in {seconds:.1f} s ({args.dtype} on {device})", flush=True)

    prompt = tts.prepare_voice(prompt_wav(args.prompt_seconds), 16000, "A prompt transcript.")
    (segment,) = tts.segments(TEXT)
    tts.set_fixed_token_count(args.tokens)
    engine = tts.token2wav_engine
    flow_prompt = engine.flow_prompt(prompt)
    audio_seconds = args.tokens / TOKENS_PER_SECOND

    rows: dict[str, list[float]] = {"llm": [], "flow": [], "hift": [], "offline_total": [],
                                    "stream_first_chunk": [], "stream_total": []}
    for repeat in range(args.repeats + 1):  # the first pass warms up kernels/allocator and is not counted
        llm_s, tokens = timed(device, lambda: list(tts.speech_tokens(segment, prompt, seed=repeat)))
        assert len(tokens) == args.tokens, len(tokens)  # the per-second figures below assume it
        with torch.inference_mode():
            flow_s, mel = timed(device, lambda: engine.mel(tokens, flow_prompt, 0, final=True))
            hift_s, (audio, _) = timed(device, lambda: engine.vocode(mel, None, engine.new_generator(repeat)))
        total_s, full = timed(device, lambda: tts.synthesize(TEXT, prompt, seed=repeat))
        first_s, stream_s, samples = first_chunk_latency(device, tts.stream(TEXT, prompt, seed=repeat))
        assert len(full) == samples == args.tokens * 960 == audio.shape[0], (len(full), samples)
        assert np.isfinite(full).all()
        if repeat == 0:
            continue
        for key, value in (("llm", llm_s), ("flow", flow_s), ("hift", hift_s), ("offline_total", total_s),
                           ("stream_first_chunk", first_s), ("stream_total", stream_s)):
            rows[key].append(value)
        print(f"repeat {repeat}: llm {llm_s:.3f} s, flow {flow_s:.3f} s, hift {hift_s:.3f} s, "
              f"offline {total_s:.3f} s, stream first chunk {first_s:.3f} s / total {stream_s:.3f} s", flush=True)

    medians = {key: statistics.median(values) for key, values in rows.items()}
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"\nCosyVoice2 full-size random weights, {args.dtype} on {name}; {args.tokens} tokens = "
          f"{audio_seconds:.1f} s audio per request, prompt {len(prompt.speech_tokens)} tokens; "
          f"median of {args.repeats}")
    print("| stage | seconds per request | seconds per second of audio |")
    print("|---|---|---|")
    for key in ("llm", "flow", "hift", "offline_total", "stream_total"):
        print(f"| {key} | {medians[key]:.3f} | {medians[key] / audio_seconds:.4f} |")
    print(f"| stream_first_chunk (latency) | {medians['stream_first_chunk']:.3f} | - |")
    if args.json:
        args.json.write_text(json.dumps({"device": name, "dtype": args.dtype, "tokens": args.tokens,
                                         "audio_seconds": audio_seconds, "median_seconds": medians,
                                         "all_seconds": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
