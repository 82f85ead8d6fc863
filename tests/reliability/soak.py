"""Soak: many concurrent speech streams against a gateway on loopback, counting every response that is lost
(no 200, a broken transfer) or truncated (no `done` event, audio shorter than the usage says), and the memory
the gateway, tritonserver (with its python stub processes) and the GPU keep.

    python -m tests.reliability.soak --minutes 10 [--concurrency 8] [--url http://127.0.0.1:8080]
    python -m tests.reliability.soak --full-size --device cuda --stub-env DIR --concurrency 64 --minutes 10 \\
        --wall-budget 590

Without ``--url`` it starts its own stack on loopback: by default the local stack (`python -m triton_repo.local_stack`)
on the tiny random model (CPU); with ``--full-size`` the stack `stack-bench` starts
(``stackbench.launch``): released-size random weights written once under ``--work``, the repository rendered
for ``--device``/``--dtype`` in benchmark mode (random weights never stop by themselves), the Triton stubs in
``--stub-env``, the gateway in front. ``--model-dir`` replaces the random weights (a real model with
``--benchmark-speech-ratio 0``, or the tiny one where no GPU is at hand: tests/reliability/test_soak.py).

After start-up and a warm-up (two requests per stream, counted but not measured for memory) it runs the streams
for ``--minutes``, sampling the memory every ``--slice-s`` seconds: gateway RSS, tritonserver RSS including its
stubs, and with ``--device cuda`` the memory used on the visible GPUs (NVML through `pynvml`, else
`nvidia-smi`). ``--wall-budget S`` keeps the whole command, start-up included, under S seconds by shortening the
measured run (the report says by how much). It prints a table and writes a JSON report (``--report``), and exits
non-zero when a response was lost, truncated or unfinished, something was still in flight at the end, or a
memory sample is missing. The CI-sized run is tests/reliability/test_soak.py.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import random
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Protocol

import httpx

from tests.reliability.stack_rig import gateway_metric, process_tree_rss, rss_bytes, triton_active_requests
from triton_repo.server import REPO_ROOT

#: 24 kHz s16le: 960 samples per speech token (tests/triton/conftest.py), 2 bytes each.
PCM_BYTES_PER_TOKEN = 960 * 2
WAV_HEADER_BYTES = 44
TEXTS = (
    "Hello there.",
    "The train was late again.",
    "One more sentence to speak. And a second one.",
    "Short.",
    "How are you today?",
)
VOICES = ("alloy", "amy", "ben", "coral")
#: The long run samples memory after each slice of this many seconds.
SLICE_S = 30.0
#: With a wall budget, new requests stop this long before the hard deadline so the ones in flight can finish...
STRAGGLER_S = 20.0
#: ...which is this long before the budget ends: time for the gauges to settle (SETTLE_S) and the stack to stop
#: (the gateway and tritonserver are each given 10 s before they are killed).
STOP_RESERVE_S = 25.0
#: The pipeline publishes its gauges every 100 ms; the gateway's drop as each response ends.
SETTLE_S = 5.0
MIB = 2**20


@dataclass
class SoakReport:
    requests: int = 0
    ok: int = 0
    lost: int = 0  # no 200, or the transfer broke
    truncated: int = 0  # 200, but the body is not the whole utterance
    unfinished: int = 0  # still running at the hard deadline of a wall budget
    refused_429: int = 0  # the in-flight limit (not a failure: the client may retry)
    audio_seconds: float = 0.0
    wall_seconds: float = 0.0
    failures: list[str] = field(default_factory=list)

    @property
    def failed(self) -> int:
        return self.lost + self.truncated + self.unfinished


async def _sse(client: httpx.AsyncClient, body: dict) -> tuple[str, float]:
    """('ok' | 'truncated' | 'lost: ...' | '429', audio seconds)."""
    audio = bytearray()
    done = None
    async with client.stream("POST", "/v1/audio/speech", json={**body, "stream_format": "sse"}) as response:
        if response.status_code != 200:
            await response.aread()
            return ("429" if response.status_code == 429 else f"lost: status {response.status_code}"), 0.0
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            event = json.loads(line[6:])
            if event["type"] == "speech.audio.delta":
                audio += base64.b64decode(event["audio"])
            elif event["type"] == "speech.audio.done":
                done = event
            else:
                return f"lost: event {event}", 0.0
    seconds = len(audio) / 2 / 24_000
    if done is None:
        return "truncated: no done event", seconds
    if len(audio) != done["usage"]["output_tokens"] * PCM_BYTES_PER_TOKEN:
        return f"truncated: {len(audio)} bytes for {done['usage']['output_tokens']} tokens", seconds
    return "ok", seconds


async def _audio(client: httpx.AsyncClient, body: dict) -> tuple[str, float]:
    async with client.stream("POST", "/v1/audio/speech", json=body) as response:
        data = await response.aread()
    if response.status_code != 200:
        return ("429" if response.status_code == 429 else f"lost: status {response.status_code}"), 0.0
    payload = len(data) - (WAV_HEADER_BYTES if body["response_format"] == "wav" else 0)
    seconds = payload / 2 / 24_000
    if payload <= 0 or payload % PCM_BYTES_PER_TOKEN:
        return f"truncated: {payload} audio bytes is not whole speech tokens", seconds
    return "ok", seconds


async def one_request(client: httpx.AsyncClient, rng: random.Random) -> tuple[str, float]:
    body = {"model": "tts-1", "input": rng.choice(TEXTS), "voice": rng.choice(VOICES), "seed": rng.randrange(2**32)}
    try:
        if rng.random() < 0.5:
            return await _sse(client, {**body, "response_format": "pcm"})
        body.update(response_format=rng.choice(("pcm", "wav")), stream=rng.random() < 0.7)
        return await _audio(client, body)
    except httpx.HTTPError as exc:
        return f"lost: {type(exc).__name__}: {exc}", 0.0


async def soak(
    url: str,
    *,
    concurrency: int,
    requests: int | None = None,
    seconds: float | None = None,
    seed: int = 0,
    deadline: float | None = None,
    on_slice: Callable[[SoakReport], None] | None = None,
    slice_s: float = SLICE_S,
) -> SoakReport:
    """``concurrency`` workers send requests back to back until ``requests`` were sent or ``seconds`` passed.

    ``deadline`` (a `time.monotonic()` value) also stops new requests and cuts those still running then
    (counted as unfinished); ``on_slice`` is called (in a thread) every ``slice_s`` seconds while they run."""
    report = SoakReport()
    rng = random.Random(seed)
    started = time.monotonic()

    def more() -> bool:
        if requests is not None and report.requests >= requests:
            return False
        if deadline is not None and time.monotonic() >= deadline:
            return False
        return seconds is None or time.monotonic() - started < seconds

    async def worker(client: httpx.AsyncClient) -> None:
        while more():
            report.requests += 1
            try:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                outcome, audio_s = await asyncio.wait_for(one_request(client, rng), left)
            except asyncio.TimeoutError:
                outcome, audio_s = "unfinished: still running at the wall budget's hard deadline", 0.0
            report.audio_seconds += audio_s
            if outcome == "ok":
                report.ok += 1
            elif outcome == "429":
                report.refused_429 += 1
            else:
                report.failures.append(outcome)
                if outcome.startswith("truncated"):
                    report.truncated += 1
                elif outcome.startswith("unfinished"):
                    report.unfinished += 1
                else:
                    report.lost += 1

    async def slices() -> None:
        assert on_slice is not None
        while True:
            await asyncio.sleep(slice_s)
            await asyncio.to_thread(on_slice, report)

    timeout = httpx.Timeout(300, connect=10)
    limits = httpx.Limits(max_connections=concurrency)
    sampler = asyncio.create_task(slices()) if on_slice is not None else None
    try:
        async with httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits) as client:
            await asyncio.gather(*(worker(client) for _ in range(concurrency)))
    finally:
        if sampler is not None:
            sampler.cancel()
    report.wall_seconds = time.monotonic() - started
    return report


# The stack under test and its memory -----------------------------------------------------------------------


class ObservedStack(Protocol):
    """What the soak reads from a stack it started (tests/reliability/stack_rig.py's StackProcess is one)."""

    @property
    def url(self) -> str: ...
    def gateway_pid(self) -> int | None: ...
    def tritonserver_pid(self) -> int | None: ...
    def gateway_metric(self, name: str, labels: str = "") -> float: ...
    def triton_active_requests(self) -> float: ...


@dataclass
class RenderedStack:
    """The stack ``stackbench.launch`` starts, seen the way the soak observes a stack."""

    stack: Any  # stackbench.launch.BenchStack (imported only for --full-size: it needs the engine's packages)

    @property
    def url(self) -> str:
        return self.stack.gateway_url

    def gateway_pid(self) -> int | None:
        gateway = self.stack.gateway
        return gateway.pid if gateway is not None and gateway.poll() is None else None

    def tritonserver_pid(self) -> int | None:
        return None if self.stack.server.exited else self.stack.server.pid

    def gateway_metric(self, name: str, labels: str = "") -> float:
        return gateway_metric(self.url, name, labels)

    def triton_active_requests(self) -> float:
        return triton_active_requests(self.stack.server.metrics_port)


def memory_sample(stack: ObservedStack, gpu: Any, phase: str, t_s: float, requests: int) -> dict[str, Any]:
    """One reading: gateway RSS, tritonserver RSS with its stub processes, GPU memory used (None without one)."""
    gateway = stack.gateway_pid()
    triton_rss, triton_processes = process_tree_rss(stack.tritonserver_pid())
    used = gpu.used() if gpu is not None else None
    return {
        "phase": phase,
        "t_s": round(t_s, 1),
        "requests": requests,
        "gateway_rss": rss_bytes(gateway) if gateway else 0,
        "triton_rss": triton_rss,
        "triton_processes": triton_processes,
        "gpu_used": used,
    }


def missing_samples(samples: list[dict[str, Any]], gpu_expected: bool) -> list[str]:
    """What is missing from the memory samples: a process not found (its RSS 0), a python stub gone since the
    first sample, GPU memory not read when a GPU was expected, or too few samples to show a trend."""
    problems = []
    measured = [s for s in samples if s["phase"] in ("warm", "slice", "end")]
    if len(measured) < 2:
        problems.append(f"{len(measured)} memory samples after warm-up (at least 2 needed)")
    first_processes = samples[0]["triton_processes"] if samples else 0
    for s in samples:
        where = f"{s['phase']} sample at {s['t_s']} s"
        if not s["gateway_rss"]:
            problems.append(f"{where}: no gateway RSS (process not found)")
        if not s["triton_rss"]:
            problems.append(f"{where}: no tritonserver RSS (process not found)")
        elif s["triton_processes"] < max(2, first_processes):
            problems.append(f"{where}: {s['triton_processes']} tritonserver processes, {first_processes} at first "
                            "(a python stub is missing)")  # fmt: skip
        if gpu_expected and not s["gpu_used"]:
            problems.append(f"{where}: no GPU memory reading")
    return problems


MEMORY_ROWS = (
    ("gateway RSS", "gateway_rss"),
    ("tritonserver RSS (with stubs)", "triton_rss"),
    ("GPU used", "gpu_used"),
)


def memory_summary(samples: list[dict[str, Any]]) -> dict[str, dict[str, float] | None]:
    """Per measure, in MiB: after start-up, start (after warm-up), end, max and growth (end − start) of the
    measured run; GPU memory summed over the visible GPUs; None for a measure never read."""
    out: dict[str, dict[str, float] | None] = {}
    for _, key in MEMORY_ROWS:
        def value(s: dict[str, Any]) -> float | None:
            v = s[key]
            if isinstance(v, list):
                v = sum(v)
            return v / MIB if v else None

        started = [value(s) for s in samples if s["phase"] == "started"]
        run = [v for s in samples if s["phase"] != "started" and (v := value(s)) is not None]
        if not run:
            out[key] = None
            continue
        out[key] = {
            "after_start_up": round(started[0], 1) if started and started[0] is not None else None,
            "start": round(run[0], 1),
            "end": round(run[-1], 1),
            "max": round(max(run), 1),
            "growth": round(run[-1] - run[0], 1),
        }
    return out


def table(figures: dict[str, Any]) -> str:
    """The printed summary: counts, timings and the memory table (MiB)."""
    r, t = figures["totals"], figures["timings"]
    lines = [
        f"soak: {figures['concurrency']} streams, {figures['measured_s']:.0f} s measured"
        + (f" (asked {figures['asked_s']:.0f} s, shortened to fit the wall budget)" if figures["shortened"] else ""),
        f"start-up {t.get('startup_s', 0):.1f} s, warm-up {t.get('warmup_s', 0):.1f} s, whole command "
        f"{t.get('total_s', 0):.1f} s",
        f"requests {r['requests']}: ok {r['ok']}, lost {r['lost']}, truncated {r['truncated']}, unfinished "
        f"{r['unfinished']}, refused (429) {r['refused_429']}; audio {r['audio_seconds']:.0f} s",
        f"in flight at the end: gateway {figures.get('gateway_in_flight_after', 'n/a')}, pipeline "
        f"{figures.get('pipeline_active_after', 'n/a')}",
        "",
        "| memory (MiB) | after start-up | after warm-up | end | max | growth after warm-up |",
        "|---|---|---|---|---|---|",
    ]
    for title, key in MEMORY_ROWS:
        m = figures["memory"].get(key)
        if key == "gpu_used":
            title += f" ({figures['gpu_source'] or 'n/a'})"
        if m is None:
            lines.append(f"| {title} | n/a | n/a | n/a | n/a | n/a |")
            continue
        cells = ["n/a" if m[k] is None else f"{m[k]:,.1f}" for k in ("after_start_up", "start", "end", "max")]
        lines.append(f"| {title} | " + " | ".join(cells) + f" | {m['growth']:+,.1f} |")
    lines += ["", "verdict: " + ("PASS" if not figures["problems"] else "FAIL: " + "; ".join(figures["problems"]))]
    return "\n".join(lines)


# Command line ----------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m tests.reliability.soak", description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=5.0, help="measured run, after start-up and warm-up")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--url", help="an existing gateway (default: start a stack here)")
    parser.add_argument("--slice-s", type=float, default=SLICE_S, help="seconds between memory samples")
    parser.add_argument("--wall-budget", type=float, metavar="S",
                        help="finish the whole command, start-up included, within S seconds (shortens the run)")
    parser.add_argument("--report", type=Path, help="JSON report (default: WORK/soak-<UTC time>.json)")
    parser.add_argument("--work", type=Path, default=REPO_ROOT / "var" / "soak",
                        help="report, and with --full-size the weights, rendered repository and logs")
    full = parser.add_argument_group("the rendered stack (--full-size), as stack-bench starts it")
    full.add_argument("--full-size", action="store_true",
                      help="released-size random weights (written once under WORK/model), benchmark mode")
    full.add_argument("--prepare-only", action="store_true", help="write the --full-size weights and stop")
    full.add_argument("--model-dir", type=Path, help="weights instead of the random released-size ones")
    full.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    full.add_argument("--dtype", default="bf16", choices=("fp32", "fp16", "bf16"))
    full.add_argument("--max-batch", type=int, help="LLM slots (default: the render's, 64 for the PyTorch LLM on a GPU)")
    full.add_argument("--max-seq-len", type=int, default=2048)
    full.add_argument("--benchmark-speech-ratio", type=float,
                      help="speech tokens per text token (0 = off: real weights; default: stackbench.launch's "
                           "realistic ratio for the model's tokenizer)")
    full.add_argument("--render-arg", action="append", default=[], metavar="FIELD=VALUE",
                      help="extra RenderOptions field, repeatable")
    full.add_argument("--stub-env", type=Path,
                      help="Python environment the Triton python stubs run in (numpy < 2); default: this one")
    return parser


def main(argv: list[str] | None = None) -> int:
    began = time.monotonic()
    parser = build_parser()
    args = parser.parse_args(argv)
    rendered = args.full_size
    if not rendered and (args.device != "cpu" or args.stub_env or args.render_arg or args.prepare_only
                         or args.model_dir):  # fmt: skip
        parser.error("--device, --stub-env, --render-arg, --model-dir and --prepare-only need --full-size")
    if args.url and rendered:
        parser.error("--url soaks an existing gateway: no --full-size with it")
    if args.stub_env is not None and not (args.stub_env / "bin" / "python3").exists():
        parser.error(f"{args.stub_env} is not a Python environment (no bin/python3)")
    if args.url:
        report = asyncio.run(soak(args.url, concurrency=args.concurrency, seconds=args.minutes * 60))
        print(json.dumps(asdict(report), indent=1))
        return 0 if report.failed == 0 else 1
    if args.prepare_only:
        from stackbench.launch import ensure_model_dir

        print(f"weights: {ensure_model_dir(args.work, args.model_dir)}")
        return 0
    report_path = args.report or args.work / f"soak-{datetime.now(timezone.utc).strftime('%Y%m%dT%H%M%SZ')}.json"
    report_path.parent.mkdir(parents=True, exist_ok=True)
    figures = run_own_stack(args, began, rendered)
    report_path.write_text(json.dumps(figures, indent=1))
    print(table(figures))
    print(f"report: {report_path}")
    return 0 if not figures["problems"] else 1


def run_own_stack(args: argparse.Namespace, began: float, rendered: bool) -> dict[str, Any]:
    """Start the stack, warm it up, soak it with memory samples, settle, stop it: the report's figures."""
    budget_end = None if args.wall_budget is None else began + args.wall_budget
    timings: dict[str, float] = {}
    figures: dict[str, Any] = {
        "started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "concurrency": args.concurrency,
        "asked_s": args.minutes * 60,
        "measured_s": 0.0,
        "shortened": False,
        "timings": timings,
        "gpu_source": None,
        "samples": [],
        "problems": [],
    }
    samples: list[dict[str, Any]] = figures["samples"]
    gpu = None
    if rendered and args.device == "cuda":
        from stackbench.cli import GpuMemory

        gpu = GpuMemory()
        figures["gpu_source"] = gpu.source
    in_flight_limit = {"TTS_MAX_IN_FLIGHT": str(args.concurrency)}  # every stream admitted: none refused with 429
    bench = None  # the rendered stack, once there is one (its logs go into a failed run's report)
    stopper: Callable[[], object] = lambda: None
    report = SoakReport()
    with tempfile.TemporaryDirectory(prefix="soak-") as scratch:
        try:
            phase = time.monotonic()
            if rendered:
                from stackbench.launch import TRITON_READY_TIMEOUT_S, BenchStack, ensure_model_dir, render_stack

                args.work.mkdir(parents=True, exist_ok=True)
                model_dir = ensure_model_dir(args.work, args.model_dir)
                timings["weights_s"] = round(time.monotonic() - phase, 1)
                phase = time.monotonic()
                _, repo = render_stack(
                    work=args.work, model_dir=model_dir, device=args.device, dtype=args.dtype,
                    max_batch=args.max_batch, max_seq_len=args.max_seq_len,
                    benchmark_speech_ratio=args.benchmark_speech_ratio, render_args=args.render_arg,
                )  # fmt: skip
                timings["render_s"] = round(time.monotonic() - phase, 1)
                bench = BenchStack(repo, args.work, stub_env=args.stub_env, gateway_env=in_flight_limit)
                stack: ObservedStack = RenderedStack(bench)
                stopper = bench.stop
                phase = time.monotonic()
                ready_timeout = _left(budget_end, STOP_RESERVE_S, default=TRITON_READY_TIMEOUT_S)
                bench.start_triton(ready_timeout=ready_timeout)
                timings["triton_ready_s"] = round(time.monotonic() - phase, 1)
                phase = time.monotonic()
                bench.start_gateway()
                timings["gateway_ready_s"] = round(time.monotonic() - phase, 1)
            else:
                from cosyvoice2.testing import write_tiny_model
                from tests.reliability.stack_rig import SPEECH_RATIO, StackProcess

                work = Path(scratch)
                process = StackProcess(write_tiny_model(work / "tiny"), work, extra_env=in_flight_limit,
                                       extra_args=SPEECH_RATIO)  # fmt: skip
                stack, stopper = process, process.stop
                process.start()
            timings["startup_s"] = round(time.monotonic() - began, 1)
            print(f"stack ready after {timings['startup_s']} s", flush=True)
            hard_deadline = None if budget_end is None else budget_end - STOP_RESERVE_S
            samples.append(memory_sample(stack, gpu, "started", 0.0, 0))

            phase = time.monotonic()
            warm = asyncio.run(soak(stack.url, concurrency=args.concurrency, requests=args.concurrency * 2,
                                    deadline=hard_deadline))  # fmt: skip
            timings["warmup_s"] = round(time.monotonic() - phase, 1)
            figures["warmup"] = asdict(warm)

            measure_s, figures["shortened"] = fit_run(args.minutes * 60, budget_end, time.monotonic())
            run_began = time.monotonic()
            samples.append(memory_sample(stack, gpu, "warm", 0.0, 0))

            def on_slice(part: SoakReport) -> None:
                samples.append(memory_sample(stack, gpu, "slice", time.monotonic() - run_began, part.requests))

            if measure_s > 0:
                report = asyncio.run(soak(stack.url, concurrency=args.concurrency, seconds=measure_s, seed=1,
                                          deadline=hard_deadline, on_slice=on_slice, slice_s=args.slice_s))  # fmt: skip
            figures["measured_s"] = round(time.monotonic() - run_began, 1)
            figures["measured"] = asdict(report)
            settle = time.monotonic() + SETTLE_S
            while time.monotonic() < settle and (stack.gateway_metric("tts_in_flight_requests")
                                                 or stack.triton_active_requests()):  # fmt: skip
                time.sleep(0.2)
            figures["gateway_in_flight_after"] = stack.gateway_metric("tts_in_flight_requests")
            figures["pipeline_active_after"] = stack.triton_active_requests()
            samples.append(memory_sample(stack, gpu, "end", time.monotonic() - run_began, report.requests))
        except Exception as exc:  # the report still says how far it got, and the run fails
            figures["problems"].append(f"{type(exc).__name__}: {exc}")
            if bench is not None:
                figures["log_tails"] = {"tritonserver": bench.server.log_tail(80), "gateway": _tail(bench.gateway_log)}
        finally:
            stop_began = time.monotonic()
            stopper()
            timings["stop_s"] = round(time.monotonic() - stop_began, 1)
    timings["total_s"] = round(time.monotonic() - began, 1)

    warm_report = SoakReport(**figures.get("warmup", {}))
    counted = ("requests", "ok", "lost", "truncated", "unfinished", "refused_429", "audio_seconds")
    totals = {k: getattr(warm_report, k) + getattr(report, k) for k in counted}
    figures["totals"] = totals
    figures["memory"] = memory_summary(samples)
    problems = figures["problems"]
    if warm_report.failed or report.failed:
        problems.append(f"{warm_report.failed + report.failed} responses lost, truncated or unfinished: "
                        + "; ".join(sorted(set(warm_report.failures + report.failures)))[:2000])  # fmt: skip
    if figures.get("gateway_in_flight_after") or figures.get("pipeline_active_after"):
        problems.append("requests still in flight at the end")
    if "measured" in figures and not figures["measured"]["requests"]:
        problems.append("the measured run sent no request: the wall budget left no time for it")
    if samples:
        problems += missing_samples(samples, gpu_expected=gpu is not None and gpu.source is not None)
    if gpu is not None and gpu.source is None:  # (then every sample lacks it: said once)
        problems.append("--device cuda but neither NVML nor nvidia-smi could read the GPU's memory")
    return figures


def fit_run(asked_s: float, budget_end: float | None, now: float) -> tuple[float, bool]:
    """(seconds of measured run, whether shortened): what was asked, or what still fits before the budget's end
    once the last requests have had STRAGGLER_S to finish and the stack STOP_RESERVE_S to settle and stop."""
    if budget_end is None:
        return asked_s, False
    fits = budget_end - now - STOP_RESERVE_S - STRAGGLER_S
    return (asked_s, False) if fits >= asked_s else (max(0.0, fits), True)


def _tail(log: Path, lines: int = 80) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:]) if log.exists() else ""


def _left(budget_end: float | None, reserve: float, default: float) -> float:
    """Seconds left before ``reserve`` seconds before the budget's end (``default`` without a budget)."""
    return default if budget_end is None else max(1.0, budget_end - reserve - time.monotonic())


if __name__ == "__main__":
    sys.exit(main())
