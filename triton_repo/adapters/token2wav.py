"""`token2wav`: flow + HiFT with per-request streams; concurrent chunks share batched flow forwards.

Must run as ONE instance: a stream's state lives in this process (render enforces count 1).
`Token2WavHandler` is the whole model; the colocated `engine` model hosts it next to the LLM.
The `token2wav` parameter picks the flow: `unet` (CosyVoice2's, from `model_dir`) or `dit` (the DiT flow of
Step-Audio-2-mini, from `dit_dir`); the chunk schedule is CosyVoice2's either way (the orchestrator's).
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch

from cosyvoice2.config import EngineConfig, resolve_dtype
from cosyvoice2.dit.loading import load_dit_token2wav
from cosyvoice2.flow.memory import plan_flow_memory
from cosyvoice2.flow.packed import key_bytes_per_row
from cosyvoice2.loading import FLOW_FILE, HIFT_FILE, load_flow, load_hift
from speech_serving.cuda_streams import TOKEN2WAV_STREAM_PRIORITY, StreamToken2Wav, worker_stream
from speech_serving.engines import BatchedToken2Wav, DiTBatchedToken2Wav
from speech_serving.gpu_yield import Token2WavCalls
from speech_serving.stats import Stats
from speech_serving.token2wav import TOKEN2WAV_STATS, Token2WavEngine, Token2WavService
from triton_repo import internal_io as io
from triton_repo.adapters.common import FINAL, handler_model, read_inputs, response
from triton_repo.model_params import ParameterError, Token2WavParams

logger = logging.getLogger(__name__)


def _memory_of(device: torch.device) -> str:
    """The GPU's memory as its driver reports it now, for a message."""
    if device.type != "cuda":
        return f"{device}'s memory"
    free, total = torch.cuda.mem_get_info(device)
    return f"{device}'s memory ({free / 2**30:.1f} of {total / 2**30:.1f} GiB free after the failure)"


class Token2WavHandler:
    """A token2wav engine behind the token2wav service (its worker on its own CUDA stream), and the answer to one
    request. CosyVoice2's engines come from the model's parameters (`from_params`); CosyVoice3's from its own
    (`adapters.cosyvoice3`)."""

    def __init__(self, engine: Token2WavEngine, device: torch.device, calls: Token2WavCalls | None = None) -> None:
        """`calls`: marks each engine call for the LLM scheduler of the same process (`gpu_yield`)."""
        try:
            graphs, seconds = engine.capture_graphs()  # in initialize: the model is not ready before this is done
        except torch.OutOfMemoryError as error:  # a setting too large for this GPU: no retry will heal it
            raise ParameterError(
                f"token2wav: its CUDA graphs and their buffers do not fit in {_memory_of(device)}; render with fewer "
                "--token2wav-rows (each row of the packed flow's key axis takes 504 MiB at the released size) or a "
                "smaller --flow-cache-gb, or serve from a GPU with more memory (docs/deploy.md, \"Resource needs\")"
            ) from error
        if graphs:
            logger.info("token2wav: captured %d CUDA graphs in %.1f s", graphs, seconds)
        self.stats = Stats(TOKEN2WAV_STATS)
        self.service = Token2WavService(StreamToken2Wav(engine, worker_stream(device, TOKEN2WAV_STREAM_PRIORITY)),
                                        self.stats, calls=calls)
        logger.info("token2wav: whole calls of at most %s jobs, deadline order", self.service.policy.max_rows)

    @classmethod
    def from_params(cls, params: Token2WavParams, calls: Token2WavCalls | None = None) -> Token2WavHandler:
        model_dir = params.model_dir
        device, dtype = torch.device(params.device), resolve_dtype(params.dtype)
        engine: BatchedToken2Wav | DiTBatchedToken2Wav
        if params.token2wav == "dit":
            if params.dit_dir is None:
                raise ParameterError("token2wav: token2wav=dit needs dit_dir")
            # the orchestrator cuts the chunks by CosyVoice2's schedule: the DiT step graphs' buckets cover it
            schedules = params.schedule.schedules(EngineConfig.for_model_dir(model_dir))
            engine = DiTBatchedToken2Wav(load_dit_token2wav(params.dit_dir, device, dtype), schedules=schedules)
            logger.info("token2wav: DiT flow from %s", params.dit_dir)
        else:
            config = EngineConfig.for_model_dir(model_dir)
            flow = load_flow(model_dir / FLOW_FILE, config, device, dtype)
            hift = load_hift(model_dir / HIFT_FILE, config, device)
            plan = plan_flow_memory(device, key_bytes_per_row(flow.decoder.estimator, dtype), params.token2wav_rows,
                                    params.flow_cache_gb)
            logger.info("token2wav: %s", plan.describe())
            # the orchestrator may cut a stream's chunks by any of these schedules: HiFT's graph buckets cover them
            engine = BatchedToken2Wav(
                flow, hift, config, params.schedule.schedule(config), params.flow_cache, plan.flow_cache_gib,
                schedules=params.schedule.schedules(config), max_rows=plan.rows,
            )
        return cls(engine, device, calls)

    async def handle(self, request: Any, sender: Any) -> None:
        stream_id, tokens, prompt, chunk, seed, close = io.parse_token2wav(read_inputs(request, io.TOKEN2WAV_INPUTS))
        if close:
            self.service.close_stream(stream_id)
            audio = np.zeros(0, dtype=np.float32)
        else:
            audio = await self.service.process(stream_id, tokens, prompt, chunk, seed)
        sender.send(response({io.WAVEFORM.name: audio.astype(np.float32)}), flags=FINAL)

    def close(self) -> None:
        self.service.shutdown()


TritonPythonModel = handler_model(Token2WavParams, Token2WavHandler.from_params)
