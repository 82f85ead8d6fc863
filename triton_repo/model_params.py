"""Typed parameters of the repository's internal models: one class per model.

`render` writes an instance into the model's `config.pbtxt` (`to_parameters`: the `parameters { ... }` string
map), the model's adapter reads it back with the same class (`from_parameters`), so a parameter's name, type
and meaning exist once. Rules of the string form:

* scalars: `str`, `int`, `float`, `bool` ("true"/"false"), `Path`; an optional one (`X | None`) is left out
  when None and read as None when absent;
* a nested dataclass is flattened into its fields' keys (with the field's `prefix` metadata in front); an
  optional nested one is left out when None and read as None when none of its keys is present;
* keys shared by two nested parts (the colocated `engine` hosts the LLM and token2wav) must agree.

Reading refuses unknown keys, missing keys and values of the wrong type with a `ParameterError` that names
the model, the key and the value. Importable outside tritonserver (render runs there): no Triton imports.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, TypeVar

from speech_serving.repetition import LoopGuardConfig
from speech_serving.schedule import StreamScheduleParams
from spark_tts.streaming import ChunkSchedule


class ParameterError(ValueError):
    """A model parameter is missing, unknown or not of its declared type."""


_P = TypeVar("_P", bound="ModelParams")
_SCALARS = (str, int, float, bool, Path)


def optional_type(kind: Any) -> tuple[Any, bool]:
    """(the type, whether None is allowed) of an annotation such as `int | None`."""
    if isinstance(kind, types.UnionType) or typing.get_origin(kind) is typing.Union:
        args = [a for a in typing.get_args(kind) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return kind, False


def _format(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _parse(kind: Any, text: str) -> object:
    if kind is bool:
        if text not in ("true", "false"):
            raise ValueError("expected true or false")
        return text == "true"
    if kind is Path:
        if not text:
            raise ValueError("expected a path")
        return Path(text)
    return kind(text)


def _flatten(obj: object, prefix: str, out: dict[str, str], owner: str) -> None:
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):  # type: ignore[arg-type]
        kind, _ = optional_type(hints[f.name])
        value = getattr(obj, f.name)
        key = prefix + f.metadata.get("prefix", "" if dataclasses.is_dataclass(kind) else f.name)
        if value is None:
            continue
        if dataclasses.is_dataclass(kind):
            _flatten(value, key, out, owner)
            continue
        text = _format(value)
        if out.setdefault(key, text) != text:
            raise ParameterError(f"{owner}: parameter {key} has two values, {out[key]!r} and {text!r}")


def _build(cls: type, prefix: str, params: Mapping[str, str], used: set[str], owner: str) -> Any:
    hints = typing.get_type_hints(cls)
    values: dict[str, object] = {}
    for f in dataclasses.fields(cls):
        kind, optional = optional_type(hints[f.name])
        key = prefix + f.metadata.get("prefix", "" if dataclasses.is_dataclass(kind) else f.name)
        if dataclasses.is_dataclass(kind):
            keys = _keys(kind, key)
            if optional and not keys & params.keys():
                values[f.name] = None
            else:
                values[f.name] = _build(kind, key, params, used, owner)
            continue
        if kind not in _SCALARS:
            raise TypeError(f"{cls.__name__}.{f.name}: unsupported parameter type {kind!r}")
        if key not in params:
            if optional:
                values[f.name] = None
                continue
            raise ParameterError(f"{owner}: parameter {key} is missing")
        used.add(key)
        try:
            values[f.name] = _parse(kind, params[key])
        except ValueError as exc:
            raise ParameterError(
                f"{owner}: parameter {key}={params[key]!r} is not a valid {getattr(kind, '__name__', kind)} ({exc})"
            ) from exc
    try:
        return cls(**values)
    except (ValueError, TypeError) as exc:  # the class's own checks (e.g. LoopGuardConfig's limits)
        raise ParameterError(f"{owner}: {exc}") from exc


def _keys(cls: type, prefix: str) -> set[str]:
    hints = typing.get_type_hints(cls)
    keys: set[str] = set()
    for f in dataclasses.fields(cls):
        kind, _ = optional_type(hints[f.name])
        key = prefix + f.metadata.get("prefix", "" if dataclasses.is_dataclass(kind) else f.name)
        keys |= _keys(kind, key) if dataclasses.is_dataclass(kind) else {key}
    return keys


class ModelParams:
    """Base of the parameter classes (frozen dataclasses): the string form of `config.pbtxt` both ways."""

    def to_parameters(self) -> dict[str, str]:
        out: dict[str, str] = {}
        _flatten(self, "", out, type(self).__name__)
        return out

    @classmethod
    def from_parameters(cls: type[_P], params: Mapping[str, str], model: str | None = None) -> _P:
        owner = model or cls.__name__
        used: set[str] = set()
        result = _build(cls, "", params, used, owner)
        unknown = sorted(params.keys() - used)
        if unknown:
            raise ParameterError(f"{owner}: unknown parameters {', '.join(unknown)}")
        return result


def _prefixed(prefix: str) -> dict[str, str]:
    return {"prefix": prefix}


@dataclass(frozen=True)
class BenchmarkMode:
    """Benchmark mode for random-weight models (they stop at random): every request generates exactly
    round(`speech_ratio` x target text tokens) speech tokens; the LLM never samples a stop id and the loop guard
    is off. One option, rendered into the orchestrators' and the LLM's parameters alike. Spark-TTS takes the same
    mode with its own ratio (semantic tokens per target text token of Spark's tokenizer; `SparkRenderOptions`):
    its orchestrators fix the length and count every generated id as one code, its engine never stops early."""

    speech_ratio: float


@dataclass(frozen=True)
class InternalModels:
    """Which models answer the orchestrator's LLM and token2wav calls (rendered per layout: `engine` for both
    when colocated, `llm` and `token2wav` in the single layout), and whether the LLM takes a delivery schedule
    (`deliver_at`: the PyTorch LLM; TensorRT-LLM streams per token)."""

    llm_model: str
    token2wav_model: str
    token2wav_decoupled: bool
    llm_deliver_at: bool = False
    voice_prompt_model: str = "voice_prompt"  # the voice-prompt cache of this pipeline's model (CosyVoice3 has its own)


@dataclass(frozen=True)
class OrchestratorParams(ModelParams):
    """`cosyvoice2` / `cosyvoice2_stream` (`adapters.orchestrator`)."""

    model_dir: Path
    llm_backend: str
    max_sequence_len: int
    max_target_text_tokens: int
    schedule: StreamScheduleParams
    models: InternalModels
    voice_cache: int  # voice prompts each orchestrator keeps in front of `voice_prompt` (a hit makes no call)
    benchmark: BenchmarkMode | None = field(default=None, metadata=_prefixed("benchmark_"))
    # TensorRT-LLM only: the logits bias file (text-id mask), its repetition penalty and the loop guard
    llm_logits_bias: Path | None = None
    llm_repetition_penalty: float | None = None
    loop_guard: LoopGuardConfig | None = field(default=None, metadata=_prefixed("loop_"))


@dataclass(frozen=True)
class _TorchModelParams(ModelParams):
    """What every PyTorch model of the engine is loaded with."""

    model_dir: Path
    device: str
    dtype: str


@dataclass(frozen=True)
class DecoderParams(_TorchModelParams):
    """A PyTorch LLM on our batched decoder under continuous batching: its capacity (`adapters.llm.LLMHandler`)."""

    max_batch: int  # sequences decoded together (KV slots)
    max_seq_len: int  # prompt + generated tokens per sequence
    max_waiting: int  # requests queued beyond the slots before [overloaded]


@dataclass(frozen=True)
class LLMParams(DecoderParams):
    """The PyTorch LLM (`adapters.llm.LLMHandler`)."""

    benchmark: BenchmarkMode | None = field(default=None, metadata=_prefixed("benchmark_"))
    llm_yield: str = "off"  # colocated engine: when the LLM waits for token2wav's running call (`gpu_yield`)


@dataclass(frozen=True)
class Token2WavParams(_TorchModelParams):
    """token2wav (`adapters.token2wav.Token2WavHandler`)."""

    schedule: StreamScheduleParams
    flow_cache: str
    # unet, these two: None sized to the GPU at start (`cosyvoice2.flow.memory`)
    flow_cache_gb: float | None  # the live streams' flow caches' budget; 0: no limit
    token2wav: str = "unet"  # unet (CosyVoice2's flow) or dit (`dit_dir`)
    dit_dir: Path | None = None
    token2wav_rows: int | None = None  # unet: jobs per call at most, its graphs' largest row bucket


@dataclass(frozen=True)
class EngineParams(ModelParams):
    """The colocated layout's engine (`adapters.engine`): the LLM's and token2wav's parameters in one map."""

    llm: LLMParams
    token2wav: Token2WavParams


@dataclass(frozen=True)
class EngineEntryParams(ModelParams):
    """`cosyvoice2_stream` hosting the engine (`adapters.engine_entry`, colocated layout): the streaming
    orchestrator's parameters and the engine's in one map."""

    orchestrator: OrchestratorParams
    engine: EngineParams


@dataclass(frozen=True)
class AudioModelParams(ModelParams):
    """`audio_tokenizer` and `speaker_embedding` (`adapters.audio_features`); `spark_audio_tokenizer`
    (`adapters.spark`, `model_dir` the Spark-TTS directory)."""

    model_dir: Path
    device: str


@dataclass(frozen=True)
class VoicePromptParams(ModelParams):
    """`voice_prompt` (`adapters.voice_prompt`) and `spark_voice_prompt` (`adapters.spark`)."""

    cache_capacity: int  # voices kept


# -- Spark-TTS (`triton_repo.spark_render`): `model_dir` is the Spark-TTS directory --------------------------------
@dataclass(frozen=True)
class SparkOrchestratorParams(ModelParams):
    """`spark_tts` / `spark_tts_stream` (`adapters.spark.SparkOrchestratorModel`)."""

    model_dir: Path
    sample_rate: int  # Hz of the waveform the engine vocodes, stated in every response
    max_new_tokens: int  # LLM tokens per segment
    max_seq_len: int  # the LLM's prompt + generated tokens per sequence
    max_target_text_tokens: int
    schedule: ChunkSchedule  # the stream's piece sizes (first_chunk_tokens, scale, max_chunk_tokens)
    voice_cache: int  # voices each orchestrator keeps in front of `spark_voice_prompt` (a hit makes no call)
    benchmark: BenchmarkMode | None = field(default=None, metadata=_prefixed("benchmark_"))
    trtllm_model: str | None = None  # the tensorrtllm model decoding the LLM; None: `spark_engine`'s PyTorch LLM


@dataclass(frozen=True)
class SparkEngineParams(DecoderParams):
    """`spark_engine` (`adapters.spark.SparkEngineModel`): the Spark LLM and BiCodec's decoder in one process."""

    benchmark: BenchmarkMode | None = field(default=None, metadata=_prefixed("benchmark_"))
    llm: bool = True  # false: the LLM runs on TensorRT-LLM (`spark_llm`) and this model only vocodes


# -- CosyVoice3 (`triton_repo.cosyvoice3_render`): `model_dir` is the CosyVoice3 directory ----------------------
@dataclass(frozen=True)
class CosyVoice3OrchestratorParams(ModelParams):
    """`cosyvoice3` / `cosyvoice3_stream` (`adapters.cosyvoice3.CosyVoice3OrchestratorModel`)."""

    model_dir: Path
    max_sequence_len: int  # the LLM's prompt + generated tokens per sequence
    max_target_text_tokens: int
    first_hop: int  # the streaming schedule: tokens of the first chunk, then second_hop doubling per chunk
    second_hop: int
    models: InternalModels
    voice_cache: int  # voices each orchestrator keeps in front of `cosyvoice3_voice_prompt` (a hit makes no call)
    benchmark: BenchmarkMode | None = field(default=None, metadata=_prefixed("benchmark_"))
    # TensorRT-LLM only (`cosyvoice3_llm`), as CosyVoice2's: the logits bias file (text-row mask), the repetition
    # penalty and the loop guard standing in for RAS; the silent-token filter then runs here
    llm_logits_bias: Path | None = None
    llm_repetition_penalty: float | None = None
    loop_guard: LoopGuardConfig | None = field(default=None, metadata=_prefixed("loop_"))


@dataclass(frozen=True)
class CosyVoice3EngineParams(DecoderParams):
    """CosyVoice3's engine (`adapters.cosyvoice3_engine`): its LLM and token2wav in `cosyvoice3_stream`'s process, or
    token2wav alone in `cosyvoice3_engine` beside a TensorRT-LLM engine."""

    # cached: streams keep their flow caches; chunked: the final chunk continues them too (the chunk mask); recompute:
    # every chunk re-runs the flow (the reference)
    flow_cache: str
    flow_voices: int  # voices whose prompt flow cache the cached streams start from (least recently used dropped)
    # the live cached streams' own flow caches together (voices not counted); 0: no limit; None: sized to the GPU
    flow_cache_gb: float | None
    # the orchestrators' streaming schedule (tokens of the first chunk, then second_hop doubling per chunk): the
    # flow's CUDA-graph buckets are made to cover its chunks
    first_hop: int
    second_hop: int
    benchmark: BenchmarkMode | None = field(default=None, metadata=_prefixed("benchmark_"))
    llm: bool = True  # False with a TensorRT-LLM engine (`cosyvoice3_llm` decodes): token2wav only, no PyTorch LLM


@dataclass(frozen=True)
class CosyVoice3EngineEntryParams(ModelParams):
    """`cosyvoice3_stream` hosting the engine (`adapters.cosyvoice3_engine.CosyVoice3StreamModel`, the PyTorch
    LLM): the streaming orchestrator's parameters and the engine's in one map, as CosyVoice2's `EngineEntryParams`."""

    orchestrator: CosyVoice3OrchestratorParams
    engine: CosyVoice3EngineParams
