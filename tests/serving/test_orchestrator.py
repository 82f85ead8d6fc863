"""Orchestrator state machine with in-process fake clients (no Triton, no model)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from cosyvoice2.streaming import ChunkSchedule
from cosyvoice2.vocab import SpeechVocabLayout
from speech_serving.errors import InvalidInput, UnknownVoice
from speech_serving.io_struct import PromptTensors
from speech_serving.orchestrator import (
    Orchestrator,
    OrchestratorConfig,
    SamplingConfig,
    parse_request,
)
import pipeline_contract as contract
from pipeline_contract import SpeechRequest

VOCAB = SpeechVocabLayout(text_vocab_size=1000, speech_token_size=50)
SAMPLES_PER_TOKEN = 960
PROMPT = PromptTensors(np.arange(7, dtype=np.int32), np.zeros((14, 80), np.float32), np.ones(192, np.float32))


class WordTokenizer:
    def encode(self, text: str) -> list[int]:
        return [len(word) for word in text.split()]


class FakeClients:
    """LLM: `tokens` speech ids (+ offset) in batches of `batch`; token2wav: 960 samples/token."""

    def __init__(self, tokens: list[int], batch: int = 4, hold_after: int | None = None) -> None:
        self.tokens, self.batch, self.hold_after = tokens, batch, hold_after
        self.calls: list[tuple] = []
        self.llm_requests: list = []
        self.stopped: list[str] = []
        self.closed: list[str] = []
        self.emitted = 0

    async def voice_prompt(self, request):
        return PROMPT

    async def llm(self, request_id, request):
        self.llm_requests.append(request)
        ids = [t + VOCAB.speech_offset for t in self.tokens]
        for i in range(0, len(ids), self.batch):
            if self.hold_after is not None and i >= self.hold_after:
                await asyncio.Event().wait()  # the LLM never finishes: only a cancel ends this
            self.emitted = min(i + self.batch, len(self.tokens))
            yield ids[i : i + self.batch]
            await asyncio.sleep(0)

    async def llm_stop(self, request_id):
        self.stopped.append(request_id)

    async def token2wav(self, request_id, tokens, prompt, chunk, seed):
        self.calls.append((request_id, tokens.tolist(), prompt, chunk, self.emitted))
        n = len(tokens) if chunk is None else chunk.stop - chunk.start
        return np.full(n * SAMPLES_PER_TOKEN, 0.1, np.float32)

    async def token2wav_close(self, request_id):
        self.closed.append(request_id)


def request(text="one two three four five", seed=3) -> SpeechRequest:
    return SpeechRequest(np.zeros(16000, np.float32), "ref text", text, "voice", seed)


def orchestrator(clients, **config) -> Orchestrator:
    schedule = ChunkSchedule(first_hop=5, grid=5, max_hop=20, growth=2, lookahead=3)
    return Orchestrator(OrchestratorConfig(vocab=VOCAB, schedule=schedule, **config), WordTokenizer(), clients)


async def collect(orch, req, streaming):
    return [chunk async for chunk in orch.synthesize(req, streaming)]


async def test_offline_is_one_final_chunk_of_all_tokens():
    tokens = list(range(40))
    clients = FakeClients(tokens)
    orch = orchestrator(clients)
    [chunk] = await collect(orch, request(), streaming=False)
    assert chunk.final and chunk.output_tokens == 40 and chunk.waveform.size == 40 * SAMPLES_PER_TOKEN
    assert chunk.input_tokens == len("ref text".split()) + 5
    [(_, sent, prompt, chunk_arg, _)] = clients.calls
    assert sent == tokens and prompt is PROMPT and chunk_arg is None
    assert orch.stats.get("orchestrator_active_requests") == 0


async def test_streaming_follows_the_schedule_and_starts_before_the_llm_ends():
    tokens = list(range(45))
    clients = FakeClients(tokens, batch=2)
    orch = orchestrator(clients)
    chunks = await collect(orch, request(), streaming=True)
    schedule = ChunkSchedule(prompt_tokens=PROMPT.speech_tokens.size, first_hop=5, grid=5, max_hop=20, lookahead=3)
    expected = schedule.chunks(len(tokens))
    assert [c for *_, c, _ in clients.calls] == expected
    assert len(chunks) == len(expected) > 2 and [c.final for c in chunks] == [False] * (len(chunks) - 1) + [True]
    assert chunks[0].output_tokens < len(tokens) == chunks[-1].output_tokens
    assert clients.calls[0][4] < len(tokens)  # the first chunk ran while the LLM was still generating
    assert sum(c.waveform.size for c in chunks) == len(tokens) * SAMPLES_PER_TOKEN
    sent = [t for _, part, *_ in clients.calls for t in part]
    assert sent == tokens  # each token handed over exactly once, in order
    assert [call[2] is PROMPT for call in clients.calls] == [True] + [False] * (len(clients.calls) - 1)
    assert len({call[0] for call in clients.calls}) == 1 and clients.closed == [] and clients.stopped == []


def test_the_schedule_follows_the_streams_running_when_a_stream_starts():
    """Lone (1 running, itself counted): the lone schedule; fewer than `busy_streams`: the light one; from
    `busy_streams` on: the padded one. Without a light schedule everything beside others is padded."""
    padded = ChunkSchedule(first_hop=5, grid=5, max_hop=20, growth=2, lookahead=3)
    light = ChunkSchedule(first_hop=5, grid=1, max_hop=20, growth=2, lookahead=3)
    lone = ChunkSchedule(first_hop=4, grid=1, max_hop=20, growth=2, lookahead=3, second_hop=10)
    config = OrchestratorConfig(vocab=VOCAB, schedule=padded, lone_schedule=lone, light_schedule=light, busy_streams=4)
    orch = Orchestrator(config, WordTokenizer(), clients=None)  # type: ignore[arg-type]
    first_hops = {running: orch.schedule(PROMPT, running).hop(0) for running in range(1, 7)}
    pad = -int(PROMPT.speech_tokens.size) % 5
    assert pad > 0 and first_hops == {1: 4, 2: 5, 3: 5, 4: 5 + pad, 5: 5 + pad, 6: 5 + pad}
    assert orch.schedule(PROMPT).hop(0) == 5 + pad  # no count given: the busy streams' schedule
    plain = Orchestrator(OrchestratorConfig(vocab=VOCAB, schedule=padded, lone_schedule=lone, busy_streams=4),
                         WordTokenizer(), clients=None)  # type: ignore[arg-type]
    assert [plain.schedule(PROMPT, running).hop(0) for running in (1, 2, 3, 4)] == [4] + [5 + pad] * 3


async def test_a_lone_stream_follows_the_lone_schedule_and_a_busy_one_the_padded_one():
    """PROMPT has 7 tokens: padded, the first hop is 5 + 3 (to the 5-token grid); unpadded (`lone_schedule`), 5.
    A request that starts while another runs follows the padded schedule; the deliveries asked of the LLM match."""
    padded = ChunkSchedule(first_hop=5, grid=5, max_hop=20, growth=2, lookahead=3)
    lone = ChunkSchedule(first_hop=5, grid=1, max_hop=20, growth=2, lookahead=3)
    tokens = list(range(45))
    clients = FakeClients(tokens, batch=2)
    orch = Orchestrator(OrchestratorConfig(vocab=VOCAB, schedule=padded, lone_schedule=lone), WordTokenizer(), clients)
    await collect(orch, request(), streaming=True)
    first = clients.calls[0][3]
    assert (first.start, first.stop, first.feed) == (0, 5, 8)
    assert clients.llm_requests[0].deliver_at[0] == 8

    held = FakeClients(tokens, batch=2, hold_after=4)  # a first request that keeps running
    orch = Orchestrator(OrchestratorConfig(vocab=VOCAB, schedule=padded, lone_schedule=lone), WordTokenizer(), held)
    running = asyncio.ensure_future(collect(orch, request(), streaming=True))
    while held.emitted < 4:  # the first request's LLM now holds (it never ends by itself)
        await asyncio.sleep(0)
    await asyncio.sleep(0)
    held.hold_after = None  # the second request's LLM runs to its end
    await collect(orch, request(), streaming=True)
    assert len({call[0] for call in held.calls}) == 1  # the held request never reached its first chunk
    second = held.calls[0][3]
    assert (second.start, second.stop) == (0, 8)  # 5 + the pad of 3
    assert held.llm_requests[1].deliver_at[0] == 11
    running.cancel()
    with pytest.raises(asyncio.CancelledError):
        await running


async def test_llm_request_layout_limits_and_seed():
    clients = FakeClients(list(range(10)))
    orch = orchestrator(clients)
    await collect(orch, request("aa bbb", seed=None), streaming=False)
    [llm] = clients.llm_requests
    expected = [VOCAB.sos_id, 3, 4, 2, 3, VOCAB.task_id_id] + [VOCAB.speech_offset + t for t in range(7)]
    assert llm.input_ids.tolist() == expected
    assert (llm.min_tokens, llm.max_tokens) == (4, 40)  # 2x and 20x the 2 target tokens
    await collect(orch, request("aa bbb", seed=None), streaming=False)
    assert clients.llm_requests[0].seed != clients.llm_requests[1].seed  # no fixed seed


async def test_benchmark_mode_fixes_the_generated_length_per_text_token():
    clients = FakeClients(list(range(10)))
    fixed = SamplingConfig(fixed_token_text_ratio=3.4)
    await collect(orchestrator(clients, sampling=fixed), request("aa bbb ccc"), streaming=False)
    assert (clients.llm_requests[0].min_tokens, clients.llm_requests[0].max_tokens) == (10, 10)  # round(3 x 3.4)
    # 14 prefix ids leave room for 6 of the 10: refused, never silently shortened
    with pytest.raises(InvalidInput, match="sequence limit"):
        await collect(orchestrator(clients, sampling=fixed, max_sequence_len=20), request("aa bbb ccc"), streaming=False)
    assert len(clients.llm_requests) == 1


async def test_ids_after_an_end_id_are_not_audio_and_the_sequence_is_stopped():
    class RunsOn(FakeClients):
        async def llm(self, request_id, request):
            offset = VOCAB.speech_offset
            yield [offset + 1, offset + 2, VOCAB.end_ids[1], offset + 3]
            yield [offset + 4]  # a backend that keeps going after the end id

    clients = RunsOn([])
    [chunk] = await collect(orchestrator(clients), request(), streaming=False)
    assert clients.calls[0][1] == [1, 2] and chunk.output_tokens == 2
    assert clients.stopped == [clients.calls[0][0]]


async def test_max_tokens_is_clamped_to_the_sequence_limit_and_impossible_prompts_are_rejected():
    clients = FakeClients(list(range(10)))
    await collect(orchestrator(clients, max_sequence_len=30), request("aa bbb"), streaming=False)
    assert clients.llm_requests[0].max_tokens == 30 - 13
    with pytest.raises(InvalidInput, match=r"^\[invalid_input\].*sequence limit"):
        await collect(orchestrator(clients, max_sequence_len=14), request("aa bbb"), streaming=False)
    with pytest.raises(InvalidInput, match="at most 3"):
        await collect(orchestrator(clients, max_target_text_tokens=3), request(), streaming=False)


async def test_cancel_mid_stream_stops_the_llm_and_closes_the_stream():
    clients = FakeClients(list(range(100)), batch=4, hold_after=40)
    orch = orchestrator(clients)
    got = []

    async def consume():
        async for chunk in orch.synthesize(request(), streaming=True):
            got.append(chunk)

    task = asyncio.create_task(consume())
    while len(got) < 2:
        await asyncio.sleep(0.001)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    request_id = clients.calls[0][0]
    assert clients.stopped == [request_id] and clients.closed == [request_id]
    stats = orch.stats.snapshot()
    assert stats["orchestrator_active_requests"] == 0 and stats["orchestrator_cancelled_total"] == 1


async def test_a_consumer_that_stops_reading_cancels_the_request_it_does_not_fail_it():
    """The entry model stops reading a stream when sending a chunk to a client that just left fails: closing the
    stream early frees the request downstream and counts it cancelled, not failed."""
    clients = FakeClients(list(range(100)), batch=4, hold_after=40)
    orch = orchestrator(clients)
    stream = orch.synthesize(request(), streaming=True)
    first = await stream.__anext__()
    assert not first.final
    await stream.aclose()
    request_id = clients.calls[0][0]
    assert clients.stopped == [request_id] and clients.closed == [request_id]
    stats = orch.stats.snapshot()
    assert stats["orchestrator_active_requests"] == 0
    assert (stats["orchestrator_cancelled_total"], stats["orchestrator_failed_total"]) == (1, 0)


async def test_a_failing_llm_releases_the_open_stream():
    class Failing(FakeClients):
        async def llm(self, request_id, request):
            async for ids in super().llm(request_id, request):
                yield ids
                if self.calls:
                    raise RuntimeError("[overloaded] llm went away")

    clients = Failing(list(range(60)), batch=10)
    orch = orchestrator(clients)
    with pytest.raises(RuntimeError, match="llm went away"):
        await collect(orch, request(), streaming=True)
    assert clients.closed == [clients.calls[0][0]]
    assert orch.stats.get("orchestrator_failed_total") == 1


def _arrays(**overrides):
    wav = np.zeros(8000, np.float32)
    arrays = {
        contract.REFERENCE_WAV.name: wav,
        contract.REFERENCE_WAV_LEN.name: np.array([8000], np.int32),
        contract.REFERENCE_TEXT.name: np.array([b"hi"], object),
        contract.TARGET_TEXT.name: np.array(["héllo".encode()], object),
        contract.VOICE_ID.name: np.array([b"abc"], object),
        contract.SEED.name: None,
    }
    arrays.update(overrides)
    return arrays


def test_parse_request_accepts_the_contract_and_slices_the_audio():
    req = parse_request(_arrays(**{contract.REFERENCE_WAV_LEN.name: np.array([4000], np.int32)}))
    assert req.reference_wav.size == 4000 and req.target_text == "héllo" and req.seed is None
    seeded = parse_request(_arrays(**{contract.SEED.name: np.array([2**63 + 5], np.uint64)}))
    assert seeded.seed == 2**63 + 5


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({contract.REFERENCE_WAV_LEN.name: np.array([9000], np.int32)}, "reference_wav_len"),
        ({contract.REFERENCE_WAV_LEN.name: np.array([100], np.int32)}, "reference_wav_len"),
        ({contract.REFERENCE_WAV.name: np.full(8000, np.nan, np.float32)}, "NaN"),
        ({contract.TARGET_TEXT.name: np.array([b"\xff"], object)}, "UTF-8"),
        ({contract.VOICE_ID.name: np.array([b""], object)}, "voice_id"),
        ({contract.REFERENCE_WAV_LEN.name: None}, "reference_wav_len"),
    ],
)
def test_parse_request_rejects_bad_input_with_the_invalid_input_tag(overrides, message):
    with pytest.raises(InvalidInput, match=message) as info:
        parse_request(_arrays(**overrides))
    assert str(info.value).startswith(contract.ERROR_INVALID_INPUT)


class BoundaryClients(FakeClients):
    """An LLM that honours the request's `deliver_at`: tokens only at its boundaries and at the end."""

    async def llm(self, request_id, request):
        self.llm_requests.append(request)
        ids = [t + VOCAB.speech_offset for t in self.tokens]
        cuts = [b for b in request.deliver_at if b < len(ids)] + [len(ids)]
        start = 0
        for cut in cuts:
            self.emitted = cut
            yield ids[start:cut]
            start = cut
            await asyncio.sleep(0)


async def test_streaming_asks_for_tokens_at_the_chunk_boundaries_and_gets_the_same_chunks_as_per_token():
    tokens = list(range(61))
    per_token, buffered = FakeClients(tokens, batch=1), BoundaryClients(tokens)
    orch_a, orch_b = orchestrator(per_token), orchestrator(buffered)
    chunks_a = await collect(orch_a, request(), streaming=True)
    chunks_b = await collect(orch_b, request(), streaming=True)
    [llm] = buffered.llm_requests
    schedule = ChunkSchedule(prompt_tokens=PROMPT.speech_tokens.size, first_hop=5, grid=5, max_hop=20, lookahead=3)
    assert llm.deliver_at == tuple(schedule.boundaries(llm.max_tokens)) and len(llm.deliver_at) > 2
    assert [call[1:4] for call in buffered.calls] == [call[1:4] for call in per_token.calls]  # tokens, prompt, chunk
    # every non-final chunk ran as soon as its boundary was delivered, as early as with per-token delivery
    assert [call[4] for call in buffered.calls[:-1]] == [call[4] for call in per_token.calls[:-1]]
    assert [(c.output_tokens, c.final) for c in chunks_b] == [(c.output_tokens, c.final) for c in chunks_a]
    await collect(orch_b, request(), streaming=False)
    assert buffered.llm_requests[-1].deliver_at == ()  # offline: the tokens are needed only at the end


@pytest.mark.parametrize("text", [b"", b"   "])
async def test_empty_target_text_only_prepares_the_voice(text):
    """The contract's warm-up rule: the voice prompt is computed, nothing is spoken, zero tokens."""
    req = parse_request(_arrays(**{contract.TARGET_TEXT.name: np.array([text], object)}))
    assert req.target_text == ""
    clients = FakeClients(list(range(10)))
    prepared: list[str] = []

    async def voice_prompt(request):
        prepared.append(request.voice_id)
        return PROMPT

    clients.voice_prompt = voice_prompt
    orch = orchestrator(clients)
    for streaming in (False, True):
        [chunk] = await collect(orch, req, streaming)
        assert chunk.final and chunk.waveform.size == 0 and (chunk.input_tokens, chunk.output_tokens) == (0, 0)
    # computed once: the second request finds the voice in the orchestrator's own cache
    assert prepared == ["abc"] and clients.llm_requests == [] and clients.calls == []
    assert orch.stats.get("orchestrator_active_requests") == 0


# -- voices named by id only ------------------------------------------------------------------------------------------
class VoiceModelClients(FakeClients):
    """A voice-prompt model that holds the voices it was sent with audio, and refuses id-only requests for others."""

    def __init__(self, tokens: list[int]) -> None:
        super().__init__(tokens)
        self.held: set[str] = set()
        self.prompt_calls: list[tuple[str, bool]] = []  # (voice id, with audio)

    async def voice_prompt(self, request):
        self.prompt_calls.append((request.voice_id, request.carries_audio))
        await asyncio.sleep(0)
        if request.carries_audio:
            self.held.add(request.voice_id)
        elif request.voice_id not in self.held:
            raise UnknownVoice.of(request.voice_id)
        return PROMPT


async def test_an_id_only_request_for_a_held_voice_makes_no_voice_prompt_call():
    clients = VoiceModelClients(list(range(10)))
    orch = orchestrator(clients)
    await collect(orch, request(), streaming=False)  # with its audio: computed by the voice-prompt model
    chunks = await collect(orch, contract.id_only(request()), streaming=True)
    assert chunks[-1].final and sum(c.waveform.size for c in chunks) == 10 * SAMPLES_PER_TOKEN
    assert clients.prompt_calls == [("voice", True)]  # the id-only request was served from the orchestrator's cache
    assert orch.voices.cache.stats.get("voice_cache_hits_total") == 1


async def test_an_id_only_request_missing_here_is_looked_up_in_the_voice_prompt_model():
    clients = VoiceModelClients(list(range(10)))
    clients.held.add("voice")  # e.g. prepared through the other pipeline model (offline / streaming)
    orch = orchestrator(clients)
    await collect(orch, contract.id_only(request()), streaming=False)
    await collect(orch, contract.id_only(request()), streaming=False)
    assert clients.prompt_calls == [("voice", False)]  # looked up once without audio, then held here


@pytest.mark.parametrize("streaming", [False, True])
async def test_an_unknown_voice_is_refused_with_its_tag_before_any_work(streaming):
    clients = VoiceModelClients(list(range(10)))
    orch = orchestrator(clients)
    chunks = []
    with pytest.raises(UnknownVoice) as info:
        async for chunk in orch.synthesize(contract.id_only(request()), streaming):
            chunks.append(chunk)
    assert str(info.value).startswith(contract.ERROR_UNKNOWN_VOICE) and "voice" in str(info.value)
    assert chunks == [] and clients.llm_requests == [] and clients.calls == []
    assert "voice" not in orch.voices.cache  # nothing cached: the resend with the audio computes it
    assert orch.stats.get("orchestrator_active_requests") == 0
    [chunk] = await collect(orch, request(), streaming=False)  # the resend
    assert chunk.waveform.size == 10 * SAMPLES_PER_TOKEN


async def test_a_request_with_audio_never_inherits_an_id_only_lookup_failure():
    clients = VoiceModelClients(list(range(10)))
    orch = orchestrator(clients)
    results = await asyncio.gather(
        collect(orch, contract.id_only(request()), streaming=False), collect(orch, request(), streaming=False),
        return_exceptions=True,
    )
    assert isinstance(results[0], UnknownVoice)
    assert not isinstance(results[1], BaseException) and results[1][0].waveform.size == 10 * SAMPLES_PER_TOKEN
