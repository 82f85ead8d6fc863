"""The pipeline contract: the one Triton interface the gateway calls.

Two models with the same inputs and outputs are deployed side by side:

* ``OFFLINE_MODEL`` (non-decoupled): one request -> exactly one response holding the whole waveform
  of one text segment.
* ``STREAMING_MODEL`` (decoupled): one request -> N >= 1 responses, each holding the next waveform
  chunk; the last response carries the TRITONSERVER_RESPONSE_COMPLETE_FINAL flag *together with* its
  data (the grpc.aio client cannot ask for an empty final response).

A request whose ``target_text`` is empty only computes and caches the voice prompt for ``voice_id``
(voice registration warms the cache this way): its single response has an empty waveform and zero
tokens. The gateway never sends empty text for speech (it rejects empty input with 400).

A request may name its voice by ``voice_id`` alone, without ``reference_wav``/``reference_wav_len`` (an *id-only*
request): the pipeline takes the voice from its voice cache, or, when it does not hold it, answers with an error
tagged ``ERROR_UNKNOWN_VOICE`` before any audio, and the client sends the request again with the audio.

Both take ``max_batch_size: 0`` shapes (no batch dimension): batching happens inside the pipeline.
The gateway sends one request per text segment, in order. This module is import-light (numpy only)
because the torch-free gateway, the Triton model adapters and the stand-in test model all use it.
See docs/pipeline-contract.md for the prose version.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Mapping, Sequence, TypeVar

import numpy as np

OFFLINE_MODEL = "cosyvoice2"
STREAMING_MODEL = "cosyvoice2_stream"
#: The Spark-TTS pipeline, rendered beside CosyVoice2 when a Spark model directory is given: the same inputs and
#: outputs, 16 kHz audio (the `sample_rate` output says so).
SPARK_OFFLINE_MODEL = "spark_tts"
SPARK_STREAMING_MODEL = "spark_tts_stream"
#: The CosyVoice3 pipeline, rendered beside CosyVoice2 when a CosyVoice3 model directory is given: the same inputs
#: and outputs, 24 kHz audio.
COSYVOICE3_OFFLINE_MODEL = "cosyvoice3"
COSYVOICE3_STREAMING_MODEL = "cosyvoice3_stream"

#: The most target-text tokens (Qwen2 tokenizer) one segment may have; longer ones are refused as
#: ``[invalid_input]``. The gateway cuts its segments below it (a deployment may render a different limit).
MAX_SEGMENT_TOKENS = 300

#: gRPC channel options of every client of the pipeline models (the gateway, tts-bench). A restarted Triton must
#: be found again quickly: gRPC's reconnect back-off (default 120 s) is capped. With a target naming several Triton
#: instances (a ``dns:///`` Kubernetes headless Service, an ``ipv4:a,b`` list: `grpc_target`) the requests are
#: spread round robin over all of them; with one address the policy changes nothing.
_MAX_MESSAGE_BYTES = 2**31 - 1
GRPC_CHANNEL_ARGS: tuple[tuple[str, int | str], ...] = (
    ("grpc.max_send_message_length", _MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", _MAX_MESSAGE_BYTES),
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.lb_policy_name", "round_robin"),
)


def grpc_target(addresses: Sequence[str]) -> str:
    """One gRPC target for Triton instances at ``addresses`` ("host:port", IPv4): the address itself for one, an
    ``ipv4:a,b,...`` list for several (balanced round robin by `GRPC_CHANNEL_ARGS`)."""
    if not addresses:
        raise ValueError("no Triton address")
    return addresses[0] if len(addresses) == 1 else "ipv4:" + ",".join(addresses)


def target_addresses(target: str) -> list[str]:
    """The Triton instances a gRPC target names itself: the addresses of an ``ipv4:a,b,...`` list, or the one
    ``host:port``; none for a target gRPC resolves (``dns:///name:port`` and other schemes)."""
    if target.startswith("ipv4:"):
        return [a.strip() for a in target[len("ipv4:"):].split(",") if a.strip()]
    return [] if ":/" in target or target.startswith(("dns:", "unix:", "ipv6:")) else [target]


#: Reference audio must be 16 kHz mono. CosyVoice2 returns 24 kHz mono, the rate the gateway serves (every
#: response also states its rate in `sample_rate`; the gateway resamples other rates to this one).
REFERENCE_SAMPLE_RATE = 16_000
OUTPUT_SAMPLE_RATE = 24_000


@dataclass(frozen=True)
class TensorSpec:
    name: str
    triton_dtype: str  # the config.pbtxt/tritonclient name, e.g. "FP32", "BYTES"
    dims: tuple[int, ...]
    optional: bool = False
    #: Shape the model sees when it differs from `dims` (e.g. () for a scalar behind a batch dimension).
    reshape: tuple[int, ...] | None = None
    #: Let the dynamic batcher group requests whose variable dims differ (python models get a list anyway).
    allow_ragged_batch: bool = False

    @property
    def numpy_dtype(self) -> type:
        return _NUMPY_DTYPES[self.triton_dtype]

    @property
    def pbtxt_dtype(self) -> str:
        return "TYPE_STRING" if self.triton_dtype == "BYTES" else f"TYPE_{self.triton_dtype}"


_NUMPY_DTYPES: dict[str, type] = {
    "FP32": np.float32,
    "INT32": np.int32,
    "INT64": np.int64,
    "UINT64": np.uint64,
    "BOOL": np.bool_,
    "FP16": np.float16,
    "BYTES": np.object_,
}

# Inputs ---------------------------------------------------------------------------------------
#: The reference voice, 16 kHz mono float in [-1, 1], and its valid samples: both or neither (an id-only request).
REFERENCE_WAV = TensorSpec("reference_wav", "FP32", (-1,), optional=True)
REFERENCE_WAV_LEN = TensorSpec("reference_wav_len", "INT32", (1,), optional=True)
#: UTF-8 transcript of the reference; empty = none (the pipeline then uses CosyVoice2's cross-lingual mode).
REFERENCE_TEXT = TensorSpec("reference_text", "BYTES", (1,))
TARGET_TEXT = TensorSpec("target_text", "BYTES", (1,))  # UTF-8 text of ONE segment to speak
#: Keys the server-side voice-prompt cache: a content hash of (audio, transcript), computed by the
#: gateway once per voice. Never a bare name: two voices with one transcript must not collide, and a voice
#: replaced under its name (new audio or transcript) gets a new id, so a cache never serves the old one.
VOICE_ID = TensorSpec("voice_id", "BYTES", (1,))
SEED = TensorSpec("seed", "UINT64", (1,), optional=True)  # sampling seed; absent = random per request
#: UTF-8 style instruction ("Speak slowly and sadly"); absent or empty = none. Given, the pipeline uses its
#: instruct mode with the voice's timbre (the transcript is then unused; CosyVoice2 and CosyVoice3 alike); a
#: pipeline without one (Spark-TTS) refuses the request as invalid input.
INSTRUCTION_TEXT = TensorSpec("instruction_text", "BYTES", (1,), optional=True)

INPUTS: tuple[TensorSpec, ...] = (
    REFERENCE_WAV, REFERENCE_WAV_LEN, REFERENCE_TEXT, TARGET_TEXT, VOICE_ID, SEED, INSTRUCTION_TEXT,
)  # fmt: skip

# Outputs --------------------------------------------------------------------------------------
WAVEFORM = TensorSpec("waveform", "FP32", (-1,))  # mono float32 samples at `sample_rate` (may be empty)
#: Usage, cumulative for the request so far; the final response holds the totals.
INPUT_TOKENS = TensorSpec("input_tokens", "INT32", (1,))  # text tokens the LLM read (prompt text + target)
OUTPUT_TOKENS = TensorSpec("output_tokens", "INT32", (1,))  # speech tokens the LLM generated

#: The rate of `waveform` in Hz, in every response: 24000 (CosyVoice2, CosyVoice3), 16000 (Spark-TTS).
SAMPLE_RATE = TensorSpec("sample_rate", "INT32", (1,))

OUTPUTS: tuple[TensorSpec, ...] = (WAVEFORM, INPUT_TOKENS, OUTPUT_TOKENS, SAMPLE_RATE)

#: Error messages raised by pipeline models start with one of these tags so the gateway can map
#: them to HTTP statuses without parsing free text (Triton's gRPC status codes are coarse).
ERROR_INVALID_INPUT = "[invalid_input]"  # -> 400
ERROR_OVERLOADED = "[overloaded]"  # -> 503 with Retry-After
#: An id-only request named a voice the pipeline does not hold (never seen, evicted, or another replica's): sent
#: before any audio; the client sends the request again with the reference audio.
ERROR_UNKNOWN_VOICE = "[unknown_voice]"


def pbtxt_io_block(kind: str, specs: tuple[TensorSpec, ...]) -> str:
    """Render an ``input [...]`` or ``output [...]`` block of a config.pbtxt from specs."""
    items = []
    for spec in specs:
        dims = ", ".join(str(d) for d in spec.dims)
        optional = " optional: true" if spec.optional and kind == "input" else ""
        reshape = ""
        if spec.reshape is not None:
            reshape = f" reshape: {{ shape: [ {', '.join(str(d) for d in spec.reshape)} ] }}"
        ragged = " allow_ragged_batch: true" if spec.allow_ragged_batch and kind == "input" else ""
        items.append(
            f'  {{ name: "{spec.name}" data_type: {spec.pbtxt_dtype} dims: [ {dims} ]{reshape}{optional}{ragged} }}'
        )
    return f"{kind} [\n" + ",\n".join(items) + "\n]"


# The one codec ------------------------------------------------------------------------------------
# Every party speaks the contract through these functions (the gateway's Triton client, tts-bench, the
# pipeline's entry models, the test stand-in), so a tensor's name, dtype or a rule such as warm-up cannot
# drift between them.

#: The shortest and longest reference the pipeline accepts (0.1 s; 30 s is the speech tokenizer's and CAM++'s limit).
MIN_REFERENCE_SAMPLES = REFERENCE_SAMPLE_RATE // 10
MAX_REFERENCE_SAMPLES = 30 * REFERENCE_SAMPLE_RATE


class ContractViolation(ValueError):
    """Tensors that break the contract: a request's (the pipeline answers it as ``ERROR_INVALID_INPUT``) or a
    response's (the client's call fails)."""


@dataclass(frozen=True)
class SpeechRequest:
    """One pipeline request: one text segment spoken with one reference voice."""

    #: float32, 16 kHz mono; decoded: exactly the reference_wav_len valid samples. Empty: an id-only request (the
    #: voice is named by `voice_id` alone and taken from the pipeline's voice cache).
    reference_wav: np.ndarray
    reference_text: str  # "" = the voice has no transcript (cross-lingual mode)
    target_text: str  # "" = the warm-up rule: only compute and cache the voice prompt
    voice_id: str
    seed: int | None = None  # None = random per request
    instruction: str = ""  # "" = none; else the instruct mode (the transcript is then unused)

    @property
    def carries_audio(self) -> bool:
        """False for an id-only request."""
        return self.reference_wav.size > 0


_Request = TypeVar("_Request", bound=SpeechRequest)


def id_only(request: _Request) -> _Request:
    """``request`` naming its voice by ``voice_id`` alone: the reference audio stays home (the transcript still
    travels: it is small and decides the voice mode)."""
    return replace(request, reference_wav=np.zeros(0, dtype=np.float32))


@dataclass(frozen=True)
class SpeechChunk:
    """One response: the next waveform piece, its rate and the usage so far."""

    waveform: np.ndarray  # float32 mono at `sample_rate`; may be empty
    input_tokens: int  # cumulative for the request
    output_tokens: int  # cumulative for the request
    final: bool  # the last response of the request (for the streaming model: sent with the FINAL flag)
    sample_rate: int = OUTPUT_SAMPLE_RATE  # Hz of `waveform`: CosyVoice2's 24 kHz unless the pipeline says otherwise


def _text(value: str) -> np.ndarray:
    return np.array([value.encode("utf-8")], dtype=np.object_)


def encode_request(request: SpeechRequest) -> dict[str, np.ndarray]:
    """The input tensors of ``request`` by name, in ``INPUTS`` order; optional inputs only when set (an id-only
    request has no reference tensors)."""
    arrays: dict[str, np.ndarray] = {}
    if request.carries_audio:
        wav = np.ascontiguousarray(request.reference_wav, dtype=np.float32).reshape(-1)
        arrays[REFERENCE_WAV.name] = wav
        arrays[REFERENCE_WAV_LEN.name] = np.array([wav.size], dtype=np.int32)
    arrays.update({
        REFERENCE_TEXT.name: _text(request.reference_text),
        TARGET_TEXT.name: _text(request.target_text),
        VOICE_ID.name: _text(request.voice_id),
    })  # fmt: skip
    if request.seed is not None:
        arrays[SEED.name] = np.array([request.seed], dtype=np.uint64)
    if request.instruction:
        arrays[INSTRUCTION_TEXT.name] = _text(request.instruction)
    return arrays


def payload_bytes(arrays: Mapping[str, np.ndarray]) -> int:
    """The tensor data that ``arrays`` put on the wire: numeric tensors' bytes, BYTES elements as Triton serializes
    them (a 4-byte length, then the bytes). What a request costs to carry, without the protocol's framing."""
    total = 0
    for value in arrays.values():
        if value.dtype == np.object_:
            total += sum(4 + len(item if isinstance(item, bytes) else str(item).encode()) for item in value.flat)
        else:
            total += value.nbytes
    return total


def grpc_inputs(request: SpeechRequest) -> list:
    """``encode_request`` as ``tritonclient.grpc.InferInput`` objects (what the gRPC clients send)."""
    return grpc_tensors(encode_request(request))


def grpc_tensors(arrays: Mapping[str, np.ndarray]) -> list:
    """Encoded request tensors (``encode_request``) as ``tritonclient.grpc.InferInput`` objects."""
    from tritonclient.grpc import InferInput  # noqa: PLC0415 - clients only; the Triton models never need it

    inputs = []
    for name, value in arrays.items():
        tensor = InferInput(name, list(value.shape), _INPUTS_BY_NAME[name].triton_dtype)
        tensor.set_data_from_numpy(value)
        inputs.append(tensor)
    return inputs


_INPUTS_BY_NAME = {spec.name: spec for spec in INPUTS}


def _scalar_text(arrays: Mapping[str, np.ndarray | None], spec: TensorSpec) -> str:
    value = arrays.get(spec.name)
    if value is None or value.size != 1:
        raise ContractViolation(f"input '{spec.name}' must hold exactly one string")
    item = value.reshape(-1)[0]
    try:
        return item.decode("utf-8") if isinstance(item, bytes) else str(item)
    except UnicodeDecodeError as exc:
        raise ContractViolation(f"input '{spec.name}' is not valid UTF-8") from exc


def _reference(wav: np.ndarray | None, wav_len: np.ndarray | None) -> np.ndarray:
    """The valid samples of a request's reference audio, checked."""
    if wav is None or wav_len is None or wav_len.size != 1:
        raise ContractViolation(
            "reference_wav and a one-element reference_wav_len come together (or neither: an id-only request)"
        )
    wav = np.asarray(wav, dtype=np.float32).reshape(-1)
    n = int(wav_len.reshape(-1)[0])
    if not MIN_REFERENCE_SAMPLES <= n <= min(wav.size, MAX_REFERENCE_SAMPLES):
        raise ContractViolation(
            f"reference_wav_len must be between {MIN_REFERENCE_SAMPLES} and {MAX_REFERENCE_SAMPLES} samples "
            f"(16 kHz) and <= the {wav.size} samples sent; got {n}"
        )
    wav = wav[:n]
    if not np.isfinite(wav).all():
        raise ContractViolation("reference_wav holds NaN or infinite samples")
    return wav


def decode_request(arrays: Mapping[str, np.ndarray | None]) -> SpeechRequest:
    """The inverse of ``encode_request`` with the contract's input rules (numpy arrays by tensor name; absent
    optional inputs as None; neither reference tensor: an id-only request, decoded with an empty
    ``reference_wav``). Raises ``ContractViolation`` saying what is wrong."""
    wav, wav_len = arrays.get(REFERENCE_WAV.name), arrays.get(REFERENCE_WAV_LEN.name)
    if wav is None and wav_len is None:
        wav = np.zeros(0, dtype=np.float32)  # id-only: the pipeline looks the voice up by voice_id
    else:
        wav = _reference(wav, wav_len)
    target_text = _scalar_text(arrays, TARGET_TEXT)
    if not target_text.strip():
        target_text = ""  # the warm-up rule: whitespace only counts as empty
    voice_id = _scalar_text(arrays, VOICE_ID)
    if not voice_id:
        raise ContractViolation("voice_id is empty")
    seed = arrays.get(SEED.name)
    instruction = arrays.get(INSTRUCTION_TEXT.name)
    return SpeechRequest(
        reference_wav=wav,
        reference_text=_scalar_text(arrays, REFERENCE_TEXT),
        target_text=target_text,
        voice_id=voice_id,
        seed=None if seed is None or seed.size == 0 else int(seed.reshape(-1)[0]),
        instruction="" if instruction is None else _scalar_text(arrays, INSTRUCTION_TEXT),
    )


def encode_response(chunk: SpeechChunk) -> dict[str, np.ndarray]:
    """The output tensors of one response by name (``chunk.final`` travels as the response's flag)."""
    return {
        WAVEFORM.name: np.asarray(chunk.waveform, dtype=np.float32).reshape(-1),
        INPUT_TOKENS.name: np.array([chunk.input_tokens], dtype=np.int32),
        OUTPUT_TOKENS.name: np.array([chunk.output_tokens], dtype=np.int32),
        SAMPLE_RATE.name: np.array([chunk.sample_rate], dtype=np.int32),
    }


def decode_response(as_numpy: Callable[[str], np.ndarray | None], final: bool) -> SpeechChunk:
    """One response from its output tensors (``as_numpy(name)``, None for an absent one, as tritonclient's
    results give them); a flag-only response (no tensors) is an empty chunk with zero usage. Audio without a
    positive ``sample_rate`` is a ``ContractViolation``: its rate would be a guess."""

    def first_int(spec: TensorSpec) -> int:
        value = as_numpy(spec.name)
        return int(value.reshape(-1)[0]) if value is not None and value.size else 0

    waveform = as_numpy(WAVEFORM.name)
    samples = np.zeros(0, np.float32) if waveform is None else waveform.reshape(-1).astype(np.float32, copy=False)
    sample_rate = first_int(SAMPLE_RATE)
    if sample_rate <= 0:
        if samples.size:
            raise ContractViolation(f"a response holds {samples.size} samples but no positive sample_rate")
        sample_rate = OUTPUT_SAMPLE_RATE  # nothing to play: any rate will do
    return SpeechChunk(
        waveform=samples,
        input_tokens=first_int(INPUT_TOKENS),
        output_tokens=first_int(OUTPUT_TOKENS),
        final=final,
        sample_rate=sample_rate,
    )
