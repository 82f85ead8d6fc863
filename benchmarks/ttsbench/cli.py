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
from ttsbench.ratesearch import (
    DEFAULT_FIRST_CHUNK_P95_S,
    ListenerBound,
    RateSearch,
    SearchSettings,
    SearchSettingsError,
    search_rate,
)
from ttsbench.report import (
    LevelSummary,
    RateSummary,
    rate_table,
    render_report,
    report_document,
    summarize_level,
    summarize_rate,
)
from ttsbench.runner import Target, measure, run_level, run_open_loop
from ttsbench.sentences import SENTENCES
from ttsbench.targets import BALANCES, DEFAULT_PIPELINE, PIPELINES, GatewayTarget, TritonTarget

DEFAULT_CONCURRENCY = (1, 2, 4, 8, 16, 32)
#: Open loop without --duration or --requests: each rate offers arrivals for this long.
DEFAULT_RATE_SECONDS = 30.0
DEFAULT_RATE_BOUNDS = (0.25, 64.0)


def concurrency_list(text: str) -> list[int]:
    try:
        levels = [int(x) for x in text.split(",") if x.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of integers: {text!r}") from exc
    if not levels or min(levels) < 1:
        raise argparse.ArgumentTypeError("concurrency levels must be integers >= 1")
    return levels


def positive_rate(text: str) -> float:
    try:
        rate = float(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from exc
    if not 0 < rate < float("inf"):
        raise argparse.ArgumentTypeError(f"rates are requests per second > 0, got {text!r}")
    return rate


def rate_list(text: str) -> list[float]:
    rates = [positive_rate(x) for x in text.split(",") if x.strip()]
    if not rates:
        raise argparse.ArgumentTypeError("no rate given")
    return rates


def rate_bounds(text: str) -> tuple[float, float]:
    rates = rate_list(text)
    if len(rates) != 2 or rates[0] > rates[1]:
        raise argparse.ArgumentTypeError(f"expected LOW,HIGH with LOW <= HIGH, got {text!r}")
    return rates[0], rates[1]


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    load = common.add_argument_group("load")
    load.add_argument("--mode", choices=("streaming", "offline", "both"),
                      help="default: both (closed loop), streaming (open loop, which only streams)")
    load.add_argument("--concurrency", type=concurrency_list,
                      help="closed loop: comma-separated levels (default 1,2,4,8,16,32)")
    amount = load.add_mutually_exclusive_group()
    amount.add_argument("--requests", type=int,
                        help="measured requests per level (default: max(input size, 2 x concurrency)) or per rate")
    amount.add_argument("--duration", type=float,
                        help="measure each level for this many seconds instead; open loop: offer arrivals for this "
                             f"long per rate (default {DEFAULT_RATE_SECONDS:g})")
    load.add_argument("--warmup", type=int, default=1,
                      help="warm-up requests per worker, per level (not measured); open loop: sent one at a time "
                           "before the first rate")
    load.add_argument("--timeout", type=float, default=300.0, help="deadline of one request, seconds")
    load.add_argument("--seed", type=int, help="sampling seed sent with every request")

    open_loop = common.add_argument_group(
        "open loop (instead of --concurrency): Poisson arrivals, each request sent when it arrives, however many "
        "are still running")
    rates = open_loop.add_mutually_exclusive_group()
    rates.add_argument("--rates", type=rate_list, metavar="LIST", help="comma-separated arrival rates, requests/s")
    rates.add_argument("--rate-search", type=positive_rate, metavar="START",
                       help="find the highest rate that meets the bound below, starting at START requests/s: grow "
                            "geometrically until a rate misses it, then bisect")
    open_loop.add_argument("--rate-bounds", type=rate_bounds, default=DEFAULT_RATE_BOUNDS, metavar="LOW,HIGH",
                           help="the rates the search may try (default {:g},{:g})".format(*DEFAULT_RATE_BOUNDS))
    open_loop.add_argument("--search-steps", type=int, default=8, help="most rates the search measures (default 8)")
    open_loop.add_argument("--search-precision", type=float, default=0.1,
                           help="bisect until the bracket is within this share of its lower end (default 0.1)")
    open_loop.add_argument("--first-chunk-p95", type=float, default=DEFAULT_FIRST_CHUNK_P95_S, metavar="SECONDS",
                           help="the search's bound, with no stalled stream and no error (default 0.5)")
    open_loop.add_argument("--arrival-seed", type=int, default=0,
                           help="seed of the arrival times and the request picks (default 0)")

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

    parser = argparse.ArgumentParser(prog="tts-bench", description="Latency and throughput of the speech-serving stack.")
    targets = parser.add_subparsers(dest="target", required=True)
    triton = targets.add_parser("triton", parents=[common], help="Triton directly over gRPC")
    triton.add_argument("--url", default="127.0.0.1:8001", help="Triton gRPC host:port, or a gRPC target naming several "
                        "(ipv4:host:port,host:port; dns:///name:port), spread round robin")
    triton.add_argument("--fresh-voice-ids", action="store_true",
                        help="a new voice id per request, so the server's prompt cache never hits")
    triton.add_argument("--balance", choices=BALANCES, default="round-robin",
                        help="how a target naming several instances spreads the requests: the channel's round robin, "
                             "or least-busy: each request to the instance with the fewest of this run's requests in "
                             "flight (the gateway's TTS_TRITON_BALANCE=least-busy pick)")
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


def is_open_loop(args: argparse.Namespace) -> bool:
    return args.rates is not None or args.rate_search is not None


def load_mode(args: argparse.Namespace) -> str:
    """--mode, or its default for the load shape: open loop only streams."""
    return args.mode or ("streaming" if is_open_loop(args) else "both")


def check_load(args: argparse.Namespace) -> None:
    """Fill the defaults that depend on the load shape; refuse combinations that do not mean anything."""
    if not is_open_loop(args):
        args.mode = load_mode(args)
        args.concurrency = args.concurrency or list(DEFAULT_CONCURRENCY)
        return
    if args.concurrency is not None:
        raise InputError("--concurrency is for closed loop; open loop (--rates, --rate-search) sets arrival rates")
    if load_mode(args) != "streaming":
        raise InputError("open loop measures streams (first chunk, stalls): leave out --mode or give streaming")
    if args.arrival_seed < 0:
        raise InputError("--arrival-seed must be >= 0")
    if (args.requests is not None and args.requests < 1) or (args.duration is not None and not args.duration > 0):
        raise InputError("open loop needs --requests >= 1 or --duration > 0 per rate")
    args.mode = load_mode(args)
    if args.requests is None and args.duration is None:
        args.duration = DEFAULT_RATE_SECONDS


def make_targets(args: argparse.Namespace) -> list[Target]:
    mode = load_mode(args)
    modes = [True, False] if mode == "both" else [mode == "streaming"]
    if args.target == "triton":
        return [TritonTarget(args.url, streaming, args.seed, args.fresh_voice_ids, args.pipeline, args.balance)
                for streaming in modes]  # fmt: skip
    return [
        GatewayTarget(args.url, streaming, args.response_format, args.stream_format, args.model, args.api_key, args.seed)
        for streaming in modes
    ]


def run_settings(args: argparse.Namespace, source: str, n_inputs: int) -> dict[str, Any]:
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "api_key"}
    return {**settings, "inputs": source, "input_count": n_inputs, "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


async def check_voices(target: Target, requests: Sequence[BenchRequest]) -> None:
    if isinstance(target, GatewayTarget) and (missing := await target.missing_voices(requests)):
        raise InputError(
            f"the gateway does not know {len(missing)} voice(s) of these inputs (e.g. {missing[0]}); "
            "serve them from its voices dir (TTS_VOICES_DIR) or use that dir as --voices-dir"
        )


async def run_rates(args: argparse.Namespace, target: Target, requests: Sequence[BenchRequest],
                    settings: dict[str, Any]) -> tuple[list[RateSummary], RateSearch | None]:
    """The open loop: warm-up one request at a time, then the given rates or the rate search."""
    search_settings = None
    if args.rate_search is not None:
        try:
            search_settings = SearchSettings(args.rate_search, *args.rate_bounds, max_steps=args.search_steps,
                                             precision=args.search_precision)  # fmt: skip
        except SearchSettingsError as exc:
            raise InputError(str(exc)) from exc
    for i in range(args.warmup):
        await measure(target, requests[i % len(requests)], args.timeout)
    summaries: list[RateSummary] = []

    def write_json(search: RateSearch | None = None) -> None:  # after every rate, and with the search's outcome
        if args.json:
            document = report_document([], settings, with_records=not args.no_records, rates=summaries,
                                       rate_search=None if search is None else search.to_dict())  # fmt: skip
            args.json.write_text(json.dumps(document, indent=1, ensure_ascii=False))

    async def one_rate(rate: float) -> RateSummary:
        result = await run_open_loop(target, requests, rate, num_requests=args.requests, duration=args.duration,
                                     seed=args.arrival_seed, timeout=args.timeout)  # fmt: skip
        summary = summarize_rate(result)
        summaries.append(summary)
        p95 = "-" if summary.first_chunk is None else f"{1000 * summary.first_chunk.p95:.0f} ms"
        print(f"{summary.mode} rate={rate:g}/s: {summary.requests} requests, {summary.errors} errors, first chunk "
              f"p95 {p95}, {summary.wall_seconds:.1f} s", file=sys.stderr)  # fmt: skip
        write_json()
        return summary

    if search_settings is None:
        for rate in args.rates:
            await one_rate(rate)
        print(f"== {target.mode}, open loop ==\n{rate_table(summaries)}\n")
        return summaries, None
    search = await search_rate(one_rate, search_settings, ListenerBound(args.first_chunk_p95))
    write_json(search)
    print(f"== {target.mode}, open-loop rate search ==\n{search.table()}\n{search.conclusion()}\n")
    return summaries, search


async def run_levels(args: argparse.Namespace, requests: Sequence[BenchRequest],
                     settings: dict[str, Any]) -> list[LevelSummary]:
    """The closed loop: every concurrency level of every mode."""
    summaries: list[LevelSummary] = []
    for target in make_targets(args):
        try:
            await check_voices(target, requests)
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


async def run(args: argparse.Namespace) -> None:
    check_load(args)
    requests, source = load_requests(args)
    settings = run_settings(args, source, len(requests))
    print(f"{len(requests)} inputs from {source}", file=sys.stderr)
    if not is_open_loop(args):
        await run_levels(args, requests, settings)
        return
    (target,) = make_targets(args)
    try:
        await check_voices(target, requests)
        await run_rates(args, target, requests, settings)
    finally:
        await target.aclose()


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        asyncio.run(run(args))
    except InputError as exc:
        print(f"tts-bench: {exc}", file=sys.stderr)
        return 2
    return 0
