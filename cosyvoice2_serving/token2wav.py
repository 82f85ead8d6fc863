"""Token2wav serving: a registry of per-request streams and a batcher that runs concurrent chunks together.

Each streaming request owns one engine stream state (flow prompt, token buffer, HiFT caches), keyed by
the orchestrator's server-generated request id. The state exists from the request's first chunk until
its final chunk, an error in one of its chunks, or an explicit close (cancellation) - nothing else
keeps it alive.

All engine work runs on one worker thread, in one of two ways (`T2W_SCHEDULING`):

* `call`: whenever the worker is free it takes the pending jobs (at most one per stream, so a stream's chunks
  stay in order) and hands them to the engine in one call; the engine runs them as one batched flow + HiFT
  pass (any mix of chunk shapes and offline jobs, padded and masked). A job arriving meanwhile waits for the
  whole call (encoder, 10 Euler steps, HiFT).
* `step` (engines that implement `StepToken2WavEngine`): the worker loops over single estimator steps. Each
  iteration admits newly pending chunks (their encoder pass), runs ONE Euler step over every chunk in flight -
  chunks at different steps share the padded evaluation - and vocodes and answers the chunks that ran their
  last step. A new stream's first chunk so starts at the next step, not after a whole call. Jobs the engine
  cannot step (offline utterances, chunks that recompute the flow) run as whole calls between two steps, at
  most one call per iteration, so steps and whole calls both keep moving. At most `max_rows` chunks are in
  flight (the engine's largest padded shape); a job waits for room.

First chunks go first: while any stream waits for its first chunk, a call runs only first chunks (plus
jobs that have waited `max_defer_s`); in step mode first chunks are admitted before later chunks, and a job
that has waited `max_defer_s` before both.

With `first_chunks_between_steps` (call scheduling, one worker, an engine whose `run` takes `between_steps`),
a call of later chunks checks before each of its Euler steps whether first chunks wait, and runs them there as
a call of their own: a new stream waits for one estimator step of a running call, not for all of it, while
the call's own rows keep the lock-step cost of a whole call (no per-row step indices as in step mode). It does
so only while every stream of the running call has enough audio buffered at its listener to wait for that
first-chunk call and the rest of its own (`_Playback`: the audio answered since the stream's first audio, less
the time since then, against the recent durations of both kinds of call), so a stream about to run dry is not
delayed further.

With a `first_chunk_engine` (call scheduling), a second worker thread runs only first chunks, with that
engine, while the first runs everything else: a new stream's first chunk never waits for a running call of
later chunks. The two engines share the model and run on separate CUDA streams (the first-chunk one with
the higher priority), so the GPU overlaps the two calls; a stream's later chunks wait until its first one is
answered, so each stream's chunks still run one at a time and in order. A stream past its first chunk is already playing audio and has
slack; a new stream's listener hears nothing until its first chunk is done, and later chunks (longer
flow prefixes) would make that call several times slower.

For every stream's first chunk the service adds up its wait (arrival -> the start of the call that runs it) and
that call (`FIRST_CHUNK_STATS`); in step mode the "call" is the chunk's span from its admission to its answer.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, Sequence, TypeVar, cast

import numpy as np

from cosyvoice2.streaming import Chunk
from cosyvoice2_serving.errors import InvalidInput
from cosyvoice2_serving.io_struct import PromptTensors
from cosyvoice2_serving.stats import Stats

S = TypeVar("S")

CLOSED_IDS_REMEMBERED = 4096

logger = logging.getLogger(__name__)

#: How the worker schedules engine work (module docstring): whole calls, or one estimator step at a time.
T2W_SCHEDULING = ("step", "call")

#: Step-mode iterations whose schedule `Token2WavService.step_trace` keeps (the most recent ones).
STEP_TRACE_LENGTH = 4096

TOKEN2WAV_STATS = (
    "token2wav_active_streams",
    "token2wav_chunks_total",
    "token2wav_engine_calls_total",  # whole calls (every batch in call mode; jobs not stepped in step mode)
    "token2wav_max_jobs_per_call",
    "token2wav_call_jobs_total",  # jobs run in whole calls (in step mode only those that are not stepped)
    "token2wav_steps_total",  # step mode: estimator steps run (each over all chunks in flight)
    "token2wav_step_rows_total",  # step mode: chunk-steps run; / steps_total = mean chunks per step
    "token2wav_max_rows_per_step",
    "token2wav_rows_in_flight",  # step mode: chunks between admission and their last step now
    "token2wav_step_seconds_total",  # step mode: wall time inside admissions (encoder) and steps (+ HiFT)
    "token2wav_failed_total",
    "token2wav_closed_total",
    "token2wav_expired_total",
    "token2wav_engine_seconds_total",  # wall time inside whole engine calls (flow + HiFT)
    "token2wav_first_chunk_calls_total",  # calls of the first-chunk worker (with a `first_chunk_engine`)
    "token2wav_calls_between_steps_total",  # first-chunk calls run between two Euler steps of another call
    "token2wav_between_steps_deferred_total",  # ... not run there: a stream of the running call had too little audio
)

#: Summed over the first chunks of streams that were answered with audio (a failed or cancelled one is not counted;
#: docs/PERFORMANCE.md#what-is-measured); divide each sum by `token2wav_first_chunks_total` for the mean.
FIRST_CHUNK_STATS = (
    "token2wav_first_chunks_total",
    "token2wav_first_chunk_wait_seconds_total",  # arrival -> the start of the call that runs it (step mode: admission)
    "token2wav_first_chunk_call_seconds_total",  # that call (step mode: admission -> answered, steps shared)
    "token2wav_first_chunk_rows_total",  # that call's jobs (step mode: the mean chunks per step it took part in)
)
TOKEN2WAV_STATS += FIRST_CHUNK_STATS

#: Call durations assumed before any was timed (seconds), and the weight of the newest call in their running means.
INITIAL_CALL_S = 0.2
CALL_MEAN_WEIGHT = 0.2


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


class StepToken2WavEngine(Token2WavEngine[S], Protocol):
    """An engine that can also run chunks one estimator step at a time (`T2W_SCHEDULING` "step")."""

    @property
    def can_step(self) -> bool:
        """False when no job could be stepped (the service then schedules whole calls)."""

    @property
    def max_rows(self) -> int:
        """Chunks in flight at most."""

    def steppable(self, item: Work[S]) -> bool:
        """Whether the job can be stepped (else it runs as a whole `run` call)."""

    def admit(self, work: Sequence[Work[S]]) -> list[Any]:
        """Start each job: a handle to pass to `step`, or the job's error."""

    def step(self, handles: Sequence[Any]) -> list[np.ndarray | Exception | None]:
        """One step of every handle; per handle its audio when it finished, its error, or None (steps left)."""

    def cancel(self, handle: Any) -> None:
        """Drop a handle in flight and free what its stream holds."""


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
    # the call that runs it (step mode: from its admission): when it started, and its rows (step mode: the mean
    # chunks per step over the steps it took part in, set when it is answered)
    started_at: float | None = field(init=False, default=None)
    rows: float = field(init=False, default=0.0)

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

    def buffered(self, now: float) -> float:
        """Seconds of audio the listener has not played yet (negative: it ran dry)."""
        return self.started + self.seconds - now


@dataclass(frozen=True)
class _Lane(Generic[S]):
    """One worker thread of call scheduling: the engine it calls and the jobs it takes."""

    name: str
    engine: Token2WavEngine[S]
    first_chunks: bool | None  # True: first chunks only; False: everything else; None: everything (one worker)


@dataclass(eq=False)
class _InFlight(Generic[S]):
    """Step mode: a job whose chunk the engine is stepping."""

    job: _Job[S]
    handle: Any
    steps: int = 0  # steps run so far
    step_rows_before: int = 0  # the service's chunk-steps run before its admission


class Token2WavService(Generic[S]):
    def __init__(
        self,
        engine: Token2WavEngine[S],
        stats: Stats | None = None,
        idle_timeout_s: float = 300.0,
        max_defer_s: float = 0.25,
        scheduling: str = "call",
        first_chunk_engine: Token2WavEngine[S] | None = None,
        first_chunks_between_steps: bool = False,
    ) -> None:
        if scheduling not in T2W_SCHEDULING:
            raise ValueError(f"scheduling must be one of {T2W_SCHEDULING}, got {scheduling!r}")
        if scheduling == "step" and not (callable(getattr(engine, "admit", None)) and getattr(engine, "can_step", True)):
            # an engine that cannot step (the UNet token2wav with flow caches off) runs whole calls, first chunks first
            scheduling = "call"
        self.scheduling = scheduling
        self.engine = engine
        self.max_defer_s = max_defer_s
        self.stats = stats or Stats(TOKEN2WAV_STATS)
        # step mode: chunks in flight (job, engine handle, steps run) and the streams they belong to
        self._in_flight: list[_InFlight[S]] = []
        self._step_rows_run = 0  # step mode: chunk-steps run so far (each step adds its chunks in flight)
        # step mode: per step, (request id, steps that job had run before) of every chunk in it, oldest first
        # (what the scheduler did, for the service's tests and for debugging)
        self.step_trace: deque[tuple[tuple[str, int], ...]] = deque(maxlen=STEP_TRACE_LENGTH)
        # A stream whose orchestrator vanished (crashed process) would never be closed: expire idle ones.
        self.idle_timeout_s = idle_timeout_s
        self._streams: dict[str, S] = {}
        self._last_used: dict[str, float] = {}
        # Ids closed recently: a close can overtake the request's own in-flight first chunk, which must
        # then not open the stream again (ids are never reused, so remembering the last few suffices).
        self._closed_ids: OrderedDict[str, None] = OrderedDict()
        self._pending: list[_Job[S]] = []
        self._running: set[str] = set()  # streams (request ids) with a job in a worker's call now
        self._cond = threading.Condition()
        self._closed = False
        if scheduling == "call" and first_chunk_engine is not None:
            lanes = [_Lane("token2wav", engine, False), _Lane("token2wav-first", first_chunk_engine, True)]
        else:
            lanes = [_Lane("token2wav", engine, None)]
        self.first_chunk_worker = len(lanes) > 1
        self.first_chunks_between_steps = (first_chunks_between_steps and not self.first_chunk_worker
                                           and scheduling == "call"
                                           and bool(getattr(engine, "runs_between_steps", False)))
        # what the between-steps rule weighs: the audio of each stream, and how long both kinds of call take
        self.sample_rate: int | None = getattr(engine, "sample_rate", None)
        self._playback: dict[str, _Playback] = {}
        self._first_call_s = self._later_call_s = INITIAL_CALL_S
        self._threads = [threading.Thread(target=self._run, args=(lane,), name=lane.name, daemon=True)
                         for lane in lanes]
        for thread in self._threads:
            thread.start()

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
        for thread in self._threads:
            thread.join(timeout=10)

    # -- worker threads ------------------------------------------------------------------------
    def _run(self, lane: _Lane[S]) -> None:
        if self.scheduling == "step":
            while self._iterate_steps():
                pass
        else:
            while self._iterate(lane):
                pass

    # -- step mode -------------------------------------------------------------------------------------
    def _iterate_steps(self) -> bool:
        """Admit what is pending, run whole calls for jobs that cannot be stepped, run one estimator step over
        every chunk in flight and answer the finished ones. False when the service is shut down."""
        engine: Any = self.engine
        with self._cond:
            self._expire_idle()
            while not self._pending and not self._in_flight and not self._closed:
                self._cond.wait(timeout=min(self.idle_timeout_s, 60.0))
                self._expire_idle()
            closed = self._closed
            if closed:
                for job in self._pending:
                    job.resolve(RuntimeError("token2wav service is shut down"))
                cancelled, self._in_flight = self._in_flight, []
            else:
                # a stream closed while its chunk is in flight gives its row (and its caches) back now
                cancelled = [row for row in self._in_flight if row.job.request_id in self._closed_ids]
                self._in_flight = [row for row in self._in_flight if row not in cancelled]
                batch = self._take_step_jobs(engine.max_rows - len(self._in_flight))
        for row in cancelled:
            self._cancel(row, RuntimeError("token2wav service is shut down") if closed
                         else InvalidInput(f"token2wav stream {row.job.request_id} was closed"))
        if closed:
            self.stats.set("token2wav_rows_in_flight", 0)
            return False
        try:
            self._admit(batch)
            if self._in_flight:
                self._step()
        except Exception as exc:  # noqa: BLE001 - a dead worker would hang every request: answer and go on
            logger.exception("token2wav step failed")
            failed, self._in_flight = self._in_flight, []
            for row in failed:
                self._cancel(row, exc)
            for job in batch:
                job.resolve(exc)  # no-op for jobs already answered
        self.stats.set("token2wav_rows_in_flight", len(self._in_flight))
        return True

    def _take_step_jobs(self, room: int) -> list[_Job[S]]:
        """Jobs to start now, removed from the queue: at most one per stream and none of a stream with a chunk
        in flight (a stream's chunks stay in order). Streaming chunks: jobs that waited `max_defer_s` first
        (nothing starves), then first chunks, then the rest, oldest first, up to `room`. Offline jobs (whole
        calls, no row) take no room; they wait while first chunks wait or run, up to `max_defer_s`.
        Caller holds the lock."""
        now = time.monotonic()
        busy = {row.job.request_id for row in self._in_flight}
        heads: dict[str, _Job[S]] = {}
        for job in self._pending:
            if job.request_id not in busy:
                heads.setdefault(job.request_id, job)

        def overdue(job: _Job[S]) -> bool:
            return job.queued_at < now - self.max_defer_s

        def rank(job: _Job[S]) -> tuple[int, float]:
            return (0 if overdue(job) else 1 if job.is_first_chunk else 2, job.queued_at)

        chunks = sorted((job for job in heads.values() if job.chunk is not None), key=rank)[: max(room, 0)]
        # a whole call between two steps holds up every chunk in flight: not while a first chunk waits or runs
        first_waiting = any(job.is_first_chunk for job in [*heads.values(), *(row.job for row in self._in_flight)])
        offline = [job for job in heads.values() if job.chunk is None and (not first_waiting or overdue(job))]
        batch = chunks + offline
        for job in batch:
            self._pending.remove(job)
        return batch

    def _admit(self, batch: list[_Job[S]]) -> None:
        """Start the batch's steppable jobs; run the others as one whole call (between two steps)."""
        engine: Any = self.engine
        opened = time.monotonic()  # a first chunk's span starts with opening its stream, as a call's does
        stepped: list[tuple[_Job[S], Work[S]]] = []
        whole: list[_Job[S]] = []
        for job in batch:
            try:
                state = self._state_for(job)
                work = Work(state, job.tokens, job.chunk)
                if engine.steppable(work):
                    stepped.append((job, work))
                    continue
            except Exception as exc:  # noqa: BLE001 - answered per job
                self._finish_job(job, exc)
                continue
            whole.append(job)
        if whole:
            self._execute(whole)
        if not stepped:
            return
        for job, _ in stepped:
            job.started_at = opened
        started = time.monotonic()
        handles = engine.admit([work for _, work in stepped])
        self.stats.add("token2wav_step_seconds_total", time.monotonic() - started)
        for (job, _), handle in zip(stepped, handles, strict=True):
            if isinstance(handle, Exception):
                self._finish_job(job, handle)
            else:
                self._in_flight.append(_InFlight(job, handle, step_rows_before=self._step_rows_run))

    def _step(self) -> None:
        engine: Any = self.engine
        rows = self._in_flight
        started = time.monotonic()
        results = engine.step([row.handle for row in rows])
        self.stats.add("token2wav_step_seconds_total", time.monotonic() - started)
        self._step_rows_run += len(rows)
        self.stats.add("token2wav_steps_total")
        self.stats.add("token2wav_step_rows_total", len(rows))
        self.stats.set("token2wav_max_rows_per_step", max(self.stats.get("token2wav_max_rows_per_step"), len(rows)))
        self.step_trace.append(tuple((row.job.request_id, row.steps) for row in rows))
        still: list[_InFlight[S]] = []
        for row, result in zip(rows, results, strict=True):
            row.steps += 1
            if result is None:
                still.append(row)
            elif isinstance(result, Exception):
                self._cancel(row, result)
            else:
                row.job.rows = (self._step_rows_run - row.step_rows_before) / row.steps
                self._finish_job(row.job, result)
        self._in_flight = still

    def _cancel(self, row: "_InFlight[S]", error: BaseException) -> None:
        """Drop a chunk in flight (closed stream, failure, shutdown) and answer it with `error`."""
        try:
            cast(Any, self.engine).cancel(row.handle)
        except Exception:  # noqa: BLE001 - freeing must not stop the worker
            logger.exception("token2wav: dropping a chunk in flight failed")
        self._finish_job(row.job, error)

    def _finish_job(self, job: _Job[S], result: np.ndarray | BaseException, ended: float | None = None) -> None:
        """Count, end the stream where the chunk failed or was its last, and answer the job. `ended`: when its call
        ended (default: now)."""
        failed = isinstance(result, BaseException)
        self.stats.add("token2wav_failed_total" if failed else "token2wav_chunks_total")
        if not failed and job.is_first_chunk and job.started_at is not None:
            self._count_first_chunk(job, time.monotonic() if ended is None else ended)
        # only for registered streams: a chunk that ends after its stream was closed must not leave an entry
        if (self.first_chunks_between_steps and self.sample_rate and job.chunk is not None and not failed
                and job.request_id in self._streams):
            now = time.monotonic()
            playback = self._playback.setdefault(job.request_id, _Playback(now))
            playback.seconds += cast(np.ndarray, result).size / self.sample_rate
        if job.chunk is not None and (failed or job.chunk.final):
            # a failed chunk leaves the stream's caches inconsistent; a final one ends it
            with self._cond:
                self._drop(job.request_id)
        job.resolve(result)

    def _count_first_chunk(self, job: _Job[S], ended: float) -> None:
        assert job.started_at is not None
        self.stats.add_all({
            "token2wav_first_chunks_total": 1,
            "token2wav_first_chunk_wait_seconds_total": job.started_at - job.queued_at,
            "token2wav_first_chunk_call_seconds_total": ended - job.started_at,
            "token2wav_first_chunk_rows_total": job.rows,
        })  # fmt: skip

    def _iterate(self, lane: _Lane[S]) -> bool:
        """Take the lane's next batch and run it. False when the service is shut down."""
        with self._cond:
            self._expire_idle()
            batch = self._take_batch(lane)
            while not batch and not self._closed:
                self._cond.wait(timeout=min(self.idle_timeout_s, 60.0))
                self._expire_idle()
                batch = self._take_batch(lane)
            if self._closed:
                for job in [*batch, *self._pending]:
                    job.resolve(RuntimeError("token2wav service is shut down"))
                self._pending.clear()
                return False
        hook = None
        if self.first_chunks_between_steps and not any(job.is_first_chunk for job in batch):
            hook = functools.partial(self._first_chunks_between_steps, batch)
        started = time.monotonic()
        try:
            self._execute(batch, lane.engine, between_steps=hook)
            if hook is not None:
                self._later_call_s = _mean(self._later_call_s, time.monotonic() - started)
        except Exception as exc:  # noqa: BLE001 - a dead worker would hang every request: answer and go on
            logger.exception("token2wav batch failed")
            for job in batch:
                job.resolve(exc)  # no-op for jobs already answered
        finally:
            with self._cond:
                self._running.difference_update(job.request_id for job in batch)
                self._cond.notify_all()  # the other worker may now take these streams' next chunks
        if lane.first_chunks:
            self.stats.add("token2wav_first_chunk_calls_total")
        return True

    def _take_batch(self, lane: _Lane[S]) -> list[_Job[S]]:
        """The lane's next call's jobs, removed from the queue: one per stream (the oldest, which keeps a
        stream's chunks in order), none of a stream whose job the other worker runs now. One worker: only first
        chunks and overdue jobs while any first chunk waits. Caller holds the lock."""
        batch = self._heads()
        if lane.first_chunks is None:
            if any(job.is_first_chunk for job in batch):
                overdue = time.monotonic() - self.max_defer_s
                batch = [job for job in batch if job.is_first_chunk or job.queued_at < overdue]
        else:
            batch = [job for job in batch if job.is_first_chunk == lane.first_chunks]
        for job in batch:
            self._pending.remove(job)
            self._running.add(job.request_id)
        return batch

    def _heads(self) -> list[_Job[S]]:
        """Each stream's oldest pending job (which keeps a stream's chunks in order), except streams with a job in
        a call now. Caller holds the lock."""
        heads: dict[str, _Job[S]] = {}
        for job in self._pending:
            if job.request_id not in self._running:
                heads.setdefault(job.request_id, job)
        return list(heads.values())

    def _first_chunks_between_steps(self, running: list[_Job[S]]) -> None:
        """Called by the engine before each Euler step of the call of `running` (later chunks): the first chunks
        waiting now run as a call of their own (these streams are not in the running call: they had no chunk
        before), unless a running stream has too little audio buffered to wait for it."""
        with self._cond:
            if self._closed:
                return
            batch = [job for job in self._heads() if job.is_first_chunk]
            if not batch:
                return
            if not self._can_wait(running):
                self.stats.add("token2wav_between_steps_deferred_total")
                return
            for job in batch:
                self._pending.remove(job)
                self._running.add(job.request_id)
        started = time.monotonic()
        try:
            self._execute(batch)  # no hook: a first-chunk call never waits for anything
            self._first_call_s = _mean(self._first_call_s, time.monotonic() - started)
        except Exception as exc:  # noqa: BLE001 - the running call must go on; these jobs get the error
            logger.exception("token2wav first-chunk call between steps failed")
            for job in batch:
                job.resolve(exc)
        finally:
            with self._cond:
                self._running.difference_update(job.request_id for job in batch)
        self.stats.add("token2wav_calls_between_steps_total")

    def _can_wait(self, running: list[_Job[S]]) -> bool:
        """Whether every stream of a running call keeps playing through a first-chunk call and the rest of its own
        call (twice the recent first-chunk call, for margin, plus a whole later call). Caller holds the lock."""
        if not self.sample_rate:
            return True
        now, need = time.monotonic(), 2 * self._first_call_s + self._later_call_s
        for job in running:
            playback = self._playback.get(job.request_id)
            if job.chunk is not None and playback is not None and playback.buffered(now) < need:
                return False
        return True

    def _execute(self, batch: list[_Job[S]], engine: Token2WavEngine[S] | None = None,
                 between_steps: Any = None) -> None:
        engine = engine or self.engine
        opened = time.monotonic()  # a first chunk's call starts with opening its stream (prompt to the device)
        work: list[Work[S]] = []
        runnable: list[_Job[S]] = []
        for job in batch:
            try:
                state = self._state_for(job, engine)
            except Exception as exc:
                job.resolve(exc)
                continue
            runnable.append(job)
            work.append(Work(state, job.tokens, job.chunk))
        if not work:
            return
        for job in runnable:
            job.started_at, job.rows = opened, float(len(work))
        started = time.monotonic()
        try:
            results: list[np.ndarray | Exception] = (
                engine.run(work) if between_steps is None else cast(Any, engine).run(work, between_steps=between_steps))
        except Exception as exc:
            results = [exc] * len(work)
        ended = time.monotonic()
        self.stats.add("token2wav_engine_seconds_total", ended - started)
        self.stats.add("token2wav_engine_calls_total")
        self.stats.add("token2wav_call_jobs_total", len(work))
        self.stats.set("token2wav_max_jobs_per_call", max(self.stats.get("token2wav_max_jobs_per_call"), len(work)))
        for job, result in zip(runnable, results, strict=True):
            self._finish_job(job, result, ended)

    def _state_for(self, job: _Job[S], engine: Token2WavEngine[S] | None = None) -> S:
        engine = engine or self.engine  # the engine of the worker that runs the job opens its stream
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


def _mean(mean: float, value: float) -> float:
    """The running mean of call durations with `value` added."""
    return (1.0 - CALL_MEAN_WEIGHT) * mean + CALL_MEAN_WEIGHT * value
