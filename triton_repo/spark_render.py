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

from spark_tts.engine import SAMPLE_RATE
from spark_tts.errors import SparkModelError
from spark_tts.loading import check_model_dir, read_llm_config
from spark_tts.streaming import ChunkSchedule
import pipeline_contract as contract
from triton_repo import spark_io as io
from triton_repo import trtllm_backend_facts as facts
from triton_repo.model_params import AudioModelParams, BenchmarkMode, SparkEngineParams, SparkOrchestratorParams, VoicePromptParams
from triton_repo.render_options import RenderOptions, SparkRenderOptions
from triton_repo.render_templates import ModelSpec, entry_specs
from triton_repo.render_trtllm import LOGITS_DTYPE, holds_engine, limit_errors, read_engine_config, trtllm_parameters

__all__ = ["SparkRenderOptions", "check", "model_specs", "models"]

VOICE_PROMPT = io.VOICE_PROMPT_MODEL
AUDIO_TOKENIZER = io.AUDIO_TOKENIZER_MODEL
ENGINE = io.ENGINE_MODEL
LLM = io.LLM_MODEL  # the TensorRT-LLM engine of the Spark LLM (`--spark-engine-dir`)
MODELS = frozenset(
    {contract.SPARK_OFFLINE_MODEL, contract.SPARK_STREAMING_MODEL, VOICE_PROMPT, AUDIO_TOKENIZER, ENGINE}
)
SINGLE_INSTANCE = (ENGINE, LLM)


def models(opts: RenderOptions) -> set[str]:
    """The Spark models `model_specs` describes (none without `opts.spark`), named independently of it for the
    validation of the rendered repository."""
    if opts.spark is None:
        return set()
    return set(MODELS) | ({LLM} if opts.spark.engine_dir is not None else set())


def check(opts: RenderOptions) -> list[str]:
    """What the Spark options' fields cannot say themselves (their bounds: `render_checks.field_errors`)."""
    spark = opts.spark
    if spark is None:
        return []
    errors = []
    try:
        check_model_dir(spark.model_dir)
    except SparkModelError as exc:
        errors.append(f"--spark-dir: {exc}")
    if spark.benchmark_ratio is not None and not spark.benchmark_ratio > 0:
        errors.append(f"--spark-benchmark-ratio must be > 0, got {spark.benchmark_ratio}")
    if spark.engine_dir is not None:
        errors += _check_engine(opts, spark)
    if spark.max_chunk_tokens < spark.first_chunk_tokens:
        errors.append(f"--spark-max-chunk {spark.max_chunk_tokens} is below --spark-first-chunk "
                      f"{spark.first_chunk_tokens}")
    return errors


def _check_engine(opts: RenderOptions, spark: SparkRenderOptions) -> list[str]:
    """The Spark TensorRT-LLM engine against what the Spark models send it (the same pinned facts as CosyVoice2's)."""
    assert spark.engine_dir is not None
    if opts.device != "cuda":
        return ["--spark-engine-dir needs --device cuda"]
    if not holds_engine(spark.engine_dir):
        return [f"--spark-engine-dir {spark.engine_dir} holds no TensorRT-LLM engine (config.json + rank*.engine)"]
    engine = read_engine_config(spark.engine_dir)
    errors = facts.engine_version_problems(engine, "--spark-engine-dir", spark.engine_dir)
    errors += limit_errors(engine, (("--max-batch", opts.max_batch, "max_batch_size"),
                                    ("--spark-max-seq-len", spark.max_seq_len, "max_seq_len")), "the Spark engine")
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


def model_specs(opts: RenderOptions) -> list[ModelSpec]:
    """The Spark models (none without `opts.spark`)."""
    spark = opts.spark
    if spark is None:
        return []
    specs = entry_specs(
        opts, orchestrator_params(opts), ("spark", "SparkOrchestratorModel"),
        (contract.SPARK_OFFLINE_MODEL, "Spark-TTS offline pipeline: one response, the whole 16 kHz waveform."),
        (contract.SPARK_STREAMING_MODEL, "Spark-TTS streaming pipeline: 16 kHz chunks that concatenate to the offline "
                                         "waveform; FINAL rides on the last one."),
    )
    specs += [
        ModelSpec(VOICE_PROMPT, "spark_voice_prompt.pbtxt", io.SPARK_VOICE_PROMPT_INPUTS, io.VOICE_TOKENS,
                  VoicePromptParams(opts.voice_cache), ("spark", "SparkVoicePromptModel"),
                  dict(instances=opts.instances_of(VOICE_PROMPT))),
        ModelSpec(AUDIO_TOKENIZER, "audio_model.pbtxt", io.SPARK_AUDIO_INPUTS, io.VOICE_TOKENS,
                  AudioModelParams(spark.model_dir.resolve(), opts.model_device),
                  ("spark", "SparkAudioTokenizerModel"),
                  dict(description="Spark audio tokenizer (wav2vec2 + BiCodec encoder): global and semantic tokens "
                                   "of 16 kHz audio; a dynamic batch runs as one masked forward.",
                       max_batch=opts.audio_max_batch, max_queue_delay_us=opts.max_queue_delay_us,
                       instances=opts.instances_of(AUDIO_TOKENIZER))),
        ModelSpec(ENGINE, "spark_engine.pbtxt", io.ENGINE_INPUTS, io.ENGINE_OUTPUTS, engine_params(opts),
                  ("spark", "SparkEngineModel")),
    ]  # fmt: skip
    if spark.engine_dir is not None:  # the engine stays in engine_dir
        specs.append(ModelSpec(
            LLM, "spark_llm_tensorrt_llm.pbtxt", io.TRTLLM_INPUTS, io.TRTLLM_OUTPUTS,
            trtllm_parameters(opts, spark.engine_dir, spark.max_seq_len), None,
            dict(max_batch=opts.max_batch, max_seq_len=spark.max_seq_len),
        ))  # fmt: skip
    return specs


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
        device=opts.model_device,
        dtype=opts.dtype,
        max_batch=opts.max_batch,
        max_seq_len=spark.max_seq_len,
        max_waiting=opts.max_waiting,
        benchmark=_benchmark(spark),
        llm=spark.engine_dir is None,
    )


def _benchmark(spark: SparkRenderOptions) -> BenchmarkMode | None:
    return None if spark.benchmark_ratio is None else BenchmarkMode(spark.benchmark_ratio)
