"""The rendered repository in a real tritonserver: tiny random model, PyTorch LLM, CPU."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as aio
from tritonclient.utils import InferenceServerException

from cosyvoice2.text.tokenizer import CosyVoice2Tokenizer
from tests.triton.conftest import (
    FIRST_HOP,
    SAMPLES_PER_TOKEN,
    settled_metrics,
    stream,
    synthesis_inputs,
    wait_metrics,
)
import pipeline_contract as contract
from triton_repo.render import RenderOptions, write_repository

pytestmark = pytest.mark.triton

TEXT = "Hello world, the tiny model speaks."


async def test_offline_audio_length_matches_the_generated_tokens(pipeline):
    async with aio.InferenceServerClient(pipeline.server.grpc_url) as client:
        result = await client.infer(contract.OFFLINE_MODEL, synthesis_inputs(TEXT, seed=5))
    waveform = result.as_numpy(contract.WAVEFORM.name)
    output_tokens = int(result.as_numpy(contract.OUTPUT_TOKENS.name)[0])
    assert output_tokens > 0 and int(result.as_numpy(contract.INPUT_TOKENS.name)[0]) > 0
    assert waveform.dtype == np.float32 and waveform.size == output_tokens * SAMPLES_PER_TOKEN
    assert np.isfinite(waveform).all() and np.abs(waveform).max() > 0


async def test_streaming_sends_chunks_before_the_llm_has_finished(pipeline):
    async with aio.InferenceServerClient(pipeline.server.grpc_url) as client:
        chunks = await stream(client, synthesis_inputs(TEXT, seed=6))
    assert len(chunks) >= 3
    assert [final for *_, final in chunks] == [False] * (len(chunks) - 1) + [True]
    counts = [tokens for _, _, tokens, _ in chunks]
    assert counts == sorted(counts) and counts[0] < counts[-1]  # the first chunk left before the last token existed
    assert sum(w.size for w, *_ in chunks) == counts[-1] * SAMPLES_PER_TOKEN
    assert len({inp for _, inp, _, _ in chunks}) == 1


async def test_eight_concurrent_streams_all_complete(pipeline):
    texts = [f"Request number {i} says hello to the world." for i in range(8)]
    async with aio.InferenceServerClient(pipeline.server.grpc_url) as client:
        results = await asyncio.gather(*(stream(client, synthesis_inputs(t, seed=i)) for i, t in enumerate(texts)))
    for chunks in results:
        assert chunks[-1][3] and len(chunks) >= 2
        total = chunks[-1][2]
        assert total > 0 and sum(w.size for w, *_ in chunks) == total * SAMPLES_PER_TOKEN
    metrics = await wait_metrics(pipeline, lambda m: m[("orchestrator_active_requests", "cosyvoice2_stream")] == 0)
    assert metrics[("token2wav_active_streams", pipeline.token2wav_model)] == 0
    assert metrics[("llm_active_sequences", pipeline.llm_model)] == 0


async def test_decoupled_models_leave_the_stub_no_unfinished_bookkeeping(pipeline):
    """The python stub keeps each decoupled model's running `async def execute` in a set; an `execute` that finished
    before the stub added it made the removal fail ("Cannot remove future from background", an error line per
    request, the future kept for good). Requests refused at once (too short a reference) finish fastest, so they
    come too: streams and offline requests, good and refused, through every decoupled model."""
    texts = [f"Stream {i} of the stub check." for i in range(6)]

    async def refused(call):
        with pytest.raises(InferenceServerException, match="reference_wav_len"):
            await call

    async with aio.InferenceServerClient(pipeline.server.grpc_url) as client:
        too_short = [synthesis_inputs(f"Refused {i}.", seconds=0.05) for i in range(16)]
        await asyncio.gather(*(stream(client, synthesis_inputs(t, seed=i)) for i, t in enumerate(texts)),
                             client.infer(contract.OFFLINE_MODEL, synthesis_inputs(TEXT, seed=3)),
                             *(refused(stream(client, inputs)) for inputs in too_short),
                             *(refused(client.infer(contract.OFFLINE_MODEL, inputs)) for inputs in too_short))
    await wait_metrics(pipeline, lambda m: m[("orchestrator_active_requests", "cosyvoice2_stream")] == 0)
    log = pipeline.server.log_path.read_text(errors="replace")
    assert "Cannot remove future from background" not in log


async def test_cancel_mid_stream_frees_the_request_everywhere(pipeline):
    before = await settled_metrics(pipeline)
    long_text = " ".join(["This sentence keeps the language model busy for a long while."] * 4)
    async with aio.InferenceServerClient(pipeline.server.grpc_url) as client:
        chunks = await stream(client, synthesis_inputs(long_text, seed=9), cancel_after=1)
        assert len(chunks) == 1 and not chunks[0][3]

        def freed(m):
            return (
                m[("orchestrator_active_requests", "cosyvoice2_stream")] == 0
                and m[("llm_active_sequences", pipeline.llm_model)] == 0
                and m[("token2wav_active_streams", pipeline.token2wav_model)] == 0
            )

        counted = [
            ("orchestrator_cancelled_total", "cosyvoice2_stream"),
            ("llm_cancelled_total", pipeline.llm_model),
            ("token2wav_closed_total", pipeline.token2wav_model),
        ]

        def released(m):  # each layer counted the cancellation once (a publisher thread may lag on a busy machine)
            return freed(m) and all(m.get(key, 0) >= before.get(key, 0) + 1 for key in counted)

        assert freed(await wait_metrics(pipeline, released))
        metrics = await settled_metrics(pipeline)
    for stat, model in counted:
        assert metrics[(stat, model)] == before.get((stat, model), 0) + 1, stat


async def test_a_repeated_voice_hits_the_prompt_cache(pipeline):
    """A voice held by an orchestrator costs its requests no voice-prompt call; the other pipeline model finds it in
    the shared `voice_prompt` model by id alone, without its audio."""

    def calls(metrics, model):
        return sum(metrics.get((f"voice_cache_{kind}_total", model), 0) for kind in ("hits", "misses"))

    async with aio.InferenceServerClient(pipeline.server.grpc_url) as client:
        await client.infer(contract.OFFLINE_MODEL, synthesis_inputs("First.", voice="voice-repeat"))
        first = await settled_metrics(pipeline)
        await client.infer(contract.OFFLINE_MODEL, synthesis_inputs("Second.", voice="voice-repeat"))
        await client.infer(contract.OFFLINE_MODEL, synthesis_inputs("Third.", voice="voice-repeat", by_id=True))
        second = await settled_metrics(pipeline)
        await stream(client, synthesis_inputs("Fourth.", voice="voice-repeat", by_id=True))
        await stream(client, synthesis_inputs("Fifth.", voice="voice-repeat", by_id=True))
        third = await settled_metrics(pipeline)
    offline = ("voice_cache_hits_total", contract.OFFLINE_MODEL)
    assert second[offline] == first.get(offline, 0) + 2  # with audio or by id: held by the orchestrator
    assert calls(second, "voice_prompt") == calls(first, "voice_prompt")  # ... so no voice_prompt call
    # the streaming orchestrator: one lookup by id in voice_prompt (a hit there), then held itself
    assert third[("voice_cache_hits_total", "voice_prompt")] == second[("voice_cache_hits_total", "voice_prompt")] + 1
    assert third[("voice_cache_misses_total", "voice_prompt")] == second[("voice_cache_misses_total", "voice_prompt")]
    streaming = ("voice_cache_hits_total", contract.STREAMING_MODEL)
    assert third[streaming] == second.get(streaming, 0) + 1


async def test_invalid_input_is_reported_with_its_tag(pipeline):
    async with aio.InferenceServerClient(pipeline.server.grpc_url) as client:
        too_long = "word " * (contract.MAX_SEGMENT_TOKENS + 20)  # (empty text is the voice warm-up, not an error)
        with pytest.raises(InferenceServerException, match=r"\[invalid_input\].*target_text"):
            await client.infer(contract.OFFLINE_MODEL, synthesis_inputs(too_long))
        with pytest.raises(InferenceServerException, match=r"\[invalid_input\]"):
            await stream(client, synthesis_inputs(too_long))


@pytest.fixture(scope="module")
def benchmark_pipeline(tiny_model_dir, tmp_path_factory, triton_server_factory):
    """The pipeline rendered in benchmark mode (`--benchmark-speech-ratio`)."""
    repo = write_repository(
        RenderOptions(
            model_dir=tiny_model_dir,
            out=tmp_path_factory.mktemp("benchmark") / "repo",
            max_batch=4,
            max_seq_len=1024,
            first_hop=FIRST_HOP,
            benchmark_speech_ratio=BENCHMARK_RATIO,
        )
    )
    server = triton_server_factory(repo, ready_timeout=240)
    yield server
    server.cleanup()


BENCHMARK_RATIO = 6.5


async def test_benchmark_mode_generates_exactly_the_fixed_length(benchmark_pipeline, tiny_model_dir):
    """Random weights stop at random; in benchmark mode every request runs to round(ratio x text tokens)."""
    text_tokens = len(CosyVoice2Tokenizer.from_model_dir(tiny_model_dir).encode(TEXT))
    expected = round(text_tokens * BENCHMARK_RATIO)
    async with aio.InferenceServerClient(benchmark_pipeline.grpc_url) as client:
        results = await asyncio.gather(
            *(client.infer(contract.OFFLINE_MODEL, synthesis_inputs(TEXT, seed=seed)) for seed in range(3))
        )
        chunks = await stream(client, synthesis_inputs(TEXT, seed=9))
    for result in results:
        assert int(result.as_numpy(contract.OUTPUT_TOKENS.name)[0]) == expected
        assert result.as_numpy(contract.WAVEFORM.name).size == expected * SAMPLES_PER_TOKEN
    assert chunks[-1][2] == expected and sum(c[0].size for c in chunks) == expected * SAMPLES_PER_TOKEN


def infer_input(name: str, value: np.ndarray, triton_dtype: str) -> grpcclient.InferInput:
    tensor = grpcclient.InferInput(name, list(value.shape), triton_dtype)
    tensor.set_data_from_numpy(value)
    return tensor


@pytest.mark.parametrize(
    ("inputs", "message"),
    [
        pytest.param(  # half an LLM request, half a token2wav request
            [("input_ids", np.array([[1, 2, 3]], np.int32), "INT32"), ("stream_id", np.array([b"s1"], object), "BYTES")],
            "[invalid_input] engine: inputs", id="mixed",
        ),
        # no engine tensor: a client's request, refused by the contract's codec
        pytest.param([("seed", np.array([3], np.uint64), "UINT64")], contract.TARGET_TEXT.name, id="neither"),
    ],
)
async def test_a_malformed_engine_request_is_invalid_input(pipeline, inputs, message):
    async def requests():
        yield {"model_name": pipeline.llm_model, "inputs": [infer_input(*spec) for spec in inputs],
               "request_id": "malformed"}

    async with aio.InferenceServerClient(pipeline.server.grpc_url) as client:
        errors = [str(error) async for _, error in client.stream_infer(requests()) if error is not None]
    assert len(errors) == 1 and message in errors[0]


async def test_instruct_and_cross_lingual_modes_run_and_count_the_text_they_read(pipeline, tiny_model_dir):
    """input_tokens counts what the LLM read: instruction + target (instruct), the target only (no transcript)."""
    tokenizer = CosyVoice2Tokenizer.from_model_dir(tiny_model_dir)
    target = len(tokenizer.encode(TEXT))
    cases = {
        "instruct": (synthesis_inputs(TEXT, seed=3, instruction="Speak slowly."),
                     len(tokenizer.encode("Speak slowly.<|endofprompt|>")) + target),
        "cross_lingual": (synthesis_inputs(TEXT, seed=3, reference_text=""), target),
        "zero_shot": (synthesis_inputs(TEXT, seed=3), len(tokenizer.encode("a reference")) + target),
    }
    async with aio.InferenceServerClient(pipeline.server.grpc_url) as client:
        for name, (inputs, expected_input_tokens) in cases.items():
            result = await client.infer(contract.OFFLINE_MODEL, inputs)
            output_tokens = int(result.as_numpy(contract.OUTPUT_TOKENS.name)[0])
            assert int(result.as_numpy(contract.INPUT_TOKENS.name)[0]) == expected_input_tokens, name
            assert output_tokens > 0 and result.as_numpy(contract.WAVEFORM.name).size == output_tokens * SAMPLES_PER_TOKEN
        chunks = await stream(client, synthesis_inputs(TEXT, seed=4, instruction="Whisper."))
    assert chunks[-1][3] and sum(w.size for w, *_ in chunks) == chunks[-1][2] * SAMPLES_PER_TOKEN


async def test_every_model_process_froze_its_heap_and_counts_its_collections(pipeline):
    """Each python model's process freezes what it loaded (`speech_serving.heap`) at the end of `initialize` and
    exports its collector's counters beside the model's own stats."""
    models = sorted(path.parent.name for path in pipeline.repo.glob("*/config.pbtxt")
                    if 'backend: "python"' in path.read_text())
    assert models
    metrics = await wait_metrics(pipeline, lambda m: all(m.get(("python_gc_frozen_objects", model)) for model in models))
    for model in models:
        assert metrics.get(("python_gc_frozen_objects", model), 0) > 1000, model  # at least the loaded modules
        for name in ("python_gc_collections_total", "python_gc_full_seconds_total"):
            assert (name, model) in metrics, (name, model)
