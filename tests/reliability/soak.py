"""Soak: many concurrent speech streams against a gateway on loopback, counting every response that is lost
(no 200, a broken transfer) or truncated (no `done` event, audio shorter than the usage says), and the memory
the gateway and tritonserver keep.

    python -m tests.reliability.soak --minutes 10 [--concurrency 8] [--url http://127.0.0.1:8080]

Without ``--url`` it starts its own local stack on the tiny random model (everything on loopback) and reports
gateway and tritonserver memory growth too. The CI-sized run is tests/reliability/test_soak.py.
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
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

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


@dataclass
class SoakReport:
    requests: int = 0
    ok: int = 0
    lost: int = 0  # no 200, or the transfer broke
    truncated: int = 0  # 200, but the body is not the whole utterance
    refused_429: int = 0  # the in-flight limit (not a failure: the client may retry)
    audio_seconds: float = 0.0
    wall_seconds: float = 0.0
    failures: list[str] = field(default_factory=list)


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
    url: str, *, concurrency: int, requests: int | None = None, seconds: float | None = None, seed: int = 0
) -> SoakReport:
    """``concurrency`` workers send requests back to back until ``requests`` were sent or ``seconds`` passed."""
    report = SoakReport()
    rng = random.Random(seed)
    started = time.monotonic()

    def more() -> bool:
        if requests is not None and report.requests >= requests:
            return False
        return seconds is None or time.monotonic() - started < seconds

    async def worker(client: httpx.AsyncClient) -> None:
        while more():
            report.requests += 1
            outcome, audio_s = await one_request(client, rng)
            report.audio_seconds += audio_s
            if outcome == "ok":
                report.ok += 1
            elif outcome == "429":
                report.refused_429 += 1
            else:
                report.failures.append(outcome)
                if outcome.startswith("truncated"):
                    report.truncated += 1
                else:
                    report.lost += 1

    timeout = httpx.Timeout(300, connect=10)
    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits) as client:
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
    report.wall_seconds = time.monotonic() - started
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.reliability.soak", description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=5.0)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--url", help="an existing gateway (default: start the local stack on the tiny model)")
    args = parser.parse_args(argv)
    if args.url:
        report = asyncio.run(soak(args.url, concurrency=args.concurrency, seconds=args.minutes * 60))
        print(json.dumps(asdict(report), indent=1))
        return 0 if report.lost == report.truncated == 0 else 1

    from cosyvoice2.testing import write_tiny_model
    from tests.reliability.stack_rig import SPEECH_RATIO, StackProcess

    with tempfile.TemporaryDirectory(prefix="soak-") as work:
        stack = StackProcess(write_tiny_model(Path(work) / "tiny"), Path(work), extra_args=SPEECH_RATIO).start()
        try:
            asyncio.run(soak(stack.url, concurrency=args.concurrency, requests=args.concurrency * 2))  # warm-up
            # Memory after each slice of the run: a leak keeps growing, a cache levels off.
            samples = [(0, stack.gateway_rss(), stack.triton_rss())]
            report = SoakReport()
            end = time.monotonic() + args.minutes * 60
            while (left := end - time.monotonic()) > 0:
                part = asyncio.run(
                    soak(stack.url, concurrency=args.concurrency, seconds=min(SLICE_S, left), seed=len(samples))
                )
                for name in ("requests", "ok", "lost", "truncated", "refused_429", "audio_seconds", "wall_seconds"):
                    setattr(report, name, getattr(report, name) + getattr(part, name))
                report.failures += part.failures
                samples.append((report.requests, stack.gateway_rss(), stack.triton_rss()))
            settle = time.monotonic() + 10  # the pipeline publishes its gauges every 100 ms
            while time.monotonic() < settle and stack.triton_active_requests():
                time.sleep(0.2)
            figures = {
                **asdict(report),
                "gateway_in_flight_after": stack.gateway_metric("tts_in_flight_requests"),
                "pipeline_active_after": stack.triton_active_requests(),
                "rss_mb_by_requests": [
                    {"requests": n, "gateway": round(g / 2**20, 1), "triton": round(t / 2**20, 1)}
                    for n, g, t in samples
                ],
            }
        finally:
            stack.stop()
    print(json.dumps(figures, indent=1))
    return 0 if report.lost == report.truncated == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
