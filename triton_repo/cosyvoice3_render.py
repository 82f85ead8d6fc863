"""The CosyVoice3 models of the rendered repository (`render --cosyvoice3-dir DIR`), beside CosyVoice2's.

| model | what |
|---|---|
| `cosyvoice3` / `cosyvoice3_stream` | the pipeline contract (offline / decoupled), 24 kHz `waveform` + `sample_rate` |
| `cosyvoice3_stream` (PyTorch LLM) | also the engine's process: the LLM (our batched decoder under the continuous-batching scheduler), token2wav (DiT flow + causal HiFT under the token2wav service) and the streaming orchestrator calling both directly, as CosyVoice2's colocated `cosyvoice2_stream`; `cosyvoice3` reaches the engine here over BLS |
| `cosyvoice3_voice_prompt` | the voice cache (LRU by voice id) in front of the two audio models |
| `cosyvoice3_audio_tokenizer` | `speech_tokenizer_v3.onnx`, dynamically batched |
| `cosyvoice3_speaker_embedding` | CAM++ (`campplus.onnx` of the CosyVoice3 directory), dynamically batched |
| `cosyvoice3_llm`, `cosyvoice3_engine` | with `--cosyvoice3-engine-dir` only: the LLM on the tensorrtllm backend, and token2wav alone in a python model; both entry models then orchestrate over BLS |

Every model is one of CosyVoice2's templates and adapters with CosyVoice3's parameters (the adapter factory
`ModelSpec` and the tables below). Without `--cosyvoice3-dir` nothing here is rendered and the repository is
unchanged. The layout is colocated whatever `--layout` says (as Spark-TTS's `spark_engine`).
"""

from __future__ import annotations

import json
from dataclasses import replace

from cosyvoice2.vocab import LAYOUT_FILE, LOGITS_BIAS_FILE
from cosyvoice3.config import CosyVoice3Config
from cosyvoice3.errors import CosyVoice3Error
from cosyvoice3.layout import ENGINE_FILES, FRONTEND_FILES, TOKENIZER_FILES
from speech_serving.cosyvoice3 import cosyvoice3_vocab
import pipeline_contract as contract
from triton_repo import internal_io as io
from triton_repo.model_params import (
    AudioModelParams,
    BenchmarkMode,
    CosyVoice3EngineEntryParams,
    CosyVoice3EngineParams,
    CosyVoice3OrchestratorParams,
    InternalModels,
    VoicePromptParams,
)
from triton_repo.render_options import CosyVoice3RenderOptions, RenderOptions
from triton_repo.render_templates import ModelSpec, engine_entry_spec, entry_specs, with_options
from triton_repo.render_trtllm import TrtllmFlags, trtllm_input_errors, trtllm_parameters

__all__ = ["CosyVoice3RenderOptions", "check", "model_specs", "models"]

ENGINE = io.COSYVOICE3_ENGINE_MODEL
VOICE_PROMPT = io.COSYVOICE3_VOICE_PROMPT_MODEL
AUDIO_TOKENIZER = io.COSYVOICE3_AUDIO_TOKENIZER_MODEL
SPEAKER_EMBEDDING = io.COSYVOICE3_SPEAKER_EMBEDDING_MODEL
LLM = io.COSYVOICE3_LLM_MODEL  # the TensorRT-LLM engine of the CosyVoice3 LLM (`--cosyvoice3-engine-dir`)
STREAM = contract.COSYVOICE3_STREAMING_MODEL  # the engine's process with the PyTorch LLM
MODELS = frozenset({contract.COSYVOICE3_OFFLINE_MODEL, STREAM, VOICE_PROMPT, AUDIO_TOKENIZER, SPEAKER_EMBEDDING})
SINGLE_INSTANCE = (ENGINE, LLM)  # and STREAM where it holds the engine (`check`)
TRTLLM_FLAGS = TrtllmFlags(backend="--cosyvoice3-engine-dir", engine_dir="--cosyvoice3-engine-dir",
                           llm_dir="--cosyvoice3-llm-dir", which="the CosyVoice3 engine")
#: What a served CosyVoice3 directory must hold (the engine alone could do with fewer: id-level calls only).
SERVED_FILES = (*ENGINE_FILES, *TOKENIZER_FILES, *FRONTEND_FILES)
#: The orchestrators' targets: the engine answers both the LLM's and token2wav's calls, in `cosyvoice3_stream`'s
#: process (the PyTorch LLM; beside TensorRT-LLM `orchestrator_params` names `cosyvoice3_llm` and `cosyvoice3_engine`).
INTERNAL_MODELS = InternalModels(llm_model=STREAM, token2wav_model=STREAM, token2wav_decoupled=True,
                                 llm_deliver_at=True, voice_prompt_model=VOICE_PROMPT)


def models(opts: RenderOptions) -> set[str]:
    """The CosyVoice3 models `model_specs` describes (none without `opts.cosyvoice3`), for the validation of the
    rendered repository."""
    if opts.cosyvoice3 is None:
        return set()
    return set(MODELS) | (set() if engine_in_stream(opts) else {LLM, ENGINE})


def engine_in_stream(opts: RenderOptions) -> bool:
    """Whether `cosyvoice3_stream` is the engine's process: with the PyTorch LLM (a TensorRT-LLM engine decodes
    inside tritonserver itself, beside `cosyvoice3_engine`'s token2wav)."""
    return opts.cosyvoice3 is not None and opts.cosyvoice3.engine_dir is None


def check(opts: RenderOptions) -> list[str]:
    """What the CosyVoice3 options' fields cannot say themselves (their bounds: `render_checks.field_errors`)."""
    cv3 = opts.cosyvoice3
    if cv3 is None:
        return []
    errors = []
    # serving reads text and reference audio: the engine's files, the tokenizer's and both frontend models
    missing = [name for name in SERVED_FILES if not (cv3.model_dir / name).is_file()]
    if not cv3.model_dir.is_dir():
        errors.append(f"--cosyvoice3-dir {cv3.model_dir} is not a directory (expected a CosyVoice3 model directory)")
    elif missing:
        errors.append(f"--cosyvoice3-dir {cv3.model_dir} lacks {', '.join(missing)}")
    else:
        try:
            CosyVoice3Config.from_model_dir(cv3.model_dir)
        except (CosyVoice3Error, ValueError, KeyError, TypeError) as exc:  # a malformed yaml or config.json
            errors.append(f"--cosyvoice3-dir: {exc}")
    if engine_in_stream(opts) and opts.instances_of(STREAM) != 1:
        errors.append(f"--instances {STREAM}={opts.instances_of(STREAM)}: {STREAM} holds the engine (the LLM "
                      "sequences and token2wav streams), so it runs as one instance")
    if cv3.benchmark_ratio is not None and not cv3.benchmark_ratio > 0:
        errors.append(f"--cosyvoice3-benchmark-ratio must be > 0, got {cv3.benchmark_ratio}")
    if cv3.engine_dir is not None:
        errors += trtllm_input_errors(opts, cv3.engine_dir, cv3.llm_dir, TRTLLM_FLAGS)
        if not errors:
            errors += _converted_layout_errors(cv3)
    elif cv3.llm_dir is not None:
        errors.append("--cosyvoice3-llm-dir is only used with --cosyvoice3-engine-dir")
    return errors


def _converted_layout_errors(cv3: CosyVoice3RenderOptions) -> list[str]:
    """The checkpoint the engine was built from must hold this model's merged vocabulary (the ids the orchestrators
    send): a CosyVoice2 conversion has another."""
    assert cv3.llm_dir is not None
    expected = cosyvoice3_vocab(CosyVoice3Config.from_model_dir(cv3.model_dir)).to_json()
    try:
        recorded = json.loads((cv3.llm_dir / LAYOUT_FILE).read_text())
    except (OSError, ValueError) as exc:
        return [f"--cosyvoice3-llm-dir {cv3.llm_dir}: no readable {LAYOUT_FILE} ({exc})"]
    if recorded != expected:
        return [f"--cosyvoice3-llm-dir {cv3.llm_dir} was not converted from this CosyVoice3 model (its {LAYOUT_FILE} "
                f"puts sos at {recorded.get('sos_id')}, the model's merged vocabulary at {expected['sos_id']}); "
                "convert it with python -m cosyvoice_build.cosyvoice3_trtllm"]
    return []


def model_specs(opts: RenderOptions) -> list[ModelSpec]:
    """The CosyVoice3 models (none without `opts.cosyvoice3`)."""
    cv3 = opts.cosyvoice3
    if cv3 is None:
        return []
    model_dir = cv3.model_dir.resolve()
    specs = entry_specs(
        opts, orchestrator_params(opts), ("cosyvoice3", "CosyVoice3OrchestratorModel"),
        (contract.COSYVOICE3_OFFLINE_MODEL, "CosyVoice3 offline pipeline: one response with the whole waveform of one "
                                            "segment."),
        (contract.COSYVOICE3_STREAMING_MODEL, "CosyVoice3 streaming pipeline: waveform chunks; FINAL rides on the "
                                              "last one."),
    )
    specs.append(ModelSpec(VOICE_PROMPT, "voice_prompt.pbtxt", io.VOICE_PROMPT_INPUTS, io.VOICE_PROMPT_OUTPUTS,
                           VoicePromptParams(cache_capacity=opts.voice_cache),
                           ("cosyvoice3_engine", "CosyVoice3VoicePromptModel"),
                           dict(instances=opts.instances_of(VOICE_PROMPT))))
    specs += [
        ModelSpec(name, "audio_model.pbtxt", io.AUDIO_INPUTS, (output,),
                  AudioModelParams(model_dir, opts.model_device), adapter,
                  dict(description=description, max_batch=opts.audio_max_batch,
                       max_queue_delay_us=opts.max_queue_delay_us,
                       instances=opts.instances_of(name)))
        for name, output, adapter, description in (
            (AUDIO_TOKENIZER, io.SPEECH_TOKENS, ("cosyvoice3_engine", "CosyVoice3AudioTokenizerModel"),
             "CosyVoice3 speech tokenizer (speech_tokenizer_v3.onnx), 25 Hz tokens of 16 kHz audio."),
            (SPEAKER_EMBEDDING, io.XVECTOR, ("audio_features", "SpeakerEmbeddingModel"),
             "CAM++ x-vector (CosyVoice3's campplus.onnx) of 16 kHz audio."),
        )
    ]  # fmt: skip
    if engine_in_stream(opts):
        specs = [spec for spec in specs if spec.name != STREAM]
        specs.append(engine_entry_spec(STREAM, CosyVoice3EngineEntryParams(orchestrator_params(opts),
                                                                           engine_params(opts)),
                                       ("cosyvoice3_engine", "CosyVoice3StreamModel")))
        return specs
    specs.append(ModelSpec(ENGINE, "engine.pbtxt", io.ENGINE_INPUTS, io.ENGINE_OUTPUTS, engine_params(opts),
                           ("cosyvoice3_engine", "CosyVoice3EngineModel")))
    if cv3.engine_dir is not None:  # CosyVoice2's `llm` tensors and template; the engine stays in engine_dir
        specs.append(ModelSpec(
            LLM, "llm_tensorrt_llm.pbtxt", io.LLM_INPUTS, io.LLM_OUTPUTS,
            trtllm_parameters(opts, cv3.engine_dir, opts.max_seq_len), None,
            dict(max_batch=opts.max_batch, max_seq_len=opts.max_seq_len),
        ))  # fmt: skip
    return specs


def _benchmark(cv3: CosyVoice3RenderOptions) -> BenchmarkMode | None:
    return None if cv3.benchmark_ratio is None else BenchmarkMode(cv3.benchmark_ratio)


def orchestrator_params(opts: RenderOptions) -> CosyVoice3OrchestratorParams:
    """Parameters of both CosyVoice3 pipeline models (`adapters.cosyvoice3.CosyVoice3OrchestratorModel`)."""
    cv3 = opts.cosyvoice3
    assert cv3 is not None
    trtllm = cv3.engine_dir is not None and cv3.llm_dir is not None
    return CosyVoice3OrchestratorParams(
        model_dir=cv3.model_dir.resolve(),
        max_sequence_len=opts.max_seq_len,
        max_target_text_tokens=opts.max_target_text_tokens,
        first_hop=cv3.first_hop,
        second_hop=cv3.second_hop,
        # TensorRT-LLM: the LLM calls go to cosyvoice3_llm (one response per token, no delivery schedule), token2wav's
        # to cosyvoice3_engine
        models=INTERNAL_MODELS if engine_in_stream(opts)
        else replace(INTERNAL_MODELS, llm_model=LLM, token2wav_model=ENGINE, llm_deliver_at=False),
        voice_cache=opts.voice_cache,
        benchmark=_benchmark(cv3),
        llm_logits_bias=(cv3.llm_dir / LOGITS_BIAS_FILE).resolve() if trtllm else None,
        llm_repetition_penalty=opts.repetition_penalty if trtllm else None,
        loop_guard=opts.loop_guard if trtllm else None,
    )


def engine_params(opts: RenderOptions) -> CosyVoice3EngineParams:
    """Parameters of CosyVoice3's engine (`adapters.cosyvoice3_engine`; in `cosyvoice3_stream` or, beside
    TensorRT-LLM, `cosyvoice3_engine`): the LLM's capacity and dtype are the render's (`with_options`); `flow_cache`
    and `flow_cache_gb` are CosyVoice3's own options, not CosyVoice2's of those names."""
    cv3 = opts.cosyvoice3
    assert cv3 is not None
    return with_options(CosyVoice3EngineParams, opts, model_dir=cv3.model_dir.resolve(), device=opts.model_device,
                        flow_cache=cv3.flow_cache, flow_voices=cv3.flow_voices, flow_cache_gb=cv3.flow_cache_gb,
                        first_hop=cv3.first_hop, second_hop=cv3.second_hop, benchmark=_benchmark(cv3),
                        llm=cv3.engine_dir is None)
