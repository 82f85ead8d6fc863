"""Token2wav serving: a registry of per-request streams and a batcher that runs concurrent chunks together.

Each streaming request owns one engine stream state (flow prompt, token buffer, HiFT caches), keyed by
the orchestrator's server-generated request id. The state exists from the request's first chunk until
its final chunk, an error in one of its chunks, or an explicit close (cancellation) - nothing else
keeps it alive.

All engine work runs on one worker thread, in whole calls: whenever the worker is free it takes pending jobs (at
most one per stream, its oldest, so a stream's chunks stay in order) and hands them to the engine in one call; the
engine runs them as one batched flow + HiFT pass (any mix of chunk shapes and offline jobs, padded and masked).
Which jobs, and in what order, is `token2wav_policy.SchedulePolicy`: streams about to run out of buffered audio
first, then first chunks of new streams, then the rest by the time each stream's buffered audio runs out; at most
the engine's `max_rows` jobs per call (its largest CUDA-graph bucket of rows), the others wait for the next call.

What a stream has buffered is tracked per stream (`_Playback`): its listener starts playing when the first audio
is answered, and every answered chunk adds its samples / the engine's `sample_rate` seconds. The expected call time
is a running mean of the calls so far.

For every stream's first chunk the service adds up its wait (arrival -> the start of the call that runs it) and
that call (`FIRST_CHUNK_STATS`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, Sequence, TypeVar

import numpy as np

from cosyvoice2.streaming import Chunk
from speech_serving.errors import InvalidInput
from speech_serving.gpu_yield import Token2WavCalls
from speech_serving.io_struct import PromptTensors
from speech_serving.stats import Stats
from speech_serving.token2wav_policy import CallTimes, PendingJob, SchedulePolicy, Urgency

S = TypeVar("S")

CLOSED_IDS_REMEMBERED = 4096

logger = logging.getLogger(__name__)

TOKEN2WAV_STATS = (
    "token2wav_active_streams",
    "token2wav_chunks_total",
    "token2wav_engine_calls_total",
    "token2wav_max_jobs_per_call",
    "token2wav_call_jobs_total",
    "token2wav_starving_jobs_total",  # jobs ranked first: their stream runs dry within `starving_calls` calls
    "token2wav_capped_calls_total",  # calls that left pending jobs for the next one (more than `max_rows`)
    "token2wav_failed_total",
    "token2wav_closed_total",
    "token2wav_expired_total",
    "token2wav_engine_seconds_total",  # wall time inside engine calls (flow + HiFT)
    "token2wav_flow_frames_needed_total",  # new frames the flow estimator needed (engines that count them)
    "token2wav_flow_frames_computed_total",  # ... and computed, padded up to the CUDA-graph buckets
    "token2wav_hift_replayed_total",  # HiFT forwards replayed from a CUDA graph (engines that count them)
    "token2wav_hift_eager_total",  # ... and run eagerly, fitting no captured bucket (long offline utterances)
    # streams whose flow caches met the budget (`flow_cache_gb`) and stopped growing: their later chunks recompute
    # the frames since then, so a run where this climbs needs a larger budget or fewer streams per GPU
    "token2wav_flow_cache_refused_total",
    # the CUDA allocator of the token2wav process ran out of free blocks and retried after freeing its cache (each
    # retry synchronizes the GPU): GPU memory is short
    "token2wav_cuda_alloc_retries_total",
)

#: Summed over the first chunks of streams that were answered with audio (a failed or cancelled one is not counted;
#: docs/PERFORMANCE.md#what-is-measured); divide each sum by `token2wav_first_chunks_total` for the mean.
FIRST_CHUNK_STATS = (
    "token2wav_first_chunks_total",
    "token2wav_first_chunk_wait_seconds_total",  # arrival -> the start of the call that runs it
    "token2wav_first_chunk_call_seconds_total",  # that call
    "token2wav_first_chunk_rows_total",  # that call's jobs
)
TOKEN2WAV_STATS += FIRST_CHUNK_STATS

#: Running totals an engine may keep, as (its method, the counters of this call's share of each value): the flow
#: estimator's frames (needed, computed with the padding up to its graph buckets), HiFT's forwards (replayed from
#: a CUDA graph, eager).
ENGINE_TOTALS = (
    ("frame_counts", ("token2wav_flow_frames_needed_total", "token2wav_flow_frames_computed_total")),
    ("hift_calls", ("token2wav_hift_replayed_total", "token2wav_hift_eager_total")),
    ("flow_cache_refusals", ("token2wav_flow_cache_refused_total",)),
    ("allocator_retries", ("token2wav_cuda_alloc_retries_total",)),
)

#: Call duration assumed before any was timed (seconds), and the weight of the newest call in the running mean.
INITIAL_CALL_S = 0.2
CALL_MEAN_WEIGHT = 0.2


@dataclass(frozen=True)
class Work(Generic[S]):
    """One job as the engine sees it."""

    state: S  # the stream's engine state (a throwaway state for offline jobs)
    tokens: np.ndarray  # int32 speech tokens not sent before (offline: all of them)
    chunk: Chunk | None  # the schedule chunk this job completes; None = offline, whole utterance


class Token2WavEngine(Protocol[S]):
    """What the service calls. An engine may also have `max_rows` (jobs per call at most: its largest CUDA-graph
    bucket of rows) and `sample_rate` (of the audio `run` returns, to follow each stream's buffered audio)."""

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
    # the call that runs it: when it started, and its jobs
    started_at: float | None = field(init=False, default=None)
    rows: int = field(init=False, default=0)

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



@dataclass
class _Playback:
    """A stream's audio as its listener plays it: playback starts when the first audio is answered."""

    started: float  # time.monotonic() of the first audio
    seconds: float = 0.0  # audio answered so far

    @property
    def runs_dry_at(self) -> float:
        """When the listener has played everything answered so far."""
        return self.started + self.seconds


class Token2WavService(Generic[S]):
    def __init__(
        self,
        engine: Token2WavEngine[S],
        stats: Stats | None = None,
        idle_timeout_s: float = 300.0,
        max_defer_s: float = 0.25,
        max_rows: int | None = None,
        calls: Token2WavCalls | None = None,
        starving_calls: float = SchedulePolicy.starving_calls,
    ) -> None:
        """`max_rows`: jobs per call at most (default: the engine's `max_rows`, if it has one; else no cap).
        `max_defer_s`: how long a job with nothing playing (offline) may wait behind playing streams. `calls`: marks
        each engine call for an LLM scheduler of the same process that may wait for it (`gpu_yield`).
        `starving_calls`: the policy's (`SchedulePolicy.starving_calls`)."""
        self.engine = engine
        self.calls = calls
        self.policy = SchedulePolicy(max_rows if max_rows is not None else getattr(engine, "max_rows", None),
                                     max_defer_s, starving_calls)
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
        # what the deadline order weighs: the audio each stream has buffered, and how long a call takes
        self.sample_rate: int | None = getattr(engine, "sample_rate", None)
        self._playback: dict[str, _Playback] = {}
        self.call_times = CallTimes(INITIAL_CALL_S, CALL_MEAN_WEIGHT)
        self._engine_totals: dict[str, tuple[int, ...]] = {}  # per `ENGINE_TOTALS` hook, its values at the last call
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
            self._cond.notify_all()
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
            self._cond.notify_all()
        self._thread.join(timeout=10)

    # -- worker thread -------------------------------------------------------------------------
    def _run(self) -> None:
        while self._iterate():
            pass

    def _iterate(self) -> bool:
        """Take the next call's jobs and run them. False when the service is shut down."""
        with self._cond:
            self._expire_idle()
            batch = self._take_batch()
            while not batch and not self._closed:
                self._cond.wait(timeout=min(self.idle_timeout_s, 60.0))
                self._expire_idle()
                batch = self._take_batch()
            if self._closed:
                for job in [*batch, *self._pending]:
                    job.resolve(RuntimeError("token2wav service is shut down"))
                self._pending.clear()
                return False
        started = time.monotonic()
        try:
            self._execute(batch)
            self.call_times.observe(len(batch), time.monotonic() - started)
        except Exception as exc:  # noqa: BLE001 - a dead worker would hang every request: answer and go on
            logger.exception("token2wav batch failed")
            for job in batch:
                job.resolve(exc)  # no-op for jobs already answered
        return True

    def _take_batch(self) -> list[_Job[S]]:
        """The next call's jobs, removed from the queue, in the policy's order: of each stream its oldest pending
        job (which keeps a stream's chunks in order), most urgent first, at most `max_rows`. Caller holds the lock."""
        heads: dict[str, _Job[S]] = {}
        for job in self._pending:
            heads.setdefault(job.request_id, job)
        jobs = list(heads.values())
        if not jobs:
            return []
        now = time.monotonic()
        pending = [self._pending_job(job) for job in jobs]
        call_s = self.call_times.expected(self.policy.call_rows(len(jobs)))  # the call these jobs would fill
        chosen = self.policy.next_call(pending, now, call_s)
        batch = [jobs[i] for i in chosen]
        starving = sum(self.policy.urgency(pending[i], now, call_s) == Urgency.STARVING for i in chosen)
        if starving:
            self.stats.add("token2wav_starving_jobs_total", starving)
        if len(chosen) < len(jobs) and len(chosen) == self.policy.max_rows:  # the cap, not the first-chunk rule
            self.stats.add("token2wav_capped_calls_total")
        for job in batch:
            self._pending.remove(job)
        return batch

    def _pending_job(self, job: _Job[S]) -> PendingJob:
        """What the policy weighs of a job. Caller holds the lock."""
        playback = self._playback.get(job.request_id) if job.chunk is not None else None
        return PendingJob(job.queued_at, job.is_first_chunk, None if playback is None else playback.runs_dry_at)

    def _finish_job(self, job: _Job[S], result: np.ndarray | BaseException, ended: float) -> None:
        """Count, end the stream where the chunk failed or was its last, and answer the job. `ended`: when its call
        ended."""
        failed = isinstance(result, BaseException)
        self.stats.add("token2wav_failed_total" if failed else "token2wav_chunks_total")
        if not failed and job.is_first_chunk and job.started_at is not None:
            self._count_first_chunk(job, ended)
        with self._cond:
            if job.chunk is not None and (failed or job.chunk.final):
                # a failed chunk leaves the stream's caches inconsistent; a final one ends it
                self._drop(job.request_id)
            elif job.chunk is not None and self.sample_rate and job.request_id in self._streams:
                # only for registered streams: a chunk that ends after its stream was closed leaves no entry
                playback = self._playback.setdefault(job.request_id, _Playback(ended))
                playback.seconds += np.asarray(result).size / self.sample_rate
        job.resolve(result)

    def _count_first_chunk(self, job: _Job[S], ended: float) -> None:
        assert job.started_at is not None
        self.stats.add_all({
            "token2wav_first_chunks_total": 1,
            "token2wav_first_chunk_wait_seconds_total": job.started_at - job.queued_at,
            "token2wav_first_chunk_call_seconds_total": ended - job.started_at,
            "token2wav_first_chunk_rows_total": job.rows,
        })  # fmt: skip

    def _execute(self, batch: list[_Job[S]]) -> None:
        engine = self.engine
        opened = time.monotonic()  # a first chunk's call starts with opening its stream (prompt to the device)
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
        for job in runnable:
            job.started_at, job.rows = opened, len(work)
        started = time.monotonic()
        try:
            with self.calls.running() if self.calls is not None else contextlib.nullcontext():
                results: list[np.ndarray | Exception] = engine.run(work)
        except Exception as exc:
            results = [exc] * len(work)
        ended = time.monotonic()
        self.stats.add("token2wav_engine_seconds_total", ended - started)
        self.stats.add("token2wav_engine_calls_total")
        self.stats.add("token2wav_call_jobs_total", len(work))
        self.stats.set("token2wav_max_jobs_per_call", max(self.stats.get("token2wav_max_jobs_per_call"), len(work)))
        self._publish_engine_totals()
        for job, result in zip(runnable, results, strict=True):
            self._finish_job(job, result, ended)

    def _publish_engine_totals(self) -> None:
        """The running totals of engines that keep them (`ENGINE_TOTALS`) -> this call's share of them."""
        for hook, names in ENGINE_TOTALS:
            counts = getattr(self.engine, hook, None)
            if counts is None:
                continue
            now, was = counts(), self._engine_totals.get(hook, (0,) * len(names))
            self._engine_totals[hook] = now
            self.stats.add_all({name: value - before for name, value, before in zip(names, now, was, strict=True)})

    def _state_for(self, job: _Job[S]) -> S:
        engine = self.engine
        if job.chunk is None:  # offline: a throwaway state, never registered
            if job.prompt is None:
                raise InvalidInput("offline token2wav needs the prompt")
            return engine.open(job.prompt, job.seed)
        with self._cond:
            state: Any = self._streams.get(job.request_id)
            if job.request_id in self._closed_ids:
                raise InvalidInput(f"token2wav stream {job.request_id} was closed")
            if job.prompt is not None:
                if state is not None:
                    raise InvalidInput(f"token2wav stream {job.request_id} is already open")
                state = engine.open(job.prompt, job.seed)
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
        self._playback.pop(request_id, None)
        existed = self._streams.pop(request_id, None) is not None
        self.stats.set("token2wav_active_streams", len(self._streams))
        return existed

    def _expire_idle(self) -> None:
        """Drop streams unused for `idle_timeout_s`. Caller holds the lock."""
        deadline = time.monotonic() - self.idle_timeout_s
        for request_id in [r for r, used in self._last_used.items() if used < deadline]:
            if self._drop(request_id):
                self.stats.add("token2wav_expired_total")
