"""Serving logic of the Spark-TTS pipeline (no Triton): orchestrator, voice tokens, the colocated engine.

The pipeline contract is the same as CosyVoice2's (docs/pipeline-contract.md); what differs behind it:

- the voice prompt is Spark's: 32 global tokens and the reference's semantic tokens (``SparkVoicePrompt``),
  computed by the masked batched audio tokenizer, so a request's tokens never depend on its batch;
- the LLM prompt is one id sequence (``SparkTokenizer.prompt_ids``) decoded on our batched decoder
  (``SparkLM``) with continuous batching (``ContinuousBatchingScheduler``);
- streaming resolves the decoder's receptive field on the server: each piece is vocoded over a window with
  context on both sides and only its own samples are sent (``spark_tts.streaming.StreamPlan``), so the
  concatenated pieces equal the offline waveform and clients simply concatenate;
- the waveform is 16 kHz (``SparkEngine.sample_rate``); every chunk says so in its ``sample_rate``.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import AsyncIterator, Protocol, Sequence

import numpy as np
import torch

from speech_lm.decode import BatchedDecoder
from speech_serving.cuda_streams import LLM_STREAM_PRIORITY, TOKEN2WAV_STREAM_PRIORITY, StreamDecoder, worker_stream
from speech_serving.errors import InvalidInput
from speech_serving.io_struct import SparkLLMRequest, SparkVoicePrompt
from speech_serving.llm_scheduler import LLM_STATS, ContinuousBatchingScheduler, TokenStream
from speech_serving.orchestrator import (
    ORCHESTRATOR_STATS,
    RELEASE_TIMEOUT_S,
    FirstChunkTimes,
    accounted,
    benchmark_token_count,
    new_request_id,
)
from speech_serving.stats import Stats
from speech_serving.voice_cache import VoicePrompts
from spark_tts.audio_tokenizer import AudioTokenizer
from spark_tts.config import BiCodecConfig
from spark_tts.engine import SAMPLE_RATE as SPARK_SAMPLE_RATE
from spark_tts.errors import SparkInputError
from spark_tts.layout import BICODEC_CONFIG_FILE
from spark_tts.llm import SparkSampling, spark_request
from spark_tts.loading import check_model_dir, load_bicodec, load_llm, load_wav2vec2, read_audio_params
from spark_tts.prompt import SparkTokenizer
from spark_tts.streaming import ChunkSchedule, StreamPlan, Window, receptive_radius
import pipeline_contract as contract
from pipeline_contract import SpeechChunk, SpeechRequest

logger = logging.getLogger(__name__)

# -- configuration ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class SparkOrchestratorConfig:
    radius: int  # the decoder's receptive radius in tokens (the streaming windows' context)
    hop: int  # samples per semantic token
    schedule: ChunkSchedule = field(default_factory=ChunkSchedule)
    sampling: SparkSampling = field(default_factory=SparkSampling)
    max_sequence_len: int = 2048  # the LLM's KV capacity per sequence (prompt + generated)
    max_target_text_tokens: int = contract.MAX_SEGMENT_TOKENS
    sample_rate: int = SPARK_SAMPLE_RATE  # of the vocoded waveform, stated in every chunk
    # Benchmark mode (random weights stop at random): exactly round(ratio x target text tokens) LLM tokens, each
    # counted as one semantic code (`SparkTokenizer.benchmark_codes`); the engine must not stop early either
    # (`SparkEngine(benchmark=True)`). None: off.
    fixed_token_text_ratio: float | None = None
    voice_cache: int = 64  # voices this orchestrator keeps (a hit makes no voice-prompt call)

    def fixed_tokens(self, num_text_tokens: int) -> int | None:
        """Benchmark mode's LLM tokens for ``num_text_tokens`` target text tokens; None when off."""
        if self.fixed_token_text_ratio is None:
            return None
        return benchmark_token_count(num_text_tokens, self.fixed_token_text_ratio)

    @classmethod
    def for_model_dir(cls, model_dir: Path, **overrides: object) -> SparkOrchestratorConfig:
        bicodec = BiCodecConfig.from_yaml(model_dir / BICODEC_CONFIG_FILE)
        return cls(radius=receptive_radius(bicodec), hop=bicodec.hop_length, **overrides)  # type: ignore[arg-type]


class SparkClients(Protocol):
    async def voice_prompt(self, request: SpeechRequest) -> SparkVoicePrompt:
        """The voice's tokens from the pipeline's voice-prompt model: computed from the request's audio once per
        voice id (cached by the callee), or for an id-only request looked up there (`UnknownVoice` when it does
        not hold the voice). Called only when the orchestrator's own cache misses."""

    def llm(self, request_id: str, request: SparkLLMRequest) -> AsyncIterator[list[int]]:
        """Generated LLM ids as they are decoded (one list per delivery; ends when the sequence ends)."""

    async def llm_stop(self, request_id: str) -> None:
        """Stop a running sequence and free its slot (idempotent)."""

    async def vocode(self, global_tokens: np.ndarray, semantic_tokens: np.ndarray, emit_start: int,
                     emit_end: int) -> np.ndarray:
        """The samples of tokens ``[emit_start, emit_end)`` (indices into ``semantic_tokens``) of the waveform
        the decoder gives for all of ``semantic_tokens``."""


def delivery_points(plan: StreamPlan, max_tokens: int) -> tuple[int, ...]:
    """The token counts at which ``plan`` completes a window, assuming one semantic code per generated id
    (a non-semantic id only delays a window to the next point or the end; the plan itself is not advanced)."""
    points, emitted, size = [], 0, plan.schedule.first_chunk_tokens
    while emitted + size + plan.right_context <= max_tokens:
        points.append(emitted + size + plan.right_context)
        emitted += size
        size = plan.schedule.next_size(size)
    return tuple(points)


# -- the orchestrator ------------------------------------------------------------------------------
class SparkOrchestrator:
    def __init__(self, config: SparkOrchestratorConfig, tokenizer: SparkTokenizer, clients: SparkClients,
                 stats: Stats | None = None) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.clients = clients
        self.stats = stats or Stats(ORCHESTRATOR_STATS)
        self.voices: VoicePrompts[SparkVoicePrompt] = VoicePrompts(config.voice_cache,
                                                                   lambda r: self.clients.voice_prompt(r))

    def build_llm_request(self, request: SpeechRequest, voice: SparkVoicePrompt, streaming: bool
                          ) -> tuple[SparkLLMRequest, int]:
        """The LLM sequence and the number of text tokens it reads (transcript + target)."""
        if request.instruction:
            raise InvalidInput("spark-tts has no instruct mode: send the request without instructions")
        target_ids = self.tokenizer.encode(request.target_text)
        if len(target_ids) > self.config.max_target_text_tokens:
            raise InvalidInput(
                f"target_text has {len(target_ids)} tokens; at most {self.config.max_target_text_tokens} "
                "per segment (split longer text)")
        # An empty transcript means none: Spark's transcript-free prompt (the speaker from the global tokens)
        transcript = request.reference_text or None
        semantic = voice.semantic_tokens.tolist() if transcript is not None else ()
        prompt_ids = self.tokenizer.prompt_ids(request.target_text, voice.global_tokens.tolist(), transcript,
                                               semantic)
        room = self.config.max_sequence_len - len(prompt_ids)
        fixed = self.config.fixed_tokens(len(target_ids))
        max_new = min(self.config.sampling.max_new_tokens if fixed is None else fixed, room)
        if max_new < 1:
            raise InvalidInput(
                f"prompt ({len(prompt_ids)} tokens) leaves no room for speech within the LLM's "
                f"{self.config.max_sequence_len}-token sequence limit; use a shorter reference or text")
        seed = request.seed if request.seed is not None else int(new_request_id())
        deliver_at = delivery_points(self._plan(), max_new) if streaming else ()
        text_tokens = len(target_ids) + (len(self.tokenizer.encode(transcript)) if transcript else 0)
        return SparkLLMRequest(np.asarray(prompt_ids, dtype=np.int32), max_new, seed, deliver_at, streaming), text_tokens

    def _plan(self) -> StreamPlan:
        return StreamPlan(self.config.radius, self.config.schedule)

    async def synthesize(self, request: SpeechRequest, streaming: bool) -> AsyncIterator[SpeechChunk]:
        """Audio chunks (16 kHz) for ``request``; offline yields exactly one, streaming's last is final."""
        request_id = new_request_id()
        first = FirstChunkTimes(self.stats, streaming)  # its "audio" stage is the vocoder's window
        llm_running = False

        async def release() -> None:
            if llm_running:  # shielded and bounded, as CosyVoice2's release
                stop = asyncio.ensure_future(self.clients.llm_stop(request_id))
                try:
                    await asyncio.wait_for(asyncio.shield(stop), RELEASE_TIMEOUT_S)
                except (asyncio.TimeoutError, Exception):  # noqa: BLE001 - the request's own error wins
                    logger.warning("request %s: stopping its LLM sequence failed", request_id)

        async with accounted(self.stats, release):
            voice = await self.voices.prompt(request)
            first.mark()
            if not request.target_text:  # the contract's warm-up rule: the voice is now cached
                yield self._chunk(np.zeros(0, dtype=np.float32), 0, 0, final=True)
                return
            llm_request, input_tokens = self.build_llm_request(request, voice, streaming)
            plan = self._plan()
            codes: list[int] = []
            llm_running = True
            to_codes = (self.tokenizer.semantic_codes if self.config.fixed_token_text_ratio is None
                        else self.tokenizer.benchmark_codes)
            async for ids in self.clients.llm(request_id, llm_request):
                codes.extend(to_codes(ids))
                for window in plan.advance(len(codes)) if streaming else ():
                    yield self._chunk(await self._vocode(voice, codes, window, first), input_tokens, len(codes),
                                      final=False)
                    first.sent()
            llm_running = False
            # the rest (offline: everything) goes with FINAL; empty when the last window already covered it
            [window] = plan.finish(len(codes)) or [Window(len(codes), len(codes), len(codes), len(codes))]
            audio = (await self._vocode(voice, codes, window, first) if window.end > window.start
                     else np.zeros(0, np.float32))
            yield self._chunk(audio, input_tokens, len(codes), final=True)
            first.sent()

    def _chunk(self, audio: np.ndarray, input_tokens: int, output_tokens: int, final: bool) -> SpeechChunk:
        return SpeechChunk(audio, input_tokens, output_tokens, final=final, sample_rate=self.config.sample_rate)

    async def _vocode(self, voice: SparkVoicePrompt, codes: list[int], window: Window,
                      first: FirstChunkTimes) -> np.ndarray:
        semantic = np.asarray(codes[window.lo:window.hi], dtype=np.int32)
        first.mark()  # the first window's codes are in ... (later windows' marks are ignored)
        wave = await self.clients.vocode(voice.global_tokens, semantic, window.start - window.lo,
                                         window.end - window.lo)
        first.mark()  # ... and its audio is back
        expected = (window.end - window.start) * self.config.hop
        if wave.size != expected:
            raise RuntimeError(f"vocoder returned {wave.size} samples for {window.end - window.start} tokens")
        return wave.astype(np.float32, copy=False)


# -- the audio tokenizer (voice prompts) -----------------------------------------------------------
class SparkVoiceTokenizer:
    """Reference waveforms -> ``SparkVoicePrompt``s, a batch of any lengths in one masked forward (every
    request gets exactly its solo tokens)."""

    def __init__(self, model_dir: Path, device: str = "cpu") -> None:
        check_model_dir(model_dir)
        bicodec = load_bicodec(model_dir, device)
        self.tokenizer = AudioTokenizer(bicodec, load_wav2vec2(model_dir, device), read_audio_params(model_dir))

    def tokenize(self, wavs: Sequence[np.ndarray]) -> list[SparkVoicePrompt]:
        try:
            tokens = self.tokenizer.tokenize(list(wavs))
        except SparkInputError as exc:
            raise InvalidInput(str(exc)) from exc
        return [SparkVoicePrompt(t.global_tokens.numpy().astype(np.int32), t.semantic_tokens.numpy().astype(np.int32))
                for t in tokens]


# -- the colocated engine: LLM + vocoder in one process --------------------------------------------
@dataclass(frozen=True)
class _VocodeJob:
    global_tokens: np.ndarray
    semantic_tokens: np.ndarray
    emit_start: int
    emit_end: int
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future


class SparkEngine:
    """``SparkLM`` under the continuous-batching scheduler, and BiCodec's decoder behind a worker that vocodes
    every window waiting at the time in one masked ``detokenize`` (each equals its solo waveform)."""

    sample_rate = SPARK_SAMPLE_RATE

    def __init__(self, model_dir: Path, device: str = "cpu", llm_dtype: torch.dtype = torch.float32,
                 max_batch: int = 16, max_seq_len: int = 2048, max_waiting: int = 64, benchmark: bool = False,
                 with_llm: bool = True) -> None:
        """``benchmark``: benchmark mode for random weights; the stop id is never drawn, so every sequence runs
        to the length its orchestrator fixed (`SparkOrchestratorConfig.fixed_token_text_ratio`). ``with_llm``
        false: the LLM runs elsewhere (a TensorRT-LLM engine) and this engine only vocodes."""
        check_model_dir(model_dir)
        self.device = torch.device(device)
        self.benchmark = benchmark
        self.stats = Stats(LLM_STATS)
        self.scheduler: ContinuousBatchingScheduler | None = None
        if with_llm:
            lm = load_llm(model_dir, self.device, llm_dtype)
            # On CUDA the decoder captures its step as CUDA graphs here, before the vocoder uses the GPU.
            decoder = BatchedDecoder(lm, num_slots=max_batch, max_seq_len=max_seq_len)
            self.scheduler = ContinuousBatchingScheduler(
                StreamDecoder(decoder, worker_stream(self.device, LLM_STREAM_PRIORITY)), max_waiting, self.stats)
        self.bicodec = load_bicodec(model_dir, self.device)
        self.hop = self.bicodec.config.hop_length
        self.token_num = self.bicodec.config.speaker.token_num
        self._vocoder_stream = worker_stream(self.device, TOKEN2WAV_STREAM_PRIORITY)
        self._jobs: queue.Queue[_VocodeJob | None] = queue.Queue()
        self._thread = threading.Thread(target=self._vocode_forever, name="spark-vocoder", daemon=True)
        self._thread.start()

    # LLM ------------------------------------------------------------------------------------------
    def submit(self, request_id: str, request: SparkLLMRequest) -> TokenStream:
        if self.scheduler is None:
            raise InvalidInput("this Spark engine only vocodes: its LLM runs on TensorRT-LLM")
        sampling = SparkSampling(max_new_tokens=request.max_new_tokens)
        decode_request = spark_request(request.prompt_ids.tolist(), sampling, request.seed, ignore_eos=self.benchmark)
        return self.scheduler.submit(request_id, decode_request, request.deliver_at, streaming=request.streaming)

    def stop(self, request_id: str) -> None:
        if self.scheduler is not None:
            self.scheduler.cancel(request_id)

    # vocoder --------------------------------------------------------------------------------------
    async def vocode(self, global_tokens: np.ndarray, semantic_tokens: np.ndarray, emit_start: int,
                     emit_end: int) -> np.ndarray:
        n = int(semantic_tokens.size)
        if global_tokens.size != self.token_num:
            raise InvalidInput(f"global_tokens must hold {self.token_num} tokens, got {global_tokens.size}")
        if not 0 <= emit_start <= emit_end <= n:
            raise InvalidInput(f"emit range [{emit_start}, {emit_end}) is not within the {n} tokens sent")
        if emit_end == emit_start:
            return np.zeros(0, dtype=np.float32)
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._jobs.put(_VocodeJob(global_tokens, semantic_tokens, emit_start, emit_end, loop, future))
        return await future

    def _vocode_forever(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            jobs = [job]
            while True:  # every window waiting now shares the forward
                try:
                    more = self._jobs.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    self._jobs.put(None)
                    break
                jobs.append(more)
            try:
                waves: list[np.ndarray | BaseException] = list(self._vocode_batch(jobs))
            except Exception as exc:  # noqa: BLE001 - every waiting request gets the error
                logger.exception("Spark vocoder call failed")
                waves = [exc] * len(jobs)
            for job, wave in zip(jobs, waves):
                job.loop.call_soon_threadsafe(_settle, job.future, wave)

    @torch.inference_mode()
    def _vocode_batch(self, jobs: list[_VocodeJob]) -> list[np.ndarray]:
        device = self.device
        stream = self._vocoder_stream
        # everything on the vocoder's stream, the host-to-device copies included (nothing to wait for elsewhere)
        with torch.cuda.stream(stream) if stream is not None else nullcontext():
            lengths = torch.tensor([j.semantic_tokens.size for j in jobs], device=device)
            rows = np.zeros((len(jobs), max(j.semantic_tokens.size for j in jobs)), dtype=np.int64)
            for row, job in enumerate(jobs):
                rows[row, : job.semantic_tokens.size] = job.semantic_tokens
            semantic = torch.from_numpy(rows).to(device)
            global_ = torch.from_numpy(np.stack([j.global_tokens.astype(np.int64) for j in jobs])).to(device)
            waves = self.bicodec.detokenize(semantic, global_, lengths).float().cpu().numpy()
        hop = self.hop
        return [waves[row, job.emit_start * hop: job.emit_end * hop].copy() for row, job in enumerate(jobs)]

    def close(self) -> None:
        if self.scheduler is not None:
            self.scheduler.close()
        self._jobs.put(None)
        self._thread.join(timeout=10)


def _settle(future: asyncio.Future, value: np.ndarray | BaseException) -> None:
    if future.done():
        return
    if isinstance(value, BaseException):
        future.set_exception(value)
    else:
        future.set_result(value)
