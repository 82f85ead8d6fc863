"""The Spark-TTS models of the rendered repository (`render --spark-dir DIR`), beside CosyVoice2's.

| model | what |
|---|---|
| `spark_tts` / `spark_tts_stream` | the pipeline contract (offline / decoupled), 16 kHz `waveform` + `sample_rate` |
| `spark_voice_prompt` | the voice cache (LRU by voice id) in front of the audio tokenizer |
| `spark_audio_tokenizer` | wav2vec2 + BiCodec encoder, dynamically batched, masked (solo tokens in any batch) |
| `spark_engine` | the LLM (our batched decoder, continuous batching) and BiCodec's decoder in one process |
| `spark_llm` | with `--spark-engine-dir` only: the LLM on the tensorrtllm backend (`spark_engine` then only vocodes) |

Without `--spark-dir` nothing here is rendered and the CosyVoice2 repository is unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from spark_tts.engine import SAMPLE_RATE
from spark_tts.errors import SparkModelError
from spark_tts.llm import SparkSampling
from spark_tts.loading import check_model_dir, read_llm_config
from spark_tts.streaming import ChunkSchedule
import pipeline_contract as contract
from triton_repo import spark_io as io
from triton_repo import trtllm_backend_facts as facts
from triton_repo.model_params import AudioModelParams, BenchmarkMode, SparkEngineParams, SparkOrchestratorParams, VoicePromptParams

if TYPE_CHECKING:
    from triton_repo.render import RenderOptions

VOICE_PROMPT = "spark_voice_prompt"
AUDIO_TOKENIZER = "spark_audio_tokenizer"
ENGINE = "spark_engine"
LLM = "spark_llm"  # the TensorRT-LLM engine of the Spark LLM (`--spark-engine-dir`)
MODELS = frozenset(
    {contract.SPARK_OFFLINE_MODEL, contract.SPARK_STREAMING_MODEL, VOICE_PROMPT, AUDIO_TOKENIZER, ENGINE}
)
#: Models whose instance count may be chosen (the engine keeps the sequences and must stay one process).
SCALABLE = (contract.SPARK_OFFLINE_MODEL, contract.SPARK_STREAMING_MODEL, VOICE_PROMPT, AUDIO_TOKENIZER)
SINGLE_INSTANCE = (ENGINE, LLM)
#: The TensorRT-LLM engine's share of the free GPU memory for its KV cache: the vocoder, the audio tokenizer
#: (and CosyVoice2) share its GPU.
KV_CACHE_FREE_GPU_MEM_FRACTION = 0.5
_SCHEDULE = ChunkSchedule()


@dataclass(frozen=True)
class SparkRenderOptions:
    """The Spark part of a render (`RenderOptions.spark`); defaults are the served runtime's."""

    model_dir: Path  # the released layout (SparkAudio/Spark-TTS-0.5B)
    max_new_tokens: int = SparkSampling().max_new_tokens  # 512 = 10.24 s per segment
    first_chunk_tokens: int = _SCHEDULE.first_chunk_tokens
    chunk_scale: float = _SCHEDULE.scale
    max_chunk_tokens: int = _SCHEDULE.max_chunk_tokens
    # prompt + generated tokens per sequence: a 10 s reference (500 tokens) + 200 text tokens + 512 fit in 2048
    max_seq_len: int = 2048
    # Benchmark mode for random weights (they stop at random): every request generates exactly
    # round(ratio x target text tokens) semantic tokens and the stop id is never drawn. None = off. Spark's own
    # ratio: its tokenizer and token rate (50 per second) are not CosyVoice2's.
    benchmark_ratio: float | None = None
    # A TensorRT-LLM engine of the Spark LLM (`python -m cosyvoice_build.spark_trtllm`): rendered as `spark_llm`
    # (tensorrtllm backend) and the orchestrators' LLM; None: the PyTorch LLM inside `spark_engine`.
    engine_dir: Path | None = None


def models(opts: RenderOptions) -> set[str]:
    """The Spark models `files` renders (none without `opts.spark`)."""
    if opts.spark is None:
        return set()
    return set(MODELS) | ({LLM} if opts.spark.engine_dir is not None else set())


def check(opts: RenderOptions) -> list[str]:
    spark = opts.spark
    if spark is None:
        return []
    errors = []
    try:
        check_model_dir(spark.model_dir)
    except SparkModelError as exc:
        errors.append(f"--spark-dir: {exc}")
    for name, value, low in (
        ("--spark-max-new-tokens", spark.max_new_tokens, 1), ("--spark-first-chunk", spark.first_chunk_tokens, 1),
        ("--spark-max-seq-len", spark.max_seq_len, 64),
    ):  # fmt: skip
        if value < low:
            errors.append(f"{name} must be >= {low}, got {value}")
    if spark.benchmark_ratio is not None and not spark.benchmark_ratio > 0:
        errors.append(f"--spark-benchmark-ratio must be > 0, got {spark.benchmark_ratio}")
    if spark.engine_dir is not None:
        errors += _check_engine(opts, spark)
    if spark.chunk_scale < 1:
        errors.append(f"--spark-chunk-scale must be >= 1, got {spark.chunk_scale}")
    if spark.max_chunk_tokens < spark.first_chunk_tokens:
        errors.append(f"--spark-max-chunk {spark.max_chunk_tokens} is below --spark-first-chunk "
                      f"{spark.first_chunk_tokens}")
    return errors


def _check_engine(opts: RenderOptions, spark: SparkRenderOptions) -> list[str]:
    """The Spark TensorRT-LLM engine against what the Spark models send it (the same pinned facts as CosyVoice2's)."""
    from triton_repo.render import LOGITS_DTYPE, read_engine_config  # noqa: PLC0415 - render imports this module

    assert spark.engine_dir is not None
    if opts.device != "cuda":
        return ["--spark-engine-dir needs --device cuda"]
    if not (spark.engine_dir / "config.json").is_file() or not any(spark.engine_dir.glob("*.engine")):
        return [f"--spark-engine-dir {spark.engine_dir} holds no TensorRT-LLM engine (config.json + rank*.engine)"]
    engine = read_engine_config(spark.engine_dir)
    errors = facts.engine_version_problems(engine, "--spark-engine-dir", spark.engine_dir)
    build = engine.get("build_config", {})
    for flag, ours, key in (("--max-batch", opts.max_batch, "max_batch_size"),
                            ("--spark-max-seq-len", spark.max_seq_len, "max_seq_len")):
        if key in build and ours > int(build[key]):
            errors.append(f"{flag} {ours} exceeds the Spark engine's {key} {build[key]}")
    pretrained = engine.get("pretrained_config", {})
    if pretrained.get("logits_dtype") != LOGITS_DTYPE:
        errors.append(f"the Spark engine's logits are {pretrained.get('logits_dtype') or 'of unknown type'}, not "
                      f"{LOGITS_DTYPE}: benchmark mode's embedding bias would fail every request; rebuild it with "
                      f"trtllm-build --logits_dtype {LOGITS_DTYPE}")
    try:
        vocab = read_llm_config(spark.model_dir).qwen.vocab_size
    except (OSError, ValueError, SparkModelError):
        return errors  # the model directory's own check names it
    if pretrained.get("vocab_size") != vocab:
        errors.append(f"the Spark engine's vocab_size {pretrained.get('vocab_size')} is not the Spark LLM's {vocab} "
                      f"(built from another checkpoint?)")
    return errors


def files(opts: RenderOptions) -> dict[str, str]:
    """Relative path -> content of the Spark models (empty without `opts.spark`)."""
    # noqa: PLC0415 - render imports this module
    from triton_repo.render import _fill, _parameters, _python_model, instance_group, trtllm_parameters  # noqa: PLC0415

    spark = opts.spark
    if spark is None:
        return {}
    out: dict[str, str] = {}
    for name, decoupled, description in (
        (contract.SPARK_OFFLINE_MODEL, "false", "Spark-TTS offline pipeline: one response, the whole 16 kHz waveform."),
        (contract.SPARK_STREAMING_MODEL, "true", "Spark-TTS streaming pipeline: 16 kHz chunks that concatenate to "
                                                 "the offline waveform; FINAL rides on the last one."),
    ):  # fmt: skip
        out[f"{name}/config.pbtxt"] = _fill(
            "orchestrator.pbtxt", name=name, description=description, decoupled=decoupled,
            inputs=contract.pbtxt_io_block("input", contract.INPUTS),
            outputs=contract.pbtxt_io_block("output", contract.OUTPUTS),
            instances=opts.instances_of(name), parameters=_parameters(orchestrator_params(opts)),
        )  # fmt: skip
        out[f"{name}/1/model.py"] = _python_model("spark", "SparkOrchestratorModel")
    out[f"{VOICE_PROMPT}/config.pbtxt"] = _fill(
        "spark_voice_prompt.pbtxt", name=VOICE_PROMPT,
        inputs=contract.pbtxt_io_block("input", io.SPARK_VOICE_PROMPT_INPUTS),
        outputs=contract.pbtxt_io_block("output", io.VOICE_TOKENS),
        instances=opts.instances_of(VOICE_PROMPT), parameters=_parameters(VoicePromptParams(opts.voice_cache)),
    )  # fmt: skip
    out[f"{VOICE_PROMPT}/1/model.py"] = _python_model("spark", "SparkVoicePromptModel")
    out[f"{AUDIO_TOKENIZER}/config.pbtxt"] = _fill(
        "audio_model.pbtxt", name=AUDIO_TOKENIZER,
        description="Spark audio tokenizer (wav2vec2 + BiCodec encoder): global and semantic tokens of 16 kHz "
                    "audio; a dynamic batch runs as one masked forward.",
        max_batch=opts.audio_max_batch, max_queue_delay_us=opts.max_queue_delay_us,
        inputs=contract.pbtxt_io_block("input", io.SPARK_AUDIO_INPUTS),
        outputs=contract.pbtxt_io_block("output", io.VOICE_TOKENS),
        instance_group=instance_group(opts, AUDIO_TOKENIZER, opts.instances_of(AUDIO_TOKENIZER)),
        parameters=_parameters(AudioModelParams(spark.model_dir.resolve(), opts.device_of(AUDIO_TOKENIZER))),
    )  # fmt: skip
    out[f"{AUDIO_TOKENIZER}/1/model.py"] = _python_model("spark", "SparkAudioTokenizerModel")
    out[f"{ENGINE}/config.pbtxt"] = _fill(
        "spark_engine.pbtxt", name=ENGINE,
        inputs=contract.pbtxt_io_block("input", io.ENGINE_INPUTS),
        outputs=contract.pbtxt_io_block("output", io.ENGINE_OUTPUTS),
        parameters=_parameters(engine_params(opts)),
    )  # fmt: skip
    out[f"{ENGINE}/1/model.py"] = _python_model("spark", "SparkEngineModel")
    if spark.engine_dir is not None:
        out[f"{LLM}/config.pbtxt"] = _fill(
            "spark_llm_tensorrt_llm.pbtxt", name=LLM, max_batch=opts.max_batch, max_seq_len=spark.max_seq_len,
            inputs=contract.pbtxt_io_block("input", io.TRTLLM_INPUTS),
            outputs=contract.pbtxt_io_block("output", io.TRTLLM_OUTPUTS),
            parameters=_parameters(trtllm_parameters(opts, spark.engine_dir, spark.max_seq_len,
                                                     KV_CACHE_FREE_GPU_MEM_FRACTION)),
        )  # fmt: skip
        out[f"{LLM}/1/.keep"] = ""  # the backend needs the version directory; the engine stays in engine_dir
    return out


def orchestrator_params(opts: RenderOptions) -> SparkOrchestratorParams:
    """Parameters of both Spark pipeline models (`adapters.spark.SparkOrchestratorModel`)."""
    spark = opts.spark
    assert spark is not None
    return SparkOrchestratorParams(
        model_dir=spark.model_dir.resolve(),
        sample_rate=SAMPLE_RATE,
        max_new_tokens=spark.max_new_tokens,
        max_seq_len=spark.max_seq_len,
        max_target_text_tokens=opts.max_target_text_tokens,
        schedule=ChunkSchedule(spark.first_chunk_tokens, spark.chunk_scale, spark.max_chunk_tokens),
        voice_cache=opts.voice_cache,
        benchmark=_benchmark(spark),
        trtllm_model=LLM if spark.engine_dir is not None else None,
    )


def engine_params(opts: RenderOptions) -> SparkEngineParams:
    """Parameters of `spark_engine` (`adapters.spark.SparkEngineModel`)."""
    spark = opts.spark
    assert spark is not None
    return SparkEngineParams(
        model_dir=spark.model_dir.resolve(),
        device=opts.device_of(ENGINE),
        dtype=opts.dtype,
        max_batch=opts.max_batch,
        max_seq_len=spark.max_seq_len,
        max_waiting=opts.max_waiting,
        benchmark=_benchmark(spark),
        llm=spark.engine_dir is None,
    )


def _benchmark(spark: SparkRenderOptions) -> BenchmarkMode | None:
    return None if spark.benchmark_ratio is None else BenchmarkMode(spark.benchmark_ratio)
