"""Tensors of the repository's internal models, and the numpy conversions on both sides of each call.

`pipeline_contract` is the gateway-facing interface; this module is the orchestrator <-> internal-model one.
The config templates render their io blocks from these specs, and the Triton adapters convert with
the functions below, so a tensor name or shape exists in exactly one place. numpy only (no Triton).

The LLM tensors are the TensorRT-LLM backend's (`tensorrtllm_backend` inflight_batcher_llm
`tensorrt_llm/config.pbtxt`): the PyTorch LLM model declares the same subset, so the orchestrator
cannot tell the backends apart.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Iterable, Mapping

import numpy as np

from cosyvoice2.llm import sampling_defaults
from cosyvoice2.streaming import Chunk
from cosyvoice2.vocab import SpeechVocabLayout
from speech_serving.errors import InvalidInput
from speech_serving.io_struct import LLMRequest, PromptTensors
from pipeline_contract import REFERENCE_WAV, REFERENCE_WAV_LEN, VOICE_ID, SpeechRequest, TensorSpec
from triton_repo.trtllm_backend_facts import PINNED

Arrays = Mapping[str, "np.ndarray | None"]

# -- CosyVoice3's internal models (`render --cosyvoice3-dir`): the same tensors as CosyVoice2's counterparts -----
COSYVOICE3_VOICE_PROMPT_MODEL = "cosyvoice3_voice_prompt"
COSYVOICE3_AUDIO_TOKENIZER_MODEL = "cosyvoice3_audio_tokenizer"  # speech_tokenizer_v3.onnx
COSYVOICE3_SPEAKER_EMBEDDING_MODEL = "cosyvoice3_speaker_embedding"  # CosyVoice3's campplus.onnx
COSYVOICE3_ENGINE_MODEL = "cosyvoice3_engine"  # LLM + token2wav in one process (CosyVoice2's: adapters.engine)
#: with `--cosyvoice3-engine-dir`: the LLM on the tensorrtllm backend, CosyVoice2's `llm` tensors (the engine
#: then runs token2wav only)
COSYVOICE3_LLM_MODEL = "cosyvoice3_llm"

# -- audio_tokenizer / speaker_embedding (dynamic batching: dims exclude the batch dimension) ------
AUDIO_INPUTS = (replace(REFERENCE_WAV, optional=False, allow_ragged_batch=True), replace(REFERENCE_WAV_LEN, optional=False))
SPEECH_TOKENS = TensorSpec("speech_tokens", "INT32", (-1,))  # raw 25 Hz tokens, not yet 1:2-aligned
XVECTOR = TensorSpec("xvector", "FP32", (-1,))  # CAM++ 192-d

# -- voice_prompt ----------------------------------------------------------------------------------
#: The voice id with the reference audio (compute the prompt unless cached), or alone (only look it up).
VOICE_PROMPT_INPUTS = (REFERENCE_WAV, REFERENCE_WAV_LEN, VOICE_ID)
PROMPT_SPEECH_TOKENS = TensorSpec("prompt_speech_tokens", "INT32", (-1,))
PROMPT_MEL = TensorSpec("prompt_mel", "FP32", (-1, 80))
PROMPT_XVECTOR = TensorSpec("prompt_xvector", "FP32", (-1,))
VOICE_PROMPT_OUTPUTS = (PROMPT_SPEECH_TOKENS, PROMPT_MEL, PROMPT_XVECTOR)

# -- llm (max_batch_size > 0: every tensor has a leading batch dimension of 1) ---------------------
_SCALAR = ()
INPUT_IDS = TensorSpec("input_ids", "INT32", (-1,))
INPUT_LENGTHS = TensorSpec("input_lengths", "INT32", (1,), reshape=_SCALAR)
REQUEST_OUTPUT_LEN = TensorSpec("request_output_len", "INT32", (1,))
END_ID = TensorSpec("end_id", "INT32", (1,), optional=True, reshape=_SCALAR)
PAD_ID = TensorSpec("pad_id", "INT32", (1,), optional=True, reshape=_SCALAR)
STOP_WORDS_LIST = TensorSpec("stop_words_list", "INT32", (2, -1), optional=True)
EMBEDDING_BIAS = TensorSpec("embedding_bias", "FP32", (-1,), optional=True)
RUNTIME_TOP_K = TensorSpec("runtime_top_k", "INT32", (1,), optional=True, reshape=_SCALAR)
RUNTIME_TOP_P = TensorSpec("runtime_top_p", "FP32", (1,), optional=True, reshape=_SCALAR)
TEMPERATURE = TensorSpec("temperature", "FP32", (1,), optional=True, reshape=_SCALAR)
# Named as the pinned TensorRT-LLM backend reads them (later backends renamed both: trtllm_backend_facts).
MIN_LENGTH = TensorSpec(PINNED.roles["min_tokens"], "INT32", (1,), optional=True, reshape=_SCALAR)
RANDOM_SEED = TensorSpec(PINNED.roles["seed"], "UINT64", (1,), optional=True, reshape=_SCALAR)
#: TensorRT-LLM only (the PyTorch LLM runs RAS instead and ignores it): divides the logits of ids already in the
#: sequence, the backend's nearest equivalent of RAS (docs/deploy.md).
REPETITION_PENALTY = TensorSpec("repetition_penalty", "FP32", (1,), optional=True, reshape=_SCALAR)
STREAMING = TensorSpec("streaming", "BOOL", (1,), optional=True)
STOP = TensorSpec("stop", "BOOL", (1,), optional=True)  # cancels the sequence with this request id
LLM_INPUTS = (
    INPUT_IDS, INPUT_LENGTHS, REQUEST_OUTPUT_LEN, END_ID, PAD_ID, STOP_WORDS_LIST, EMBEDDING_BIAS,
    RUNTIME_TOP_K, RUNTIME_TOP_P, TEMPERATURE, MIN_LENGTH, RANDOM_SEED, REPETITION_PENALTY, STREAMING, STOP,
)  # fmt: skip
#: PyTorch LLM only (TensorRT-LLM has no such input): the ascending cumulative token counts at which the
#: caller needs the tokens decoded so far (the streaming schedule's chunk boundaries); the model answers only
#: there and at the end instead of once per token. Absent: one response per decoded token (as TensorRT-LLM).
DELIVER_AT = TensorSpec("deliver_at", "INT32", (-1,), optional=True)
PYTORCH_LLM_INPUTS = (*LLM_INPUTS, DELIVER_AT)
OUTPUT_IDS = TensorSpec("output_ids", "INT32", (-1, -1))  # [beam, tokens]
SEQUENCE_LENGTH = TensorSpec("sequence_length", "INT32", (-1,))  # [beam]
LLM_OUTPUTS = (OUTPUT_IDS, SEQUENCE_LENGTH)

# -- token2wav -------------------------------------------------------------------------------------
STREAM_ID = TensorSpec("stream_id", "BYTES", (1,))
T2W_SPEECH_TOKENS = TensorSpec("speech_tokens", "INT32", (-1,))  # tokens not sent before
CHUNK = TensorSpec("chunk", "INT32", (4,), optional=True)  # start, stop, feed, final; absent = offline
T2W_SEED = TensorSpec("seed", "UINT64", (1,), optional=True)
CLOSE = TensorSpec("close", "BOOL", (1,), optional=True)  # drop the stream (cancellation)
TOKEN2WAV_INPUTS = (
    STREAM_ID, T2W_SPEECH_TOKENS, CHUNK, T2W_SEED, CLOSE,
    TensorSpec(PROMPT_SPEECH_TOKENS.name, "INT32", (-1,), optional=True),
    TensorSpec(PROMPT_MEL.name, "FP32", (-1, 80), optional=True),
    TensorSpec(PROMPT_XVECTOR.name, "FP32", (-1,), optional=True),
)  # fmt: skip
WAVEFORM = TensorSpec("waveform", "FP32", (-1,))

# -- engine (colocated layout): the LLM and token2wav tensors on one decoupled model ---------------
def _explicit_batch(spec: TensorSpec) -> TensorSpec:
    """`engine` has max_batch_size 0, so the LLM tensors' batch dimension of 1 is part of their dims."""
    return replace(spec, dims=(-1, *spec.dims), reshape=None)


#: Every input is optional: a request carries the LLM set or the token2wav set (`engine_request_kind`).
ENGINE_INPUTS = tuple(replace(_explicit_batch(s), optional=True) for s in PYTORCH_LLM_INPUTS) + tuple(
    replace(s, optional=True) for s in TOKEN2WAV_INPUTS
)
ENGINE_OUTPUTS = (*(_explicit_batch(s) for s in LLM_OUTPUTS), WAVEFORM)
LLM_KIND = "llm"
TOKEN2WAV_KIND = "token2wav"
_KINDS = ((LLM_KIND, PYTORCH_LLM_INPUTS), (TOKEN2WAV_KIND, TOKEN2WAV_INPUTS))


def engine_request_kind(input_names: Iterable[str]) -> str:
    """`LLM_KIND` or `TOKEN2WAV_KIND`: the one tensor set whose required inputs are all present and
    which holds every input present; anything else is `InvalidInput`."""
    names = set(input_names)
    for kind, specs in _KINDS:
        if {s.name for s in specs if not s.optional} <= names <= {s.name for s in specs}:
            return kind
    expected = "; ".join(
        f"{kind}: {', '.join(s.name for s in specs if not s.optional)} (+ optional {kind} inputs)"
        for kind, specs in _KINDS
    )
    raise InvalidInput(f"engine: inputs {sorted(names)} match no request kind; expected {expected}")


def _col(value: object, dtype: type) -> np.ndarray:
    """A [1, 1] tensor: batch of one, one element."""
    return np.array([[value]], dtype=dtype)


# -- LLM: orchestrator side ------------------------------------------------------------------------
def llm_request_tensors(
    request: LLMRequest,
    vocab: SpeechVocabLayout,
    logits_bias: np.ndarray | None,
    repetition_penalty: float | None = None,
    deliver_at: bool = False,
) -> dict[str, np.ndarray]:
    """The LLM inputs (batch of one). TensorRT-LLM only: `logits_bias` masks text ids (docs/triton.md),
    `repetition_penalty` stands in for RAS (docs/deploy.md). PyTorch LLM only: `deliver_at` sends the request's
    delivery schedule."""
    stop_ids = vocab.stop_ids
    tensors = {
        INPUT_IDS.name: request.input_ids.astype(np.int32).reshape(1, -1),
        INPUT_LENGTHS.name: _col(request.input_ids.size, np.int32),
        REQUEST_OUTPUT_LEN.name: _col(request.max_tokens, np.int32),
        # the end id is the one min_length masks; the stop words end a request at any length. CosyVoice2: EOS,
        # then the other two end ids (upstream's Triton path stopped on <|eos1|> only); CosyVoice3: sos, then
        # the other 199 special ids (`cosyvoice3.vocab`)
        END_ID.name: _col(vocab.end_id, np.int32),
        PAD_ID.name: _col(vocab.end_id, np.int32),
        # one single-id word each: [[ids...], [offsets 1..n]]
        STOP_WORDS_LIST.name: np.array([[stop_ids, range(1, len(stop_ids) + 1)]], dtype=np.int32),
        RUNTIME_TOP_K.name: _col(request.top_k, np.int32),
        RUNTIME_TOP_P.name: _col(request.top_p, np.float32),
        TEMPERATURE.name: _col(request.temperature, np.float32),
        MIN_LENGTH.name: _col(request.min_tokens, np.int32),
        RANDOM_SEED.name: _col(request.seed, np.uint64),
        STREAMING.name: _col(request.streaming, np.bool_),
    }
    if logits_bias is not None:
        tensors[EMBEDDING_BIAS.name] = logits_bias.astype(np.float32).reshape(1, -1)
    if repetition_penalty is not None:
        tensors[REPETITION_PENALTY.name] = _col(repetition_penalty, np.float32)
    if deliver_at and request.streaming and request.deliver_at is not None:  # offline answers once anyway
        tensors[DELIVER_AT.name] = np.array(request.deliver_at, dtype=np.int32).reshape(1, -1)
    return tensors


def llm_stop_tensors() -> dict[str, np.ndarray]:
    """A `stop` request: the required inputs carry dummies, the request id names the sequence."""
    return {
        INPUT_IDS.name: np.zeros((1, 1), dtype=np.int32),
        INPUT_LENGTHS.name: _col(1, np.int32),
        REQUEST_OUTPUT_LEN.name: _col(1, np.int32),
        STOP.name: _col(True, np.bool_),
    }


def llm_response_ids(arrays: Arrays) -> list[int]:
    """The new ids of one LLM response (exclude_input_in_output; beam 0; trimmed to sequence_length)."""
    ids, length = arrays.get(OUTPUT_IDS.name), arrays.get(SEQUENCE_LENGTH.name)
    if ids is None:
        return []
    beam = ids.reshape(-1, ids.shape[-1])[0] if ids.size else np.zeros(0, dtype=np.int32)
    n = int(length.reshape(-1)[0]) if length is not None and length.size else beam.size
    return beam[:n].tolist()


# -- LLM: model side -------------------------------------------------------------------------------
def _scalar(arrays: Arrays, spec: TensorSpec, default: object) -> object:
    value = arrays.get(spec.name)
    return default if value is None or value.size == 0 else value.reshape(-1)[0].item()


def parse_llm_request(arrays: Arrays) -> tuple[LLMRequest, bool]:
    """(request, stop): the inverse of `llm_request_tensors` / `llm_stop_tensors`."""
    if bool(_scalar(arrays, STOP, False)):
        return _EMPTY_REQUEST, True
    ids = np.asarray(arrays[INPUT_IDS.name]).reshape(-1).astype(np.int32)
    length = int(_scalar(arrays, INPUT_LENGTHS, ids.size))
    request = LLMRequest(
        input_ids=ids[:length],
        min_tokens=int(_scalar(arrays, MIN_LENGTH, 0)),
        max_tokens=int(_scalar(arrays, REQUEST_OUTPUT_LEN, 0)),
        seed=int(_scalar(arrays, RANDOM_SEED, 0)),
        top_k=int(_scalar(arrays, RUNTIME_TOP_K, sampling_defaults.TOP_K)),
        top_p=float(_scalar(arrays, RUNTIME_TOP_P, sampling_defaults.TOP_P)),
        temperature=float(_scalar(arrays, TEMPERATURE, sampling_defaults.TEMPERATURE)),
        streaming=bool(_scalar(arrays, STREAMING, False)),
        deliver_at=_deliver_at(arrays.get(DELIVER_AT.name)),
    )
    return request, False


def _deliver_at(value: np.ndarray | None) -> tuple[int, ...] | None:
    if value is None:
        return None
    counts = tuple(int(v) for v in np.asarray(value).reshape(-1))
    if any(b <= a for a, b in zip(counts, counts[1:])) or (counts and counts[0] < 1):
        raise InvalidInput(f"{DELIVER_AT.name} must be ascending positive token counts, got {list(counts)}")
    return counts


_EMPTY_REQUEST = LLMRequest(np.zeros(0, np.int32), 0, 0, 0, 0, 0.0, 1.0, False)


def llm_response_tensors(ids: list[int]) -> dict[str, np.ndarray]:
    return {
        OUTPUT_IDS.name: np.array([[ids]], dtype=np.int32).reshape(1, 1, len(ids)),
        SEQUENCE_LENGTH.name: np.array([[len(ids)]], dtype=np.int32),
    }


# -- voice_prompt ----------------------------------------------------------------------------------
def voice_prompt_tensors(request: SpeechRequest) -> dict[str, np.ndarray]:
    """A voice-prompt model's inputs (CosyVoice2's `voice_prompt`, Spark's `spark_voice_prompt`) for `request`: its
    voice id, and its reference audio unless the request is id-only."""
    tensors = {VOICE_ID.name: np.array([request.voice_id.encode()], dtype=np.object_)}
    if request.carries_audio:
        tensors[REFERENCE_WAV.name] = request.reference_wav
        tensors[REFERENCE_WAV_LEN.name] = np.array([request.reference_wav.size], dtype=np.int32)
    return tensors


def parse_voice_prompt(arrays: Arrays) -> tuple[str, np.ndarray | None]:
    """(voice id, the reference's valid samples; None for a lookup by id alone): the inverse of
    `voice_prompt_tensors`."""
    raw = arrays[VOICE_ID.name].reshape(-1)[0]
    voice_id = raw.decode() if isinstance(raw, bytes) else str(raw)
    wav, wav_len = arrays.get(REFERENCE_WAV.name), arrays.get(REFERENCE_WAV_LEN.name)
    if wav is None or wav_len is None:
        return voice_id, None
    return voice_id, np.asarray(wav, dtype=np.float32).reshape(-1)[: int(wav_len.reshape(-1)[0])]


def prompt_to_tensors(prompt: PromptTensors) -> dict[str, np.ndarray]:
    return {
        PROMPT_SPEECH_TOKENS.name: prompt.speech_tokens.astype(np.int32),
        PROMPT_MEL.name: prompt.mel.astype(np.float32),
        PROMPT_XVECTOR.name: prompt.embedding.astype(np.float32),
    }


def prompt_from_tensors(arrays: Arrays) -> PromptTensors | None:
    tokens = arrays.get(PROMPT_SPEECH_TOKENS.name)
    if tokens is None:
        return None
    return PromptTensors(
        np.asarray(tokens, dtype=np.int32).reshape(-1),
        np.asarray(arrays[PROMPT_MEL.name], dtype=np.float32).reshape(-1, 80),
        np.asarray(arrays[PROMPT_XVECTOR.name], dtype=np.float32).reshape(-1),
    )


# -- token2wav -------------------------------------------------------------------------------------
def token2wav_tensors(
    stream_id: str, tokens: np.ndarray, prompt: PromptTensors | None, chunk: Chunk | None, seed: int
) -> dict[str, np.ndarray]:
    tensors = {
        STREAM_ID.name: np.array([stream_id.encode()], dtype=np.object_),
        T2W_SPEECH_TOKENS.name: np.asarray(tokens, dtype=np.int32).reshape(-1),
        T2W_SEED.name: np.array([seed], dtype=np.uint64),
    }
    if chunk is not None:
        tensors[CHUNK.name] = np.array([chunk.start, chunk.stop, chunk.feed, int(chunk.final)], dtype=np.int32)
    if prompt is not None:
        tensors.update(prompt_to_tensors(prompt))
    return tensors


def token2wav_close_tensors(stream_id: str) -> dict[str, np.ndarray]:
    return {
        STREAM_ID.name: np.array([stream_id.encode()], dtype=np.object_),
        T2W_SPEECH_TOKENS.name: np.zeros(0, dtype=np.int32),
        CLOSE.name: np.array([True]),
    }


def parse_token2wav(arrays: Arrays) -> tuple[str, np.ndarray, PromptTensors | None, Chunk | None, int | None, bool]:
    """(stream id, tokens, prompt, chunk, seed, close)."""
    raw = arrays[STREAM_ID.name].reshape(-1)[0]
    stream_id = raw.decode() if isinstance(raw, bytes) else str(raw)
    chunk_array = arrays.get(CHUNK.name)
    chunk = None
    if chunk_array is not None:
        start, stop, feed, final = (int(v) for v in chunk_array.reshape(-1)[:4])
        chunk = Chunk(start=start, stop=stop, feed=feed, final=bool(final))
    seed = _scalar(arrays, T2W_SEED, None)
    return (
        stream_id,
        np.asarray(arrays[T2W_SPEECH_TOKENS.name], dtype=np.int32).reshape(-1),
        prompt_from_tensors(arrays),
        chunk,
        None if seed is None else int(seed),
        bool(_scalar(arrays, CLOSE, False)),
    )
