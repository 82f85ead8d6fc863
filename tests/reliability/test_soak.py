"""CI-sized soak against the local stack on the tiny model: concurrent streams, none lost or truncated,
nothing left in flight, memory growth bounded. The long run: `python -m tests.reliability.soak --minutes N`."""

from __future__ import annotations

import asyncio
import time

import pytest

from tests.reliability.soak import soak

#: The first test here starts the shared stack (up to START_TIMEOUT_S) before its own work.
pytestmark = [pytest.mark.triton, pytest.mark.timeout(1200)]

CONCURRENCY = 6
REQUESTS = 24
#: Generous bounds: a leak of per-request state (audio buffers, gRPC streams) grows far beyond them.
GATEWAY_GROWTH_BYTES = 64 * 2**20
TRITON_GROWTH_BYTES = 256 * 2**20


def test_concurrent_streams_are_all_whole_and_leave_nothing_behind(tiny_stack):
    asyncio.run(soak(tiny_stack.url, concurrency=CONCURRENCY, requests=CONCURRENCY))  # warm every code path
    gateway_before, triton_before = tiny_stack.gateway_rss(), tiny_stack.triton_rss()
    report = asyncio.run(soak(tiny_stack.url, concurrency=CONCURRENCY, requests=REQUESTS, seed=1))
    print(f"soak: {report}")
    assert report.requests == REQUESTS and report.refused_429 == 0
    assert (report.lost, report.truncated) == (0, 0), report.failures
    assert report.ok == REQUESTS and report.audio_seconds > 0
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and (
        tiny_stack.gateway_metric("tts_in_flight_requests") or tiny_stack.triton_active_requests()
    ):
        time.sleep(0.2)
    assert tiny_stack.gateway_metric("tts_in_flight_requests") == 0
    assert tiny_stack.triton_active_requests() == 0
    gateway_growth = tiny_stack.gateway_rss() - gateway_before
    triton_growth = tiny_stack.triton_rss() - triton_before
    print(f"memory growth: gateway {gateway_growth / 2**20:.1f} MiB, triton {triton_growth / 2**20:.1f} MiB")
    assert gateway_growth < GATEWAY_GROWTH_BYTES and triton_growth < TRITON_GROWTH_BYTES
