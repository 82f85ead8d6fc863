"""The HF Qwen2ForCausalLM conversion of llm.pt, checked against the upstream reference dump and our own engine."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer, LogitsProcessor, LogitsProcessorList, Qwen2ForCausalLM

from cosyvoice_build.hf_llm import ConversionError, convert_llm_to_hf, load_logits_bias
from cosyvoice_build.vocab_layout import LAYOUT_FILE, SpeechVocabLayout
from tests.build.conftest import MICRO_BASE_VOCAB, MICRO_DIR, PARITY_DIR, requires_parity

pytestmark = requires_parity
LOGP_TOLERANCE = 5e-5  # parity/README.md, llm_logp_full


@pytest.fixture(scope="module")
def dump() -> dict[str, np.ndarray]:
    with np.load(PARITY_DIR / "micro_dump_seed1234.npz") as arrays:
        return {k: arrays[k] for k in arrays.files if k.startswith(("llm_", "in_"))}


@pytest.fixture(scope="module")
def layout(micro_hf_dir: Path) -> SpeechVocabLayout:
    return SpeechVocabLayout.load(micro_hf_dir)


@pytest.fixture(scope="module")
def hf_model(micro_hf_dir: Path) -> Qwen2ForCausalLM:
    return Qwen2ForCausalLM.from_pretrained(str(micro_hf_dir), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def bias(micro_hf_dir: Path) -> torch.Tensor:
    return load_logits_bias(micro_hf_dir)


def teacher_forced_ids(dump: dict[str, np.ndarray], layout: SpeechVocabLayout) -> torch.Tensor:
    """[sos, prompt text, text, task_id, prompt speech, teacher speech] as ids of the extended vocabulary."""
    speech = np.concatenate([dump["in_prompt_speech_token"][0], dump["in_teacher_speech_token"][0]])
    ids = [layout.sos_id, *dump["in_prompt_text"][0], *dump["in_text"][0], layout.task_id_id]
    ids += [layout.to_vocab_id(int(k)) for k in speech]
    return torch.tensor([ids], dtype=torch.long)


def speech_log_probs(logits: torch.Tensor, bias: torch.Tensor, layout: SpeechVocabLayout) -> torch.Tensor:
    """log_softmax over the WHOLE extended vocabulary (bias added), then the 6564 speech/end columns."""
    full = torch.log_softmax(logits.float() + bias, dim=-1)
    return full[..., layout.speech_offset : layout.speech_offset + layout.num_speech_classes]


def test_released_vocabulary_layout_matches_upstream_ids() -> None:
    layout = SpeechVocabLayout(text_vocab_size=151663)
    assert layout.to_vocab_id(0) == 151663 and layout.to_vocab_id(6560) == 158223
    assert layout.end_ids == (158224, 158225, 158226)
    assert (layout.sos_id, layout.task_id_id, layout.vocab_size, layout.padded_vocab_size) == (158227, 158228, 158229, 158336)
    assert layout.to_speech_token(158223) == 6560
    with pytest.raises(ValueError):
        layout.to_speech_token(158224)  # an end id is not a speech token


def test_micro_text_vocabulary_ends_where_speech_starts(layout: SpeechVocabLayout) -> None:
    assert layout.speech_offset == 512  # every micro text id (< 512) stays a text row


@torch.inference_mode()
def test_input_embeddings_equal_the_reference_assembly(hf_model, dump, layout) -> None:
    prefix = teacher_forced_ids(dump, layout)[:, : dump["llm_lm_input"].shape[1]]
    embeds = hf_model.get_input_embeddings()(prefix)
    assert float((embeds - torch.from_numpy(dump["llm_lm_input"])).abs().max()) == 0.0


@torch.inference_mode()
def test_speech_log_probs_match_the_reference(hf_model, bias, dump, layout) -> None:
    logits = hf_model(input_ids=teacher_forced_ids(dump, layout)).logits[0]
    ours = speech_log_probs(logits, bias, layout)
    assert ours.shape == dump["llm_logp_full"].shape
    assert float((ours - torch.from_numpy(dump["llm_logp_full"])).abs().max()) <= LOGP_TOLERANCE


@torch.inference_mode()
def test_kv_cached_decoding_matches_the_reference_steps(hf_model, bias, dump, layout) -> None:
    ids = teacher_forced_ids(dump, layout)
    prefix_len = dump["llm_lm_input"].shape[1]
    out = hf_model(input_ids=ids[:, :prefix_len], use_cache=True)
    rows = [speech_log_probs(out.logits[0, -1], bias, layout)]
    for position in range(prefix_len, ids.shape[1]):
        out = hf_model(input_ids=ids[:, position : position + 1], past_key_values=out.past_key_values, use_cache=True)
        rows.append(speech_log_probs(out.logits[0, -1], bias, layout))
    assert float((torch.stack(rows) - torch.from_numpy(dump["llm_logp_step"])).abs().max()) <= LOGP_TOLERANCE


@torch.inference_mode()
def test_speech_log_probs_match_our_engine(hf_model, bias, dump, layout) -> None:
    from cosyvoice2.llm import CosyVoice2LM, CosyVoice2Prefix, LLMConfig

    harness = json.loads((MICRO_DIR / "harness_config.json").read_text())
    engine = CosyVoice2LM(LLMConfig.from_harness(harness["llm"]))
    engine.load_state_dict(torch.load(MICRO_DIR / "llm.pt", weights_only=True), strict=True)
    engine.eval()
    teacher = torch.as_tensor(dump["in_teacher_speech_token"][0], dtype=torch.long)
    prefix = engine.embed_prefix(CosyVoice2Prefix.of(dump["in_text"][0].tolist(), dump["in_prompt_text"][0].tolist(),
                                                     dump["in_prompt_speech_token"][0].tolist()))
    expected = engine(torch.cat([prefix, engine.embed_speech(teacher)[None]], dim=1))[0]
    ours = speech_log_probs(hf_model(input_ids=teacher_forced_ids(dump, layout)).logits[0], bias, layout)
    assert float((ours - expected).abs().max()) <= LOGP_TOLERANCE


class AddLogitsBias(LogitsProcessor):
    """What a runtime does with logits_bias.safetensors (TensorRT-LLM: the per-request embedding_bias)."""

    def __init__(self, bias: torch.Tensor) -> None:
        self.bias = bias

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        return scores + self.bias


@torch.inference_mode()
def test_text_ids_can_never_be_sampled(hf_model, bias, dump, layout) -> None:
    logits = hf_model(input_ids=teacher_forced_ids(dump, layout)).logits[0]
    speech = slice(layout.speech_offset, layout.speech_offset + layout.num_speech_classes)
    # The head alone does not mask (text rows are zero, logit 0): that is why the bias must be applied.
    unmasked = torch.softmax(logits, dim=-1)
    assert float(unmasked[:, : layout.speech_offset].sum(-1).min()) > 0.01
    masked = torch.softmax(logits + bias, dim=-1)
    assert float(masked[:, : layout.speech_offset].max()) == 0.0
    assert float(masked[:, layout.sos_id :].max()) == 0.0  # sos/task_id/padding rows neither
    assert torch.allclose(masked[:, speech].sum(-1), torch.ones(logits.shape[0]))

    torch.manual_seed(0)
    prompt = teacher_forced_ids(dump, layout)[:, : dump["llm_lm_input"].shape[1]]
    generated = hf_model.generate(
        prompt, do_sample=True, top_k=0, top_p=1.0, max_new_tokens=40, min_new_tokens=40, num_return_sequences=8,
        logits_processor=LogitsProcessorList([AddLogitsBias(bias)]), pad_token_id=layout.end_ids[0],
        eos_token_id=None,
    )[:, prompt.shape[1] :]  # fmt: skip
    assert bool(((generated >= speech.start) & (generated < speech.stop)).all())


def test_tokenizer_knows_speech_and_marker_tokens(micro_hf_dir: Path, layout: SpeechVocabLayout) -> None:
    tokenizer = AutoTokenizer.from_pretrained(str(micro_hf_dir))
    assert len(tokenizer) == layout.vocab_size
    ids = tokenizer.convert_tokens_to_ids(["<|s_0|>", "<|s_6560|>", "<|eos1|>", "<|eos2|>", "<|eos3|>", "<|sos|>", "<|task_id|>"])
    assert ids == [layout.speech_offset, layout.speech_offset + 6560, *layout.end_ids, layout.sos_id, layout.task_id_id]
    # CosyVoice2's own specials keep their places right below the speech tokens ([mn] = 151662 when released).
    assert tokenizer.convert_tokens_to_ids("<|endofprompt|>") == MICRO_BASE_VOCAB + 3
    assert tokenizer.convert_tokens_to_ids("[mn]") == layout.speech_offset - 1
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Hello world"}], tokenize=False)
    assert prompt == "<|sos|>Hello world<|task_id|>"


def test_config_is_portable_to_older_transformers(micro_hf_dir: Path, micro_model_dir: Path, layout) -> None:
    config = json.loads((micro_hf_dir / "config.json").read_text())
    blank_en = json.loads((micro_model_dir / "CosyVoice-BlankEN" / "config.json").read_text())
    assert config["rope_theta"] == blank_en["rope_theta"]  # transformers 4 (TRT-LLM image) reads this key
    assert config["vocab_size"] == layout.padded_vocab_size and config["tie_word_embeddings"] is False
    tokenizer_config = json.loads((micro_hf_dir / "tokenizer_config.json").read_text())
    assert "[mn]" in tokenizer_config["additional_special_tokens"]
    assert not isinstance(tokenizer_config.get("extra_special_tokens"), list)
    generation = json.loads((micro_hf_dir / "generation_config.json").read_text())
    assert generation["eos_token_id"] == list(layout.end_ids)  # all three end ids stop
    assert json.loads((micro_hf_dir / LAYOUT_FILE).read_text())["speech_offset"] == layout.speech_offset


def _broken_copy(micro_model_dir: Path, tmp_path: Path) -> Path:
    target = tmp_path / "model"
    shutil.copytree(micro_model_dir, target)
    return target


def test_missing_state_dict_key_is_named(micro_model_dir: Path, tmp_path: Path) -> None:
    model = _broken_copy(micro_model_dir, tmp_path)
    state = torch.load(model / "llm.pt", weights_only=True)
    del state["llm_decoder.bias"]
    torch.save(state, model / "llm.pt")
    with pytest.raises(ConversionError, match="llm_decoder.bias"):
        convert_llm_to_hf(model, tmp_path / "out")


def test_truncated_checkpoint_is_reported(micro_model_dir: Path, tmp_path: Path) -> None:
    model = _broken_copy(micro_model_dir, tmp_path)
    (model / "llm.pt").write_bytes((model / "llm.pt").read_bytes()[:1000])
    with pytest.raises(ConversionError, match="not a readable torch state dict"):
        convert_llm_to_hf(model, tmp_path / "out")


def test_malformed_config_is_reported(micro_model_dir: Path, tmp_path: Path) -> None:
    model = _broken_copy(micro_model_dir, tmp_path)
    (model / "CosyVoice-BlankEN" / "config.json").write_text("{not json")
    with pytest.raises(ConversionError, match="config.json is not valid JSON"):
        convert_llm_to_hf(model, tmp_path / "out")


def test_tokenizer_larger_than_the_embedding_is_refused(micro_model_dir: Path, tmp_path: Path) -> None:
    from speech_lm.testing import write_test_tokenizer

    model = _broken_copy(micro_model_dir, tmp_path)
    write_test_tokenizer(model / "CosyVoice-BlankEN", base_vocab_size=MICRO_BASE_VOCAB + 10)
    with pytest.raises(ConversionError, match="embed_tokens has 512 rows"):
        convert_llm_to_hf(model, tmp_path / "out")


@torch.inference_mode()
def test_tiny_model_of_the_engine_converts_consistently(tmp_path: Path) -> None:
    """The engine's own tiny-model writer (official layout) -> HF -> same speech log-probs as the engine."""
    from cosyvoice2.llm import CosyVoice2LM, CosyVoice2Prefix, LLMConfig
    from speech_lm.config import Qwen2Config
    from cosyvoice2.testing import write_tiny_model

    model_dir = write_tiny_model(tmp_path / "tiny")
    out = tmp_path / "hf"
    layout = convert_llm_to_hf(model_dir, out)
    blank_en = json.loads((model_dir / "CosyVoice-BlankEN" / "config.json").read_text())
    state = torch.load(model_dir / "llm.pt", weights_only=True)
    config = LLMConfig(qwen=Qwen2Config.from_dict(blank_en), speech_token_size=state["speech_embedding.weight"].shape[0] - 3)
    engine = CosyVoice2LM(config)
    engine.load_state_dict(state, strict=True)
    engine.eval()
    text, speech = [5, 17, 42, 99], [0, 7, 6560, 123]
    prefix = engine.embed_prefix(CosyVoice2Prefix.of(text))
    expected = engine(torch.cat([prefix, engine.embed_speech(torch.tensor(speech))[None]], dim=1))[0]
    ids = torch.tensor([[layout.sos_id, *text, layout.task_id_id, *(layout.to_vocab_id(k) for k in speech)]])
    hf = Qwen2ForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    ours = speech_log_probs(hf(input_ids=ids).logits[0], load_logits_bias(out), layout)
    assert float((ours - expected).abs().max()) <= LOGP_TOLERANCE
