"""CosyVoice3's models that hold its engine or its voice front-end: `cosyvoice3_stream` (the streaming entry model
as the engine's process: the LLM, token2wav and the streaming orchestrator in one process), `cosyvoice3_engine`
(token2wav alone, beside a TensorRT-LLM engine), the voice prompt (`cosyvoice3_voice_prompt`) and speech tokenizer
(`cosyvoice3_audio_tokenizer`); its speaker embedding is CosyVoice2's `SpeakerEmbeddingModel` on CosyVoice3's
`campplus.onnx`.

Every one is CosyVoice2's adapter with CosyVoice3's parts: the engine is `EngineHandler` over an `LLMHandler` (our
batched decoder under the continuous-batching scheduler) and a `Token2WavHandler` (the token2wav service and its
scheduling policy) around `CosyVoice3BatchedToken2Wav`, hosted as CosyVoice2's colocated `cosyvoice2_stream` hosts
its own (`adapters.engine_entry`); the voice prompt is `voice_prompt`'s with CosyVoice3's audio models and its
12 kHz mel band. The tensors are CosyVoice2's (`internal_io`).
"""

from __future__ import annotations

from typing import Any

import torch

from cosyvoice2.config import resolve_dtype
from cosyvoice2.flow.memory import flow_cache_budget_bytes
from cosyvoice3.config import CosyVoice3Config
from cosyvoice3.frontend import PROMPT_MEL_FMAX
from cosyvoice3.layout import FLOW_FILE, HIFT_FILE, LLM_FILE, SPEECH_TOKENIZER_FILE
from cosyvoice3.llm import SilentTokenFilter, sampling_params
from cosyvoice3.loading import load_config, load_flow, load_hift, load_llm
from cosyvoice3.token2wav import FLOW_CACHE_MOST_GIB, CosyVoice3Token2Wav, runtime_schedule
from speech_serving.cosyvoice3 import cosyvoice3_vocab
from speech_serving.engines import CosyVoice3BatchedToken2Wav
from speech_serving.gpu_yield import Token2WavCalls
from triton_repo import internal_io as io
from triton_repo.adapters import voice_prompt
from triton_repo.adapters.audio_features import AudioTokenizerModel
from triton_repo.adapters.common import handler_model, model_params
from triton_repo.adapters.cosyvoice3 import cosyvoice3_orchestrator
from triton_repo.adapters.engine import EngineHandler
from triton_repo.adapters.engine_entry import EngineClients, EngineEntryModel
from triton_repo.adapters.llm import LLMHandler
from triton_repo.adapters.token2wav import Token2WavHandler
from triton_repo.model_params import CosyVoice3EngineEntryParams, CosyVoice3EngineParams

def engine_handler(params: CosyVoice3EngineParams) -> EngineHandler | Token2WavHandler:
    """CosyVoice3's LLM (loaded first: its CUDA graphs are captured before another thread uses the GPU) and
    token2wav from the model directory; token2wav alone when a TensorRT-LLM engine (`cosyvoice3_llm`) decodes
    (`params.llm` False: no request here is an LLM request)."""
    config = load_config(params.model_dir)
    device, dtype = torch.device(params.device), resolve_dtype(params.dtype)
    if not params.llm:
        return _token2wav(params, config, device, dtype)
    benchmark = params.benchmark is not None
    # `gpu_yield`: the LLM counts its steps beside token2wav's calls (the stage table's step beside token2wav and
    # with it idle); it never waits for them (off: CosyVoice2's lone yield is not measured with CosyVoice3)
    calls = Token2WavCalls()
    llm = LLMHandler(
        load_llm(params.model_dir / LLM_FILE, config, device, dtype), cosyvoice3_vocab(config), params,
        # benchmark mode: no stop id is drawn and every token counts (the orchestrator fixes the length)
        sampling=sampling_params(config.llm, ignore_eos=benchmark),
        token_filter=None if benchmark else lambda: SilentTokenFilter.for_config(config.llm).accept,
        yield_to=calls, yield_mode="off",
    )  # fmt: skip
    return EngineHandler(llm, _token2wav(params, config, device, dtype, calls))


def _token2wav(params: CosyVoice3EngineParams, config: CosyVoice3Config, device: torch.device,
               dtype: torch.dtype, calls: Token2WavCalls | None = None) -> Token2WavHandler:
    flow = load_flow(params.model_dir / FLOW_FILE, config, device, dtype)
    hift = load_hift(params.model_dir / HIFT_FILE, config, device)
    # the orchestrators' schedule: the flow's step-graph buckets cover its chunks (captured by Token2WavHandler)
    schedule = runtime_schedule(params.first_hop, params.second_hop, lookahead=config.flow.pre_lookahead_len)
    engine = CosyVoice3Token2Wav(flow, hift, schedule, voice_capacity=params.flow_voices,
                                 final_over_cache=params.flow_cache == "chunked")
    # left open, the budget is what the GPU leaves beside the step graphs' buffers, at most the 80 GB-class default
    engine.limit_flow_caches(flow_cache_budget_bytes(device, engine.graphs.plan(dtype).total, params.flow_cache_gb,
                                                     FLOW_CACHE_MOST_GIB))
    cached = params.flow_cache != "recompute"
    return Token2WavHandler(CosyVoice3BatchedToken2Wav(engine, cached=cached), device, calls)


CosyVoice3EngineModel = handler_model(CosyVoice3EngineParams, engine_handler)


class CosyVoice3StreamModel(EngineEntryModel):
    """`cosyvoice3_stream` with the PyTorch LLM: the engine's process, its streaming orchestrator calling the LLM's
    scheduler and token2wav's service directly; the offline `cosyvoice3` reaches the engine here over BLS."""

    def load(self, args: dict[str, str]) -> tuple[EngineHandler, Any]:
        params = CosyVoice3EngineEntryParams.from_parameters(model_params(args), args["model_name"])
        if not params.engine.llm:  # the render hosts the engine here only with the PyTorch LLM
            raise ValueError(f"{args['model_name']}: an engine without its LLM cannot host the streaming pipeline")
        engine = engine_handler(params.engine)
        assert isinstance(engine, EngineHandler)
        orchestrator = cosyvoice3_orchestrator(
            params.orchestrator, lambda vocab: EngineClients(engine, vocab, params.orchestrator.models))
        return engine, orchestrator


class CosyVoice3VoicePromptModel(voice_prompt.TritonPythonModel):
    """A voice's CosyVoice3 prompt (v3 speech tokens, CAM++ x-vector, the 24 kHz mel up to 12 kHz), cached by voice
    id apart from CosyVoice2's: the two models' prompts of one voice differ."""

    tokenizer_model = io.COSYVOICE3_AUDIO_TOKENIZER_MODEL
    speaker_model = io.COSYVOICE3_SPEAKER_EMBEDDING_MODEL
    mel_fmax = PROMPT_MEL_FMAX


class CosyVoice3AudioTokenizerModel(AudioTokenizerModel):
    tokenizer_file = SPEECH_TOKENIZER_FILE
