"""Strict loading of the released layout: the micro model loads; damaged files are rejected naming the tensor;
the full-size released layout (built on the meta device) has the release's tensor count and file sizes and loads
into our modules strictly."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from speech_lm.qwen2 import Qwen2Config
from spark_tts import layout
from spark_tts.codec.bicodec import BiCodec
from spark_tts.codec.speaker import EcapaWidths
from spark_tts.codec.wav2vec2 import Wav2Vec2Features
from spark_tts.config import BiCodecConfig, Wav2Vec2Params
from spark_tts.errors import SparkError, SparkModelError
from spark_tts.llm import SparkLM, SparkLMConfig
from spark_tts.loading import (
    LLMFileConfig,
    _fold,
    load_bicodec,
    load_llm,
    load_wav2vec2,
    released_bicodec_shapes,
    released_llm_shapes,
    released_wav2vec2_shapes,
)
from tests.spark.conftest import MICRO_DIR, needs_parity_data


def _size(shapes) -> int:
    return sum(math.prod(s) for s in shapes.values())


# ---- full size, released layout --------------------------------------------------------------------------------
def test_full_size_bicodec_layout_is_the_release() -> None:
    shapes = released_bicodec_shapes(BiCodecConfig(), EcapaWidths())
    assert len(shapes) == 840  # the released file's tensor count (mel window/filterbank are not stored)
    assert 625e6 < 4 * _size(shapes) < 626e6  # BiCodec/model.safetensors: 626 MB of fp32
    state = {k: torch.empty(v, device="meta") for k, v in shapes.items()}
    with torch.device("meta"):
        model = BiCodec(BiCodecConfig(), EcapaWidths())
    model.load_state_dict(_fold(state, model.weight_normed()), strict=True, assign=True)


def test_full_size_wav2vec2_layout_is_the_release() -> None:
    shapes = released_wav2vec2_shapes(Wav2Vec2Params())
    assert 1.269e9 < 4 * _size(shapes) < 1.271e9  # pytorch_model.bin: 1.27 GB of fp32 (~317 M parameters)
    assert sum(k.startswith("wav2vec2.encoder.layers.23.") for k in shapes) == 16  # all 24 layers are in the file
    with torch.device("meta"):
        model = Wav2Vec2Features(Wav2Vec2Params())
    assert len(model.encoder.layers) == 16  # only the layers the feature mix reads are built
    assert all("wav2vec2." + k in shapes or k == "encoder.pos_conv_embed.conv.weight" for k in model.state_dict())


def test_full_size_llm_layout_is_the_release() -> None:
    config = LLMFileConfig(Qwen2Config(vocab_size=166000), tied=True)
    shapes = released_llm_shapes(config)
    assert "lm_head.weight" not in shapes
    assert 506e6 < _size(shapes) < 508e6  # ~507 M parameters (tied head)
    with torch.device("meta"):
        model = SparkLM(SparkLMConfig(qwen=config.qwen, eos_id=151645))
    model.load_released({k: torch.empty(v, device="meta") for k, v in shapes.items()}, tied=True)
    assert model.llm.lm_head.weight is model.llm.model.embed_tokens.weight


# ---- the micro model and damaged copies --------------------------------------------------------------------------
@pytest.fixture()
def micro_copy(tmp_path: Path) -> Path:
    target = tmp_path / "Spark-TTS-micro"
    shutil.copytree(MICRO_DIR, target)
    return target


@needs_parity_data
def test_micro_loads_strictly(micro_copy: Path) -> None:
    assert isinstance(load_bicodec(micro_copy), BiCodec)
    assert len(load_wav2vec2(micro_copy).encoder.layers) == 16
    assert load_llm(micro_copy).config.eos_id == 514


@needs_parity_data
@pytest.mark.parametrize("damage, message", [
    (lambda s: s.pop("decoder.model.0.weight_g"), "missing keys.*decoder.model.0.weight_g"),
    (lambda s: s.update({"encoder.extra.weight": torch.zeros(2)}), "unexpected keys.*encoder.extra.weight"),
    (lambda s: s.update({"quantizer.codebook.weight": torch.zeros(8192, 4)}), "wrong shapes.*quantizer.codebook"),
])
def test_damaged_bicodec_is_rejected(micro_copy: Path, damage, message: str) -> None:
    path = micro_copy / layout.BICODEC_WEIGHTS_FILE
    state = load_file(path)
    damage(state)
    save_file(state, path)
    with pytest.raises(SparkModelError, match=message):
        load_bicodec(micro_copy)


@needs_parity_data
def test_wav2vec2_without_its_unused_tensors_is_rejected(micro_copy: Path) -> None:
    """The strict check covers the whole released file, the 16 used layers' tensors and the rest alike."""
    path = micro_copy / layout.WAV2VEC2_WEIGHTS_FILE
    state = torch.load(path, weights_only=True)
    del state["project_hid.weight"]
    torch.save(state, path)
    with pytest.raises(SparkModelError, match="project_hid.weight"):
        load_wav2vec2(micro_copy)


@needs_parity_data
def test_llm_with_an_untied_head_is_rejected(micro_copy: Path) -> None:
    path = micro_copy / layout.LLM_WEIGHTS_FILE
    state = load_file(path)
    state["lm_head.weight"] = state["model.embed_tokens.weight"].clone()
    save_file(state, path)
    with pytest.raises(SparkModelError, match="unexpected keys.*lm_head.weight"):
        load_llm(micro_copy)


def test_missing_directory_files_are_named(tmp_path: Path) -> None:
    from spark_tts.engine import SparkTTS

    (tmp_path / "BiCodec").mkdir()
    (tmp_path / "config.yaml").write_text("sample_rate: 16000\n")
    with pytest.raises(SparkError, match="BiCodec/model.safetensors.*LLM/config.json"):
        SparkTTS.load(tmp_path)
