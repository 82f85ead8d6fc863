"""`voice_prompt`: the voice-prompt cache in front of `audio_tokenizer` and `speaker_embedding`.

One model (not one cache per orchestrator instance), so each voice is tokenized and embedded once.
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np

from cosyvoice2_serving.engines import prompt_tensors
from cosyvoice2_serving.io_struct import PromptTensors
from cosyvoice2_serving.stats import Stats
from cosyvoice2_serving.voice_cache import CACHE_STATS, VoicePromptCache
import pipeline_contract as contract
from triton_repo import internal_io as io
from triton_repo.adapters.common import FINAL, MetricsExporter, bls, model_params, read_inputs, response, serve
from triton_repo.model_params import VoicePromptParams


class TritonPythonModel:
    def initialize(self, args: dict[str, str]) -> None:
        params = VoicePromptParams.from_parameters(model_params(args), args["model_name"])
        self.stats = Stats(CACHE_STATS)
        self.metrics = MetricsExporter(args["model_name"], self.stats)
        self.cache: VoicePromptCache[PromptTensors] = VoicePromptCache(params.cache_capacity, self.stats)

    async def execute(self, requests: list[Any]) -> None:
        serve(requests, self._handle)

    async def _handle(self, request: Any, sender: Any) -> None:
        arrays = read_inputs(request, io.VOICE_PROMPT_INPUTS)
        wav = arrays[contract.REFERENCE_WAV.name].reshape(-1)[
            : int(arrays[contract.REFERENCE_WAV_LEN.name].reshape(-1)[0])
        ]
        raw_id = arrays[contract.VOICE_ID.name].reshape(-1)[0]
        voice_id = raw_id.decode() if isinstance(raw_id, bytes) else str(raw_id)
        prompt = await self.cache.get(voice_id, lambda: self._compute(wav))
        sender.send(response(io.prompt_to_tensors(prompt)), flags=FINAL)

    async def _compute(self, wav: np.ndarray) -> PromptTensors:
        audio = {
            contract.REFERENCE_WAV.name: wav.reshape(1, -1).astype(np.float32),
            contract.REFERENCE_WAV_LEN.name: np.array([[wav.size]], dtype=np.int32),
        }
        tokens, xvector = await asyncio.gather(
            bls("audio_tokenizer", audio, [io.SPEECH_TOKENS.name]),
            bls("speaker_embedding", audio, [io.XVECTOR.name]),
        )
        return await asyncio.get_running_loop().run_in_executor(
            None, prompt_tensors, tokens[io.SPEECH_TOKENS.name], xvector[io.XVECTOR.name], wav
        )
