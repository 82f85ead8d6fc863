"""Cancellation of a pipeline request (`run_until_cancelled`, `FinalResponseGuard`), with a fake request.

The request is asked `is_cancelled()` while its handler runs, and never after its final response went out: the
handler may still clean up then (close its LLM sequence and token2wav stream), and the server may have released the
request."""

from __future__ import annotations

import asyncio

import pytest

from speech_serving.orchestrator import FinalResponseGuard, run_until_cancelled

FINAL = 1


class FakeRequest:
    """Records the responses; `is_cancelled()` fails the test if asked after the final response."""

    def __init__(self, cancel_after: int | None = None) -> None:
        self.sent: list[tuple[object, int]] = []
        self.asked = 0
        self.cancel_after = cancel_after

    def send(self, response=None, flags: int = 0) -> None:
        self.sent.append((response, flags))

    def is_cancelled(self) -> bool:
        assert not any(flags & FINAL for _, flags in self.sent), "asked about a request that was answered"
        self.asked += 1
        return self.cancel_after is not None and self.asked > self.cancel_after


async def test_an_answered_request_is_not_asked_while_its_handler_cleans_up() -> None:
    request = FakeRequest()
    sender = FinalResponseGuard(request, FINAL)
    cleaned = asyncio.Event()

    async def handle() -> None:
        sender.send("chunk")
        await asyncio.sleep(0.05)
        sender.send("last", flags=FINAL)
        await asyncio.sleep(0.2)  # the clean-up after the answer: four polls' time
        cleaned.set()

    cancelled = await run_until_cancelled(handle, request.is_cancelled, answered=lambda: sender.final_sent,
                                          poll_s=0.01)
    assert not cancelled and cleaned.is_set() and request.asked >= 1
    assert request.sent == [("chunk", 0), ("last", FINAL)]


async def test_a_request_cancelled_before_its_answer_stops_its_handler() -> None:
    request = FakeRequest(cancel_after=2)
    sender = FinalResponseGuard(request, FINAL)
    stopped = asyncio.Event()

    async def handle() -> None:
        try:
            sender.send("chunk")
            await asyncio.sleep(10)
        finally:
            stopped.set()

    assert await run_until_cancelled(handle, request.is_cancelled, answered=lambda: sender.final_sent, poll_s=0.01)
    assert stopped.is_set() and not sender.final_sent


def test_the_guard_refuses_a_response_after_the_final_one() -> None:
    request = FakeRequest()
    sender = FinalResponseGuard(request, FINAL)
    sender.send(flags=FINAL)
    assert sender.final_sent and request.sent == [(None, FINAL)]
    with pytest.raises(RuntimeError, match="after the request's final response"):
        sender.send("late")
    assert len(request.sent) == 1
