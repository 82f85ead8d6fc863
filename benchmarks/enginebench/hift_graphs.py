"""HiFT's CUDA graphs at the released size (random weights): the buckets a token2wav server captures for the served
chunk schedules, how long the capture takes and what memory it holds, and the time per HiFT call eagerly and
replayed at a few (rows, mel frames) the service forms.

    PYTHONUNBUFFERED=1 python -m enginebench.hift_graphs --device cuda --json hift.json

`--frame-step` sets the buckets' mel-frame step (the server's is `cosyvoice2.hift.generator.FRAME_STEP`).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from cosyvoice2.config import EngineConfig
from cosyvoice2.hift import HiFTConfig, HiFTGenerator
from cosyvoice2.hift.generator import FRAME_STEP, HiFTBuckets
from cosyvoice2.streaming import hift_buckets
from enginebench.microbench import Bench
from speech_serving.schedule import StreamScheduleParams, for_every_prompt

MAX_ROWS = 16  # the service's cap: the flow graphs' largest row bucket
#: (rows, mel frames): a first chunk (hop 25 + 12 pad), a second one (50 + the 8 withheld frames), a steady one (100)
CALLS = [(rows, frames) for rows in (1, 4, 16) for frames in (74, 108, 208)]


def served_buckets(config: EngineConfig, frame_step: int) -> HiFTBuckets:
    """The buckets a server captures for the default schedules (`StreamScheduleParams()`), at `frame_step`."""
    buckets = hift_buckets(for_every_prompt(StreamScheduleParams().schedules(config)), MAX_ROWS,
                           config.flow.token_mel_ratio, config.streaming.mel_cache_len, config.hift.samples_per_frame)
    if frame_step == FRAME_STEP:
        return buckets
    return HiFTBuckets.covering(buckets.frames, buckets.rows, buckets.cache_samples, frame_step)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--frame-step", type=int, default=FRAME_STEP)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    device = torch.device(args.device)
    config = EngineConfig()
    hift = HiFTGenerator(HiFTConfig())
    hift.fold_weight_norm()
    hift = hift.to(device).eval()
    graphs = hift.cuda_graphs
    buckets = served_buckets(config, args.frame_step)
    graphs.use_buckets(buckets)
    torch.cuda.synchronize(device)
    allocated, reserved = torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device)
    started = time.perf_counter()
    count = graphs.capture_all(device)
    torch.cuda.synchronize(device)
    capture_s = time.perf_counter() - started
    report = {"device": torch.cuda.get_device_name(device), "frame_step": args.frame_step, "rows": buckets.rows,
              "frames": buckets.frames, "cache_samples": buckets.cache_samples, "graphs": count,
              "capture_s": round(capture_s, 2), "static_buffer_mib": graphs.buffer_bytes / 2**20,
              "allocated_mib": (torch.cuda.memory_allocated(device) - allocated) / 2**20,
              "reserved_mib": (torch.cuda.memory_reserved(device) - reserved) / 2**20}
    print(json.dumps(report), flush=True)

    bench = Bench(device, args.repeats, warmup=3)
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.inference_mode():
        for rows, frames in CALLS:
            mels = [torch.randn(1, 80, frames, device=device, generator=gen) for _ in range(rows)]
            caches = [torch.randn(1, 1, buckets.cache_samples, device=device, generator=gen) for _ in range(rows)]
            noises = [hift.draw_noise(1, frames, gen) for _ in range(rows)]
            for variant in ("eager", "graph"):
                hift.cuda_graphs = graphs if variant == "graph" else None
                bench.time("hift", f"{rows} rows x {frames} frames", variant,
                           lambda: hift.inference_batch(mels, caches, noises))
    hift.cuda_graphs = graphs
    report["calls"] = bench.rows
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
