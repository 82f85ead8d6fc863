"""The released layout at full size (parameter names and shapes against a full-size build of the reference,
`keys_full.txt`) and the random-model writers: a tiny model runs end to end, a full-size layout loads strictly."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

from cosyvoice3.config import CosyVoice3Config, read_release_yaml
from cosyvoice3.engine import SynthesisRequest
from cosyvoice3.layout import FLOW_FILE, HIFT_FILE, LLM_FILE
from cosyvoice3.loading import load
from cosyvoice3.testing import (
    full_size_modules, release_yaml, tiny_config, write_full_size_layout, write_full_size_model, write_tiny_model,
)  # fmt: skip
from cosyvoice3.token2wav import VoicePrompt
from tests.cosyvoice3.conftest import PARITY_DIR

KEYS_FULL = PARITY_DIR / "keys_full.txt"


def reference_layout() -> dict[str, dict[str, tuple[int, ...]]]:
    files: dict[str, dict[str, tuple[int, ...]]] = {}
    for line in KEYS_FULL.read_text().splitlines():
        if line and not line.startswith("#"):
            file, key, shape, _ = line.split("\t")
            files.setdefault(file, {})[key] = tuple(int(v) for v in shape.strip("[]").split(",") if v.strip())
    return files


@pytest.mark.skipif(not KEYS_FULL.exists(), reason="parity data absent")
def test_full_size_modules_match_the_released_names_and_shapes() -> None:
    expected, counts = reference_layout(), reference_parameter_counts()
    for module, name in zip(full_size_modules(), (LLM_FILE, FLOW_FILE, HIFT_FILE)):
        ours = {k: tuple(v.shape) for k, v in module.state_dict().items()}
        assert ours == expected[name], name
        assert sum(p.numel() for p in module.parameters()) == counts[name], name


def reference_parameter_counts() -> dict[str, int]:
    """`# llm.pt: 293 keys, 506148480 parameters` header lines of keys_full.txt."""
    counts = {}
    for line in KEYS_FULL.read_text().splitlines():
        if line.startswith("#"):
            name, rest = line[1:].strip().split(":", 1)
            counts[name] = int(rest.split(",")[1].split()[0])
    return counts


@pytest.mark.skipif(not KEYS_FULL.exists(), reason="parity data absent")
def test_full_size_layout_loads_strictly(tmp_path: Path) -> None:
    """The files hold every released key at its released shape (stride-0 views: a few MB); loading consumes all
    of them, and the loaded LLM and flow have the reference build's parameter counts (tied head counted once)."""
    engine = load(write_full_size_layout(tmp_path / "full"))
    t2w = engine.token2wav_engine
    counts = reference_parameter_counts()
    for module, name in ((engine.llm, LLM_FILE), (t2w.flow, FLOW_FILE)):
        assert sum(p.numel() for p in module.parameters()) == counts[name], name
    assert t2w.flow.config == CosyVoice3Config().flow and t2w.hift.config.base_channels == 512


@pytest.mark.slow
@pytest.mark.skipif(not KEYS_FULL.exists(), reason="parity data absent")
@pytest.mark.skipif(os.environ.get("COSYVOICE_DENSE_TESTS") != "1",
                    reason="3.4 GB on disk and ~4.5 GB of memory: set COSYVOICE_DENSE_TESTS=1 to run it")
def test_dense_full_size_model_loads_strictly(tmp_path: Path) -> None:
    """A full-size checkpoint as a release stores it (dense fp32 tensors, 3.4 GB on disk; 1-2 minutes and about
    4.5 GB of memory on a 2-core machine, hence slow) loads strictly, takes the file's values, keeps the head tied."""
    model_dir = write_full_size_model(tmp_path / "dense", seed=3)
    engine = load(model_dir)
    counts = reference_parameter_counts()
    t2w = engine.token2wav_engine
    for module, name in ((engine.llm, LLM_FILE), (t2w.flow, FLOW_FILE)):
        assert sum(p.numel() for p in module.parameters()) == counts[name], name
    assert engine.llm.llm.model.lm_head.weight is engine.llm.body.embed_tokens.weight
    for module, name in ((engine.llm, LLM_FILE), (t2w.flow, FLOW_FILE)):
        file = torch.load(model_dir / name, map_location="cpu", weights_only=True, mmap=True)
        ours = module.state_dict()
        assert set(ours) == set(file), name
        for key in list(file)[:: max(1, len(file) // 20)]:  # a spread of keys
            stored = file[key]
            assert stored.untyped_storage().nbytes() >= stored.numel() * stored.element_size(), f"{key}: not dense"
            assert torch.equal(ours[key], stored), f"{name} {key}"


def test_release_yaml_round_trips() -> None:
    for config in (CosyVoice3Config(), tiny_config()):
        parsed = CosyVoice3Config.from_yaml(read_release_yaml(release_yaml(config)), config.llm.qwen.__dict__)
        assert parsed == config


@pytest.fixture(scope="module")
def tiny_engine(tmp_path_factory: pytest.TempPathFactory):
    return load(write_tiny_model(tmp_path_factory.mktemp("tiny_cv3")))


def tiny_voice(prompt_tokens: int = 12) -> VoicePrompt:
    rng = np.random.default_rng(0)
    vocab = tiny_config().flow.vocab_size
    return VoicePrompt.from_arrays(rng.integers(0, vocab, prompt_tokens), rng.normal(-5, 2, (2 * prompt_tokens, 80)),
                                   rng.normal(size=192))


@pytest.mark.parametrize("mode", ["zero_shot", "instruct", "cross_lingual"])
def test_tiny_model_synthesizes_each_mode(tiny_engine, mode: str) -> None:
    eop = tiny_engine.config.llm.endofprompt_id
    text = [100, 200, 300, 400]
    request = {"zero_shot": SynthesisRequest(text, prompt_text=[11, 12, eop, 13], seed=1),
               "instruct": SynthesisRequest(text, prompt_text=[11, 12, 14, eop], mode="instruct", seed=1),
               "cross_lingual": SynthesisRequest([11, 12, eop, *text], mode="cross_lingual", seed=1)}[mode]
    tiny_engine.set_fixed_token_count(30)
    try:
        voice = tiny_voice()
        tokens = list(tiny_engine.speech_tokens(request, voice))
        audio = tiny_engine.synthesize_ids(request, voice)
        streamed = np.concatenate(list(tiny_engine.stream(request, voice, cached=True)))
    finally:
        tiny_engine.set_fixed_token_count(None)
    assert len(tokens) <= 30 and audio.shape == (len(tokens) * 960,)  # silent runs may have been dropped
    # same length as offline; the values differ by design (early chunks use the chunk mask and lookahead context)
    assert streamed.shape == audio.shape and np.isfinite(streamed).all()


def test_tiny_model_refuses_a_text_without_endofprompt(tiny_engine) -> None:
    from cosyvoice3.errors import CosyVoice3InputError

    with pytest.raises(CosyVoice3InputError, match="endofprompt"):
        tiny_engine.decode_request(SynthesisRequest([1, 2, 3], prompt_text=[4, 5]), tiny_voice())
    assert torch.is_tensor(tiny_voice().tokens)
