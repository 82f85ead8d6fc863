"""Faults injected into the local stack (tiny model, loopback): tritonserver killed mid-stream, a model stub
process killed mid-stream, the gateway killed; then SIGTERM with a request in flight. What a client sees in
each case is what docs/RELIABILITY.md promises; recovery times are printed (run with -s to see them).

Runs after test_soak.py (file order) on the same stack; the drain test stops it, so it comes last."""

from __future__ import annotations

import base64
import json
import os
import signal
import threading
import time

import httpx
import pytest

from tests.reliability.soak import PCM_BYTES_PER_TOKEN
from tests.reliability.stack_rig import http_status
import pipeline_contract as contract

#: Each test may wait for a restarted stack (RECOVERY_TIMEOUT_S) or start the shared one (START_TIMEOUT_S).
pytestmark = [pytest.mark.triton, pytest.mark.timeout(1200)]

#: Several segments: the stream is still running when the fault hits.
LONG_INPUT = " ".join(
    ["The morning train was late again, and the platform slowly filled with tired people."] * 3
    + ["Nobody said a word, but everyone checked the clock."] * 3
)
RECOVERY_TIMEOUT_S = 240.0


class StreamReader(threading.Thread):
    """One speech request read in the background; `first` is set when its first bytes arrived."""

    def __init__(self, url: str, body: dict) -> None:
        super().__init__(daemon=True)
        self.url, self.body = url, body
        self.first = threading.Event()
        self.status: int | None = None
        self.events: list[dict] = []
        self.audio = bytearray()
        self.error: Exception | None = None

    def run(self) -> None:
        try:
            with httpx.Client(base_url=self.url, timeout=httpx.Timeout(300, connect=10)) as http:
                with http.stream("POST", "/v1/audio/speech", json=self.body) as response:
                    self.status = response.status_code
                    if self.body.get("stream_format") == "sse":
                        for line in response.iter_lines():
                            if line.startswith("data: "):
                                self.events.append(json.loads(line[6:]))
                                self.first.set()
                    else:
                        for chunk in response.iter_bytes():
                            self.audio += chunk
                            self.first.set()
        except Exception as exc:  # noqa: BLE001 - what the client saw is the observation
            self.error = exc
        finally:
            self.first.set()


def _start(url: str, **body: object) -> StreamReader:
    body = {"model": "tts-1", "voice": "alloy", "input": LONG_INPUT, "response_format": "pcm", **body}
    reader = StreamReader(url, body)
    reader.start()
    assert reader.first.wait(120), "no first bytes"
    assert reader.status == 200, (reader.status, reader.error)
    return reader


def _speech(url: str, text: str = "Hello again.") -> httpx.Response:
    with httpx.Client(base_url=url, timeout=120) as http:
        body = {"model": "tts-1", "voice": "alloy", "input": text, "response_format": "pcm"}
        return http.post("/v1/audio/speech", json=body)


def _wait_served(url: str, timeout: float) -> float | None:
    """Seconds until a speech request succeeds again."""
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        try:
            if _speech(url).status_code == 200:
                return time.monotonic() - started
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    return None


def _assert_sse_ended_with_an_error(reader: StreamReader) -> None:
    reader.join(120)
    assert not reader.is_alive()
    types = [event["type"] for event in reader.events]
    assert types[-1] == "error" and "speech.audio.done" not in types, types[-3:]
    assert reader.events[-1]["error"]["type"] == "server_error"


def test_triton_ports_are_the_pinned_ones(tiny_stack):
    assert tiny_stack.tritonserver_pid() is not None
    assert http_status(f"http://127.0.0.1:{tiny_stack.http_port}/v2/health/ready") == 200


def test_tritonserver_killed_mid_stream(tiny_stack):
    sse = _start(tiny_stack.url, stream_format="sse")
    audio = _start(tiny_stack.url)
    killed_at = time.monotonic()
    os.kill(tiny_stack.tritonserver_pid(), signal.SIGKILL)

    _assert_sse_ended_with_an_error(sse)
    audio.join(120)
    assert isinstance(audio.error, httpx.RemoteProtocolError)  # a cut transfer, never a short "complete" file

    assert http_status(f"{tiny_stack.url}/ready") == 503
    refused = _speech(tiny_stack.url)
    assert refused.status_code == 503 and refused.headers["retry-after"]
    assert refused.json()["error"]["code"] == "backend_unavailable"

    ready_after = tiny_stack.wait_ready(RECOVERY_TIMEOUT_S)
    assert ready_after is not None, tiny_stack.log_tail()
    served_after = _wait_served(tiny_stack.url, 30)
    assert served_after is not None
    print(f"\ntritonserver killed: ready again after {time.monotonic() - killed_at - served_after:.1f} s, "
          f"served {served_after:.1f} s after /ready")  # fmt: skip
    assert tiny_stack.gateway_metric("tts_in_flight_requests") == 0


def test_a_model_stub_killed_mid_stream(tiny_stack):
    sse = _start(tiny_stack.url, stream_format="sse")
    killed_at = time.monotonic()
    os.kill(tiny_stack.stub_pid(contract.STREAMING_MODEL), signal.SIGKILL)  # the engine's process
    _assert_sse_ended_with_an_error(sse)
    served_after = _wait_served(tiny_stack.url, RECOVERY_TIMEOUT_S)
    assert served_after is not None, tiny_stack.log_tail()
    print(f"\nengine stub killed: served again {time.monotonic() - killed_at:.1f} s after the kill")
    assert tiny_stack.gateway_metric("tts_in_flight_requests") == 0


def test_the_gateway_killed_is_restarted(tiny_stack):
    old = tiny_stack.gateway_pid()
    killed_at = time.monotonic()
    os.kill(old, signal.SIGKILL)
    ready_after = tiny_stack.wait_ready(RECOVERY_TIMEOUT_S)
    assert ready_after is not None, tiny_stack.log_tail()
    assert tiny_stack.gateway_pid() not in (None, old)
    print(f"\ngateway killed: ready again after {time.monotonic() - killed_at:.1f} s")
    assert _speech(tiny_stack.url).status_code == 200


def test_sigterm_drains_in_flight_requests_and_refuses_new_ones(tiny_stack):
    sse = _start(tiny_stack.url, stream_format="sse")
    tiny_stack.proc.send_signal(signal.SIGTERM)
    # the signal is forwarded asynchronously: a request accepted before the gateway drains is served first,
    # which a loaded machine may take many seconds for
    deadline = time.monotonic() + 60
    refused = _speech(tiny_stack.url)
    while refused.status_code != 503 and time.monotonic() < deadline:
        refused = _speech(tiny_stack.url)
    assert refused.status_code == 503 and refused.headers["retry-after"]
    assert refused.json()["error"]["code"] == "shutting_down"
    assert http_status(f"{tiny_stack.url}/ready") == 503

    sse.join(240)
    types = [event["type"] for event in sse.events]
    assert sse.error is None and types[-1] == "speech.audio.done", (sse.error, types[-3:])
    audio = b"".join(base64.b64decode(e["audio"]) for e in sse.events if e["type"] == "speech.audio.delta")
    assert len(audio) == sse.events[-1]["usage"]["output_tokens"] * PCM_BYTES_PER_TOKEN  # whole, not cut

    assert tiny_stack.proc.wait(120) == 0
    assert http_status(f"{tiny_stack.url}/health") == 0  # nothing listens any more
    assert tiny_stack.tritonserver_pid() is None
