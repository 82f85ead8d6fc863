"""CosyVoice3 beside CosyVoice2 in ONE tritonserver: `render --cosyvoice3-dir` with a tiny random CosyVoice3 model
next to the tiny CosyVoice2 model (CPU): the contract's models of both, the three voice modes, streaming over the
cached flow path, per-model voice caches, and the gateway in front (the real OpenAI SDK).

CosyVoice3 runs in benchmark mode here: random weights may draw one of the 200 stop ids at once, so every request
generates exactly round(ratio x text ids) tokens instead (the decoding rules themselves, and cached streams
against the recompute reference, are tested without Triton: tests/serving/test_cosyvoice3_serving.py)."""

from __future__ import annotations

import asyncio
import re

import numpy as np
import pytest
import tritonclient.grpc.aio as aio
from tritonclient.utils import InferenceServerException

import pipeline_contract as contract
from cosyvoice3.testing import write_tiny_model
from tests.gateway.audio_checks import FORMAT_RATES, check_speech, decode
from tests.gateway.conftest import wait_for
from tests.gateway.voice_clips import make_clip, upload
from tests.triton.conftest import FIRST_HOP, SAMPLES_PER_TOKEN, offline_chunk, streamed_chunks, synthesis_inputs
from triton_repo.render import CosyVoice3RenderOptions, RenderError, RenderOptions, write_repository

pytestmark = pytest.mark.triton

TEXT = "Hello world, the tiny CosyVoice3 model speaks."
#: small chunks so that a short utterance streams several; one speech token per text id
COSYVOICE3 = dict(first_hop=5, second_hop=6, benchmark_ratio=1.0)


@pytest.fixture(scope="session")
def cosyvoice3_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("cosyvoice3_model"), seed=3)


def _render(model_dir, cv3_dir, out, **cv3):
    return write_repository(RenderOptions(
        model_dir=model_dir, out=out, max_batch=8, max_seq_len=2048, first_hop=FIRST_HOP,
        cosyvoice3=CosyVoice3RenderOptions(cv3_dir, **{**COSYVOICE3, **cv3}),
    ))  # fmt: skip


@pytest.fixture(scope="module")
def both_server(tiny_model_dir, cosyvoice3_dir, tmp_path_factory, triton_server_factory):
    """CosyVoice2 and CosyVoice3 (cached streaming flow, the default) in one tritonserver."""
    server = triton_server_factory(_render(tiny_model_dir, cosyvoice3_dir, tmp_path_factory.mktemp("cv3") / "repo"),
                                   ready_timeout=240)
    yield server
    server.cleanup()


async def _offline(url, model, inputs):
    chunk = await offline_chunk(url, model, inputs)
    return chunk.waveform, chunk.input_tokens, chunk.output_tokens, chunk.sample_rate


async def _stream(url, inputs, model=contract.COSYVOICE3_STREAMING_MODEL):
    async with aio.InferenceServerClient(url) as client:
        chunks = await streamed_chunks(client, model, inputs)
    return [(c.waveform, c.output_tokens, c.sample_rate, c.final) for c in chunks]


async def test_offline_is_24k_with_960_samples_per_token(both_server):
    waveform, _, tokens, rate = await _offline(both_server.grpc_url, contract.COSYVOICE3_OFFLINE_MODEL,
                                               synthesis_inputs(TEXT, seed=3))
    assert rate == 24_000 and tokens > 0 and waveform.size == tokens * SAMPLES_PER_TOKEN
    assert np.isfinite(waveform).all() and np.abs(waveform).max() > 0
    again, *_ = await _offline(both_server.grpc_url, contract.COSYVOICE3_OFFLINE_MODEL, synthesis_inputs(TEXT, seed=3))
    np.testing.assert_array_equal(again, waveform)  # the seed reproduces a request (its voice now cached)


async def test_cosyvoice2_beside_it_is_unchanged(both_server):
    waveform, _, tokens, rate = await _offline(both_server.grpc_url, contract.OFFLINE_MODEL, synthesis_inputs(TEXT))
    assert rate == 24_000 and tokens > 0 and waveform.size == tokens * SAMPLES_PER_TOKEN


async def test_streaming_sends_growing_chunks_of_whole_tokens(both_server):
    chunks = await _stream(both_server.grpc_url, synthesis_inputs(TEXT, seed=4))
    assert len(chunks) >= 3 and [c[3] for c in chunks] == [False] * (len(chunks) - 1) + [True]
    assert {c[2] for c in chunks} == {24_000}
    counts = [c[1] for c in chunks]
    assert counts == sorted(counts) and counts[0] < counts[-1]  # audio left before the LLM had finished
    assert sum(c[0].size for c in chunks) == counts[-1] * SAMPLES_PER_TOKEN
    # the first chunk: the first hop's tokens (5), the HiFT's held-back frames not yet (4 tokens' worth at most)
    assert 0 < chunks[0][0].size <= 5 * SAMPLES_PER_TOKEN


async def test_cached_streams_equal_the_recompute_reference(both_server, tiny_model_dir, cosyvoice3_dir,
                                                             tmp_path_factory, triton_server_factory):
    """The same requests streamed by a repository rendered with `--cosyvoice3-flow-cache recompute` (every chunk
    from scratch, the reference path): the same chunks, equal audio up to float rounding."""
    repo = _render(tiny_model_dir, cosyvoice3_dir, tmp_path_factory.mktemp("cv3_recompute") / "repo",
                   flow_cache="recompute")
    reference = triton_server_factory(repo, ready_timeout=240)
    try:
        for seed, voice in ((7, "voice-ref-a"), (8, "voice-ref-bb")):
            inputs = synthesis_inputs(TEXT, seed=seed, voice=voice)
            cached, recomputed = await _stream(both_server.grpc_url, inputs), await _stream(reference.grpc_url, inputs)
            assert len(cached) >= 3 and [c[1:] for c in cached] == [c[1:] for c in recomputed]
            for ours, theirs in zip(cached, recomputed):
                _assert_equal_but_rounding(ours[0], theirs[0])
    finally:
        reference.cleanup()


def _assert_equal_but_rounding(ours: np.ndarray, theirs: np.ndarray) -> None:
    """Audio equal up to float rounding. Rounding also reaches a discrete decision: HiFT's source marks a sample
    voiced where its upsampled f0 passes the threshold, and an f0 that rounds to the other side of it changes a frame's
    excitation (a few hundred samples, ~5e-4 apart, on one CPU of the test machines). A stale or misplaced cache
    changes the whole chunk instead, so: nine samples in ten within 1e-4, and the difference's RMS a hundredth of
    the chunk's at most."""
    assert ours.shape == theirs.shape
    apart = np.abs(ours - theirs)
    assert np.mean(apart <= 1e-4) >= 0.9, f"{np.mean(apart > 1e-4):.1%} of the samples more than 1e-4 apart"
    assert np.sqrt(np.mean(apart**2)) <= 1e-2 * np.sqrt(np.mean(theirs**2)), "the chunks differ beyond rounding"


def _cosyvoice3_tokenizer(model_dir):
    from cosyvoice3.text import CosyVoice3Tokenizer  # noqa: PLC0415

    return CosyVoice3Tokenizer.from_model_dir(model_dir)


@pytest.mark.parametrize("mode", ["zero_shot", "cross_lingual", "instruct", "instruct_over_transcript"])
async def test_the_request_selects_the_voice_mode(both_server, cosyvoice3_dir, mode):
    """What the LLM read (`input_tokens`) is each mode's text: a transcript -> zero-shot, none -> cross-lingual, an
    instruction -> instruct (also with a transcript, which is then unused, as in CosyVoice2)."""
    from cosyvoice3.prompts import cross_lingual_text, instruct_prompt, zero_shot_prompt  # noqa: PLC0415

    tokenizer = _cosyvoice3_tokenizer(cosyvoice3_dir)
    transcript = {"zero_shot": "a reference", "instruct_over_transcript": "a reference"}.get(mode, "")
    instruction = "Speak slowly." if mode.startswith("instruct") else None
    expected = {
        "zero_shot": len(tokenizer.encode(zero_shot_prompt(transcript))) + len(tokenizer.encode(TEXT)),
        "cross_lingual": len(tokenizer.encode(cross_lingual_text(TEXT))),
    }.get(mode, len(tokenizer.encode(instruct_prompt("Speak slowly."))) + len(tokenizer.encode(TEXT)))
    waveform, input_tokens, tokens, _ = await _offline(
        both_server.grpc_url, contract.COSYVOICE3_OFFLINE_MODEL,
        synthesis_inputs(TEXT, seed=5, reference_text=transcript, instruction=instruction),
    )  # fmt: skip
    assert input_tokens == expected and waveform.size == tokens * SAMPLES_PER_TOKEN > 0


async def test_voices_by_id_are_per_model(both_server):
    """A voice CosyVoice2 holds is unknown to CosyVoice3 by id (its prompt holds other tokens and another mel);
    once sent to CosyVoice3 with its audio, both CosyVoice3 models serve it by id alone."""
    url, voice = both_server.grpc_url, "voice-per-model"
    await _offline(url, contract.OFFLINE_MODEL, synthesis_inputs("", voice=voice))  # CosyVoice2 holds it
    with pytest.raises(InferenceServerException, match=r"\[unknown_voice\]"):
        await _offline(url, contract.COSYVOICE3_OFFLINE_MODEL, synthesis_inputs(TEXT, voice=voice, by_id=True))
    warm = await _offline(url, contract.COSYVOICE3_OFFLINE_MODEL, synthesis_inputs("", voice=voice))
    assert warm[0].size == 0 and warm[2] == 0  # the warm-up rule: the prompt only
    waveform, _, tokens, _ = await _offline(url, contract.COSYVOICE3_OFFLINE_MODEL,
                                            synthesis_inputs(TEXT, voice=voice, seed=6, by_id=True))
    assert tokens > 0 and waveform.size == tokens * SAMPLES_PER_TOKEN
    streamed = await _stream(url, synthesis_inputs(TEXT, voice=voice, seed=6, by_id=True))
    assert streamed[-1][1] == tokens  # the same seed and voice: the same tokens, streamed


@pytest.mark.parametrize("inputs, message", [
    (lambda: synthesis_inputs(TEXT, seconds=0.05), "reference_wav_len"),
    (lambda: synthesis_inputs("word " * (contract.MAX_SEGMENT_TOKENS + 1)), "at most 300"),
], ids=["short-reference", "long-segment"])
async def test_cosyvoice3_refuses_what_the_contract_refuses(both_server, inputs, message):
    with pytest.raises(InferenceServerException, match=rf"\[invalid_input\].*{message}"):
        await _offline(both_server.grpc_url, contract.COSYVOICE3_OFFLINE_MODEL, inputs())


async def test_concurrent_streams_and_the_engines_metrics(both_server):
    url = both_server.grpc_url
    results = await asyncio.gather(*(_stream(url, synthesis_inputs(TEXT, seed=10 + k, voice=f"voice-{'c' * k}"))
                                     for k in range(1, 4)))
    for chunks in results:
        assert chunks[-1][3] and sum(c[0].size for c in chunks) == chunks[-1][1] * SAMPLES_PER_TOKEN
    import urllib.request  # noqa: PLC0415

    text = urllib.request.urlopen(both_server.metrics_url).read().decode()
    # the LLM scheduler and token2wav service run inside cosyvoice3_stream (the engine's process, its streaming
    # orchestrator beside them), exported under its name
    for stat in ("llm_finished_total", "token2wav_chunks_total", "orchestrator_requests_total",
                 "token2wav_flow_frames_needed_total", "token2wav_flow_frames_computed_total"):
        assert re.search(rf'^cosyvoice2_{stat}\{{model="cosyvoice3_stream"\}} [1-9]', text, re.M), stat


def test_render_without_cosyvoice3_dir_renders_no_cosyvoice3_model(tiny_model_dir, tmp_path):
    repo = write_repository(RenderOptions(model_dir=tiny_model_dir, out=tmp_path / "repo"))
    assert not any(p.name.startswith("cosyvoice3") for p in repo.iterdir())


def test_render_refuses_an_incomplete_cosyvoice3_dir(tiny_model_dir, cosyvoice3_dir, tmp_path):
    import shutil  # noqa: PLC0415

    broken = tmp_path / "broken"
    shutil.copytree(cosyvoice3_dir, broken)
    (broken / "speech_tokenizer_v3.onnx").unlink()
    with pytest.raises(RenderError, match=r"--cosyvoice3-dir .* lacks speech_tokenizer_v3\.onnx"):
        _render(tiny_model_dir, broken, tmp_path / "repo")
    with pytest.raises(RenderError, match="--cosyvoice3-flow-cache must be one of cached, chunked, recompute"):
        _render(tiny_model_dir, cosyvoice3_dir, tmp_path / "repo", flow_cache="sometimes")


def test_render_keeps_the_stream_that_holds_the_engine_one_instance(tiny_model_dir, cosyvoice3_dir, tmp_path):
    with pytest.raises(RenderError, match=r"--instances cosyvoice3_stream=2: cosyvoice3_stream holds the engine"):
        write_repository(RenderOptions(model_dir=tiny_model_dir, out=tmp_path / "repo",
                                       instances={contract.COSYVOICE3_STREAMING_MODEL: 2},
                                       cosyvoice3=CosyVoice3RenderOptions(cosyvoice3_dir, **COSYVOICE3)))
    # the offline entry model orchestrates over BLS, so it may have several
    repo = write_repository(RenderOptions(model_dir=tiny_model_dir, out=tmp_path / "repo2",
                                          instances={contract.COSYVOICE3_OFFLINE_MODEL: 2},
                                          cosyvoice3=CosyVoice3RenderOptions(cosyvoice3_dir, **COSYVOICE3)))
    assert "count: 2" in (repo / contract.COSYVOICE3_OFFLINE_MODEL / "config.pbtxt").read_text()
    assert not (repo / "cosyvoice3_engine").exists()
    assert not (tmp_path / "repo").exists()


# -- through the gateway (`both_gateway`), with the OpenAI SDK -------------------------------------------------
def test_the_gateway_lists_cosyvoice3_beside_cosyvoice2(both_gateway):
    models = [m.id for m in both_gateway.client().models.list()]
    assert models[-1] == "cosyvoice3" and "tts-1" in models and "spark-tts" not in models


@pytest.mark.parametrize("stream", [False, True], ids=["offline", "streaming"])
@pytest.mark.parametrize("response_format", sorted(FORMAT_RATES))
def test_the_gateway_serves_cosyvoice3_in_every_format(both_gateway, response_format, stream):
    data = both_gateway.client().audio.speech.create(
        model="cosyvoice3", voice="alloy", input="Hello from CosyVoice3.", response_format=response_format,
        extra_body={"stream": stream, "seed": 11},
    ).read()
    check_speech(data, response_format, whole=SAMPLES_PER_TOKEN)


@pytest.mark.parametrize("voice", ["amy", "ben", "clara", "dave"])
def test_every_shipped_voice_speaks_with_cosyvoice3(both_gateway, voice):
    data = both_gateway.client().audio.speech.create(
        model="cosyvoice3", voice=voice, input="A shipped voice.", response_format="wav",
        extra_body={"stream": False, "seed": 2},
    ).read()  # fmt: skip
    samples, rate = decode(data, "wav")
    assert rate == 24_000 and samples.size > 0


@pytest.mark.parametrize("stream", [False, True], ids=["offline", "streaming"])
def test_the_gateway_speaks_instructions_in_cosyvoice3s_instruct_mode(both_gateway, stream):
    data = both_gateway.client().audio.speech.create(
        model="cosyvoice3", voice="nova", input="Slowly now.", response_format="pcm", instructions="Speak slowly.",
        extra_body={"stream": stream, "seed": 3},
    ).read()  # fmt: skip
    samples, _ = decode(data, "pcm")
    assert samples.size > 0 and samples.size % SAMPLES_PER_TOKEN == 0


def test_an_uploaded_voice_speaks_with_both_models_and_warms_cosyvoice3(both_gateway, both_server):
    def cache_entries() -> float:
        import urllib.request  # noqa: PLC0415

        text = urllib.request.urlopen(both_server.metrics_url).read().decode()
        found = re.search(r'^cosyvoice2_voice_cache_entries\{model="cosyvoice3_voice_prompt"\} (\S+)$', text, re.M)
        return float(found.group(1)) if found else 0.0

    before = cache_entries()
    with both_gateway.http() as http:
        created = upload(http, name="Threefold", audio=make_clip("wav", 1.5), transcript="Words of the clip.")
    assert created.status_code == 200, created.text
    # the upload computed CosyVoice3's prompt of it (metrics are published within ~100 ms; a loaded machine lags)
    assert wait_for(lambda: cache_entries() == before + 1, timeout=15)
    for model in ("tts-1", "cosyvoice3"):
        for stream in (False, True):
            data = both_gateway.client().audio.speech.create(model=model, voice="Threefold", input="Hi there.",
                                                            response_format="wav", extra_body={"stream": stream}).read()
            samples, rate = decode(data, "wav")
            assert rate == 24_000 and samples.size > 0


# -- the served LLM without Triton (benchmark mode above draws no stop id and filters nothing) -------------------
class _LLMCall:
    """One request to an `LLMHandler`, as the python backend hands it over, and the responses it sends."""

    def __init__(self, arrays: dict) -> None:
        self.arrays, self.sent = arrays, []

    def request_id(self) -> str:
        return "42"

    def send(self, response=None, flags=0) -> None:
        self.sent.append((response, flags))


async def test_the_served_llm_sends_the_engines_tokens_with_silent_runs_dropped(adapters, monkeypatch,
                                                                                cosyvoice3_dir):
    """CosyVoice3's `LLMHandler` (the shared scheduler, CosyVoice3's sampler and silent-run filter) answers an
    orchestrator's request with exactly the engine's `generate` tokens. Every token counts as silent here, with
    runs of at most 3 kept, so the filter visibly acts: the request sends 3 tokens."""
    import dataclasses  # noqa: PLC0415
    import sys  # noqa: PLC0415

    from cosyvoice3.llm import SilentTokenFilter, generate, sampling_params  # noqa: PLC0415
    from cosyvoice3.loading import load  # noqa: PLC0415
    from speech_serving.cosyvoice3 import CosyVoice3Orchestrator, cosyvoice3_schedule, cosyvoice3_vocab  # noqa: PLC0415
    from speech_serving.engines import build_decode_request  # noqa: PLC0415
    from speech_serving.io_struct import PromptTensors  # noqa: PLC0415
    from speech_serving.orchestrator import OrchestratorConfig  # noqa: PLC0415
    from triton_repo import internal_io as io  # noqa: PLC0415
    from triton_repo.model_params import DecoderParams  # noqa: PLC0415

    stub = sys.modules["triton_python_backend_utils"]
    monkeypatch.setattr(stub, "get_input_tensor_by_name", lambda call, name: _Tensor.of(call.arrays, name),
                        raising=False)
    monkeypatch.setattr(stub, "Tensor", lambda name, value: (name, value), raising=False)
    monkeypatch.setattr(stub, "InferenceResponse", lambda output_tensors: dict(output_tensors), raising=False)
    llm_adapter = adapters("llm")

    engine = load(cosyvoice3_dir)
    config = dataclasses.replace(engine.config.llm, silent_tokens=tuple(range(6561)), max_silent_run=3)
    engine.llm.config = config
    vocab = cosyvoice3_vocab(engine.config)
    params = DecoderParams(model_dir=cosyvoice3_dir, device="cpu", dtype="fp32", max_batch=2, max_seq_len=1024,
                           max_waiting=4)
    handler = llm_adapter.LLMHandler(engine.llm, vocab, params, sampling_params(config),
                                     lambda: SilentTokenFilter.for_config(config).accept)
    orchestrator = CosyVoice3Orchestrator(OrchestratorConfig(vocab=vocab, schedule=cosyvoice3_schedule(engine.config)),
                                          engine.tokenizer, clients=None)  # type: ignore[arg-type]
    rng = np.random.default_rng(0)
    prompt = PromptTensors(rng.integers(0, 6561, 12).astype(np.int32), np.zeros((24, 80), np.float32),
                           np.zeros(192, np.float32))
    lengths = []
    try:
        for seed in range(1, 6):
            request = contract.SpeechRequest(np.zeros(1600, np.float32), "a reference", TEXT, "v", seed)
            llm_request, _ = orchestrator.build_llm_request(request, prompt, streaming=False)
            call = _LLMCall(io.llm_request_tensors(llm_request, vocab, None))
            await handler.handle(call, call)
            [(response, _)] = call.sent  # offline: one response
            sent = vocab.to_speech_tokens(np.asarray(io.llm_response_ids(response))).tolist()
            decode = build_decode_request(llm_request.input_ids, vocab, llm_request.min_tokens,
                                          llm_request.max_tokens, seed, llm_request.top_k, llm_request.top_p,
                                          sampling_params(config))
            assert sent == list(generate(engine.llm, decode))
            lengths.append(len(sent))
    finally:
        handler.close()
    assert max(lengths) == 3  # the filter cut the sequences that ran on (random weights stop early at times)


class _Tensor:
    def __init__(self, value: np.ndarray) -> None:
        self.value = value

    def as_numpy(self) -> np.ndarray:
        return self.value

    @classmethod
    def of(cls, arrays: dict, name: str) -> "_Tensor | None":
        return cls(arrays[name]) if name in arrays else None
