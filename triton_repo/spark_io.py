"""Tensors of the Spark-TTS internal models (`spark_audio_tokenizer`, `spark_voice_prompt`, `spark_engine`) and
the numpy conversions on both sides of each call. numpy only (no Triton).

The Spark orchestrators speak the pipeline contract (`pipeline_contract`) to the gateway; this module is their
interface to the internal models, as `internal_io.py` is CosyVoice2's.
"""

from __future__ import annotations

from typing import Iterable, Mapping

import numpy as np

from speech_serving.errors import InvalidInput
from speech_serving.io_struct import SparkLLMRequest, SparkVoicePrompt
from pipeline_contract import TensorSpec
from triton_repo import internal_io as trt
from triton_repo.internal_io import AUDIO_INPUTS, VOICE_PROMPT_INPUTS

Arrays = Mapping[str, "np.ndarray | None"]

# -- the internal models' names (the orchestrators call them; render writes them) ------------------------
VOICE_PROMPT_MODEL = "spark_voice_prompt"
AUDIO_TOKENIZER_MODEL = "spark_audio_tokenizer"
ENGINE_MODEL = "spark_engine"
LLM_MODEL = "spark_llm"  # the TensorRT-LLM engine of the Spark LLM (`render --spark-engine-dir`)

# -- spark_audio_tokenizer (dynamic batching: dims exclude the batch dimension) / spark_voice_prompt --------
SPARK_AUDIO_INPUTS = AUDIO_INPUTS
GLOBAL_TOKENS = TensorSpec("global_tokens", "INT32", (-1,))  # 32 per voice
SEMANTIC_TOKENS = TensorSpec("semantic_tokens", "INT32", (-1,))  # 50 per second of reference
VOICE_TOKENS = (GLOBAL_TOKENS, SEMANTIC_TOKENS)
SPARK_VOICE_PROMPT_INPUTS = VOICE_PROMPT_INPUTS

# -- spark_engine (max_batch_size 0, decoupled): an LLM request or a vocoder request ----------------------
PROMPT_IDS = TensorSpec("input_ids", "INT32", (-1,), optional=True)
MAX_NEW_TOKENS = TensorSpec("request_output_len", "INT32", (1,), optional=True)
LLM_SEED = TensorSpec("random_seed", "UINT64", (1,), optional=True)
#: Token counts at which the caller needs the ids decoded so far (its stream windows); empty: only at the end.
DELIVER_AT = TensorSpec("deliver_at", "INT32", (-1,), optional=True)
STOP = TensorSpec("stop", "BOOL", (1,), optional=True)  # cancels the sequence with this request id
LLM_INPUTS = (PROMPT_IDS, MAX_NEW_TOKENS, LLM_SEED, DELIVER_AT, STOP)
OUTPUT_IDS = TensorSpec("output_ids", "INT32", (-1,))  # the LLM ids decoded since the last response

VOCODE_GLOBAL = TensorSpec(GLOBAL_TOKENS.name, "INT32", (-1,), optional=True)
VOCODE_SEMANTIC = TensorSpec(SEMANTIC_TOKENS.name, "INT32", (-1,), optional=True)  # the window's tokens
#: Which of the window's tokens to return the samples of: [start, end) (the rest is context).
EMIT = TensorSpec("emit", "INT32", (2,), optional=True)
VOCODER_INPUTS = (VOCODE_GLOBAL, VOCODE_SEMANTIC, EMIT)
WAVEFORM = TensorSpec("waveform", "FP32", (-1,))  # 16 kHz

ENGINE_INPUTS = (*LLM_INPUTS, *VOCODER_INPUTS)
ENGINE_OUTPUTS = (OUTPUT_IDS, WAVEFORM)
LLM_KIND = "llm"
VOCODER_KIND = "vocoder"


def engine_request_kind(input_names: Iterable[str]) -> str:
    """`LLM_KIND` (a prompt, or `stop`) or `VOCODER_KIND` (all three vocoder inputs); anything else is refused."""
    names = set(input_names)
    llm, vocoder = {s.name for s in LLM_INPUTS}, {s.name for s in VOCODER_INPUTS}
    if names and names <= llm and (PROMPT_IDS.name in names or STOP.name in names):
        return LLM_KIND
    if names == vocoder:
        return VOCODER_KIND
    raise InvalidInput(f"spark_engine: inputs {sorted(names)} are neither an LLM request ({', '.join(sorted(llm))}) "
                       f"nor a vocoder request ({', '.join(sorted(vocoder))})")


def _first(arrays: Arrays, spec: TensorSpec, default: int) -> int:
    value = arrays.get(spec.name)
    return default if value is None or value.size == 0 else int(value.reshape(-1)[0])


# -- voice tokens ----------------------------------------------------------------------------------------
def voice_to_tensors(voice: SparkVoicePrompt) -> dict[str, np.ndarray]:
    return {GLOBAL_TOKENS.name: voice.global_tokens.astype(np.int32),
            SEMANTIC_TOKENS.name: voice.semantic_tokens.astype(np.int32)}


def voice_from_tensors(arrays: Arrays) -> SparkVoicePrompt:
    global_tokens, semantic = arrays.get(GLOBAL_TOKENS.name), arrays.get(SEMANTIC_TOKENS.name)
    if global_tokens is None or semantic is None:
        raise RuntimeError("spark voice prompt: tokens missing from the response")
    return SparkVoicePrompt(global_tokens.reshape(-1).astype(np.int32), semantic.reshape(-1).astype(np.int32))


# -- LLM -------------------------------------------------------------------------------------------------
def llm_request_tensors(request: SparkLLMRequest) -> dict[str, np.ndarray]:
    tensors = {
        PROMPT_IDS.name: request.prompt_ids.astype(np.int32).reshape(-1),
        MAX_NEW_TOKENS.name: np.array([request.max_new_tokens], dtype=np.int32),
        LLM_SEED.name: np.array([request.seed], dtype=np.uint64),
    }
    if request.deliver_at is not None:
        tensors[DELIVER_AT.name] = np.asarray(request.deliver_at, dtype=np.int32).reshape(-1)
    return tensors


def llm_stop_tensors() -> dict[str, np.ndarray]:
    return {STOP.name: np.array([True])}


def parse_llm_request(arrays: Arrays) -> tuple[SparkLLMRequest | None, bool]:
    """(the request, or None for a stop; whether it is a stop)."""
    stop = arrays.get(STOP.name)
    if stop is not None and bool(stop.reshape(-1)[0]):
        return None, True
    ids = arrays.get(PROMPT_IDS.name)
    if ids is None or ids.size == 0:
        raise InvalidInput("spark_engine: an LLM request needs a non-empty input_ids")
    max_new = _first(arrays, MAX_NEW_TOKENS, 0)
    if max_new < 1:
        raise InvalidInput("spark_engine: request_output_len must be >= 1")
    deliver = arrays.get(DELIVER_AT.name)
    return SparkLLMRequest(
        prompt_ids=ids.reshape(-1).astype(np.int32),
        max_new_tokens=max_new,
        seed=_first(arrays, LLM_SEED, 0),
        deliver_at=None if deliver is None else tuple(int(x) for x in deliver.reshape(-1)),
    ), False


def llm_response_tensors(ids: list[int]) -> dict[str, np.ndarray]:
    return {OUTPUT_IDS.name: np.asarray(ids, dtype=np.int32)}


def llm_response_ids(arrays: Arrays) -> list[int]:
    ids = arrays.get(OUTPUT_IDS.name)
    return [] if ids is None else ids.reshape(-1).astype(int).tolist()


# -- spark_llm: the Spark LLM on the tensorrtllm backend (`SparkRenderOptions.engine_dir`) ----------------------
#: What the Spark orchestrators send it: CosyVoice2's TensorRT-LLM tensors (the backend's names, pinned facts in
#: `trtllm_backend_facts`) less the parts Spark has no use for (no text mask, no minimum length, no extra stop
#: words, no repetition penalty: Spark samples plain top-k/top-p). `embedding_bias` is sent in benchmark mode only,
#: to keep the stop id from being drawn.
TRTLLM_INPUTS = (
    trt.INPUT_IDS, trt.INPUT_LENGTHS, trt.REQUEST_OUTPUT_LEN, trt.END_ID, trt.PAD_ID, trt.EMBEDDING_BIAS,
    trt.RUNTIME_TOP_K, trt.RUNTIME_TOP_P, trt.TEMPERATURE, trt.RANDOM_SEED, trt.STREAMING, trt.STOP,
)  # fmt: skip
TRTLLM_OUTPUTS = trt.LLM_OUTPUTS
#: The sampling controls every generation request carries, by role (`trtllm_backend_facts.check_request`).
TRTLLM_ROLES = ("seed", "end_id", "runtime_top_k", "runtime_top_p", "temperature")
#: The logit bias that keeps an id from being drawn (benchmark mode; float32 logits, as the engine is built).
NEVER = -1e9


def trtllm_request_tensors(request: SparkLLMRequest, eos_id: int, top_k: int, top_p: float, temperature: float,
                           stop_bias: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """One Spark LLM sequence for the tensorrtllm backend (batch of one), sampled as `SparkSampling` says.
    Streaming requests get their ids per token, offline ones once. ``stop_bias``: benchmark mode's embedding bias."""
    streaming = request.streaming
    tensors = {
        trt.INPUT_IDS.name: request.prompt_ids.astype(np.int32).reshape(1, -1),
        trt.INPUT_LENGTHS.name: np.array([[request.prompt_ids.size]], dtype=np.int32),
        trt.REQUEST_OUTPUT_LEN.name: np.array([[request.max_new_tokens]], dtype=np.int32),
        trt.END_ID.name: np.array([[eos_id]], dtype=np.int32),
        trt.PAD_ID.name: np.array([[eos_id]], dtype=np.int32),
        trt.RUNTIME_TOP_K.name: np.array([[top_k]], dtype=np.int32),
        trt.RUNTIME_TOP_P.name: np.array([[top_p]], dtype=np.float32),
        trt.TEMPERATURE.name: np.array([[temperature]], dtype=np.float32),
        trt.RANDOM_SEED.name: np.array([[request.seed]], dtype=np.uint64),
        trt.STREAMING.name: np.array([[streaming]], dtype=np.bool_),
    }
    if stop_bias is not None:
        tensors[trt.EMBEDDING_BIAS.name] = stop_bias.astype(np.float32).reshape(1, -1)
    return tensors


def benchmark_stop_bias(vocab_size: int, eos_id: int) -> np.ndarray:
    """Benchmark mode's embedding bias: zero everywhere but the stop id (one value per row of the logits)."""
    bias = np.zeros(vocab_size, dtype=np.float32)
    bias[eos_id] = NEVER
    return bias


# -- vocoder ---------------------------------------------------------------------------------------------
def vocode_tensors(global_tokens: np.ndarray, semantic_tokens: np.ndarray, emit_start: int, emit_end: int
                   ) -> dict[str, np.ndarray]:
    return {
        VOCODE_GLOBAL.name: global_tokens.astype(np.int32).reshape(-1),
        VOCODE_SEMANTIC.name: semantic_tokens.astype(np.int32).reshape(-1),
        EMIT.name: np.array([emit_start, emit_end], dtype=np.int32),
    }


def parse_vocode_request(arrays: Arrays) -> tuple[np.ndarray, np.ndarray, int, int]:
    emit = arrays[EMIT.name]
    assert emit is not None and arrays[VOCODE_GLOBAL.name] is not None and arrays[VOCODE_SEMANTIC.name] is not None
    if emit.size != 2:
        raise InvalidInput("spark_engine: emit must hold [start, end)")
    start, end = (int(x) for x in emit.reshape(-1))
    return (arrays[VOCODE_GLOBAL.name].reshape(-1), arrays[VOCODE_SEMANTIC.name].reshape(-1), start, end)
