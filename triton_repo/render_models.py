"""The models of the rendered repository: CosyVoice2's table of `ModelSpec`s (per layout), Spark-TTS's and
CosyVoice3's beside them (`spark_render`, `cosyvoice3_render`), every model's typed parameters, and the record of
the options (`MARKER`).

`render_files` is pure: options in, relative path -> content out (it reads only the templates and an engine's
`config.json`); checking the options first and writing the files is `triton_repo.render`'s.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from cosyvoice2.vocab import LOGITS_BIAS_FILE
from speech_serving.schedule import StreamScheduleParams
import pipeline_contract as contract
from triton_repo import internal_io as io
from triton_repo import cosyvoice3_render, spark_render
from triton_repo.model_params import (
    AudioModelParams,
    BenchmarkMode,
    EngineEntryParams,
    EngineParams,
    InternalModels,
    LLMParams,
    OrchestratorParams,
    Token2WavParams,
    VoicePromptParams,
)
from triton_repo.render_options import RenderOptions
from triton_repo.render_templates import ModelSpec, engine_entry_spec, entry_specs, model_files, with_options
from triton_repo.render_trtllm import trtllm_parameters

MARKER = ".cosyvoice2-render.json"  # options of the render; also marks the directory as ours
TOKEN2WAV_MODEL = "token2wav"
#: Models that must run as exactly one instance (per-request state in their process).
SINGLE_INSTANCE = ("llm", TOKEN2WAV_MODEL, *spark_render.SINGLE_INSTANCE,
                   *cosyvoice3_render.SINGLE_INSTANCE)


def render_files(opts: RenderOptions) -> dict[str, str]:
    """Relative path -> file content of the whole repository (no I/O besides reading templates and the engine's
    config.json)."""
    files = model_files(model_specs(opts) + spark_render.model_specs(opts) + cosyvoice3_render.model_specs(opts))
    files[MARKER] = json.dumps(_options_record(opts), indent=1, sort_keys=True) + "\n"
    return files


def model_specs(opts: RenderOptions) -> list[ModelSpec]:
    """CosyVoice2's models: both pipeline models, the voice front-end, then the LLM and token2wav of the layout
    (colocated: the streaming pipeline model is the engine's process)."""
    specs = entry_specs(
        opts, orchestrator_params(opts), ("orchestrator", "TritonPythonModel"),
        (contract.OFFLINE_MODEL, "Offline pipeline: one response with the whole waveform of one segment."),
        (contract.STREAMING_MODEL, "Streaming pipeline: waveform chunks; FINAL rides on the last one."),
    )
    if opts.layout == "colocated":
        specs = [spec for spec in specs if spec.name != contract.STREAMING_MODEL]
    specs.append(ModelSpec("voice_prompt", "voice_prompt.pbtxt", io.VOICE_PROMPT_INPUTS, io.VOICE_PROMPT_OUTPUTS,
                           VoicePromptParams(cache_capacity=opts.voice_cache), ("voice_prompt", "TritonPythonModel"),
                           dict(instances=opts.instances_of("voice_prompt"))))
    specs += [
        ModelSpec(name, "audio_model.pbtxt", io.AUDIO_INPUTS, (output,),
                  AudioModelParams(opts.model_dir.resolve(), opts.model_device), ("audio_features", cls),
                  dict(description=description, max_batch=opts.audio_max_batch,
                       max_queue_delay_us=opts.max_queue_delay_us, instances=opts.instances_of(name)))
        for name, output, cls, description in (
            ("audio_tokenizer", io.SPEECH_TOKENS, "AudioTokenizerModel", "Speech tokenizer (ONNX), 25 Hz tokens of 16 kHz audio."),
            ("speaker_embedding", io.XVECTOR, "SpeakerEmbeddingModel", "CAM++ x-vector (ONNX) of 16 kHz audio."),
        )
    ]  # fmt: skip
    if opts.layout == "colocated":
        specs.append(engine_entry_spec(contract.STREAMING_MODEL,
                                       EngineEntryParams(orchestrator_params(opts), engine_params(opts)),
                                       ("engine_entry", "TritonPythonModel")))
        return specs
    specs.append(_llm_spec(opts))
    specs.append(ModelSpec(TOKEN2WAV_MODEL, "token2wav.pbtxt", io.TOKEN2WAV_INPUTS, (io.WAVEFORM,),
                           token2wav_params(opts), ("token2wav", "TritonPythonModel")))
    return specs


def engine_params(opts: RenderOptions) -> EngineParams:
    return EngineParams(llm_params(opts), token2wav_params(opts))


def _llm_spec(opts: RenderOptions) -> ModelSpec:
    """The separate `llm` model (the single layout) of either backend."""
    limits = dict(max_batch=opts.max_batch, max_seq_len=opts.max_seq_len)
    if opts.llm_backend == "pytorch":
        return ModelSpec("llm", "llm_pytorch.pbtxt", io.PYTORCH_LLM_INPUTS, io.LLM_OUTPUTS, llm_params(opts),
                         ("llm", "TritonPythonModel"), limits)
    return ModelSpec("llm", "llm_tensorrt_llm.pbtxt", io.LLM_INPUTS, io.LLM_OUTPUTS,
                     trtllm_parameters(opts, opts.engine_dir, opts.max_seq_len), None, limits)


def expected_models(opts: RenderOptions) -> set[str]:
    internal = set() if opts.layout == "colocated" else {"llm", TOKEN2WAV_MODEL}  # colocated: the entry model
    frontend = {contract.OFFLINE_MODEL, contract.STREAMING_MODEL, "voice_prompt", "audio_tokenizer", "speaker_embedding"}
    return frontend | internal | spark_render.models(opts) | cosyvoice3_render.models(opts)


def internal_models(opts: RenderOptions) -> InternalModels:
    """The orchestrator's targets for its LLM and token2wav calls."""
    colocated = opts.layout == "colocated"
    return InternalModels(
        llm_model=contract.STREAMING_MODEL if colocated else "llm",
        token2wav_model=contract.STREAMING_MODEL if colocated else TOKEN2WAV_MODEL,
        token2wav_decoupled=colocated,
        llm_deliver_at=opts.llm_delivery == "chunk",
    )


def _benchmark(opts: RenderOptions) -> BenchmarkMode | None:
    return None if opts.benchmark_speech_ratio is None else BenchmarkMode(opts.benchmark_speech_ratio)


def _schedule(opts: RenderOptions) -> StreamScheduleParams:
    return StreamScheduleParams(first_hop=opts.first_hop, chunk_growth=opts.chunk_growth,
                                align_first_hop=opts.align_first_hop, busy_streams=opts.busy_streams,
                                lone_first_hop=None if opts.lone_first_hop is None else min(opts.lone_first_hop,
                                                                                            opts.first_hop))


def orchestrator_params(opts: RenderOptions) -> OrchestratorParams:
    """Parameters of both pipeline models (`adapters.orchestrator`)."""
    trtllm = opts.llm_backend == "tensorrt_llm"
    return OrchestratorParams(
        model_dir=opts.model_dir.resolve(),
        llm_backend=opts.llm_backend,
        max_sequence_len=opts.max_seq_len,
        max_target_text_tokens=opts.max_target_text_tokens,
        schedule=_schedule(opts),
        models=internal_models(opts),
        voice_cache=opts.voice_cache,
        benchmark=_benchmark(opts),
        llm_logits_bias=(opts.llm_dir / LOGITS_BIAS_FILE).resolve() if trtllm and opts.llm_dir else None,
        llm_repetition_penalty=opts.repetition_penalty if trtllm else None,
        loop_guard=opts.loop_guard if trtllm else None,
    )


def llm_params(opts: RenderOptions) -> LLMParams:
    """Parameters of the PyTorch LLM (`adapters.llm.LLMHandler`): dtype, max_batch, max_seq_len, max_waiting."""
    return with_options(LLMParams, opts, model_dir=opts.model_dir.resolve(), device=opts.model_device,
                         benchmark=_benchmark(opts))


def token2wav_params(opts: RenderOptions) -> Token2WavParams:
    """Parameters of token2wav (`adapters.token2wav.Token2WavHandler`, also hosted by the colocated engine):
    dtype, token2wav and flow_cache* as rendered."""
    return with_options(
        Token2WavParams, opts,
        model_dir=opts.model_dir.resolve(),
        device=opts.model_device,
        schedule=_schedule(opts),
        dit_dir=opts.dit_dir.resolve() if opts.dit_dir is not None else None,
    )  # fmt: skip


def _options_record(opts: RenderOptions) -> dict[str, object]:
    record = asdict(opts)
    record.pop("out")
    record = {k: (str(Path(v).resolve()) if isinstance(v, Path) else v) for k, v in record.items()}
    for part in ("spark", "cosyvoice3"):  # the optional models' own options
        if record[part] is not None:
            record[part] = {k: (str(Path(v).resolve()) if isinstance(v, Path) else v) for k, v in record[part].items()}
    return record
