"""The per-request state machine of the pipeline, written against small client protocols.

One request: validate -> voice prompt (cached per voice id, here and in the voice-prompt model) -> LLM token
stream -> token2wav in the chunks of the streaming schedule (or once, offline) -> audio chunks with cumulative
token usage.

Every request gets a server-generated id (never the client's: upstream's empty client ids made
concurrent streams share state). Whatever ends a request - completion, an error, or cancellation -
the `finally` path stops its LLM sequence and closes its token2wav stream if they are still open,
so no per-request state outlives the request anywhere in the pipeline.

A streaming request's way to its first response is timed stage by stage (`FirstChunkTimes`): voice prompt, the
LLM's tokens of the first chunk, its audio, sending it; the LLM scheduler and the token2wav service break the
middle two down further (docs/PERFORMANCE.md#what-is-measured).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable, Mapping, Protocol

import numpy as np

from cosyvoice2.frontend.llm_prompt import llm_prompt
from cosyvoice2.llm import sampling_defaults as defaults
from cosyvoice2.vocab import SpeechVocabLayout

from cosyvoice2.streaming import Chunk, ChunkSchedule
from speech_serving.errors import InvalidInput
from speech_serving.io_struct import LLMRequest, PromptTensors
from speech_serving.repetition import LoopGuardConfig
from speech_serving.schedule import for_prompt
from speech_serving.stats import Stats
from speech_serving.voice_cache import VoicePrompts
import pipeline_contract as contract
from pipeline_contract import SpeechChunk, SpeechRequest

logger = logging.getLogger(__name__)

RELEASE_TIMEOUT_S = 10.0

ORCHESTRATOR_STATS = (
    "orchestrator_active_requests",
    "orchestrator_requests_total",
    "orchestrator_cancelled_total",
    "orchestrator_failed_total",
    "orchestrator_loops_cut_total",
)

#: Summed over the streaming requests whose first audio chunk was sent (a request cancelled or failed before that,
#: or one without audio, is not counted): the stages of the way to the first response, laid end to end, so that
#: their sum is the request's first-chunk time inside the pipeline. Divide by `orchestrator_first_chunks_total`.
FIRST_CHUNK_STATS = (
    "orchestrator_first_chunks_total",
    "orchestrator_first_chunk_prompt_seconds_total",  # the request's arrival -> its voice prompt is ready
    "orchestrator_first_chunk_tokens_seconds_total",  # -> the LLM's tokens of the first chunk are in
    "orchestrator_first_chunk_audio_seconds_total",  # -> token2wav's audio of it is back
    "orchestrator_first_chunk_send_seconds_total",  # -> its response is sent
)
ORCHESTRATOR_STATS += FIRST_CHUNK_STATS


@dataclass(frozen=True)
class SamplingConfig:
    """CosyVoice2's decoding defaults (docs/reference/cosyvoice2.md#ras-sampling); temperature 1 as in the reference."""

    top_k: int = defaults.TOP_K
    top_p: float = defaults.TOP_P
    temperature: float = defaults.TEMPERATURE
    min_token_text_ratio: float = defaults.MIN_TOKEN_TEXT_RATIO
    max_token_text_ratio: float = defaults.MAX_TOKEN_TEXT_RATIO
    # Benchmark mode (random weights stop at random): exactly round(ratio x target text tokens) speech tokens.
    fixed_token_text_ratio: float | None = None

    def token_limits(self, num_text_tokens: int) -> tuple[int, int]:
        """(min, max) speech tokens for `num_text_tokens` target text tokens."""
        if self.fixed_token_text_ratio is not None:
            fixed = benchmark_token_count(num_text_tokens, self.fixed_token_text_ratio)
            return fixed, fixed
        return int(num_text_tokens * self.min_token_text_ratio), int(num_text_tokens * self.max_token_text_ratio)


def benchmark_token_count(num_text_tokens: int, ratio: float) -> int:
    """Benchmark mode's generated length for a target text (CosyVoice2's and Spark-TTS's alike): round(ratio x
    text tokens), at least one."""
    return max(1, round(num_text_tokens * ratio))


@dataclass(frozen=True)
class OrchestratorConfig:
    vocab: SpeechVocabLayout
    schedule: ChunkSchedule = field(default_factory=ChunkSchedule)  # prompt_tokens is set per request
    #: the schedule of a stream that starts while no other request runs in this orchestrator (None: `schedule`)
    lone_schedule: ChunkSchedule | None = None
    #: the schedule of a stream that starts while fewer than `busy_streams` requests run here, itself counted
    #: (None: `schedule`); `schedule` is then the busy streams' (`StreamScheduleParams.busy_streams`)
    light_schedule: ChunkSchedule | None = None
    busy_streams: int = 2
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    max_sequence_len: int = 4096  # the LLM's KV capacity per sequence (prompt + generated)
    max_target_text_tokens: int = contract.MAX_SEGMENT_TOKENS
    loop_guard: LoopGuardConfig | None = None  # for LLM backends without RAS (TensorRT-LLM): speech_serving.repetition
    voice_cache: int = 64  # voice prompts this orchestrator keeps (a hit makes no voice-prompt call)


# -- the clients the orchestrator drives ----------------------------------------------------------
class PipelineClients(Protocol):
    async def voice_prompt(self, request: SpeechRequest) -> PromptTensors:
        """The voice's prompt tensors from the pipeline's voice-prompt model: computed from the request's audio
        once per voice id (cached by the callee), or for an id-only request looked up there (`UnknownVoice` when
        it does not hold the voice). Called only when the orchestrator's own cache misses."""

    def llm(self, request_id: str, request: LLMRequest) -> AsyncIterator[list[int]]:
        """Generated LLM ids as they are decoded (one list per response; ends when the sequence ends)."""

    async def llm_stop(self, request_id: str) -> None:
        """Stop a running sequence and free its slot (idempotent)."""

    async def token2wav(
        self, request_id: str, tokens: np.ndarray, prompt: PromptTensors | None, chunk: Chunk | None, seed: int
    ) -> np.ndarray:
        """Audio for the next chunk of stream `request_id`.

        `tokens` are the speech tokens not sent before; `prompt` is given on the first call only
        (it opens the stream; `seed` seeds the vocoder's source noise).
        `chunk` is the schedule's chunk this call completes; None means offline: `tokens` are all
        tokens and the whole utterance is synthesized at once without keeping state.
        """

    async def token2wav_close(self, request_id: str) -> None:
        """Drop stream `request_id` (idempotent)."""


class TextTokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...


# -- input parsing ---------------------------------------------------------------------------------
def parse_request(arrays: Mapping[str, np.ndarray | None]) -> SpeechRequest:
    """The contract inputs (numpy arrays by tensor name), decoded by the contract's codec; a violation is
    `InvalidInput` (tagged for the gateway)."""
    try:
        return contract.decode_request(arrays)
    except contract.ContractViolation as exc:
        raise InvalidInput(str(exc)) from exc


def new_request_id() -> str:
    """A fresh numeric id (the TensorRT-LLM backend maps request ids to uint64)."""
    return str(secrets.randbits(63))


# -- the state machine -----------------------------------------------------------------------------
class FirstChunkTimes:
    """One streaming request's way to its first response (`FIRST_CHUNK_STATS`), on the monotonic clock.

    Created when the request arrives; `mark` ends a stage (voice prompt ready, first chunk's tokens in, its audio
    back: calls beyond the third are ignored, so a caller may mark around every audio call); `sent` after the first
    response counts the request if all three stages were marked, and ends the timing either way.
    """

    __slots__ = ("_stats", "_marks")
    STAGES = FIRST_CHUNK_STATS[1:]

    def __init__(self, stats: Stats, streaming: bool = True) -> None:
        self._stats = stats
        self._marks: list[float] | None = [time.monotonic()] if streaming else None

    def mark(self) -> None:
        if self._marks is not None and len(self._marks) < len(self.STAGES):
            self._marks.append(time.monotonic())

    def sent(self) -> None:
        marks, self._marks = self._marks, None
        if marks is None or len(marks) < len(self.STAGES):
            return  # not streaming, already counted, or a first response without audio
        marks.append(time.monotonic())
        deltas = {name: marks[i + 1] - marks[i] for i, name in enumerate(self.STAGES)}
        self._stats.add_all({FIRST_CHUNK_STATS[0]: 1, **deltas})


class Orchestrator:
    def __init__(
        self,
        config: OrchestratorConfig,
        tokenizer: TextTokenizer,
        clients: PipelineClients,
        stats: Stats | None = None,
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.clients = clients
        self.stats = stats or Stats(ORCHESTRATOR_STATS)
        self.voices: VoicePrompts[PromptTensors] = VoicePrompts(
            config.voice_cache, lambda request: self.clients.voice_prompt(request)
        )

    def target_ids(self, request: SpeechRequest) -> list[int]:
        """The target text's ids, within the segment limit (`InvalidInput` beyond it)."""
        target_ids = self.tokenizer.encode(request.target_text)
        if len(target_ids) > self.config.max_target_text_tokens:
            raise InvalidInput(
                f"target_text has {len(target_ids)} tokens; at most {self.config.max_target_text_tokens} "
                "per segment (split longer text)"
            )
        return target_ids

    def llm_texts(self, request: SpeechRequest, prompt: PromptTensors) -> tuple[list[int], list[int], np.ndarray]:
        """(prompt text ids, text ids, prompt speech ids) of the request's voice mode (zero-shot, cross-lingual,
        instruct; `llm_prompt`); the length limits count the text ids. A model with other LLM texts overrides this."""
        mode_prompt = llm_prompt(request.reference_text, request.instruction)
        prompt_ids = self.tokenizer.encode(mode_prompt.text) if mode_prompt.text else []
        speech = prompt.speech_tokens if mode_prompt.speech_tokens else np.zeros(0, dtype=np.int32)
        return prompt_ids, self.target_ids(request), self.config.vocab.to_vocab_ids(speech)

    def build_llm_request(
        self, request: SpeechRequest, prompt: PromptTensors, streaming: bool, schedule: ChunkSchedule | None = None
    ) -> tuple[LLMRequest, int]:
        """The LLM sequence for `request` and the number of text tokens it reads: [SOS, prompt text ids, text ids,
        TASK_ID, prompt speech ids] (`llm_texts`)."""
        vocab, sampling = self.config.vocab, self.config.sampling
        prompt_ids, text_ids, speech_ids = self.llm_texts(request, prompt)
        input_ids = np.concatenate(
            [
                np.array([vocab.sos_id, *prompt_ids, *text_ids, vocab.task_id_id], dtype=np.int32),
                np.asarray(speech_ids, dtype=np.int32),
            ]
        )
        min_tokens, max_tokens = sampling.token_limits(len(text_ids))
        room = self.config.max_sequence_len - input_ids.size
        max_tokens = min(max_tokens, room)
        if max_tokens < max(min_tokens, 1):
            raise InvalidInput(
                f"prompt ({input_ids.size} tokens) leaves no room for speech within the LLM's "
                f"{self.config.max_sequence_len}-token sequence limit; use a shorter reference or text"
            )
        seed = request.seed if request.seed is not None else secrets.randbits(63)
        llm_request = LLMRequest(
            input_ids=input_ids,
            min_tokens=min_tokens,
            max_tokens=max_tokens,
            seed=seed,
            top_k=sampling.top_k,
            top_p=sampling.top_p,
            temperature=sampling.temperature,
            streaming=streaming,
            deliver_at=tuple((schedule or self.schedule(prompt)).boundaries(max_tokens)) if streaming else (),
        )
        return llm_request, len(prompt_ids) + len(text_ids)

    def schedule(self, prompt: PromptTensors, running: int | None = None) -> ChunkSchedule:
        """The streaming schedule of a request with `prompt` that starts while `running` requests run here, itself
        counted (None: the busy streams'): a lone stream's, a lightly loaded one's or the busy one's
        (`OrchestratorConfig`), its first hop aligned to the prompt's tokens where that schedule pads it."""
        config = self.config
        base = config.schedule
        if running is not None and running < config.busy_streams:
            quiet = config.lone_schedule if running <= 1 else None
            base = quiet or config.light_schedule or base
        return for_prompt(base, int(prompt.speech_tokens.size))

    async def synthesize(self, request: SpeechRequest, streaming: bool) -> AsyncIterator[SpeechChunk]:
        """Audio chunks for `request`; offline (streaming=False) yields exactly one chunk."""
        request_id = new_request_id()
        first = FirstChunkTimes(self.stats, streaming)
        run = _Run(request_id, self.clients, first)
        async with accounted(self.stats, run.release):
            prompt = await self.voices.prompt(request)
            first.mark()
            if not request.target_text:
                # Contract: empty target text only computes and caches the voice prompt (voice upload
                # warms the cache this way): one response, no audio, zero tokens.
                yield SpeechChunk(np.zeros(0, dtype=np.float32), 0, 0, final=True)
                return
            # the requests of this orchestrator running now, this one counted
            schedule = self.schedule(prompt, running=int(self.stats.get("orchestrator_active_requests")))
            llm_request, input_tokens = self.build_llm_request(request, prompt, streaming, schedule)
            tokens: list[int] = []
            sent = 0  # tokens already handed to token2wav
            start, index = 0, 0  # the streaming schedule's position
            run.llm_running = True
            guard = self.config.loop_guard.start() if self.config.loop_guard else None
            async for ids in self.clients.llm(request_id, llm_request):
                speech, ended = self._speech_tokens(ids)
                if guard is not None and (cut := guard.feed(speech)) is not None:
                    speech, ended = speech[:cut], True  # a token loop: end the utterance where it closed
                    self.stats.add("orchestrator_loops_cut_total")
                tokens.extend(speech)
                while streaming and (chunk := schedule.next_chunk(start, index, len(tokens), finished=False)):
                    audio = await run.token2wav(tokens[sent : chunk.feed], prompt, chunk, llm_request.seed)
                    sent, start, index = chunk.feed, chunk.stop, index + 1
                    yield SpeechChunk(audio, input_tokens, len(tokens), final=False)
                    first.sent()
                if ended:
                    break  # an end id: the utterance is complete (release() stops the sequence if it runs on)
            else:
                run.llm_running = False
            if not tokens:
                audio = np.zeros(0, dtype=np.float32)
            elif streaming:
                final = schedule.next_chunk(start, index, len(tokens), finished=True)
                assert final is not None and final.final  # every due non-final chunk ran in the loop
                audio = await run.token2wav(tokens[sent:], prompt, final, llm_request.seed)
            else:
                audio = await run.token2wav(tokens, prompt, None, llm_request.seed)
            yield SpeechChunk(audio, input_tokens, len(tokens), final=True)
            first.sent()

    def _speech_tokens(self, ids: list[int]) -> tuple[list[int], bool]:
        """LLM ids -> (speech tokens before the first non-speech id, whether such an id ended the utterance).

        End ids stop the utterance and are never audio. Any other non-speech id (a text id that escaped the
        logits mask) ends it too, loudly, instead of being fed to the flow or silently skipped.
        """
        vocab = self.config.vocab
        tokens = vocab.to_speech_tokens(np.asarray(ids, dtype=np.int64))
        outside = np.flatnonzero((tokens < 0) | (tokens >= vocab.speech_token_size))
        if not outside.size:
            return tokens.tolist(), False
        first = int(outside[0])
        if ids[first] not in vocab.end_ids:
            logger.warning("LLM produced non-speech id %d; ending the utterance there", ids[first])
        return tokens[:first].tolist(), True


@dataclass
class _Run:
    """What one request has open downstream, so that any exit path can release exactly that."""

    request_id: str
    clients: PipelineClients
    first_chunk: FirstChunkTimes
    llm_running: bool = False
    stream_open: bool = False

    async def token2wav(self, tokens: list[int], prompt: PromptTensors, chunk: Chunk | None, seed: int) -> np.ndarray:
        first = not self.stream_open
        # Streaming: the stream exists from the first call until its final chunk; offline keeps no state.
        self.stream_open = chunk is not None and not chunk.final
        self.first_chunk.mark()  # the first call's tokens are in ...
        audio = await self.clients.token2wav(
            self.request_id, np.asarray(tokens, dtype=np.int32), prompt if first else None, chunk, seed
        )
        self.first_chunk.mark()  # ... and its audio is back (later calls' marks are ignored)
        return audio

    async def release(self) -> None:
        jobs: list[Awaitable[None]] = []
        if self.llm_running:
            jobs.append(self.clients.llm_stop(self.request_id))
        if self.stream_open:
            jobs.append(self.clients.token2wav_close(self.request_id))
        self.llm_running = self.stream_open = False
        if jobs:
            # Shielded: this also runs while the request's task is being cancelled. Bounded: a stuck
            # downstream model must not keep the request (and its client's final response) forever.
            cleanup = asyncio.gather(*jobs, return_exceptions=True)
            try:
                await asyncio.wait_for(asyncio.shield(cleanup), RELEASE_TIMEOUT_S)
            except asyncio.TimeoutError:
                logger.warning("request %s: releasing its LLM/token2wav state timed out", self.request_id)


@asynccontextmanager
async def accounted(stats: Stats, release: Callable[[], Awaitable[None]]) -> AsyncIterator[None]:
    """One request's run in the orchestrator counters (requests, active; cancelled or failed by how it ended).
    However it ends, `release` frees what it holds downstream before it stops counting as active.

    Cancelled: its task was cancelled (the client left), or its consumer closed the stream before the end
    (GeneratorExit: it stopped reading, e.g. because sending a chunk to a client that had just left failed).
    Failed: the orchestrator's own work raised."""
    stats.add("orchestrator_requests_total")
    stats.add("orchestrator_active_requests")
    try:
        yield
    except (asyncio.CancelledError, GeneratorExit):
        stats.add("orchestrator_cancelled_total")
        raise
    except BaseException:
        stats.add("orchestrator_failed_total")
        raise
    finally:
        try:
            await release()
        finally:
            stats.add("orchestrator_active_requests", -1)


class FinalResponseGuard:
    """A request's response sender that remembers whether the request's final response went out.

    After it the request is tritonserver's again, which may release it while the handler still cleans up (closes
    its LLM sequence and token2wav stream): it is not asked `is_cancelled()` then (`run_until_cancelled`'s
    `answered`). Asked off the event loop, where a check could overlap the final send, that question killed
    tritonserver in two test runs; whether asking it late on the loop also froze a replica of four is not proven
    (docs/experiments/2026-11-28-replica-freeze-cause.md). Sends after the final one are refused here rather than
    sent."""

    def __init__(self, sender: Any, final_flag: int) -> None:
        self._sender, self._final_flag = sender, final_flag
        self.final_sent = False

    def send(self, response: Any = None, flags: int = 0) -> None:
        if self.final_sent:
            raise RuntimeError("a response after the request's final response")
        if response is None:
            self._sender.send(flags=flags)
        else:
            self._sender.send(response, flags=flags)
        if flags & self._final_flag:
            self.final_sent = True


async def run_until_cancelled(
    work: Callable[[], Awaitable[None]], is_cancelled: Callable[[], bool],
    answered: Callable[[], bool] = lambda: False, poll_s: float = 0.05,
) -> bool:
    """Run `work()` and cancel it as soon as `is_cancelled()` turns true. Returns True if cancelled. Once
    `answered()` (the final response went out: `FinalResponseGuard`) the request is not asked again and `work()`
    runs to its end."""
    task = asyncio.ensure_future(work())
    while not task.done():
        await asyncio.wait({task}, timeout=poll_s)
        if not task.done() and not answered() and is_cancelled():
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
            return True
    task.result()
    return False
