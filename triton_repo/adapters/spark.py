"""The Spark-TTS models: `spark_tts` / `spark_tts_stream` (orchestrators), `spark_voice_prompt` (the voice cache),
`spark_audio_tokenizer` (dynamically batched, masked) and `spark_engine` (the LLM and the vocoder in one process).

Thin: the logic is `speech_serving.spark`; the internal tensors are `triton_repo.spark_io`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, AsyncIterator

import numpy as np

from cosyvoice2.config import resolve_dtype
from speech_serving.errors import InvalidInput
from speech_serving.io_struct import SparkLLMRequest, SparkVoicePrompt
from speech_serving.orchestrator import ORCHESTRATOR_STATS
from speech_serving.spark import SparkEngine, SparkOrchestrator, SparkOrchestratorConfig, SparkVoiceTokenizer
from speech_serving.stats import Stats
from speech_serving.voice_cache import CACHE_STATS, VoicePromptCache, unknown_voice
from spark_tts.llm import SparkSampling
from spark_tts.loading import read_llm_config
from spark_tts.prompt import SparkTokenizer
import pipeline_contract as contract
from triton_repo import internal_io
from triton_repo import spark_io as io
from triton_repo.adapters.common import (
    FINAL,
    PipelineEntryModel,
    bls,
    bls_one,
    bls_stream,
    error_response,
    handler_model,
    is_decoupled,
    model_params,
    model_ready,
    read_inputs,
    response,
    serve,
)
from triton_repo.model_params import AudioModelParams, SparkEngineParams, SparkOrchestratorParams, VoicePromptParams

VOICE_PROMPT_MODEL, AUDIO_TOKENIZER_MODEL, ENGINE_MODEL = io.VOICE_PROMPT_MODEL, io.AUDIO_TOKENIZER_MODEL, io.ENGINE_MODEL


# -- orchestrators ---------------------------------------------------------------------------------
class TritonSparkClients:
    """`SparkClients` over BLS calls to the Spark internal models; the LLM is `spark_engine`'s, or with
    ``trtllm`` the tensorrtllm model it names."""

    def __init__(self, trtllm: TrtllmSparkLLM | None = None) -> None:
        self.trtllm = trtllm

    async def voice_prompt(self, request: contract.SpeechRequest) -> SparkVoicePrompt:
        out = await bls(VOICE_PROMPT_MODEL, internal_io.voice_prompt_tensors(request), [s.name for s in io.VOICE_TOKENS])
        return io.voice_from_tensors(out)

    async def llm(self, request_id: str, request: SparkLLMRequest) -> AsyncIterator[list[int]]:
        if self.trtllm is not None:
            outputs = [spec.name for spec in io.TRTLLM_OUTPUTS]
            async for out in bls_stream(self.trtllm.model, self.trtllm.tensors(request), outputs, request_id):
                ids = internal_io.llm_response_ids(out)
                if ids:
                    yield ids
            return
        async for out in bls_stream(ENGINE_MODEL, io.llm_request_tensors(request), [io.OUTPUT_IDS.name], request_id):
            ids = io.llm_response_ids(out)
            if ids:
                yield ids

    async def llm_stop(self, request_id: str) -> None:
        if self.trtllm is not None:
            outputs = [spec.name for spec in io.TRTLLM_OUTPUTS]
            async for _ in bls_stream(self.trtllm.model, internal_io.llm_stop_tensors(), outputs, request_id):
                pass
            return
        async for _ in bls_stream(ENGINE_MODEL, io.llm_stop_tensors(), [io.OUTPUT_IDS.name], request_id):
            pass

    async def vocode(self, global_tokens: np.ndarray, semantic_tokens: np.ndarray, emit_start: int,
                     emit_end: int) -> np.ndarray:
        out = await bls_one(ENGINE_MODEL, io.vocode_tensors(global_tokens, semantic_tokens, emit_start, emit_end),
                            [io.WAVEFORM.name], decoupled=True)
        wave = out[io.WAVEFORM.name]
        return np.zeros(0, np.float32) if wave is None else wave.astype(np.float32).reshape(-1)


@dataclass(frozen=True)
class TrtllmSparkLLM:
    """The Spark LLM on the tensorrtllm backend: its model and what every request to it carries."""

    model: str
    eos_id: int
    sampling: SparkSampling
    stop_bias: np.ndarray | None  # benchmark mode: the stop id is never drawn

    def tensors(self, request: SparkLLMRequest) -> dict[str, np.ndarray]:
        s = self.sampling
        return io.trtllm_request_tensors(request, self.eos_id, s.top_k, s.top_p, s.temperature, self.stop_bias)


def trtllm_llm(params: SparkOrchestratorParams, tokenizer: SparkTokenizer) -> TrtllmSparkLLM | None:
    if params.trtllm_model is None:
        return None
    eos = tokenizer.vocab.eos_id
    vocab_size = read_llm_config(params.model_dir).qwen.vocab_size
    stop_bias = io.benchmark_stop_bias(vocab_size, eos) if params.benchmark else None
    return TrtllmSparkLLM(params.trtllm_model, eos, SparkSampling(max_new_tokens=params.max_new_tokens), stop_bias)


def orchestrator_config(params: SparkOrchestratorParams) -> SparkOrchestratorConfig:
    return SparkOrchestratorConfig.for_model_dir(
        params.model_dir,
        schedule=params.schedule,
        sampling=SparkSampling(max_new_tokens=params.max_new_tokens),
        max_sequence_len=params.max_seq_len,
        max_target_text_tokens=params.max_target_text_tokens,
        sample_rate=params.sample_rate,
        fixed_token_text_ratio=params.benchmark.speech_ratio if params.benchmark else None,
        voice_cache=params.voice_cache,
    )


class SparkOrchestratorModel(PipelineEntryModel):
    def initialize(self, args: dict[str, str]) -> None:
        params = SparkOrchestratorParams.from_parameters(model_params(args), args["model_name"])
        self.streaming = is_decoupled(args)
        self.stats = Stats(ORCHESTRATOR_STATS)
        tokenizer = SparkTokenizer.from_model_dir(params.model_dir)
        clients = TritonSparkClients(trtllm_llm(params, tokenizer))
        self.orchestrator = SparkOrchestrator(orchestrator_config(params), tokenizer, clients, self.stats)
        self.metrics = model_ready(args["model_name"], self.stats, self.orchestrator.voices.cache.stats)


# -- voice prompt (cache) and audio tokenizer ------------------------------------------------------
class SparkVoicePromptModel:
    """One cache for both orchestrators, keyed by voice id; a Spark voice is not a CosyVoice2 prompt, so this
    cache is its own model beside CosyVoice2's `voice_prompt`."""

    def initialize(self, args: dict[str, str]) -> None:
        params = VoicePromptParams.from_parameters(model_params(args), args["model_name"])
        self.stats = Stats(CACHE_STATS)
        self.cache: VoicePromptCache[SparkVoicePrompt] = VoicePromptCache(params.cache_capacity, self.stats)
        self.metrics = model_ready(args["model_name"], self.stats)

    def execute(self, requests: list[Any]) -> None:
        serve(requests, self._handle, cancellable=False)

    async def _handle(self, request: Any, sender: Any) -> None:
        voice_id, wav = internal_io.parse_voice_prompt(read_inputs(request, io.SPARK_VOICE_PROMPT_INPUTS))
        if wav is None:  # an id-only request: the held voice, or [unknown_voice]
            voice = await self.cache.find(voice_id, unknown_voice(voice_id))
        else:
            voice = await self.cache.get(voice_id, lambda: self._compute(wav))
        sender.send(response(io.voice_to_tensors(voice)), flags=FINAL)

    @staticmethod
    async def _compute(wav: np.ndarray) -> SparkVoicePrompt:
        out = await bls(
            AUDIO_TOKENIZER_MODEL,
            {contract.REFERENCE_WAV.name: wav.reshape(1, -1),
             contract.REFERENCE_WAV_LEN.name: np.array([[wav.size]], dtype=np.int32)},
            [spec.name for spec in io.VOICE_TOKENS],
        )
        return io.voice_from_tensors(out)


class SparkAudioTokenizerModel:
    """Every request of a dynamic batch in one masked forward: each gets exactly its solo tokens."""

    def initialize(self, args: dict[str, str]) -> None:
        params = AudioModelParams.from_parameters(model_params(args), args["model_name"])
        self.tokenizer = SparkVoiceTokenizer(params.model_dir, params.device)
        self.metrics = model_ready(args["model_name"])

    def execute(self, requests: list[Any]) -> list[Any]:
        wavs: list[np.ndarray | None] = []
        for request in requests:
            arrays = read_inputs(request, io.SPARK_AUDIO_INPUTS)
            n = int(arrays[contract.REFERENCE_WAV_LEN.name].reshape(-1)[0])
            wavs.append(arrays[contract.REFERENCE_WAV.name].reshape(-1)[:n].astype(np.float32))
        try:
            voices: list[SparkVoicePrompt | Exception] = list(self.tokenizer.tokenize(wavs))  # type: ignore[arg-type]
        except Exception:  # noqa: BLE001 - one bad request must not fail its batch: retry one by one
            voices = [self._one(wav) for wav in wavs]  # type: ignore[arg-type]
        responses = []
        for voice in voices:
            if isinstance(voice, Exception):
                responses.append(error_response(voice))
            else:
                responses.append(response({name: value[None] for name, value in io.voice_to_tensors(voice).items()}))
        return responses

    def _one(self, wav: np.ndarray) -> SparkVoicePrompt | Exception:
        try:
            return self.tokenizer.tokenize([wav])[0]
        except Exception as exc:  # noqa: BLE001 - returned as this request's error
            return exc


# -- engine ----------------------------------------------------------------------------------------
class SparkEngineHandler:
    """The Spark engine built from the model's parameters, and the answer to one LLM or vocoder request."""

    def __init__(self, params: SparkEngineParams) -> None:
        self.engine = SparkEngine(
            params.model_dir, params.device, resolve_dtype(params.dtype),
            max_batch=params.max_batch, max_seq_len=params.max_seq_len, max_waiting=params.max_waiting,
            benchmark=params.benchmark is not None, with_llm=params.llm,
        )  # fmt: skip
        self.stats = self.engine.stats

    async def handle(self, request: Any, sender: Any) -> None:
        kind = io.engine_request_kind(tensor.name() for tensor in request.inputs())
        if kind == io.VOCODER_KIND:
            global_tokens, semantic, start, end = io.parse_vocode_request(read_inputs(request, io.VOCODER_INPUTS))
            wave = await self.engine.vocode(global_tokens, semantic, start, end)
            sender.send(response({io.WAVEFORM.name: wave}), flags=FINAL)
            return
        request_id = request.request_id()
        llm_request, stop = io.parse_llm_request(read_inputs(request, io.LLM_INPUTS))
        if stop:
            self.engine.stop(request_id)
            sender.send(response(io.llm_response_tensors([])), flags=FINAL)
            return
        if not request_id:
            raise InvalidInput("LLM requests need a request id (it is how `stop` finds them)")
        assert llm_request is not None
        stream = self.engine.submit(request_id, llm_request)
        try:
            async for delivery in stream.deliveries():
                if delivery.tokens:
                    sender.send(response(io.llm_response_tensors(delivery.tokens)),
                                flags=FINAL if delivery.last else 0)
                elif delivery.last:  # the end came without a token (the stop id): nothing but the flag
                    sender.send(flags=FINAL)
        finally:
            stream.cancel()  # no-op once finished; frees the slot when the caller went away

    def close(self) -> None:
        self.engine.close()


SparkEngineModel = handler_model(SparkEngineParams, SparkEngineHandler)
