"""`cosyvoice2` / `cosyvoice2_stream`: the pipeline entry models (one code, decoupled or not by config)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator, Mapping

import numpy as np
from safetensors.numpy import load_file

from cosyvoice2.config import EngineConfig
from cosyvoice2.streaming import Chunk
from cosyvoice2.text.tokenizer import CosyVoice2Tokenizer
from cosyvoice2.vocab import LOGITS_BIAS_KEY, SpeechVocabLayout
from cosyvoice2_serving.orchestrator import (
    ORCHESTRATOR_STATS,
    LLMRequest,
    Orchestrator,
    OrchestratorConfig,
    PromptTensors,
    SamplingConfig,
    SynthesisRequest,
    parse_request,
    stream_schedule,
)
from cosyvoice2_serving.repetition import LoopGuardConfig
from cosyvoice2_serving.stats import Stats
from triton_repo import contract
from triton_repo import internal_io as io
from triton_repo.adapters.common import (
    FINAL,
    MetricsExporter,
    bls,
    bls_one,
    bls_stream,
    is_decoupled,
    model_params,
    read_inputs,
    release_bls_streams,
    response,
    serve,
)


@dataclass(frozen=True)
class InternalModels:
    """Which models answer the LLM and token2wav calls (rendered per layout: `engine` when colocated), and
    whether the LLM takes a delivery schedule (`deliver_at`: the PyTorch LLM; TensorRT-LLM streams per token)."""

    llm: str
    token2wav: str
    token2wav_decoupled: bool
    llm_deliver_at: bool = False

    @classmethod
    def from_params(cls, params: Mapping[str, str]) -> InternalModels:
        return cls(
            params["llm_model"], params["token2wav_model"], params["token2wav_decoupled"] == "true",
            params.get("llm_deliver_at") == "true",
        )  # fmt: skip


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

    async def voice_prompt(self, request: SynthesisRequest) -> PromptTensors:
        out = await bls(
            "voice_prompt",
            {
                contract.REFERENCE_WAV.name: request.reference_wav,
                contract.REFERENCE_WAV_LEN.name: np.array([request.reference_wav.size], dtype=np.int32),
                contract.VOICE_ID.name: np.array([request.voice_id.encode()], dtype=np.object_),
            },
            [spec.name for spec in io.VOICE_PROMPT_OUTPUTS],
        )
        prompt = io.prompt_from_tensors(out)
        assert prompt is not None
        return prompt

    async def llm(self, request_id: str, request: LLMRequest) -> AsyncIterator[list[int]]:
        inputs = io.llm_request_tensors(request, self.vocab, self.logits_bias, self.repetition_penalty,
                                        self.models.llm_deliver_at)
        async for out in bls_stream(self.models.llm, inputs, [s.name for s in io.LLM_OUTPUTS], request_id):
            ids = io.llm_response_ids(out)
            if ids:
                yield ids

    async def llm_stop(self, request_id: str) -> None:
        outputs = [s.name for s in io.LLM_OUTPUTS]
        async for _ in bls_stream(self.models.llm, io.llm_stop_tensors(), outputs, request_id):
            pass

    async def token2wav(
        self, request_id: str, tokens: np.ndarray, prompt: PromptTensors | None, chunk: Chunk | None, seed: int
    ) -> np.ndarray:
        waveform = await self._token2wav_call(io.token2wav_tensors(request_id, tokens, prompt, chunk, seed))
        return np.zeros(0, np.float32) if waveform is None else waveform.astype(np.float32).reshape(-1)

    async def token2wav_close(self, request_id: str) -> None:
        await self._token2wav_call(io.token2wav_close_tensors(request_id))

    async def _token2wav_call(self, inputs: dict[str, np.ndarray]) -> np.ndarray | None:
        models = self.models
        out = await bls_one(models.token2wav, inputs, [io.WAVEFORM.name], models.token2wav_decoupled)
        return out[io.WAVEFORM.name]


def trtllm_loop_guard(params: Mapping[str, str]) -> LoopGuardConfig | None:
    """The loop guard the render step configured (TensorRT-LLM only: the PyTorch LLM runs RAS)."""
    if not params.get("loop_max_run"):
        return None
    return LoopGuardConfig(
        max_run=int(params["loop_max_run"]),
        max_period=int(params["loop_max_period"]),
        max_cycle_tokens=int(params["loop_max_cycle_tokens"]),
    )


class TritonPythonModel:
    def initialize(self, args: dict[str, str]) -> None:
        params = model_params(args)
        model_dir = Path(params["model_dir"])
        engine = EngineConfig.for_model_dir(model_dir)
        tokenizer = CosyVoice2Tokenizer.from_model_dir(model_dir)
        vocab = SpeechVocabLayout(text_vocab_size=len(tokenizer), speech_token_size=engine.llm.speech_token_size)
        schedule = stream_schedule(engine.schedule(0), int(params["first_hop"]), int(params["chunk_growth"]))
        benchmark_ratio = float(params["benchmark_speech_ratio"]) if params.get("benchmark_speech_ratio") else None
        loop_guard = trtllm_loop_guard(params) if benchmark_ratio is None else None
        config = OrchestratorConfig(
            vocab=vocab,
            schedule=schedule,
            sampling=SamplingConfig(fixed_token_text_ratio=benchmark_ratio),
            max_sequence_len=int(params["max_sequence_len"]),
            max_target_text_tokens=int(params["max_target_text_tokens"]),
            loop_guard=loop_guard,
        )
        logits_bias = None
        if params.get("llm_logits_bias"):
            logits_bias = load_file(params["llm_logits_bias"])[LOGITS_BIAS_KEY].astype(np.float32)
            if benchmark_ratio is not None:  # TensorRT-LLM: keep the stop ids from being sampled at all
                logits_bias[list(vocab.end_ids)] = -1e9
        self.streaming = is_decoupled(args)
        self.stats = Stats(ORCHESTRATOR_STATS)
        self.metrics = MetricsExporter(args["model_name"], self.stats)
        penalty = float(params["llm_repetition_penalty"]) if params.get("llm_repetition_penalty") else None
        clients = TritonClients(vocab, logits_bias, InternalModels.from_params(params), penalty)
        self.orchestrator = Orchestrator(config, tokenizer, clients, self.stats)

    async def execute(self, requests: list[Any]) -> None:
        serve(requests, self._handle)

    async def _handle(self, request: Any, sender: Any) -> None:
        synthesis = parse_request(read_inputs(request, contract.INPUTS), self.orchestrator.config)
        async for chunk in self.orchestrator.synthesize(synthesis, self.streaming):
            out = response(
                {
                    contract.WAVEFORM.name: chunk.waveform.astype(np.float32),
                    contract.INPUT_TOKENS.name: np.array([chunk.input_tokens], dtype=np.int32),
                    contract.OUTPUT_TOKENS.name: np.array([chunk.output_tokens], dtype=np.int32),
                    contract.SAMPLE_RATE.name: np.array([contract.OUTPUT_SAMPLE_RATE], dtype=np.int32),
                }
            )
            # FINAL rides on the last data response (the grpc.aio client cannot ask for an empty one)
            sender.send(out, flags=FINAL if chunk.final else 0)

    def finalize(self) -> None:
        release_bls_streams()
