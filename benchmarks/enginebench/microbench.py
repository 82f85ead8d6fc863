"""Engine micro-benchmarks at the released size with random weights (no model files): LLM prefill and decode step,
flow per call, HiFT per call, eager against CUDA graphs, the implied streaming first-chunk latency, and batched
token2wav (flow + HiFT for many streams' first chunks or many offline utterances in one call).

    PYTHONUNBUFFERED=1 python -m enginebench.microbench --device cuda --dtype bf16 --json bench.json

Every number is wall-clock per call with a device sync at the end (what a caller waits for), over `--repeats`
calls after warm-up; tables give p50 / p90 / max in milliseconds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Callable

import torch

import speech_lm.kernels
from cosyvoice2.config import EngineConfig, resolve_dtype
from cosyvoice2.flow import CausalFlow, FlowConfig
from cosyvoice2.hift import HiFTConfig, HiFTGenerator
from cosyvoice2.hift.generator import HiFTBuckets
from cosyvoice2.llm import CosyVoice2LM, LLMConfig
from cosyvoice2.llm.request import CosyVoice2Sampling, cosyvoice2_request
from speech_lm.decode import BatchedDecoder, DecodeRequest
from cosyvoice2.streaming import FlowPrompt, Token2Wav

PROMPT_TOKENS = 150  # prompt speech tokens (6 s of reference audio)
TEXT_TOKENS = 50  # prompt transcript + target text tokens
FIRST_HOP, LOOKAHEAD = 25, 3
OFFLINE_TOKENS = 250


class Bench:
    def __init__(self, device: torch.device, repeats: int, warmup: int) -> None:
        self.device, self.repeats, self.warmup = device, repeats, warmup
        self.rows: list[dict] = []

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def time(self, section: str, case: str, variant: str, fn: Callable[[], object], repeats: int | None = None) -> dict:
        for _ in range(self.warmup):
            fn()
        samples = []
        for _ in range(repeats or self.repeats):
            self.sync()
            start = time.perf_counter()
            fn()
            self.sync()
            samples.append((time.perf_counter() - start) * 1e3)
        samples.sort()
        row = {"section": section, "case": case, "variant": variant, "n": len(samples),
               "p50": statistics.median(samples), "p90": samples[int(0.9 * (len(samples) - 1))], "max": samples[-1]}
        self.rows.append(row)
        print(f"  {section:<8} {case:<34} {variant:<8} p50 {row['p50']:8.3f}  p90 {row['p90']:8.3f}  "
              f"max {row['max']:8.3f} ms", flush=True)
        return row

    def p50(self, section: str, case: str, variant: str) -> float:
        return next(r["p50"] for r in self.rows
                    if (r["section"], r.get("case"), r.get("variant")) == (section, case, variant))


def copy_bandwidth(device: torch.device) -> float:
    """Device-to-device copy, bytes read + written per second (the memory ceiling)."""
    src = torch.randn(256 * 1024 * 1024, device=device)  # 1 GiB
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(10):
        dst.copy_(src)
    torch.cuda.synchronize(device)
    return 2 * src.numel() * 4 * 10 / (time.perf_counter() - start)


def kernel_profile(device: torch.device, fn: Callable[[], object], top: int = 8) -> dict:
    """Kernels launched by one call of `fn`: count, summed GPU time (busy) and the costliest kernel names."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize(device)
    by_name: dict[str, float] = {}
    count = 0
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            count += 1
            by_name[event.name[:60]] = by_name.get(event.name[:60], 0.0) + event.time_range.elapsed_us() / 1e3
    busiest = sorted(by_name.items(), key=lambda kv: -kv[1])[:top]
    return {"kernels": count, "busy_ms": sum(by_name.values()), "top": busiest}


def report_profile(bench: "Bench", section: str, case: str, profile_: dict) -> None:
    print(f"  {section} {case}: {profile_['kernels']} kernels, {profile_['busy_ms']:.3f} ms of kernel time; top:",
          flush=True)
    for name, ms in profile_["top"]:
        print(f"      {ms:8.3f} ms  {name}", flush=True)
    bench.rows.append({"section": section, "case": f"profile {case}", **profile_})


def variants(device: torch.device) -> list[tuple[str, bool]]:
    """(name, use CUDA graphs) pairs measured on `device`."""
    return [("eager", False), ("graph", True)] if device.type == "cuda" else [("eager", False)]


def decode_request(index: int) -> DecodeRequest:
    text = [1000 + (index + i) % 5000 for i in range(TEXT_TOKENS)]
    speech = [(7 * index + 13 * i) % 6561 for i in range(PROMPT_TOKENS)]
    # benchmark mode per request: no stop id is ever drawn, the slot keeps decoding up to max_tokens
    return cosyvoice2_request(text[20:], text[:20], speech,
                              CosyVoice2Sampling(seed=index, max_tokens=1200, ignore_eos=True))


PREFILL_BATCHES = (1, 8, 16)


def bench_llm(bench: Bench, dtype: torch.dtype, batches: list[int], max_seq_len: int) -> None:
    """Eager and CUDA-graph decoders; where the time of one step goes (kernel profile)."""
    device = bench.device
    fused = "Triton" if speech_lm.kernels._triton_kernels() is not None else "PyTorch fallback (triton missing)"
    print(f"LLM (Qwen2 0.5B body, fused q|k|v and gate|up, static KV cache; add+RMSNorm and SiLU*up: {fused})",
          flush=True)
    with torch.device(device):
        llm = CosyVoice2LM(LLMConfig()).to(dtype).eval()
    weight_bytes = sum(p.numel() * p.element_size() for n, p in llm.named_parameters() if "embed" not in n)
    print(f"  weights read per step: {weight_bytes / 1e6:.0f} MB", flush=True)

    slots = max(batches)
    decoders = {}
    for variant, graphs in variants(device):
        start = time.perf_counter()
        decoders[variant] = BatchedDecoder(llm, num_slots=slots, max_seq_len=max_seq_len, cuda_graphs=graphs)
        bench.sync()
        print(f"  {variant} decoder with {slots} slots built in {time.perf_counter() - start:.1f} s "
              f"(buckets {decoders[variant].buckets})", flush=True)

    def prefill(decoder: BatchedDecoder, batch: int) -> None:
        for slot in decoder.add_many([decode_request(i) for i in range(batch)]):
            decoder.remove(slot)

    prefix = decode_request(0).prefix_length
    # add_many: eager, one right-padded forward of the batch; with graphs, one prefill graph replay per request
    for batch in (b for b in PREFILL_BATCHES if b <= slots):
        for variant, decoder in decoders.items():
            bench.time("llm", f"prefill {prefix} tokens x {batch}", variant, lambda: prefill(decoder, batch))
    if device.type == "cuda":
        report_profile(bench, "llm", f"prefill {prefix} tokens x 1",
                       kernel_profile(device, lambda: prefill(decoders["eager"], 1)))

    for batch in batches:
        for variant, decoder in decoders.items():
            for slot in decoder.active_slots:
                decoder.remove(slot)
            decoder.add_many([decode_request(i) for i in range(batch)])
            bench.time("llm", f"decode step batch {batch}", variant, decoder.step, repeats=bench.repeats)
            assert len(decoder.active_slots) == batch, "a slot stopped during the benchmark"
    if device.type == "cuda":  # where a graph replay's time goes: kernels vs launch gaps
        decoder = decoders["eager"]
        for batch in (1, max(batches)):
            for slot in decoder.active_slots:
                decoder.remove(slot)
            decoder.add_many([decode_request(i) for i in range(batch)])
            report_profile(bench, "llm", f"decode step batch {batch}", kernel_profile(device, decoder.step))
    del decoders, llm


def flow_cases() -> list[tuple[str, int, bool]]:
    """(name, tokens fed to the flow, final) for the streaming chunk calls and an offline call."""
    pad = -PROMPT_TOKENS % FIRST_HOP
    first = FIRST_HOP + pad
    return [
        (f"stream chunk 1 ({first}+{LOOKAHEAD} tok)", first + LOOKAHEAD, False),
        (f"stream chunk 2 (hop 50, {first + 50 + LOOKAHEAD} tok)", first + 50 + LOOKAHEAD, False),
        (f"stream chunk 3 (hop 100, {first + 150 + LOOKAHEAD} tok)", first + 150 + LOOKAHEAD, False),
        ("offline 250 tok", 250, True),
    ]


def random_flow(config: FlowConfig, device: torch.device, dtype: torch.dtype) -> CausalFlow:
    with torch.device(device):
        flow = CausalFlow(config).to(dtype).eval()
    flow.decoder.rand_noise = flow.decoder.rand_noise.to(device)
    return flow


def random_hift(config: HiFTConfig, device: torch.device) -> HiFTGenerator:
    hift = HiFTGenerator(config)
    hift.fold_weight_norm()
    return hift.to(device).eval()


def random_voice(config: FlowConfig, device: torch.device, dtype: torch.dtype, key: str | None = None,
                 prompt_tokens: int = PROMPT_TOKENS, seed: int = 0) -> FlowPrompt:
    """A random voice prompt: `prompt_tokens` speech tokens, their mel, an x-vector (cached by `key` when given)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    return FlowPrompt(torch.randint(0, config.vocab_size, (1, prompt_tokens), device=device, generator=gen),
                      torch.randn(1, 2 * prompt_tokens, 80, device=device, generator=gen).to(dtype),
                      torch.randn(1, 192, device=device, generator=gen).to(dtype), key=key)


def random_tokens(config: FlowConfig, n: int, seed: int = 1) -> list[int]:
    """`n` random speech tokens (a fixed draw per seed)."""
    return torch.randint(0, config.vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def bench_flow(bench: Bench, dtype: torch.dtype) -> None:
    """Eager and CUDA-graph CFM loops (the encoder runs eagerly in both)."""
    device = bench.device
    print(f"Flow (prompt {PROMPT_TOKENS} tokens, CFM 10 Euler steps with CFG)", flush=True)
    flow = random_flow(FlowConfig(), device, dtype)
    gen = torch.Generator(device=device).manual_seed(0)
    prompt_token = torch.randint(0, 6561, (1, PROMPT_TOKENS), device=device, generator=gen)
    prompt_feat = torch.randn(1, 2 * PROMPT_TOKENS, 80, device=device, generator=gen).to(dtype)
    xvector = torch.randn(1, 192, device=device, generator=gen).to(dtype)
    graphs = flow.decoder.cuda_graphs
    for name, tokens, final in flow_cases():
        token = torch.randint(0, 6561, (1, tokens), device=device, generator=gen)

        def call() -> torch.Tensor:
            return flow.inference(token, prompt_token, prompt_feat, xvector, streaming=not final, finalize=final)

        with torch.inference_mode():
            bench.time("flow", f"{name} encoder", "eager", lambda: flow.encode(token, prompt_token, not final, final),
                       repeats=max(3, bench.repeats // 4))
        flow.decoder.cuda_graphs = None
        bench.time("flow", name, "eager", call, repeats=max(3, bench.repeats // 4))
        if device.type == "cuda" and name == flow_cases()[0][0]:
            report_profile(bench, "flow", name, kernel_profile(device, call))
        flow.decoder.cuda_graphs = graphs
        if device.type != "cuda":
            continue
        start = time.perf_counter()
        call()  # first call of a frame bucket captures its graph
        bench.sync()
        print(f"  graph capture for {name}: {time.perf_counter() - start:.2f} s", flush=True)
        bench.time("flow", name, "graph", call)
    del flow


def hift_frames() -> list[tuple[str, int]]:
    """(name, mel frames) HiFT sees: chunks carry the previous chunk's last 8 frames, 2 frames per token."""
    first = FIRST_HOP + (-PROMPT_TOKENS % FIRST_HOP)
    return [(f"stream chunk 1 ({first} tok)", 2 * first), ("stream chunk 2 (50 tok)", 100 + 8),
            ("stream chunk 3 (100 tok)", 200 + 8), ("offline 250 tok", 500)]


def bench_hift(bench: Bench) -> None:
    device = bench.device
    print("HiFT (fp32, weight norm folded)", flush=True)
    hift = random_hift(HiFTConfig(), device)
    graphs = hift.cuda_graphs
    if device.type == "cuda":  # one graph per case, each call exactly its bucket (no cache source: 0 samples)
        graphs.use_buckets(HiFTBuckets.covering([frames for _, frames in hift_frames()], rows=(1,), cache_samples=0,
                                                frame_step=1))
        start = time.perf_counter()
        count = graphs.capture_all(device)
        print(f"  {count} HiFT graphs captured in {time.perf_counter() - start:.2f} s", flush=True)
    gen = torch.Generator(device=device).manual_seed(0)
    for name, frames in hift_frames():
        mel = torch.randn(1, 80, frames, device=device, generator=gen)
        for variant, _ in variants(device):
            hift.cuda_graphs = graphs if variant == "graph" else None
            bench.time("hift", name, variant, lambda: hift.inference(mel, generator=gen))


def bench_token2wav(bench: Bench, dtype: torch.dtype, streams: list[int], offline: list[int],
                    config: EngineConfig = EngineConfig()) -> None:
    """Batched token2wav (`Token2Wav.run_chunks`: one flow forward per attention mode + one HiFT forward):
    the first chunks of N fresh streams, and N offline utterances, per call; graphs on CUDA."""
    device = bench.device
    print(f"Batched token2wav (flow {dtype}, HiFT fp32; prompts ~{PROMPT_TOKENS} tokens)", flush=True)
    engine = Token2Wav(random_flow(config.flow, device, dtype), random_hift(config.hift, device), config,
                       flow_cache="off")
    engine.capture_hift_graphs()  # as a server does (offline utterances longer than the buckets stay eager)
    gen = torch.Generator(device=device).manual_seed(0)
    vocab = config.flow.vocab_size

    def prompt(tokens: int) -> FlowPrompt:
        return FlowPrompt(torch.randint(0, vocab, (1, tokens), device=device, generator=gen),
                          torch.randn(1, 2 * tokens, 80, device=device, generator=gen).to(dtype),
                          torch.randn(1, 192, device=device, generator=gen).to(dtype))

    def tokens(n: int) -> list[int]:
        return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(n)).tolist()

    def first_chunks(prompts: list[FlowPrompt]) -> list:
        work = []
        for i, flow_prompt in enumerate(prompts):
            stream = engine.open_stream(flow_prompt, engine.new_generator(i))
            stream.extend(tokens(FIRST_HOP + (-flow_prompt.num_tokens % FIRST_HOP) + LOOKAHEAD))
            work.append((stream, stream.next_chunk(finished=False)))
        return work

    same = [prompt(PROMPT_TOKENS) for _ in range(max(streams + offline))]
    # prompts of 150..178 tokens: first hops of 25..47 tokens, so the rows differ in length
    mixed = [prompt(PROMPT_TOKENS + 7 * (i % 5)) for i in range(max(streams))]
    for n in streams:
        row = bench.time("t2w", f"first chunks x {n} (same prompt length)", "graph",
                         lambda: engine.run_chunks(first_chunks(same[:n])))
        print(f"    per stream {row['p50'] / n:.2f} ms", flush=True)
    for n in streams:
        if n > 1:
            bench.time("t2w", f"first chunks x {n} (mixed prompt lengths)", "graph",
                       lambda: engine.run_chunks(first_chunks(mixed[:n])))
    for n in offline:
        lengths = [OFFLINE_TOKENS - 20 + (40 * i) // max(1, n - 1) for i in range(n)]  # ~250 tokens each
        utterances = [(tokens(length), same[i]) for i, length in enumerate(lengths)]
        row = bench.time("t2w", f"offline x {n} (~{OFFLINE_TOKENS} tok)", "graph", lambda: engine.run_chunks(
            [engine.offline_job(t, p, engine.new_generator(i)) for i, (t, p) in enumerate(utterances)]))
        audio_s = sum(lengths) * config.samples_per_token / config.sample_rate
        print(f"    RTF of the call {row['p50'] / 1e3 / audio_s:.4f} ({audio_s:.0f} s of audio)", flush=True)
    del engine


def advanced_streams(engine: Token2Wav, voice: FlowPrompt, tokens: list[int], n: int, chunks: int) -> list:
    """`n` fresh streams of `voice` over `tokens`, each already run through `chunks` chunks, with their next
    chunk: the work list of one `run_chunks` call (the advancing is not part of it)."""
    work = []
    for i in range(n):
        stream = engine.open_stream(voice, engine.new_generator(i))
        stream.extend(tokens)
        for _ in range(chunks):
            engine.run_chunks([(stream, stream.next_chunk(finished=False))])
        work.append((stream, stream.next_chunk(finished=False)))
    return work


def bench_flow_cache(bench: Bench, dtype: torch.dtype, streams: list[int], modes: list[str],
                     config: EngineConfig = EngineConfig()) -> None:
    """Streaming chunks with and without flow caches (`Token2Wav(flow_cache=...)`): N streams' first chunks
    (the voice prefix already cached), and N streams' 4th chunk (100 new tokens after 185: the cost that grew
    with the history). Each timed call starts from freshly advanced streams (the advancing is not timed)."""
    device = bench.device
    print(f"Streaming flow caches (flow {dtype}; prompt {PROMPT_TOKENS} tokens, one voice)", flush=True)
    flow, hift = random_flow(config.flow, device, dtype), random_hift(config.hift, device)
    voice = random_voice(config.flow, device, dtype, key="bench-voice")
    tokens = random_tokens(config.flow, 400)
    for mode in modes:
        engine = Token2Wav(flow, hift, config, flow_cache=mode)
        engine.capture_hift_graphs()  # (again: a new engine sets HiFT's buckets anew)
        if mode != "off":
            start = time.perf_counter()
            graphs = engine.cached.solve_graphs.capture_all(device, dtype) if engine.cached.solve_graphs else 0
            torch.cuda.synchronize(device)
            print(f"  {mode}: captured {graphs} step graphs in {time.perf_counter() - start:.1f} s, graph pool "
                  f"{torch.cuda.memory_stats(device).get('allocated_bytes.all.current', 0) / 2**30:.1f} GiB in use",
                  flush=True)
            engine.prefix(voice)

        for label, chunks in (("first chunk", 0), ("4th chunk (100 tok after 185)", 3)):
            for n in streams:
                samples = []
                work: list = []
                for repeat in range(bench.warmup + max(3, bench.repeats // 5)):
                    del work[:]  # free the previous streams' caches before building new ones
                    work = advanced_streams(engine, voice, tokens, n, chunks)
                    bench.sync()
                    start = time.perf_counter()
                    engine.run_chunks(work)
                    bench.sync()
                    if repeat >= bench.warmup:
                        samples.append((time.perf_counter() - start) * 1e3)
                samples.sort()
                row = {"section": "t2w-cache", "case": f"{label} x {n}", "variant": mode, "n": len(samples),
                       "p50": statistics.median(samples), "p90": samples[int(0.9 * (len(samples) - 1))],
                       "max": samples[-1]}
                bench.rows.append(row)
                print(f"  {label} x {n:<3} {mode:<8} p50 {row['p50']:8.3f}  p90 {row['p90']:8.3f}  "
                      f"max {row['max']:8.3f} ms", flush=True)
        del engine


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bf16", help="LLM + flow dtype (HiFT is always fp32)")
    parser.add_argument("--batches", default="1,8,32,64")
    parser.add_argument("--max-seq-len", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--only", default="llm,flow,hift,t2w,t2w-cache",
                        help="comma list of llm, flow, hift, t2w, t2w-cache")
    parser.add_argument("--t2w-streams", default="1,4,8,16,32", help="streams per batched first-chunk call")
    parser.add_argument("--t2w-offline", default="8,32", help="utterances per batched offline call")
    parser.add_argument("--flow-cache-modes", default="off,exact", help="modes compared in the t2w-cache section")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type != "cuda":
        raise SystemExit("this benchmark measures CUDA graphs and needs a CUDA device")
    dtype = resolve_dtype(args.dtype)
    bench = Bench(device, args.repeats, args.warmup)
    props = torch.cuda.get_device_properties(device)
    bandwidth = copy_bandwidth(device)
    print(f"{props.name}, torch {torch.__version__}, copy bandwidth {bandwidth / 1e12:.2f} TB/s", flush=True)
    only = set(args.only.split(","))
    with torch.inference_mode():
        if "llm" in only:
            bench_llm(bench, dtype, [int(b) for b in args.batches.split(",")], args.max_seq_len)
        if "flow" in only:
            bench_flow(bench, dtype)
        if "hift" in only:
            bench_hift(bench)
        if "t2w" in only:
            bench_token2wav(bench, dtype, [int(n) for n in args.t2w_streams.split(",")],
                            [int(n) for n in args.t2w_offline.split(",")])
        if "t2w-cache" in only:
            bench_flow_cache(bench, dtype, [int(n) for n in args.t2w_streams.split(",")],
                             args.flow_cache_modes.split(","))

    print("\n| section | case | variant | p50 ms | p90 ms | max ms |\n|---|---|---|---|---|---|")
    for row in bench.rows:
        if "p50" in row:
            print(f"| {row['section']} | {row['case']} | {row['variant']} | {row['p50']:.3f} | {row['p90']:.3f} "
                  f"| {row['max']:.3f} |")
    if {"llm", "flow", "hift"} <= only:
        first_tokens = FIRST_HOP + (-PROMPT_TOKENS % FIRST_HOP) + LOOKAHEAD
        flow_case, hift_case = flow_cases()[0][0], hift_frames()[0][0]
        parts = {variant: {
            "prefill": bench.p50("llm", f"prefill {decode_request(0).prefix_length} tokens x 1", "eager"),
            f"{first_tokens} decode steps": first_tokens * bench.p50("llm", "decode step batch 1", variant),
            "flow": bench.p50("flow", flow_case, variant),
            "hift": bench.p50("hift", hift_case, variant),
        } for variant in ("eager", "graph")}
        print("\nImplied streaming first chunk at batch 1 (p50 parts):")
        for variant, part in parts.items():
            detail = " + ".join(f"{k} {v:.1f}" for k, v in part.items())
            print(f"  {variant}: {detail} = {sum(part.values()):.1f} ms")
        bench.rows.append({"section": "first_chunk", "parts": parts})
    if args.json:
        args.json.write_text(json.dumps({"device": props.name, "torch": torch.__version__,
                                         "copy_bandwidth": bandwidth, "rows": bench.rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
