"""The HF Qwen2ForCausalLM conversion of a CosyVoice3 release (merged vocabulary, `cosyvoice3.vocab`), checked
against our CosyVoice3 LLM on tiny random checkpoints: transformers' Qwen2 on one side, `CosyVoice3LM` on the
other, the same prompt in both."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, Qwen2ForCausalLM

from cosyvoice3.config import CosyVoice3Config
from cosyvoice3.layout import LLM_FILE
from cosyvoice3.llm import CosyVoice3LM, LLMPrompt
from cosyvoice3.loading import load_llm
from cosyvoice3.testing import write_tiny_model
from cosyvoice3.text import SPECIAL_TOKENS, CosyVoice3Tokenizer
from cosyvoice3.vocab import CosyVoice3VocabLayout
from cosyvoice_build.hf_llm import ConversionError, convert_llm_to_hf, is_cosyvoice3_release, load_logits_bias
from cosyvoice_build.vocab_layout import LAYOUT_FILE, MASKED_LOGIT_BIAS

LOGIT_TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("cosyvoice3_tiny"), seed=3)


@pytest.fixture(scope="module")
def hf_dir(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("cosyvoice3_hf")
    layout = convert_llm_to_hf(model_dir, out)
    assert isinstance(layout, CosyVoice3VocabLayout)
    return out


@pytest.fixture(scope="module")
def layout(hf_dir: Path) -> CosyVoice3VocabLayout:
    return CosyVoice3VocabLayout.load(hf_dir)


@pytest.fixture(scope="module")
def engine(model_dir: Path) -> CosyVoice3LM:
    return load_llm(model_dir / LLM_FILE, CosyVoice3Config.from_model_dir(model_dir))


@pytest.fixture(scope="module")
def hf_model(hf_dir: Path) -> Qwen2ForCausalLM:
    return Qwen2ForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()


def zero_shot(engine: CosyVoice3LM) -> tuple[LLMPrompt, list[int]]:
    """A zero-shot prompt (prompt text with `<|endofprompt|>`, text, prompt speech) and teacher speech tokens that
    reach the top of the speech range."""
    endofprompt = engine.config.endofprompt_id
    prompt = LLMPrompt.build("zero_shot", text=[5, 17, 42, 99], prompt_text=[7, 8, endofprompt, 11],
                             prompt_speech_tokens=[0, 3, 6560, 1234])
    return prompt, [9, 6560, 0, 4000, 17]


def merged_ids(prompt: LLMPrompt, teacher: list[int], layout: CosyVoice3VocabLayout) -> torch.Tensor:
    """[sos, prompt text + text, task, prompt speech, teacher speech] in the merged vocabulary."""
    speech = [layout.to_vocab_id(k) for k in (*prompt.prompt_speech_tokens, *teacher)]
    return torch.tensor([[layout.sos_id, *prompt.prompt_text, *prompt.text, layout.task_id_id, *speech]])


def test_released_vocabulary_layout_is_the_documented_one() -> None:
    layout = CosyVoice3VocabLayout()
    assert (layout.to_vocab_id(0), layout.to_vocab_id(6560)) == (151936, 158496)
    assert (layout.sos_id, layout.task_id_id, layout.end_ids[1], layout.end_ids[3]) == (158497, 158499, 158498, 158500)
    assert (layout.vocab_size, layout.padded_vocab_size) == (158697, 158720)
    assert layout.end_id == layout.sos_id  # the id TensorRT-LLM's minimum length masks, as the reference does
    assert layout.stop_ids == tuple(range(158498, 158697))
    with pytest.raises(ValueError):
        layout.to_speech_token(158497)


def test_a_cosyvoice3_release_is_recognised(model_dir: Path, layout: CosyVoice3VocabLayout) -> None:
    assert is_cosyvoice3_release(model_dir)
    assert layout == CosyVoice3VocabLayout()  # the tiny model keeps the released vocabulary sizes


@torch.inference_mode()
def test_speech_logits_equal_our_engine(hf_model, engine, layout) -> None:
    prompt, teacher = zero_shot(engine)
    embeds = torch.cat([engine.embed_prefix(prompt), engine.embed_speech(torch.tensor(teacher))[None]], dim=1)
    hidden = engine.hidden(embeds)
    expected = engine.llm_decoder(hidden)[0]
    ids = merged_ids(prompt, teacher, layout)
    assert float((hf_model.get_input_embeddings()(ids) - embeds).abs().max()) == 0.0
    logits = hf_model(input_ids=ids).logits[0]
    speech = slice(layout.speech_offset, layout.vocab_size)
    assert logits[:, speech].shape == expected.shape == (ids.shape[1], 6761)
    assert float((logits[:, speech] - expected).abs().max()) <= LOGIT_TOLERANCE
    # with the bias, the softmax over the whole vocabulary is the engine's over its 6761 classes
    bias = load_logits_bias(hf_model.name_or_path)
    full = torch.log_softmax(logits + bias, dim=-1)[:, speech]
    assert float((full - engine.log_probs(hidden)[0]).abs().max()) <= LOGIT_TOLERANCE


@torch.inference_mode()
def test_text_and_padding_rows_are_masked_by_the_bias(hf_model, hf_dir, engine, layout) -> None:
    bias = load_logits_bias(hf_dir)
    assert bias.shape == (layout.padded_vocab_size,)
    assert bool((bias[: layout.speech_offset] == MASKED_LOGIT_BIAS).all())
    assert bool((bias[layout.speech_offset : layout.vocab_size] == 0).all())  # no decoder bias: it only masks
    assert bool((bias[layout.vocab_size :] == MASKED_LOGIT_BIAS).all())
    prompt, teacher = zero_shot(engine)
    logits = hf_model(input_ids=merged_ids(prompt, teacher, layout)).logits[0]
    assert float(torch.softmax(logits, dim=-1)[:, : layout.speech_offset].sum(-1).min()) > 0.01  # zero rows, logit 0
    masked = torch.softmax(logits + bias, dim=-1)
    assert float(masked[:, : layout.speech_offset].max()) == 0.0
    assert float(masked[:, layout.vocab_size :].max()) == 0.0


def test_tokenizer_and_configs_follow_the_merged_layout(hf_dir: Path, model_dir: Path, layout) -> None:
    tokenizer = AutoTokenizer.from_pretrained(str(hf_dir))
    assert len(tokenizer) == layout.vocab_size
    names = ["<|s_0|>", "<|s_6560|>", "<|sos|>", "<|eos|>", "<|task_id|>", "<|fill|>", "<|special_199|>"]
    assert tokenizer.convert_tokens_to_ids(names) == [151936, 158496, 158497, 158498, 158499, 158500, 158696]
    # the text specials keep the ids our tokenizer gives them; the unused text rows below the speech block are
    # placeholders
    text = CosyVoice3Tokenizer.from_model_dir(model_dir)
    for name in ("<|endofprompt|>", "<|endofsystem|>", SPECIAL_TOKENS[-1]):
        assert tokenizer.convert_tokens_to_ids(name) == text.token_id(name)
    assert tokenizer.convert_tokens_to_ids("<|text_pad_151935|>") == 151935
    assert tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False) == "<|sos|>Hi<|task_id|>"
    config = json.loads((hf_dir / "config.json").read_text())
    blank_en = json.loads((model_dir / "CosyVoice-BlankEN" / "config.json").read_text())
    assert config["vocab_size"] == 158720 and config["tie_word_embeddings"] is False
    assert config["rope_theta"] == blank_en["rope_theta"] and config["eos_token_id"] == layout.sos_id
    generation = json.loads((hf_dir / "generation_config.json").read_text())
    assert generation["eos_token_id"] == list(range(158497, 158697))  # every special id stops
    assert (generation["top_k"], generation["top_p"]) == (25, 0.8)
    recorded = json.loads((hf_dir / LAYOUT_FILE).read_text())
    assert (recorded["sos_id"], recorded["task_id_id"], recorded["num_special_tokens"]) == (158497, 158499, 200)


def test_a_cosyvoice3_checkpoint_without_its_speech_table_is_named(model_dir: Path, tmp_path: Path) -> None:
    broken = tmp_path / "model"
    shutil.copytree(model_dir, broken)
    state = torch.load(broken / LLM_FILE, weights_only=True)
    del state["speech_embedding.weight"]
    torch.save(state, broken / LLM_FILE)
    with pytest.raises(ConversionError, match=r"speech_embedding.weight.*CosyVoice3's llm.pt"):
        convert_llm_to_hf(broken, tmp_path / "out")


def test_the_engine_builder_converts_then_prints_the_engine_commands(model_dir: Path, tmp_path: Path, capsys) -> None:
    from cosyvoice_build import cosyvoice3_trtllm

    argv = ["--cosyvoice3-dir", str(model_dir), "--work-dir", str(tmp_path), "--max-batch-size", "8"]
    assert cosyvoice3_trtllm.main([*argv, "--print"]) == 0
    hf_dir = tmp_path / cosyvoice3_trtllm.HF_DIRNAME
    assert CosyVoice3VocabLayout.load(hf_dir) == CosyVoice3VocabLayout()
    convert, build = capsys.readouterr().out.strip().splitlines()
    assert "cosyvoice_build.trtllm_convert" in convert and f"--model_dir {hf_dir}" in convert
    assert build.startswith("trtllm-build") and "--logits_dtype float32" in build and "--max_batch_size 8" in build
    # a directory that is not a complete CosyVoice3 release is named before anything is converted
    assert cosyvoice3_trtllm.main(["--cosyvoice3-dir", str(tmp_path / "absent"), "--work-dir", str(tmp_path)]) == 1
    assert "does not exist" in capsys.readouterr().err
