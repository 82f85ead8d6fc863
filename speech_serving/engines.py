"""Adapters from the engine (`cosyvoice2`) to the serving interfaces. The only torch code in this package.

* `build_decode_request` - the flat LLM inputs (TensorRT-LLM layout) -> the engine's `DecodeRequest`,
  so the PyTorch LLM model takes the same tensors as the TensorRT-LLM model.
* `disable_stop_tokens` - benchmark mode for random weights (fixed generated lengths).
* `BatchedToken2Wav` - `Token2WavEngine` over `cosyvoice2.streaming`: all jobs of a call (streaming chunks of
  any shapes, offline utterances) share the flow and HiFT forwards; caches and noise stay per stream (so a
  seeded request sounds the same whether or not it was batched).
* `DiTBatchedToken2Wav` - the same `Token2WavEngine` over the DiT token2wav (`cosyvoice2.dit`): per-voice prompt
  caches shared by the streams of a voice, all per-stream state in a `DiTStream`.
* `CosyVoice3BatchedToken2Wav` - the same `Token2WavEngine` over CosyVoice3's DiT flow + causal HiFT
  (`cosyvoice3.token2wav`): recompute or cached streams, per-voice prompt flow caches.
* `speech_tokens`, `speaker_xvector`, `prompt_tensors` - the prompt features from 16 kHz audio.
"""

from __future__ import annotations

import logging
import time

from dataclasses import dataclass, replace
from typing import Any, Callable, Sequence

import numpy as np
import torch

from cosyvoice2.config import EngineConfig
from cosyvoice2.dit.flow import PromptCache
from cosyvoice2.dit.token2wav import DiTStream, DiTToken2Wav, VoiceCaches, prompt_key
from cosyvoice2.frontend.audio import resample
from cosyvoice2.frontend.features import MEL_FMAX, MEL_SAMPLE_RATE, matcha_mel, speaker_fbank, whisper_log_mel
from cosyvoice2.frontend.onnx_models import SpeakerEncoder, SpeechTokenizer
from cosyvoice2.frontend.prompt import align_tokens_and_mel
from cosyvoice2.llm import CosyVoice2LM
from cosyvoice2.llm.request import CosyVoice2Sampling, cosyvoice2_request
from cosyvoice2.streaming import (
    Chunk, ChunkSchedule, FlowAndVocoder, FlowPrompt, Token2Wav, Token2WavStream, prompt_digest,
)
from cosyvoice3.token2wav import CosyVoice3Stream, CosyVoice3Token2Wav, VoicePrompt
from speech_serving.errors import InvalidInput
from cosyvoice2.vocab import SpeechVocabLayout
from speech_serving.io_struct import PromptTensors
from speech_serving.schedule import for_every_prompt, for_prompt
from speech_serving.token2wav import Work
from speech_lm.decode import DecodeRequest
from pipeline_contract import REFERENCE_SAMPLE_RATE

logger = logging.getLogger(__name__)

#: Jobs per token2wav call at most when the engine has no CUDA-graph buckets (the buckets' largest row count).
DEFAULT_MAX_ROWS = 16


# -- LLM -------------------------------------------------------------------------------------------
def build_decode_request(
    input_ids: np.ndarray,
    vocab: SpeechVocabLayout,
    min_tokens: int,
    max_tokens: int,
    seed: int | None,
    top_k: int,
    top_p: float,
    sampling: CosyVoice2Sampling | None = None,
) -> DecodeRequest:
    """[SOS, text ids, TASK_ID, prompt speech ids + offset] -> DecodeRequest with exactly these limits.

    `sampling`: the model's sampler the request's values go into (default: CosyVoice2's); CosyVoice3 passes its
    own, with `ignore_eos` in benchmark mode (its 200 stop ids are not masked by a head bias)."""
    ids = np.asarray(input_ids, dtype=np.int64).reshape(-1)
    if ids.size < 2 or ids[0] != vocab.sos_id:
        raise InvalidInput("LLM input_ids must start with <|sos|>")
    task_positions = np.flatnonzero(ids == vocab.task_id_id)
    if task_positions.size != 1:
        raise InvalidInput("LLM input_ids must hold exactly one <|task_id|>")
    split = int(task_positions[0])
    text, speech = ids[1:split], vocab.to_speech_tokens(ids[split + 1 :])
    if text.size == 0 or (text >= vocab.text_vocab_size).any() or (text < 0).any():
        raise InvalidInput("LLM input_ids: the text part must be non-empty text ids")
    if ((speech < 0) | (speech >= vocab.speech_token_size)).any():
        raise InvalidInput("LLM input_ids: after <|task_id|> only speech token ids may follow")
    if not 0 <= min_tokens <= max_tokens or max_tokens < 1:
        raise InvalidInput(f"LLM token limits must satisfy 0 <= min ({min_tokens}) <= max ({max_tokens}), max >= 1")
    if top_k < 1 or not 0 < top_p <= 1:
        raise InvalidInput(f"LLM sampling needs top_k >= 1 and 0 < top_p <= 1, got top_k {top_k}, top_p {top_p}")
    # The limits the orchestrator computed, as they are (the text ratios do not apply), in the model's sampler.
    sampling = replace(sampling or CosyVoice2Sampling(), top_k=top_k, top_p=top_p, seed=seed, min_tokens=min_tokens,
                       max_tokens=max_tokens)
    return cosyvoice2_request(text.tolist(), (), speech.tolist(), sampling)


@torch.no_grad()
def disable_stop_tokens(llm: CosyVoice2LM) -> None:
    """Benchmark mode of a whole deployment: the stop ids are never sampled (-inf head bias), so every sequence
    runs to the length limit its request sets. Random weights would otherwise stop at random."""
    llm.llm_decoder.bias[list(llm.config.stop_ids)] = float("-inf")


# -- token2wav -------------------------------------------------------------------------------------
def capture_or_stay_eager(what: str, capture: Callable[[], int], fall_back: Callable[[], None],
                          device: torch.device) -> int:
    """Run `capture` (it captures graphs on `device`): how many. A capture that fails is logged and `fall_back`
    leaves that part eager (it drops the graphs): graphs only save time, the server still serves."""
    try:
        with torch.inference_mode():
            count = capture()
        if count:
            torch.cuda.synchronize(device)
        return count
    except Exception:  # noqa: BLE001 - without graphs every call of that part runs eagerly
        logger.exception("token2wav: capturing %s failed; it runs eagerly", what)
        fall_back()
        return 0


def capture_hift_graphs(engine: FlowAndVocoder) -> int:
    """Capture HiFT's graphs of every bucket on HiFT's device: how many (a failed capture leaves HiFT eager)."""
    return capture_or_stay_eager("the HiFT graphs", engine.capture_hift_graphs,
                                 lambda: engine.hift.cuda_graphs.clear(), engine.hift_device)


def hift_calls(engine: FlowAndVocoder) -> tuple[int, int]:
    graphs = engine.hift.cuda_graphs
    return (graphs.replayed_calls, graphs.eager_calls) if graphs is not None else (0, 0)


#: Seconds between two readings of the CUDA allocator's statistics (`_BatchedStreams.allocator_retries`).
ALLOCATOR_READ_S = 1.0


@dataclass
class StreamState:
    prompt: FlowPrompt
    stream: Token2WavStream


class _BatchedStreams:
    """What both token2wav engines share: every job of a service batch in one `run_chunks` call of the engine
    (streaming chunks continue their stream; an offline job is a one-chunk stream); if that call fails, which
    changes no stream, each job runs alone so that only the bad one fails. Subclasses set `engine` (with
    `run_chunks` and `offline_job`) and `vocab_size`; states have `.prompt` and `.stream`."""

    engine: Any
    vocab_size: int

    def run(self, work: Sequence[Work[Any]]) -> list[np.ndarray | Exception]:
        jobs = [self._job(item) for item in work]
        ready = [job for job in jobs if not isinstance(job, Exception)]
        try:
            audio = iter(self.engine.run_chunks(ready))
            return [job if isinstance(job, Exception) else next(audio) for job in jobs]
        except Exception:  # noqa: BLE001 - a failed call changed no stream: find the bad job by running each alone
            return [job if isinstance(job, Exception) else self._run_alone(job) for job in jobs]

    def _job(self, item: Work[Any]) -> tuple[Any, Chunk] | Exception:
        try:
            tokens = item.tokens.tolist()
            if tokens and (max(tokens) >= self.vocab_size or min(tokens) < 0):  # on a GPU: a device-side assert
                raise InvalidInput(f"speech tokens must lie in 0..{self.vocab_size - 1} (the flow vocabulary)")
            if item.chunk is None:
                return self._offline_job(tokens, item.state)
            item.state.stream.extend(tokens)
            return item.state.stream, item.chunk
        except Exception as exc:  # noqa: BLE001 - returned per job, the others still run
            return exc

    def _offline_job(self, tokens: list[int], state: Any) -> tuple[Any, Chunk]:
        """A whole utterance as a one-chunk stream of the engine, its noise from the state's generator."""
        return self.engine.offline_job(tokens, state.prompt, state.stream.generator)

    _retries: tuple[float, int] = (float("-inf"), 0)  # (when read, value) of `allocator_retries`

    def allocator_retries(self) -> tuple[int]:
        """Times the CUDA caching allocator of the flow's GPU (this process) found no free block, returned its
        cached blocks to the driver and tried again: each retry synchronizes the GPU, so a run whose count climbs
        is short of GPU memory (caches, pools and batches together) and slows as a whole. Read at most once per
        `ALLOCATOR_READ_S` (`torch.cuda.memory_stats` builds a dict of every allocator statistic; the service asks
        after every call)."""
        device = self.engine.flow_device
        if device.type != "cuda":
            return (0,)
        read_at, value = self._retries
        now = time.monotonic()
        if now - read_at >= ALLOCATOR_READ_S:
            value = int(torch.cuda.memory_stats(device).get("num_alloc_retries", 0))
            self._retries = (now, value)
        return (value,)

    def _run_alone(self, job: tuple[Any, Chunk]) -> np.ndarray | Exception:
        try:
            return self.engine.run_chunks([job])[0]
        except Exception as exc:  # noqa: BLE001 - returned per job, the others still succeed
            return exc


class BatchedToken2Wav(_BatchedStreams):
    """`Token2WavEngine` for `Token2WavService`: all jobs of a service batch - streaming chunks of any shapes and
    offline utterances (one-chunk streams) - run as one `Token2Wav.run_chunks` call (one flow forward per
    attention mode, one HiFT forward). If that call fails, each job runs alone, so only the bad one fails."""

    def __init__(self, flow: torch.nn.Module, hift: torch.nn.Module, config: EngineConfig, schedule: ChunkSchedule,
                 flow_cache: str = "exact", flow_cache_gb: float | None = None,
                 schedules: Sequence[ChunkSchedule] = (), max_rows: int | None = None):
        """`schedule`: the streams' own (`open`); `schedules`: every schedule the orchestrator may cut a stream's
        chunks by (none given: `schedule`), which HiFT's graph buckets cover for every prompt length; `max_rows`:
        jobs per call at most, the largest row bucket of every CUDA graph (default: the packed solve's own)."""
        budget = None if flow_cache_gb is None else int(flow_cache_gb * 2**30)
        self.engine = Token2Wav(flow, hift, config, flow_cache=flow_cache, cache_budget_bytes=budget,
                                max_rows=max_rows)
        self.schedule = schedule  # prompt_tokens is set per stream
        self.vocab_size = config.flow.vocab_size
        self.engine.use_hift_buckets(for_every_prompt(schedules or [schedule]), self.max_rows)

    def frame_counts(self) -> tuple[int, int]:
        """(needed, computed) new frames of the flow estimator so far; computed includes the padding of each call's
        packed frame axis up to its CUDA-graph bucket."""
        cached = self.engine.cached
        return cached.frames_needed, cached.frames_computed

    def hift_calls(self) -> tuple[int, int]:
        """HiFT forwards so far: (replayed from a CUDA graph, eager: fitting no captured bucket)."""
        return hift_calls(self.engine)

    def flow_cache_refusals(self) -> tuple[int]:
        """Growths of streams' flow caches the budget refused so far (each froze one stream's caches)."""
        return (self.engine.book.refused,)

    @property
    def sample_rate(self) -> int:
        """Samples per second of the audio `run` returns."""
        return self.engine.config.sample_rate

    def capture_graphs(self) -> tuple[int, float]:
        """Capture every flow-cache step graph, encoder graph and HiFT graph now (before the server reports ready):
        (graphs, seconds). An encoder or HiFT capture that fails is logged and leaves that part eager: the server
        still serves."""
        engine = self.engine
        started = time.perf_counter()
        count = 0
        graphs = engine.cached.solve_graphs
        if engine.flow_cache != "off" and graphs is not None and engine.flow_device.type == "cuda":
            with torch.inference_mode():
                count = graphs.capture_all(engine.flow_device, engine.flow_dtype)
            torch.cuda.synchronize(engine.flow_device)
            encoder = engine.cached.encoder
            encoder_graphs = encoder.graphs
            if encoder_graphs is not None:

                def drop_encoder_graphs() -> None:  # no capture later while serving either
                    encoder_graphs.clear()
                    encoder.graphs = None

                count += capture_or_stay_eager(
                    "the flow encoder's graphs", lambda: encoder_graphs.capture_all(engine.flow_device, engine.flow_dtype),
                    drop_encoder_graphs, engine.flow_device)
        count += capture_hift_graphs(engine)
        return count, time.perf_counter() - started

    @property
    def max_rows(self) -> int:
        """Jobs per call at most (the service's cap): the largest CUDA-graph bucket of rows (more would run eagerly)."""
        return self.engine.cached.max_rows or DEFAULT_MAX_ROWS

    def open(self, prompt: PromptTensors, seed: int | None) -> StreamState:
        engine = self.engine

        def tensor(array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
            return torch.as_tensor(array).to(engine.flow_device, dtype).unsqueeze(0)

        flow_prompt = FlowPrompt(
            tensor(prompt.speech_tokens, torch.long),
            tensor(prompt.mel, engine.flow_dtype),
            tensor(prompt.embedding, engine.flow_dtype),
            prompt_digest(prompt.speech_tokens, prompt.mel, prompt.embedding),
        )
        schedule = for_prompt(self.schedule, flow_prompt.num_tokens)
        return StreamState(flow_prompt, Token2WavStream(engine, flow_prompt, schedule, engine.new_generator(seed)))


@dataclass
class DiTStreamState:
    prompt: PromptCache  # the voice's shared, read-only prompt cache (offline jobs open their own stream on it)
    stream: DiTStream


class _StepGraphStreams(_BatchedStreams):
    """The DiT flow's engines (CosyVoice2's DiT token2wav, CosyVoice3's): the flow's step graphs bound a call's
    rows. Subclasses set `engine` with `sample_rate` and `graphs`."""

    @property
    def sample_rate(self) -> int:
        """Samples per second of the audio `run` returns."""
        return self.engine.sample_rate

    @property
    def max_rows(self) -> int:
        """Jobs per call at most (the service's cap): the largest step-graph bucket of rows (more would run eagerly)."""
        return max(self.engine.graphs.buckets.rows, default=DEFAULT_MAX_ROWS)


class DiTBatchedToken2Wav(_StepGraphStreams):
    """`Token2WavEngine` over the DiT token2wav: all jobs of a service batch run as one `DiTToken2Wav.run_chunks`
    call (one batched flow call, one HiFT call); if that call fails, each job runs alone, so only the bad one fails.

    The orchestrator's chunks (`cosyvoice2.streaming.Chunk`, the UNet schedule) drive the DiT streams as they are:
    a DiT stream takes any hop >= 4 tokens with the flow's lookahead (3 tokens), and emits 960 samples per token
    in all, like the UNet token2wav. The prompt cache of a voice is computed once (`VoiceCaches`, keyed by the
    prompt's features) and shared by all its streams."""

    def __init__(self, engine: DiTToken2Wav, voice_capacity: int = 64,
                 schedules: Sequence[ChunkSchedule] = ()) -> None:
        """`schedules`: every schedule the orchestrator may cut a stream's chunks by; the graph buckets cover them
        all, for every prompt length (none given: the engine's own schedule)."""
        self.engine = engine
        self.voices = VoiceCaches(voice_capacity)
        self.vocab_size = engine.flow.config.vocab_size
        if schedules:  # else the engine's own schedule's buckets
            served = for_every_prompt(schedules)
            engine.use_graph_buckets(engine.graph_buckets(served))
            engine.use_hift_buckets(served, self.max_rows)

    def capture_graphs(self) -> tuple[int, float]:
        """Capture the DiT flow's step graphs and HiFT's graphs of every bucket now (before the server reports
        ready): (graphs, seconds). A capture that fails is logged and leaves that part eager: the server still
        serves."""
        engine = self.engine
        started = time.perf_counter()
        count = 0
        if engine.flow_device.type == "cuda":
            count = capture_or_stay_eager(
                "the DiT step graphs", lambda: engine.graphs.capture_all(engine.flow_device, engine.flow_dtype),
                engine.graphs.clear, engine.flow_device)
        count += capture_hift_graphs(engine)
        return count, time.perf_counter() - started

    def hift_calls(self) -> tuple[int, int]:
        """HiFT forwards so far: (replayed from a CUDA graph, eager: fitting no captured bucket)."""
        return hift_calls(self.engine)

    def open(self, prompt: PromptTensors, seed: int | None) -> DiTStreamState:
        engine = self.engine
        key = prompt_key(prompt.speech_tokens, prompt.mel, prompt.embedding)

        def compute() -> PromptCache:
            with torch.inference_mode():
                return engine.prompt_cache(prompt.speech_tokens, prompt.mel, prompt.embedding)

        cache = self.voices.get(key, compute)
        return DiTStreamState(cache, engine.open_stream(cache, engine.new_generator(seed)))


@dataclass
class CosyVoice3StreamState:
    prompt: VoicePrompt
    stream: CosyVoice3Stream


class CosyVoice3BatchedToken2Wav(_StepGraphStreams):
    """`Token2WavEngine` over CosyVoice3's token2wav (DiT flow + causal HiFT). The orchestrator's chunks drive the
    streams as they are (any hop, 3 lookahead tokens); `cached` streams keep their flow caches per stream and start
    from their voice's prompt cache (computed once per voice, `voice_capacity` voices kept), the others recompute
    every chunk (the reference path). The engine solves the flow of a call's cached chunks and offline jobs in one
    batch per attention mode, replayed from the flow's step graphs where the call fits their buckets (the buckets
    cover the engine's chunk schedule: the adapter gives it the orchestrators'), and vocodes the call's windows
    together where they allow (recompute streams one after another); a failed call changes no stream, so each job
    is then retried alone (`_BatchedStreams`). The seed is unused: CosyVoice3's flow and source noise come from
    fixed tables, so a request's audio depends only on its tokens and voice."""

    def __init__(self, engine: CosyVoice3Token2Wav, cached: bool) -> None:
        self.engine = engine
        self.cached = cached
        self.vocab_size = engine.flow.config.vocab_size

    def frame_counts(self) -> tuple[int, int]:
        """(needed, computed) new frames of the flow estimator so far in the batched solves of cached streams and
        offline jobs; computed includes the padding of each solve to its longest row and its graph bucket."""
        counts = self.engine.frame_counts
        return counts.needed, counts.computed

    def capture_graphs(self) -> tuple[int, float]:
        """Capture the flow's step graphs and the windowed vocoder's graphs of every bucket now, each on its own
        model's device (before the server reports ready): (graphs, seconds). A capture that fails is logged and
        leaves that part eager."""
        engine = self.engine
        if engine.flow_device.type != "cuda":
            return 0, 0.0
        # the plan first: a capture that runs out of memory still leaves it in the log
        logger.info("cosyvoice3 token2wav on %s: %s", engine.flow_device, engine.memory_plan())
        started = time.perf_counter()
        count = capture_or_stay_eager(
            "CosyVoice3's flow step graphs", lambda: engine.graphs.capture_all(engine.flow_device, engine.flow_dtype),
            engine.graphs.clear, engine.flow_device)
        vocoder = engine.vocoder_graphs
        vocoder_count = 0
        if engine.hift_device.type == "cuda":
            vocoder_count = capture_or_stay_eager("CosyVoice3's vocoder graphs",
                                                  lambda: vocoder.capture_all(engine.hift_device),
                                                  vocoder.clear, engine.hift_device)
        logger.info("cosyvoice3 token2wav: %d step graphs, %.2f GiB of static buffers; %d vocoder graphs, %.2f GiB of "
                    "static buffers; this process now has %.2f GiB allocated and %.2f GiB reserved on %s", count,
                    engine.graphs.static_bytes() / 2**30, vocoder_count, vocoder.buffer_bytes / 2**30,
                    torch.cuda.memory_allocated(engine.flow_device) / 2**30,
                    torch.cuda.memory_reserved(engine.flow_device) / 2**30, engine.flow_device)
        return count + vocoder_count, time.perf_counter() - started

    def hift_calls(self) -> tuple[int, int]:
        """Vocoder calls so far on the GPU: (replayed from a CUDA graph, eager: final calls and calls fitting no
        captured bucket)."""
        graphs = self.engine.vocoder_graphs
        return graphs.replayed_calls, graphs.eager_calls

    def open(self, prompt: PromptTensors, seed: int | None) -> CosyVoice3StreamState:
        """A stream of `prompt`'s voice; a cached one starts from the voice's prompt flow cache (computed here on
        the voice's first stream). `seed` is unused (see the class docstring)."""
        voice = VoicePrompt.from_arrays(prompt.speech_tokens, prompt.mel, prompt.embedding)
        return CosyVoice3StreamState(voice, self.engine.open_stream(voice, self.cached))

    def _offline_job(self, tokens: list[int], state: CosyVoice3StreamState) -> tuple[CosyVoice3Stream, Chunk]:
        return self.engine.offline_job(tokens, state.prompt)


# -- prompt frontend -------------------------------------------------------------------------------
@torch.inference_mode()
def speech_tokens(tokenizer: SpeechTokenizer, wav_16k: np.ndarray) -> np.ndarray:
    """(T_tok,) int32 speech tokens of 16 kHz audio."""
    return tokenizer(whisper_log_mel(torch.as_tensor(wav_16k, dtype=torch.float32)).numpy())


@torch.inference_mode()
def speaker_xvector(encoder: SpeakerEncoder, wav_16k: np.ndarray) -> np.ndarray:
    """(192,) float32 CAM++ x-vector of 16 kHz audio."""
    return encoder(speaker_fbank(torch.as_tensor(wav_16k, dtype=torch.float32)).numpy()).astype(np.float32)


@torch.inference_mode()
def prompt_tensors(tokens: np.ndarray, xvector: np.ndarray, wav_16k: np.ndarray,
                   mel_fmax: float = MEL_FMAX) -> PromptTensors:
    """Tokens + x-vector + the 24 kHz mel of the same audio -> 1:2-aligned prompt tensors
    (docs/reference/cosyvoice2.md#token-and-mel-alignment). `mel_fmax`: the mel's top filter edge (CosyVoice2's
    8 kHz; CosyVoice3 passes 12 kHz)."""
    wav_24k = resample(torch.as_tensor(wav_16k, dtype=torch.float32), REFERENCE_SAMPLE_RATE, MEL_SAMPLE_RATE)
    mel = matcha_mel(wav_24k, mel_fmax).numpy()
    tokens, mel = align_tokens_and_mel(np.asarray(tokens, dtype=np.int32).reshape(-1), mel)
    if tokens.size == 0:
        raise InvalidInput("reference audio is too short to give any speech token")
    return PromptTensors(
        np.ascontiguousarray(tokens, dtype=np.int32),
        np.ascontiguousarray(mel, dtype=np.float32),
        np.asarray(xvector, dtype=np.float32).reshape(-1),
    )
