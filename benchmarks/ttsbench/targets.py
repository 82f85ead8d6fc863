"""The two things tts-bench can load: Triton directly (gRPC) and the OpenAI gateway (HTTP).

A target sends one request and yields audio pieces as they arrive; it never reads a clock.
"""

from __future__ import annotations

import base64
import bisect
import io
import itertools
import json
import uuid
from collections.abc import AsyncIterator, Sequence

import httpx
import numpy as np
import tritonclient.grpc.aio as grpcclient
from tritonclient.utils import InferenceServerException

from gateway.replicas import BALANCES as GATEWAY_BALANCES, Replicas
import pipeline_contract as contract
from ttsbench.inputs import BenchRequest

PCM_BYTES_PER_SAMPLE = 2  # the gateway's pcm: s16le mono at OUTPUT_SAMPLE_RATE
#: The pipelines a Triton target can load: name -> (offline model, streaming model). Both speak the pipeline
#: contract; their audio rates differ (CosyVoice2 and CosyVoice3 24 kHz, Spark-TTS 16 kHz), which every response
#: states.
PIPELINES: dict[str, tuple[str, str]] = {
    "cosyvoice2": (contract.OFFLINE_MODEL, contract.STREAMING_MODEL),
    "spark-tts": (contract.SPARK_OFFLINE_MODEL, contract.SPARK_STREAMING_MODEL),
    "cosyvoice3": (contract.COSYVOICE3_OFFLINE_MODEL, contract.COSYVOICE3_STREAMING_MODEL),
}
DEFAULT_PIPELINE = "cosyvoice2"
#: How a Triton target that names several instances spreads the requests: the gRPC channel's round robin, or the
#: gateway's least-busy pick (`gateway.replicas`: each request to the instance with the fewest in flight).
BALANCES = GATEWAY_BALANCES


class TritonTarget:
    """The pipeline's Triton models over gRPC: unary infer (offline) or a decoupled stream.

    ``fresh_voice_ids`` gives every request its own voice id, so the server's prompt cache never
    hits (the "without speaker cache" numbers). Otherwise a voice's requests carry its audio until one has been
    served, then only its id, as the gateway sends them (docs/pipeline-contract.md, "Voices by id"); a pipeline
    that answers "unknown voice" gets the request again with the audio. ``pipeline`` picks the models
    (``PIPELINES``); audio durations use the rate the responses state, which must be one rate for the whole run.
    ``balance`` (``BALANCES``): how a target naming several instances spreads the requests; with "least-busy"
    the gateway's pick (`gateway.replicas.Replicas`: a channel per instance), and voices count as served per
    instance.
    """

    def __init__(self, url: str, streaming: bool, seed: int | None = None, fresh_voice_ids: bool = False,
                 pipeline: str = DEFAULT_PIPELINE, balance: str = "round-robin") -> None:
        self.streaming = streaming
        offline, stream = PIPELINES[pipeline]
        self.model = stream if streaming else offline
        # another pipeline's levels and report rows never read as CosyVoice2's: triton-spark-tts/streaming
        where = "triton" if pipeline == DEFAULT_PIPELINE else f"triton-{pipeline}"
        self.mode = f"{where}/{'streaming' if streaming else 'offline'}"
        self.sample_rate: int | None = None  # stated by the first response with audio
        # ``url`` may name several Triton instances (an ``ipv4:a,b`` list, a ``dns:///`` name): the gateway's
        # channel options spread the requests round robin over them, as the gateway's default; or its `Replicas` pick.
        if balance not in BALANCES:
            raise ValueError(f"balance must be one of {BALANCES}, got {balance!r}")
        self._url = url
        self._client: grpcclient.InferenceServerClient | None = None
        self._replicas: Replicas | None = None
        if balance == "least-busy":
            self._replicas = Replicas(url, _client)
        else:
            self._client = _client(url)
        self._seed = seed
        self._fresh_voice_ids = fresh_voice_ids
        self._ids = itertools.count()
        self._held: set[tuple[str, str]] = set()  # (address, voice) the pipeline there has served: sent by id

    def _inputs(self, request: BenchRequest, by_id: bool) -> list[grpcclient.InferInput]:
        voice = request.voice
        vid = f"{voice.id}-{uuid.uuid4().hex}" if self._fresh_voice_ids else voice.id
        speech = contract.SpeechRequest(voice.samples, voice.transcript, request.target_text, vid, self._seed)
        return contract.grpc_inputs(contract.id_only(speech) if by_id else speech)

    async def synthesize(self, request: BenchRequest) -> AsyncIterator[np.ndarray]:
        if self._replicas is None:
            async for piece in self._synthesize_at(self._client, self._url, request):
                yield piece
            return
        replica = await self._replicas.pick()
        try:
            async for piece in self._synthesize_at(replica.client, replica.address, request):
                yield piece
        finally:
            self._replicas.done(replica)

    async def _synthesize_at(self, client, address: str, request: BenchRequest) -> AsyncIterator[np.ndarray]:
        voice = (address, request.voice.id)
        by_id = not self._fresh_voice_ids and voice in self._held
        try:
            async for piece in self._synthesize(client, request, by_id):
                yield piece
        except InferenceServerException as exc:
            if not by_id or contract.ERROR_UNKNOWN_VOICE not in str(exc):
                raise
            self._held.discard(voice)  # refused before any audio: once more, with the audio
            async for piece in self._synthesize(client, request, False):
                yield piece
        self._held.add(voice)

    async def _synthesize(self, client, request: BenchRequest, by_id: bool) -> AsyncIterator[np.ndarray]:
        inputs = self._inputs(request, by_id)
        request_id = f"bench-{next(self._ids)}"
        if not self.streaming:
            result = await client.infer(self.model, inputs, request_id=request_id)
            yield self._audio(contract.decode_response(result.as_numpy, final=True))
            return

        async def one_request() -> AsyncIterator[dict]:
            # One request per stream, then half-close: the stream ends when the request is final.
            yield {"model_name": self.model, "inputs": inputs, "request_id": request_id}

        responses = client.stream_infer(one_request())
        error: Exception | None = None
        finished = False
        try:
            async for result, failure in responses:
                if failure is not None:
                    error = error or failure  # keep reading: the stream ends on its own
                    continue
                # a response without audio (the flag-only FINAL) is an empty piece, which the runner skips
                yield self._audio(contract.decode_response(result.as_numpy, final=False))
            finished = True
        finally:
            if not finished:  # abandoned (timeout): tell the server to stop working on it
                responses.cancel()
        if error is not None:
            raise error

    def _audio(self, chunk: contract.SpeechChunk) -> np.ndarray:
        if chunk.waveform.size:
            if self.sample_rate is None:
                self.sample_rate = chunk.sample_rate
            elif chunk.sample_rate != self.sample_rate:
                raise contract.ContractViolation(
                    f"{self.model} answered at {chunk.sample_rate} Hz after {self.sample_rate} Hz")
        return chunk.waveform

    def chunk_seconds(self, pieces: Sequence[np.ndarray]) -> list[float]:
        rate = self.sample_rate or contract.OUTPUT_SAMPLE_RATE  # no audio yet: nothing to time
        return [p.size / rate for p in pieces]

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.close()
        if self._replicas is not None:
            await self._replicas.close()


def _client(address: str) -> grpcclient.InferenceServerClient:
    return grpcclient.InferenceServerClient(address, channel_args=list(contract.GRPC_CHANNEL_ARGS))


class GatewayError(RuntimeError):
    """A non-2xx answer or an error event from the gateway."""


def encoded_chunk_seconds(pieces: Sequence[bytes], response_format: str) -> list[float]:
    """Audio duration each received piece of a response body in ``response_format`` made playable.

    pcm: the samples in each piece. Containers: the whole body is decoded once (PyAV) and each packet's
    decoded duration is credited to the piece that completes it; a packet is complete once the bytes up to
    the next packet's position have arrived (for Ogg, whose packets report their page's position, that is
    the end of the page). Frames the decoder releases only at the end go to the last piece. If the demuxer
    reports no positions, durations are spread over the pieces in proportion to their bytes.
    """
    if not pieces:
        return []
    if response_format == "pcm":
        return [len(p) / PCM_BYTES_PER_SAMPLE / contract.OUTPUT_SAMPLE_RATE for p in pieces]
    import av  # only compressed gateway formats need a demuxer; the Triton targets run without PyAV

    data = b"".join(pieces)
    packets: list[tuple[int, float]] = []  # (position, seconds) of every data packet
    trailing, positions_known = 0.0, True
    with av.open(io.BytesIO(data)) as container:
        for packet in container.demux(audio=0):
            seconds = sum(frame.samples / frame.sample_rate for frame in packet.decode())
            if not packet.size:  # the flush at the end of the stream
                trailing += seconds
            elif packet.pos is None or packet.pos < 0:
                positions_known = False
                packets.append((0, seconds))
            else:
                packets.append((packet.pos, seconds))
    out = [0.0] * len(pieces)
    ends = list(itertools.accumulate(len(p) for p in pieces))  # byte count after each piece
    if positions_known:
        starts = sorted({pos for pos, _ in packets})
        for pos, seconds in packets:
            following = bisect.bisect_right(starts, pos)
            complete_at = starts[following] if following < len(starts) else len(data)
            out[min(bisect.bisect_left(ends, complete_at), len(out) - 1)] += seconds
    else:
        total = sum(seconds for _, seconds in packets)
        out = [total * len(p) / len(data) for p in pieces]
    out[-1] += trailing
    return out


def encoded_seconds(data: bytes, response_format: str) -> float:
    """Duration of a complete response body in ``response_format``."""
    return sum(encoded_chunk_seconds([data], response_format))


class GatewayTarget:
    """``POST /v1/audio/speech`` with OpenAI requests; ``voice`` is the voice id (content hash),
    so the gateway must know every voice of the run (see ``missing_voices``)."""

    def __init__(
        self,
        base_url: str,
        streaming: bool,
        response_format: str = "pcm",
        stream_format: str = "audio",
        model: str = "tts-1",
        api_key: str | None = None,
        seed: int | None = None,
    ) -> None:
        self.streaming = streaming
        self.response_format = response_format
        self.stream_format = stream_format if streaming else "audio"
        self.model = model
        self.seed = seed
        self.mode = f"gateway/{f'streaming-{self.stream_format}' if streaming else 'offline'}"
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.AsyncClient(
            base_url=base_url.rstrip("/"),
            headers=headers,
            timeout=httpx.Timeout(None),  # the runner owns the deadline
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
        )

    async def missing_voices(self, requests: Sequence[BenchRequest]) -> list[str]:
        """Voice ids of ``requests`` that ``GET /v1/audio/voices`` does not list."""
        response = await self._http.get("/v1/audio/voices")
        if response.status_code != 200:
            raise GatewayError(f"GET /v1/audio/voices: HTTP {response.status_code} {response.text[:200]}")
        known = {v["id"] for v in response.json()["voices"]} | {v["name"] for v in response.json()["voices"]}
        return sorted({r.voice.id for r in requests} - known)

    def _body(self, request: BenchRequest) -> dict:
        body = {
            "model": self.model,
            "input": request.target_text,
            "voice": request.voice.id,
            "response_format": self.response_format,
            "stream_format": self.stream_format,
            "stream": self.streaming,
        }
        if self.seed is not None:
            body["seed"] = self.seed
        return body

    async def synthesize(self, request: BenchRequest) -> AsyncIterator[bytes]:
        async with self._http.stream("POST", "/v1/audio/speech", json=self._body(request)) as response:
            if response.status_code != 200:
                detail = (await response.aread()).decode(errors="replace")[:300]
                raise GatewayError(f"HTTP {response.status_code}: {detail}")
            if not self.streaming:  # one complete file: one piece, like Triton's offline response
                yield await response.aread()
            elif self.stream_format == "sse":  # exact chunk boundaries: one delta per pipeline chunk
                async for piece in _sse_audio(response):
                    yield piece
            else:  # chunked body: pieces are network reads, which need not match pipeline chunks
                async for piece in response.aiter_bytes():
                    yield piece

    def chunk_seconds(self, pieces: Sequence[bytes]) -> list[float]:
        return encoded_chunk_seconds(pieces, self.response_format)

    async def aclose(self) -> None:
        await self._http.aclose()


async def _sse_audio(response: httpx.Response) -> AsyncIterator[bytes]:
    """The audio of ``speech.audio.delta`` events until ``speech.audio.done``; other events fail."""
    async for line in response.aiter_lines():
        if not line.startswith("data:"):
            continue
        event = json.loads(line[len("data:") :])
        kind = event.get("type")
        if kind == "speech.audio.delta":
            yield base64.b64decode(event["audio"])
        elif kind == "speech.audio.done":
            return
        else:
            raise GatewayError(f"SSE event {kind}: {json.dumps(event)[:300]}")
    raise GatewayError("SSE stream ended without speech.audio.done")
