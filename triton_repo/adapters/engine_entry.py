"""`cosyvoice2_stream` (colocated layout) and `cosyvoice3_stream`: the streaming entry model is the engine's own
process.

The streaming orchestrator lives beside the LLM scheduler and token2wav service it drives (`adapters.engine`) and
calls them directly, so a chunk crosses python-backend IPC once, to the client. Orchestrating from a process of its
own cost three BLS messages more per chunk (the LLM's hand-over of its tokens, the token2wav request, the audio's
way back), each waking the other process's stub, and a response that waits for another stub to take it in (the
path the four-replica freeze was caught in, docs/experiments/2026-11-28-replica-freeze-cause.md); on one H200 that
layout kept 16 real-time streams where this one keeps 32 (docs/experiments/2026-12-01-h200-in-engine.md). The
voice prompt stays a BLS call (once per voice: the orchestrator caches it), and the offline entry model reaches
this engine over BLS: requests carrying the LLM's or token2wav's tensors are answered as the separate `llm` /
`token2wav` models answer them.
"""

from __future__ import annotations

from contextlib import aclosing
from dataclasses import replace
from typing import Any, AsyncIterator

import numpy as np

from cosyvoice2.streaming import Chunk
from cosyvoice2.vocab import SpeechVocabLayout
from speech_serving.io_struct import LLMRequest, PromptTensors
import pipeline_contract as contract
from triton_repo import internal_io as io
from triton_repo.adapters.common import (
    PipelineEntryModel,
    model_params,
    model_ready,
    serve,
    within_stall_timeout,
)
from triton_repo.adapters.engine import EngineHandler
from triton_repo.adapters.orchestrator import TritonClients, cosyvoice2_orchestrator
from triton_repo.model_params import EngineEntryParams, InternalModels

#: The engine's inputs that no client request carries (seed is both a client's and token2wav's): one of them makes a
#: request the engine's, anything else is a client's (refused by the contract's codec when it is no good).
_ENGINE_ONLY = frozenset(spec.name for spec in io.ENGINE_INPUTS) - {spec.name for spec in contract.INPUTS}


def is_client_request(request: Any) -> bool:
    return not any(tensor.name() in _ENGINE_ONLY for tensor in request.inputs())


class EngineClients(TritonClients):
    """`PipelineClients` of an orchestrator in the engine's process: the LLM's scheduler and token2wav's service
    called directly, the voice prompt over BLS (`TritonClients`)."""

    def __init__(self, engine: EngineHandler, vocab: SpeechVocabLayout, models: InternalModels) -> None:
        super().__init__(vocab, None, models)
        self.engine = engine

    async def llm(self, request_id: str, request: LLMRequest) -> AsyncIterator[list[int]]:
        if not self.models.llm_deliver_at:  # `llm_delivery=token`: every token as it comes, as over BLS
            request = replace(request, deliver_at=None)
        async with aclosing(self.engine.llm.deliveries(request_id, request)) as deliveries:
            while True:
                try:
                    ids, _ = await within_stall_timeout(f"{self.models.llm_model} (LLM)", anext(deliveries))
                except StopAsyncIteration:
                    return
                if ids:
                    yield ids

    async def llm_stop(self, request_id: str) -> None:
        self.engine.llm.scheduler.cancel(request_id)

    async def token2wav(
        self, request_id: str, tokens: np.ndarray, prompt: PromptTensors | None, chunk: Chunk | None, seed: int
    ) -> np.ndarray:
        audio = await within_stall_timeout(f"{self.models.token2wav_model} (token2wav)",
                                           self.engine.token2wav.service.process(request_id, tokens, prompt, chunk,
                                                                                 seed))
        return np.asarray(audio, dtype=np.float32).reshape(-1)

    async def token2wav_close(self, request_id: str) -> None:
        self.engine.token2wav.service.close_stream(request_id)


class EngineEntryModel(PipelineEntryModel):
    """A streaming entry model that hosts its pipeline's engine (CosyVoice2's colocated `cosyvoice2_stream`,
    CosyVoice3's `cosyvoice3_stream`): a client's request is orchestrated here over `EngineClients`, a request
    carrying the LLM's or token2wav's tensors (the offline entry model's BLS calls) is answered by the engine.
    A subclass's `load` builds the engine and the orchestrator from the model's arguments."""

    streaming = True

    def load(self, args: dict[str, str]) -> tuple[EngineHandler, Any]:
        raise NotImplementedError

    def initialize(self, args: dict[str, str]) -> None:
        self.engine, self.orchestrator = self.load(args)
        self.metrics = model_ready(args["model_name"], self.orchestrator.stats,
                                   self.orchestrator.voices.cache.stats, *self.engine.stats)

    def execute(self, requests: list[Any]) -> None:
        # a client's request is cancelled when the client leaves; the engine's are stopped by their callers
        kinds: dict[bool, list[Any]] = {True: [], False: []}
        for request in requests:
            kinds[is_client_request(request)].append(request)
        if kinds[True]:
            serve(kinds[True], self._handle, cancellable=True)
        if kinds[False]:
            serve(kinds[False], self.engine.handle, cancellable=False)

    def finalize(self) -> None:
        super().finalize()
        self.engine.close()


class TritonPythonModel(EngineEntryModel):
    """CosyVoice2's `cosyvoice2_stream` in the colocated layout."""

    def load(self, args: dict[str, str]) -> tuple[EngineHandler, Any]:
        params = EngineEntryParams.from_parameters(model_params(args), args["model_name"])
        engine = EngineHandler.from_params(params.engine)
        orchestrator = cosyvoice2_orchestrator(
            params.orchestrator, lambda vocab, _: EngineClients(engine, vocab, params.orchestrator.models))
        return engine, orchestrator
