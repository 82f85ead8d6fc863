"""`cosyvoice2` / `cosyvoice2_stream`: the pipeline entry models (one code, decoupled or not by config)."""

from __future__ import annotations

from pathlib import Path
from typing import AsyncIterator, Callable

import numpy as np
from safetensors.numpy import load_file

from cosyvoice2.config import EngineConfig
from cosyvoice2.streaming import Chunk
from cosyvoice2.text.tokenizer import CosyVoice2Tokenizer
from cosyvoice2.vocab import LOGITS_BIAS_KEY, SpeechVocabLayout
from speech_serving.io_struct import LLMRequest, PromptTensors
from speech_serving.orchestrator import (
    ORCHESTRATOR_STATS,
    Orchestrator,
    OrchestratorConfig,
    PipelineClients,
    SamplingConfig,
)
from speech_serving.stats import Stats
import pipeline_contract as contract
from triton_repo import internal_io as io
from triton_repo.model_params import InternalModels, OrchestratorParams
from triton_repo.adapters.common import (
    PipelineEntryModel,
    bls,
    bls_one,
    bls_stream,
    is_decoupled,
    model_params,
    model_ready,
)


class TritonClients:
    """`PipelineClients` over BLS calls to the repository's internal models."""

    def __init__(
        self,
        vocab: SpeechVocabLayout,
        logits_bias: np.ndarray | None,
        models: InternalModels,
        repetition_penalty: float | None = None,
        token_filter: Callable[[], Callable[[int], bool]] | None = None,
    ) -> None:
        self.vocab = vocab
        self.logits_bias = logits_bias  # TensorRT-LLM: the text-id mask + llm_decoder.bias, per request
        self.models = models
        self.repetition_penalty = repetition_penalty  # TensorRT-LLM: its stand-in for RAS
        # per request, a fresh predicate on speech tokens: False drops the token (CosyVoice3 on TensorRT-LLM: the
        # silent-token filter the PyTorch LLM's handler applies); other ids always pass
        self.token_filter = token_filter

    async def voice_prompt(self, request: contract.SpeechRequest) -> PromptTensors:
        out = await bls(self.models.voice_prompt_model, io.voice_prompt_tensors(request),
                        [spec.name for spec in io.VOICE_PROMPT_OUTPUTS])
        prompt = io.prompt_from_tensors(out)
        assert prompt is not None
        return prompt

    async def llm(self, request_id: str, request: LLMRequest) -> AsyncIterator[list[int]]:
        inputs = io.llm_request_tensors(request, self.vocab, self.logits_bias, self.repetition_penalty,
                                        self.models.llm_deliver_at)
        keep = self.token_filter() if self.token_filter is not None else None
        offset = self.vocab.speech_offset
        async for out in bls_stream(self.models.llm_model, inputs, [s.name for s in io.LLM_OUTPUTS], request_id):
            ids = io.llm_response_ids(out)
            if keep is not None:
                ids = [i for i in ids if keep(i - offset)]  # non-speech ids are no silent token: they pass
            if ids:
                yield ids

    async def llm_stop(self, request_id: str) -> None:
        outputs = [s.name for s in io.LLM_OUTPUTS]
        async for _ in bls_stream(self.models.llm_model, io.llm_stop_tensors(), outputs, request_id):
            pass

    async def token2wav(
        self, request_id: str, tokens: np.ndarray, prompt: PromptTensors | None, chunk: Chunk | None, seed: int
    ) -> np.ndarray:
        waveform = await self._token2wav_call(io.token2wav_tensors(request_id, tokens, prompt, chunk, seed))
        return np.zeros(0, np.float32) if waveform is None else waveform.astype(np.float32).reshape(-1)

    async def token2wav_close(self, request_id: str) -> None:
        await self._token2wav_call(io.token2wav_close_tensors(request_id))

    async def _token2wav_call(self, inputs: dict[str, np.ndarray]) -> np.ndarray | None:
        out = await bls_one(self.models.token2wav_model, inputs, [io.WAVEFORM.name], self.models.token2wav_decoupled)
        return out[io.WAVEFORM.name]


def read_logits_bias(path: Path | None, vocab: SpeechVocabLayout, benchmark: bool) -> np.ndarray | None:
    """TensorRT-LLM: the per-request logits bias of the converted checkpoint (None: the PyTorch LLM, which needs
    none); in benchmark mode the end ids are masked too, so that none is ever sampled."""
    if path is None:
        return None
    logits_bias = load_file(path)[LOGITS_BIAS_KEY].astype(np.float32)
    if benchmark:
        logits_bias[list(vocab.end_ids)] = -1e9
    return logits_bias


def cosyvoice2_orchestrator(params: OrchestratorParams,
                            clients: Callable[[SpeechVocabLayout, np.ndarray | None], PipelineClients]
                            ) -> Orchestrator:  # fmt: skip
    """CosyVoice2's orchestrator of a pipeline entry model as its parameters say; `clients(vocab, logits_bias)`
    makes what it calls (`TritonClients`: BLS; `adapters.engine_entry`: the engine in the same process)."""
    engine = EngineConfig.for_model_dir(params.model_dir)
    tokenizer = CosyVoice2Tokenizer.from_model_dir(params.model_dir)
    vocab = SpeechVocabLayout(text_vocab_size=len(tokenizer), speech_token_size=engine.llm.speech_token_size)
    benchmark = params.benchmark
    config = OrchestratorConfig(
        vocab=vocab,
        schedule=params.schedule.schedule(engine),
        lone_schedule=params.schedule.lone_schedule(engine),
        light_schedule=params.schedule.light_schedule(engine),
        busy_streams=params.schedule.busy_streams,
        sampling=SamplingConfig(fixed_token_text_ratio=benchmark.speech_ratio if benchmark else None),
        max_sequence_len=params.max_sequence_len,
        max_target_text_tokens=params.max_target_text_tokens,
        loop_guard=None if benchmark else params.loop_guard,  # TensorRT-LLM only (the PyTorch LLM runs RAS)
        voice_cache=params.voice_cache,
    )
    logits_bias = read_logits_bias(params.llm_logits_bias, vocab, benchmark is not None)
    return Orchestrator(config, tokenizer, clients(vocab, logits_bias), Stats(ORCHESTRATOR_STATS))


class TritonPythonModel(PipelineEntryModel):
    def initialize(self, args: dict[str, str]) -> None:
        params = OrchestratorParams.from_parameters(model_params(args), args["model_name"])
        self.streaming = is_decoupled(args)
        self.orchestrator = cosyvoice2_orchestrator(
            params, lambda vocab, bias: TritonClients(vocab, bias, params.models, params.llm_repetition_penalty))
        self.metrics = model_ready(args["model_name"], self.orchestrator.stats, self.orchestrator.voices.cache.stats)
