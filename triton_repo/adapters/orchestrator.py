"""`cosyvoice2` / `cosyvoice2_stream`: the pipeline entry models (one code, decoupled or not by config)."""

from __future__ import annotations

import secrets
from typing import AsyncIterator

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
    SamplingConfig,
)
from speech_serving.replicas import StickyRouter
from speech_serving.stats import Stats
import pipeline_contract as contract
from triton_repo import internal_io as io
from triton_repo.model_params import InternalModels, OrchestratorParams
from triton_repo.adapters.common import (
    MetricsExporter,
    PipelineEntryModel,
    bls,
    bls_one,
    bls_stream,
    is_decoupled,
    model_params,
)


class TritonClients:
    """`PipelineClients` over BLS calls to the repository's internal models."""

    def __init__(
        self,
        vocab: SpeechVocabLayout,
        logits_bias: np.ndarray | None,
        models: InternalModels,
        repetition_penalty: float | None = None,
    ) -> None:
        self.vocab = vocab
        self.logits_bias = logits_bias  # TensorRT-LLM: the text-id mask + llm_decoder.bias, per request
        self.models = models
        self.repetition_penalty = repetition_penalty  # TensorRT-LLM: its stand-in for RAS
        # Each token2wav call of a request goes to the replica holding its stream (Triton would spread them).
        # Every orchestrator process routes on its own: a random start keeps their first requests apart.
        replicas = models.token2wav_model
        self.token2wav_router = StickyRouter(replicas, start=secrets.randbelow(len(replicas)))

    async def voice_prompt(self, request: contract.SpeechRequest) -> PromptTensors:
        out = await bls(self.models.voice_prompt_model, io.voice_prompt_tensors(request),
                        [spec.name for spec in io.VOICE_PROMPT_OUTPUTS])
        prompt = io.prompt_from_tensors(out)
        assert prompt is not None
        return prompt

    async def llm(self, request_id: str, request: LLMRequest) -> AsyncIterator[list[int]]:
        inputs = io.llm_request_tensors(request, self.vocab, self.logits_bias, self.repetition_penalty,
                                        self.models.llm_deliver_at)
        async for out in bls_stream(self.models.llm_model, inputs, [s.name for s in io.LLM_OUTPUTS], request_id):
            ids = io.llm_response_ids(out)
            if ids:
                yield ids

    async def llm_stop(self, request_id: str) -> None:
        outputs = [s.name for s in io.LLM_OUTPUTS]
        async for _ in bls_stream(self.models.llm_model, io.llm_stop_tensors(), outputs, request_id):
            pass

    async def token2wav(
        self, request_id: str, tokens: np.ndarray, prompt: PromptTensors | None, chunk: Chunk | None, seed: int
    ) -> np.ndarray:
        replica = self.token2wav_router.route(request_id)
        try:
            waveform = await self._token2wav_call(replica, io.token2wav_tensors(request_id, tokens, prompt, chunk, seed))
        finally:
            if chunk is None or chunk.final:  # offline or the last chunk: the replica keeps nothing of it
                self.token2wav_router.release(request_id)
        return np.zeros(0, np.float32) if waveform is None else waveform.astype(np.float32).reshape(-1)

    async def token2wav_close(self, request_id: str) -> None:
        replica = self.token2wav_router.owner(request_id) or self.token2wav_router.route(request_id)
        try:
            await self._token2wav_call(replica, io.token2wav_close_tensors(request_id))
        finally:
            self.token2wav_router.release(request_id)

    async def _token2wav_call(self, replica: str, inputs: dict[str, np.ndarray]) -> np.ndarray | None:
        out = await bls_one(replica, inputs, [io.WAVEFORM.name], self.models.token2wav_decoupled)
        return out[io.WAVEFORM.name]


class TritonPythonModel(PipelineEntryModel):
    def initialize(self, args: dict[str, str]) -> None:
        params = OrchestratorParams.from_parameters(model_params(args), args["model_name"])
        engine = EngineConfig.for_model_dir(params.model_dir)
        tokenizer = CosyVoice2Tokenizer.from_model_dir(params.model_dir)
        vocab = SpeechVocabLayout(text_vocab_size=len(tokenizer), speech_token_size=engine.llm.speech_token_size)
        benchmark = params.benchmark
        config = OrchestratorConfig(
            vocab=vocab,
            schedule=params.schedule.schedule(engine),
            lone_schedule=params.schedule.lone_schedule(engine),
            sampling=SamplingConfig(fixed_token_text_ratio=benchmark.speech_ratio if benchmark else None),
            max_sequence_len=params.max_sequence_len,
            max_target_text_tokens=params.max_target_text_tokens,
            loop_guard=None if benchmark else params.loop_guard,  # TensorRT-LLM only (the PyTorch LLM runs RAS)
            voice_cache=params.voice_cache,
        )
        logits_bias = None
        if params.llm_logits_bias is not None:
            logits_bias = load_file(params.llm_logits_bias)[LOGITS_BIAS_KEY].astype(np.float32)
            if benchmark:  # TensorRT-LLM: keep the stop ids from being sampled at all
                logits_bias[list(vocab.end_ids)] = -1e9
        self.streaming = is_decoupled(args)
        self.stats = Stats(ORCHESTRATOR_STATS)
        clients = TritonClients(vocab, logits_bias, params.models, params.llm_repetition_penalty)
        self.orchestrator = Orchestrator(config, tokenizer, clients, self.stats)
        self.metrics = MetricsExporter(args["model_name"], self.stats, self.orchestrator.voices.cache.stats)
