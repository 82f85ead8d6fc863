"""`cosyvoice3` (and `cosyvoice3_stream` beside a TensorRT-LLM engine): CosyVoice3's orchestrating entry models
(one code, decoupled or not by config).

CosyVoice2's orchestrator machinery (`TritonClients`, `PipelineEntryModel`) with `CosyVoice3Orchestrator`: its BLS
calls go to CosyVoice3's internal models (`cosyvoice3_voice_prompt`, and the LLM and token2wav where the rendered
`InternalModels` name them: `cosyvoice3_stream`, the engine's process, or `cosyvoice3_engine` and
`cosyvoice3_llm` beside TensorRT-LLM). Torch-free, like CosyVoice2's entry models: the models that hold the engine
are in `adapters.cosyvoice3_engine`.
"""

from __future__ import annotations

from typing import Callable

from cosyvoice2.vocab import SpeechVocabLayout
from cosyvoice3.config import CosyVoice3Config
from cosyvoice3.silence import SilentTokenFilter
from cosyvoice3.text import CosyVoice3Tokenizer
from speech_serving.cosyvoice3 import CosyVoice3Orchestrator, cosyvoice3_schedule, cosyvoice3_vocab
from speech_serving.orchestrator import ORCHESTRATOR_STATS, OrchestratorConfig, PipelineClients, SamplingConfig
from speech_serving.stats import Stats
from triton_repo.adapters.common import PipelineEntryModel, is_decoupled, model_params, model_ready
from triton_repo.adapters.orchestrator import TritonClients, read_logits_bias
from triton_repo.model_params import CosyVoice3OrchestratorParams


def orchestrator_config(params: CosyVoice3OrchestratorParams, config: CosyVoice3Config) -> OrchestratorConfig:
    """The orchestrator's settings: CosyVoice3's vocabulary, schedule and sampler, the rendered limits."""
    sampling = config.llm.sampling
    benchmark = params.benchmark
    return OrchestratorConfig(
        vocab=cosyvoice3_vocab(config),
        schedule=cosyvoice3_schedule(config, params.first_hop, params.second_hop),
        sampling=SamplingConfig(top_k=sampling.top_k, top_p=sampling.top_p,
                                fixed_token_text_ratio=benchmark.speech_ratio if benchmark else None),
        max_sequence_len=params.max_sequence_len,
        max_target_text_tokens=params.max_target_text_tokens,
        loop_guard=None if benchmark else params.loop_guard,  # TensorRT-LLM only (the PyTorch LLM runs RAS)
        voice_cache=params.voice_cache,
    )  # fmt: skip


def cosyvoice3_orchestrator(
    params: CosyVoice3OrchestratorParams,
    clients: Callable[[SpeechVocabLayout], PipelineClients] | None = None,
) -> CosyVoice3Orchestrator:
    """CosyVoice3's orchestrator of a pipeline entry model as its parameters say; `clients(vocab)` makes what it
    calls (`adapters.engine_entry.EngineClients`: the engine in the same process), by default `TritonClients`
    (BLS to the rendered internal models)."""
    config = CosyVoice3Config.from_model_dir(params.model_dir)
    settings = orchestrator_config(params, config)
    vocab = settings.vocab
    if clients is None:
        logits_bias = read_logits_bias(params.llm_logits_bias, vocab, params.benchmark is not None)
        # TensorRT-LLM: the silent-token filter the PyTorch LLM's handler applies runs here (not in benchmark
        # mode, where every generated token counts)
        trtllm_filter = logits_bias is not None and params.benchmark is None
        made: PipelineClients = TritonClients(
            vocab, logits_bias, params.models, params.llm_repetition_penalty,
            (lambda: SilentTokenFilter.for_config(config.llm).accept) if trtllm_filter else None)
    else:
        made = clients(vocab)
    tokenizer = CosyVoice3Tokenizer.from_model_dir(params.model_dir)
    return CosyVoice3Orchestrator(settings, tokenizer, made, Stats(ORCHESTRATOR_STATS))


class CosyVoice3OrchestratorModel(PipelineEntryModel):
    """`cosyvoice3`, and `cosyvoice3_stream` where a TensorRT-LLM engine decodes (with the PyTorch LLM the
    streaming entry model is the engine's process: `adapters.cosyvoice3_engine.CosyVoice3StreamModel`)."""

    def initialize(self, args: dict[str, str]) -> None:
        params = CosyVoice3OrchestratorParams.from_parameters(model_params(args), args["model_name"])
        self.streaming = is_decoupled(args)
        self.orchestrator = cosyvoice3_orchestrator(params)
        self.metrics = model_ready(args["model_name"], self.orchestrator.stats, self.orchestrator.voices.cache.stats)
