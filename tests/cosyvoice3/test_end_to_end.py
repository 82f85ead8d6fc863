"""One offline call end to end on the tiny random model: text -> ids -> LLM (fixed length: random weights never
stop sensibly) -> flow -> HiFT -> audio, with the voice built from a reference recording, for the three modes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import soundfile

from cosyvoice3.config import SYSTEM_PROMPT
from cosyvoice3.errors import CosyVoice3InputError, CosyVoice3ModelError
from cosyvoice3.loading import load
from cosyvoice3.testing import write_tiny_model
from tests.engine.test_frontend_prompt import speech_like

TOKENS = 24
TEXT = "Hello world, hello there."
TRANSCRIPT = "the reference says this"
INSTRUCTION = "Please speak slowly."
MODES = {"zero_shot": {"reference_text": TRANSCRIPT}, "instruct": {"instruction": INSTRUCTION},
         "cross_lingual": {}}


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory):
    engine = load(write_tiny_model(tmp_path_factory.mktemp("tiny_cv3_text")), onnx_providers=["CPUExecutionProvider"])
    engine.set_fixed_token_count(TOKENS)
    return engine


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("ref") / "reference.wav"
    soundfile.write(path, speech_like(1.2, 22050, seed=5), 22050, subtype="PCM_16")
    return path


@pytest.mark.parametrize("mode", list(MODES))
def test_synthesize_text_in_each_mode(engine, reference: Path, mode: str) -> None:
    fields = MODES[mode]
    voice = engine.prepare_voice(reference)
    assert voice.tokens.numel() == 30 and voice.mel.shape == (60, 80)  # 1.2 s at 25 tokens / 50 frames per second

    request = engine.text_request(TEXT, seed=3, **fields)
    assert request.mode == mode
    tok = engine.tokenizer
    eop = engine.config.llm.endofprompt_id
    system, target = tok.encode(SYSTEM_PROMPT), tok.encode(TEXT)
    decode = engine.decode_request(request, voice)
    if mode == "zero_shot":
        expected = (target, [*system, eop, *tok.encode(TRANSCRIPT)], voice.tokens.tolist())
    elif mode == "instruct":
        expected = (target, [*tok.encode(f"{SYSTEM_PROMPT} {INSTRUCTION}"), eop], [])
    else:
        expected = ([*system, eop, *target], [], [])
    p = decode.prefix
    assert (list(p.text), list(p.prompt_text), list(p.prompt_speech_tokens)) == expected
    # the LLM input: [sos, prompt text ++ text, task, prompt speech]
    prefix = engine.llm.embed_prefix(p)
    assert prefix.shape[1] == 1 + len(expected[1]) + len(expected[0]) + 1 + len(expected[2])

    tokens = list(engine.speech_tokens(request, voice))  # the same seed draws the same tokens
    assert 0 < len(tokens) <= TOKENS  # runs of more than 5 silent tokens may be dropped
    audio = engine.synthesize(TEXT, reference, seed=3, **fields)
    assert audio.dtype == np.float32 and np.isfinite(audio).all() and np.abs(audio).max() > 0
    assert audio.shape == (len(tokens) * engine.token2wav_engine.samples_per_token,)
    assert engine.token2wav_engine.samples_per_token == engine.sample_rate // 25
    # the same call with samples instead of a file, and with the ready voice, gives the same audio
    wav, rate = soundfile.read(reference, dtype="float32")
    np.testing.assert_array_equal(engine.synthesize(TEXT, (wav, rate), seed=3, **fields), audio)
    np.testing.assert_array_equal(engine.synthesize(TEXT, voice, seed=3, **fields), audio)


def test_text_level_errors(engine, reference: Path, tmp_path: Path) -> None:
    with pytest.raises(CosyVoice3InputError, match="not both"):
        engine.synthesize(TEXT, reference, reference_text=TRANSCRIPT, instruction=INSTRUCTION)
    with pytest.raises(CosyVoice3InputError, match="empty"):
        engine.synthesize("  ", reference)
    with pytest.raises(CosyVoice3InputError, match="sample rate"):
        engine.synthesize(TEXT, (np.zeros(8000, np.float32), 8000))
    bare = load(write_tiny_model(tmp_path / "bare", text_frontend=False))
    with pytest.raises(CosyVoice3ModelError, match="tokenizer"):
        bare.text_request(TEXT)
    with pytest.raises(CosyVoice3ModelError, match="frontend"):
        bare.prepare_voice(reference)
