"""Strict loading of the released layout: the oracle's micro files load with every key consumed; a missing,
extra or mis-shaped key, a missing file or a foreign yaml is refused with an error naming the file and key."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from cosyvoice3.config import CosyVoice3Config, read_release_yaml
from cosyvoice3.errors import CosyVoice3ConfigError, CosyVoice3ModelError
from cosyvoice3.layout import FLOW_FILE, HIFT_FILE, LLM_FILE, MODEL_YAML
from cosyvoice3.loading import load, load_config, load_flow, load_hift, load_llm
from tests.cosyvoice3.conftest import harness, needs_parity_data

pytestmark = needs_parity_data


def test_config_follows_the_release_yaml(micro_config: CosyVoice3Config) -> None:
    args = harness()
    est, hift = args["flow"]["estimator"], args["hift"]
    dit = micro_config.flow.dit
    assert (dit.dim, dit.depth, dit.heads, dit.dim_head) == (est["dim"], est["depth"], est["heads"], est["dim_head"])
    assert dit.static_chunk_size == est["static_chunk_size"]  # `!ref <chunk_size> * <token_mel_ratio>` resolved
    assert micro_config.flow.pre_lookahead_channels == args["flow"]["pre_lookahead_layer"]["channels"]
    assert micro_config.hift.base_channels == hift["base_channels"]
    assert micro_config.hift.conv_pre_look_right == hift["conv_pre_look_right"]
    assert micro_config.llm.qwen.hidden_size == args["llm"]["qwen"]["hidden_size"]
    assert micro_config.llm.sampling.top_k == args["llm"]["sampling"]["top_k"]
    assert micro_config.llm.num_speech_classes == micro_config.llm.speech_token_size + 200


def test_every_tensor_is_consumed(micro_model_dir: Path, micro_config: CosyVoice3Config) -> None:
    llm = load_llm(micro_model_dir / LLM_FILE, micro_config)
    flow = load_flow(micro_model_dir / FLOW_FILE, micro_config)
    hift = load_hift(micro_model_dir / HIFT_FILE, micro_config)
    for module, name in ((llm, LLM_FILE), (flow, FLOW_FILE)):
        file = torch.load(micro_model_dir / name, weights_only=True)
        ours = module.state_dict()
        assert set(ours) == set(file)
        assert all(torch.equal(ours[k], file[k]) for k in file)
    assert llm.llm.model.lm_head.weight is llm.body.embed_tokens.weight
    assert hift.stft_window.shape == (micro_config.hift.istft_n_fft,)


def _broken_copy(src: Path, dst: Path, name: str, edit) -> Path:
    shutil.copytree(src, dst)
    state = torch.load(dst / name, weights_only=True)
    edit(state)
    torch.save(state, dst / name)
    return dst


@pytest.mark.parametrize("name,edit,expected", [
    (FLOW_FILE, lambda s: s.pop("decoder.estimator.proj_out.bias"), "missing keys (1): decoder.estimator.proj_out.bias"),
    (LLM_FILE, lambda s: s.__setitem__("llm_decoder.bias", torch.zeros(6761)), "unexpected keys (1): llm_decoder.bias"),
    (HIFT_FILE, lambda s: s.__setitem__("conv_pre.bias", torch.zeros(3)), "wrong shapes (1): conv_pre.bias"),
])
def test_mismatches_name_file_and_key(micro_model_dir: Path, tmp_path: Path, name: str, edit, expected: str) -> None:
    broken = _broken_copy(micro_model_dir, tmp_path / "broken", name, edit)
    config = load_config(broken, endofprompt_id=harness()["micro_text"]["endofprompt_row"])
    with pytest.raises(CosyVoice3ModelError) as info:
        load(broken, config=config)
    assert str(broken / name) in str(info.value) and expected in str(info.value)


def test_missing_file_is_named(micro_model_dir: Path, tmp_path: Path) -> None:
    shutil.copytree(micro_model_dir, tmp_path / "d")
    (tmp_path / "d" / HIFT_FILE).unlink()
    with pytest.raises(CosyVoice3ModelError, match=HIFT_FILE):
        load(tmp_path / "d")


def test_a_foreign_yaml_is_refused(micro_model_dir: Path) -> None:
    text = (micro_model_dir / MODEL_YAML).read_text().replace("CausalMaskedDiffWithDiT", "CausalMaskedDiffWithXvec")
    with pytest.raises(CosyVoice3ConfigError, match="CausalMaskedDiffWithXvec"):
        CosyVoice3Config.from_yaml(read_release_yaml(text), harness()["llm"]["qwen"])


def test_ref_expressions_resolve() -> None:
    data = read_release_yaml("a: 25\nb: 2\nc: !ref <a> * <b>\nd: !ref <a>\ne: !new:x.Y\n  k: !ref <c>\n")
    assert (data["c"], data["d"], data["e"]) == (50, 25, {"__class__": "x.Y", "k": 50})
    paths = read_release_yaml("root: /m\nf: !ref <root>/BlankEN\nitems: [!ref <root>, 2]\n")
    assert (paths["f"], paths["items"]) == ("/m/BlankEN", ["/m", 2])
    with pytest.raises(CosyVoice3ConfigError):
        read_release_yaml("a: !ref <missing>\n")
