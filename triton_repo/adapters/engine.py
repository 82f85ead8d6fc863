"""The colocated layout's engine: the PyTorch LLM and token2wav in ONE process (`engine_entry` hosts it).

Two models would be two processes, two CUDA contexts that the GPU time-slices; in one process the
LLM scheduler's and token2wav's worker threads run their kernels concurrently on their own CUDA
streams (token2wav's with the higher priority, `speech_serving.cuda_streams`). A request is an
LLM request or a token2wav request by its inputs (`internal_io.engine_request_kind`); each is answered
exactly as the separate `llm` / `token2wav` models answer it (token2wav: one response, flagged final).
"""

from __future__ import annotations

from typing import Any

from speech_serving.gpu_yield import Token2WavCalls
from triton_repo import internal_io as io
from triton_repo.adapters.llm import LLMHandler
from triton_repo.adapters.token2wav import Token2WavHandler
from triton_repo.model_params import EngineParams


class EngineHandler:
    """The LLM's and token2wav's handlers in one process; each request goes to the one its inputs name."""

    def __init__(self, llm: LLMHandler, token2wav: Token2WavHandler) -> None:
        self.llm = llm
        self.token2wav = token2wav
        self.stats = (self.llm.stats, self.token2wav.stats)

    @classmethod
    def from_params(cls, params: EngineParams) -> EngineHandler:
        """CosyVoice2's LLM and token2wav (CosyVoice3's: `adapters.cosyvoice3`). The LLM first: its CUDA graphs are
        captured while no other thread uses the GPU yet."""
        calls = Token2WavCalls()  # `gpu_yield`: the LLM counts its steps beside token2wav's calls, and waits for a
        # running one as llm_yield says (off: never)
        llm = LLMHandler.from_params(params.llm, yield_to=calls)
        return cls(llm, Token2WavHandler.from_params(params.token2wav, calls))

    async def handle(self, request: Any, sender: Any) -> None:
        kind = io.engine_request_kind(tensor.name() for tensor in request.inputs())
        handler = self.llm if kind == io.LLM_KIND else self.token2wav
        await handler.handle(request, sender)

    def close(self) -> None:
        self.llm.close()
        self.token2wav.close()

