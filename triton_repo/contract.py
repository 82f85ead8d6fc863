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

Both take ``max_batch_size: 0`` shapes (no batch dimension): batching happens inside the pipeline.
The gateway sends one request per text segment, in order. This module is import-light (numpy only)
because the torch-free gateway, the Triton model adapters and the stand-in test model all use it.
See docs/pipeline-contract.md for the prose version.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

OFFLINE_MODEL = "cosyvoice2"
STREAMING_MODEL = "cosyvoice2_stream"
#: The Spark-TTS pipeline, rendered beside CosyVoice2 when a Spark model directory is given: the same inputs and
#: outputs, 16 kHz audio (the `sample_rate` output says so).
SPARK_OFFLINE_MODEL = "spark_tts"
SPARK_STREAMING_MODEL = "spark_tts_stream"

#: The most target-text tokens (Qwen2 tokenizer) one segment may have; longer ones are refused as
#: ``[invalid_input]``. The gateway cuts its segments below it (a deployment may render a different limit).
MAX_SEGMENT_TOKENS = 300

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
REFERENCE_WAV = TensorSpec("reference_wav", "FP32", (-1,))  # 16 kHz mono float in [-1, 1]
REFERENCE_WAV_LEN = TensorSpec("reference_wav_len", "INT32", (1,))  # valid samples in reference_wav
#: UTF-8 transcript of the reference; empty = none (the pipeline then uses CosyVoice2's cross-lingual mode).
REFERENCE_TEXT = TensorSpec("reference_text", "BYTES", (1,))
TARGET_TEXT = TensorSpec("target_text", "BYTES", (1,))  # UTF-8 text of ONE segment to speak
#: Keys the server-side voice-prompt cache: a content hash of (audio, transcript), computed by the
#: gateway once per voice. Never a bare name: two voices with one transcript must not collide.
VOICE_ID = TensorSpec("voice_id", "BYTES", (1,))
SEED = TensorSpec("seed", "UINT64", (1,), optional=True)  # sampling seed; absent = random per request
#: UTF-8 style instruction ("Speak slowly and sadly"); absent or empty = none. Given, the pipeline uses
#: CosyVoice2's instruct mode with the voice's timbre (the transcript is then unused).
INSTRUCTION_TEXT = TensorSpec("instruction_text", "BYTES", (1,), optional=True)

INPUTS: tuple[TensorSpec, ...] = (
    REFERENCE_WAV, REFERENCE_WAV_LEN, REFERENCE_TEXT, TARGET_TEXT, VOICE_ID, SEED, INSTRUCTION_TEXT,
)  # fmt: skip

# Outputs --------------------------------------------------------------------------------------
WAVEFORM = TensorSpec("waveform", "FP32", (-1,))  # mono float32 samples at `sample_rate` (may be empty)
#: Usage, cumulative for the request so far; the final response holds the totals.
INPUT_TOKENS = TensorSpec("input_tokens", "INT32", (1,))  # text tokens the LLM read (prompt text + target)
OUTPUT_TOKENS = TensorSpec("output_tokens", "INT32", (1,))  # speech tokens the LLM generated

#: The rate of `waveform` in Hz, in every response: 24000 (CosyVoice2), 16000 (Spark-TTS).
SAMPLE_RATE = TensorSpec("sample_rate", "INT32", (1,))

OUTPUTS: tuple[TensorSpec, ...] = (WAVEFORM, INPUT_TOKENS, OUTPUT_TOKENS, SAMPLE_RATE)

#: Error messages raised by pipeline models start with one of these tags so the gateway can map
#: them to HTTP statuses without parsing free text (Triton's gRPC status codes are coarse).
ERROR_INVALID_INPUT = "[invalid_input]"  # -> 400
ERROR_OVERLOADED = "[overloaded]"  # -> 503 with Retry-After


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
