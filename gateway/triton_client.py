"""The gateway's only door to Triton: gRPC (aio) calls of the pipeline contract.

Maps every failure to the gateway's errors: unreachable or not-ready Triton -> BackendUnavailable,
model errors tagged ``[invalid_input]`` -> InvalidRequest, ``[overloaded]`` -> BackendOverloaded,
deadlines -> SynthesisTimeout, anything else -> SynthesisFailed.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
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
import pipeline_contract as contract

logger = logging.getLogger(__name__)

_MAX_MESSAGE_BYTES = 2**31 - 1
# A restarted Triton must be found again quickly: cap gRPC's reconnect back-off (default 120 s).
_CHANNEL_ARGS = [
    ("grpc.max_send_message_length", _MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", _MAX_MESSAGE_BYTES),
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    # With a dns:/// target naming several Triton instances (a Kubernetes headless Service), spread the
    # requests over all of them; with one address this changes nothing.
    ("grpc.lb_policy_name", "round_robin"),
]
_UNAVAILABLE_CODES = {"StatusCode.UNAVAILABLE", "StatusCode.CANCELLED", "StatusCode.NOT_FOUND"}


@dataclass(frozen=True, kw_only=True)
class SegmentRequest(contract.SpeechRequest):
    """One text segment to speak with one reference voice, under the request id Triton logs it with."""

    request_id: str


@dataclass(frozen=True)
class Pipeline:
    """The two Triton models of one speech model (same contract): CosyVoice2's or Spark-TTS's."""

    offline: str
    streaming: str


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
    """gRPC client of the offline and streaming pipeline models. Create it inside the event loop."""

    def __init__(
        self, url: str, offline_model: str, streaming_model: str, *, timeout_s: float, retry_after_s: int
    ) -> None:
        self._client = grpcclient.InferenceServerClient(url, channel_args=_CHANNEL_ARGS)
        self.pipeline = Pipeline(offline_model, streaming_model)  # the default: CosyVoice2's
        self._timeout_s = timeout_s
        self._retry_after_s = retry_after_s

    async def close(self) -> None:
        await self._client.close()

    async def is_deployed(self, pipeline: Pipeline, timeout_s: float) -> bool:
        """Whether Triton has both models of `pipeline` loaded and ready (False when Triton is unreachable)."""
        try:
            for model in (pipeline.offline, pipeline.streaming):
                if not await self._client.is_model_ready(model, client_timeout=timeout_s):
                    return False
        except (InferenceServerException, grpc.RpcError):
            return False
        return True

    async def check_ready(self, timeout_s: float) -> None:
        """Raise BackendUnavailable unless Triton and both models of the default pipeline are ready."""
        try:
            if not await self._client.is_server_ready(client_timeout=timeout_s):
                raise BackendUnavailable("Triton is not ready.", retry_after=self._retry_after_s)
            for model in (self.pipeline.offline, self.pipeline.streaming):
                if not await self._client.is_model_ready(model, client_timeout=timeout_s):
                    raise BackendUnavailable(f"Model '{model}' is not ready.", retry_after=self._retry_after_s)
        except (InferenceServerException, grpc.RpcError) as exc:
            logger.info("readiness: Triton unreachable: %s", exc)  # probes come often: not a warning each time
            raise BackendUnavailable("The speech backend is unreachable.", retry_after=self._retry_after_s) from exc

    async def synthesize_offline(
        self, request: SegmentRequest, *, timeout_s: float | None = None, pipeline: Pipeline | None = None
    ) -> contract.SpeechChunk:
        """One unary request on the offline model (of `pipeline`, default CosyVoice2's): the whole waveform of one
        segment (with empty ``target_text``: only the voice prompt is computed and cached, per the contract)."""
        try:
            result = await self._client.infer(
                (pipeline or self.pipeline).offline,
                contract.grpc_inputs(request),
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
        """The decoupled model's chunks for one segment, in order.

        The request stream is half-closed right after the request, so the call ends by itself after
        the FINAL response and is read to that end. If the consumer stops early (cancelled task,
        closed generator) the gRPC call is cancelled, which Triton reports to the model as
        ``request.is_cancelled()``.
        """

        async def one_request() -> AsyncIterator[dict[str, object]]:
            yield {
                "model_name": (pipeline or self.pipeline).streaming,
                "inputs": contract.grpc_inputs(request),
                "outputs": _requested_outputs(),
                "request_id": request.request_id,
            }

        call = self._client.stream_infer(one_request(), stream_timeout=self._timeout_s)
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
