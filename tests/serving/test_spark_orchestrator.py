"""The Spark serving logic without Triton: the orchestrator over in-process clients (the real tiny engine's
scheduler, vocoder worker and masked audio tokenizer)."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

import torch
from safetensors.torch import load_file, save_file

from speech_serving.errors import InvalidInput
from speech_serving.io_struct import SparkLLMRequest
from speech_serving.spark import (
    SparkEngine,
    SparkOrchestrator,
    SparkOrchestratorConfig,
    SparkVoiceTokenizer,
    delivery_points,
)
from spark_tts import layout
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


async def test_a_streaming_request_counts_one_first_chunk_in_the_orchestrator_and_the_llm(stack):
    orchestrator, clients = stack
    counts = lambda: (orchestrator.stats.get("orchestrator_first_chunks_total"),  # noqa: E731
                      clients.engine.stats.get("llm_first_chunks_total"))
    stages = lambda: [orchestrator.stats.get(f"orchestrator_first_chunk_{stage}_seconds_total")  # noqa: E731
                      for stage in ("prompt", "tokens", "audio", "send")]
    before = counts()
    await _collect(orchestrator, _request(seed=7), streaming=False)
    assert counts() == before  # offline: no first chunk
    earlier = stages()
    started = time.monotonic()
    streamed = await _collect(orchestrator, _request(seed=7), streaming=True)
    seen = time.monotonic() - started
    assert len(streamed) >= 2 and counts() == (before[0] + 1, before[1] + 1)
    spent = [after - prior for after, prior in zip(stages(), earlier)]
    assert all(value > 0 for value in spent[:3]) and sum(spent) <= seen  # the vocoder's window is the audio stage


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


BENCHMARK_RATIO = 2.5


@pytest.fixture(scope="module")
def eager_stop_dir(tmp_path_factory):
    """A tiny model whose LLM draws its stop id first whenever it may: every token's embedding (tied to the output
    head) carries a large constant in one dimension, the stop token's twice that, and the final norm keeps only
    that dimension, so the stop id has by far the largest logit. Benchmark mode must still run to its length."""
    directory = write_tiny_model(tmp_path_factory.mktemp("spark_eager_stop"), seed=3)
    weights = directory / layout.LLM_WEIGHTS_FILE
    state = load_file(weights)
    eos = SparkTokenizer.from_model_dir(directory).vocab.eos_id
    embed = state["model.embed_tokens.weight"]
    embed[:, 0] = 10.0
    embed[eos, 0] = 20.0
    state["model.norm.weight"] = torch.zeros_like(state["model.norm.weight"])
    state["model.norm.weight"][0] = 1.0
    save_file(state, weights)
    return directory


async def test_the_eager_stop_model_stops_at_once_outside_benchmark_mode(eager_stop_dir):
    engine = SparkEngine(eager_stop_dir, max_batch=1, max_seq_len=256)
    tokenizer = SparkTokenizer.from_model_dir(eager_stop_dir)
    request = SparkLLMRequest(np.asarray(tokenizer.prompt_ids("Hi there.", [1] * 32, None, ()), np.int32), 50, 1, ())
    try:
        ids = [i async for ids in engine.submit("r", request) for i in ids]
    finally:
        engine.close()
    assert len(ids) <= 1 and tokenizer.semantic_codes(ids) == []  # so benchmark mode's exact lengths are its doing


@pytest.fixture(scope="module")
def benchmark_stack(eager_stop_dir):
    """Benchmark mode as the rendered models run it: the orchestrator fixes the length, the engine never stops."""
    spark_dir = eager_stop_dir
    engine = SparkEngine(spark_dir, max_batch=4, max_seq_len=1024, benchmark=True)
    clients = _Clients(engine, SparkVoiceTokenizer(spark_dir))
    config = SparkOrchestratorConfig.for_model_dir(spark_dir, schedule=SCHEDULE, max_sequence_len=1024,
                                                   fixed_token_text_ratio=BENCHMARK_RATIO)
    yield SparkOrchestrator(config, SparkTokenizer.from_model_dir(spark_dir), clients)
    engine.close()


@pytest.mark.parametrize("text", ["Hi.", "Hello there, tiny Spark.", "A somewhat longer sentence, so that the "
                                  "fixed length grows with the text and streams in several pieces."])
async def test_benchmark_mode_generates_the_configured_semantic_tokens_per_text_token(benchmark_stack, text):
    orchestrator = benchmark_stack
    expected = max(1, round(BENCHMARK_RATIO * len(orchestrator.tokenizer.encode(text))))
    for seed in (1, 2):
        [offline] = await _collect(orchestrator, _request(text=text, seed=seed), streaming=False)
        # every generated id became one code: no early stop id, no dropped non-semantic id of the random LLM
        assert offline.output_tokens == expected
        assert offline.waveform.size == expected * orchestrator.config.hop
    streamed = await _collect(orchestrator, _request(text=text), streaming=True)
    assert streamed[-1].output_tokens == expected
    assert sum(c.waveform.size for c in streamed) == expected * orchestrator.config.hop


def test_benchmark_ids_are_one_code_each(spark_dir):
    tokenizer = SparkTokenizer.from_model_dir(spark_dir)
    semantic = tokenizer.semantic_ids([0, 5, 8191])
    other = [tokenizer.vocab.eos_id, tokenizer.vocab.semantic_base + 8192 + 3]
    assert tokenizer.benchmark_codes(semantic) == tokenizer.semantic_codes(semantic) == [0, 5, 8191]
    assert tokenizer.semantic_codes(other) == []
    assert tokenizer.benchmark_codes(other) == [i % 8192 for i in other]
