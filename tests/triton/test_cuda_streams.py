"""The CUDA-stream proxies of the LLM decoder and the token2wav engine (on CPU: faked stream contexts)."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch

from speech_serving import cuda_streams
from speech_serving.cuda_streams import StreamDecoder, StreamToken2Wav, worker_stream
from speech_serving.llm_scheduler import StepOutput
from speech_serving.token2wav import Work


class StreamLog:
    """Stands in for `torch.cuda.stream`: records which stream is current."""

    def __init__(self) -> None:
        self.current: object | None = None
        self.entered: list[object] = []

    @contextlib.contextmanager
    def __call__(self, stream: object):
        self.entered.append(stream)
        previous, self.current = self.current, stream
        try:
            yield
        finally:
            self.current = previous


@pytest.fixture
def stream_log(monkeypatch) -> StreamLog:
    log = StreamLog()
    monkeypatch.setattr(cuda_streams.torch.cuda, "stream", log)
    return log


class RecordingDecoder:
    """A `SlotDecoder` that notes the stream current at each call."""

    last_step_sync_seconds = 0.0
    last_step_device_seconds = 0.0

    num_slots = 3

    def __init__(self, log: StreamLog) -> None:
        self.log = log
        self.calls: list[tuple[str, object]] = []

    def add(self, request: str) -> int:
        self.calls.append(("add", self.log.current))
        if request == "bad":
            raise ValueError("bad request")
        return 2

    def step(self) -> dict[int, StepOutput]:
        self.calls.append(("step", self.log.current))
        return {2: StepOutput(token=7, finished=False)}

    def remove(self, slot: int) -> None:
        self.calls.append((f"remove {slot}", self.log.current))

    def add_many(self, requests: list[str]) -> list[int]:
        self.calls.append((f"add_many {len(requests)}", self.log.current))
        return list(range(len(requests)))


def test_every_decoder_call_runs_on_the_stream_and_results_pass_through(stream_log):
    stream = object()
    inner = RecordingDecoder(stream_log)
    decoder = StreamDecoder(inner, stream)
    assert decoder.num_slots == 3
    assert decoder.add("r") == 2
    assert decoder.step() == {2: StepOutput(token=7, finished=False)}
    decoder.remove(2)
    assert decoder.add_many(["a", "b"]) == [0, 1]  # a method the proxy does not name runs on the stream too
    with pytest.raises(ValueError, match="bad request"):
        decoder.add("bad")
    assert inner.calls == [
        ("add", stream), ("step", stream), ("remove 2", stream), ("add_many 2", stream), ("add", stream)
    ]  # fmt: skip
    assert stream_log.current is None  # the context is left after each call, also after an error


class RecordingEngine:
    def __init__(self, log: StreamLog) -> None:
        self.log = log
        self.streams_at_call: list[object] = []
        self.name = "engine under test"

    def open(self, prompt: object, seed: int | None) -> tuple[object, int | None]:
        self.streams_at_call.append(self.log.current)
        return prompt, seed

    def run(self, work: list[Work]) -> list[np.ndarray | Exception]:
        self.streams_at_call.append(self.log.current)
        if not work:
            raise RuntimeError("no work")
        return [np.full(2, float(item.tokens.sum()), np.float32) for item in work]


def test_token2wav_engine_calls_run_on_the_stream_and_results_pass_through(stream_log):
    stream = object()
    inner = RecordingEngine(stream_log)
    engine = StreamToken2Wav(inner, stream)
    prompt = object()
    state = engine.open(prompt, 5)
    assert state == (prompt, 5)
    out = engine.run([Work(state, np.array([1, 2], np.int32), None), Work(state, np.array([4], np.int32), None)])
    assert [a.tolist() for a in out] == [[3.0, 3.0], [4.0, 4.0]]
    with pytest.raises(RuntimeError, match="no work"):
        engine.run([])
    assert inner.streams_at_call == [stream, stream, stream] and stream_log.current is None
    assert engine.name == "engine under test"  # plain attributes pass through unchanged


def test_without_a_stream_the_calls_are_plain_delegation(stream_log):
    inner = RecordingDecoder(stream_log)
    decoder = StreamDecoder(inner, None)
    assert decoder.add("r") == 2 and decoder.step()[2].token == 7
    assert stream_log.entered == [] and inner.calls == [("add", None), ("step", None)]
    with pytest.raises(AttributeError):
        decoder.no_such_method  # noqa: B018 - the lookup itself must fail


def test_worker_streams_exist_only_on_cuda(monkeypatch):
    assert worker_stream(torch.device("cpu"), cuda_streams.TOKEN2WAV_STREAM_PRIORITY) is None
    created = []

    class FakeStream:
        def __init__(self, device, priority):
            self.device, self.priority, self.waited_for = device, priority, None
            created.append(self)

        def wait_stream(self, other):
            self.waited_for = other

    monkeypatch.setattr(cuda_streams.torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(cuda_streams.torch.cuda, "current_stream", lambda device: f"current of {device}")
    device = torch.device("cuda:0")
    stream = worker_stream(device, cuda_streams.TOKEN2WAV_STREAM_PRIORITY)
    assert created == [stream] and stream.priority == cuda_streams.TOKEN2WAV_STREAM_PRIORITY
    assert stream.device == device
    assert stream.waited_for == "current of cuda:0"  # model setup finishes before the worker's first kernel
    # a lower number goes first: the token2wav worker above the LLM
    assert cuda_streams.TOKEN2WAV_STREAM_PRIORITY < cuda_streams.LLM_STREAM_PRIORITY
