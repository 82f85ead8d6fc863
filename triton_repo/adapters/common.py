"""What every Triton adapter shares: parameters, tensors <-> numpy, responses, BLS calls, metrics.

Imported only inside tritonserver's python stub (it needs `triton_python_backend_utils`).
"""

from __future__ import annotations

import asyncio
import contextlib
import faulthandler
import json
import logging
import sys
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Any, AsyncIterator, Awaitable, Callable, Mapping, Sequence

import numpy as np
import triton_python_backend_utils as pb_utils

from speech_serving.errors import RemoteError, UnknownVoice
from speech_serving.heap import GcPauses, freeze_heap
from speech_serving.loop_watchdog import LoopWatchdog
from speech_serving.orchestrator import FinalResponseGuard, parse_request, run_until_cancelled
from speech_serving.llm_scheduler import SWITCH_INTERVAL_S
from speech_serving.stats import Stats
import pipeline_contract as contract
from pipeline_contract import SpeechChunk, SpeechRequest, TensorSpec
from triton_repo.cuda_libraries import check_cuda_libraries
from triton_repo.model_params import ModelParams

logger = logging.getLogger("cosyvoice2.triton")

# A stub that dies in native code leaves only "stub process is not healthy" behind: print every thread's
# Python stack to stderr (tritonserver's log) on SIGSEGV/SIGABRT/SIGBUS/SIGFPE instead.
faulthandler.enable(all_threads=True)

# Every stub runs several Python threads that hand work to each other (event loop, BLS readers, the LLM
# scheduler, the token2wav worker): a thread woken by a finished GPU step waits up to the switch interval for the
# GIL (`SWITCH_INTERVAL_S` says why it is short).
sys.setswitchinterval(SWITCH_INTERVAL_S)

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL

#: Each decoupled BLS stream is read by one blocking reader here, never on the stub's event loop (it would
#: stall every request). A reader is busy for its stream's whole life, hence the many workers.
_BLS_THREADS = ThreadPoolExecutor(max_workers=1024, thread_name_prefix="bls")
#: This process's event loop, watched from its first request on (`serving_loop`).
_WATCHDOG = LoopWatchdog()
#: No internal model ever goes this long without answering (a decode step is milliseconds, a token2wav call
#: well under a second): a silent callee fails the request with a clear error instead of hanging it.
BLS_STALL_TIMEOUT_S = 60.0
#: This process's garbage collections, counted from its start; exported with its model's stats (`model_ready`).
_GC_PAUSES = GcPauses().install()
_IN_FLIGHT: set[asyncio.Task] = set()
_LOOP: asyncio.AbstractEventLoop | None = None
_LOOP_LOCK = threading.Lock()


def model_config(args: Mapping[str, str]) -> dict[str, Any]:
    return json.loads(args["model_config"])


def model_params(args: Mapping[str, str]) -> dict[str, str]:
    """The model's string parameters. Every model's `initialize` reads them first, so here the process's event-loop
    watchdog learns whose loop it watches (one model per python stub process)."""
    _WATCHDOG.name = args.get("model_name", _WATCHDOG.name)
    return {k: v["string_value"] for k, v in model_config(args).get("parameters", {}).items()}


def model_ready(model_name: str, *stats: Stats) -> MetricsExporter:
    """The end of every model's `initialize`, once the model has loaded what it serves (engines, graphs, caches):
    warns about a CUDA library loaded from two places, freezes the process's heap (`speech_serving.heap`: a full
    collection would otherwise walk everything loaded, every thread stopped), and exports `stats` with the
    process's collector counters as the model's metrics."""
    check_cuda_libraries(logger)  # the engines' libraries are mapped by now
    frozen = freeze_heap(_GC_PAUSES.stats)
    logger.info("%s loaded: %d objects frozen out of the garbage collector's walks", model_name, frozen)
    return MetricsExporter(model_name, *stats, _GC_PAUSES.stats)


def is_decoupled(args: Mapping[str, str]) -> bool:
    return pb_utils.using_decoupled_model_transaction_policy(model_config(args))


def read_inputs(request: Any, specs: Sequence[TensorSpec]) -> dict[str, np.ndarray | None]:
    arrays: dict[str, np.ndarray | None] = {}
    for spec in specs:
        tensor = pb_utils.get_input_tensor_by_name(request, spec.name)
        arrays[spec.name] = None if tensor is None else tensor.as_numpy()
    return arrays


def tensors(arrays: Mapping[str, np.ndarray]) -> list[Any]:
    return [pb_utils.Tensor(name, np.ascontiguousarray(value)) for name, value in arrays.items()]


def response(arrays: Mapping[str, np.ndarray]) -> Any:
    return pb_utils.InferenceResponse(output_tensors=tensors(arrays))


def error_response(exc: BaseException) -> Any:
    return pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(str(exc) or type(exc).__name__))


def serve(requests: Sequence[Any], handle: Callable[[Any, Any], Awaitable[None]], *, cancellable: bool) -> None:
    """A model's `execute`: hands each request to this process's serving loop as a task of its own (the requests
    run concurrently, no head-of-line blocking) and returns at once, before any of them is answered.

    `handle(request, sender)` sends the request's responses, the last with the FINAL flag; if it fails
    the error goes back as the final response. `cancellable` (the pipeline's entry models): a client that leaves
    cancels the task. The models behind them are never cancelled through tritonserver - their callers stop what
    they started explicitly (an LLM `stop` request, a token2wav close) - so they are not asked: each
    `is_cancelled()` is a blocking round trip to tritonserver on the event loop, and the engine would ask it for
    every in-flight LLM sequence and token2wav job every 50 ms.

    Why `execute` is a plain function and the loop is ours, not the stub's: for an `async def execute` of a
    decoupled model the python stub schedules the coroutine on its own loop, then registers a done-callback that
    removes the coroutine's future from a set, then adds the future to that set. A coroutine that finished in
    between (a request refused at once, say) made the removal fail ("Cannot remove future from background;
    KeyError", an error line per request) and left the finished future in the set for good; no wait inside the
    coroutine closes that window. A plain `execute` that returns None is the stub's ordinary decoupled path (and,
    for a non-decoupled model, answered through its response sender, the default one), with no bookkeeping.
    """
    loop = serving_loop()
    loop.call_soon_threadsafe(_start_all, list(requests), handle, cancellable)


def serving_loop() -> asyncio.AbstractEventLoop:
    """This process's one event loop, on a daemon thread of its own, started on first use and watched
    (`speech_serving.loop_watchdog`: stuck for seconds, it is logged with every thread's stack)."""
    global _LOOP  # noqa: PLW0603 - one loop per process, made once
    with _LOOP_LOCK:
        if _LOOP is None:
            loop = asyncio.new_event_loop()
            threading.Thread(target=loop.run_forever, name="serving-loop", daemon=True).start()
            loop.call_soon_threadsafe(_WATCHDOG.start, loop)
            _LOOP = loop
        return _LOOP


def _start_all(requests: list[Any], handle: Callable[[Any, Any], Awaitable[None]], cancellable: bool) -> None:
    loop = asyncio.get_running_loop()
    for request in requests:
        task = loop.create_task(_serve_one(request, handle, cancellable))
        _IN_FLIGHT.add(task)  # the loop keeps only weak references to tasks
        task.add_done_callback(_IN_FLIGHT.discard)


async def _serve_one(request: Any, handle: Callable[[Any, Any], Awaitable[None]], cancellable: bool) -> None:
    sender = FinalResponseGuard(request.get_response_sender(), FINAL)
    try:
        if cancellable:
            cancelled = await run_until_cancelled(lambda: handle(request, sender), request.is_cancelled,
                                                  answered=lambda: sender.final_sent)
        else:
            await handle(request, sender)
            cancelled = False
        if cancelled and not sender.final_sent:
            sender.send(flags=FINAL)
    except Exception as exc:  # noqa: BLE001 - every failure becomes the request's error response
        # a downstream model's error was logged there; an unknown voice is an answer (the client resends the audio)
        if not isinstance(exc, (RemoteError, UnknownVoice)):
            logger.exception("request failed")
        if sender.final_sent:  # answered already: the failure came in the clean-up after it
            return
        try:
            sender.send(error_response(exc), flags=FINAL)
        except Exception:  # noqa: BLE001 - the request may already be complete (e.g. cancelled)
            logger.exception("could not send the error response")


def _outputs(resp: Any, names: Sequence[str]) -> dict[str, np.ndarray | None]:
    if resp.has_error():
        raise RemoteError(resp.error().message())
    out: dict[str, np.ndarray | None] = {}
    for name in names:
        tensor = pb_utils.get_output_tensor_by_name(resp, name)
        out[name] = None if tensor is None else tensor.as_numpy()
    return out


def _bls_request(model: str, inputs: Mapping[str, np.ndarray], outputs: Sequence[str], request_id: str) -> Any:
    return pb_utils.InferenceRequest(
        model_name=model, inputs=tensors(inputs), requested_output_names=list(outputs), request_id=request_id
    )


async def bls(
    model: str, inputs: Mapping[str, np.ndarray], outputs: Sequence[str], request_id: str = ""
) -> dict[str, np.ndarray | None]:
    """One call to a non-decoupled model."""
    resp = await within_stall_timeout(model, _bls_request(model, inputs, outputs, request_id).async_exec())
    return _outputs(resp, outputs)


async def within_stall_timeout(model: str, pending: Awaitable[Any]) -> Any:
    """`pending`'s result; a callee (a model over BLS, or an engine part in this process) silent for
    `BLS_STALL_TIMEOUT_S` fails the request with a clear error instead of hanging it."""
    try:
        return await asyncio.wait_for(pending, BLS_STALL_TIMEOUT_S)
    except asyncio.TimeoutError:
        logger.error("BLS call to %s: no response for %.0f s", model, BLS_STALL_TIMEOUT_S)
        raise RemoteError(f"internal model {model} sent no response for {BLS_STALL_TIMEOUT_S:.0f} s") from None


class _DeferredRelease:
    """Keeps finished BLS response iterators referenced from Python for a while before dropping them.

    The python stub of Triton <= 2.52 (python_backend before r25.01, #390) frees a finished decoupled BLS
    stream from its own C++ messaging thread, without the GIL: when that thread drops the last reference,
    the responses' numpy arrays are freed under a running interpreter and the stub dies ("malloc(): unaligned
    fastbin chunk", SIGSEGV) after a few dozen streams. That release happens right after the final response
    is read; holding our Python reference longer makes Python, with the GIL, always the last owner.
    """

    HOLD_S = 5.0

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: deque[tuple[float, Any]] = deque()

    def keep(self, obj: Any) -> None:
        now = time.monotonic()
        expired = []
        with self._lock:
            self._held.append((now + self.HOLD_S, obj))
            while self._held and self._held[0][0] <= now:
                expired.append(self._held.popleft())
        del expired  # dropped here, outside the lock

    def clear(self) -> None:
        with self._lock:
            self._held.clear()


_RETIRED = _DeferredRelease()
_END = object()


def release_bls_streams() -> None:
    """For a model's `finalize`: drop the held iterators while the stub can still release them cleanly."""
    _RETIRED.clear()


def _pump_stream(
    model: str, request: Any, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue, abandoned: threading.Event
) -> None:
    """Reads one decoupled BLS stream to its end in a thread of its own and hands each response to the loop.

    One reader per stream, reading to the final response even if the caller left: a second concurrent reader
    of a stub iterator is unsafe, and an iterator never read to its end is never released by the stub.
    """

    def pass_on(item: Any) -> None:
        if abandoned.is_set():
            return
        try:
            loop.call_soon_threadsafe(queue.put_nowait, item)
        except RuntimeError:  # the loop is closed: the model is shutting down
            abandoned.set()

    iterator = None
    try:
        iterator = request.exec(decoupled=True)
        for resp in iterator:
            pass_on(resp)
        pass_on(_END)
    except Exception as exc:  # noqa: BLE001 - the caller raises it
        pass_on(RemoteError(f"{model}: {exc}"))
    finally:
        if iterator is not None:
            _RETIRED.keep(iterator)


async def bls_stream(
    model: str, inputs: Mapping[str, np.ndarray], outputs: Sequence[str], request_id: str = ""
) -> AsyncIterator[dict[str, np.ndarray | None]]:
    """The responses of a decoupled model as they arrive (the flag-only final one is skipped)."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    abandoned = threading.Event()
    request = _bls_request(model, inputs, outputs, request_id)
    _BLS_THREADS.submit(_pump_stream, model, request, loop, queue, abandoned)
    try:
        while True:
            item = await within_stall_timeout(model, queue.get())
            if item is _END:
                return
            if isinstance(item, RemoteError):
                raise item
            arrays = _outputs(item, outputs)
            if any(value is not None for value in arrays.values()):
                yield arrays
    finally:
        # Early exit (error, cancellation, stall): the reader drains the rest on its own and drops it.
        abandoned.set()


async def bls_one(
    model: str, inputs: Mapping[str, np.ndarray], outputs: Sequence[str], decoupled: bool, request_id: str = ""
) -> dict[str, np.ndarray | None]:
    """The one response of a call that answers once, whether `model` is decoupled or not."""
    if not decoupled:
        return await bls(model, inputs, outputs, request_id)
    responses = [arrays async for arrays in bls_stream(model, inputs, outputs, request_id)]
    if len(responses) != 1:
        raise RemoteError(f"{model} sent {len(responses)} responses where one was expected")
    return responses[0]


class PipelineEntryModel:
    """A pipeline's entry model (`cosyvoice2`/`cosyvoice2_stream`, `spark_tts`/`spark_tts_stream`): each request is
    decoded by the contract's codec, run by the orchestrator, and every chunk is encoded by the codec. A subclass's
    `initialize` sets `orchestrator` and `streaming` (whether the model is decoupled)."""

    orchestrator: Any  # has `synthesize(SpeechRequest, streaming) -> AsyncIterator[SpeechChunk]`
    streaming: bool

    def execute(self, requests: list[Any]) -> None:
        serve(requests, self._handle, cancellable=True)

    async def _handle(self, request: Any, sender: Any) -> None:
        synthesis: SpeechRequest = parse_request(read_inputs(request, contract.INPUTS))
        chunk: SpeechChunk
        # closed here however the sends end, not whenever the garbage collector finds the generator: its clean-up
        # frees the request's LLM sequence and token2wav stream
        async with contextlib.aclosing(self.orchestrator.synthesize(synthesis, self.streaming)) as chunks:
            async for chunk in chunks:
                # FINAL rides on the last data response (the grpc.aio client cannot ask for an empty one)
                sender.send(response(contract.encode_response(chunk)), flags=FINAL if chunk.final else 0)

    def finalize(self) -> None:
        release_bls_streams()


def handler_model(params_class: type[ModelParams], build: Callable[[Any], Any]) -> type:
    """The Triton model class of a model whose every request one handler answers.

    `build(params)` makes the handler from the model's typed parameters. The handler has
    `handle(request, sender)` (run per request by `serve`), `close()` (at unload) and `stats`, one `Stats` or a
    tuple of them, exported as the model's metrics.
    """

    class HandlerModel:
        def initialize(self, args: dict[str, str]) -> None:
            params = params_class.from_parameters(model_params(args), args["model_name"])
            self.handler = self.build(params)
            stats = self.handler.stats
            self.metrics = model_ready(args["model_name"], *(stats if isinstance(stats, tuple) else (stats,)))

        def execute(self, requests: list[Any]) -> None:
            serve(requests, self.handler.handle, cancellable=False)

        def finalize(self) -> None:
            self.handler.close()

    HandlerModel.build = staticmethod(build)  # type: ignore[attr-defined]
    return HandlerModel


class MetricsExporter:
    """Mirrors `Stats` objects into Triton custom metrics ``cosyvoice2_<stat>{model="<name>"}``.

    Stats named ``*_total`` are counters, the rest gauges. Shown on tritonserver's metrics port. A model
    hosting several components (the colocated `engine`: LLM and token2wav) exports all their stats under
    its one model label; their names must not clash.
    Every metric call is an IPC round trip to tritonserver, so hot loops (decoder steps, token2wav
    calls) never make one: a single publisher thread pushes the changed values at most every 100 ms.
    """

    PERIOD_S = 0.1

    def __init__(self, model_name: str, *stats: Stats) -> None:
        self._stats = stats
        self._families: list[Any] = []  # keep the families alive: metrics die with them
        self._metrics: dict[str, Any] = {}
        for name in self._snapshot():
            kind = pb_utils.MetricFamily.COUNTER if name.endswith("_total") else pb_utils.MetricFamily.GAUGE
            family = pb_utils.MetricFamily(
                name=f"cosyvoice2_{name}", description=f"CosyVoice2 pipeline: {name}", kind=kind
            )
            self._families.append(family)
            self._metrics[name] = family.Metric(labels={"model": model_name})
        self._published: dict[str, float] = {}
        self._changed = threading.Event()
        for component in stats:
            component.add_listener(self._on_change)
        threading.Thread(target=self._publish_forever, name=f"metrics-{model_name}", daemon=True).start()

    def _on_change(self, name: str, value: float) -> None:
        # Called on every stats update, e.g. from the LLM worker between decoder steps: once the event is
        # set, a plain read instead of `Event.set`'s lock and notify.
        if not self._changed.is_set():
            self._changed.set()

    def _snapshot(self) -> dict[str, float]:
        merged: dict[str, float] = {}
        for component in self._stats:
            values = component.snapshot()
            clash = merged.keys() & values.keys()
            if clash:
                raise ValueError(f"stats exported twice under one model: {sorted(clash)}")
            merged.update(values)
        return merged

    def _publish_forever(self) -> None:
        while True:
            self._changed.wait()
            self._changed.clear()
            try:
                self._publish()
            except Exception:  # noqa: BLE001 - metrics must never take the model down
                logger.exception("publishing metrics failed")
            time.sleep(self.PERIOD_S)

    def _publish(self) -> None:
        for name, value in self._snapshot().items():
            last = self._published.get(name, 0.0)
            if value == last and name in self._published:
                continue
            if name.endswith("_total"):
                if value > last:
                    self._metrics[name].increment(value - last)
            else:
                self._metrics[name].set(value)
            self._published[name] = value
