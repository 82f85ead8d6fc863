"""CosyVoice3's serving parts without Triton, on the tiny random CosyVoice3 model: the orchestrator's LLM requests
per voice mode, their decoding by the shared LLM path equal to the engine's own, and the token2wav engine behind
the token2wav service (cached streams equal the recompute reference, also past a flow-cache budget; offline jobs
equal the engine's offline audio; a bad job fails alone)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import cosyvoice3
from cosyvoice2.frontend.llm_prompt import llm_prompt
from cosyvoice2.streaming import Chunk
from cosyvoice3.llm import CosyVoice3LM, sampling_params
from cosyvoice3.prompts import cross_lingual_text, instruct_prompt, zero_shot_prompt
from cosyvoice3.testing import write_tiny_model
from cosyvoice3.text import CosyVoice3Tokenizer
from cosyvoice3.token2wav import CosyVoice3Token2Wav, VoicePrompt
from pipeline_contract import SpeechRequest
from speech_serving.cosyvoice3 import CosyVoice3Orchestrator, cosyvoice3_schedule, cosyvoice3_vocab
from speech_serving.engines import CosyVoice3BatchedToken2Wav, build_decode_request
from speech_serving.errors import InvalidInput
from speech_serving.io_struct import PromptTensors
from speech_serving.orchestrator import OrchestratorConfig
from speech_serving.token2wav import Work
from speech_lm.decode import generate_tokens

AUDIO_ATOL = 1e-4  # cached and recompute flows agree to float rounding (docs/cosyvoice3.md: 1.2e-6 on the mel)
TARGET = "Hello there, how are you today?"
TRANSCRIPT = "What the reference says."


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> cosyvoice3.CosyVoice3:
    return cosyvoice3.load(write_tiny_model(tmp_path_factory.mktemp("cv3"), seed=5))


@pytest.fixture(scope="module")
def orchestrator(engine) -> CosyVoice3Orchestrator:
    config = OrchestratorConfig(vocab=cosyvoice3_vocab(engine.config), schedule=cosyvoice3_schedule(engine.config))
    return CosyVoice3Orchestrator(config, engine.tokenizer, clients=None)  # type: ignore[arg-type]


def voice(rng: np.random.Generator, tokens: int) -> PromptTensors:
    return PromptTensors(rng.integers(0, 6561, tokens).astype(np.int32),
                         (rng.standard_normal((2 * tokens, 80)) - 5).astype(np.float32),
                         rng.standard_normal(192).astype(np.float32))


def request(reference_text: str = "", instruction: str = "", seed: int = 7) -> SpeechRequest:
    return SpeechRequest(np.zeros(1600, np.float32), reference_text, TARGET, "voice", seed, instruction)


def test_the_three_modes_give_the_llm_texts_of_the_engine(orchestrator, engine):
    tokenizer: CosyVoice3Tokenizer = engine.tokenizer
    vocab = orchestrator.config.vocab
    prompt = voice(np.random.default_rng(0), 12)
    target = tokenizer.encode(TARGET)
    transcript = llm_prompt(TRANSCRIPT).text  # normalized, as CosyVoice2's zero-shot prompt
    speech = (prompt.speech_tokens + vocab.speech_offset).tolist()
    cases = {
        "zero_shot": (request(TRANSCRIPT), tokenizer.encode(zero_shot_prompt(transcript)), target, speech),
        "instruct": (request(instruction=" Speak slowly. "), tokenizer.encode(instruct_prompt("Speak slowly.")),
                     target, []),
        # an instruction wins over the transcript, as in CosyVoice2 (the transcript is then unused)
        "instruct over transcript": (request(TRANSCRIPT, "Speak slowly."),
                                     tokenizer.encode(instruct_prompt("Speak slowly.")), target, []),
        "cross_lingual": (request(), [], tokenizer.encode(cross_lingual_text(TARGET)), []),
    }
    for name, (speech_request, prompt_ids, text_ids, speech_ids) in cases.items():
        llm_request, input_tokens = orchestrator.build_llm_request(speech_request, prompt, streaming=True)
        expected = [vocab.sos_id, *prompt_ids, *text_ids, vocab.task_id_id, *speech_ids]
        assert llm_request.input_ids.tolist() == expected, name
        assert input_tokens == len(prompt_ids) + len(text_ids), name
        assert (llm_request.min_tokens, llm_request.max_tokens) == (2 * len(text_ids), 20 * len(text_ids)), name
        # the served runtime's schedule: 15, then 25 doubling, 3 lookahead tokens each, up to the length limit
        due = (18, 43, 93, 193, 393, 793)
        assert llm_request.deliver_at == tuple(d for d in due if d <= llm_request.max_tokens), name
        assert len(llm_request.deliver_at) >= 3, name


def test_a_long_segment_is_refused(orchestrator):
    long = SpeechRequest(np.zeros(1600, np.float32), "", "word " * 400, "voice", 1)
    with pytest.raises(InvalidInput, match="at most 300"):
        orchestrator.build_llm_request(long, voice(np.random.default_rng(1), 5), streaming=False)


@pytest.mark.parametrize("mode", ["zero_shot", "instruct", "cross_lingual"])
def test_the_served_llm_request_decodes_the_engines_tokens(orchestrator, engine, mode):
    """The orchestrator's flat request, taken apart by the LLM model (`build_decode_request` with CosyVoice3's
    sampler), decodes exactly the tokens of the engine's own request for the same text, voice and seed."""
    prompt = voice(np.random.default_rng(2), 10)
    fields = {"zero_shot": dict(reference_text=TRANSCRIPT), "instruct": dict(instruction="Speak slowly."),
              "cross_lingual": {}}[mode]
    llm: CosyVoice3LM = engine.llm
    voice_prompt = VoicePrompt.from_arrays(prompt.speech_tokens, prompt.mel, prompt.embedding)
    transcript = llm_prompt(TRANSCRIPT).text if mode == "zero_shot" else None
    decoded = 0
    for seed in range(1, 7):  # random weights may stop at once: several seeds, so that tokens are compared
        llm_request, _ = orchestrator.build_llm_request(request(**fields, seed=seed), prompt, streaming=False)
        served = build_decode_request(
            llm_request.input_ids, orchestrator.config.vocab, llm_request.min_tokens, llm_request.max_tokens,
            llm_request.seed, llm_request.top_k, llm_request.top_p, sampling_params(engine.config.llm),
        )  # fmt: skip
        ours = list(generate_tokens(llm, served))  # type: ignore[arg-type]
        own = engine.text_request(TARGET, transcript, fields.get("instruction"), seed=seed)
        expected = list(generate_tokens(llm, engine.decode_request(own, voice_prompt)))  # type: ignore[arg-type]
        assert ours == expected, seed
        # (fewer than min_tokens is possible: below it only one of the 200 stop ids is masked, as in the reference)
        assert len(ours) <= llm_request.max_tokens
        decoded += len(ours)
    assert decoded >= 20


def _streams(engine: cosyvoice3.CosyVoice3, cached: bool, seed: int,
             budget: int | None = None) -> list[list[np.ndarray]]:
    """Two streams of two voices in rounds of the orchestrator's chunks, one offline job beside the first round
    (its audio: the engine's offline audio); each stream's pieces add up to 960 samples per token. `budget`: the
    streams' flow caches run under that budget (a token2wav of their own), which is all returned at the end."""
    rng = np.random.default_rng(seed)
    token2wav: CosyVoice3Token2Wav = engine.token2wav_engine
    if budget is not None:
        token2wav = CosyVoice3Token2Wav(token2wav.flow, token2wav.hift, token2wav.schedule, cache_budget_bytes=budget)
    batched = CosyVoice3BatchedToken2Wav(token2wav, cached=cached)
    voices = [voice(rng, 23), voice(rng, 31)]
    tokens = [rng.integers(0, 6561, n).astype(np.int32) for n in (40, 28)]
    schedule = cosyvoice3_schedule(engine.config, first_hop=5, second_hop=6)
    plans = [schedule.chunks(t.size) for t in tokens]
    states = [batched.open(v, 1) for v in voices]
    offline = Work(batched.open(voices[1], 2), rng.integers(0, 6561, 17).astype(np.int32), None)
    out: list[list[np.ndarray]] = [[], []]
    offline_audio = np.zeros(0)
    for index in range(max(map(len, plans))):
        work, owners = [], []
        for k, (state, plan) in enumerate(zip(states, plans)):
            if index < len(plan):
                sent = plan[index - 1].feed if index else 0
                work.append(Work(state, tokens[k][sent: plan[index].feed], plan[index]))
                owners.append(k)
        if index == 0:
            work.append(offline)
        results = batched.run(work)
        for k, audio in zip(owners, results):
            assert isinstance(audio, np.ndarray)
            out[k].append(audio)
        if index == 0:
            offline_audio = results[-1]
    expected_offline = token2wav.offline(offline.tokens.tolist(), offline.state.prompt)
    np.testing.assert_allclose(offline_audio, expected_offline, atol=AUDIO_ATOL)
    for pieces, t in zip(out, tokens):
        assert len(pieces) >= 4 and sum(p.size for p in pieces) == 960 * t.size
    assert token2wav.cache_bytes == 0  # every stream ran its final chunk
    return out


def _assert_same_pieces(streams: list[list[np.ndarray]], reference: list[list[np.ndarray]]) -> None:
    for ours, theirs in zip(streams, reference):
        assert [p.size for p in ours] == [p.size for p in theirs]
        for a, b in zip(ours, theirs):
            np.testing.assert_allclose(a, b, atol=AUDIO_ATOL)


def test_cached_streams_equal_the_recompute_reference(engine):
    _assert_same_pieces(_streams(engine, cached=True, seed=3), _streams(engine, cached=False, seed=3))


def test_streams_past_the_flow_cache_budget_recompute_the_same_audio(engine):
    """A budget of one byte: every cached stream drops its cache at its first chunk and recomputes from then on."""
    _assert_same_pieces(_streams(engine, cached=True, seed=3, budget=1), _streams(engine, cached=False, seed=3))


def test_a_bad_job_fails_alone(engine):
    batched = CosyVoice3BatchedToken2Wav(engine.token2wav_engine, cached=True)
    rng = np.random.default_rng(4)
    good = Work(batched.open(voice(rng, 9), 1), rng.integers(0, 6561, 12).astype(np.int32), None)
    bad_token = Work(batched.open(voice(rng, 9), 1), np.array([3, 10**6], np.int32), None)
    bad_chunk = Work(batched.open(voice(rng, 9), 1), rng.integers(0, 6561, 30).astype(np.int32),
                     Chunk(start=7, stop=20, feed=23, final=False))  # does not continue its fresh stream
    with torch.inference_mode():
        results = batched.run([good, bad_token, bad_chunk])
    assert isinstance(results[0], np.ndarray) and results[0].size == 960 * 12
    assert isinstance(results[1], InvalidInput) and isinstance(results[2], Exception)


def test_the_served_vocoder_calls_are_counted(engine):
    """The served token2wav reports its vocoder calls as HiFT calls (replayed, eager): on the CPU it captures nothing
    and its calls run eagerly, uncounted; with its vocoder graphs emulated every non-final call of a stream cut by the
    engine's schedule replays and the final call runs eagerly."""
    token2wav: CosyVoice3Token2Wav = engine.token2wav_engine
    batched = CosyVoice3BatchedToken2Wav(token2wav, cached=True)
    assert batched.capture_graphs() == (0, 0.0)
    rng = np.random.default_rng(6)
    tokens = rng.integers(0, 6561, 95).astype(np.int32)
    plan = token2wav.schedule.chunks(tokens.size)
    graphs = token2wav.vocoder_graphs

    def run() -> None:
        state = batched.open(voice(rng, 9), 1)
        sent = 0
        for chunk in plan:
            assert isinstance(batched.run([Work(state, tokens[sent:chunk.feed], chunk)])[0], np.ndarray)
            sent = chunk.feed

    before = batched.hift_calls()
    run()
    assert batched.hift_calls() == before
    graphs.emulate = True
    try:
        run()
    finally:
        graphs.emulate = False
    replayed, eager = (now - was for now, was in zip(batched.hift_calls(), before))
    assert len(plan) == 4 and (replayed, eager) == (3, 1)


@pytest.mark.parametrize("tokens", [0, 3, 17, 18, 43, 44, 150, 1000])
def test_the_orchestrators_schedule_is_the_engines_served_schedule(tokens):
    """The orchestrator's chunks (CosyVoice2's `ChunkSchedule` with a second hop, torch-free) are exactly the
    engine's served-runtime chunks (`cosyvoice3.token2wav.runtime_schedule`): 15, 25, 50, 100, ... no cap."""
    from cosyvoice3.config import CosyVoice3Config  # noqa: PLC0415
    from cosyvoice3.token2wav import runtime_schedule  # noqa: PLC0415

    served = cosyvoice3_schedule(CosyVoice3Config())
    assert served.chunks(tokens) == runtime_schedule().chunks(tokens)
    assert [served.hop(i) for i in range(5)] == [15, 25, 50, 100, 200]


def test_a_second_hop_outside_its_bounds_is_refused():
    from cosyvoice2.streaming import ChunkSchedule  # noqa: PLC0415

    for second_hop in (3, 101):
        with pytest.raises(ValueError, match="second_hop"):
            ChunkSchedule(first_hop=15, second_hop=second_hop, max_hop=100)
