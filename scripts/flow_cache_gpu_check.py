"""GPU check of the chunk-cached streaming flow at the released size (random weights, no model files).

For streams of several chunks (one voice; rows at different points batched together), the cached path's mel -
replayed from CUDA graphs where the call fits a bucket - must equal recomputing prompt + history for every
non-final chunk (fp32: within 5e-5 absolute here too; bf16 is reported, not checked). Also prints how long
capturing every step-graph bucket took.

    PYTHONUNBUFFERED=1 python -m scripts.flow_cache_gpu_check --dtype fp32
"""

from __future__ import annotations

import argparse
import time

import torch

from cosyvoice2.config import resolve_dtype
from cosyvoice2.flow import CausalFlow, FlowConfig
from cosyvoice2.flow.cached import CachedFlowRunner, CachedRow, CachedSegment
from cosyvoice2.streaming import ChunkSchedule


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="fp32")
    parser.add_argument("--prompt-tokens", type=int, default=150)
    parser.add_argument("--tokens", type=int, default=400)
    parser.add_argument("--streams", type=int, default=3)
    parser.add_argument("--capture-all", action="store_true", help="capture every bucket first (else on first use)")
    args = parser.parse_args()
    device, dtype = torch.device("cuda"), resolve_dtype(args.dtype)
    # fp32 means fp32: TF32 convolutions (cuDNN's default) alone differ by ~1e-3 between two call shapes
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(0)
    with torch.device(device):
        flow = CausalFlow(FlowConfig()).to(dtype).eval()
        for param in flow.parameters():  # default init plus offsets: no trivial norms
            param.data.add_(torch.randn_like(param) * 0.02)
    flow.decoder.rand_noise = flow.decoder.rand_noise.to(device)
    flow.decoder.cuda_graphs = None  # the reference recomputes eagerly
    parser_args = args
    runner = CachedFlowRunner(flow)
    if parser_args.capture_all:  # what a server does at start-up (fp32 graphs of every bucket need ~45 GiB)
        start = time.perf_counter()
        with torch.inference_mode():
            captured = runner.graphs.capture_all(device, dtype)
        torch.cuda.synchronize()
        print(f"captured {captured} step graphs in {time.perf_counter() - start:.1f} s", flush=True)

    gen = torch.Generator(device=device).manual_seed(1)
    prompt_tokens = torch.randint(0, 6561, (args.prompt_tokens,), device=device, generator=gen)
    prompt_mel = torch.randn(2 * args.prompt_tokens, 80, device=device, generator=gen).to(dtype)
    xvector = torch.randn(1, 192, device=device, generator=gen).to(dtype)
    tokens = [torch.randint(0, 6561, (args.tokens,), device=device, generator=gen) for _ in range(args.streams)]
    schedule = ChunkSchedule(prompt_tokens=args.prompt_tokens)
    chunks = [c for c in schedule.chunks(args.tokens) if not c.final]
    with torch.inference_mode():
        spks = runner.project_speaker(xvector)[0]
        prefix = runner.prefix(prompt_tokens, prompt_mel, spks)
        owns = [CachedSegment() for _ in range(args.streams)]
        worst = 0.0
        # stream s runs chunk i at round i + s, so each call mixes rows at different points of their streams
        for round_ in range(len(chunks) + args.streams - 1):
            work = [(s, chunks[round_ - s]) for s in range(args.streams) if 0 <= round_ - s < len(chunks)]
            rows = [CachedRow(torch.cat([prompt_tokens, tokens[s][: c.feed]]), prompt_mel, spks, prefix, owns[s],
                              stop=args.prompt_tokens + c.stop, final=False, keep=True,
                              emit_from=args.prompt_tokens + c.start) for s, c in work]
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            mels = runner.run(rows)
            torch.cuda.synchronize()
            elapsed = (time.perf_counter() - t0) * 1e3
            for (s, c), mel in zip(work, mels):
                ref = flow.inference(tokens[s][None, : c.feed], prompt_tokens[None], prompt_mel[None], xvector,
                                     streaming=True, finalize=False)[0, :, 2 * c.start :]
                diff = (mel - ref.float()).abs().max().item()
                worst = max(worst, diff)
                print(f"  round {round_} stream {s} chunk {c.start}-{c.stop}: frames {mel.shape[1]} "
                      f"max |cached - recompute| {diff:.2e}", flush=True)
            print(f"  round {round_}: {len(rows)} rows in {elapsed:.1f} ms", flush=True)
    print(f"worst deviation {worst:.2e} ({args.dtype})")
    if dtype == torch.float32 and worst > 5e-5:
        print("FAIL: cached streaming flow differs from recompute")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
