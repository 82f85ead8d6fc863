"""`voice_prompt`: the voice-prompt cache in front of `audio_tokenizer` and `speaker_embedding`.

One model behind every orchestrator instance (each also keeps its own cache in front of it), so each voice is
tokenized and embedded once. A request without audio only looks its voice up: the held prompt, or `[unknown_voice]`.
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np

from cosyvoice2.frontend.features import MEL_FMAX
from speech_serving.engines import prompt_tensors
from speech_serving.io_struct import PromptTensors
from speech_serving.stats import Stats
from speech_serving.voice_cache import CACHE_STATS, VoicePromptCache, unknown_voice
import pipeline_contract as contract
from triton_repo import internal_io as io
from triton_repo.adapters.common import (
    FINAL, bls, model_params, model_ready, read_inputs, response, serve,
)
from triton_repo.model_params import VoicePromptParams


class TritonPythonModel:
    """CosyVoice2's voice prompt; CosyVoice3's (`adapters.cosyvoice3`) names its own audio models and mel band."""

    tokenizer_model = "audio_tokenizer"
    speaker_model = "speaker_embedding"
    mel_fmax = MEL_FMAX  # the prompt mel's top filter edge

    def initialize(self, args: dict[str, str]) -> None:
        params = VoicePromptParams.from_parameters(model_params(args), args["model_name"])
        self.stats = Stats(CACHE_STATS)
        self.cache: VoicePromptCache[PromptTensors] = VoicePromptCache(params.cache_capacity, self.stats)
        self.metrics = model_ready(args["model_name"], self.stats)

    def execute(self, requests: list[Any]) -> None:
        serve(requests, self._handle, cancellable=False)

    async def _handle(self, request: Any, sender: Any) -> None:
        voice_id, wav = io.parse_voice_prompt(read_inputs(request, io.VOICE_PROMPT_INPUTS))
        if wav is None:
            prompt = await self.cache.find(voice_id, unknown_voice(voice_id))
        else:
            prompt = await self.cache.get(voice_id, lambda: self._compute(wav))
        sender.send(response(io.prompt_to_tensors(prompt)), flags=FINAL)

    async def _compute(self, wav: np.ndarray) -> PromptTensors:
        audio = {
            contract.REFERENCE_WAV.name: wav.reshape(1, -1).astype(np.float32),
            contract.REFERENCE_WAV_LEN.name: np.array([[wav.size]], dtype=np.int32),
        }
        tokens, xvector = await asyncio.gather(
            bls(self.tokenizer_model, audio, [io.SPEECH_TOKENS.name]),
            bls(self.speaker_model, audio, [io.XVECTOR.name]),
        )
        return await asyncio.get_running_loop().run_in_executor(
            None, prompt_tensors, tokens[io.SPEECH_TOKENS.name], xvector[io.XVECTOR.name], wav, self.mel_fmax
        )
