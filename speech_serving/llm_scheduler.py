"""Continuous batching for the LLM: every active sequence advances by one token per decoder step.

A `SlotDecoder` owns a static KV cache with a fixed number of slots (the engine's batched decoder).
The scheduler runs it on one worker thread: between steps it removes cancelled sequences, admits
waiting requests into free slots (prefill), then runs one step for all occupied slots and hands each
new token to its request's asyncio consumer. New requests therefore join a running batch at the next
step instead of waiting for the batch to drain, and a cancelled request frees its slot at once.

The worker's per-step host work is kept small, because it adds to every decode step (the GPU idles
meanwhile): a request may say at which token counts it needs its tokens (`deliver_at`, e.g. the
streaming schedule's chunk boundaries) and is woken only then; the hand-overs of one step reach each
event loop in a single `call_soon_threadsafe`; the lock is taken per step only when sequences end, and
the step counters are published every `STEP_STATS_PERIOD_S`, not per step.

For the first chunk of every streaming request (`FIRST_CHUNK_STATS`) the scheduler adds up where its time went:
the wait in the queue, its prefill call, and the decode steps until the hand-over that completes the chunk. They
are taken from clock readings the worker makes anyway (around prefills and steps), added up once per request at
that hand-over (the per-step loop only checks, at each hand-over, whether it is a request's first) and published
with the step counters.

Requests beyond the free slots wait in a bounded queue; a full queue rejects with `Overloaded`.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import AsyncIterator, Generic, Protocol, Sequence, TypeVar

from speech_serving.errors import Overloaded
from speech_serving.gpu_yield import LLM_YIELD_MODES, Token2WavCalls
from speech_serving.stats import Stats

R = TypeVar("R")

#: The interpreter's thread switch interval of a serving process (`sys.setswitchinterval`; Python's default 5 ms).
#: The LLM's worker waits for each step's tokens without the interpreter lock, and takes it back when the GPU is done;
#: while another thread runs Python - token2wav's worker launching its kernels, an event loop - it waits up to this
#: long for it. 0.2 ms cut a stub step's overrun beside a busy thread (1.1 -> 0.3 ms, `python -m
#: enginebench.llm_scheduler --busy-thread`, docs/triton.md) but changed nothing on a GPU: the decode step beside
#: token2wav took 2.95 / 3.00 ms at 1 / 0.2 ms (`enginebench.sm_share`), and the stack's levels were the same
#: (docs/experiments/2026-11-28-four-h100s-lease.md). The step is slower beside token2wav for the GPU, not the lock.
SWITCH_INTERVAL_S = 0.001

#: Step counters (and the first-chunk sums) reach `stats` (and its listeners: the metrics exporter) at most this
#: often, and whenever a sequence ends or the worker goes idle; per step they are only added up locally.
STEP_STATS_PERIOD_S = 0.05

logger = logging.getLogger(__name__)

LLM_STATS = (
    "llm_active_sequences",
    "llm_waiting_requests",
    "llm_finished_total",
    "llm_cancelled_total",
    "llm_failed_total",
    "llm_steps_total",
    "llm_step_seconds_total",  # wall time inside decoder steps (divide by llm_steps_total for the mean)
    "llm_step_sync_seconds_total",  # of it, the waits for the steps' tokens (the device); the rest is host work
    "llm_step_device_seconds_total",  # the steps' kernels' spans on the device (against the waits: a late start)
    "llm_yield_seconds_total",  # waits for a running token2wav call before a step (`gpu_yield`, llm_yield=lone)
    "llm_prefill_seconds_total",
    "llm_prefill_calls_total",  # prefill forwards (several waiting requests share one)
    "llm_responses_total",  # token hand-overs, responses or in-process (`deliver_at`: one per boundary + end)
)

#: Summed over the first chunks of streaming requests (docs/PERFORMANCE.md#what-is-measured): a request's first chunk
#: is its first hand-over (its first `deliver_at` boundary, or the end if it ends before that or has no boundary;
#: without a schedule its first token). An offline request (`submit(..., streaming=False)`), or one cancelled or
#: failed before its first hand-over, is not counted. Divide each sum by `llm_first_chunks_total` for the mean.
FIRST_CHUNK_STATS = (
    "llm_first_chunks_total",
    "llm_first_chunk_wait_seconds_total",  # submit -> its prefill call starts (the queue)
    "llm_first_chunk_prefill_seconds_total",  # its prefill call (shared with the requests admitted with it)
    "llm_first_chunk_decode_seconds_total",  # end of the prefill -> the step that completes the first chunk
    "llm_first_chunk_steps_total",  # decoder steps in that span
)
LLM_STATS += FIRST_CHUNK_STATS

#: The steps that ran beside a token2wav call of this process (one was running at the step's start, or one started
#: during it), and their part of `llm_step_seconds_total` and `llm_step_sync_seconds_total`: the rest ran with
#: token2wav idle. Kept only where the scheduler sees token2wav's calls (`Token2WavCalls`: the colocated layout);
#: elsewhere the names are absent, so that 0 says no step ran beside a call, never that none was seen.
BESIDE_TOKEN2WAV_STATS = (
    "llm_steps_beside_token2wav_total",
    "llm_step_beside_token2wav_seconds_total",
    "llm_step_beside_token2wav_sync_seconds_total",
)


@dataclass(frozen=True)
class StepOutput:
    """What one decoder step produced for one slot."""

    token: int | None  # the emitted speech token, None when the step ended the sequence without one
    finished: bool  # the sequence is complete (stop token or max length); its slot may be reused


class SlotDecoder(Protocol[R]):
    """A batched decoder with a fixed number of KV-cache slots. Called from one thread only."""

    #: Of the last `step`, the seconds the host waited for its tokens: the device's work that the host's launch
    #: did not cover (the rest of the step is host work). 0 where the step has no such wait (a CPU, a stub).
    last_step_sync_seconds: float
    #: Of the last `step`, the span of its kernels on the device (0 where there is none: a CPU, a stub).
    last_step_device_seconds: float

    @property
    def num_slots(self) -> int: ...

    def add(self, request: R) -> int:
        """Prefill `request` into a free slot and return the slot index."""

    def add_many(self, requests: Sequence[R]) -> list[int]:
        """Prefill several requests in one forward (all or nothing); their slots, in order."""

    def step(self) -> dict[int, StepOutput]:
        """Advance every occupied slot by one token."""

    def remove(self, slot: int) -> None:
        """Free `slot` (finished or cancelled)."""


@dataclass(frozen=True)
class Delivery:
    """What one hand-over to a consumer carries: the tokens decoded since the last one, and whether the
    sequence ended with it (with `error` set when it failed)."""

    tokens: list[int]
    last: bool = False
    error: BaseException | None = None


_NEVER = 1 << 62  # a `due` no sequence reaches


class _Job(Generic[R]):
    """One request: its consumer's loop and queue, and the tokens decoded but not handed over yet.

    `deliver_at` (ascending cumulative token counts) says when the consumer needs its tokens: they are
    buffered here until the count reaches the next boundary (and at the end); None hands over every token.
    """

    __slots__ = ("request_id", "request", "loop", "queue", "slot", "cancelled", "pending", "emitted", "due",
                 "_boundaries", "scheduled", "submitted_at", "has_first_chunk", "first_chunk")

    def __init__(
        self, request_id: str, request: R, loop: asyncio.AbstractEventLoop, deliver_at: Sequence[int] | None,
        streaming: bool,
    ) -> None:
        self.request_id = request_id
        self.request = request
        self.loop = loop
        self.queue: asyncio.Queue[Delivery] = asyncio.Queue()
        self.slot: int | None = None
        self.cancelled = False
        self.pending: list[int] = []
        self.emitted = 0  # tokens decoded so far
        self.scheduled = deliver_at is not None
        self.submitted_at = time.perf_counter()
        self.has_first_chunk = streaming
        # from admission until the first hand-over: (queue wait, prefill call, end of prefill, scheduler steps then)
        self.first_chunk: tuple[float, float, float, int] | None = None
        # boundaries still ahead, the next one last; `due` is the next one (0: every token, _NEVER: only the end)
        self._boundaries = sorted(set(deliver_at or ()), reverse=True)
        self.due = 0
        if self.scheduled:
            self.advance()

    def advance(self) -> None:
        """The buffered tokens were handed over at `due`: move on to the next boundary past `emitted`."""
        if not self.scheduled:
            return
        boundaries = self._boundaries
        while boundaries and boundaries[-1] <= self.emitted:
            boundaries.pop()
        self.due = boundaries.pop() if boundaries else _NEVER

    def take(self, last: bool = False, error: BaseException | None = None) -> Delivery:
        tokens, self.pending = self.pending, []
        return Delivery(tokens, last, error)


class _Outbox:
    """The deliveries of one scheduler iteration, grouped by event loop: each loop is woken once
    (`call_soon_threadsafe` writes to the loop's wake-up pipe, a system call) however many tokens and
    requests it receives."""

    __slots__ = ("_by_loop",)

    def __init__(self) -> None:
        self._by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, Delivery]]] = {}

    def put(self, job: _Job, delivery: Delivery) -> None:
        batch = self._by_loop.get(job.loop)
        if batch is None:
            batch = self._by_loop[job.loop] = []
        batch.append((job.queue, delivery))

    def send(self) -> None:
        for loop, batch in self._by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, batch)
            except RuntimeError:  # the consumers' loop is gone; nobody is listening any more
                pass
        self._by_loop = {}


def _put_all(batch: list[tuple[asyncio.Queue, Delivery]]) -> None:
    for queue, delivery in batch:
        queue.put_nowait(delivery)


class TokenStream:
    """The consumer side of one request: async-iterate to get lists of new tokens as they are decoded."""

    def __init__(self, job: _Job, scheduler: ContinuousBatchingScheduler) -> None:
        self._job = job
        self._scheduler = scheduler
        self.request_id = job.request_id
        self._scheduled = job.scheduled

    def __aiter__(self) -> AsyncIterator[list[int]]:
        return self._tokens()

    async def _tokens(self) -> AsyncIterator[list[int]]:
        async for delivery in self.deliveries():
            if delivery.tokens:
                yield delivery.tokens

    async def deliveries(self) -> AsyncIterator[Delivery]:
        """Every hand-over; the last one has `last` set (and raises its error after its tokens, if any).

        With a delivery schedule each hand-over is one delivery, exactly as scheduled; without one, the
        hand-overs already waiting are merged, so a slow consumer gets fewer, larger batches.
        """
        queue = self._job.queue
        while True:
            delivery = await queue.get()
            if not self._scheduled:
                while not delivery.last and not queue.empty():
                    more = queue.get_nowait()
                    delivery = Delivery(delivery.tokens + more.tokens, more.last, more.error)
            if delivery.error is not None:
                if delivery.tokens:
                    yield Delivery(delivery.tokens)
                raise delivery.error
            yield delivery
            if delivery.last:
                return

    def cancel(self) -> None:
        self._scheduler.cancel(self.request_id)


class ContinuousBatchingScheduler(Generic[R]):
    def __init__(self, decoder: SlotDecoder[R], max_waiting: int, stats: Stats | None = None,
                 yield_to: Token2WavCalls | None = None, max_yield_s: float = 0.25, yield_mode: str = "lone") -> None:
        """`yield_to`: the token2wav calls of this process to wait for (`gpu_yield`, at most `max_yield_s` a step)
        when `yield_mode` says: "lone", while the LLM decodes one stream past its first chunk; "off" (or `yield_to`
        None): never. The steps beside the calls are counted too (`observe_token2wav`)."""
        if yield_mode not in LLM_YIELD_MODES:
            raise ValueError(f"yield_mode must be one of {LLM_YIELD_MODES}, got {yield_mode!r}")
        self.decoder = decoder
        self.yield_to = yield_to if yield_mode != "off" else None
        self.yield_mode = yield_mode
        self.max_yield_s = max_yield_s
        self.max_waiting = max_waiting
        self.stats = stats or Stats(LLM_STATS)
        self._token2wav_calls: Token2WavCalls | None = None  # read by the worker before and after each step
        if yield_to is not None:
            self.observe_token2wav(yield_to)
        self._lock = threading.Condition()
        self._waiting: deque[_Job[R]] = deque()
        self._jobs: dict[str, _Job[R]] = {}  # waiting and active, by request id
        self._active: dict[int, _Job[R]] = {}  # by slot
        self._cancels = 0  # cancellations not yet applied by the worker (it skips the scan while 0)
        self._closed = False
        self._outbox = _Outbox()  # worker thread only
        self._steps = 0  # worker thread only: steps run, and those of them (and their seconds) not yet in `stats`
        self._published_steps = 0
        self._unpublished_seconds = 0.0
        self._unpublished_sync_seconds = 0.0
        self._unpublished_device_seconds = 0.0
        self._unpublished_beside_steps = 0  # worker thread only: of the unpublished steps, those beside token2wav
        self._unpublished_beside_seconds = 0.0
        self._unpublished_beside_sync_seconds = 0.0
        self._unpublished_first_chunks = dict.fromkeys(FIRST_CHUNK_STATS, 0.0)  # worker thread only
        self._publish_at = 0.0
        self._thread = threading.Thread(target=self._run, name="llm-scheduler", daemon=True)
        self._thread.start()

    # -- called from the event loop ------------------------------------------------------------
    def submit(self, request_id: str, request: R, deliver_at: Sequence[int] | None = None,
               streaming: bool | None = None) -> TokenStream:
        """Queue `request`; its tokens arrive on the returned stream.

        `deliver_at`: cumulative token counts at which the consumer needs the tokens decoded so far (e.g. the
        chunk boundaries of a streaming schedule); tokens are handed over only there and at the end, so the
        consumer wakes up once per boundary instead of once per token. Empty: only at the end. None: every step.
        `streaming`: whether the consumer streams, so that its first hand-over is a first chunk (`FIRST_CHUNK_STATS`;
        a streaming request too short for a boundary has an empty `deliver_at`); default: unless `deliver_at` is empty.
        """
        if streaming is None:
            streaming = deliver_at is None or len(deliver_at) > 0
        job = _Job(request_id, request, asyncio.get_running_loop(), deliver_at, streaming)
        with self._lock:
            if self._closed:
                raise RuntimeError("scheduler is closed")
            if request_id in self._jobs:
                raise ValueError(f"duplicate LLM request id {request_id!r}")
            free_slots = self.decoder.num_slots - len(self._active)
            waiting = sum(not job.cancelled for job in self._waiting)
            if waiting >= free_slots + self.max_waiting:
                raise Overloaded(f"LLM busy: {len(self._active)} active sequences and {waiting} waiting")
            self._jobs[request_id] = job
            self._waiting.append(job)
            self.stats.set("llm_waiting_requests", len(self._waiting))
            self._lock.notify()
        return TokenStream(job, self)

    def cancel(self, request_id: str) -> bool:
        """Stop `request_id`; its stream ends without error. False when it is unknown or already done."""
        with self._lock:
            job = self._jobs.get(request_id)
            if job is None or job.cancelled:
                return False
            job.cancelled = True
            self._cancels += 1
            self._lock.notify()
            return True

    def active_request_ids(self) -> set[str]:
        with self._lock:
            return set(self._jobs)

    @property
    def observed_token2wav(self) -> Token2WavCalls | None:
        """The token2wav calls whose overlap with the steps is counted (None: not counted)."""
        return self._token2wav_calls

    def observe_token2wav(self, calls: Token2WavCalls) -> None:
        """Count the steps that run beside `calls` (`BESIDE_TOKEN2WAV_STATS`), without waiting for them (`yield_to`
        waits, and observes its calls itself). Before the stats are exported: it declares their names."""
        self.stats.declare(BESIDE_TOKEN2WAV_STATS)
        self._token2wav_calls = calls

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._lock.notify()
        self._thread.join(timeout=10)

    # -- worker thread -------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            try:
                if not self._iterate():
                    return
            except Exception as exc:  # noqa: BLE001 - a dead worker would hang every request: fail them, go on
                logger.exception("LLM scheduler iteration failed")
                with self._lock:
                    self._fail_all(exc)
            finally:
                self._outbox.send()

    def _iterate(self) -> bool:
        """Admit, then step once. False when the scheduler is closed."""
        admit: list[_Job[R]] = []
        with self._lock:
            if not self._closed and not self._active and not self._waiting:
                self._publish_step_stats()
            while not self._closed and not self._active and not self._waiting:
                self._lock.wait()
            if self._closed:
                self._fail_all(RuntimeError("LLM scheduler shut down"))
                return False
            if self._cancels:
                self._drop_cancelled()
            if self._waiting and len(self._active) < self.decoder.num_slots:
                while self._waiting and len(self._active) + len(admit) < self.decoder.num_slots:
                    admit.append(self._waiting.popleft())
                self.stats.set("llm_waiting_requests", len(self._waiting))
        if admit:  # prefill outside the lock: submit/cancel stay responsive
            self._admit(admit)
        if self._active:
            if self.yield_to is not None and self._lone_past_first_chunk():
                waited = self.yield_to.wait_while_running(
                    self.max_yield_s, lambda: bool(self._waiting or self._cancels or self._closed))
                if waited:
                    self.stats.add("llm_yield_seconds_total", waited)
                if self._waiting or self._cancels or self._closed:
                    return True  # admit, cancel or close before the step
            self._step()
        return True

    def _lone_past_first_chunk(self) -> bool:
        """One streaming sequence active, its first chunk handed over, nothing waiting: its next tokens can wait
        for a running token2wav call (`gpu_yield`). Worker thread only (it alone changes `_active`)."""
        if len(self._active) != 1 or self._waiting:
            return False
        (job,) = self._active.values()
        return job.has_first_chunk and job.first_chunk is None and not job.cancelled

    def _admit(self, jobs: list[_Job[R]]) -> None:
        """Prefill `jobs` together (one forward); if that fails, one by one so a bad request fails alone."""
        started = time.perf_counter()
        try:
            slots: list[int | BaseException] = (
                list(self.decoder.add_many([job.request for job in jobs])) if len(jobs) > 1 else []
            )
        except Exception:  # noqa: BLE001 - retried per request below, which reports the real error
            slots = []
        if not slots:
            slots = [self._add_one(job) for job in jobs]
        ended = time.perf_counter()
        self.stats.add("llm_prefill_seconds_total", ended - started)
        self.stats.add("llm_prefill_calls_total")
        with self._lock:
            for job, slot in zip(jobs, slots, strict=True):
                if isinstance(slot, BaseException):
                    self._finish(job, "llm_failed_total", slot)
                    continue
                job.slot = slot
                if job.has_first_chunk:
                    job.first_chunk = (started - job.submitted_at, ended - started, ended, self._steps)
                self._active[slot] = job
            self.stats.set("llm_active_sequences", len(self._active))

    def _add_one(self, job: _Job[R]) -> int | BaseException:
        try:
            return self.decoder.add(job.request)
        except Exception as exc:  # noqa: BLE001 - a bad request fails alone
            return exc

    def _step(self) -> None:
        calls = self._token2wav_calls
        # `started` before `busy` (`Token2WavCalls.started`): plain reads, no lock
        calls_started = -1 if calls is None else calls.started
        beside = calls is not None and calls.busy
        started = time.perf_counter()
        try:
            outputs = self.decoder.step()
        except Exception as exc:  # the batch state is unknown: fail the sequences in it, keep serving
            with self._lock:
                for job in list(self._active.values()):
                    self._release(job, "llm_failed_total", exc)
            return
        ended = time.perf_counter()
        sync = self.decoder.last_step_sync_seconds
        self._steps += 1
        self._unpublished_seconds += ended - started
        self._unpublished_sync_seconds += sync
        self._unpublished_device_seconds += self.decoder.last_step_device_seconds
        if calls is not None and (beside or calls.started != calls_started):
            self._unpublished_beside_steps += 1
            self._unpublished_beside_seconds += ended - started
            self._unpublished_beside_sync_seconds += sync
        active, outbox = self._active, self._outbox
        finished: list[_Job[R]] = []
        # Only the worker thread changes `_active` and a job's token buffer, so the tokens are sorted out
        # without the lock; it is taken only when sequences end. This loop runs for every token: inlined.
        for slot, out in outputs.items():
            job = active.get(slot)
            if job is None:
                continue
            token = out.token
            if token is not None and not job.cancelled:
                job.pending.append(token)
                job.emitted += 1
                if out.finished:
                    finished.append(job)  # its tokens go out with its end
                elif job.emitted >= job.due:
                    outbox.put(job, job.take())
                    job.advance()
                    if job.first_chunk is not None:  # once per request, at a hand-over (never per token)
                        self._count_first_chunk(job, ended)
            elif out.finished:
                finished.append(job)
        if finished:
            with self._lock:
                for job in finished:
                    self._release(job, "llm_finished_total")
            self._publish_step_stats()  # before the ends are handed over (`_run` sends the outbox)
        elif ended >= self._publish_at:
            self._publish_step_stats()
            self._publish_at = ended + STEP_STATS_PERIOD_S

    def _publish_step_stats(self) -> None:
        if self._steps != self._published_steps:
            steps = {"llm_steps_total": self._steps - self._published_steps,
                     "llm_step_seconds_total": self._unpublished_seconds,
                     "llm_step_sync_seconds_total": self._unpublished_sync_seconds,
                     "llm_step_device_seconds_total": self._unpublished_device_seconds}
            if self._unpublished_beside_steps:  # with the steps they are part of: a scrape sees both or neither
                steps.update({"llm_steps_beside_token2wav_total": self._unpublished_beside_steps,
                              "llm_step_beside_token2wav_seconds_total": self._unpublished_beside_seconds,
                              "llm_step_beside_token2wav_sync_seconds_total": self._unpublished_beside_sync_seconds})
                self._unpublished_beside_steps = 0
                self._unpublished_beside_seconds = self._unpublished_beside_sync_seconds = 0.0
            self.stats.add_all(steps)
            self._published_steps, self._unpublished_seconds, self._unpublished_sync_seconds = self._steps, 0.0, 0.0
            self._unpublished_device_seconds = 0.0
        first_chunks = self._unpublished_first_chunks
        if first_chunks["llm_first_chunks_total"]:
            self._unpublished_first_chunks = dict.fromkeys(FIRST_CHUNK_STATS, 0.0)
            self.stats.add_all(first_chunks)  # the count with its sums: a scrape never sees one without the other

    def _count_first_chunk(self, job: _Job[R], delivered_at: float) -> None:
        """The hand-over at `delivered_at` (the end of the step that made it) completes the job's first chunk.
        Worker thread only (as every path that ends a job or hands over to it)."""
        assert job.first_chunk is not None
        wait, prefill, prefilled_at, steps = job.first_chunk
        job.first_chunk = None
        sums = self._unpublished_first_chunks
        sums["llm_first_chunks_total"] += 1
        sums["llm_first_chunk_wait_seconds_total"] += wait
        sums["llm_first_chunk_prefill_seconds_total"] += prefill
        sums["llm_first_chunk_decode_seconds_total"] += delivered_at - prefilled_at
        sums["llm_first_chunk_steps_total"] += self._steps - steps

    def _drop_cancelled(self) -> None:
        active = [j for j in self._active.values() if j.cancelled]
        for job in active:
            self._release(job, "llm_cancelled_total")
        if active:  # as for a finished job: the steps it ran are counted before its end is handed over
            self._publish_step_stats()
        waiting = [j for j in self._waiting if j.cancelled]
        for job in waiting:
            self._waiting.remove(job)
            self._finish(job, "llm_cancelled_total")
        if waiting:
            self.stats.set("llm_waiting_requests", len(self._waiting))
        self._cancels = 0

    def _release(self, job: _Job[R], counter: str, error: BaseException | None = None) -> None:
        """Free the slot of an active job and end its stream. Caller holds the lock."""
        assert job.slot is not None
        del self._active[job.slot]
        try:
            self.decoder.remove(job.slot)
        finally:
            self.stats.set("llm_active_sequences", len(self._active))
            self._finish(job, counter, error)

    def _finish(self, job: _Job[R], counter: str, error: BaseException | None = None) -> None:
        """End the job's stream: what it buffered goes out with the end (a cancelled job's is dropped)."""
        self._jobs.pop(job.request_id, None)
        self.stats.add(counter)
        if job.cancelled:
            job.pending = []
        elif error is None and job.first_chunk is not None:  # it ended before its first boundary: the end is it
            self._count_first_chunk(job, time.perf_counter())
        self._outbox.put(job, job.take(last=True, error=error))

    def _fail_all(self, error: BaseException) -> None:
        for job in list(self._active.values()):
            self._release(job, "llm_failed_total", error)
        while self._waiting:
            self._finish(self._waiting.popleft(), "llm_failed_total", error)
        self.stats.set("llm_waiting_requests", 0)
