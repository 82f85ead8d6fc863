"""``tts-bench``: argument parsing and wiring; every computation lives in the other modules."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gateway.settings import SHIPPED_VOICES_DIR
from ttsbench.inputs import (
    SEED_TTS_DATASET,
    SEED_TTS_DEFAULT_SPLIT,
    BenchRequest,
    InputError,
    default_requests,
    load_manifest,
    load_seed_tts,
    prepare_requests,
)
from ttsbench.report import LevelSummary, render_report, report_document, summarize_level
from ttsbench.runner import Target, run_level
from ttsbench.sentences import SENTENCES
from ttsbench.targets import DEFAULT_PIPELINE, PIPELINES, GatewayTarget, TritonTarget

DEFAULT_CONCURRENCY = (1, 2, 4, 8, 16, 32)


def concurrency_list(text: str) -> list[int]:
    try:
        levels = [int(x) for x in text.split(",") if x.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of integers: {text!r}") from exc
    if not levels or min(levels) < 1:
        raise argparse.ArgumentTypeError("concurrency levels must be integers >= 1")
    return levels


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    load = common.add_argument_group("load")
    load.add_argument("--mode", choices=("streaming", "offline", "both"), default="both")
    load.add_argument("--concurrency", type=concurrency_list, default=list(DEFAULT_CONCURRENCY),
                      help="comma-separated levels (default 1,2,4,8,16,32)")
    amount = load.add_mutually_exclusive_group()
    amount.add_argument("--requests", type=int,
                        help="measured requests per level (default: max(input size, 2 x concurrency))")
    amount.add_argument("--duration", type=float, help="measure each level for this many seconds instead")
    load.add_argument("--warmup", type=int, default=1, help="warm-up requests per worker, per level (not measured)")
    load.add_argument("--timeout", type=float, default=300.0, help="deadline of one request, seconds")
    load.add_argument("--seed", type=int, help="sampling seed sent with every request")

    inputs = common.add_argument_group("inputs (default: the built-in sentences spoken by the voices in --voices-dir)")
    source = inputs.add_mutually_exclusive_group()
    source.add_argument("--manifest", type=Path,
                        help="JSONL lines {prompt_audio, prompt_text, target_text[, id]} or id|prompt_text|prompt_wav|target_text")
    source.add_argument("--seed-tts", nargs="?", const=SEED_TTS_DATASET, metavar="NAME_OR_DIR",
                        help=f"the upstream set {SEED_TTS_DATASET} from the local HF cache or a directory (needs `datasets`)")
    inputs.add_argument("--split", default=SEED_TTS_DEFAULT_SPLIT, help="split of --seed-tts")
    inputs.add_argument("--voices-dir", type=Path, default=SHIPPED_VOICES_DIR,
                        help="reference voices of the default set: <name>.<audio> + <name>.txt")
    inputs.add_argument("--limit", type=int, help="use only the first N inputs")

    out = common.add_argument_group("output")
    out.add_argument("--json", type=Path, help="write the results here (rewritten after every level)")
    out.add_argument("--no-records", action="store_true", help="leave per-request records out of the JSON")

    parser = argparse.ArgumentParser(prog="tts-bench", description="Latency and throughput of CosyVoice2 serving.")
    targets = parser.add_subparsers(dest="target", required=True)
    triton = targets.add_parser("triton", parents=[common], help="Triton directly over gRPC")
    triton.add_argument("--url", default="127.0.0.1:8001", help="Triton gRPC host:port")
    triton.add_argument("--fresh-voice-ids", action="store_true",
                        help="a new voice id per request, so the server's prompt cache never hits")
    triton.add_argument("--pipeline", choices=tuple(PIPELINES), default=DEFAULT_PIPELINE,
                        help="which pipeline's Triton models to load: "
                             + ", ".join(f"{name} ({' / '.join(models)})" for name, models in PIPELINES.items()))
    gateway = targets.add_parser("gateway", parents=[common], help="the OpenAI gateway over HTTP")
    gateway.add_argument("--url", default="http://127.0.0.1:8080", help="gateway base URL (without /v1)")
    gateway.add_argument("--model", default="tts-1")
    gateway.add_argument("--api-key")
    gateway.add_argument("--response-format", choices=("pcm", "wav", "mp3", "opus", "aac", "flac"), default="pcm")
    gateway.add_argument("--stream-format", choices=("audio", "sse"), default="audio", help="for streaming mode")
    return parser


def load_requests(args: argparse.Namespace) -> tuple[list[BenchRequest], str]:
    """The prepared requests and a one-line description of where they came from."""
    if args.manifest:
        requests, source = prepare_requests(load_manifest(args.manifest)), f"manifest {args.manifest}"
    elif args.seed_tts:
        requests = prepare_requests(load_seed_tts(args.seed_tts, args.split))
        source = f"{args.seed_tts} split {args.split}"
    else:
        requests, source = default_requests(args.voices_dir, SENTENCES), f"built-in sentences, voices {args.voices_dir}"
    return (requests[: args.limit] if args.limit else requests), source


def make_targets(args: argparse.Namespace) -> list[Target]:
    modes = [True, False] if args.mode == "both" else [args.mode == "streaming"]
    if args.target == "triton":
        return [TritonTarget(args.url, streaming, args.seed, args.fresh_voice_ids, args.pipeline) for streaming in modes]
    return [
        GatewayTarget(args.url, streaming, args.response_format, args.stream_format, args.model, args.api_key, args.seed)
        for streaming in modes
    ]


def run_settings(args: argparse.Namespace, source: str, n_inputs: int) -> dict[str, Any]:
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "api_key"}
    return {**settings, "inputs": source, "input_count": n_inputs, "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


async def run(args: argparse.Namespace) -> list[LevelSummary]:
    requests, source = load_requests(args)
    settings = run_settings(args, source, len(requests))
    print(f"{len(requests)} inputs from {source}", file=sys.stderr)
    summaries: list[LevelSummary] = []
    for target in make_targets(args):
        try:
            if isinstance(target, GatewayTarget) and (missing := await target.missing_voices(requests)):
                raise InputError(
                    f"the gateway does not know {len(missing)} voice(s) of these inputs (e.g. {missing[0]}); "
                    "serve them from its voices dir (TTS_VOICES_DIR) or use that dir as --voices-dir"
                )
            for concurrency in args.concurrency:
                n = None if args.duration else (args.requests or max(len(requests), 2 * concurrency))
                result = await run_level(
                    target, requests, concurrency, num_requests=n, duration=args.duration,
                    warmup_per_worker=args.warmup, timeout=args.timeout,
                )
                summary = summarize_level(result)
                summaries.append(summary)
                print(f"{summary.mode} c={concurrency}: {summary.requests} requests, {summary.errors} errors, "
                      f"{summary.wall_seconds:.1f} s", file=sys.stderr)
                if args.json:
                    document = report_document(summaries, settings, with_records=not args.no_records)
                    args.json.write_text(json.dumps(document, indent=1, ensure_ascii=False))
        finally:
            await target.aclose()
        print(render_report([s for s in summaries if s.mode == target.mode]) + "\n")
    return summaries


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        asyncio.run(run(args))
    except InputError as exc:
        print(f"tts-bench: {exc}", file=sys.stderr)
        return 2
    return 0
