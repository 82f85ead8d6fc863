"""The Spark serving logic without Triton: the orchestrator over in-process clients (the real tiny engine's
scheduler, vocoder worker and masked audio tokenizer)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from cosyvoice2_serving.errors import InvalidInput
from cosyvoice2_serving.spark import (
    SparkEngine,
    SparkOrchestrator,
    SparkOrchestratorConfig,
    SparkVoiceTokenizer,
    delivery_points,
)
from spark_tts.llm import SparkSampling
from spark_tts.prompt import SparkTokenizer
from spark_tts.streaming import ChunkSchedule, StreamPlan
from spark_tts.testing import write_tiny_model
from pipeline_contract import SpeechRequest

SCHEDULE = ChunkSchedule(first_chunk_tokens=20, scale=1.5, max_chunk_tokens=60)


@pytest.fixture(scope="module")
def spark_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("spark_tiny"), seed=3)


class _Clients:
    def __init__(self, engine: SparkEngine, voices: SparkVoiceTokenizer) -> None:
        self.engine, self.voices, self.stopped = engine, voices, []

    async def voice_prompt(self, request):
        return self.voices.tokenize([request.reference_wav])[0]

    async def llm(self, request_id, request):
        async for ids in self.engine.submit(request_id, request):
            yield ids

    async def llm_stop(self, request_id):
        self.stopped.append(request_id)
        self.engine.stop(request_id)

    async def vocode(self, global_tokens, semantic_tokens, emit_start, emit_end):
        return await self.engine.vocode(global_tokens, semantic_tokens, emit_start, emit_end)


@pytest.fixture(scope="module")
def stack(spark_dir):
    engine = SparkEngine(spark_dir, max_batch=4, max_seq_len=1024)
    clients = _Clients(engine, SparkVoiceTokenizer(spark_dir))
    config = SparkOrchestratorConfig.for_model_dir(spark_dir, schedule=SCHEDULE,
                                                   sampling=SparkSampling(max_new_tokens=150), max_sequence_len=1024)
    yield SparkOrchestrator(config, SparkTokenizer.from_model_dir(spark_dir), clients), clients
    engine.close()


def _request(text="Hello there, tiny Spark.", seed=3, transcript="a reference", instruction=""):
    wav = (np.random.default_rng(1).standard_normal(16000) * 0.1).astype(np.float32)
    return SpeechRequest(wav, transcript, text, "voice-1", seed, instruction)


async def _collect(orchestrator, request, streaming):
    return [chunk async for chunk in orchestrator.synthesize(request, streaming)]


def test_delivery_points_are_where_the_plan_completes_windows():
    points = delivery_points(StreamPlan(39, SCHEDULE), 200)
    probe, firsts = StreamPlan(39, SCHEDULE), []
    for n in range(1, 201):  # one token at a time: the counts at which a window completes
        if probe.advance(n):
            firsts.append(n)
    assert points == tuple(firsts) and points[:3] == (20 + 39, 20 + 30 + 39, 20 + 30 + 45 + 39)


async def test_streamed_pieces_concatenate_to_the_offline_waveform(stack):
    orchestrator, _ = stack
    [offline] = await _collect(orchestrator, _request(), streaming=False)
    streamed = await _collect(orchestrator, _request(), streaming=True)
    assert offline.final and offline.output_tokens > 0
    assert offline.waveform.size == offline.output_tokens * orchestrator.config.hop
    assert [c.final for c in streamed] == [False] * (len(streamed) - 1) + [True] and len(streamed) >= 3
    audio = np.concatenate([c.waveform for c in streamed])
    assert audio.size == offline.waveform.size
    np.testing.assert_allclose(audio, offline.waveform, atol=1e-4)
    assert streamed[-1].output_tokens == offline.output_tokens and streamed[-1].input_tokens == offline.input_tokens
    assert {c.sample_rate for c in [offline, *streamed]} == {16_000}  # every chunk states Spark's rate


async def test_concurrent_requests_each_get_their_solo_audio(stack):
    orchestrator, _ = stack
    solo = [(await _collect(orchestrator, _request(seed=s), False))[0].waveform for s in (5, 6)]
    together = await asyncio.gather(*(_collect(orchestrator, _request(seed=s), False) for s in (5, 6)))
    for alone, [chunk] in zip(solo, together):
        np.testing.assert_allclose(chunk.waveform, alone, atol=1e-4)


async def test_warm_up_instructions_and_usage(stack):
    orchestrator, _ = stack
    [warm] = await _collect(orchestrator, _request(text=""), streaming=True)
    assert warm.final and warm.waveform.size == 0 and warm.output_tokens == 0
    with pytest.raises(InvalidInput, match="instruct"):
        await _collect(orchestrator, _request(instruction="Speak sadly"), streaming=False)
    # input tokens: transcript + target; without a transcript only the target
    [with_text] = await _collect(orchestrator, _request(), False)
    [without] = await _collect(orchestrator, _request(transcript=""), False)
    tokenizer = orchestrator.tokenizer
    assert with_text.input_tokens == len(tokenizer.encode("a reference")) + without.input_tokens
    assert without.input_tokens == len(tokenizer.encode("Hello there, tiny Spark."))


async def test_a_cancelled_stream_stops_its_llm_sequence(stack):
    orchestrator, clients = stack
    stream = orchestrator.synthesize(_request(seed=9), streaming=True)
    first = await stream.__anext__()
    assert not first.final
    await stream.aclose()
    assert len(clients.stopped) == 1
    for _ in range(100):  # the scheduler's worker applies the cancellation between steps
        if clients.stopped[0] not in clients.engine.scheduler.active_request_ids():
            break
        await asyncio.sleep(0.05)
    assert clients.stopped[0] not in clients.engine.scheduler.active_request_ids()
