"""`audio_tokenizer` and `speaker_embedding`: the two ONNX prompt models, dynamically batched.

Requests of a batch arrive together in one `execute`; each is sliced to its `reference_wav_len`
(upstream's speaker model ignored the length and embedded the padding).
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from cosyvoice2.frontend.onnx_models import (
    CAMPPLUS_FILE,
    SPEECH_TOKENIZER_FILE,
    SpeakerEncoder,
    SpeechTokenizer,
    default_providers,
)
from speech_serving.engines import speaker_xvector, speech_tokens
import pipeline_contract as contract
from triton_repo import internal_io as io
from triton_repo.adapters.common import error_response, model_params, model_ready, read_inputs, response
from triton_repo.model_params import AudioModelParams


def _providers(device: str) -> list:
    """onnxruntime's providers for `device`; cuda:N names the GPU (the CUDA provider's own default is GPU 0)."""
    providers: list = default_providers() if device.startswith("cuda") else ["CPUExecutionProvider"]
    _, _, index = device.partition(":")
    if index and "CUDAExecutionProvider" in providers:
        providers[providers.index("CUDAExecutionProvider")] = ("CUDAExecutionProvider", {"device_id": int(index)})
    return providers


class _AudioModel:
    output: str
    compute: Callable[[Any, np.ndarray], np.ndarray]

    def execute(self, requests: list[Any]) -> list[Any]:
        responses = []
        for request in requests:
            try:
                arrays = read_inputs(request, io.AUDIO_INPUTS)
                n = int(arrays[contract.REFERENCE_WAV_LEN.name].reshape(-1)[0])
                wav = arrays[contract.REFERENCE_WAV.name].reshape(-1)[:n]
                value = self.compute(self.model, wav)
                responses.append(response({self.output: value[None]}))
            except Exception as exc:  # noqa: BLE001 - one bad request does not fail its batch
                responses.append(error_response(exc))
        return responses


class AudioTokenizerModel(_AudioModel):
    output = io.SPEECH_TOKENS.name
    compute = staticmethod(speech_tokens)
    #: the speech tokenizer in `model_dir` (CosyVoice2's v2; CosyVoice3's subclass names its v3, same interface)
    tokenizer_file = SPEECH_TOKENIZER_FILE

    def initialize(self, args: dict[str, str]) -> None:
        params = AudioModelParams.from_parameters(model_params(args), args["model_name"])
        self.model = SpeechTokenizer(params.model_dir / self.tokenizer_file, _providers(params.device))
        self.metrics = model_ready(args["model_name"])


class SpeakerEmbeddingModel(_AudioModel):
    output = io.XVECTOR.name
    compute = staticmethod(speaker_xvector)

    def initialize(self, args: dict[str, str]) -> None:
        params = AudioModelParams.from_parameters(model_params(args), args["model_name"])
        # CAM++ runs on CPU, as upstream's reference frontend does (it is small and its input is short)
        self.model = SpeakerEncoder(params.model_dir / CAMPPLUS_FILE)
        self.metrics = model_ready(args["model_name"])
