"""`llm` with the PyTorch backend: continuous batching over a static KV cache, streaming token ids.

Same tensors as the TensorRT-LLM backend's model (`internal_io.LLM_INPUTS/OUTPUTS`), including its
cancellation by a second request with `stop` set and the same request id, plus one of its own:
`deliver_at`, the token counts at which the caller needs its tokens. Every response is an IPC message to
the caller's process (and wakes it), so with `deliver_at` a streaming request gets one response per
boundary (the last one flagged final) instead of one per token; without it, one per decoded token.
`LLMHandler` is the whole model; the colocated `engine` model hosts it next to token2wav.
"""

from __future__ import annotations

from contextlib import aclosing
from typing import Any, AsyncIterator, Callable

import numpy as np
import torch

from cosyvoice2.config import EngineConfig, resolve_dtype
from cosyvoice2.llm.request import CosyVoice2Sampling
from cosyvoice2.loading import LLM_FILE, load_llm
from cosyvoice2.text.tokenizer import CosyVoice2Tokenizer
from cosyvoice2.vocab import SpeechVocabLayout
from speech_lm.decode import BatchedDecoder
from speech_serving.cuda_streams import LLM_STREAM_PRIORITY, StreamDecoder, worker_stream
from speech_serving.engines import build_decode_request, disable_stop_tokens
from speech_serving.errors import InvalidInput
from speech_serving.gpu_yield import Token2WavCalls
from speech_serving.io_struct import LLMRequest
from speech_serving.llm_scheduler import LLM_STATS, ContinuousBatchingScheduler
from speech_serving.stats import Stats
from triton_repo import internal_io as io
from triton_repo.adapters.common import FINAL, handler_model, read_inputs, response
from triton_repo.model_params import DecoderParams, LLMParams


#: A per-request filter of the decoded speech tokens (`accept(token)` -> keep it); CosyVoice3 drops long silent runs.
TokenFilter = Callable[[int], bool]


class LLMHandler:
    """A speech LLM on our batched decoder under the continuous-batching scheduler, and the answer to one LLM
    request. CosyVoice2's (`from_params`) and CosyVoice3's (`adapters.cosyvoice3`) differ only in the model, the
    flat vocabulary of their requests, the sampler and an optional filter of the decoded tokens."""

    def __init__(self, llm: torch.nn.Module, vocab: SpeechVocabLayout, params: DecoderParams,
                 sampling: CosyVoice2Sampling | None = None,
                 token_filter: Callable[[], TokenFilter] | None = None,
                 yield_to: Token2WavCalls | None = None, yield_mode: str = "lone") -> None:
        """`sampling`: the sampler each request's values go into (None: CosyVoice2's); `token_filter`: makes one
        request's filter (None: every decoded token is sent); `yield_to`: the token2wav calls of this process the
        scheduler may wait for, and `yield_mode` when (`gpu_yield`)."""
        self.vocab = vocab
        self.sampling = sampling
        self.token_filter = token_filter
        # On CUDA the decoder captures its step as CUDA graphs (one per batch/length bucket) right here.
        decoder = BatchedDecoder(llm, num_slots=params.max_batch, max_seq_len=params.max_seq_len)
        self.stats = Stats(LLM_STATS)
        self.scheduler = ContinuousBatchingScheduler(
            StreamDecoder(decoder, worker_stream(torch.device(params.device), LLM_STREAM_PRIORITY)),
            params.max_waiting, self.stats, yield_to=yield_to, yield_mode=yield_mode,
        )  # fmt: skip

    @classmethod
    def from_params(cls, params: LLMParams, yield_to: Token2WavCalls | None = None) -> LLMHandler:
        """CosyVoice2's LLM from its model directory (`yield_to`: as in the constructor)."""
        model_dir = params.model_dir
        config = EngineConfig.for_model_dir(model_dir)
        llm = load_llm(model_dir / LLM_FILE, config, torch.device(params.device), resolve_dtype(params.dtype))
        vocab = SpeechVocabLayout(len(CosyVoice2Tokenizer.from_model_dir(model_dir)), config.llm.speech_token_size)
        if params.benchmark:
            disable_stop_tokens(llm)  # benchmark mode: the orchestrator's length limit ends every sequence
        return cls(llm, vocab, params, yield_to=yield_to, yield_mode=params.llm_yield)

    async def handle(self, request: Any, sender: Any) -> None:
        request_id = request.request_id()
        llm_request, stop = io.parse_llm_request(read_inputs(request, io.PYTORCH_LLM_INPUTS))
        if stop:
            self.scheduler.cancel(request_id)
            sender.send(response(io.llm_response_tensors([])), flags=FINAL)
            return
        if not request_id:
            raise InvalidInput("LLM requests need a request id (it is how `stop` finds them)")
        async with aclosing(self.deliveries(request_id, llm_request)) as deliveries:
            async for ids, last in deliveries:
                if ids or not llm_request.streaming:  # offline: exactly one response, maybe empty
                    sender.send(response(io.llm_response_tensors(ids)), flags=FINAL if last else 0)
                elif last:  # the end came without a token (a stop id): nothing but the flag
                    sender.send(flags=FINAL)

    async def deliveries(self, request_id: str, llm_request: LLMRequest) -> AsyncIterator[tuple[list[int], bool]]:
        """(vocabulary ids, last) per hand-over of one sequence: what an LLM response carries, for the model's own
        requests and for an orchestrator in this process (`adapters.engine_entry`). Closed early (`aclosing`), it
        frees the sequence's slot."""
        decode_request = build_decode_request(
            llm_request.input_ids, self.vocab, llm_request.min_tokens, llm_request.max_tokens,
            llm_request.seed, llm_request.top_k, llm_request.top_p, self.sampling,
        )  # fmt: skip
        keep = self.token_filter() if self.token_filter is not None else None
        # not streaming: the caller reads one response, so the scheduler hands over nothing before the end
        deliver_at = llm_request.deliver_at if llm_request.streaming else ()
        stream = self.scheduler.submit(request_id, decode_request, deliver_at, streaming=llm_request.streaming)
        try:
            async for delivery in stream.deliveries():
                tokens = delivery.tokens if keep is None else [t for t in delivery.tokens if keep(t)]
                # the decoder counts speech tokens; the LLM's responses are vocabulary ids
                ids = self.vocab.to_vocab_ids(np.asarray(tokens, dtype=np.int64)).tolist() if tokens else []
                if ids or delivery.last:  # a hand-over: a response (`handle`) or an orchestrator's delivery here
                    self.stats.add("llm_responses_total")
                yield ids, delivery.last
        finally:
            stream.cancel()  # no-op once finished; frees the slot when the caller went away

    def close(self) -> None:
        self.scheduler.close()


TritonPythonModel = handler_model(LLMParams, LLMHandler.from_params)
