"""Each serving worker thread runs its GPU work on its own CUDA stream.

In one process (the colocated layout) kernels of different streams run concurrently, and the stream
priority lets token2wav (first chunks are latency-critical) go ahead of the LLM's decode steps. Two
processes would instead time-slice the GPU between their contexts.

The Triton-free services stay unaware of streams: the decoder (`SlotDecoder`) and the token2wav engine
(`Token2WavEngine`) are wrapped in delegating proxies that enter `torch.cuda.stream(s)` around every
call. Results reach the host inside the call (`.tolist()`, `.cpu()`), so they are synchronized on the
wrapper's stream. On CPU the stream is None and the proxies just delegate.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, ContextManager, Generic, Sequence, TypeVar

import numpy as np
import torch

from speech_serving.llm_scheduler import SlotDecoder, StepOutput
from speech_serving.io_struct import PromptTensors
from speech_serving.token2wav import Token2WavEngine, Work

R = TypeVar("R")
S = TypeVar("S")

#: CUDA stream priorities: a lower number is a higher priority (out-of-range values are clamped to the
#: device's range, [-5, 0] on recent GPUs). The token2wav worker runs above the LLM: its calls hold first chunks
#: and chunks of streams about to run out of audio (`token2wav_policy`).
TOKEN2WAV_STREAM_PRIORITY = -2
LLM_STREAM_PRIORITY = -1


def worker_stream(device: torch.device, priority: int) -> torch.cuda.Stream | None:
    """A new CUDA stream on `device` (None off CUDA)."""
    if device.type != "cuda":
        return None
    stream = torch.cuda.Stream(device=device, priority=priority)
    # What was queued during model setup (weights, the decoder's graph capture) must finish before the
    # worker's first kernel reads it.
    stream.wait_stream(torch.cuda.current_stream(device))
    return stream


class _OnStream:
    """Runs every method call of the wrapped object on `stream`; other attributes pass through."""

    def __init__(self, target: Any, stream: torch.cuda.Stream | None) -> None:
        self._target = target
        self.stream = stream

    def _context(self) -> ContextManager[object]:
        return contextlib.nullcontext() if self.stream is None else torch.cuda.stream(self.stream)

    def _call(self, method: Any, *args: Any, **kwargs: Any) -> Any:
        with self._context():
            return method(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        # Only reached for attributes the proxy lacks, so methods added to the target later (e.g. a
        # batched prefill) also run on the stream.
        if name.startswith("__") or name == "_target":
            raise AttributeError(name)
        value = getattr(self._target, name)
        if not callable(value):
            return value
        return functools.wraps(value)(functools.partial(self._call, value))


class StreamDecoder(_OnStream, Generic[R]):
    """`SlotDecoder` whose prefills and steps run on the LLM worker's stream."""

    def __init__(self, decoder: SlotDecoder[R], stream: torch.cuda.Stream | None) -> None:
        super().__init__(decoder, stream)

    @property
    def num_slots(self) -> int:
        return self._target.num_slots

    def add(self, request: R) -> int:
        return self._call(self._target.add, request)

    def step(self) -> dict[int, StepOutput]:
        return self._call(self._target.step)

    def remove(self, slot: int) -> None:
        self._call(self._target.remove, slot)


class StreamToken2Wav(_OnStream, Generic[S]):
    """`Token2WavEngine` whose stream openings and runs happen on the token2wav worker's stream."""

    def __init__(self, engine: Token2WavEngine[S], stream: torch.cuda.Stream | None) -> None:
        super().__init__(engine, stream)

    def open(self, prompt: PromptTensors, seed: int | None) -> S:
        return self._call(self._target.open, prompt, seed)

    def run(self, work: Sequence[Work[S]]) -> list[np.ndarray | Exception]:
        return self._call(self._target.run, work)
