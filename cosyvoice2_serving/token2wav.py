"""Token2wav serving: a registry of per-request streams and a batcher that runs concurrent chunks together.

Each streaming request owns one engine stream state (flow prompt, token buffer, HiFT caches), keyed by
the orchestrator's server-generated request id. The state exists from the request's first chunk until
its final chunk, an error in one of its chunks, or an explicit close (cancellation) - nothing else
keeps it alive.

All engine work runs on one worker thread. Whenever it is free it takes the pending jobs (at most one
per stream, so a stream's chunks stay in order) and hands them to the engine in one call; the engine
runs them as one batched flow + HiFT pass (any mix of chunk shapes and offline jobs, padded and masked).

First chunks go first: while any stream waits for its first chunk, a call runs only first chunks (plus
jobs that have waited `max_defer_s`). A stream past its first chunk is already playing audio and has
slack; a new stream's listener hears nothing until its first chunk is done, and later chunks (longer
flow prefixes) would make that call several times slower.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, Sequence, TypeVar

import numpy as np

from cosyvoice2.streaming import Chunk
from cosyvoice2_serving.errors import InvalidInput
from cosyvoice2_serving.io_struct import PromptTensors
from cosyvoice2_serving.stats import Stats

S = TypeVar("S")

CLOSED_IDS_REMEMBERED = 4096

logger = logging.getLogger(__name__)

TOKEN2WAV_STATS = (
    "token2wav_active_streams",
    "token2wav_chunks_total",
    "token2wav_engine_calls_total",
    "token2wav_max_jobs_per_call",
    "token2wav_failed_total",
    "token2wav_closed_total",
    "token2wav_expired_total",
    "token2wav_engine_seconds_total",  # wall time inside engine calls (flow + HiFT)
)


@dataclass(frozen=True)
class Work(Generic[S]):
    """One job as the engine sees it."""

    state: S  # the stream's engine state (a throwaway state for offline jobs)
    tokens: np.ndarray  # int32 speech tokens not sent before (offline: all of them)
    chunk: Chunk | None  # the schedule chunk this job completes; None = offline, whole utterance


class Token2WavEngine(Protocol[S]):
    def open(self, prompt: PromptTensors, seed: int | None) -> S:
        """A fresh stream state for one request."""

    def run(self, work: Sequence[Work[S]]) -> list[np.ndarray | Exception]:
        """Audio (or the error) for each job, in order; jobs of different streams may share forwards."""


@dataclass
class _Job(Generic[S]):
    request_id: str
    tokens: np.ndarray
    prompt: PromptTensors | None
    chunk: Chunk | None
    seed: int | None
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future = field(init=False)
    queued_at: float = field(init=False, default_factory=time.monotonic)

    def __post_init__(self) -> None:
        self.future = self.loop.create_future()

    @property
    def is_first_chunk(self) -> bool:
        return self.chunk is not None and self.chunk.start == 0

    def resolve(self, result: np.ndarray | BaseException) -> None:
        def settle() -> None:
            if self.future.done():  # the caller was cancelled meanwhile
                return
            if isinstance(result, BaseException):
                self.future.set_exception(result)
            else:
                self.future.set_result(result)

        try:
            self.loop.call_soon_threadsafe(settle)
        except RuntimeError:  # loop closed: nobody waits any more
            pass


class Token2WavService(Generic[S]):
    def __init__(
        self,
        engine: Token2WavEngine[S],
        stats: Stats | None = None,
        idle_timeout_s: float = 300.0,
        max_defer_s: float = 0.25,
    ) -> None:
        self.engine = engine
        self.max_defer_s = max_defer_s
        self.stats = stats or Stats(TOKEN2WAV_STATS)
        # A stream whose orchestrator vanished (crashed process) would never be closed: expire idle ones.
        self.idle_timeout_s = idle_timeout_s
        self._streams: dict[str, S] = {}
        self._last_used: dict[str, float] = {}
        # Ids closed recently: a close can overtake the request's own in-flight first chunk, which must
        # then not open the stream again (ids are never reused, so remembering the last few suffices).
        self._closed_ids: OrderedDict[str, None] = OrderedDict()
        self._pending: list[_Job[S]] = []
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="token2wav", daemon=True)
        self._thread.start()

    # -- event-loop side -----------------------------------------------------------------------
    async def process(
        self,
        request_id: str,
        tokens: np.ndarray,
        prompt: PromptTensors | None,
        chunk: Chunk | None,
        seed: int | None = None,
    ) -> np.ndarray:
        """Audio for one chunk of stream `request_id` (see `PipelineClients.token2wav`)."""
        job = _Job(request_id, np.asarray(tokens, dtype=np.int32), prompt, chunk, seed, asyncio.get_running_loop())
        with self._cond:
            if self._closed:
                raise RuntimeError("token2wav service is shut down")
            self._pending.append(job)
            self._cond.notify()
        return await job.future

    def close_stream(self, request_id: str) -> bool:
        """Free the state of `request_id` (cancelled or abandoned request). False if it had none."""
        with self._cond:
            existed = self._drop(request_id)
            self._closed_ids[request_id] = None
            while len(self._closed_ids) > CLOSED_IDS_REMEMBERED:
                self._closed_ids.popitem(last=False)
            if existed:
                self.stats.add("token2wav_closed_total")
        return existed

    def active_streams(self) -> set[str]:
        with self._cond:
            return set(self._streams)

    def shutdown(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join(timeout=10)

    # -- worker thread -------------------------------------------------------------------------
    def _run(self) -> None:
        while self._iterate():
            pass

    def _iterate(self) -> bool:
        """Take the next batch and run it. False when the service is shut down."""
        with self._cond:
            self._expire_idle()
            while not self._pending and not self._closed:
                self._cond.wait(timeout=min(self.idle_timeout_s, 60.0))
                self._expire_idle()
            if self._closed:
                for job in self._pending:
                    job.resolve(RuntimeError("token2wav service is shut down"))
                return False
            batch = self._take_batch()
        try:
            self._execute(batch)
        except Exception as exc:  # noqa: BLE001 - a dead worker would hang every request: answer and go on
            logger.exception("token2wav batch failed")
            for job in batch:
                job.resolve(exc)  # no-op for jobs already answered
        return True

    def _take_batch(self) -> list[_Job[S]]:
        """The next call's jobs, removed from the queue: one per stream (the oldest, which keeps a stream's
        chunks in order); only first chunks and overdue jobs while any first chunk waits. Caller holds the lock."""
        overdue = time.monotonic() - self.max_defer_s
        heads: dict[str, _Job[S]] = {}
        for job in self._pending:
            heads.setdefault(job.request_id, job)
        batch = list(heads.values())
        if any(job.is_first_chunk for job in batch):
            batch = [job for job in batch if job.is_first_chunk or job.queued_at < overdue]
        for job in batch:
            self._pending.remove(job)
        return batch

    def _execute(self, batch: list[_Job[S]]) -> None:
        work: list[Work[S]] = []
        runnable: list[_Job[S]] = []
        for job in batch:
            try:
                state = self._state_for(job)
            except Exception as exc:
                job.resolve(exc)
                continue
            runnable.append(job)
            work.append(Work(state, job.tokens, job.chunk))
        if not work:
            return
        started = time.perf_counter()
        try:
            results: list[np.ndarray | Exception] = self.engine.run(work)
        except Exception as exc:
            results = [exc] * len(work)
        self.stats.add("token2wav_engine_seconds_total", time.perf_counter() - started)
        self.stats.add("token2wav_engine_calls_total")
        self.stats.set("token2wav_max_jobs_per_call", max(self.stats.get("token2wav_max_jobs_per_call"), len(work)))
        for job, result in zip(runnable, results, strict=True):
            failed = isinstance(result, Exception)
            self.stats.add("token2wav_failed_total" if failed else "token2wav_chunks_total")
            if job.chunk is not None and (failed or job.chunk.final):
                # a failed chunk leaves the stream's caches inconsistent; a final one ends it
                with self._cond:
                    self._drop(job.request_id)
            job.resolve(result)

    def _state_for(self, job: _Job[S]) -> S:
        if job.chunk is None:  # offline: a throwaway state, never registered
            if job.prompt is None:
                raise InvalidInput("offline token2wav needs the prompt")
            return self.engine.open(job.prompt, job.seed)
        with self._cond:
            state: Any = self._streams.get(job.request_id)
            if job.request_id in self._closed_ids:
                raise InvalidInput(f"token2wav stream {job.request_id} was closed")
            if job.prompt is not None:
                if state is not None:
                    raise InvalidInput(f"token2wav stream {job.request_id} is already open")
                state = self.engine.open(job.prompt, job.seed)
                if not job.chunk.final:  # a one-chunk stream never needs registering
                    self._streams[job.request_id] = state
                    self.stats.set("token2wav_active_streams", len(self._streams))
            elif state is None:
                raise InvalidInput(f"token2wav stream {job.request_id} is not open (closed, expired or never opened)")
            self._last_used[job.request_id] = time.monotonic()
            return state

    def _drop(self, request_id: str) -> bool:
        """Forget a stream. Caller holds the lock."""
        self._last_used.pop(request_id, None)
        existed = self._streams.pop(request_id, None) is not None
        self.stats.set("token2wav_active_streams", len(self._streams))
        return existed

    def _expire_idle(self) -> None:
        """Drop streams unused for `idle_timeout_s`. Caller holds the lock."""
        deadline = time.monotonic() - self.idle_timeout_s
        for request_id in [r for r, used in self._last_used.items() if used < deadline]:
            if self._drop(request_id):
                self.stats.add("token2wav_expired_total")
