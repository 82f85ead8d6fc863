"""Speed of the Spark-TTS engine at the released size, with random weights.

Writes a full-size random model (spark_tts.testing.write_full_size_random_model) to a temp dir (or uses
--model-dir), loads it (default: LLM bf16 on CUDA, BiCodec/wav2vec2 fp32), and measures in benchmark mode (a fixed
number of LLM tokens per request, since random weights never stop sensibly):

- the audio tokenizer on one reference and on a masked batch of references;
- offline synthesis and streaming at concurrency 1 (first piece latency, RTF);
- concurrency N: N requests decoded together on one BatchedDecoder (continuous batching), their stream windows
  vocoded together (StreamPlan + vocode_batch) in one loop: first-piece latency per request, RTF, ms per step.

That the engine computes the right thing on a GPU is a test: tests/gpu/test_spark.py.

    PYTHONUNBUFFERED=1 python -m enginebench.spark_engine --tokens 250 --concurrency 1 4 16
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

from speech_lm.decode import BatchedDecoder
from enginebench.timing import sync, timed
from spark_tts.engine import SparkTTS
from spark_tts.llm import SparkSampling, spark_request
from spark_tts.streaming import ChunkSchedule, StreamPlan
from spark_tts.testing import write_full_size_random_model, write_tiny_model

TEXT = "This sentence only sets the prompt length; benchmark mode fixes the number of generated tokens."
TOKENS_PER_SECOND = 50




def reference(seconds: float, seed: int = 0) -> np.ndarray:
    t = np.arange(int(seconds * 16000)) / 16000
    rng = np.random.default_rng(seed)
    return (0.3 * np.sin(2 * np.pi * (150 + 20 * seed) * t) + 0.02 * rng.standard_normal(t.size)).astype(np.float32)




def concurrent_streams(engine: SparkTTS, prompts: list[list[int]], tokens: int, schedule: ChunkSchedule,
                       device: torch.device) -> dict[str, float]:
    """All requests start together on one decoder; windows of all streams vocoded per step in one batch."""
    decoder = BatchedDecoder(engine.lm, num_slots=len(prompts), max_seq_len=max(map(len, prompts)) + tokens + 1)
    sampling = SparkSampling(max_new_tokens=tokens)
    voice_globals = [list(range(32))] * len(prompts)
    sync(device)
    start = time.perf_counter()
    slots = decoder.add_many([spark_request(p, sampling, seed=i, ignore_eos=True) for i, p in enumerate(prompts)])
    index = {slot: i for i, slot in enumerate(slots)}
    codes: list[list[int]] = [[] for _ in prompts]
    plans = [StreamPlan(engine.radius, schedule) for _ in prompts]
    first: list[float | None] = [None] * len(prompts)
    steps = 0
    while decoder.active_slots or not all(p.finished for p in plans):
        finished = set()
        if decoder.active_slots:
            steps += 1
            for slot, out in decoder.step().items():
                i = index[slot]
                if out.token is not None:
                    codes[i] += engine.codes_of(out.token)
                if out.finished:
                    finished.add(i)
        jobs = []
        for i, plan in enumerate(plans):
            if plan.finished:
                continue
            done = i in finished or not decoder.active_slots
            windows = plan.finish(len(codes[i])) if done else plan.advance(len(codes[i]))
            jobs += [(i, w) for w in windows]
        if jobs:
            waves = engine.vocode_batch([(voice_globals[i], codes[i][w.lo : w.hi]) for i, w in jobs])
            sync(device)
            now = time.perf_counter() - start
            for (i, _), _wave in zip(jobs, waves):
                if first[i] is None:
                    first[i] = now
    total = time.perf_counter() - start
    audio_seconds = sum(len(c) for c in codes) / TOKENS_PER_SECOND
    return {"first_piece_p50_s": statistics.median(first), "first_piece_max_s": max(first),
            "wall_s": total, "rtf": total / (audio_seconds / len(prompts)), "ms_per_step": 1000 * total / steps}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", type=Path, help="an existing model directory (default: write a random one)")
    parser.add_argument("--tiny", action="store_true", help="a tiny random model instead of the released size")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bf16", choices=["fp32", "bf16", "fp16"], help="LLM precision")
    parser.add_argument("--tokens", type=int, default=250, help="LLM tokens per request (50 = 1 s of audio)")
    parser.add_argument("--reference-seconds", type=float, default=5.0)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--first-chunk-tokens", type=int, default=50)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    torch.backends.cuda.matmul.allow_tf32 = True  # speed check, not parity
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model_dir or (write_tiny_model(tmp) if args.tiny else write_full_size_random_model(tmp))
        load_s, engine = timed(device, lambda: SparkTTS.load(model_dir, device=device, llm_dtype=dtype))
    torch.set_grad_enabled(False)
    report: dict = {"device": str(device), "llm_dtype": args.dtype, "tokens": args.tokens, "load_s": load_s,
                    "receptive_radius": engine.radius}
    refs = [reference(args.reference_seconds * (0.6 + 0.1 * i), seed=i) for i in range(8)]
    engine.prepare_voices(refs[:1], ["warm up"])
    report["tokenize_1_s"] = timed(device, lambda: engine.prepare_voices(refs[:1], ["x"]))[0]
    report["tokenize_8_masked_s"] = timed(device, lambda: engine.prepare_voices(refs, ["x"] * 8))[0]
    [voice] = engine.prepare_voices(refs[:1], ["A transcript of the reference audio."])
    engine.set_fixed_token_count(args.tokens)
    schedule = ChunkSchedule(first_chunk_tokens=args.first_chunk_tokens)
    list(engine.stream(voice, TEXT, seed=0, schedule=schedule))  # warm-up (CUDA graphs, allocator)
    offline_s, audio = timed(device, lambda: engine.synthesize(voice, TEXT, seed=1))
    report["offline_c1"] = {"wall_s": offline_s, "audio_s": audio.size / 16000,
                            "rtf": offline_s / (audio.size / 16000)}
    sync(device)
    start, first = time.perf_counter(), None
    samples = 0
    for piece in engine.stream(voice, TEXT, seed=2, schedule=schedule):
        first = first if first is not None else time.perf_counter() - start
        samples += piece.size
    report["stream_c1"] = {"first_piece_s": first, "wall_s": time.perf_counter() - start, "audio_s": samples / 16000}
    vocode_s = timed(device, lambda: engine.vocode(voice.global_tokens, list(range(args.tokens))))[0]
    report["vocode_offline_s"] = vocode_s
    prompt = engine.prompt_ids(voice, TEXT)
    report["prompt_tokens"] = len(prompt)
    for n in args.concurrency:
        report[f"concurrent_c{n}"] = concurrent_streams(engine, [prompt] * n, args.tokens, schedule, device)
    print(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
