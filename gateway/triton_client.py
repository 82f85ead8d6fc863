"""The gateway's only door to Triton: gRPC (aio) calls of the pipeline contract.

Maps every failure to the gateway's errors: unreachable or not-ready Triton -> BackendUnavailable,
model errors tagged ``[invalid_input]`` -> InvalidRequest, ``[overloaded]`` -> BackendOverloaded,
deadlines -> SynthesisTimeout, anything else -> SynthesisFailed.

A voice goes to a pipeline with its reference audio once; later requests name it by id alone (`VoiceMemory`). A
pipeline that does not hold it (a restart, an eviction, a replica behind the same target that never saw it)
answers ``[unknown_voice]`` before any audio, and the request is sent once more with the audio.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import AsyncIterator
from collections.abc import Hashable
from contextlib import aclosing
from dataclasses import dataclass

import grpc
from tritonclient.grpc import InferenceServerException, InferRequestedOutput
from tritonclient.grpc import aio as grpcclient

from gateway.errors import (
    ApiError,
    BackendOverloaded,
    BackendUnavailable,
    InvalidRequest,
    SynthesisFailed,
    SynthesisTimeout,
)
from gateway.metrics import GatewayMetrics
from gateway.replicas import BALANCES, Replica, Replicas
import pipeline_contract as contract

logger = logging.getLogger(__name__)

# The channel options every client of the pipeline shares: capped reconnect back-off, round robin over a target
# naming several Triton instances.
_CHANNEL_ARGS = list(contract.GRPC_CHANNEL_ARGS)
_UNAVAILABLE_CODES = {"StatusCode.UNAVAILABLE", "StatusCode.CANCELLED", "StatusCode.NOT_FOUND"}


@dataclass(frozen=True, kw_only=True)
class SegmentRequest(contract.SpeechRequest):
    """One text segment to speak with one reference voice, under the request id Triton logs it with."""

    request_id: str


@dataclass(frozen=True)
class Pipeline:
    """The two Triton models of one speech model (same contract): CosyVoice2's, Spark-TTS's or CosyVoice3's. Voices
    sent with their audio are remembered per pipeline (`VoiceMemory`), as each pipeline keeps its own voice cache."""

    offline: str
    streaming: str


class VoiceNotHeld(SynthesisFailed):
    """The pipeline does not hold the voice an id-only request named (``[unknown_voice]``, sent before any audio):
    the request goes again with the audio. A client sees it only from a pipeline that refuses a request carrying the
    audio, which is a failure inside the pipeline."""


class VoiceMemory:
    """Which voices each pipeline of one Triton target was sent with their audio and accepted: their next requests
    name them by id alone. Keyed by the pipeline, or by (replica address, pipeline) where the gateway picks the
    replica itself (least-busy balancing), since each replica keeps its own voice cache.

    A voice the pipeline did not hold when named by id is forgotten: its resend carries the audio, and so does its
    next request before it is remembered again. Behind a round-robin target that next request reaches another
    replica than the resend did, so with two replicas both hold the voice after one miss (strict turn-taking
    would otherwise send every id-only request to the replica that lacks it and every resend to the other).

    Bounded: the `capacity` most recently used voices per pipeline (0: none, every request carries its audio); a
    forgotten voice only travels with its audio once more. Used from the event loop only.
    """

    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"voice memory capacity must be >= 0, got {capacity}")
        self.capacity = capacity
        self._known: dict[Hashable, OrderedDict[str, None]] = {}

    def knows(self, pipeline: Hashable, voice_id: str) -> bool:
        known = self._known.get(pipeline)
        if known is None or voice_id not in known:
            return False
        known.move_to_end(voice_id)
        return True

    def remember(self, pipeline: Hashable, voice_id: str) -> None:
        if not self.capacity:
            return
        known = self._known.setdefault(pipeline, OrderedDict())
        known[voice_id] = None
        known.move_to_end(voice_id)
        while len(known) > self.capacity:
            known.popitem(last=False)

    def forget(self, pipeline: Hashable, voice_id: str) -> None:
        self._known.get(pipeline, {}).pop(voice_id, None)


#: How a request's voice travelled, the label of the gateway's pipeline-request metrics.
BY_ID, WITH_AUDIO, RESENT_WITH_AUDIO = "by_id", "with_audio", "resent_with_audio"


def _requested_outputs() -> list[InferRequestedOutput]:
    return [InferRequestedOutput(spec.name) for spec in contract.OUTPUTS]


def _decode(result: object, final: bool) -> contract.SpeechChunk:
    """A response through the contract's codec; one that breaks the contract (audio without its rate) fails the
    synthesis, it is not the client's fault."""
    try:
        return contract.decode_response(result.as_numpy, final)  # type: ignore[attr-defined]
    except contract.ContractViolation as exc:
        raise SynthesisFailed(f"Synthesis failed: the pipeline's response breaks the contract: {exc}") from exc


def _is_final(result: object) -> bool:
    params = result.get_response().parameters  # type: ignore[attr-defined]
    return "triton_final_response" in params and params["triton_final_response"].bool_param


def map_error(message: str, status: str | None, *, retry_after: int) -> ApiError:
    """A Triton/gRPC failure as the gateway error the client should see."""
    if contract.ERROR_UNKNOWN_VOICE in message:
        return VoiceNotHeld(f"Synthesis failed: the pipeline does not hold the voice: {message}")
    if contract.ERROR_INVALID_INPUT in message:
        return InvalidRequest(message.split(contract.ERROR_INVALID_INPUT, 1)[1].strip() or message)
    if contract.ERROR_OVERLOADED in message:
        return BackendOverloaded("The speech backend is overloaded; retry later.", retry_after=retry_after)
    if status == "StatusCode.DEADLINE_EXCEEDED":
        return SynthesisTimeout("The speech backend did not finish in time.")
    if status in _UNAVAILABLE_CODES or "failed to connect" in message.lower() or "not ready" in message.lower():
        # gRPC's words name internal addresses ("ipv4:10.0.0.7:8001: Failed to connect"): the log gets them,
        # the client gets what it can act on.
        logger.warning("speech backend unavailable (%s): %s", status, message)
        return BackendUnavailable("The speech backend is unavailable; retry later.", retry_after=retry_after)
    return SynthesisFailed(f"Synthesis failed: {message}")


def _from_exception(exc: Exception, retry_after: int) -> ApiError:
    if isinstance(exc, InferenceServerException):
        return map_error(exc.message() or str(exc), exc.status(), retry_after=retry_after)
    if isinstance(exc, grpc.aio.AioRpcError):
        return map_error(exc.details() or "", str(exc.code()), retry_after=retry_after)
    return SynthesisFailed(f"Synthesis failed: {exc}")


class TritonClient:
    """gRPC client of the offline and streaming pipeline models. Create it inside the event loop.

    `url` is one target: one Triton, or several behind one name (a ``dns:///`` Service, an ``ipv4:a,b`` list)
    spread round-robin by the channel, or with `balance` "least-busy" each request to the replica with the fewest
    of the gateway's requests in flight (`Replicas`; a request that could not reach its replica goes once to another
    before any audio); `known_voices` voices per pipeline (per replica and pipeline when balancing) are remembered
    as sent to it (`VoiceMemory`).
    """

    def __init__(
        self,
        url: str,
        offline_model: str,
        streaming_model: str,
        *,
        timeout_s: float,
        retry_after_s: int,
        known_voices: int = 1024,
        metrics: GatewayMetrics | None = None,
        balance: str = "round-robin",
    ) -> None:
        if balance not in BALANCES:
            raise ValueError(f"balance must be one of {BALANCES}, got {balance!r}")
        self._replicas: Replicas | None = None
        self._client = None
        if balance == "least-busy":
            self._replicas = Replicas(url, lambda address: grpcclient.InferenceServerClient(
                address, channel_args=_CHANNEL_ARGS))
        else:
            self._client = grpcclient.InferenceServerClient(url, channel_args=_CHANNEL_ARGS)
        self.pipeline = Pipeline(offline_model, streaming_model)  # the default: CosyVoice2's
        self._timeout_s = timeout_s
        self._retry_after_s = retry_after_s
        self.voices = VoiceMemory(known_voices)
        self._metrics = metrics

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()
        if self._replicas is not None:
            await self._replicas.close()

    async def _clients(self) -> list:
        """The clients the readiness checks ask: the one target's, or every known replica's."""
        if self._replicas is None:
            return [self._client]
        try:
            await self._replicas.refresh()
        except BackendUnavailable:
            return []
        return self._replicas.clients()

    async def is_deployed(self, pipeline: Pipeline, timeout_s: float) -> bool:
        """Whether Triton (a replica, when balancing) has both models of `pipeline` loaded and ready (False when
        Triton is unreachable)."""
        for client in await self._clients():
            try:
                if all([await client.is_model_ready(model, client_timeout=timeout_s)
                        for model in (pipeline.offline, pipeline.streaming)]):  # fmt: skip
                    return True
            except (InferenceServerException, grpc.RpcError):
                continue
        return False

    async def check_ready(self, timeout_s: float) -> None:
        """Raise BackendUnavailable unless Triton (a replica, when balancing) and both models of the default
        pipeline are ready."""
        clients = await self._clients()
        if not clients:
            raise BackendUnavailable("The speech backend is unreachable.", retry_after=self._retry_after_s)
        failure: BackendUnavailable | None = None
        for client in clients:
            try:
                await self._check_ready(client, timeout_s)
                return
            except BackendUnavailable as exc:
                failure = exc
        assert failure is not None
        raise failure

    async def _check_ready(self, client, timeout_s: float) -> None:
        try:
            if not await client.is_server_ready(client_timeout=timeout_s):
                raise BackendUnavailable("Triton is not ready.", retry_after=self._retry_after_s)
            for model in (self.pipeline.offline, self.pipeline.streaming):
                if not await client.is_model_ready(model, client_timeout=timeout_s):
                    raise BackendUnavailable(f"Model '{model}' is not ready.", retry_after=self._retry_after_s)
        except (InferenceServerException, grpc.RpcError) as exc:
            logger.info("readiness: Triton unreachable: %s", exc)  # probes come often: not a warning each time
            raise BackendUnavailable("The speech backend is unreachable.", retry_after=self._retry_after_s) from exc

    # -- replicas (least-busy balancing) -------------------------------------------------------------------------
    async def _pick(self, avoid: Replica | None) -> Replica | None:
        return None if self._replicas is None else await self._replicas.pick(avoid)

    def _release(self, replica: Replica | None) -> None:
        if replica is not None and self._replicas is not None:
            self._replicas.done(replica)

    def _fails_over(self, replica: Replica | None, tried: Replica | None) -> bool:
        """Whether a request `replica` could not reach goes once more to another replica (and `replica` sits out)."""
        if replica is None or self._replicas is None or tried is not None or len(self._replicas.addresses) < 2:
            return False
        self._replicas.mark_down(replica)
        return True

    def _on(self, replica: Replica | None, pipeline: Pipeline) -> tuple[object, Hashable]:
        """The client of a request and the key its voices are remembered under."""
        if replica is None:
            return self._client, pipeline
        return replica.client, (replica.address, pipeline)

    def _first_try(self, request: SegmentRequest, pipeline: Hashable) -> tuple[SegmentRequest, str]:
        """`request` by voice id alone when `pipeline` (its voices' key) was sent its voice before, else as it is."""
        if request.carries_audio and self.voices.knows(pipeline, request.voice_id):
            return contract.id_only(request), BY_ID
        return request, WITH_AUDIO if request.carries_audio else BY_ID

    def _inputs(self, request: SegmentRequest, voice: str) -> list:
        arrays = contract.encode_request(request)
        if self._metrics is not None:
            self._metrics.pipeline_requests.labels(voice).inc()
            self._metrics.pipeline_request_bytes.labels(voice).inc(contract.payload_bytes(arrays))
        return contract.grpc_tensors(arrays)

    async def synthesize_offline(
        self, request: SegmentRequest, *, timeout_s: float | None = None, pipeline: Pipeline | None = None
    ) -> contract.SpeechChunk:
        """One unary request on the offline model (of `pipeline`, default CosyVoice2's): the whole waveform of one
        segment (with empty ``target_text``: only the voice prompt is computed and cached, per the contract)."""
        pipeline = pipeline or self.pipeline
        tried = None
        while True:
            replica = await self._pick(tried)
            try:
                return await self._offline_on(replica, request, pipeline, timeout_s)
            except BackendUnavailable:
                if not self._fails_over(replica, tried):
                    raise
                tried = replica
            finally:
                self._release(replica)

    async def _offline_on(
        self, replica: Replica | None, request: SegmentRequest, pipeline: Pipeline, timeout_s: float | None
    ) -> contract.SpeechChunk:
        client, key = self._on(replica, pipeline)
        sent, voice = self._first_try(request, key)
        try:
            chunk = await self._offline_once(client, sent, voice, pipeline, timeout_s)
        except VoiceNotHeld:
            if sent is request:
                raise
            self.voices.forget(key, request.voice_id)
            return await self._offline_once(client, request, RESENT_WITH_AUDIO, pipeline, timeout_s)
        self.voices.remember(key, request.voice_id)
        return chunk

    async def _offline_once(
        self, client, request: SegmentRequest, voice: str, pipeline: Pipeline, timeout_s: float | None
    ) -> contract.SpeechChunk:
        try:
            result = await client.infer(
                pipeline.offline,
                self._inputs(request, voice),
                outputs=_requested_outputs(),
                request_id=request.request_id,
                client_timeout=timeout_s or self._timeout_s,
            )
        except (InferenceServerException, grpc.RpcError) as exc:
            raise _from_exception(exc, self._retry_after_s) from exc
        return _decode(result, final=True)

    async def synthesize_stream(
        self, request: SegmentRequest, pipeline: Pipeline | None = None
    ) -> AsyncIterator[contract.SpeechChunk]:
        """The decoupled model's chunks for one segment, in order (sent by voice id alone when the pipeline was sent
        the voice before; again with the audio if it answers ``[unknown_voice]``, which comes before any chunk)."""
        pipeline = pipeline or self.pipeline
        tried = None
        while True:
            replica = await self._pick(tried)
            answered = False
            try:
                async with aclosing(self._stream_on(replica, request, pipeline)) as chunks:
                    async for chunk in chunks:
                        answered = True
                        yield chunk
                return
            except BackendUnavailable:
                if answered or not self._fails_over(replica, tried):
                    raise
                tried = replica
            finally:
                self._release(replica)

    async def _stream_on(
        self, replica: Replica | None, request: SegmentRequest, pipeline: Pipeline
    ) -> AsyncIterator[contract.SpeechChunk]:
        client, key = self._on(replica, pipeline)
        sent, voice = self._first_try(request, key)
        answered = False
        try:
            # aclosing: a consumer leaving mid-stream cancels the gRPC call now, not when the generator is collected
            async with aclosing(self._stream_once(client, sent, voice, pipeline)) as chunks:
                async for chunk in chunks:
                    answered = True
                    self.voices.remember(key, request.voice_id)
                    yield chunk
            return
        except VoiceNotHeld:
            if sent is request or answered:
                raise
            self.voices.forget(key, request.voice_id)
        async with aclosing(self._stream_once(client, request, RESENT_WITH_AUDIO, pipeline)) as chunks:
            async for chunk in chunks:
                yield chunk

    async def _stream_once(
        self, client, request: SegmentRequest, voice: str, pipeline: Pipeline
    ) -> AsyncIterator[contract.SpeechChunk]:
        """One streaming call.

        The request stream is half-closed right after the request, so the call ends by itself after
        the FINAL response and is read to that end. If the consumer stops early (cancelled task,
        closed generator) the gRPC call is cancelled, which Triton reports to the model as
        ``request.is_cancelled()``.
        """

        async def one_request() -> AsyncIterator[dict[str, object]]:
            yield {
                "model_name": pipeline.streaming,
                "inputs": self._inputs(request, voice),
                "outputs": _requested_outputs(),
                "request_id": request.request_id,
            }

        call = client.stream_infer(one_request(), stream_timeout=self._timeout_s)
        ended = False
        try:
            final_seen = False
            async for result, error in call:
                if error is not None:
                    raise _from_exception(error, self._retry_after_s)
                final_seen = _is_final(result)
                yield _decode(result, final_seen)
            ended = True
            if not final_seen:
                raise SynthesisFailed("The speech stream ended without its final response.")
        except (InferenceServerException, grpc.RpcError) as exc:
            ended = True
            raise _from_exception(exc, self._retry_after_s) from exc
        finally:
            if not ended:
                call.cancel()
